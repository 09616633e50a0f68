"""Equinox ``LayerNorm``, ``RMSNorm``, ``Linear`` and heads backed by the cutelayers kernels.

Drop-in replacements for ``equinox.nn.LayerNorm`` / ``equinox.nn.RMSNorm``: the same fields
(``shape``, ``eps``, ``use_weight``, ``use_bias``; arrays ``weight`` / ``bias`` of ``shape``), the
same constructor defaults (``eps=1e-5``; both weight and bias on, also for RMSNorm), the same
unbatched call ``layer(x, state=..., *, key=None)`` with ``x.shape == shape``, returning ``out``
or ``(out, state)``, and the same dtypes: computed in float32, returned in x's dtype.

The statistics span the whole ``shape`` (flattened to one row). Call them under ``jax.vmap`` as
usual: the op's batching rule folds the vmapped axes into rows, so a batch is one kernel launch.

``Linear`` is a drop-in for ``equinox.nn.Linear`` (arrays ``weight`` (out, in) and ``bias``
(out,), the same uniform initialisation and "scalar" features, the unbatched call) running
:func:`cutelayers.ops.fused_linear`, with an extra ``activation`` fused into the GEMM epilogue;
under ``jax.vmap`` a batch is again one launch, and under ``jax.grad`` of the vmap the weight
gradient is one (in, out) GEMM over all rows, not one per example.

Heads: ``LMHead`` (a vocabulary projection shaped like ``Linear(in_features, vocab_size)`` and its
cross-entropy loss in one, without the logits; optionally tied to an embedding table) and
``MeanPoolClassifier`` (masked mean pooling and a ``Linear`` to the classes).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from cutelayers._module_checks import check_tied_embedding
from cutelayers.ops.linear import fused_linear
from cutelayers.ops.lm_head import linear_cross_entropy
from cutelayers.ops.norm import layer_norm, rms_norm
from cutelayers.ops.pool import masked_mean_pool

_NO_STATE = object()  # "no state passed": then only the output is returned


def _default_float(dtype):
    """``dtype``, or Equinox's default float (float64 under jax_enable_x64, else float32)."""
    return jax.dtypes.canonicalize_dtype(jnp.float64) if dtype is None else dtype


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
        dtype = _default_float(dtype)
        shape = _shape(shape)
        self.shape, self.eps, self.use_weight, self.use_bias = shape, eps, use_weight, use_bias
        self.weight = jnp.ones(shape, dtype=dtype) if use_weight else None
        self.bias = jnp.zeros(shape, dtype=dtype) if use_bias else None

    def __call__(self, x: Array, state=_NO_STATE, *, key=None):
        """``x`` of ``shape`` -> normalized array of ``shape`` in x's dtype (and ``state``,
        unchanged, if one was passed)."""
        return _apply(rms_norm, self, x, state)


def _features(n: int | Literal["scalar"]) -> int:
    return 1 if n == "scalar" else n


def _linear_init(key, in_features, out_features, use_bias, dtype, with_weight=True):
    """(weight (out, in) | None, bias (out,) | None) drawn as ``equinox.nn.Linear`` draws them:
    uniform in +-1/sqrt(in) (+-1 for in = 0) from ``key`` split in two, so equal keys give
    equal arrays."""
    dtype = _default_float(dtype)
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


class Linear(eqx.Module):
    """``activation(weight @ x + bias)``; see ``equinox.nn.Linear``.

    ``weight``: (out_features, in_features), ``bias``: (out_features,) or None, dtype ``dtype``
    (default: Equinox's default float), drawn as Equinox does, so equal keys give equal arrays. A
    "scalar" feature count means an input or output of shape ().

    ``activation`` (static): None (Equinox's Linear), a name or a ``jax.nn`` function fused into
    the GEMM's epilogue, or any other callable applied after it (see
    :func:`cutelayers.ops.fused_linear`).
    """

    weight: Array
    bias: Array | None
    in_features: int | Literal["scalar"] = eqx.field(static=True)
    out_features: int | Literal["scalar"] = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    activation: Any = eqx.field(static=True)

    def __init__(self, in_features: int | Literal["scalar"], out_features: int | Literal["scalar"],
                 use_bias: bool = True, dtype=None, *, activation: Any = None, key: PRNGKeyArray):
        self.weight, self.bias = _linear_init(key, in_features, out_features, use_bias, dtype)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.activation = activation

    def __call__(self, x: Array, residual: Array | None = None, *, key: PRNGKeyArray | None = None) -> Array:
        """``x`` (in_features,) -- () if "scalar" -- -> (out_features,) -- () if "scalar" --, in
        the promoted dtype of x and the parameters (as ``weight @ x + bias``). ``residual``, shaped
        like the result, optional: added after the activation in the same kernel (cast to the
        result dtype). ``key`` is ignored."""
        expected = () if self.in_features == "scalar" else (self.in_features,)
        if x.shape != expected:
            raise ValueError(f"Linear: x must have shape {expected} (in_features={self.in_features!r}); "
                             f"got {x.shape}. For a batch, use jax.vmap(linear)(x).")
        x, weight, bias = _promote(x, self.weight, self.bias)
        if residual is not None:
            residual = jnp.asarray(residual).astype(x.dtype).reshape(-1)
        # the transpose is of the weight, once per call, not of the (batched) activations
        y = fused_linear(x.reshape(-1), weight.T, bias, activation=self.activation, residual=residual)
        return y.reshape(()) if self.out_features == "scalar" else y


class LMHead(eqx.Module):
    """Language-model head and its loss in one: cross-entropy of ``weight @ h + bias`` against
    ``labels``, never materialising the (tokens, vocab_size) logits
    (:func:`cutelayers.ops.linear_cross_entropy`).

    Arrays as ``equinox.nn.Linear(in_features, vocab_size)``'s -- ``weight`` (vocab_size,
    in_features), ``bias`` (vocab_size,) or None, the same initialisation -- so a Linear head's
    checkpoint loads unchanged. The op takes the (in_features, vocab_size) transpose, made once
    per call.

    Unlike ``Linear``, the call takes the whole batch: ``h`` (..., in_features) and ``labels``
    (...) of any leading shape, reduced to one loss -- better than ``jax.vmap``, under which each
    example has its own mean and the gradient a per-example (vocab_size, in_features) weight.

    Weight tying: with ``tie_embedding=True`` the head has no weight (``weight`` is None); pass
    the (vocab_size, in_features) embedding table at each call, ``head(h, labels,
    embedding=table)`` (e.g. an ``equinox.nn.Embedding``'s ``weight``).

    ``reduction`` ("mean" over the tokens that are not ``ignore_index``, "sum" or "none"),
    ``ignore_index`` and ``chunk_size`` (static fields) are those of ``linear_cross_entropy``.
    """

    weight: Array | None
    bias: Array | None
    in_features: int = eqx.field(static=True)
    vocab_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    tie_embedding: bool = eqx.field(static=True)
    reduction: str = eqx.field(static=True)
    ignore_index: int | None = eqx.field(static=True)
    chunk_size: int | None = eqx.field(static=True)

    def __init__(self, in_features: int, vocab_size: int, use_bias: bool = True, dtype=None, *,
                 tie_embedding: bool = False, reduction: str = "mean", ignore_index: int | None = None,
                 chunk_size: int | None = None, key: PRNGKeyArray):
        self.weight, self.bias = _linear_init(key, in_features, vocab_size, use_bias, dtype,
                                              with_weight=not tie_embedding)
        self.in_features, self.vocab_size, self.use_bias = in_features, vocab_size, use_bias
        self.tie_embedding, self.reduction = tie_embedding, reduction
        self.ignore_index, self.chunk_size = ignore_index, chunk_size

    def __call__(self, h: Array, labels: Array, *, embedding: Array | None = None,
                 key: PRNGKeyArray | None = None) -> Array:
        """``h`` (..., in_features), ``labels`` (...) integers -> float32 loss: a scalar, or (...)
        for reduction="none"; ``key`` is ignored."""
        check_tied_embedding("LMHead", self.tie_embedding, embedding, self.vocab_size, self.in_features)
        h, weight, bias = _promote(h, embedding if self.tie_embedding else self.weight, self.bias)
        return linear_cross_entropy(h, weight.T, labels, bias=bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, chunk_size=self.chunk_size)


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
