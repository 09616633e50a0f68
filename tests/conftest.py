"""Test setup: four fake CPU devices, CuTe compiles for sm_90a, XLA compiles shared by the run's
processes, `gpu`, `multigpu` and `cute` markers, fresh randomness; with
``CUTELAYERS_TEST_TIMINGS=<file>``, one JSON line per test of where its time went."""

import collections
import json
import os
import secrets
import shutil
import tempfile
import time

# Before JAX is imported anywhere: fake devices for placement/sharding tests, LLVM's cheapest
# optimization level for XLA's CPU programs (the suite compiles far more than it runs: about a
# quarter less time on 2 cores), and a target arch so CuTe kernels compile on machines without a GPU.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# Compile counts in tests must not depend on what an earlier run left on disk: the disk cache is
# off unless a test turns it on (tests/test_disk_cache.py, with its own directory).
os.environ["CUTELAYERS_CACHE_DIR"] = ""
# XLA programs compiled once per test run, not once per process: JAX's persistent compilation
# cache in a directory made fresh for the run by the first process to load this file (the xdist
# controller), which the workers and the subprocesses tests launch inherit, and removed at the end.
_OWNS_JAX_CACHE = "CUTELAYERS_TEST_JAX_CACHE" not in os.environ
if _OWNS_JAX_CACHE:
    os.environ["CUTELAYERS_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="cutelayers-test-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["CUTELAYERS_TEST_JAX_CACHE"])
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
    if _OWNS_JAX_CACHE:
        shutil.rmtree(os.environ["CUTELAYERS_TEST_JAX_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
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
