"""What every benchmark and the autotuner share: a jitted function's time per call, and the rows
of the bandwidth-bound tables (the copy bandwidth measured in the same run is their floor)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


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


def print_table(results: list[dict]) -> None:
    """The markdown table of :func:`result_row` rows."""
    print("| op | pass | rows x N | dtype | floor us | time us | GB/s | % copy BW | XLA us | XLA/ours |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['op']} | {r.get('pass', 'fwd')} | {r['rows']} x {r['n']} | {r['dtype']} | {r['floor_us']:.1f} | "
              f"{r['us']:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} | {r['xla_us']:.1f} | {r['speedup']:.2f} |")
