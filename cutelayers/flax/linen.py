"""Flax linen ``LayerNorm``, ``RMSNorm``, ``Dense`` and heads backed by the cutelayers kernels.

Drop-in replacements for ``flax.linen.LayerNorm`` / ``flax.linen.RMSNorm``: same attributes and
defaults, same parameters (``scale``, ``bias``: shape (features,), ``param_dtype``, the same
initializers) and the same result dtype -- ``dtype`` if given, else the promoted dtype of the input
and the parameters (``flax.linen.dtypes.canonicalize_dtype``); a bf16 input with the default
float32 parameters therefore gives float32, as in Flax.

Differences: statistics always use the stable two-pass variance in float32, so
``use_fast_variance`` and ``force_float32_reductions=False`` change nothing (results agree with
Flax to float32 rounding); ``reduction_axes`` / ``feature_axes`` other than the last axis,
``axis_name``, ``axis_index_groups`` and ``mask`` raise ``NotImplementedError``.

``Dense`` is a drop-in for ``flax.linen.Dense`` (parameters ``kernel`` (in, features) and
``bias`` (features,), the same initializers and ``promote_dtype`` rule) running
:func:`cutelayers.ops.fused_linear`, with an extra ``activation`` fused into the GEMM epilogue. A
custom ``dot_general`` / ``dot_general_cls`` raises ``NotImplementedError``.

Heads: ``LMHead`` (a Dense-shaped vocabulary projection and its cross-entropy loss in one, without
the logits; optionally tied to an embedding table) and ``MeanPoolClassifier`` (masked mean pooling
and a ``Dense`` to the classes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import dtypes, initializers
from flax.linen.linear import default_kernel_init
from flax.linen.module import Module, compact

from cutelayers._module_checks import check_tied_embedding
from cutelayers.flax._common import check_dense_supported, check_supported
from cutelayers.ops.linear import fused_linear
from cutelayers.ops.lm_head import linear_cross_entropy
from cutelayers.ops.norm import layer_norm, rms_norm
from cutelayers.ops.pool import masked_mean_pool

Axes = Any
Dtype = Any
Initializer = Any
PrecisionLike = Any


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


class Dense(Module):
    """``activation(x @ kernel + bias)`` over the last axis; see ``flax.linen.Dense`` for the
    attributes.

    Input (..., in_features) in bfloat16, float16 or float32; output (..., features). Input and
    parameters are promoted with ``promote_dtype`` (to ``dtype`` if given) and the result has that
    dtype, as in Flax; the GEMM accumulates in float32.

    ``activation``: None (Flax's Dense), a name or a ``jax.nn`` function fused into the GEMM's
    epilogue, or any other callable applied after it (see :func:`cutelayers.ops.fused_linear`).
    ``precision`` applies to float32 GEMMs (bfloat16 / float16 products are exact).
    """

    features: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()
    promote_dtype: Any = dtypes.promote_dtype
    dot_general: Any = None
    dot_general_cls: Any = None
    activation: Any = None

    @compact
    def __call__(self, inputs, residual=None):
        """``inputs`` (..., in_features) -> (..., features). ``residual`` (..., features), optional:
        added after the activation in the same kernel (cast to the result dtype)."""
        check_dense_supported("Dense", dot_general=self.dot_general, dot_general_cls=self.dot_general_cls)
        kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        return fused_linear(inputs, kernel, bias, activation=self.activation, precision=self.precision,
                            residual=None if residual is None else jnp.asarray(residual).astype(inputs.dtype))


class LMHead(Module):
    """Language-model head and its loss in one: cross-entropy of ``h @ kernel + bias`` against
    ``labels``, never materialising the (tokens, vocab_size) logits
    (:func:`cutelayers.ops.linear_cross_entropy`).

    Parameters as ``Dense(vocab_size)``'s -- ``kernel`` (hidden, vocab_size), ``bias``
    (vocab_size,), the same initializers and ``promote_dtype`` rule -- so a Dense head's checkpoint
    loads unchanged (and ``Dense(vocab_size).apply`` on these parameters gives the logits, e.g.
    for generation).

    Weight tying: with ``tie_embedding=True`` the head has no kernel; pass the (vocab_size,
    hidden) embedding table at each call, ``head(h, labels, embedding=table)`` (e.g. an
    ``nn.Embed``'s ``embedding``), and the logits are ``h @ table.T + bias``.

    ``reduction`` ("mean" over the tokens that are not ``ignore_index``, "sum" or "none"),
    ``ignore_index`` and ``chunk_size`` are those of ``linear_cross_entropy``.
    """

    vocab_size: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()
    promote_dtype: Any = dtypes.promote_dtype
    tie_embedding: bool = False
    reduction: str = "mean"
    ignore_index: int | None = None
    chunk_size: int | None = None

    @compact
    def __call__(self, h, labels, *, embedding=None):
        """``h`` (..., hidden), ``labels`` (...) integers -> float32 loss: a scalar, or (...) for
        reduction="none"."""
        hidden = jnp.shape(h)[-1]
        check_tied_embedding("LMHead", self.tie_embedding, embedding, self.vocab_size, hidden)
        if self.tie_embedding:
            weight = embedding
        else:
            weight = self.param("kernel", self.kernel_init, (hidden, self.vocab_size), self.param_dtype)
        bias = self.param("bias", self.bias_init, (self.vocab_size,), self.param_dtype) if self.use_bias else None
        h, weight, bias = self.promote_dtype(h, weight, bias, dtype=self.dtype)
        kernel = weight.T if self.tie_embedding else weight
        return linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, chunk_size=self.chunk_size)


class MeanPoolClassifier(Module):
    """Masked mean pooling over the sequence, then a ``Dense`` to ``num_classes`` logits.

    ``x`` (..., seq, features), ``mask`` (..., seq) bool or 0/1 (nonzero keeps a position) ->
    (..., num_classes) in the promoted dtype of the pooled input and the parameters. Positions
    the mask drops do not count; a row that keeps none pools to 0 (its logits are the bias).
    Parameters: the ``Dense`` submodule ``head`` (``kernel`` (features, num_classes), ``bias``);
    the other attributes are passed to it.
    """

    num_classes: int
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()
    promote_dtype: Any = dtypes.promote_dtype

    @compact
    def __call__(self, x, mask):
        """``x`` (..., seq, features), ``mask`` (..., seq) -> logits (..., num_classes)."""
        head = Dense(self.num_classes, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                     precision=self.precision, kernel_init=self.kernel_init, bias_init=self.bias_init,
                     promote_dtype=self.promote_dtype, name="head")
        return head(masked_mean_pool(x, mask))
