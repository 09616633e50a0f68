"""Row reductions over the last axis: ``reduce_sum``, ``reduce_mean``, ``reduce_max``.

Forward: one CuTe kernel (fp32 accumulation, result in the input dtype, as ``jnp.sum`` gives).
Backward: sum and mean broadcast the cotangent; max routes it to the positions equal to the max,
split evenly between ties -- the same rule as ``jax.grad(jnp.max)``. These are single elementwise
passes that XLA fuses into their consumer, so they need no kernel of their own.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cutelayers.kernels.reduction_config import RowConfig, row_config, row_config_space
from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import RowKernelFamily, call_on_rows, check_float_array, normalize_axis


@dataclasses.dataclass(frozen=True)
class RowReduce(RowKernelFamily):
    """Kernel family: out[r] = reduce(x[r, :]) for ``kind`` in sum / mean / max.

    ``config``: the kernel's RowConfig, chosen by the op for its operands. The row-reduce kernel
    always streams its rows, so it has its own heuristic and config space.
    """

    kind: str
    config: RowConfig | None = None
    arg_names = ("x",)

    @property
    def name(self) -> str:
        return f"reduce_{self.kind}"

    def out_avals(self, avals):
        (x,) = avals
        return (jax.ShapeDtypeStruct(x.shape[:1], x.dtype),)

    def reference(self, x):
        return (reference(self.kind, x),)

    def default_config(self, avals):
        return row_config(self.row_length(avals), self.elem_bits(avals))

    def config_space(self, avals) -> tuple:
        return row_config_space(self.row_length(avals), self.elem_bits(avals))

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.reduction import RowReduceKernel

        n = self.row_length(avals)
        op = "max" if self.kind == "max" else "sum"
        scale = 1.0 / n if self.kind == "mean" else 1.0
        return RowReduceKernel(n, op, scale, self.elem_bits(avals), self.chosen_config())


def reference(kind: str, x: jax.Array) -> jax.Array:
    """The jnp reduction over the last axis, accumulating in fp32."""
    if kind == "max":
        return jnp.max(x, axis=-1)
    acc = jnp.sum(x, axis=-1, dtype=jnp.float32)
    if kind == "mean":
        acc = acc / x.shape[-1]
    return acc.astype(x.dtype)


@functools.cache
def _reduce_fn(kind: str):
    family = RowReduce(kind)
    forward = fold_batch(lambda x: call_on_rows(family, x)[0])

    @jax.custom_vjp
    def reduce(x):
        return forward(x)

    def fwd(x):
        y = forward(x)
        # sum/mean need only x's shape and dtype: keep a zero-size stand-in, not x itself.
        return y, (x if kind == "max" else jnp.zeros((0, x.shape[-1]), x.dtype), y)

    def bwd(res, g):
        x_or_shape, y = res
        n, dtype = x_or_shape.shape[-1], x_or_shape.dtype
        g = g.astype(jnp.float32)[..., None]
        if kind == "max":
            hit = x_or_shape == y[..., None]
            count = jnp.sum(hit, axis=-1, keepdims=True, dtype=jnp.float32)
            # no position equals a NaN max: that row's gradient is NaN, as jax.grad(jnp.max) gives it
            dx = jnp.where(count == 0, jnp.nan, jnp.where(hit, g / count, 0.0))
        else:
            dx = jnp.broadcast_to(g / n if kind == "mean" else g, (*y.shape, n))
        return (dx.astype(dtype),)

    reduce.defvjp(fwd, bwd)
    return reduce


def _reduce(kind: str, x, axis):
    op = f"reduce_{kind}"
    x = check_float_array(op, "x", x, min_rank=0)  # the reduced axis is checked below, not the last
    if x.ndim == 0:
        raise ValueError(f"{op}: argument 'x' has rank 0 (shape ()); it needs an axis to reduce")
    axis = normalize_axis(op, axis, x.ndim)
    if x.shape[axis] == 0:
        raise ValueError(f"{op}: argument 'x' has an empty axis {axis} to reduce (shape {tuple(x.shape)})")
    if axis != x.ndim - 1:
        x = jnp.moveaxis(x, axis, -1)  # the kernel reduces the last axis; this costs a transpose
    return _reduce_fn(kind)(x)


def reduce_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over ``axis`` (default: the last).

    Args:
      x: array of shape (..., N), N >= 1, dtype bfloat16, float16 or float32.
      axis: the axis to reduce; other than the last costs a transpose first.

    Returns:
      x's shape without ``axis``, in x's dtype (accumulated in float32).
    """
    return _reduce("sum", x, axis)


def reduce_mean(x: jax.Array, axis: int = -1) -> jax.Array:
    """Mean over ``axis``; same shapes and dtypes as :func:`reduce_sum`."""
    return _reduce("mean", x, axis)


def reduce_max(x: jax.Array, axis: int = -1) -> jax.Array:
    """Maximum over ``axis`` (NaN propagates); same shapes and dtypes as :func:`reduce_sum`.

    The gradient goes to the positions equal to the maximum, split evenly between ties, as
    ``jax.grad(jnp.max)`` does.
    """
    return _reduce("max", x, axis)
