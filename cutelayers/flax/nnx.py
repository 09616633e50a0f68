"""Flax NNX ``LayerNorm``, ``RMSNorm``, ``Linear`` and heads backed by the cutelayers kernels.

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

``Linear`` is a drop-in for ``flax.nnx.Linear`` (``nnx.Param`` attributes ``kernel``
(in_features, out_features) and ``bias`` (out_features,), the same initializers, metadata and
``promote_dtype`` rule; the GEMM needs one dtype, so here the input is promoted too) running
:func:`cutelayers.ops.fused_linear`, with an extra ``activation`` fused into the GEMM epilogue. A
custom ``dot_general``, an ``out_sharding`` or a ``preferred_element_type`` other than the
compute dtype raise ``NotImplementedError``.

Heads: ``LMHead`` (a Linear-shaped vocabulary projection and its cross-entropy loss in one, without
the logits; optionally tied to an embedding table) and ``MeanPoolClassifier`` (masked mean pooling
and a ``Linear`` to the classes).
"""

from __future__ import annotations

import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

from cutelayers._module_checks import check_tied_embedding
from cutelayers.flax._common import check_dense_supported, check_supported
from cutelayers.ops.linear import fused_linear
from cutelayers.ops.lm_head import linear_cross_entropy
from cutelayers.ops.norm import layer_norm, rms_norm
from cutelayers.ops.pool import masked_mean_pool

Axes = tp.Any
Dtype = tp.Any
Initializer = tp.Any
PrecisionLike = tp.Any


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


def _dense_params(in_features, out_features, with_kernel, use_bias, param_dtype, kernel_init, bias_init, rngs,
                  kernel_metadata, bias_metadata):
    """(kernel, bias) ``nnx.Param`` s of shapes (in_features, out_features) and (out_features,), or
    ``nnx.data(None)`` where absent; the same draws in the same order as ``nnx.Linear``, so equal
    Rngs give equal parameters."""
    kernel = bias = nnx.data(None)
    if with_kernel:
        kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype), **kernel_metadata)
    if use_bias:
        bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata)
    return kernel, bias


class Linear(nnx.Module):
    """``activation(x @ kernel + bias)`` over the last axis; see ``flax.nnx.Linear`` for the
    arguments.

    Input (..., in_features) in bfloat16, float16 or float32; output (..., out_features). Input
    and parameters are promoted with ``promote_dtype`` (to ``dtype`` if given) and the result has
    that dtype, as in NNX; the GEMM accumulates in float32.

    ``activation``: None (NNX's Linear), a name or a ``jax.nn`` function fused into the GEMM's
    epilogue, or any other callable applied after it (see :func:`cutelayers.ops.fused_linear`).
    ``precision`` applies to float32 GEMMs (bfloat16 / float16 products are exact).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        precision: PrecisionLike = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        dot_general: tp.Callable = jax.lax.dot_general,
        promote_dtype: tp.Callable = dtypes.promote_dtype,
        preferred_element_type: Dtype | None = None,
        activation: tp.Any = None,
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    ):
        self.kernel: nnx.Param
        self.bias: nnx.Param | None
        self.kernel, self.bias = _dense_params(in_features, out_features, True, use_bias, param_dtype, kernel_init,
                                               bias_init, rngs, kernel_metadata, bias_metadata)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.dot_general = dot_general
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.activation = activation

    def __call__(self, inputs, out_sharding=None, *, residual=None):
        """``inputs`` (..., in_features) -> (..., out_features). ``residual`` (..., out_features),
        optional: added after the activation in the same kernel (cast to the result dtype)."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        preferred = self.preferred_element_type
        check_dense_supported(
            "Linear",
            dot_general=None if self.dot_general is jax.lax.dot_general else self.dot_general,
            out_sharding=out_sharding,
            # the GEMM's result is already in the compute dtype: asking for that one is honoured
            preferred_element_type=None if preferred is None or jnp.dtype(preferred) == inputs.dtype else preferred,
        )
        return fused_linear(inputs, kernel, bias, activation=self.activation, precision=self.precision,
                            residual=None if residual is None else jnp.asarray(residual).astype(inputs.dtype))


class LMHead(nnx.Module):
    """Language-model head and its loss in one: cross-entropy of ``h @ kernel + bias`` against
    ``labels``, never materialising the (tokens, vocab_size) logits
    (:func:`cutelayers.ops.linear_cross_entropy`).

    Parameters as ``nnx.Linear(in_features, vocab_size)``'s -- ``kernel`` (in_features,
    vocab_size), ``bias`` (vocab_size,), the same initializers, draws, metadata and
    ``promote_dtype`` rule -- so a Linear head's state loads unchanged.

    Weight tying: with ``tie_embedding=True`` the head has no kernel; pass the (vocab_size,
    in_features) embedding table at each call, ``head(h, labels, embedding=table)`` (e.g.
    ``embed.embedding[...]`` of an ``nnx.Embed``), and the logits are ``h @ table.T + bias``.

    ``reduction`` ("mean" over the tokens that are not ``ignore_index``, "sum" or "none"),
    ``ignore_index`` and ``chunk_size`` are those of ``linear_cross_entropy``.
    """

    def __init__(
        self,
        in_features: int,
        vocab_size: int,
        *,
        use_bias: bool = True,
        dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        promote_dtype: tp.Callable = dtypes.promote_dtype,
        tie_embedding: bool = False,
        reduction: str = "mean",
        ignore_index: int | None = None,
        chunk_size: int | None = None,
        rngs: nnx.Rngs,
        kernel_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
        bias_metadata: tp.Mapping[str, tp.Any] = MappingProxyType({}),
    ):
        self.kernel: nnx.Param | None
        self.bias: nnx.Param | None
        self.kernel, self.bias = _dense_params(in_features, vocab_size, not tie_embedding, use_bias, param_dtype,
                                               kernel_init, bias_init, rngs, kernel_metadata, bias_metadata)
        self.in_features = in_features
        self.vocab_size = vocab_size
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.promote_dtype = promote_dtype
        self.tie_embedding = tie_embedding
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size

    def __call__(self, h, labels, *, embedding=None):
        """``h`` (..., in_features), ``labels`` (...) integers -> float32 loss: a scalar, or (...)
        for reduction="none"."""
        check_tied_embedding("LMHead", self.tie_embedding, embedding, self.vocab_size, self.in_features)
        weight = embedding if self.tie_embedding else self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        h, weight, bias = self.promote_dtype((h, weight, bias), dtype=self.dtype)
        kernel = weight.T if self.tie_embedding else weight
        return linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, chunk_size=self.chunk_size)


class MeanPoolClassifier(nnx.Module):
    """Masked mean pooling over the sequence, then a ``Linear`` to ``num_classes`` logits.

    ``x`` (..., seq, in_features), ``mask`` (..., seq) bool or 0/1 (nonzero keeps a position) ->
    (..., num_classes) in the promoted dtype of the pooled input and the parameters. Positions
    the mask drops do not count; a row that keeps none pools to 0 (its logits are the bias).
    Parameters: the :class:`Linear` attribute ``head``; the keyword arguments are passed to it.
    """

    def __init__(self, in_features: int, num_classes: int, *, use_bias: bool = True, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init, bias_init: Initializer = default_bias_init,
                 promote_dtype: tp.Callable = dtypes.promote_dtype, rngs: nnx.Rngs):
        self.head = Linear(in_features, num_classes, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                           precision=precision, kernel_init=kernel_init, bias_init=bias_init,
                           promote_dtype=promote_dtype, rngs=rngs)

    def __call__(self, x, mask):
        """``x`` (..., seq, in_features), ``mask`` (..., seq) -> logits (..., num_classes)."""
        return self.head(masked_mean_pool(x, mask))
