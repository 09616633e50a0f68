"""The weight-gradient GEMM (dkernel = xᵀ @ dz, contracting the rows) at the GPT-2 layers' (K, N),
16384 rows: every (config, schedule) -- whole tiles, or stream-K ("sk") -- timed next to XLA's
einsum, on the device: ``python .ci/dkernel_sweep.py [--rows 16384]``. Each candidate is the op as
the backward runs it: zeros, the kernel adding its partial tiles into them, the cast to bfloat16. The CuTe kernels compile
first, in worker processes side by side (their disk cache entries are what the timing process
loads), then one process times them. Prints a table and the best candidate per shape."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import itertools
import multiprocessing
import os

SHAPES = ((768, 3072), (3072, 768), (768, 2304), (768, 768), (4096, 4096))  # (K, N): fc1, fc2, qkv, attn out
SCHEDULES = ("tiles", "sk")  # one unit per output tile, stream-K


def configs():
    from cutelayers.kernels.gemm_config import GemmConfig

    return {
        "128x128": GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6),
        "128x128 c2x1": GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, cluster_m=2),
        "128x256 c2x1": GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_m=2),
        "128x128 pp": GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, pingpong=True),
        "128x128 pp c2x1": GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, cluster_m=2,
                                      pingpong=True),
        "64x256 pp": GemmConfig(tile_m=64, tile_n=256, consumer_warpgroups=2, stages=6, pingpong=True),
    }


def candidate_fn(config_name: str, schedule, k: int, n: int):
    import jax.numpy as jnp

    from cutelayers.ops.linear import LinearWeightGrad
    from cutelayers.runtime.sharding import kernel_call

    config = configs()[config_name]
    family = LinearWeightGrad(config=config, accumulate=True, stream_k=schedule == "sk")

    def fn(x, dz):
        (dw,) = kernel_call(family, x, dz, jnp.zeros((1, k, n), jnp.float32))
        return dw.astype(x.dtype)

    return fn


def operands(rows: int, k: int, n: int, concrete: bool):
    import jax
    import jax.numpy as jnp

    bf = jnp.bfloat16
    if not concrete:
        return jax.ShapeDtypeStruct((1, rows, k), bf), jax.ShapeDtypeStruct((1, rows, n), bf)
    kx, kd = jax.random.split(jax.random.key(0))
    return (jax.random.normal(kx, (1, rows, k), jnp.float32).astype(bf),
            jax.random.normal(kd, (1, rows, n), jnp.float32).astype(bf))


def compile_one(case, rows: int) -> str:
    """Compile one candidate (fills the disk cache); '' or the error."""
    import jax

    from cutelayers.backend import use_backend

    name, schedule, k, n = case
    try:
        with use_backend("cute"):
            jax.jit(candidate_fn(name, schedule, k, n)).lower(*operands(rows, k, n, False)).compile()
        return ""
    except Exception as e:  # noqa: BLE001 -- reported in the table, the sweep goes on
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    args = parser.parse_args()
    cases = [(name, s, k, n) for (k, n), name, s in itertools.product(SHAPES, configs(), SCHEDULES)
             if not (s == "sk" and "pp" in name)]  # stream-K runs cooperative configs
    with cf.ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = dict(zip(cases, pool.map(functools.partial(compile_one, rows=args.rows), cases)))
    print(f"# compiled {sum(not e for e in errors.values())} of {len(cases)} candidates", flush=True)

    import jax
    import jax.numpy as jnp

    from cutelayers.backend import use_backend
    from cutelayers.bench.timing import time_fn

    print(f"# device: {jax.devices()[0].device_kind}; rows {args.rows}")
    print("| K x N | config | schedule | us | TFLOP/s | XLA us | XLA/ours | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    best = {}
    for k, n in SHAPES:
        x, dz = operands(args.rows, k, n, True)
        xla = jax.jit(lambda x, dz: jnp.einsum("lmk,lmn->lkn", x, dz, preferred_element_type=jnp.float32
                                                ).astype(x.dtype))
        ref = xla(x, dz).astype(jnp.float32)
        t_xla = time_fn(xla, x, dz)
        flops = 2.0 * args.rows * k * n
        for case in [c for c in cases if c[2:] == (k, n)]:
            name, schedule = case[:2]
            if errors[case]:
                print(f"| {k} x {n} | {name} | {schedule} | - | - | {t_xla * 1e6:.1f} | - | {errors[case]} |")
                continue
            with use_backend("cute"):
                fn = jax.jit(candidate_fn(name, schedule, k, n))
                out = fn(x, dz).astype(jnp.float32)
                t = time_fn(fn, x, dz)
            err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            print(f"| {k} x {n} | {name} | {schedule} | {t * 1e6:.1f} | {flops / t / 1e12:.0f} | "
                  f"{t_xla * 1e6:.1f} | {t_xla / t:.2f} | {err:.1e} |", flush=True)
            if err < 1e-2 and t < best.get((k, n), (None, 1.0))[1]:
                best[(k, n)] = ((name, schedule), t, t_xla)
    print("\n| K x N | best config | schedule | us | XLA/ours |\n|---|---|---|---|---|")
    for (k, n), ((name, schedule), t, t_xla) in best.items():
        print(f"| {k} x {n} | {name} | {schedule} | {t * 1e6:.1f} | {t_xla / t:.2f} |")


if __name__ == "__main__":
    main()
