"""One GEMM of a layer, ours and XLA's (cuBLAS), launched for Nsight Compute:
``python .ci/gemm_ncu.py [MxKxN [PART]]`` (default 8192x4096x4096 fwd; bf16, random normal data).
The layer is x (M, K) @ w (K, N); PART is which of its GEMMs runs:

* ``fwd``: x @ w;
* ``dx``: dz (M, N) @ wᵀ, the input gradient;
* ``dkernel``: xᵀ @ dz with dz's column sums (the bias gradient), into float32 -- what a layer with
  float32 parameters (the GPT models') runs: ours one launch (its stream-K zeros, where it has any,
  are XLA's), XLA's cuBLAS and a reduction.

Each runs WARMUP times, then once more: ``.ci/gemm-ncu`` profiles the last launch of each. Profiling
starts only after both are compiled (``cuProfilerStart``; ncu runs with ``--profile-from-start
off``): XLA's GEMM autotuner launches candidate cuBLAS kernels while compiling, which would otherwise
take ncu's launch counts."""
import ctypes
import sys

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.ops.linear import input_grad_fn, weight_grad_fn

WARMUP = 2
F32 = jnp.float32
m, k, n = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8192x4096x4096").split("x"))
part = sys.argv[2] if len(sys.argv) > 2 else "fwd"
PARTS = {  # part -> (ours, XLA's), functions of (x, w, dz)
    "fwd": (lambda x, w, dz: cl.ops.fused_linear(x, w), lambda x, w, dz: x @ w),
    "dx": (lambda x, w, dz: input_grad_fn(True)(dz, w), lambda x, w, dz: dz @ w.T),
    "dkernel": (lambda x, w, dz: weight_grad_fn(True, sums="b", result_dtype=F32)(x[None], dz[None]),
                lambda x, w, dz: (jnp.einsum("mk,mn->kn", x, dz, preferred_element_type=F32),
                                  jnp.sum(dz.astype(F32), axis=0))),
}
if part not in PARTS:
    sys.exit(f"PART must be one of {tuple(PARTS)}; got {part!r}")
kx, kw, kz = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(kx, (m, k), F32).astype(jnp.bfloat16)
w = (jax.random.normal(kw, (k, n), F32) / k**0.5).astype(jnp.bfloat16)
dz = jax.random.normal(kz, (m, n), F32).astype(jnp.bfloat16)
ours_fn, xla_fn = PARTS[part]
with cl.use_backend("cute"):
    ours = jax.jit(ours_fn).lower(x, w, dz).compile()
xla = jax.jit(xla_fn).lower(x, w, dz).compile()
jax.block_until_ready((x, w, dz))
ctypes.CDLL("libcuda.so.1").cuProfilerStart()
for fn in (ours, xla):  # each fn's launches back to back: WARMUP, then the profiled one
    for _ in range(WARMUP + 1):
        jax.block_until_ready(fn(x, w, dz))
print(f"{m}x{k}x{n} {part}: ours then XLA, {WARMUP + 1} launches each")
