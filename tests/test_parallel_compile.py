"""cutelayers.parallel_compiles: the kernels a lowering needs compile in worker processes while it
lowers (CUDA lowering on this CPU-only machine, CuTe compiles for sm_90a), and are registered,
cached, counted and on disk when the block ends.

Spawned workers import JAX and the CuTe DSL (seconds each), so the module shares one parallel
lowering (``parallel_run``) and one pool across its tests."""

import dataclasses
import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import cutelayers as cl
from cutelayers.aot import kernel_targets
from cutelayers.ops._rowwise import call_on_rows
from cutelayers.ops.reduce import RowReduce
from cutelayers.runtime import parallel_compile
from cutelayers.runtime.primitive import registered_kernel

pytestmark = pytest.mark.cute

# Sizes no other test uses: FFI registrations last for the process, and pytest-xdist runs other
# test files in this one, so only kernels new to it show whether the block registered them.
ROWS, K, N = 48, 176, 336
KERNELS = {"linear_fwd", "linear_dx", "linear_dkernel", "layer_norm_fwd", "layer_norm_bwd"}


def block(x, kernel, bias, scale, shift):
    """A small model's block: a fused GEMM (bias, gelu), then a LayerNorm."""
    return jnp.sum(cl.ops.layer_norm(cl.ops.fused_linear(x, kernel, bias, activation="gelu"), scale, shift)
                   .astype(jnp.float32))


AVALS = (jax.ShapeDtypeStruct((ROWS, K), jnp.bfloat16), jax.ShapeDtypeStruct((K, N), jnp.bfloat16),
         jax.ShapeDtypeStruct((N,), jnp.bfloat16), jax.ShapeDtypeStruct((N,), jnp.float32),
         jax.ShapeDtypeStruct((N,), jnp.float32))


def lower_cuda(f, *avals) -> str:
    return jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def train_step_text() -> str:
    """The block's forward and backward (five distinct kernels), lowered for CUDA."""
    jax.clear_caches()  # JAX caches lowerings: lower again, through the kernel caches
    return lower_cuda(jax.value_and_grad(block, argnums=tuple(range(5))), *AVALS)


def kernel_name(target: str) -> str:
    return target.removeprefix("cutelayers_").rsplit("_", 1)[0]


@dataclasses.dataclass(frozen=True)
class FailsInWorkers(RowReduce):
    """reduce_sum, under another name, whose launcher refuses to build in a compile worker (a
    spawned child process) and builds here."""

    @property
    def name(self) -> str:
        return "reduce_fails_in_workers"

    def launcher(self, avals, out_avals):
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("this kernel does not build in a compile worker")
        return super().launcher(avals, out_avals)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A disk cache of this module's own, on for every test here; the pool stopped at the end."""
    directory = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUTELAYERS_CACHE_DIR", str(directory))
        yield directory
    parallel_compile.shutdown_workers()


@pytest.fixture(scope="module")
def parallel_run(cache_dir):
    """The block's train step lowered in ``parallel_compiles(workers=2)`` from empty caches: what
    was registered inside the block and after it, the text, the session and the statistics."""
    cl.clear_cache()
    with cl.parallel_compiles(workers=2) as session:
        text = train_step_text()
        targets = kernel_targets(text)
        inside = {t: registered_kernel(t) is not None for t in targets}
    after = {t: registered_kernel(t) is not None for t in targets}
    return {"text": text, "targets": targets, "inside": inside, "after": after, "session": session,
            "info": cl.cache_info()}


@pytest.fixture(autouse=True)
def clean_jax_caches():
    jax.clear_caches()
    yield


def test_parallel_lowering_registers_every_kernel_at_the_end_of_the_block(parallel_run):
    assert {kernel_name(t) for t in parallel_run["targets"]} == KERNELS
    # Inside the block the custom calls are emitted but no kernel is compiled yet ...
    assert not any(parallel_run["inside"].values()), parallel_run["inside"]
    # ... and leaving it waits for every one.
    assert all(parallel_run["after"].values()), parallel_run["after"]
    session = parallel_run["session"]
    assert session.workers == 2
    assert session.compiled_in_workers + session.compiled_here == len(KERNELS)
    assert session.compiled_in_workers >= 2  # the first two cannot be taken back from the workers


def test_cache_info_counts_one_compile_per_kernel(parallel_run):
    info = parallel_run["info"]
    assert set(info) == KERNELS
    for name, stats in info.items():
        assert (stats.compiles, stats.disk_hits) == (1, 0), (name, stats)
        assert stats.compile_seconds > 0, name


def test_sequential_lowering_gives_the_same_text_from_the_disk_entries(parallel_run, cache_dir):
    # The parent stored each worker's object: an entry per kernel, valid (a lowering without the
    # block loads them all, compiling nothing) and named by the same targets.
    assert len(list(cache_dir.glob("*.o"))) == len(KERNELS) == len(list(cache_dir.glob("*.json")))
    cl.clear_cache()
    text = train_step_text()
    assert text == parallel_run["text"]
    info = cl.cache_info()
    assert {name: (s.compiles, s.disk_hits) for name, s in info.items()} == {name: (0, 1) for name in KERNELS}


def test_a_repeat_lowering_is_all_memory_hits(parallel_run):
    before = cl.cache_info()
    with cl.parallel_compiles(workers=2) as session:
        assert train_step_text() == parallel_run["text"]
    after = cl.cache_info()
    assert (session.compiled_in_workers, session.compiled_here) == (0, 0)
    for name in KERNELS:
        assert after[name].compiles == before[name].compiles and after[name].disk_hits == before[name].disk_hits
        assert after[name].memory_hits > before[name].memory_hits, name


def test_a_lone_kernel_and_one_worker_compile_here_without_a_pool(cache_dir, monkeypatch):
    def no_pool(workers):
        raise AssertionError(f"a pool of {workers} workers was started")

    monkeypatch.setattr(parallel_compile, "_worker_pool", no_pool)
    cl.clear_cache()
    x = jax.ShapeDtypeStruct((5, 424), jnp.float32)
    with cl.parallel_compiles(workers=4) as session:  # one kernel only
        lower_cuda(cl.ops.reduce_max, x)
    assert (session.compiled_in_workers, session.compiled_here) == (0, 1)
    with cl.parallel_compiles(workers=1) as session:  # two kernels, one worker: none in the pool
        lower_cuda(lambda x: cl.ops.reduce_sum(x) + cl.ops.reduce_mean(x), x)
    assert (session.compiled_in_workers, session.compiled_here) == (0, 2)
    info = cl.cache_info()
    assert [info[n].compiles for n in ("reduce_max", "reduce_sum", "reduce_mean")] == [1, 1, 1]


def test_an_unpicklable_family_compiles_here(cache_dir, caplog):
    import user_kernels  # its cute_call carries a lambda reference: the family cannot be pickled

    cl.clear_cache()
    with caplog.at_level(logging.WARNING, logger="cutelayers"), cl.parallel_compiles(workers=2) as session:
        text = lower_cuda(lambda x: user_kernels.add(x, 0.625), jax.ShapeDtypeStruct((300,), jnp.float32))
    assert "kernel family 'add' cannot be pickled" in caplog.text
    assert (session.compiled_in_workers, session.compiled_here) == (0, 1)
    assert all(registered_kernel(t) is not None for t in kernel_targets(text))
    assert cl.cache_info()["add"].compiles == 1


def test_a_failing_worker_falls_back_to_compiling_here(cache_dir, caplog):
    def f(x):  # two kernels for the pool; one fails in its worker
        return call_on_rows(FailsInWorkers("sum"), x)[0] + cl.ops.reduce_max(x)

    cl.clear_cache()
    with caplog.at_level(logging.WARNING, logger="cutelayers"), cl.parallel_compiles(workers=2) as session:
        text = lower_cuda(f, jax.ShapeDtypeStruct((7, 392), jnp.float32))
    assert "compile worker failed (RuntimeError: this kernel does not build in a compile worker)" in caplog.text
    assert (session.compiled_in_workers, session.compiled_here) == (1, 1)
    assert all(registered_kernel(t) is not None for t in kernel_targets(text))
    info = cl.cache_info()
    assert info["reduce_fails_in_workers"].compiles == info["reduce_max"].compiles == 1


def test_an_exception_inside_the_block_leaves_nothing_pending(cache_dir):
    f = jax.jit(lambda x: cl.ops.reduce_sum(x) + cl.ops.reduce_max(x))
    x = jax.ShapeDtypeStruct((3, 456), jnp.float16)
    cl.clear_cache()
    with pytest.raises(RuntimeError, match="while lowering"), cl.parallel_compiles(workers=2):
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        raise RuntimeError("an error while lowering")
    assert not any(registered_kernel(t) for t in kernel_targets(text))
    assert all(s.compiles == 0 for s in cl.cache_info().values())
    # Lowering the same function again is not served a cached module calling kernels never built,
    # and finds no placeholder: it compiles each kernel.
    with cl.parallel_compiles(workers=1) as session:
        f.trace(x).lower(lowering_platforms=("cuda",))
    assert session.compiled_here == 2
    info = cl.cache_info()
    assert [(info[n].compiles, info[n].memory_hits) for n in ("reduce_sum", "reduce_max")] == [(1, 0), (1, 0)]
    assert all(registered_kernel(t) for t in kernel_targets(text))


@pytest.mark.parametrize("workers", [0, -2, 1.5, True, "4"])
def test_workers_must_be_a_positive_integer(workers):
    with pytest.raises(ValueError, match=r"parallel_compiles: workers must be a positive integer.*got"):
        cl.parallel_compiles(workers)


def test_default_workers_leave_a_core_to_the_parent():
    assert 1 <= parallel_compile.default_workers() <= 15
    assert cl.parallel_compiles is parallel_compile.parallel_compiles


def test_the_pool_shuts_down_at_interpreter_exit(tmp_path):
    """A process that compiled in workers (and keeps its pool) exits promptly and quietly."""
    program = textwrap.dedent("""
        import jax, jax.numpy as jnp
        import cutelayers as cl

        x = jax.ShapeDtypeStruct((3, 136), jnp.float32)
        with cl.parallel_compiles(workers=2) as session:
            jax.jit(lambda x: cl.ops.reduce_sum(x) + cl.ops.reduce_max(x)).trace(x).lower(
                lowering_platforms=("cuda",))
        print(session.compiled_in_workers + session.compiled_here)
    """)
    env = {**os.environ, "CUTELAYERS_CACHE_DIR": str(tmp_path), "CUTE_DSL_ARCH": "sm_90a"}
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "2"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-3000:]
