"""Masked mean pooling over a sequence axis: ``masked_mean_pool(x, mask)``.

    y[..., d] = sum_s w[..., s] x[..., s, d],    w = keep / max(count(keep), 1)

(the positions the mask drops are left out of the sum, not weighted by 0: a NaN there stays out).

A jnp implementation: XLA fuses the weighting and the reduction into one pass over x (a
dedicated kernel may come later); plain jnp, so jax.vmap needs no rule of its own. The custom_vjp
saves only the (..., S) weights -- never x -- and its backward is one broadcast,
``dx = w[..., :, None] * dy[..., None, :]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cutelayers.ops._rowwise import check_float_array

F32 = jnp.float32


def _weights(mask):
    """(..., S) float32: 1 / count at kept positions, 0 elsewhere (and everywhere if none kept)."""
    keep = jnp.asarray(mask).astype(bool).astype(F32)  # nonzero is kept (not `!= 0`: bool masks under 'strict')
    return keep / jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1.0)


def _pool_fwd(x, mask):
    w = _weights(mask)
    # a select, not only the product: a NaN or inf at a position the mask drops must not reach
    # the mean (0 * inf is NaN)
    weighted = jnp.where(w[..., None] != 0, x.astype(F32) * w[..., None], 0.0)
    return jnp.sum(weighted, axis=-2).astype(x.dtype), w


@jax.custom_vjp
def _pool(x, mask):
    return _pool_fwd(x, mask)[0]


def _pool_bwd(w, dy):
    # dy has y's dtype, which is x's
    return (w[..., :, None] * dy.astype(F32)[..., None, :]).astype(dy.dtype), None


_pool.defvjp(_pool_fwd, _pool_bwd)


def masked_mean_pool(x, mask) -> jax.Array:
    """Mean of ``x`` over the positions its ``mask`` keeps, along the sequence axis.

    Args:
      x: (..., S, D), bfloat16, float16 or float32.
      mask: (..., S) bool, or numbers where nonzero means keep (e.g. a 0/1 attention mask).

    Returns:
      (..., D) in x's dtype, accumulated in float32. A row whose mask keeps nothing gives 0 (and
      zero gradient). The mask gets no gradient.
    """
    op = "masked_mean_pool"
    x = check_float_array(op, "x", x, min_rank=2)
    if not hasattr(mask, "shape") or not hasattr(mask, "dtype"):
        raise TypeError(f"{op}: argument 'mask' must be an array; got {type(mask).__name__}")
    if not (mask.dtype == bool or jnp.issubdtype(mask.dtype, jnp.number)):
        raise TypeError(f"{op}: argument 'mask' must be bool or numeric; got dtype {mask.dtype}")
    if tuple(mask.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"{op}: argument 'mask' has shape {tuple(mask.shape)}; expected "
                         f"{tuple(x.shape[:-1])} (x's shape without the feature axis)")
    return _pool(x, jnp.asarray(mask))
