"""Flax linen ``LayerNorm``, ``RMSNorm``, ``Dense``, ``MLP``, ``Embed`` and heads backed by the cutelayers ops.

``LayerNorm``, ``RMSNorm`` and ``Dense`` subclass ``flax.linen.LayerNorm`` / ``RMSNorm`` /
``Dense``: the same attributes, defaults, parameters and dtype rules, by construction, and
``isinstance`` holds. A call runs the cutelayers op -- last-axis statistics in float32 (two-pass
variance, so ``use_fast_variance`` and ``force_float32_reductions`` change only rounding), the
fused GEMM -- where it serves the arguments, and otherwise the stock module's own computation,
logged once (README, *Drop-in modules*, lists which arguments take which path).

``Dense`` adds ``activation`` (fused into the GEMM epilogue) and a ``residual`` call argument.

``LayerNorm`` and ``RMSNorm`` add a ``residual`` call argument: ``norm(x, residual=r)`` returns
``(norm(x + r), x + r)``, the add fused into the norm's kernels (see
:func:`cutelayers.ops.add_layer_norm`). An argument rather than ``AddLayerNorm`` modules: the
module, its parameters and their automatic names (``LayerNorm_0``) are those of a plain norm, so a
pre-norm block switches to the fused add without touching its checkpoints.

``MLP``: a transformer feed-forward block, ``Dense`` -> activation -> ``Dense`` (+ residual), as one
:func:`cutelayers.ops.mlp` call; its parameters are those of two ``Dense`` children.

``Embed`` subclasses ``flax.linen.Embed`` (same parameter, lookup and ``attend``); its table gradient
sums repeated ids on the tensor cores before scattering (:func:`cutelayers.ops.embed`).

Heads: ``LMHead`` (a Dense-shaped vocabulary projection and its cross-entropy loss in one, without
the logits; optionally tied to an embedding table) and ``MeanPoolClassifier`` (masked mean pooling
and a ``Dense`` to the classes).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import dtypes, initializers
from flax.linen.linear import default_kernel_init
from flax.linen.module import Module, compact

from cutelayers._module_checks import (
    array_blocker,
    check_mlp,
    check_norm_residual,
    check_parts,
    check_tied_embedding,
    embed_blocker,
    empty_blocker,
    epsilon_blocker,
    fc1_features,
    finish_linear,
    finish_mlp,
    kernels_serve,
    lm_head_loss,
    norm_blocker,
    norm_op,
    op_operands,
    options_blocker,
    residual_blocker,
    residual_like,
    split_result,
    stock_norm,
)
from cutelayers.ops.embed import embed
from cutelayers.ops.linear import fused_linear
from cutelayers.ops.mlp import mlp
from cutelayers.ops.pool import masked_mean_pool
from cutelayers.ops.split_linear import split_linear

Dtype = Any
Initializer = Any
PrecisionLike = Any


def _param_dtype(module: Module, name: str):
    """The dtype parameter ``name`` has in this call, before it is declared: a bound one's (as
    ``apply`` was given it: a loaded checkpoint may differ from ``param_dtype``; NumPy float64
    reads as JAX makes it), else ``param_dtype`` (``init``)."""
    if module.has_variable("params", name):
        return jnp.asarray(module.get_variable("params", name)).dtype
    return module.param_dtype


class _Norm(Module):
    """The call shared by :class:`LayerNorm` and :class:`RMSNorm`: the cutelayers op over the last
    axis (parameters (features,), result in ``dtype`` or the promoted dtype), else stock."""

    @compact
    def __call__(self, x, *, residual: jax.Array | None = None, mask: jax.Array | None = None):
        """Normalize ``x``; returns the same shape. See the stock module for the arguments.

        ``residual`` (x's shape), optional: normalize summed = x + residual instead (in the
        residual's dtype) and return ``(normed, summed)`` -- the pre-norm transformer's residual
        add fused into the norm's kernels (:func:`cutelayers.ops.add_layer_norm`)."""
        center = isinstance(self, nn.LayerNorm)
        check_norm_residual(type(self).__name__, x, residual)
        names = ("scale",) * self.use_scale + ("bias",) * (center and self.use_bias)
        why = (options_blocker(axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, mask=mask)
               or epsilon_blocker(self.epsilon)
               or norm_blocker(x, self.reduction_axes, self.feature_axes, dtype=self.dtype,
                               **{n: _param_dtype(self, n) for n in names})
               or residual_blocker(x, residual))
        if not kernels_serve(type(self).__name__, why):
            return stock_norm(functools.partial(super().__call__, mask=mask), x, residual)
        init = {"scale": self.scale_init, "bias": getattr(self, "bias_init", None)}
        params = {n: jnp.asarray(self.param(n, init[n], (x.shape[-1],), self.param_dtype)) for n in names}
        return norm_op(center, residual)(x, params.get("scale"), params.get("bias"), epsilon=self.epsilon,
                                         dtype=self.dtype)


class LayerNorm(_Norm, nn.LayerNorm):
    """``flax.linen.LayerNorm`` on the cutelayers kernels (see the module docstring)."""


class RMSNorm(_Norm, nn.RMSNorm):
    """``flax.linen.RMSNorm`` on the cutelayers kernels (see the module docstring)."""


def _dense_params(dense: nn.Dense, in_features: int):
    """``kernel`` (in_features, features) and ``bias`` (features,) or None, declared in ``dense``'s
    scope as ``flax.linen.Dense`` declares them (names, shapes, initializers, ``param_dtype``)."""
    kernel = dense.param("kernel", dense.kernel_init, (in_features, dense.features), dense.param_dtype)
    bias = dense.param("bias", dense.bias_init, (dense.features,), dense.param_dtype) if dense.use_bias else None
    return kernel, bias


class Dense(nn.Dense):
    """``flax.linen.Dense`` on the fused GEMM, plus ``activation``: None (Flax's Dense), a name or
    a ``jax.nn`` function fused into the GEMM's epilogue, or any other callable applied after it
    (see :func:`cutelayers.ops.fused_linear`). ``precision`` applies to float32 GEMMs (bfloat16 /
    float16 products are exact)."""

    activation: Any = None

    @compact
    def __call__(self, inputs, *, residual=None, parts: int | None = None):
        """``inputs`` (..., in_features) -> (..., features). ``residual`` (..., features), optional:
        added after the activation (cast to the result dtype). ``parts``, optional: the result as a
        tuple of that many equal blocks of features, each its own array (attention's q, k, v;
        :func:`cutelayers.ops.split_linear`), for a plain projection."""
        check_parts("Dense", parts, self.features, self.activation, residual)
        custom_promote = None if self.promote_dtype is dtypes.promote_dtype else self.promote_dtype
        why = (options_blocker(dot_general=self.dot_general, dot_general_cls=self.dot_general_cls,
                               promote_dtype=custom_promote)
               or empty_blocker(features=self.features)
               or array_blocker(inputs, kernel=_param_dtype(self, "kernel"), dtype=self.dtype,
                                bias=_param_dtype(self, "bias") if self.use_bias else None))
        if not kernels_serve("Dense", why):
            return split_result(finish_linear("Dense", super().__call__(inputs), self.activation, residual), parts)
        kernel, bias = _dense_params(self, jnp.shape(inputs)[-1])
        inputs, kernel, bias = op_operands(self.promote_dtype(inputs, kernel, bias, dtype=self.dtype), (kernel, bias))
        if parts is not None:
            return split_linear(inputs, kernel, bias, parts=parts, precision=self.precision)
        return fused_linear(inputs, kernel, bias, activation=self.activation, precision=self.precision,
                            residual=residual_like(residual, inputs))


class Embed(nn.Embed):
    """``flax.linen.Embed`` whose table gradient sums repeated ids before its scatter, in float32
    (:func:`cutelayers.ops.embed`); the lookup and ``attend`` are Flax's."""

    def __call__(self, inputs):
        """``inputs`` (...) integer ids -> (..., features) in ``dtype`` (default: the table's)."""
        custom_promote = None if self.promote_dtype is dtypes.promote_dtype else self.promote_dtype
        why = (options_blocker(promote_dtype=custom_promote)
               or embed_blocker(inputs, self.num_embeddings, self.features, table=self.embedding.dtype, dtype=self.dtype))
        if not kernels_serve("Embed", why):
            return super().__call__(inputs)
        return embed(self.embedding, inputs, self.dtype)


class _DenseParams(nn.Dense):
    """A ``Dense``'s parameters without its product: ``(kernel, bias)`` for ``in_features``
    inputs, declared where and as the ``Dense`` would declare them (an ``MLP``'s layers)."""

    @compact
    def __call__(self, in_features: int):
        return _dense_params(self, in_features)


class MLP(Module):
    """Transformer feed-forward block, ``Dense(hidden_features)`` -> ``activation`` ->
    ``Dense(features)`` (+ ``residual``), as one :func:`cutelayers.ops.mlp` call: two fused GEMMs,
    and in the backward the activation's derivative inside the hidden-gradient GEMM.

    Parameters: those of two ``flax.linen.Dense`` children named ``Dense_0`` (``kernel``
    (in_features, hidden_features), ``bias``) and ``Dense_1`` (``kernel`` (hidden_features,
    features), ``bias``) -- the names a compact module calling ``nn.Dense`` twice gets -- with
    Dense's initializers and draws, so such a stock MLP's parameters load unchanged (and equal keys
    give equal parameters).

    Attributes:
      hidden_features: the first layer's output width.
      features: the block's output width.
      activation: between the layers: a name or ``jax.nn`` function fused into the GEMM epilogue
        ('gelu', jax.nn.gelu's tanh approximation, by default; see
        :func:`cutelayers.ops.fused_linear` for the list), None for none, any other callable,
        applied unfused, or a gated one, 'swiglu' / 'geglu': then ``Dense_0`` has 2 x
        hidden_features outputs, the gate and value halves (:func:`cutelayers.ops.mlp`).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as ``Dense``'s, for both
        layers. The computation runs in ``dtype`` if given, else in the promoted dtype of the
        input and the parameters (Dense's rule, for the block as a whole); ``precision`` applies
        to float32 GEMMs (bfloat16 / float16 products are exact).
      out_kernel_init: the second layer's kernel initializer; None: ``kernel_init`` (e.g. GPT-2's
        scaled initialization of a projection into the residual stream).

    Input and parameters that the op cannot take (complex or other dtypes, a scalar input or an
    empty last axis) run the stock computation, two ``flax.linen.Dense`` layers, logged once.
    """

    hidden_features: int
    features: int
    activation: Any = "gelu"
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    out_kernel_init: Initializer | None = None
    bias_init: Initializer = initializers.zeros_init()

    @compact
    def __call__(self, inputs, residual=None):
        """``inputs`` (..., in_features) -> (..., features). ``residual`` (..., features),
        optional: added to the second layer's output (cast to the result dtype)."""
        check_mlp("MLP", self.activation, hidden_features=self.hidden_features, features=self.features)
        stock = not kernels_serve("MLP", array_blocker(inputs, parameters=self.param_dtype, dtype=self.dtype))
        Layer = nn.Dense if stock else _DenseParams
        shared = {"use_bias": self.use_bias, "dtype": self.dtype, "param_dtype": self.param_dtype,
                  "precision": self.precision, "bias_init": self.bias_init}
        out_kernel_init = self.out_kernel_init or self.kernel_init
        fc1 = Layer(fc1_features(self.activation, self.hidden_features), kernel_init=self.kernel_init,
                    name="Dense_0", **shared)
        fc2 = Layer(self.features, kernel_init=out_kernel_init, name="Dense_1", **shared)
        if stock:
            return finish_mlp("MLP", fc1, fc2, inputs, self.activation, residual)
        w1, b1 = fc1(jnp.shape(inputs)[-1])
        w2, b2 = fc2(self.hidden_features)
        inputs, w1, b1, w2, b2 = op_operands(dtypes.promote_dtype(inputs, w1, b1, w2, b2, dtype=self.dtype),
                                             (w1, b1, w2, b2))
        return mlp(inputs, w1, b1, w2, b2, activation=self.activation, precision=self.precision,
                   residual=residual_like(residual, inputs))


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
    ``ignore_index``, ``label_smoothing``, ``z_loss``, ``logit_soft_cap`` and ``chunk_size`` are
    those of ``linear_cross_entropy``.
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
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    logit_soft_cap: float | None = None
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
        h, weight, bias = op_operands(self.promote_dtype(h, weight, bias, dtype=self.dtype), (weight, bias))
        return lm_head_loss(self, h, weight, bias, labels, vocab_major=self.tie_embedding)


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
