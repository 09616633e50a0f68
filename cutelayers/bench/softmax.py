"""GPU benchmark of softmax / log-softmax and cross-entropy against XLA and optax.

* softmax ``fwd``: y from x; minimum bytes = read x + write y (32768 rows);
* softmax ``bwd``: dx from (y, dy); minimum bytes = read y, dy + write dx (32768 rows);
* cross-entropy ``fwd+bwd``: loss and dlogits from (logits, labels); counted as 2 |logits|
  (read once, write dlogits once), the figure the issue compares against (8192 rows).

``rows`` sets every array's rows instead (a decode batch's few, say). Fewer rows where x would
pass ``MAX_X_BYTES`` (wide rows: N = 256K would make a 16 GiB x, and
the benchmark would run out of memory rather than measure).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import cutelayers as cl
from cutelayers.bench.timing import measured_bandwidth, result_row, time_fn

SOFTMAX_ROWS = 32768
CE_ROWS = 8192
MAX_X_BYTES = 1 << 30


def _rows(rows: int, n: int, dtype) -> int:
    """``rows``, or fewer to keep an (rows, n) array within MAX_X_BYTES."""
    return max(1, min(rows, MAX_X_BYTES // (n * dtype.itemsize)))


def _time_backward(f, x, dy) -> float:
    """The backward alone: dx from (y, dy), y = f(x) computed once outside the timing. The vjp
    function is a pytree, so its residuals are arguments of the timed function, not constants."""
    _, vjp = jax.vjp(f, x)
    return time_fn(jax.jit(lambda vjp, dy: vjp(dy)[0]), vjp, dy)


def bench_softmax(ns: list[int], dtype=jnp.bfloat16, rows: int | None = None) -> list[dict]:
    dtype = jnp.dtype(dtype)
    bw = measured_bandwidth()
    key = jax.random.key(0)
    results = []
    for n in ns:
        kx, kd, kl = jax.random.split(jax.random.fold_in(key, n), 3)
        x = 2 * jax.random.normal(kx, (_rows(rows or SOFTMAX_ROWS, n, dtype), n), dtype)
        dy = jax.random.normal(kd, x.shape, dtype)
        x_bytes = x.size * dtype.itemsize
        with cl.use_backend("cute"):
            t = time_fn(jax.jit(cl.ops.softmax), x)
            t_bwd = _time_backward(cl.ops.softmax, x, dy)
        results.append(result_row("softmax", x.shape, dtype, 2 * x_bytes, t, time_fn(jax.jit(jax.nn.softmax), x), bw))
        results.append(result_row("softmax", x.shape, dtype, 3 * x_bytes, t_bwd,
                                  _time_backward(jax.nn.softmax, x, dy), bw, **{"pass": "bwd"}))
        del x, dy
        logits = 2 * jax.random.normal(kx, (_rows(rows or CE_ROWS, n, dtype), n), dtype)
        labels = jax.random.randint(kl, logits.shape[:1], 0, n)

        def ce(f, labels=labels):
            return jax.jit(jax.value_and_grad(lambda z: jnp.mean(f(z, labels))))

        with cl.use_backend("cute"):
            t = time_fn(ce(cl.ops.softmax_cross_entropy), logits)
        t_xla = time_fn(ce(optax.softmax_cross_entropy_with_integer_labels), logits)
        results.append(result_row("cross_entropy", logits.shape, dtype, 2 * logits.size * dtype.itemsize,
                                  t, t_xla, bw, **{"pass": "fwd+bwd"}))
    return results
