"""Benchmarks: ``python -m cutelayers.bench {reduce,norms,softmax,gemm,lm_head,compile} ...``.

All but ``compile`` need a GPU.

Every table states its floor first: the HBM copy bandwidth measured in the same run (a read+write
elementwise pass over a large buffer), then each op's minimum bytes over its time, as % of that
copy bandwidth, next to XLA's own version timed in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import cutelayers as cl


def time_fn(fn, *args, iters: int = 20, repeats: int = 7) -> float:
    """Median seconds per call of a jitted ``fn``: batches of async calls, synchronized per batch."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a read+write elementwise pass (the practical HBM ceiling for row kernels)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    t = time_fn(jax.jit(lambda x: x + 1.0), x)
    return 2 * nbytes / t


def result_row(op: str, shape: tuple[int, int], dtype, nbytes: int, t: float, t_xla: float, bw: float,
               **extra) -> dict:
    """One table row: times, effective GB/s over the minimum bytes, % of copy BW, ratio vs XLA."""
    floor = nbytes / bw
    return dict(op=op, rows=shape[0], n=shape[1], dtype=jnp.dtype(dtype).name, us=t * 1e6,
                gbs=nbytes / t / 1e9, pct=100 * floor / t, xla_us=t_xla * 1e6, speedup=t_xla / t,
                floor_us=floor * 1e6, **extra)


def measured_bandwidth() -> float:
    """The copy bandwidth, measured now and printed as the table's floor."""
    bw = copy_bandwidth()
    print(f"# device: {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.3f} TB/s (read+write)")
    return bw


def bench_reduce(rows: int, ns: list[int], dtype) -> list[dict]:
    bw = measured_bandwidth()
    key = jax.random.key(0)
    results = []
    for n in ns:
        x = jax.random.normal(key, (rows, n), jnp.float32).astype(dtype)
        nbytes = x.size * x.dtype.itemsize + rows * x.dtype.itemsize
        for name, ours, xla in (
            ("reduce_sum", cl.ops.reduce_sum, lambda x: jnp.sum(x, -1, dtype=jnp.float32).astype(x.dtype)),
            ("reduce_max", cl.ops.reduce_max, lambda x: jnp.max(x, -1)),
        ):
            with cl.use_backend("cute"):
                f = jax.jit(ours)
                t = time_fn(f, x)
            t_xla = time_fn(jax.jit(xla), x)
            results.append(result_row(name, x.shape, dtype, nbytes, t, t_xla, bw))
    return results


def print_table(results: list[dict]) -> None:
    print("| op | pass | rows x N | dtype | floor us | time us | GB/s | % copy BW | XLA us | XLA/ours |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['op']} | {r.get('pass', 'fwd')} | {r['rows']} x {r['n']} | {r['dtype']} | {r['floor_us']:.1f} | "
              f"{r['us']:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} | {r['xla_us']:.1f} | {r['speedup']:.2f} |")


def print_records(rows: list[dict]) -> None:
    """A markdown table of dict rows, columns in the first row's key order."""
    if rows:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(str(v) for v in row.values()) + " |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cutelayers.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True)
    red = sub.add_parser("reduce", help="row reductions vs XLA")
    red.add_argument("--rows", type=int, default=32768, help="rows M (default 32768)")
    red.add_argument("--n", type=int, nargs="+", default=[4096], help="feature sizes N (default 4096)")
    red.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    norms = sub.add_parser("norms", help="layer_norm / rms_norm fwd and fwd+bwd vs XLA (x = 256 MiB)")
    norms.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 65536])
    norms.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    soft = sub.add_parser("softmax", help="softmax fwd/bwd and cross-entropy fwd+bwd vs XLA/optax")
    soft.add_argument("--n", type=int, nargs="+", default=[4096, 32768, 131072])
    soft.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    from cutelayers.bench_gemm import EPILOGUES, parse_shape

    gemm = sub.add_parser("gemm", help="fused_linear (Hopper GEMM + epilogue) TFLOP/s vs XLA")
    gemm.add_argument("--shapes", type=parse_shape, nargs="+", default=(),
                      help="MxKxN ... (default: the transformer layers of bench_gemm.LAYERS)")
    gemm.add_argument("--epilogue", choices=EPILOGUES, default="bias+gelu", help="epilogue of --shapes")
    gemm.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    head = sub.add_parser("lm_head", help="linear_cross_entropy fwd+bwd time and temp memory vs unfused XLA")
    head.add_argument("--t", type=int, default=8192, help="tokens T (default 8192)")
    head.add_argument("--h", type=int, default=4096, help="hidden size H (default 4096)")
    head.add_argument("--v", type=int, default=131072, help="vocabulary size V (default 131072)")
    head.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    head.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default: the op's)")
    comp = sub.add_parser("compile", help="compile seconds per kernel family and disk-cache load seconds (no GPU needed)")
    comp.add_argument("--n", type=int, default=4096, help="feature size N (default 4096)")
    comp.add_argument("--k", type=int, default=4096, help="GEMM inner size K (default 4096)")
    args = parser.parse_args(argv)
    if args.suite == "compile":
        from cutelayers.bench_compile import bench_compile

        print_records(bench_compile(n=args.n, k=args.k))
        return 0
    try:
        jax.devices("cuda")
    except RuntimeError:
        print("cutelayers.bench needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    if args.suite == "reduce":
        print_table(bench_reduce(args.rows, args.n, jnp.dtype(args.dtype)))
    elif args.suite == "norms":
        from cutelayers.bench_norms import bench_norms

        print_table(bench_norms(args.n, jnp.dtype(args.dtype)))
    elif args.suite == "softmax":
        from cutelayers.bench_softmax import bench_softmax

        print_table(bench_softmax(args.n, jnp.dtype(args.dtype)))
    elif args.suite == "gemm":
        from cutelayers import bench_gemm

        print(f"# device: {jax.devices()[0].device_kind}")
        layers = bench_gemm.layers_from_args(args.shapes, args.epilogue)
        results = bench_gemm.bench_gemm(layers, jnp.dtype(args.dtype))
        if not args.shapes:
            results += bench_gemm.bench_mlp(dtype=jnp.dtype(args.dtype))
        bench_gemm.print_table(results)
    elif args.suite == "lm_head":
        from cutelayers.bench_heads import bench_lm_head

        print(f"# device: {jax.devices()[0].device_kind}")
        print_records(bench_lm_head(args.t, args.h, args.v, jnp.dtype(args.dtype), args.chunk_size))
    print("# cache:", {k: (v.compiles, v.memory_hits, v.disk_hits, round(v.compile_seconds, 2)) for k, v in cl.cache_info().items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
