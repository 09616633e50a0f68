"""Equinox ``LayerNorm``, ``RMSNorm``, ``Linear``, ``MLP``, ``Embedding`` and heads backed by the cutelayers ops.

``LayerNorm``, ``RMSNorm`` and ``Linear`` subclass ``equinox.nn.LayerNorm`` / ``RMSNorm`` /
``Linear``: the same constructor, fields, arrays (same initialisation: equal keys give equal
arrays), unbatched call and dtypes, by construction, and ``isinstance`` holds. A call runs the
cutelayers op where it serves the arguments -- the norms' statistics over the whole ``shape``
(flattened to one row) in float32, result in x's dtype; the GEMM -- and otherwise the stock
module's own computation, logged once (README, *Drop-in modules*, lists which arguments take which
path). Under ``jax.vmap`` the op's batching rule folds the vmapped axes into rows, so a batch is
one kernel launch; under ``jax.grad`` of the vmap, Linear's weight gradient is one GEMM over all
rows, not one per example.

``Linear`` adds ``activation`` (static; fused into the GEMM epilogue) and a ``residual`` call
argument.

``LayerNorm`` and ``RMSNorm`` add a keyword ``residual`` call argument: ``norm(x, residual=r)``
returns ``(norm(x + r), x + r)``, the add fused into the norm's kernels (see
:func:`cutelayers.ops.add_layer_norm`). An argument rather than ``AddLayerNorm`` modules: the
module and its arrays are those of a plain norm, so a pre-norm block switches to the fused add
without touching its checkpoints.

``MLP``: a transformer feed-forward block, ``Linear`` -> activation -> ``Linear`` (+ residual), as
one :func:`cutelayers.ops.mlp` call; its arrays are those of two ``equinox.nn.Linear`` fields.

``Embedding`` subclasses ``equinox.nn.Embedding`` (same fields and scalar call); its weight gradient
sums repeated ids on the tensor cores before scattering (:func:`cutelayers.ops.embed`).

Heads: ``LMHead`` (a vocabulary projection shaped like ``Linear(in_features, vocab_size)`` and its
cross-entropy loss in one, without the logits; optionally tied to an embedding table) and
``MeanPoolClassifier`` (masked mean pooling and a ``Linear`` to the classes).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from cutelayers._module_checks import (
    array_blocker,
    check_head_dtype,
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
    norm_op,
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

_NO_STATE = object()  # "no state passed": then only the output is returned


def _dtype(a):
    return None if a is None else a.dtype


class _Norm(eqx.Module):
    """The call shared by :class:`LayerNorm` and :class:`RMSNorm`: the cutelayers op on x as one
    row, else stock (which also raises for an ``x`` not of ``shape``)."""

    def __call__(self, x: Array, state=_NO_STATE, *, residual: Array | None = None,
                 key: PRNGKeyArray | None = None):
        """``x`` of ``shape`` -> normalized array of ``shape`` in x's dtype (and ``state``,
        unchanged, if one was passed). ``key`` is ignored.

        ``residual`` (x's shape), optional: normalize summed = x + residual instead (in the
        residual's dtype) and return ``(normed, summed)`` in place of the normalized array -- the
        pre-norm transformer's residual add fused into the norm's kernels
        (:func:`cutelayers.ops.add_layer_norm`); normed then has the residual's dtype."""
        check_norm_residual(type(self).__name__, x, residual)
        if getattr(x, "shape", None) != self.shape or not kernels_serve(
                type(self).__name__, epsilon_blocker(self.eps)
                or array_blocker(x.reshape(-1), weight=_dtype(self.weight), bias=_dtype(self.bias))
                or residual_blocker(x, residual)):
            out = stock_norm(functools.partial(super().__call__, key=key), x, residual)
        else:
            center = isinstance(self, eqx.nn.LayerNorm)
            source = x if residual is None else residual  # the normalized input has its dtype
            flat = [None if a is None else a.reshape(-1) for a in (x, residual, self.weight, self.bias)]
            out = norm_op(center, flat[1])(flat[0], *flat[2:], epsilon=self.eps, dtype=source.dtype)
            out = jax.tree.map(lambda a: a.reshape(x.shape), out)
        return out if state is _NO_STATE else (out, state)


class LayerNorm(_Norm, eqx.nn.LayerNorm):
    """``equinox.nn.LayerNorm`` on the cutelayers kernels (see the module docstring)."""

    __init__ = eqx.nn.LayerNorm.__init__  # the stock one, not a dataclass __init__ from the mixin


class RMSNorm(_Norm, eqx.nn.RMSNorm):
    """``equinox.nn.RMSNorm`` on the cutelayers kernels (see the module docstring)."""

    __init__ = eqx.nn.RMSNorm.__init__


def _features(n: int | Literal["scalar"]) -> int:
    return 1 if n == "scalar" else n


def _shape(n: int | Literal["scalar"]) -> tuple[int, ...]:
    """The shape of a layer's unbatched input or output of ``n`` features: () for "scalar"."""
    return () if n == "scalar" else (n,)


def _linear_init(key, in_features, out_features, use_bias, dtype, with_weight=True):
    """(weight (out, in) | None, bias (out,) | None) drawn as ``equinox.nn.Linear`` draws them:
    uniform in +-1/sqrt(in) (+-1 for in = 0) from ``key`` split in two, so equal keys give
    equal arrays."""
    dtype = jax.dtypes.canonicalize_dtype(jnp.float64) if dtype is None else dtype  # Equinox's default float
    wkey, bkey = jax.random.split(key, 2)
    n_in, n_out = _features(in_features), _features(out_features)
    lim = 1.0 if n_in == 0 else 1 / math.sqrt(n_in)
    weight = jax.random.uniform(wkey, (n_out, n_in), dtype, minval=-lim, maxval=lim) if with_weight else None
    bias = jax.random.uniform(bkey, (n_out,), dtype, minval=-lim, maxval=lim) if use_bias else None
    return weight, bias


def _promote(*arrays):
    """The arrays (None passes through) in their promoted dtype, as ``weight @ x + bias`` gives."""
    dtype = jnp.result_type(*(a for a in arrays if a is not None))
    return tuple(None if a is None else a.astype(dtype) for a in arrays)


def _flat_residual(residual, x):
    """A per-example ``residual`` (None passes) as the (features,) row the ops take, in x's dtype."""
    return None if residual is None else residual_like(residual, x).reshape(-1)


class Linear(eqx.nn.Linear):
    """``equinox.nn.Linear`` on the fused GEMM, plus ``activation`` (static): None (Equinox's
    Linear), a name or a ``jax.nn`` function fused into the GEMM's epilogue, or any other callable
    applied after it (see :func:`cutelayers.ops.fused_linear`)."""

    activation: Any = eqx.field(static=True)

    def __init__(self, in_features: int | Literal["scalar"], out_features: int | Literal["scalar"],
                 use_bias: bool = True, dtype=None, *, activation: Any = None, key: PRNGKeyArray):
        super().__init__(in_features, out_features, use_bias, dtype, key=key)
        self.activation = activation

    def __call__(self, x: Array, *, residual: Array | None = None, key: PRNGKeyArray | None = None,
                 parts: int | None = None) -> Array:
        """``x`` (in_features,) -- () if "scalar" -- -> (out_features,) -- () if "scalar" --, in
        the promoted dtype of x and the parameters (as ``weight @ x + bias``). ``residual``, shaped
        like the result, optional: added after the activation (cast to the result dtype). ``parts``,
        optional: the result as a tuple of that many equal blocks, each its own array (attention's
        q, k, v; :func:`cutelayers.ops.split_linear`), for a plain projection. ``key`` is ignored."""
        check_parts("Linear", parts, self.out_features, self.activation, residual)
        if jnp.shape(x) != _shape(self.in_features) or not kernels_serve(
                "Linear", empty_blocker(out_features=self.out_features)
                or array_blocker(jnp.reshape(x, -1), weight=self.weight.dtype, bias=_dtype(self.bias))):
            return split_result(finish_linear("Linear", super().__call__(x, key=key), self.activation, residual), parts)
        x, weight, bias = _promote(jnp.reshape(x, -1), self.weight, self.bias)
        if parts is not None:
            return split_linear(x, weight, bias, parts=parts, kernel_layout="nk")
        # the GEMMs read the (out, in) weight as stored; its gradient comes back (out, in) too
        y = fused_linear(x, weight, bias, activation=self.activation, residual=_flat_residual(residual, x),
                         kernel_layout="nk")
        return y.reshape(_shape(self.out_features))


class Embedding(eqx.nn.Embedding):
    """``equinox.nn.Embedding`` whose weight gradient sums repeated ids before its scatter, in
    float32 (:func:`cutelayers.ops.embed`); under ``jax.vmap`` the whole batch of ids is one
    lookup and one gradient."""

    def __call__(self, x, *, key: PRNGKeyArray | None = None) -> Array:
        """``x`` a scalar integer id -> (embedding_size,) (an id out of range clamps, as
        ``weight[x]`` does). ``key`` is ignored."""
        ids = jnp.asarray(x) if eqx.is_array_like(x) else x
        if jnp.shape(ids) != () or not kernels_serve(
                "Embedding", embed_blocker(ids, self.num_embeddings, self.embedding_size, weight=self.weight.dtype)):
            return super().__call__(x, key=key)
        return embed(self.weight, ids, mode="clip")


class MLP(eqx.Module):
    """Transformer feed-forward block, ``fc1`` -> ``activation`` -> ``fc2`` (+ ``residual``), as one
    :func:`cutelayers.ops.mlp` call: two fused GEMMs, and in the backward the activation's
    derivative inside the hidden-gradient GEMM.

    Arrays: those of the two ``equinox.nn.Linear`` fields ``fc1`` (in_features -> hidden_features)
    and ``fc2`` (hidden_features -> out_features), initialised as Equinox initialises them from
    ``key`` split in two (``fc1`` from the first half, ``fc2`` from the second), so a stock module
    with two such fields loads unchanged and equal keys give equal arrays. (``equinox.nn.MLP`` keeps
    its layers in a ``layers`` tuple instead; this is not a drop-in for it.)

    Args:
      in_features, hidden_features, out_features: the widths of the input (or "scalar"), the
        hidden layer and the output (or "scalar").
      use_bias, dtype: as ``equinox.nn.Linear``'s, for both layers.
      activation (static): between the layers: a name or ``jax.nn`` function fused into the GEMM
        epilogue ('gelu', jax.nn.gelu's tanh approximation, by default; see
        :func:`cutelayers.ops.fused_linear` for the list), None for none, any other callable,
        applied unfused, or a gated one, 'swiglu' / 'geglu': then ``fc1`` has 2 x hidden_features
        outputs, the gate and value halves (:func:`cutelayers.ops.mlp`).
      key: the initialisation's random key.

    Unbatched, as Equinox layers are; under ``jax.vmap`` the op folds the batch into rows (one
    launch per GEMM, the weight gradients one GEMM over all rows). The computation runs in the
    promoted dtype of x and all the arrays. Arrays the op cannot take (complex or other dtypes),
    ``in_features=0`` or an ``x`` of another shape run the stock computation, ``fc1`` and
    ``fc2``'s own calls (Equinox's own result or error).
    """

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    activation: Any = eqx.field(static=True)

    def __init__(self, in_features: int | Literal["scalar"], hidden_features: int,
                 out_features: int | Literal["scalar"], use_bias: bool = True, dtype=None, *,
                 activation: Any = "gelu", key: PRNGKeyArray):
        check_mlp("MLP", activation, hidden_features=hidden_features)
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(in_features, fc1_features(activation, hidden_features), use_bias, dtype, key=k1)
        self.fc2 = eqx.nn.Linear(hidden_features, out_features, use_bias, dtype, key=k2)
        self.activation = activation

    def __call__(self, x: Array, residual: Array | None = None, *, key: PRNGKeyArray | None = None) -> Array:
        """``x`` (in_features,) -- () if "scalar" -- -> (out_features,) -- () if "scalar" --.
        ``residual``, shaped like the result, optional: added to ``fc2``'s output (cast to the
        result dtype). ``key`` is ignored."""
        fc1, fc2 = self.fc1, self.fc2
        arrays = (fc1.weight, fc1.bias, fc2.weight, fc2.bias)
        names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        if jnp.shape(x) != _shape(fc1.in_features) or not kernels_serve(
                "MLP", array_blocker(jnp.reshape(x, -1), **{n: _dtype(a) for n, a in zip(names, arrays)})):
            return finish_mlp("MLP", fc1, fc2, x, self.activation, residual)
        x, w1, b1, w2, b2 = _promote(jnp.reshape(x, -1), *arrays)
        y = mlp(x, w1, b1, w2, b2, activation=self.activation, residual=_flat_residual(residual, x),
                kernel_layout="nk")
        return y.reshape(_shape(fc2.out_features))


class LMHead(eqx.Module):
    """Language-model head and its loss in one: cross-entropy of ``weight @ h + bias`` against
    ``labels``, never materialising the (tokens, vocab_size) logits
    (:func:`cutelayers.ops.linear_cross_entropy`).

    Arrays as ``equinox.nn.Linear(in_features, vocab_size)``'s -- ``weight`` (vocab_size,
    in_features), ``bias`` (vocab_size,) or None, the same initialisation -- so a Linear head's
    checkpoint loads unchanged. The op reads that (vocab_size, in_features) weight as stored.

    Unlike ``Linear``, the call takes the whole batch: ``h`` (..., in_features) and ``labels``
    (...) of any leading shape, reduced to one loss -- better than ``jax.vmap``, under which each
    example has its own mean and the gradient a per-example (vocab_size, in_features) weight.

    Weight tying: with ``tie_embedding=True`` the head has no weight (``weight`` is None); pass
    the (vocab_size, in_features) embedding table at each call, ``head(h, labels,
    embedding=table)`` (e.g. an ``equinox.nn.Embedding``'s ``weight``).

    ``reduction`` ("mean" over the tokens that are not ``ignore_index``, "sum" or "none"),
    ``ignore_index``, ``label_smoothing``, ``z_loss``, ``logit_soft_cap`` and ``chunk_size``
    (static fields) are those of ``linear_cross_entropy``.
    """

    weight: Array | None
    bias: Array | None
    in_features: int = eqx.field(static=True)
    vocab_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    tie_embedding: bool = eqx.field(static=True)
    reduction: str = eqx.field(static=True)
    ignore_index: int | None = eqx.field(static=True)
    label_smoothing: float = eqx.field(static=True)
    z_loss: float = eqx.field(static=True)
    logit_soft_cap: float | None = eqx.field(static=True)
    chunk_size: int | None = eqx.field(static=True)

    def __init__(self, in_features: int, vocab_size: int, use_bias: bool = True, dtype=None, *,
                 tie_embedding: bool = False, reduction: str = "mean", ignore_index: int | None = None,
                 label_smoothing: float = 0.0, z_loss: float = 0.0, logit_soft_cap: float | None = None,
                 chunk_size: int | None = None, key: PRNGKeyArray):
        self.weight, self.bias = _linear_init(key, in_features, vocab_size, use_bias, dtype,
                                              with_weight=not tie_embedding)
        self.in_features, self.vocab_size, self.use_bias = in_features, vocab_size, use_bias
        self.tie_embedding, self.reduction = tie_embedding, reduction
        self.ignore_index, self.chunk_size = ignore_index, chunk_size
        self.label_smoothing, self.z_loss, self.logit_soft_cap = label_smoothing, z_loss, logit_soft_cap

    def __call__(self, h: Array, labels: Array, *, embedding: Array | None = None,
                 key: PRNGKeyArray | None = None) -> Array:
        """``h`` (..., in_features), ``labels`` (...) integers -> float32 loss: a scalar, or (...)
        for reduction="none"; ``key`` is ignored."""
        check_tied_embedding("LMHead", self.tie_embedding, embedding, self.vocab_size, self.in_features)
        table = {"embedding": embedding} if self.tie_embedding else {"weight": self.weight}
        promoted = _promote(h, *table.values(), self.bias)
        check_head_dtype("LMHead", promoted[0].dtype, h=h, **table, bias=self.bias)
        h, weight, bias = promoted
        return lm_head_loss(self, h, weight, bias, labels, vocab_major=True)


class MeanPoolClassifier(eqx.Module):
    """Masked mean pooling over the sequence, then a :class:`Linear` ``head`` to ``num_classes``.

    Unbatched, as Equinox layers are: ``x`` (seq, in_features), ``mask`` (seq,) bool or 0/1
    (nonzero keeps a position) -> logits (num_classes,) in the promoted dtype of the pooled input
    and the parameters; use ``jax.vmap`` for a batch. A row that keeps no position pools to 0
    (its logits are the bias).
    """

    head: Linear

    def __init__(self, in_features: int, num_classes: int, use_bias: bool = True, dtype=None, *,
                 key: PRNGKeyArray):
        self.head = Linear(in_features, num_classes, use_bias, dtype, key=key)

    def __call__(self, x: Array, mask: Array, *, key: PRNGKeyArray | None = None) -> Array:
        """``x`` (seq, in_features), ``mask`` (seq,) -> logits (num_classes,); ``key`` is ignored."""
        return self.head(masked_mean_pool(x, mask))
