"""Energy and time a call at the GPU's power cap, ours against XLA's, on the device:

    python .ci/energy_probe.py head T H V ...         # the LM head's value_and_grad, both heads
    python .ci/energy_probe.py gemm MxKxN[:CONFIG] ... # x @ w: XLA's, then ours (CONFIG: a name of
                                                     # GEMM_CONFIGS below; default: the op's choice)

Under the 700 W cap a long GEMM-bound computation runs at whatever clock keeps it there, so its time
is its energy over the cap: TFLOP per joule, not TFLOP/s alone, says whether a kernel can be made
faster (docs/gemm_notes.md, seventy-first session). Each case is compiled, run back to back for
SETTLE_S (the clock settles), then for MEASURE_S more between two readings of NVML's cumulative
energy counter, the SM clock sampled meanwhile. Prints one markdown row a case; "% of peak" is the
rate against the H100's 4096 dense bf16 FLOP a cycle an SM at the sampled clock."""
import ctypes
import sys
import threading
import time

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench.lm_head import compile_head, head_operands
from cutelayers.kernels.gemm_config import GemmConfig
from cutelayers.ops.linear import LinearForward
from cutelayers.runtime.sharding import kernel_call

SETTLE_S, MEASURE_S = 1.5, 3.0
FLOP_PER_CYCLE = 132 * 4096  # H100 SXM: SMs x dense bf16 FLOP a cycle
GEMM_CONFIGS = {
    "wide_2x1": GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_m=2),
    "wide_1x2": GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_n=2),
    "wide_1x1": GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4),
    "pingpong192_2x1": GemmConfig(tile_m=128, tile_n=192, consumer_warpgroups=2, stages=5, cluster_m=2,
                                  pingpong=True),
}

nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
device = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(device)) == 0


def energy_mj() -> int:
    value = ctypes.c_ulonglong()
    assert nvml.nvmlDeviceGetTotalEnergyConsumption(device, ctypes.byref(value)) == 0
    return value.value


def sample_clock(stop: threading.Event, clocks: list) -> None:
    value = ctypes.c_uint()
    while not stop.is_set():
        nvml.nvmlDeviceGetClockInfo(device, 1, ctypes.byref(value))  # 1: NVML_CLOCK_SM
        clocks.append(value.value)
        time.sleep(0.01)


def measure(name: str, fn, args, flops: float) -> None:
    out = fn(*args)
    jax.block_until_ready(out)
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < SETTLE_S:
        out = fn(*args)
        calls += 1
    jax.block_until_ready(out)
    calls = max(4, int(MEASURE_S * calls / (time.perf_counter() - start)))
    stop, clocks = threading.Event(), []
    sampler = threading.Thread(target=sample_clock, args=(stop, clocks))
    sampler.start()
    e0, t0 = energy_mj(), time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    t1, e1 = time.perf_counter(), energy_mj()
    stop.set()
    sampler.join()
    seconds, joules = (t1 - t0) / calls, (e1 - e0) / 1e3 / calls
    clock = sum(clocks[len(clocks) // 5:]) / max(1, len(clocks) - len(clocks) // 5)  # past the first fifth
    print(f"| {name} | {calls} | {seconds * 1e3:.3f} | {joules:.4f} | {joules / seconds:.0f} | {clock:.0f} | "
          f"{flops / seconds / 1e12:.0f} | {flops / seconds / (FLOP_PER_CYCLE * clock * 1e6) * 100:.1f} | "
          f"{flops / joules / 1e12:.3f} |", flush=True)


def gemm_cases(spec: str):
    shape, _, config = spec.partition(":")
    m, k, n = (int(v) for v in shape.split("x"))
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (1, m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (1, k, n), jnp.bfloat16)
    yield f"gemm {shape} XLA", jax.jit(lambda x, w: x[0] @ w[0]), (x, w), 2 * m * k * n
    with cl.use_backend("cute"):
        if config:
            family = LinearForward("none", False, False, False, config=GEMM_CONFIGS[config])
            ours = jax.jit(lambda x, w: kernel_call(family, x, w)[0])
        else:
            ours = jax.jit(lambda x, w: cl.ops.fused_linear(x[0], w[0]))
        jax.block_until_ready(ours(x, w))  # compiled under the backend
    yield f"gemm {shape} ours {config or '(the op)'}", ours, (x, w), 2 * m * k * n


def head_cases(t: int, h: int, v: int):
    operands = head_operands(t, h, v, jnp.bfloat16, param_dtype=jnp.float32)
    for head in ("xla", "fused"):
        with cl.use_backend("cute"):
            compiled = compile_head(head, operands)
        yield f"head {t}x{h}x{v} {head}", compiled, operands, 6 * t * h * v


def main(argv: list[str]) -> None:
    print("| case | calls | ms a call | J a call | W | SM MHz | TFLOP/s | % of peak at that clock | TFLOP/J |")
    print("|---|---|---|---|---|---|---|---|---|")
    while argv:
        if argv[0] == "head":
            cases, argv = head_cases(*(int(a) for a in argv[1:4])), argv[4:]
        elif argv[0] == "gemm":
            specs = []
            argv = argv[1:]
            while argv and argv[0] not in ("head", "gemm"):
                specs.append(argv.pop(0))
            cases = (case for spec in specs for case in gemm_cases(spec))
        else:
            sys.exit(f"expected 'head T H V' or 'gemm MxKxN[:CONFIG] ...'; got {argv[0]!r}")
        for case in cases:
            measure(*case)


if __name__ == "__main__":
    main(sys.argv[1:])
