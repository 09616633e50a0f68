"""GPU benchmark of ``embed`` (lookup + table gradient) against the stock layers' ``jnp.take``.

Token ids come from three distributions, because the gradient's cost depends on how often ids
repeat: ``uniform`` over the vocabulary, ``zipf`` (exponent 1.1 over the vocabulary: BPE-like
text, the most common id a few percent of tokens) and ``bytes`` (Zipf over 256 ids: byte-level
text, as the shipped corpus is read). Minimum bytes of fwd+bwd: read the rows and dy, write y
and the float32 table gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cutelayers.bench.timing import time_fn
from cutelayers.ops.embed import BLOCK_TOKENS, embed, table_grad

DISTRIBUTIONS = ("uniform", "zipf", "bytes")


def token_ids(distribution: str, tokens: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``tokens`` int32 ids in [0, vocab) drawn from ``distribution`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    if distribution == "uniform":
        return rng.integers(0, vocab, tokens, dtype=np.int32)
    support = min(vocab, 256) if distribution == "bytes" else vocab
    weights = 1.0 / np.arange(1, support + 1) ** 1.1
    return rng.choice(support, tokens, p=weights / weights.sum()).astype(np.int32)


def bench_embed(tokens: int, hidden: int, vocab: int, dtype, bw: float, blocks=(BLOCK_TOKENS,)) -> list[dict]:
    """fwd+bwd of ``embed`` vs ``jnp.take`` of the table cast to ``dtype`` (what flax's Embed
    runs), per id distribution and per block size of the gradient's pre-summation."""
    key = jax.random.key(0)
    table = jax.random.normal(key, (vocab, hidden), jnp.float32)
    dy = jax.random.normal(jax.random.fold_in(key, 1), (tokens, hidden), jnp.float32).astype(dtype)
    nbytes = 2 * tokens * hidden * jnp.dtype(dtype).itemsize + tokens * hidden * 4 + vocab * hidden * 4
    rows = []
    for distribution in DISTRIBUTIONS:
        ids = token_ids(distribution, tokens, vocab)
        distinct = int(np.unique(ids).size)
        ids = jnp.asarray(ids)

        def stock(table, dy, ids=ids):
            y, pullback = jax.vjp(lambda w: jnp.take(w.astype(dtype), ids, axis=0), table)
            return y, pullback(dy)[0]

        t_xla = time_fn(jax.jit(stock), table, dy)
        for block in blocks:
            def ours(table, dy, block=block, ids=ids):
                y = embed(table, ids, dtype)  # the lookup; the gradient at this block size
                return y, table_grad(dy, ids, vocab, block)

            t = time_fn(jax.jit(ours), table, dy)
            rows.append({"ids": distribution, "distinct": distinct, "block": block,
                             "floor_us": round(nbytes / bw * 1e6, 1), "us": round(t * 1e6, 1),
                             "xla_us": round(t_xla * 1e6, 1), "xla_over_ours": round(t_xla / t, 2),
                             "floor_over_ours": round(nbytes / bw / t, 2)})
    return rows
