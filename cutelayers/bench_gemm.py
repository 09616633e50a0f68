"""GEMM benchmark: ``python -m cutelayers.bench gemm [--shapes MxKxN ...] [--dtype bfloat16]``.

For each M x K x N, bf16 and activation gelu by default: TFLOP/s of ``fused_linear`` forward
(2MNK flops) and forward + backward (6MNK: y, dx, dkernel), next to XLA's ``gelu(x @ w + b)`` and
its VJP, and a plain XLA matmul, all timed in the same process.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench import time_fn
from cutelayers.ops.linear import ACTIVATION_FUNCTIONS, fused_linear

SHAPES = [(8192, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096), (4096, 1024, 4096), (16, 4096, 4096)]

SASS_HINT = """\
# To confirm the kernels issue HGMMA (warpgroup MMA) instructions, dump their cubin and SASS:
#   CUTE_DSL_KEEP=ptx,cubin,sass CUTE_DSL_DUMP_DIR=/tmp/cute_dump python -m cutelayers.bench gemm --shapes 4096x1024x4096
#   grep -c HGMMA /tmp/cute_dump/*linear*.sass      # or: cuobjdump -sass /tmp/cute_dump/<kernel>.sm_90a.cubin | grep HGMMA
# (sass needs nvdisasm >= 12.9: a CUDA toolkit on CUDA_HOME, or pip install 'nvidia-cutlass-dsl[sass]').
# Kernels compile once per process; clear the DSL's disk cache (CUTE_DSL_NO_CACHE=1) so the dump happens."""


def _time_pair(ours, xla, args):
    """(seconds ours, seconds xla): ours traced and compiled under the CuTe backend."""
    with cl.use_backend("cute"):
        t_ours = time_fn(jax.jit(ours), *args)
    return t_ours, time_fn(jax.jit(xla), *args)


def bench_gemm(shapes=SHAPES, dtype=jnp.bfloat16, activation: str = "gelu") -> list[dict]:
    """Time fused_linear against XLA for every (M, K, N) in ``shapes``; returns one dict per shape
    with TFLOP/s for ours / XLA forward and forward + backward, and the plain matmul's."""
    act = ACTIVATION_FUNCTIONS[activation]
    results = []
    for m, k, n in shapes:
        keys = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(dtype)
        w = (jax.random.normal(keys[1], (k, n), jnp.float32) / k**0.5).astype(dtype)
        b = jax.random.normal(keys[2], (n,), jnp.float32).astype(dtype)
        dy = jax.random.normal(keys[3], (m, n), jnp.float32).astype(dtype)

        def ours(x, w, b):
            return fused_linear(x, w, b, activation=activation)

        def xla(x, w, b):
            return act(x @ w + b)

        def vjp_of(f):
            return lambda x, w, b, dy: jax.vjp(f, x, w, b)[1](dy)

        fwd, fwd_xla = _time_pair(ours, xla, (x, w, b))
        train, train_xla = _time_pair(vjp_of(ours), vjp_of(xla), (x, w, b, dy))
        matmul = time_fn(jax.jit(lambda x, w: x @ w), x, w)
        flops = 2.0 * m * n * k
        results.append(dict(
            m=m, k=k, n=n, dtype=jnp.dtype(dtype).name, activation=activation,
            fwd_tflops=flops / fwd / 1e12, xla_fwd_tflops=flops / fwd_xla / 1e12,
            matmul_tflops=flops / matmul / 1e12,
            train_tflops=3 * flops / train / 1e12, xla_train_tflops=3 * flops / train_xla / 1e12,
            fwd_vs_xla=fwd_xla / fwd, fwd_vs_matmul=matmul / fwd, train_vs_xla=train_xla / train,
        ))
    return results


def print_table(results: list[dict]) -> None:
    print("| M x K x N | dtype | act | fwd TFLOP/s | XLA fused fwd | XLA matmul | fwd speedup vs XLA | "
          "fwd vs matmul | fwd+bwd TFLOP/s | XLA fwd+bwd | fwd+bwd speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['m']} x {r['k']} x {r['n']} | {r['dtype']} | {r['activation']} | {r['fwd_tflops']:.0f} | "
              f"{r['xla_fwd_tflops']:.0f} | {r['matmul_tflops']:.0f} | {r['fwd_vs_xla']:.2f} | "
              f"{r['fwd_vs_matmul']:.2f} | {r['train_tflops']:.0f} | {r['xla_train_tflops']:.0f} | "
              f"{r['train_vs_xla']:.2f} |")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxKxN' -> (M, K, N)."""
    m, k, n = (int(v) for v in text.lower().split("x"))
    return m, k, n
