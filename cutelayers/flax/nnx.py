"""Flax NNX ``LayerNorm``, ``RMSNorm``, ``Linear``, ``MLP``, ``Embed`` and heads backed by the cutelayers ops.

``LayerNorm``, ``RMSNorm`` and ``Linear`` subclass ``flax.nnx.LayerNorm`` / ``RMSNorm`` /
``Linear``: the same constructor, ``nnx.Param`` attributes (same initializers, draws and metadata)
and dtype rule (``promote_dtype``, to ``dtype`` if given), by construction, and ``isinstance``
holds. A call runs the cutelayers op where it serves the arguments -- the norms over the last axis
with float32 statistics (two-pass variance: ``use_fast_variance`` changes only rounding), the
fused GEMM -- and otherwise the stock module's own computation, logged once (README, *Drop-in
modules*, lists which arguments take which path). A widening promotion of the norms' input is
skipped (the kernel reads x in its own dtype and computes in float32); a narrowing ``dtype``
casts x first, as NNX does.

``Linear`` adds ``activation`` (fused into the GEMM epilogue) and a ``residual`` call argument.

``LayerNorm`` and ``RMSNorm`` add a keyword ``residual`` call argument: ``norm(x, residual=r)``
returns ``(norm(x + r), x + r)``, the add fused into the norm's kernels (see
:func:`cutelayers.ops.add_layer_norm`). An argument rather than ``AddLayerNorm`` modules: the
module and its ``nnx.Param`` s are those of a plain norm, so a pre-norm block switches to the fused
add without touching its state. The sum keeps the residual's dtype and is normalized in float32:
a narrowing ``dtype`` rounds only the result, not the sum first as NNX's own computation does.

``MLP``: a transformer feed-forward block, ``Linear`` -> activation -> ``Linear`` (+ residual), as
one :func:`cutelayers.ops.mlp` call; its parameters are those of two ``nnx.Linear`` children.

``Embed`` subclasses ``flax.nnx.Embed`` (same parameter, lookup and ``attend``); its table gradient
sums repeated ids on the tensor cores before scattering (:func:`cutelayers.ops.embed`).

Heads: ``LMHead`` (a Linear-shaped vocabulary projection and its cross-entropy loss in one, without
the logits; optionally tied to an embedding table) and ``MeanPoolClassifier`` (masked mean pooling
and a ``Linear`` to the classes).
"""

from __future__ import annotations

import functools
import typing as tp
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

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

Dtype = tp.Any
Initializer = tp.Any
PrecisionLike = tp.Any


def _custom(promote_dtype):
    """``promote_dtype`` where it is not NNX's own (whose rule the ops follow), else None."""
    return None if promote_dtype is dtypes.promote_dtype else promote_dtype


class _Norm(nnx.Module):
    """The call shared by :class:`LayerNorm` and :class:`RMSNorm`: the cutelayers op over the last
    axis, else stock."""

    def __call__(self, x, *, residual: jax.Array | None = None, mask: jax.Array | None = None):
        """Normalize ``x``; returns the same shape. See the stock module for the arguments.

        ``residual`` (x's shape), optional: normalize summed = x + residual instead (in the
        residual's dtype) and return ``(normed, summed)`` -- the pre-norm transformer's residual
        add fused into the norm's kernels (:func:`cutelayers.ops.add_layer_norm`)."""
        center = isinstance(self, nnx.LayerNorm)
        check_norm_residual(type(self).__name__, x, residual)
        params = [p[...] if p is not None else None for p in (self.scale, getattr(self, "bias", None))]
        why = (options_blocker(axis_name=self.axis_name, axis_index_groups=self.axis_index_groups, mask=mask,
                               promote_dtype=_custom(self.promote_dtype))
               or epsilon_blocker(self.epsilon)
               or norm_blocker(x, self.reduction_axes, self.feature_axes, dtype=self.dtype,
                               **{n: p.dtype for n, p in zip(("scale", "bias"), params) if p is not None})
               or residual_blocker(x, residual))
        if not kernels_serve(type(self).__name__, why):
            return stock_norm(functools.partial(super().__call__, mask=mask), x, residual)
        if (residual is None and self.dtype is not None
                and jnp.promote_types(x.dtype, self.dtype) != jnp.dtype(self.dtype)):
            x = x.astype(self.dtype)  # a narrowing dtype: NNX normalizes the cast input
        return norm_op(center, residual)(x, *params, epsilon=self.epsilon, dtype=self.dtype)


class LayerNorm(_Norm, nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` on the cutelayers kernels (see the module docstring)."""


class RMSNorm(_Norm, nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` on the cutelayers kernels (see the module docstring)."""

    def __call__(self, x, mask: jax.Array | None = None, *, residual: jax.Array | None = None):
        # NNX's RMSNorm takes mask positionally
        return super().__call__(x, residual=residual, mask=mask)


class Linear(nnx.Linear):
    """``flax.nnx.Linear`` on the fused GEMM, plus ``activation``: None (NNX's Linear), a name or
    a ``jax.nn`` function fused into the GEMM's epilogue, or any other callable applied after it
    (see :func:`cutelayers.ops.fused_linear`). ``precision`` applies to float32 GEMMs (bfloat16 /
    float16 products are exact)."""

    def __init__(self, in_features: int, out_features: int, *, activation: tp.Any = None, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self.activation = activation

    def __call__(self, inputs, out_sharding=None, *, residual=None, parts: int | None = None):
        """``inputs`` (..., in_features) -> (..., out_features). ``residual`` (..., out_features),
        optional: added after the activation (cast to the result dtype). ``parts``, optional: the
        result as a tuple of that many equal blocks of out_features, each its own array (attention's
        q, k, v; :func:`cutelayers.ops.split_linear`), for a plain projection."""
        check_parts("Linear", parts, self.out_features, self.activation, residual)
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        why = (options_blocker(dot_general=None if self.dot_general is jax.lax.dot_general else self.dot_general,
                               out_sharding=out_sharding, promote_dtype=_custom(self.promote_dtype))
               or empty_blocker(out_features=self.out_features)
               or array_blocker(inputs, kernel=kernel.dtype, bias=getattr(bias, "dtype", None),
                                dtype=self.dtype))
        if why is None:  # (NNX's own promote_dtype here: a custom one is the stock computation's)
            x, kernel, bias = op_operands(self.promote_dtype((inputs, kernel, bias), dtype=self.dtype), (kernel, bias))
            preferred = self.preferred_element_type
            # the GEMM's result is in the compute dtype: asking for that one is honoured
            why = options_blocker(preferred_element_type=None if preferred is None
                                  or jnp.dtype(preferred) == x.dtype else preferred)
        if not kernels_serve("Linear", why):  # stock promotes the inputs itself
            return split_result(finish_linear("Linear", super().__call__(inputs, out_sharding), self.activation, residual),
                                parts)
        if parts is not None:
            return split_linear(x, kernel, bias, parts=parts, precision=self.precision)
        return fused_linear(x, kernel, bias, activation=self.activation, precision=self.precision,
                            residual=residual_like(residual, x))


class Embed(nnx.Embed):
    """``flax.nnx.Embed`` whose table gradient sums repeated ids before its scatter, in float32
    (:func:`cutelayers.ops.embed`); the lookup and ``attend`` are NNX's."""

    def __call__(self, inputs, out_sharding=None):
        """``inputs`` (...) integer ids -> (..., features) in ``dtype``."""
        table = self.embedding[...]
        why = (options_blocker(out_sharding=out_sharding, promote_dtype=_custom(self.promote_dtype))
               or embed_blocker(inputs, self.num_embeddings, self.features, table=table.dtype, dtype=self.dtype))
        if not kernels_serve("Embed", why):
            return super().__call__(inputs, out_sharding)
        return embed(table, inputs, self.dtype)


class MLP(nnx.Module):
    """Transformer feed-forward block, ``fc1`` -> ``activation`` -> ``fc2`` (+ ``residual``), as one
    :func:`cutelayers.ops.mlp` call: two fused GEMMs, and in the backward the activation's
    derivative inside the hidden-gradient GEMM.

    Parameters: those of the two ``nnx.Linear`` attributes ``fc1`` (in_features ->
    hidden_features) and ``fc2`` (hidden_features -> out_features), built in that order from
    ``rngs``: a stock module with two such attributes has the same state (it loads unchanged) and,
    from equal Rngs, the same parameters.

    Args:
      in_features, hidden_features, out_features: the widths of the input, the hidden layer and
        the output.
      activation: between the layers: a name or ``jax.nn`` function fused into the GEMM epilogue
        ('gelu', jax.nn.gelu's tanh approximation, by default; see
        :func:`cutelayers.ops.fused_linear` for the list), None for none, any other callable,
        applied unfused, or a gated one, 'swiglu' / 'geglu': then ``fc1`` has 2 x hidden_features
        outputs, the gate and value halves (:func:`cutelayers.ops.mlp`).
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as ``nnx.Linear``'s, for
        both layers. The computation runs in ``dtype`` if given, else in the promoted dtype of
        the input and the parameters (Linear's rule, for the block as a whole); ``precision``
        applies to float32 GEMMs (bfloat16 / float16 products are exact). The call reads ``fc1``'s
        ``dtype`` and ``precision``.
      out_kernel_init: ``fc2``'s kernel initializer; None: ``kernel_init`` (e.g. GPT-2's scaled
        initialization of a projection into the residual stream).
      rngs: the parameters' random streams.

    Input and parameters that the op cannot take (complex or other dtypes, an empty last axis) run
    the stock computation, ``fc1`` and ``fc2``'s own calls, logged once.
    """

    def __init__(self, in_features: int, hidden_features: int, out_features: int, *,
                 activation: tp.Any = "gelu", use_bias: bool = True, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init,
                 out_kernel_init: Initializer | None = None, bias_init: Initializer = default_bias_init,
                 rngs: nnx.Rngs):
        check_mlp("MLP", activation, in_features=in_features, hidden_features=hidden_features,
                  out_features=out_features)
        shared = {"use_bias": use_bias, "dtype": dtype, "param_dtype": param_dtype, "precision": precision,
                  "bias_init": bias_init, "rngs": rngs}
        self.fc1 = nnx.Linear(in_features, fc1_features(activation, hidden_features), kernel_init=kernel_init,
                              **shared)
        self.fc2 = nnx.Linear(hidden_features, out_features, kernel_init=out_kernel_init or kernel_init,
                              **shared)
        self.activation = activation

    def __call__(self, inputs, residual=None):
        """``inputs`` (..., in_features) -> (..., out_features). ``residual`` (..., out_features),
        optional: added to ``fc2``'s output (cast to the result dtype)."""
        fc1, fc2 = self.fc1, self.fc2
        params = [p[...] if p is not None else None for p in (fc1.kernel, fc1.bias, fc2.kernel, fc2.bias)]
        names = ("fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias")
        why = array_blocker(inputs, dtype=fc1.dtype,
                            **{n: p.dtype for n, p in zip(names, params) if p is not None})
        if not kernels_serve("MLP", why):
            return finish_mlp("MLP", fc1, fc2, inputs, self.activation, residual)
        inputs, w1, b1, w2, b2 = op_operands(dtypes.promote_dtype((inputs, *params), dtype=fc1.dtype), params)
        return mlp(inputs, w1, b1, w2, b2, activation=self.activation, precision=fc1.precision,
                   residual=residual_like(residual, inputs))


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
    ``ignore_index``, ``label_smoothing``, ``z_loss``, ``logit_soft_cap`` and ``chunk_size`` are
    those of ``linear_cross_entropy``.
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
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logit_soft_cap: float | None = None,
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
        self.label_smoothing, self.z_loss, self.logit_soft_cap = label_smoothing, z_loss, logit_soft_cap
        self.chunk_size = chunk_size

    def __call__(self, h, labels, *, embedding=None):
        """``h`` (..., in_features), ``labels`` (...) integers -> float32 loss: a scalar, or (...)
        for reduction="none"."""
        check_tied_embedding("LMHead", self.tie_embedding, embedding, self.vocab_size, self.in_features)
        weight = embedding if self.tie_embedding else self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        h, weight, bias = op_operands(self.promote_dtype((h, weight, bias), dtype=self.dtype), (weight, bias))
        return lm_head_loss(self, h, weight, bias, labels, vocab_major=self.tie_embedding)


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
