"""GPU benchmark of the row reductions (reduce_sum, reduce_max) against XLA's jnp version.

Minimum bytes: read x + write one value per row. Rows as :func:`cutelayers.bench.timing.result_row`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench.timing import measured_bandwidth, result_row, time_fn


def bench_reduce(rows: int, ns: list[int], dtype) -> list[dict]:
    bw = measured_bandwidth()
    key = jax.random.key(0)
    results = []
    for n in ns:
        x = jax.random.normal(key, (rows, n), jnp.float32).astype(dtype)
        nbytes = x.size * x.dtype.itemsize + rows * x.dtype.itemsize
        for name, ours, xla in (
            ("reduce_sum", cl.ops.reduce_sum, lambda x: jnp.sum(x, -1, dtype=jnp.float32).astype(x.dtype)),
            ("reduce_max", cl.ops.reduce_max, lambda x: jnp.max(x, -1)),
        ):
            with cl.use_backend("cute"):
                f = jax.jit(ours)
                t = time_fn(f, x)
            t_xla = time_fn(jax.jit(xla), x)
            results.append(result_row(name, x.shape, dtype, nbytes, t, t_xla, bw))
    return results
