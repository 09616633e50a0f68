"""Equinox ``LayerNorm`` and ``RMSNorm`` backed by the cutelayers kernels.

Drop-in replacements for ``equinox.nn.LayerNorm`` / ``equinox.nn.RMSNorm``: the same fields
(``shape``, ``eps``, ``use_weight``, ``use_bias``; arrays ``weight`` / ``bias`` of ``shape``), the
same constructor defaults (``eps=1e-5``; both weight and bias on, also for RMSNorm), the same
unbatched call ``layer(x, state=..., *, key=None)`` with ``x.shape == shape``, returning ``out``
or ``(out, state)``, and the same dtypes: computed in float32, returned in x's dtype.

The statistics span the whole ``shape`` (flattened to one row). Call them under ``jax.vmap`` as
usual: the op's batching rule folds the vmapped axes into rows, so a batch is one kernel launch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from cutelayers.ops.norm import layer_norm, rms_norm

_NO_STATE = object()  # "no state passed": then only the output is returned


def _shape(shape) -> tuple[int, ...]:
    return (shape,) if isinstance(shape, int) else tuple(shape)


def _check_shape(module: str, shape, x) -> None:
    if x.shape != shape:
        raise ValueError(
            f"`{module}(shape)(x)` needs x.shape == shape; got shape={shape} and x.shape={x.shape}. "
            f"For a batch, use jax.vmap({module.lower()})(x)."
        )


def _apply(op, module, x, state):
    _check_shape(type(module).__name__, module.shape, x)
    size = x.size
    weight = module.weight.reshape(size) if module.use_weight else None
    bias = module.bias.reshape(size) if module.use_bias else None
    out = op(x.reshape(size), weight, bias, epsilon=module.eps, dtype=x.dtype).reshape(x.shape)
    return out if state is _NO_STATE else (out, state)


class LayerNorm(eqx.Module):
    """LayerNorm over the whole input array; see ``equinox.nn.LayerNorm``.

    ``weight`` / ``bias``: arrays of ``shape`` (dtype ``dtype``, default float32) or None.
    """

    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    use_weight: bool = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    weight: Array | None
    bias: Array | None

    def __init__(self, shape: int | Sequence[int], eps: float = 1e-5, use_weight: bool = True,
                 use_bias: bool = True, dtype=None, *, elementwise_affine: bool | None = None):
        shape = _shape(shape)
        if elementwise_affine is not None:
            use_weight = use_bias = elementwise_affine
            warnings.warn("LayerNorm(elementwise_affine=...) is deprecated in favour of "
                          "LayerNorm(use_weight=...) and LayerNorm(use_bias=...)")
        self.shape, self.eps, self.use_weight, self.use_bias = shape, eps, use_weight, use_bias
        self.weight = jnp.ones(shape, dtype=dtype) if use_weight else None
        self.bias = jnp.zeros(shape, dtype=dtype) if use_bias else None

    def __call__(self, x: Array, state=_NO_STATE, *, key=None):
        """``x`` of ``shape`` -> normalized array of ``shape`` in x's dtype (and ``state``,
        unchanged, if one was passed)."""
        return _apply(layer_norm, self, x, state)


class RMSNorm(eqx.Module):
    """RMSNorm over the whole input array, with optional weight and bias; see
    ``equinox.nn.RMSNorm``.

    ``weight`` / ``bias``: arrays of ``shape`` (dtype ``dtype``, default JAX's default float) or
    None.
    """

    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    use_weight: bool = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    weight: Array | None
    bias: Array | None

    def __init__(self, shape: int | Sequence[int], eps: float = 1e-5, use_weight: bool = True,
                 use_bias: bool = True, dtype=None):
        dtype = jax.dtypes.canonicalize_dtype(jnp.float64) if dtype is None else dtype
        shape = _shape(shape)
        self.shape, self.eps, self.use_weight, self.use_bias = shape, eps, use_weight, use_bias
        self.weight = jnp.ones(shape, dtype=dtype) if use_weight else None
        self.bias = jnp.zeros(shape, dtype=dtype) if use_bias else None

    def __call__(self, x: Array, state=_NO_STATE, *, key=None):
        """``x`` of ``shape`` -> normalized array of ``shape`` in x's dtype (and ``state``,
        unchanged, if one was passed)."""
        return _apply(rms_norm, self, x, state)
