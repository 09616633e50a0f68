"""Embedding lookup with a collision-free gradient: ``embed(table, ids, dtype=None)``.

    y[..., :] = table[ids[...], :]                                (cast to ``dtype``)
    dtable[v, :] = sum over positions p with ids[p] == v of dy[p, :]

The forward is XLA's gather. The gradient is where the stock layers lose time: ``jnp.take``'s
transpose is a scatter-add of every token's row, one float atomic per element, and the atomics on
one table row serialize. Real text repeats tokens (byte-level text: a few hundred distinct ids;
BPE: the most common token is several percent of all), so a GPT-2-size step spent 25 ms of its 54
in that scatter on the shipped corpus.

Here the rows are first summed within blocks of :data:`BLOCK_TOKENS` consecutive tokens, on the
tensor cores: per block, ``S @ dy`` with ``S[i, j] = 1`` where token j has token i's id and i is
that id's first position in the block, accumulated in float32. Only those first positions are
scattered (the others are dropped), so a table row takes at most one add per block. The forward
reads the table's rows before casting them (the stock layers cast the whole table first), and the
gradient accumulates in float32 where the stock scatter adds in the compute dtype.

Indices follow ``jnp.take``: a negative id counts from the end; an id out of range gives a NaN row
and no gradient (``mode="clip"``: the nearest row, which takes the gradient, as a scalar
``table[id]`` does). One difference from a scatter: a non-finite value in dy reaches every row its
block of tokens adds to. jnp only, so it runs on every platform; under ``jax.vmap`` the batch folds
into the ids (:mod:`cutelayers.ops._batching`), so ``grad(vmap(f))`` runs one gradient over all
tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cutelayers.kernels.hopper import concrete_dim
from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import as_int32, check_dtype, check_float_array
from cutelayers.ops._zeros import zeros_after
from cutelayers.runtime.sharding import explicit_sharding, typed_like, vary_like

F32 = jnp.float32
BLOCK_TOKENS = 128  # tokens summed per block before the scatter (fastest of 128-1024 on an H100)
MODES = ("fill", "clip")


def _normalized(ids, num_embeddings: int, mode: str):
    """int32 ids in [0, num_embeddings]: negative ones counted from the end; out of range ones
    clamped (``clip``) or ``num_embeddings`` (``fill``: a NaN row forward, no gradient)."""
    ids = jnp.where(ids < 0, ids + num_embeddings, ids)
    if mode == "clip":
        return jnp.clip(ids, 0, num_embeddings - 1).astype(jnp.int32)
    return jnp.where((ids >= 0) & (ids < num_embeddings), ids, num_embeddings).astype(jnp.int32)


def _truncated_to_bfloat16(x):
    """x (float32) with its low 16 bits cleared: exactly a bfloat16, by bits. (A float32 ->
    bfloat16 -> float32 round trip would do the same, but XLA may drop it as excess precision.)"""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, F32)


def _bfloat16_pieces(x):
    """Three bfloat16 arrays whose float32 sum is x to within 2^-22 of it."""
    hi = _truncated_to_bfloat16(x)
    mid = _truncated_to_bfloat16(x - hi)
    return [piece.astype(jnp.bfloat16) for piece in (hi, mid, x - hi - mid)]


def table_grad(dy: jax.Array, ids: jax.Array, num_embeddings: int, block_tokens: int = BLOCK_TOKENS) -> jax.Array:
    """The float32 (num_embeddings, H) gradient of ``take(table, ids)`` for ``dy`` (..., H), summed
    per block of ``block_tokens`` tokens of ids' last axis before the scatter; ``ids`` in
    [0, num_embeddings], where ``num_embeddings`` marks a token that gets no gradient."""
    h = dy.shape[-1]
    if ids.size == 0:  # no token: no blocks to cut (a block of min(block_tokens, 0) tokens)
        return jnp.zeros((num_embeddings, h), F32)
    # Blocks lie within a row of ids' last axis, so a batch sharded over devices stays so.
    t = ids.shape[-1] if ids.ndim else 1
    ids, dy = ids.reshape(-1, t), dy.reshape(-1, t, h)
    # A dropped token's dy must not reach the block's sums (0 * inf is nan).
    dy = jnp.where((ids < num_embeddings)[..., None], dy, 0)
    if concrete_dim(t) is None:  # a symbolic token count (jax.export) cannot be cut into blocks
        zeros = zeros_after(dy, (num_embeddings, h))
        return zeros.at[ids.reshape(-1)].add(dy.reshape(-1, h).astype(F32), mode="drop")
    block = min(block_tokens, t)
    pad = -t % block
    if pad:
        ids = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=num_embeddings)
        dy = jnp.pad(dy, ((0, 0), (0, pad), (0, 0)))
    ids = ids.reshape(ids.shape[0], -1, block)
    dy = dy.reshape(*ids.shape, h)
    same = ids[..., :, None] == ids[..., None, :]  # (rows, blocks, i, j)
    earlier = jnp.tri(block, k=-1, dtype=bool)  # j < i
    first = ~jnp.any(same & earlier[None, None], axis=-1)  # no earlier token of the same id
    if dy.dtype == F32:  # three bfloat16 pieces hold float32's 24 bits: the GEMM loses none
        dy = jnp.concatenate(_bfloat16_pieces(dy), axis=-1)
    gather = (same & first[..., None]).astype(dy.dtype)  # 0 / 1: exact in every dtype
    sums = jnp.einsum("rnij,rnjh->rnih", gather, dy, preferred_element_type=F32)
    if sums.shape[-1] != h:
        sums = sums[..., :h] + sums[..., h:2 * h] + sums[..., 2 * h:]
    targets = jnp.where(first, ids, num_embeddings)  # (rows, blocks, i): not flattened, which
    # under Explicit mesh axes jax refuses for a sharded dim past the first (a vmap's batch).
    # The row-sharded sums go into a replicated table: JAX types that scatter only when told its
    # result's sharding (its zeros must carry the mesh, too).
    replicated = explicit_sharding(sums, lambda spec: jax.sharding.PartitionSpec())
    zeros = zeros_after(sums, (num_embeddings, h), out_sharding=replicated)
    return zeros.at[targets].add(sums, mode="drop", out_sharding=replicated)


@functools.cache
def _folded_table_grad(num_embeddings: int):
    """:func:`table_grad` for one table size, vmappable without a batched scatter: a batch of B
    gradients is one gradient of a B-times-larger table, example b's ids offset by b tables."""

    def batched(dy, ids):
        b = ids.shape[0]
        offset = (jnp.arange(b, dtype=jnp.int32) * num_embeddings).reshape(b, *(1,) * (ids.ndim - 1))
        ids = jnp.where(ids < num_embeddings, ids + offset, b * num_embeddings)  # "no gradient" stays so
        return _folded_table_grad(b * num_embeddings)(dy, ids).reshape(b, num_embeddings, dy.shape[-1])

    return fold_batch(functools.partial(table_grad, num_embeddings=num_embeddings), batched=batched)


@functools.cache
def _embed_fn(num_embeddings: int, table_dtype, dtype, mode: str):
    """The differentiable lookup for one table size, pair of dtypes and index mode:
    ``(table, ids) -> rows``."""

    @jax.custom_vjp
    def lookup(table, ids):
        return lookup_fwd(table, ids)[0]

    def lookup_fwd(table, ids):
        ids = _normalized(ids, num_embeddings, mode)
        # ids' spec, the features whole
        rows_sharding = explicit_sharding(ids, lambda spec: jax.sharding.PartitionSpec(*spec, None))
        rows = table.at[ids].get(mode="fill", fill_value=jnp.nan, out_sharding=rows_sharding)
        return rows.astype(dtype), (ids, table)  # the backward reads the table's type alone

    def lookup_bwd(res, dy):
        ids, table = res
        (dtable,) = typed_like((table,), (_folded_table_grad(num_embeddings)(dy, ids).astype(table_dtype),))
        return dtable, None

    lookup.defvjp(lookup_fwd, lookup_bwd)
    return fold_batch(lookup, shared=(0,), per_example=lookup)


def embed(table, ids, dtype=None, mode: str = "fill") -> jax.Array:
    """Rows of ``table`` at ``ids``: what ``jnp.take(table, ids, axis=0)`` gives, with a faster
    gradient (see the module docstring).

    Args:
      table: (num_embeddings, features), bfloat16, float16 or float32.
      ids: integer array of any shape; negative ids count from the end.
      dtype: the result's dtype (default: the table's); the rows are cast after the lookup.
      mode: where an id is out of range, ``"fill"``: a NaN row (``jnp.take``'s rule, Flax's
        ``Embed``), and no gradient; ``"clip"``: the nearest row, which also takes its gradient
        (a scalar ``table[id]``'s rule: Equinox's ``Embedding``).

    Returns:
      ``ids.shape + (features,)`` in ``dtype``. The gradient with respect to ``table`` is summed in
      float32 and returned in the table's dtype; ``ids`` get none.
    """
    op = "embed"
    table = check_float_array(op, "table", table, min_rank=2)
    if table.ndim != 2:
        raise ValueError(f"{op}: argument 'table' must have rank 2 (num_embeddings, features); got shape "
                         f"{tuple(table.shape)}")
    if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
        given = getattr(ids, "dtype", type(ids).__name__)
        raise TypeError(f"{op}: argument 'ids' must be an integer array; got {given}")
    if mode not in MODES:
        raise ValueError(f"{op}: argument 'mode' is {mode!r}; allowed: {', '.join(map(repr, MODES))}")
    dtype = jnp.dtype(table.dtype) if dtype is None else check_dtype(op, "dtype", dtype)
    ids = as_int32(ids)  # uint8 ids of a 256-row table: ids + 256 must not wrap in uint8
    if table.shape[0] == 0 and ids.size:
        raise ValueError(f"{op}: argument 'table' has no rows (shape {tuple(table.shape)}) to look {ids.size} "
                         "id(s) up in")
    # inside shard_map: the table varies like the ids, so its gradient is summed over the shards
    (table,) = vary_like(ids, table)
    return _embed_fn(table.shape[0], jnp.dtype(table.dtype), dtype, mode)(table, ids)
