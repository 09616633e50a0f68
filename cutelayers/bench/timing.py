"""What every benchmark and the autotuner share: a jitted function's time per call (device time
on a GPU), the GPU kernels a traced run launched, and the rows of the bandwidth-bound tables (the
copy bandwidth measured in the same run is their floor)."""

from __future__ import annotations

import collections
import datetime
import glob
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

# Seconds of back-to-back calls before a measurement. Under the GPU's power cap the SM clock
# settles over a fraction of a second of load, and what draws more power slows more: the LM head at
# GPT-2 size ran 18 % longer a call over 80 calls than over 4, XLA's head 5 % (H100,
# docs/benchmarks.md, fifty-first session). Timed at a settled clock, each side is measured as it
# runs in training, whichever ran before it.
SETTLE_SECONDS = 0.5


def settle_clock(calls, seconds: float = SETTLE_SECONDS) -> None:
    """Run ``calls()`` again and again for ``seconds`` (on a GPU; elsewhere there is no clock to
    settle and it returns at once)."""
    if seconds <= 0 or jax.default_backend() != "gpu":
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        calls()


def traced_kernel_spans(run) -> list[tuple[str, float, float]]:
    """``run()`` under jax.profiler: the (name, start, seconds) of every kernel it launched on the
    first GPU's streams, in the order they started (start in seconds on the trace's clock); []
    where no device kernels are recorded (CPU)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run()
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        profile = jax.profiler.ProfileData.from_file(path)
    events = [event for plane in profile.planes if plane.name == "/device:GPU:0"  # over a mesh: the first device's
              for line in plane.lines if line.name.startswith("Stream") for event in line.events]
    return [(event.name, event.start_ns / 1e9, event.duration_ns / 1e9)
            for event in sorted(events, key=lambda event: event.start_ns)]


def traced_kernels(run) -> list[tuple[str, float]]:
    """:func:`traced_kernel_spans` without the starts: (name, seconds) in the order they started."""
    return [(name, seconds) for name, _, seconds in traced_kernel_spans(run)]


def idle_gaps(spans: list[tuple[str, float, float]], key) -> dict[tuple[str, str], tuple[int, float]]:
    """Where the device sat idle between the kernels of :func:`traced_kernel_spans`: each gap
    before a kernel that started after every earlier one had ended, summed by (``key`` of the
    kernel that ended last before it, ``key`` of the kernel it waited for) -> (gaps, seconds)."""
    totals = collections.defaultdict(lambda: (0, 0.0))
    end, last = None, None
    for name, start, seconds in spans:
        if end is not None and start > end:
            gaps, idle = totals[key(last), key(name)]
            totals[key(last), key(name)] = (gaps + 1, idle + start - end)
        if end is None or start + seconds > end:
            end, last = start + seconds, name
    return dict(totals)


def kernel_totals(spans: list[tuple[str, float, float]]) -> dict[str, tuple[int, float]]:
    """{name: (launches, seconds)} of :func:`traced_kernel_spans`' list."""
    totals = collections.defaultdict(lambda: (0, 0.0))
    for name, _, seconds in spans:
        calls, total = totals[name]
        totals[name] = (calls + 1, total + seconds)
    return dict(totals)


# Operands of fewer bytes are timed in rotation over copies that add up to more, so that a call
# reads them from device memory, not from what the previous call left in L2 (50 MB on an H100,
# 60 on an H200; the decode GEMM's weight is 32 MiB, a GPT-2 layer's activations 24-96 MiB).
# MAX_ROTATION bounds the copies.
ROTATION_BYTES = 256 * 2**20
MAX_ROTATION = 8


def operand_sets(args: tuple) -> list[tuple]:
    """``args`` and copies of it, enough that together their arrays pass :data:`ROTATION_BYTES`
    (at most :data:`MAX_ROTATION` sets; ``[args]`` alone where one set passes it)."""
    def copy(leaf):
        return jnp.copy(leaf) if isinstance(leaf, jax.Array) else leaf

    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(args) if isinstance(leaf, jax.Array))
    count = min(MAX_ROTATION, -(-ROTATION_BYTES // max(nbytes, 1)))
    return [args] + [jax.tree.map(copy, args) for _ in range(count - 1)]


def _rotating_calls(fn, args, iters: int):
    """``calls()``: ``iters`` calls of ``fn`` rotating over :func:`operand_sets` of ``args``, then a
    sync -- after every set has run once (compile + warm up)."""
    sets = operand_sets(args)
    for operands in sets:
        jax.block_until_ready(fn(*operands))
    jax.block_until_ready(fn(*args))

    def calls():
        for i in range(iters):
            out = fn(*sets[i % len(sets)])
        jax.block_until_ready(out)

    return calls


def _per_call(kernels: list, iters: int) -> list[list]:
    """``traced_kernels`` of ``iters`` calls split into each call's list; [] unless every call
    launched the same number of kernels (or none were recorded)."""
    if not kernels or len(kernels) % iters:
        return []
    n = len(kernels) // iters
    return [kernels[i:i + n] for i in range(0, len(kernels), n)]


def call_kernels(fn, *args, iters: int = 10) -> list[tuple[str, float]]:
    """One call of a jitted ``fn`` kernel by kernel: (name, median seconds over ``iters`` calls
    rotating over :func:`operand_sets`, after :func:`settle_clock`) in launch order -- which kernel a gap
    between two implementations is in. [] where no device kernels are recorded (CPU) or calls
    launched different kernel counts."""
    run = _rotating_calls(fn, args, iters)
    settle_clock(run)
    calls = _per_call(traced_kernels(run), iters)
    if not calls:
        return []
    return [(name, statistics.median(call[j][1] for call in calls)) for j, (name, _) in enumerate(calls[0])]


def time_fn(fn, *args, iters: int = 20, repeats: int = 7, settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median seconds per call of a jitted ``fn``, its calls rotating over copies of small
    operands (:func:`operand_sets`), after ``settle_seconds`` of them (:func:`settle_clock`).

    On a GPU, device time: the summed durations of the kernels each of ``iters`` traced calls
    launched (the host's dispatch, ~50-100 us per call, would otherwise be what a call of a few
    tens of microseconds measures). Where no kernels are recorded (CPU), wall time: batches of
    asynchronous calls, synchronized per batch.
    """
    calls = _rotating_calls(fn, args, iters)
    settle_clock(calls, settle_seconds)
    kernels = traced_kernels(calls)
    if per_call := _per_call(kernels, iters):  # one call's kernels each, in order
        return statistics.median(sum(s for _, s in call) for call in per_call)
    if kernels:  # calls that launch differently (never seen): the mean
        return sum(s for _, s in kernels) / iters
    return _batch_seconds(calls, iters, repeats)


def wall_time(fn, *args, iters: int = 10, repeats: int = 5, settle_seconds: float = SETTLE_SECONDS) -> float:
    """Median wall seconds per call of a jitted ``fn``: batches of ``iters`` asynchronous calls
    (rotating over :func:`operand_sets`), synchronized per batch, after ``settle_seconds`` of them
    (:func:`settle_clock`). Unlike :func:`time_fn`'s device time it counts the device's idle time inside a
    call -- where the host waits on the device mid-call (a data-dependent loop's predicate) and
    launches the rest only then."""
    calls = _rotating_calls(fn, args, iters)
    settle_clock(calls, settle_seconds)
    return _batch_seconds(calls, iters, repeats)


def _batch_seconds(calls, iters: int, repeats: int) -> float:
    """Median over ``repeats`` runs of ``calls()`` of its wall seconds per call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        calls()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a read+write elementwise pass (the practical HBM ceiling for row kernels)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    t = time_fn(jax.jit(lambda x: x + 1.0), x)
    return 2 * nbytes / t


def result_row(op: str, shape: tuple[int, int], dtype, nbytes: int, t: float, t_xla: float, bw: float,
               **extra) -> dict:
    """One table row: times, effective GB/s over the minimum bytes, % of copy BW, ratio vs XLA.
    Also printed at once to stderr as a progress line (the table comes at the end)."""
    floor = nbytes / bw
    row = dict(op=op, rows=shape[0], n=shape[1], dtype=jnp.dtype(dtype).name, us=t * 1e6,
               gbs=nbytes / t / 1e9, pct=100 * floor / t, xla_us=t_xla * 1e6, speedup=t_xla / t,
               floor_us=floor * 1e6, **extra)
    print(f"# {op} {extra.get('pass', 'fwd')} {shape[0]} x {shape[1]}: {row['us']:.1f} us "
          f"({row['pct']:.1f} % of copy), XLA {row['xla_us']:.1f} us", file=sys.stderr, flush=True)
    return row


def measured_bandwidth() -> float:
    """The copy bandwidth, measured now and printed as the table's floor."""
    bw = copy_bandwidth()
    print(f"# device: {jax.devices()[0].device_kind}; copy bandwidth {bw / 1e12:.3f} TB/s (read+write)")
    return bw


def row_key(row: dict) -> tuple:
    """What identifies a :func:`result_row` row across runs: op, pass, shape, dtype and the
    parameters' dtype (x's where a row does not name it)."""
    return row["op"], row.get("pass", "fwd"), row["rows"], row["n"], row["dtype"], row.get("params", row["dtype"])


def save_rows(path, results: list[dict]) -> None:
    """Write :func:`result_row` rows as JSON (with the GPU and the date): a later run compares
    against them with :func:`load_baseline` (``--baseline``)."""
    table = {"format": 1, "device": jax.devices()[0].device_kind,
             "date": datetime.date.today().isoformat(), "rows": results}
    with open(path, "w") as f:
        json.dump(table, f, indent=1)


def load_baseline(path) -> tuple[str, dict[tuple, float]]:
    """The rows a run saved with :func:`save_rows` (a previous release's kernels, say): a line
    describing them, and their times (us) by :func:`row_key`. ValueError naming ``path`` and what
    is wrong for a file that is not such a table."""
    try:
        with open(path) as f:
            table = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the baseline {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the baseline {path} is not JSON: {e}") from None
    if not isinstance(table, dict) or table.get("format") != 1 or not isinstance(table.get("rows"), list):
        raise ValueError(f"the baseline {path} is not a table written by --json (format 1, a list of rows)")
    try:
        times = {row_key(row): float(row["us"]) for row in table["rows"]}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the baseline {path} has a row without op, rows, n, dtype and us: {e!r}") from None
    return f"{path} ({table.get('device', 'unknown GPU')}, {table.get('date', 'undated')})", times


def print_table(results: list[dict], baseline: dict[tuple, float] | None = None) -> None:
    """The markdown table of :func:`result_row` rows; with ``baseline`` (times by
    :func:`row_key`, from :func:`load_baseline`), also each row's baseline time over its time
    ("-" for a row the baseline lacks). ``XLA/floor`` is XLA's time over the floor: the most
    XLA/ours that a kernel moving the minimum bytes at copy bandwidth could show."""
    extra = " baseline/ours |" if baseline is not None else ""
    print("| op | pass | rows x N | dtype | floor us | time us | GB/s | % copy BW | XLA us | XLA/floor | XLA/ours |"
          + extra)
    print("|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * bool(extra))
    for r in results:
        cells = (f"| {r['op']} | {r.get('pass', 'fwd')} | {r['rows']} x {r['n']} | {r['dtype']} | {r['floor_us']:.1f} | "
                 f"{r['us']:.1f} | {r['gbs']:.0f} | {r['pct']:.1f} | {r['xla_us']:.1f} | "
                 f"{r['xla_us'] / r['floor_us']:.2f} | {r['speedup']:.2f} |")
        if baseline is not None:
            before = baseline.get(row_key(r))
            cells += f" {before / r['us']:.2f} |" if before else " - |"
        print(cells)
