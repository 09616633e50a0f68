"""Drop-in swap: a model written with the framework's layers, then with cutelayers' -- same code,
other import -- loading the stock model's checkpoint, outputs compared.

    python examples/drop_in_swap.py [--seed S] [--dtype {bfloat16,float32}]

One small network (LayerNorm -> Linear -> gelu -> Linear -> residual -> RMSNorm -> Linear) per
framework, parameterised by the layer namespace it is built from:

* Flax NNX: ``flax.nnx``        vs ``cutelayers.flax.nnx``   (state as a msgpack pure dict)
* Equinox:  ``equinox.nn``      vs ``cutelayers.equinox``    (eqx.tree_serialise_leaves)
* Flax linen: ``flax.linen``    vs ``cutelayers.flax.linen`` (flax.serialization.to_bytes)

The cutelayers model is initialised from another seed, then restored from the stock model's bytes,
so matching outputs show that the checkpoint -- not the seed -- made them equal. Exit status 1 if
the outputs differ by more than the dtype's tolerance (max |difference| / max |stock output|).
"""

from __future__ import annotations

import argparse
import io
import secrets
import sys

import equinox as eqx
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx

from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx

DIM, HIDDEN, OUT, BATCH = 64, 256, 16, 32
# Outputs are rounded to the compute dtype; the two models round intermediates at different
# points (cutelayers keeps norm statistics and GEMM epilogues in float32).
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-5}


class NnxNet(nnx.Module):
    def __init__(self, layers, dtype, *, rngs: nnx.Rngs):
        self.norm = layers.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.up = layers.Linear(DIM, HIDDEN, dtype=dtype, rngs=rngs)
        self.down = layers.Linear(HIDDEN, DIM, dtype=dtype, rngs=rngs)
        self.final_norm = layers.RMSNorm(DIM, dtype=dtype, rngs=rngs)
        self.head = layers.Linear(DIM, OUT, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.down(jax.nn.gelu(self.up(self.norm(x))))
        return self.head(self.final_norm(x))


class EqxNet(eqx.Module):
    norm: eqx.Module
    up: eqx.Module
    down: eqx.Module
    final_norm: eqx.Module
    head: eqx.Module

    def __init__(self, layers, dtype, *, key):
        up, down, head = jax.random.split(key, 3)
        self.norm = layers.LayerNorm(DIM, dtype=dtype)
        self.up = layers.Linear(DIM, HIDDEN, dtype=dtype, key=up)
        self.down = layers.Linear(HIDDEN, DIM, dtype=dtype, key=down)
        self.final_norm = layers.RMSNorm(DIM, dtype=dtype)
        self.head = layers.Linear(DIM, OUT, dtype=dtype, key=head)

    def __call__(self, x):  # unbatched, as Equinox layers are: x (DIM,)
        x = x + self.down(jax.nn.gelu(self.up(self.norm(x))))
        return self.head(self.final_norm(x))


class LinenNet(linen.Module):
    layers: object  # the module flax.linen or cutelayers.flax.linen
    dtype: object

    @linen.compact
    def __call__(self, x):
        layers, dtype = self.layers, self.dtype
        hidden = layers.Dense(HIDDEN, dtype=dtype)(layers.LayerNorm(dtype=dtype)(x))
        x = x + layers.Dense(DIM, dtype=dtype)(jax.nn.gelu(hidden))
        return layers.Dense(OUT, dtype=dtype)(layers.RMSNorm(dtype=dtype)(x))


# Each *_outputs gives (stock model's output, cutelayers model's output before restoring the stock
# checkpoint, and after).

def nnx_outputs(x, dtype, seed):
    stock = NnxNet(nnx, dtype, rngs=nnx.Rngs(seed))
    blob = flax.serialization.msgpack_serialize(nnx.to_pure_dict(nnx.state(stock, nnx.Param)))
    swapped = NnxNet(cl_nnx, dtype, rngs=nnx.Rngs(seed + 1))
    fresh = swapped(x)
    params = nnx.state(swapped, nnx.Param)
    nnx.replace_by_pure_dict(params, flax.serialization.msgpack_restore(blob))
    nnx.update(swapped, params)
    return stock(x), fresh, swapped(x)


def eqx_outputs(x, dtype, seed):
    stock = EqxNet(eqx.nn, dtype, key=jax.random.key(seed))
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, stock)
    swapped = EqxNet(cl_eqx, dtype, key=jax.random.key(seed + 1))
    fresh = jax.vmap(swapped)(x)
    buffer.seek(0)
    swapped = eqx.tree_deserialise_leaves(buffer, swapped)
    return jax.vmap(stock)(x), fresh, jax.vmap(swapped)(x)


def linen_outputs(x, dtype, seed):
    stock = LinenNet(linen, dtype)
    stock_variables = stock.init(jax.random.key(seed), x)
    blob = flax.serialization.to_bytes(stock_variables)
    swapped = LinenNet(cl_linen, dtype)
    variables = swapped.init(jax.random.key(seed + 1), x)
    fresh = swapped.apply(variables, x)
    restored = flax.serialization.from_bytes(variables, blob)  # the target gives the tree structure
    return stock.apply(stock_variables, x), fresh, swapped.apply(restored, x)


def max_relative_difference(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="seed of inputs and init (default: fresh)")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="bfloat16",
                        help="compute dtype (parameters: float32 in Flax, this dtype in Equinox)")
    args = parser.parse_args(argv)
    seed = secrets.randbits(31) if args.seed is None else args.seed
    dtype, tolerance = jnp.dtype(args.dtype), TOLERANCE[args.dtype]
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((BATCH, DIM)), dtype)
    print(f"seed {seed}; dtype {dtype.name}; tolerance {tolerance:.0e} (max |diff| / max |stock output|)")

    failed = False
    for framework, outputs in (("nnx", nnx_outputs), ("equinox", eqx_outputs), ("linen", linen_outputs)):
        stock, fresh, restored = outputs(x, dtype, seed)
        error, before = max_relative_difference(restored, stock), max_relative_difference(fresh, stock)
        ok = restored.dtype == stock.dtype and error <= tolerance < before
        failed |= not ok
        print(f"{framework:8} stock vs cutelayers after restoring: {error:.1e}  (before: {before:.1e})  "
              f"{restored.dtype}  {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
