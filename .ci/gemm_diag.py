"""One GEMM kernel case in this process: ``python .ci/gemm_diag.py CONFIG EPILOGUE M K N``; prints
the relative error against the family's reference (a hang is caught by the caller's timeout)."""
import sys

import jax
import jax.numpy as jnp

from cutelayers.kernels.gemm_config import CONFIGS, EXTRA_CONFIGS
from cutelayers.ops.linear import LinearForward, LinearInputGrad
from cutelayers.runtime.sharding import kernel_call

configs = dict(CONFIGS, **{f"extra{i}": c for i, c in enumerate(EXTRA_CONFIGS)})
config, epilogue, m, k, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
cfg = configs[config]
bf = jnp.bfloat16
keys = jax.random.split(jax.random.key(0), 4)
x = jax.random.normal(keys[0], (1, m, k)).astype(bf)
w = (jax.random.normal(keys[1], (1, k, n)) / k**0.5).astype(bf)
r = jax.random.normal(keys[2], (1, m, n)).astype(bf)
if epilogue == "residual":
    fam, ops = LinearForward("none", False, True, False, cfg), (x, w, r)
elif epilogue == "preact":
    fam, ops = LinearForward("gelu", False, False, True, cfg), (x, w)
elif epilogue == "plain":
    fam, ops = LinearForward("none", False, False, False, cfg), (x, w)
else:  # grad_of: dz (1, m, n) @ w(1, k, n)^T * gelu'(z (1, m, k))
    z = jax.random.normal(keys[3], (1, m, k)).astype(bf)
    fam, ops = LinearInputGrad("gelu", cfg), (r, w, z)
out = jax.block_until_ready(jax.jit(lambda *a: kernel_call(fam, *a))(*ops))
ref = fam.reference(*ops)
err = max(float(jnp.linalg.norm((o.astype(jnp.float32) - q.astype(jnp.float32)).ravel())
                / jnp.linalg.norm(q.astype(jnp.float32).ravel())) for o, q in zip(out, ref))
print(f"{config} {epilogue} {m}x{k}x{n}: rel err {err:.2e}")
