"""GPU benchmark of layer_norm / rms_norm and their fused residual adds (add_layer_norm /
add_rms_norm) against XLA's compiled jnp formula.

``bench_norms(ns, dtype, rows)`` times, for each N, x of (M, N) with M = ``rows`` (default: x is
256 MiB):

* ``fwd``: y from x, scale (and bias); minimum bytes = read x + write y; with the residual add
  4 |x| (x and the residual read, y and the sum written);
* ``fwd+bwd``: y, then dx, dscale (and dbias) from x and dy; minimum bytes = 5 |x| (x read by
  both passes, y and dx written, dy read; parameters and row statistics are negligible); with the
  residual add 8 |x| (the backward also reads the sum's gradient; the sum replaces x), the
  gradient x and the residual share returned once (see ``_fwd_bwd``). One program holds both
  passes with dy given up front, so XLA may fuse them and read x once for y and dx together
  (below the floor counted here);
* ``step``: the same work as a training step runs it, where the backward's cotangent exists only
  after the forward's output (the rest of the network runs between them): dy passes through an
  ``optimization_barrier`` with y, so neither side can start the backward's reads before y is
  written. Same minimum bytes as ``fwd+bwd``.

Parameters have x's dtype by default, so every row operand moves in 128-bit vectors; with
``param_dtype`` float32 (what Flax's modules train with) they are float32, and both sides still
return x's dtype (as a Flax module with ``dtype`` set does). Results carry the same keys as
:func:`cutelayers.bench.reduce.bench_reduce`'s, plus ``pass`` and ``params`` (the parameters' dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench.timing import measured_bandwidth, result_row, time_fn
from cutelayers.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm

X_BYTES = 256 << 20
DEFAULT_NS = [768, 1024, 4096, 8192, 16384, 65536]  # 768: GPT-2's width


def _plain(center: bool):
    """The jnp formula XLA compiles itself (fp32 statistics, output in x's dtype)."""

    def norm(x, scale, bias=None):
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, -1, keepdims=True) if center else 0.0
        y = (x32 - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(x32 - mean), -1, keepdims=True) + 1e-6)
        y = y * scale.astype(jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)

    return norm


def _plain_add(center: bool):
    """The residual add, then :func:`_plain`: (y, x + residual)."""
    norm = _plain(center)

    def add_norm(x, residual, scale, bias=None):
        summed = x + residual
        return norm(summed, scale, bias), summed

    return add_norm


def _fwd_bwd(f, shared_grad: bool = False, step: bool = False):
    """Forward and backward of f, every result's cotangent dy. ``shared_grad`` (the residual
    adds): x's and the residual's gradients are one value, d(x + residual), returned once -- a
    model reads that one buffer in both places, while a jit returning it twice writes it twice
    (for the kernels' backward, a copy: 2 |x| more than the floor counts). ``step``: dy reaches
    the backward only with y written (an ``optimization_barrier`` over both), as in a training
    step, where dy comes from the layers that read y."""
    def run(dy, *args):
        y, vjp = jax.vjp(f, *args)
        if step:
            y, dy = jax.lax.optimization_barrier((y, dy))
        grads = vjp(jax.tree.map(lambda _: dy, y))
        return y, (grads[:1] + grads[2:] if shared_grad else grads)

    return run


OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
PASSES = ("fwd", "fwd+bwd", "step")


def bench_norms(ns: list[int] | None = None, dtype=jnp.bfloat16, rows: int | None = None,
                ops: tuple[str, ...] = OPS, passes: tuple[str, ...] = PASSES, param_dtype=None) -> list[dict]:
    """Time ``ops`` (of :data:`OPS`) in ``passes`` (of :data:`PASSES`) for each N in ``ns`` on
    ``rows`` rows (default: x is 256 MiB), scale and bias in ``param_dtype`` (default: x's dtype);
    one dict per row."""
    for name, given, allowed in (("ops", ops, OPS), ("passes", passes, PASSES)):
        if not given or set(given) - set(allowed):
            raise ValueError(f"{name} {tuple(given)!r}: choose one or more of {allowed}")
    ns = ns or DEFAULT_NS
    dtype = jnp.dtype(dtype)
    param_dtype = jnp.dtype(param_dtype or dtype)
    bw = measured_bandwidth()
    key = jax.random.key(0)
    results = []
    for n in ns:
        m = rows or max(X_BYTES // (n * dtype.itemsize), 1)
        kx, kd, ks = jax.random.split(jax.random.fold_in(key, n), 3)
        x = jax.random.normal(kx, (m, n), jnp.float32).astype(dtype)
        dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
        residual = jax.random.normal(jax.random.fold_in(kx, 1), (m, n), jnp.float32).astype(dtype)
        scale = (1.0 + 0.1 * jax.random.normal(ks, (n,), jnp.float32)).astype(param_dtype)
        bias = (0.1 * jax.random.normal(jax.random.fold_in(ks, 1), (n,), jnp.float32)).astype(param_dtype)
        x_bytes = x.size * dtype.itemsize
        for name, ours, xla, params, adds in (
            ("layer_norm", layer_norm, _plain(True), (scale, bias), False),
            ("rms_norm", rms_norm, _plain(False), (scale,), False),
            ("add_layer_norm", add_layer_norm, _plain_add(True), (residual, scale, bias), True),
            ("add_rms_norm", add_rms_norm, _plain_add(False), (residual, scale), True),
        ):
            if name not in ops:
                continue
            fwd_bytes, fwd_bwd_bytes = (4, 8) if adds else (2, 5)
            for pass_, nbytes, make in (("fwd", fwd_bytes * x_bytes, lambda f: f),
                                        ("fwd+bwd", fwd_bwd_bytes * x_bytes,
                                         functools.partial(_fwd_bwd, shared_grad=adds)),
                                        ("step", fwd_bwd_bytes * x_bytes,
                                         functools.partial(_fwd_bwd, shared_grad=adds, step=True))):
                if pass_ not in passes:
                    continue
                args = (x, *params) if pass_ == "fwd" else (dy, x, *params)
                with cl.use_backend("cute"):
                    t = time_fn(jax.jit(make(functools.partial(ours, dtype=dtype))), *args)
                t_xla = time_fn(jax.jit(make(xla)), *args)
                results.append(result_row(name, x.shape, dtype, nbytes, t, t_xla, bw,
                                          **{"pass": pass_, "params": param_dtype.name}))
    return results
