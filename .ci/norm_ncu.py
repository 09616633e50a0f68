"""A norm op's forward and backward, ours, launched for Nsight Compute:
``python .ci/norm_ncu.py [OP] [ROWSxN] [PARAM_DTYPE]`` (default rms_norm 512x262144 bfloat16; OP one of
``cutelayers.bench.norms.OPS``; bf16 x and dy, random normal data; the tuned tables as the op finds
them). Profiling starts after the program is compiled and run once (``cuProfilerStart``; ncu runs
with ``--profile-from-start off``), so ncu sees one call's kernels: the forward, the backward and
XLA's sum of the dscale / dbias partials."""
import ctypes
import functools
import sys

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench.norms import OPS, _fwd_bwd

op, shape, param_dtype = (sys.argv[1:] + ["rms_norm", "512x262144", "bfloat16"][len(sys.argv) - 1:])[:3]
if op not in OPS:
    sys.exit(f"norm_ncu: op {op!r}: choose one of {OPS}")
m, n = (int(v) for v in shape.split("x"))
keys = jax.random.split(jax.random.key(0), 5)
x, dy, residual = (jax.random.normal(k, (m, n), jnp.float32).astype(jnp.bfloat16) for k in keys[:3])
scale = (1.0 + 0.1 * jax.random.normal(keys[3], (n,), jnp.float32)).astype(param_dtype)
bias = (0.1 * jax.random.normal(keys[4], (n,), jnp.float32)).astype(param_dtype)
args = ((residual,) if op.startswith("add_") else ()) + ((scale, bias) if "layer" in op else (scale,))
fwd_bwd = _fwd_bwd(functools.partial(getattr(cl.ops, op), dtype=jnp.bfloat16))  # the benchmark's fwd+bwd
on_gpu = jax.default_backend() == "gpu"
with cl.use_backend("cute" if on_gpu else "reference"):  # off the GPU: a check of the script alone
    step = jax.jit(fwd_bwd).lower(dy, x, *args).compile()
jax.block_until_ready(step(dy, x, *args))
if on_gpu:
    ctypes.CDLL("libcuda.so.1").cuProfilerStart()
jax.block_until_ready(step(dy, x, *args))
print(f"{op} {m}x{n}, {param_dtype} parameters: " + ("one profiled call" if on_gpu else "no GPU, nothing profiled"))
