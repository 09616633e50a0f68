"""Lower a preset's cutelayers train step (nnx, bf16, value_and_grad of the loss at the training
batch) for CUDA on a CPU-only host, so that every CuTe kernel it runs compiles for sm_90a; run by
``.ci/step-ptxas``, which keeps their PTX and reads ptxas's register and spill counts."""
import sys

import jax
import jax.numpy as jnp

import cutelayers as cl
from models import common
from models.configs import get_config
from training.train import DEFAULTS

name = sys.argv[1]
config = get_config(name, dtype="bfloat16")
model = common.init("nnx", config, jax.random.key(0), abstract=True)
tokens = jax.ShapeDtypeStruct((DEFAULTS[name]["batch_size"], config.seq_len), jnp.int32)
with cl.use_backend("cute"):
    jax.jit(jax.value_and_grad(model.loss)).trace(model.params, tokens, tokens).lower(lowering_platforms=("cuda",))
print(f"lowered the {name} step")
