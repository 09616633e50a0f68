"""Test setup: four fake CPU devices, CuTe compiles for sm_90a, XLA programs and CuTe kernels
compiled once for the run's processes, `gpu`, `multigpu` and `cute` markers, fresh randomness; with
``CUTELAYERS_TEST_TIMINGS=<file>``, one JSON line per test of where its time went."""

import collections
import importlib.metadata
import json
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

# Before JAX is imported anywhere: fake devices for placement/sharding tests, the cheapest XLA CPU
# compiles (the suite compiles far more than it runs): LLVM -O0, XLA's classic emitters rather
# than its fusion emitters (the suite's XLA compile seconds on 2 cores: 524 -> 295) and one LLVM
# module per program, not several for parallel codegen (a worker per core leaves no core to spare);
# and a target arch so CuTe kernels compile on machines without a GPU.
# The two XLA:CPU emitter flags exist in jaxlib 0.10 (the CPU CI's); jaxlib 0.11 (the GPU image's)
# aborts on the first at startup, so they are passed only to older jaxlibs.
try:
    _JAXLIB = tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2])
except importlib.metadata.PackageNotFoundError:  # no jaxlib: importing jax fails with its own message
    _JAXLIB = (0, 0)
_CPU_EMITTER_FLAGS = " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"
                      + (_CPU_EMITTER_FLAGS if _JAXLIB < (0, 11) else ""))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# Compiles once per test run, not once per process: JAX's persistent compilation cache (XLA
# programs) and cutelayers' disk cache (CuTe kernels) in directories made fresh for the run by the
# first process to load this file (the xdist controller), which the workers and the subprocesses
# tests launch inherit, and removed at the end. Nothing an earlier run left is read; within the
# run, whether a kernel is compiled or loaded depends on which test got to it first, so tests
# count kernels made ready (`built`), or turn the disk cache off where they count compiles.
_OWNED_CACHES = []
for _variable, _prefix in (("CUTELAYERS_TEST_JAX_CACHE", "cutelayers-test-jax-cache-"),
                           ("CUTELAYERS_TEST_KERNEL_CACHE", "cutelayers-test-kernels-")):
    if _variable not in os.environ:
        os.environ[_variable] = tempfile.mkdtemp(prefix=_prefix)
        _OWNED_CACHES.append(os.environ[_variable])
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["CUTELAYERS_TEST_JAX_CACHE"])
os.environ["CUTELAYERS_CACHE_DIR"] = os.environ["CUTELAYERS_TEST_KERNEL_CACHE"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax
import numpy as np
import pytest

from cutelayers.runtime.primitive import cute_dsl_missing


def _hopper_gpus() -> list:
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return []
    return [d for d in gpus if str(getattr(d, "compute_capability", "0")).startswith("9")]


HOPPER_GPUS = _hopper_gpus()
HAS_GPU = bool(HOPPER_GPUS)
# Why CuTe kernels cannot be built here, or None (the library's own check): `cute` tests (and `gpu`
# tests, which run kernels) are skipped without the CuTe DSL, as in a plain `pip install -e .`.
CUTE_MISSING = cute_dsl_missing()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs CuTe kernels on a Hopper GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu: runs on two Hopper GPUs of one host (skipped with fewer)")
    config.addinivalue_line("markers", "cute: needs the CuTe DSL, the 'cute' extra: builds kernels or checks their "
                                       "CUDA lowering (skipped without it)")


def pytest_unconfigure(config):
    for directory in _OWNED_CACHES:
        shutil.rmtree(directory, ignore_errors=True)


# The suite's longest tests (and the tests sharing their module-scoped fixtures), longest first:
# they run first, so that no worker starts one near the end while the other has nothing left.
# xdist's worksteal hands each worker a contiguous half of the collection and lets an idle worker
# take the back half of a busy one's queue: with these at the front of the first half, the queues'
# ends, what is left when the run closes, hold only short tests. A node id prefix: a module
# (``file.py``), a test function (all its parametrizations) or one parametrization.
RUN_FIRST = (
    # the deep24 train steps' fixture (~40 s: 3 frameworks lowered, ~37 kernels compiled) and its users
    "tests/test_models.py::test_each_mlp_is_one_op_in_the_train_step",
    "tests/test_models.py::test_deep24_blocks_compile_each_kernel_once",
    "tests/test_models.py::test_export_of_a_model",
    "tests/test_autotune.py::test_candidates_compile_for_sm90a",  # every GEMM config: ~40 s
    "tests/test_training.py::test_two_processes_and_one_share_checkpoints",  # ~35 s, 4 processes
    "tests/test_training_bench.py::test_bench_tiny_cases_table_and_breakdown",
    "tests/test_softmax.py::test_cuda_lowering_compiles_every_kernel",
    "tests/test_mlp.py::test_lowering_fuses_the_activation_derivative",
    "tests/test_linear.py::test_lowering_bias_grad_comes_from_the_weight_grad_kernel",
    "tests/test_mlp_modules.py::test_modules_lower_to_the_mlp_kernels_for_cuda",
    "tests/test_examples.py::test_gradient_check_covers_every_op_and_dtype",
    "tests/test_mlp.py::test_gated_block_lowers_to_the_gemm_kernels",
    "tests/test_linear.py::test_lowering_compiles_once_across_row_counts_and_batches",
    "tests/test_disk_cache.py::test_second_process_compiles_nothing_and_concurrent_writers_leave_valid_entries",
    "tests/test_linear.py::test_accumulating_weight_grad_compiles_for_every_config",
    "tests/test_training_bench.py::test_bench_over_meshes",
    "tests/test_linear.py::test_lowering_every_activation",  # 9 x ~8 s, sharing dx / dkernel kernels
    "tests/test_split_linear.py::test_lowering_has_three_kernels_and_no_activation_sized_slice_or_concatenation",
    "tests/test_export.py::test_round_trip_in_a_fresh_process",
    "tests/test_parallel_compile.py",  # its module fixture: one parallel lowering for the module's tests
    "tests/test_linear.py::test_lowering_grad_of_vmap_is_one_weight_grad_on_all_rows",
    "tests/test_linear.py::test_lowering_kernel_layout_nk_reads_and_writes_the_kernel_as_stored",
    "tests/test_linear.py::test_ptxas_neither_serializes_the_wgmmas_nor_spills",  # ~10 s: 9 kernels + ptxas
    "tests/test_linear_modules.py::test_linen_dense_lowers_to_the_gemm_kernels_for_cuda",
    "tests/test_heads.py::test_vmap_jit_grad_compositions",
    "tests/test_training.py::test_checkpoint_round_trip_and_exact_resume",
    "tests/test_training.py::test_resume_keeps_the_schedule_unless_rescheduled",
    "tests/test_training.py::test_stock_checkpoint_continues_in_the_cutelayers_model",
    "tests/test_training.py::test_path_notes_are_one_line_of_the_same_format",
    "tests/test_training.py::test_sample_continues_the_prompt",
    "tests/test_multigpu.py::test_training_over_a_data_mesh_of_two",
)


def _run_first_rank(nodeid: str) -> int:
    """The position of the RUN_FIRST entry ``nodeid`` falls under; len(RUN_FIRST) for none."""
    for rank, prefix in enumerate(RUN_FIRST):
        if nodeid == prefix or nodeid.startswith(prefix + ("::" if prefix.endswith(".py") else "[")):
            return rank
    return len(RUN_FIRST)


def pytest_collection_modifyitems(config, items):
    # a stable sort: the same order in every xdist worker (they must agree), the rest as collected
    items.sort(key=lambda item: _run_first_rank(item.nodeid))
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU of compute capability 9.x (none visible)")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 CUDA GPUs of compute capability 9.x; {len(HOPPER_GPUS)} visible")
    skip_cute = pytest.mark.skip(reason=str(CUTE_MISSING))
    for item in items:
        # markers, not keywords: a keyword is also any part of the test's node id (test_multigpu.py)
        if item.get_closest_marker("gpu") and not HAS_GPU:
            item.add_marker(skip_gpu)
        elif item.get_closest_marker("multigpu") and len(HOPPER_GPUS) < 2:
            item.add_marker(skip_multigpu)
        elif CUTE_MISSING and (item.get_closest_marker("cute") or item.get_closest_marker("gpu")):
            item.add_marker(skip_cute)


UNWRITABLE = ("a directory", "under a file", "/proc")


def unwritable_path(kind: str, tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    """A file path ``name`` that cannot be written, of one ``kind`` of :data:`UNWRITABLE`: an
    existing directory, a path under a file, or a new file in /proc (skips where there is none)."""
    if kind == "a directory":
        return tmp_path
    if kind == "under a file":
        (tmp_path / "afile").write_text("x")
        return tmp_path / "afile" / name
    if not pathlib.Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    return pathlib.Path("/proc") / name


def built(stats) -> int:
    """Kernels a ``cl.cache_info()`` entry made ready in this process: compiled here, or loaded
    from the run's disk cache where another test or worker compiled them first."""
    return stats.compiles + stats.disk_hits


def kept_ptx_env(dump_dir) -> dict:
    """The environment of a fresh process that compiles CuTe kernels for sm_90a on the CPU and
    keeps their PTX in ``dump_dir`` (the DSL reads CUTE_DSL_KEEP at import), importing this
    checkout's cutelayers, with no kernel cache or tuning file in the way."""
    repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
            "JAX_PLATFORMS": "cpu", "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx",
            "CUTE_DSL_DUMP_DIR": str(dump_dir), "CUTELAYERS_CACHE_DIR": "", "CUTELAYERS_TUNING_FILE": ""}


def kept_ptx(dump_dir, program: str, *argv: str):
    """Run ``program`` (Python source that lowers one CuTe kernel) with ``argv`` in a fresh process
    that keeps its PTX in ``dump_dir`` (:func:`kept_ptx_env`); the path of that one PTX file."""
    proc = subprocess.run([sys.executable, "-c", program, *argv], env=kept_ptx_env(dump_dir), cwd=dump_dir,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = pathlib.Path(dump_dir).glob("*.ptx")
    return path


# Lowers the heuristic kernel of the row kernel family argv[1] at (16384, argv[2]) bf16 for sm_90a
# (through kept_ptx, which keeps its PTX).
ROW_KERNEL_PTX_PROGRAM = """
import dataclasses, functools, sys
import jax
import cutelayers as cl
from cutelayers.bench import autotune
from cutelayers.runtime.sharding import kernel_call
((case, _, default),) = autotune.list_candidates(sys.argv[1], [(16384, int(sys.argv[2]))], ["bfloat16"])
with cl.use_backend("cute"):
    jax.jit(functools.partial(kernel_call, dataclasses.replace(case.family, config=default))).trace(
        *case.avals).lower(lowering_platforms=("cuda",))
"""


def longest_load_run(ptx: str) -> int:
    """The most global loads in ``ptx`` that issue one after another: no branch, barrier or
    arithmetic between them (moves and conversions of their values aside)."""
    run = best = 0
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("ld.global"):
            run += 1
            best = max(best, run)
        elif not line.startswith(("mov.", "cvt.")):
            run = 0
    return best


def ptxas_report(ptxas: str, path) -> str:
    """``ptxas -arch=sm_90a -v`` of the PTX file ``path``: its report (registers, spills,
    advisories). Skips the test where this ptxas is older than the PTX the CuTe DSL emits."""
    run = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
                         capture_output=True, text=True, timeout=300, check=False)
    notes = run.stdout + run.stderr
    if run.returncode != 0 and "Unsupported .version" in notes:
        pytest.skip(f"{ptxas} is older than the PTX the CuTe DSL emits: {notes.strip()[:200]}")
    assert run.returncode == 0, notes[-3000:]
    return notes


@pytest.fixture
def rng(request):
    """A numpy Generator with a fresh seed per test; the seed is printed on failure and
    ``CUTELAYERS_TEST_SEED=<seed>`` replays it."""
    seed = int(os.environ.get("CUTELAYERS_TEST_SEED") or secrets.randbits(32))
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def cpu():
    return jax.devices("cpu")[0]


# --- where the time goes: CuTe compiles, XLA compiles, the rest ----------------------------------

TIMINGS = os.environ.get("CUTELAYERS_TEST_TIMINGS")
TRACE_AND_LOWER = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
XLA_COMPILE = "/jax/core/compile/backend_compile_duration"
_jax_seconds = collections.Counter()  # JAX's compile-phase durations in this process, by event
_spent = pytest.StashKey[list]()  # per test: [CuTe compiles, CuTe s, trace + lower s, XLA compile s]


def _totals():
    """(CuTe compiles, CuTe compile s, JAX trace + lower s (CuTe compiles included), XLA compile s)
    so far in this process."""
    import cutelayers

    info = cutelayers.cache_info().values()
    return (sum(s.compiles for s in info), sum(s.compile_seconds for s in info),
            sum(_jax_seconds[e] for e in TRACE_AND_LOWER), _jax_seconds[XLA_COMPILE])


def _measure(item):
    """A hookwrapper body adding one phase's compile work to the test's totals."""
    before = _totals()
    yield
    after = _totals()
    if after[0] < before[0]:  # a fixture or the test cleared the kernel cache and its statistics
        before = (0, 0.0, *before[2:])
    spent = item.stash.setdefault(_spent, [0, 0.0, 0.0, 0.0])
    for i, (a, b) in enumerate(zip(after, before)):
        spent[i] += a - b


if TIMINGS:
    jax.monitoring.register_event_duration_secs_listener(lambda event, secs, **_: _jax_seconds.update({event: secs}))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item):
        yield from _measure(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        yield from _measure(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item):
        yield from _measure(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Appends ``{test, seconds, cute_compiles, cute_compile_s, lowering_s, xla_compile_s}``
        to $CUTELAYERS_TEST_TIMINGS, one line per test (xdist workers append to one file);
        ``lowering_s``: JAX's tracing and lowering less the CuTe compiles it ran."""
        start = time.perf_counter()
        yield
        compiles, cute_s, lower_s, xla_s = item.stash.get(_spent, [0, 0.0, 0.0, 0.0])
        record = {"test": item.nodeid, "seconds": round(time.perf_counter() - start, 3), "cute_compiles": compiles,
                  "cute_compile_s": round(cute_s, 3), "lowering_s": round(max(lower_s - cute_s, 0.0), 3),
                  "xla_compile_s": round(xla_s, 3)}
        fd = os.open(TIMINGS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write per line: appends from several processes do not interleave
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
