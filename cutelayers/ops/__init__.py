"""Differentiable, vmappable cutelayers ops (custom_vjp + custom_vmap over CuTe kernels)."""

from cutelayers.ops.reduce import reduce_max, reduce_mean, reduce_sum

__all__ = ["reduce_max", "reduce_mean", "reduce_sum"]
