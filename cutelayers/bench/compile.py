"""Compile-time budget: seconds to compile each kernel family, and to load it from the disk cache.

``python -m cutelayers.bench compile``. Needs no GPU: kernels compile for ``CUTE_DSL_ARCH``
(default sm_90a here) through the CUDA lowering, as on a GPU host. Each family is lowered twice:
once into an empty disk cache (a compile) and once more after the in-memory cache is cleared (a
disk load). Budgets (issue 8): reductions <= 2 s each, GEMMs <= 20 s each.
"""

from __future__ import annotations

import os
import tempfile

import jax
import jax.numpy as jnp

import cutelayers as cl

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct


def _cases(n: int, m: int, k: int):
    """(label, budget seconds, function, argument specs); gradients pull in the backward kernels."""
    x, scale, labels = S((m, n), BF16), S((n,), F32), S((m,), jnp.int32)
    xk, w, bias = S((m, k), BF16), S((k, n), BF16), S((n,), BF16)

    def grad_of(f, argnums=0):
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(F32)), argnums)

    return [
        ("reduce_sum", 2, cl.ops.reduce_sum, (x,)),
        ("layer_norm fwd+bwd", 2, grad_of(cl.ops.layer_norm, (0, 1)), (x, scale)),
        ("rms_norm fwd+bwd", 2, grad_of(cl.ops.rms_norm, (0, 1)), (x, scale)),
        ("softmax fwd+bwd", 2, grad_of(cl.ops.softmax), (x,)),
        ("cross_entropy fwd+bwd", 2, grad_of(cl.ops.softmax_cross_entropy), (x, labels)),
        ("fused_linear fwd", 20, lambda a, b, c: cl.ops.fused_linear(a, b, c, activation="gelu"), (xk, w, bias)),
        ("fused_linear fwd+bwd", 20,
         grad_of(lambda a, b, c: cl.ops.fused_linear(a, b, c, activation="gelu"), (0, 1, 2)), (xk, w, bias)),
    ]


def _lower(fn, specs) -> dict[str, cl.KernelStats]:
    cl.clear_cache()
    jax.clear_caches()
    jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
    return cl.cache_info()


def bench_compile(n: int = 4096, m: int = 8192, k: int = 4096) -> list[dict]:
    """One row per case: kernels compiled, compile seconds, disk-load seconds, budget."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    saved = os.environ.get("CUTELAYERS_CACHE_DIR")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as directory, cl.use_backend("cute"):
            os.environ["CUTELAYERS_CACHE_DIR"] = directory
            for label, budget, fn, specs in _cases(n, m, k):
                cold = _lower(fn, specs)
                warm = _lower(fn, specs)
                compile_s = sum(v.compile_seconds for v in cold.values())
                slowest = max(cold.values(), key=lambda v: v.compile_seconds)
                rows.append({
                    "case": label,
                    "kernels": sum(v.compiles for v in cold.values()),
                    "compile s": round(compile_s, 2),
                    "slowest kernel s": round(slowest.compile_seconds, 2),
                    "disk load s": round(sum(v.load_seconds for v in warm.values()), 3),
                    "disk hits": sum(v.disk_hits for v in warm.values()),
                    "budget s (each)": budget,
                    "within": "yes" if max(v.compile_seconds for v in cold.values()) <= budget else "NO",
                })
                print(f"# {label}: {rows[-1]['compile s']} s", flush=True)
    finally:
        cl.clear_cache()
        if saved is None:
            os.environ.pop("CUTELAYERS_CACHE_DIR", None)
        else:
            os.environ["CUTELAYERS_CACHE_DIR"] = saved
    return rows
