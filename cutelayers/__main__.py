"""``python -m cutelayers``: a short demo -- run a layer, print the backend and the cache stats."""

import argparse
import logging

import jax
import jax.numpy as jnp

import cutelayers as cl


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cutelayers", description=__doc__)
    parser.parse_args(argv)
    try:
        backend = cl.current_backend()
    except ValueError as e:  # a CUTELAYERS_BACKEND naming no backend: said before anything runs
        parser.error(str(e))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    x = jax.random.normal(jax.random.key(0), (4, 128, 1000), jnp.bfloat16)
    f = jax.jit(lambda x: cl.ops.reduce_mean(x))
    y = f(x)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - jnp.mean(x.astype(jnp.float32), -1))))
    g = jax.jit(jax.grad(lambda x: jnp.sum(cl.ops.reduce_max(x.astype(jnp.float32)))))(x)
    print(f"platform: {jax.devices()[0].platform} ({jax.devices()[0].device_kind})")
    print(f"backend setting: {backend}")
    print(f"reduce_mean over {x.shape} {x.dtype}: max |error| vs jnp = {err:.2e}")
    print(f"grad of reduce_max: {int(jnp.sum(g))} of {g.size} entries set (one per row)")
    print("cache_info:", {k: vars(v) for k, v in cl.cache_info().items()} or "{} (reference path: nothing compiled)")


if __name__ == "__main__":
    main()
