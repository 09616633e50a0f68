"""Flax linen ``LayerNorm`` and ``RMSNorm`` backed by the cutelayers kernels.

Drop-in replacements for ``flax.linen.LayerNorm`` / ``flax.linen.RMSNorm``: same attributes and
defaults, same parameters (``scale``, ``bias``: shape (features,), ``param_dtype``, the same
initializers) and the same result dtype -- ``dtype`` if given, else the promoted dtype of the input
and the parameters (``flax.linen.dtypes.canonicalize_dtype``); a bf16 input with the default
float32 parameters therefore gives float32, as in Flax.

Differences: statistics always use the stable two-pass variance in float32, so
``use_fast_variance`` and ``force_float32_reductions=False`` change nothing (results agree with
Flax to float32 rounding); ``reduction_axes`` / ``feature_axes`` other than the last axis,
``axis_name``, ``axis_index_groups`` and ``mask`` raise ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import dtypes, initializers
from flax.linen.module import Module, compact

from cutelayers.flax._common import check_supported
from cutelayers.ops.norm import layer_norm, rms_norm

Axes = Any
Dtype = Any
Initializer = Any


class LayerNorm(Module):
    """LayerNorm over the last axis; see ``flax.linen.LayerNorm`` for the attributes.

    Input (..., features) in bfloat16, float16 or float32; output the same shape in ``dtype``
    (default: promoted dtype of input and parameters).
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: Initializer = initializers.zeros
    scale_init: Initializer = initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalize ``x`` (..., features); returns the same shape."""
        check_supported("LayerNorm", x, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
                        axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, mask=mask)
        features = (x.shape[-1],)
        scale = self.param("scale", self.scale_init, features, self.param_dtype) if self.use_scale else None
        bias = self.param("bias", self.bias_init, features, self.param_dtype) if self.use_bias else None
        present = [a for a in (x, scale, bias) if a is not None]
        out_dtype = dtypes.canonicalize_dtype(*present, dtype=self.dtype)
        return layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=out_dtype)


class RMSNorm(Module):
    """RMSNorm over the last axis; see ``flax.linen.RMSNorm`` for the attributes.

    Input (..., features) in bfloat16, float16 or float32; output the same shape in ``dtype``
    (default: promoted dtype of input and scale).
    """

    epsilon: float = 1e-6
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    use_scale: bool = True
    scale_init: Initializer = initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x, *, mask: jax.Array | None = None):
        """Normalize ``x`` (..., features); returns the same shape."""
        check_supported("RMSNorm", x, reduction_axes=self.reduction_axes, feature_axes=self.feature_axes,
                        axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, mask=mask)
        scale = self.param("scale", self.scale_init, (x.shape[-1],), self.param_dtype) if self.use_scale else None
        present = [a for a in (x, scale) if a is not None]
        out_dtype = dtypes.canonicalize_dtype(*present, dtype=self.dtype)
        return rms_norm(x, scale, epsilon=self.epsilon, dtype=out_dtype)
