"""The plain GEMM, ours and XLA's (cuBLAS), launched for Nsight Compute:
``python .ci/gemm_ncu.py [MxKxN]`` (default 8192x4096x4096, bf16, random normal data). Each runs
WARMUP times, then once more: ``.ci/gemm-ncu`` profiles the last launch of each. Profiling starts
only after both are compiled (``cuProfilerStart``; ncu runs with ``--profile-from-start off``):
XLA's GEMM autotuner launches candidate cuBLAS kernels while compiling, which would otherwise
take ncu's launch counts."""
import ctypes
import sys

import jax
import jax.numpy as jnp

import cutelayers as cl

WARMUP = 2
m, k, n = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8192x4096x4096").split("x"))
kx, kw = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
with cl.use_backend("cute"):
    ours = jax.jit(lambda x, w: cl.ops.fused_linear(x, w)).lower(x, w).compile()
xla = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
jax.block_until_ready((x, w))
ctypes.CDLL("libcuda.so.1").cuProfilerStart()
for fn in (ours, xla):  # each fn's launches back to back: WARMUP, then the profiled one
    for _ in range(WARMUP + 1):
        jax.block_until_ready(fn(x, w))
print(f"{m}x{k}x{n}: ours then XLA, {WARMUP + 1} launches each")
