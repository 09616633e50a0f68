"""Differentiable, vmappable cutelayers ops (custom_vjp, and vmap folded into rows, over CuTe kernels)."""

from cutelayers.ops.embed import embed
from cutelayers.ops.linear import fused_linear
from cutelayers.ops.lm_head import linear_cross_entropy
from cutelayers.ops.mlp import mlp
from cutelayers.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from cutelayers.ops.pool import masked_mean_pool
from cutelayers.ops.reduce import reduce_max, reduce_mean, reduce_sum
from cutelayers.ops.softmax import log_softmax, logsumexp, softmax, softmax_cross_entropy
from cutelayers.ops.split_linear import split_linear

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "embed",
    "fused_linear",
    "layer_norm",
    "linear_cross_entropy",
    "log_softmax",
    "logsumexp",
    "masked_mean_pool",
    "mlp",
    "reduce_max",
    "reduce_mean",
    "reduce_sum",
    "rms_norm",
    "softmax",
    "softmax_cross_entropy",
    "split_linear",
]
