"""Flax NNX ``LayerNorm`` and ``RMSNorm`` backed by the cutelayers kernels.

Drop-in replacements for ``flax.nnx.LayerNorm`` / ``flax.nnx.RMSNorm``: the same constructor
(``num_features``, keyword-only options, ``rngs``), the same ``nnx.Param`` attributes ``scale`` /
``bias`` (shape (num_features,), ``param_dtype``, the same initializers and metadata), and the
same dtype rule: input and parameters are promoted with ``promote_dtype`` (to ``dtype`` if given)
and the result has that dtype.

The promotion is applied to the parameters and to a zero-size stand-in of the input: widening
the input is exact, so it is skipped (the kernel reads the input in its own dtype and computes in
float32) -- only a narrowing ``dtype`` casts the input first, as NNX does.

Differences: the same as :mod:`cutelayers.flax.linen` (two-pass float32 statistics; last-axis
only; no ``axis_name`` / ``axis_index_groups`` / ``mask``).
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from cutelayers.flax._common import check_supported
from cutelayers.ops.norm import layer_norm, rms_norm

Axes = tp.Any
Dtype = tp.Any
Initializer = tp.Any


def _promote(promote_dtype, x, params, dtype):
    """(x, params, result dtype) after NNX's promotion rule, without widening x in memory."""
    stand_in, *params = promote_dtype((jnp.zeros((0,), x.dtype), *params), dtype=dtype)
    out_dtype = jnp.dtype(stand_in.dtype)
    if jnp.promote_types(x.dtype, out_dtype) != out_dtype:
        x = x.astype(out_dtype)  # a narrowing dtype: NNX normalizes the cast input
    return x, params, out_dtype


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis; see ``flax.nnx.LayerNorm`` for the arguments.

    Input (..., num_features) in bfloat16, float16 or float32; output the same shape in the
    promoted dtype.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Initializer = initializers.zeros_init(),
        scale_init: Initializer = initializers.ones_init(),
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: tp.Any = None,
        use_fast_variance: bool = True,
        promote_dtype: tp.Callable = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    ):
        feature_shape = (num_features,)
        self.scale: nnx.Param | None
        if use_scale:
            self.scale = nnx.Param(scale_init(rngs.params(), feature_shape, param_dtype), **scale_metadata)
        else:
            self.scale = nnx.data(None)
        self.bias: nnx.Param | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), feature_shape, param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_bias = use_bias
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalize ``x`` (..., num_features); returns the same shape."""
        check_supported("LayerNorm", x, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
                        axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, (scale, bias), out_dtype = _promote(self.promote_dtype, x, (scale, bias), self.dtype)
        return layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=out_dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; see ``flax.nnx.RMSNorm`` for the arguments.

    Input (..., num_features) in bfloat16, float16 or float32; output the same shape in the
    promoted dtype.
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        use_scale: bool = True,
        scale_init: Initializer = initializers.ones,
        reduction_axes: Axes = -1,
        feature_axes: Axes = -1,
        axis_name: str | None = None,
        axis_index_groups: tp.Any = None,
        use_fast_variance: bool = True,
        promote_dtype: tp.Callable = dtypes.promote_dtype,
        rngs: nnx.Rngs,
        scale_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    ):
        self.scale: nnx.Param | None
        if use_scale:
            self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype), **scale_metadata)
        else:
            self.scale = nnx.data(None)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.use_scale = use_scale
        self.reduction_axes = reduction_axes
        self.feature_axes = feature_axes
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups
        self.use_fast_variance = use_fast_variance
        self.promote_dtype = promote_dtype

    def __call__(self, x, mask: jax.Array | None = None):
        """Normalize ``x`` (..., num_features); returns the same shape."""
        check_supported("RMSNorm", x, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
                        axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, mask=mask)
        scale = self.scale[...] if self.scale is not None else None
        x, (scale,), out_dtype = _promote(self.promote_dtype, x, (scale,), self.dtype)
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=out_dtype)
