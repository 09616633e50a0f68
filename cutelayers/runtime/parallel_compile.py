"""Compile CuTe kernels in worker processes while JAX lowers: :func:`parallel_compiles`.

Without it, a lowering compiles each new kernel where it meets it (1-3 s each), one after another.
But a kernel's FFI target name is a digest of its compile key, known before compiling
(:func:`~cutelayers.runtime.primitive.ffi_target_for`), so the lowering can emit the custom call at
once: the kernel only has to be compiled and registered before XLA compiles the lowered module.
Inside ``with parallel_compiles():``

* a kernel already in this process's compile cache, or in the disk cache, is used as always;
* any other is submitted to a pool of worker processes and the lowering goes on. A placeholder
  takes its place in the compile cache, so its next use is a memory hit;
* leaving the block waits for every submitted compile; for each, this process stores the object
  the worker built in the disk cache, loads and registers it and counts the compile (with the
  worker's seconds) in ``cutelayers.cache_info()``, which reads as after compiling one by one.

So: lower inside the block, compile after it::

    with cutelayers.parallel_compiles():
        lowered = jax.jit(step).lower(*args)
    compiled = lowered.compile()

The workers are ``spawn``-ed processes (never forked from a process whose JAX may hold a GPU).
Each imports cutelayers and the CuTe DSL once, as it starts, so those imports overlap the
lowering; runs JAX on the CPU only, so it never touches a GPU; and builds for the parent's target
arch (``CUTE_DSL_ARCH``). The pool starts when a block has a second kernel to compile, serves the
blocks that follow, and shuts down after :data:`IDLE_SECONDS` without one (or at
:func:`shutdown_workers`, or at interpreter exit).

Compiled in this process instead, at the end of the block: every kernel with ``workers=1``; a
block's only kernel (a pool would not pay for its start); a kernel whose family cannot be pickled
(a ``cute_call`` launcher or reference defined in a function); and a kernel whose worker failed,
so that a compile error surfaces here with its real traceback. The last two log once why. While
it waits for the workers, this process also compiles the kernels no worker has started yet.

An exception inside the block abandons its compiles (nothing stays pending; and as JAX's cached
lowerings may call kernels that will not be built, ``jax.clear_caches()``) and propagates.

Like every ``spawn`` pool, workers import the program's main module: a script that uses this
must guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import pickle
import pkgutil
import threading
import time
from collections.abc import Hashable, Iterator

import jax

from cutelayers import backend as _backend
from cutelayers.runtime import disk_cache, primitive
from cutelayers.runtime.cache import COMPILE_CACHE, Pending

__all__ = ["IDLE_SECONDS", "CompileSession", "default_workers", "parallel_compiles", "shutdown_workers"]

IDLE_SECONDS = 60.0  # an idle pool's workers hold JAX and the CuTe DSL in memory: not for long
MAX_WORKERS = 16  # more rarely pays: a train step has a few dozen distinct kernels at most

logger = logging.getLogger("cutelayers")


def default_workers() -> int:
    """The workers of ``parallel_compiles()``: one per CPU core up to 16, less one for the process
    that lowers; at least 1. The cores are those this process may run on, where the OS says
    (a job scheduler's CPU set), else all of the machine's."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, MAX_WORKERS) - 1)


def _check_workers(workers) -> int:
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"parallel_compiles: workers must be a positive integer, or None for one per CPU "
                         f"core up to {MAX_WORKERS} less one ({default_workers()} here); got {workers!r}")
    return workers


# --- in a worker ---------------------------------------------------------------------------------

def _start_worker(arch: str) -> None:
    """Each worker's initializer: no GPU, the parent's target arch, the slow imports done now."""
    # Before any backend is used (unpickling a job creates none): this process never opens a GPU.
    jax.config.update("jax_platforms", "cpu")
    # Before the CuTe DSL is imported (it reads the variable then): build for the parent's arch,
    # whatever GPU this host has or lacks.
    os.environ["CUTE_DSL_ARCH"] = arch
    import cutlass.cute  # noqa: F401

    import cutelayers.kernels
    from cutelayers.runtime import launch  # noqa: F401  (the shim every kernel compiles through)

    for module in pkgutil.iter_modules(cutelayers.kernels.__path__, "cutelayers.kernels."):
        __import__(module.name)


def _compile_in_worker(payload: bytes) -> tuple[bytes, float]:
    """Build one kernel (``payload``: the pickled family, operand and result avals): its object
    bytes and the seconds the build took."""
    family, avals, out_avals = pickle.loads(payload)
    start = time.perf_counter()
    data = disk_cache.object_bytes(primitive.build_launcher(family, avals, out_avals))
    return data, time.perf_counter() - start


# --- the pool ------------------------------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: concurrent.futures.ProcessPoolExecutor | None = None
_pool_shape: tuple[int, str] | None = None  # (workers, arch) the pool was started with
_open_sessions = 0
_idle_timer: threading.Timer | None = None


def _worker_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """The pool of ``workers`` processes for this target arch, started on first use."""
    global _pool, _pool_shape
    arch, _ = primitive.target_arch()
    with _pool_lock:
        if _pool is not None and _pool_shape != (workers, arch):
            _pool.shutdown(wait=False)  # its queued work still runs; a new block uses the new pool
            _pool = None
        if _pool is None:
            _pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker, initargs=(arch,))
            _pool_shape = (workers, arch)
            logger.info("cutelayers: compiling kernels in up to %d worker processes (%s)", workers, arch)
        return _pool


def _drop_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Forget ``pool`` (broken: a worker died), so the next compile starts a new one."""
    global _pool
    with _pool_lock:
        if _pool is pool:
            _pool = None
    pool.shutdown(wait=False, cancel_futures=True)


def shutdown_workers() -> None:
    """Stop the compile workers now (they stop by themselves after :data:`IDLE_SECONDS` idle);
    compiles they had queued are cancelled and compile in this process when waited for."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


# Stop and drop the pool before the interpreter tears its modules down: the pool's own exit hook
# has stopped idle workers by then, but a pool object that outlives its modules complains as it is
# collected.
atexit.register(shutdown_workers)


def _session_opened() -> None:
    global _open_sessions
    with _pool_lock:
        _open_sessions += 1
        if _idle_timer is not None:
            _idle_timer.cancel()


def _session_closed() -> None:
    global _open_sessions, _idle_timer
    with _pool_lock:
        _open_sessions -= 1
        if _open_sessions == 0 and _pool is not None:
            # A daemon thread: a pending timer never holds up interpreter exit.
            _idle_timer = threading.Timer(IDLE_SECONDS, _stop_if_idle)
            _idle_timer.daemon = True
            _idle_timer.start()


def _stop_if_idle() -> None:
    global _pool
    with _pool_lock:
        if _open_sessions or _pool is None:
            return
        pool, _pool = _pool, None
    pool.shutdown(wait=False)


# --- in the parent -------------------------------------------------------------------------------

class _PendingCompile(Pending):
    """A kernel submitted in a session: its FFI target (all a lowering needs) and its compile, in a
    worker (``future``) or, without one, here when its result is asked for."""

    def __init__(self, key: Hashable, job: primitive.CompileJob):
        self.key = key
        self.job = job
        self.target = job.target
        self.payload: bytes | None = None  # what a worker receives, if one may build it
        self.future: concurrent.futures.Future | None = None
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.compiled_here: bool | None = None  # once finished: here, or in a worker
        self._lock = threading.Lock()
        self._kernel: primitive.CompiledKernel | None = None

    def result(self) -> primitive.CompiledKernel:
        with self._lock:  # finished once, by whichever thread asks first
            if self._kernel is None:
                try:
                    self._kernel = self._finish()
                except BaseException:
                    COMPILE_CACHE.discard(self.key, self)  # the next lookup compiles (and fails) anew
                    raise
            return self._kernel

    def _finish(self) -> primitive.CompiledKernel:
        if self.future is not None:
            try:
                data, seconds = self.future.result()
                return self._adopt(data, seconds)
            except concurrent.futures.CancelledError:
                pass  # taken back from the queue (or abandoned): compiled here
            except Exception as error:  # noqa: BLE001  (compiled again here, where it raises for real)
                if isinstance(error, concurrent.futures.BrokenExecutor) and self.pool is not None:
                    _drop_pool(self.pool)
                _backend.log_once("in-process compile", f"a compile worker failed ({type(error).__name__}: "
                                                        f"{error}); its kernel compiles in this process")
        with COMPILE_CACHE.exclusive():
            start = time.perf_counter()
            kernel = primitive.compile_kernel(self.job)
            COMPILE_CACHE.fill(self.job.name, self.key, self, kernel, time.perf_counter() - start)
        self.compiled_here = True
        return kernel

    def _adopt(self, data: bytes, seconds: float) -> primitive.CompiledKernel:
        """Store, load and register the object a worker built, and count its compile."""
        with COMPILE_CACHE.exclusive():  # loading touches the CuTe DSL runtime too: one at a time
            if self.job.entry is not None:
                self.job.entry.store(data)
            kernel = primitive.kernel_from_object(self.target, data, self.job.family.graph_safe)
        COMPILE_CACHE.fill(self.job.name, self.key, self, kernel, seconds)
        self.compiled_here = False
        return kernel


class CompileSession:
    """The compiles of one :func:`parallel_compiles` block (what the block's ``as`` gets).

    ``workers``: the pool size it uses. After the block, ``compiled_in_workers`` and
    ``compiled_here`` count the kernels it compiled each way.
    """

    def __init__(self, workers: int):
        self.workers = workers
        self.compiled_in_workers = 0
        self.compiled_here = 0
        self._lock = threading.Lock()
        self._submitted: list[_PendingCompile] = []
        self._needed: dict[int, _PendingCompile] = {}  # every placeholder the block's lowerings used
        self._held: list[_PendingCompile] = []  # poolable, not sent: a pool starts at the second
        self._pooled: list[_PendingCompile] = []  # sent to the pool, in order
        self._pool_used = False

    def submit(self, key: Hashable, job: primitive.CompileJob) -> _PendingCompile:
        """Called by the compile cache for a kernel it lacks: a placeholder, its compile under way."""
        pending = _PendingCompile(key, job)
        if self.workers > 1:
            pending.payload = _pickled(job)
        with self._lock:
            self._submitted.append(pending)
            if pending.payload is None:
                return pending
            self._held.append(pending)
            if not self._pool_used and len(self._held) < 2:
                return pending
            batch, self._held, self._pool_used = self._held, [], True
        try:
            pool = _worker_pool(self.workers)
            for waiting in batch:
                waiting.future = pool.submit(_compile_in_worker, waiting.payload)
                waiting.pool = pool
                with self._lock:
                    self._pooled.append(waiting)
        except Exception as error:  # noqa: BLE001  (e.g. at interpreter exit: those left compile here)
            _backend.log_once("in-process compile", f"no compile worker could take a kernel ({type(error).__name__}: "
                                                    f"{error}); it compiles in this process")
        return pending

    def track(self, kernel) -> None:
        """Note a placeholder a lowering of this block used (its own or another block's)."""
        if isinstance(kernel, _PendingCompile):
            with self._lock:
                self._needed.setdefault(id(kernel), kernel)

    def finish(self) -> None:
        """Wait for every kernel the block's lowerings used: each is then registered and cached."""
        needed = list(self._needed.values())
        for pending in needed:  # those no worker builds, while the workers build theirs
            if pending.future is None:
                pending.result()
        # Then the tail of the queue, from its end: kernels queued behind a worker's worth of
        # others, which no worker has started yet (cancel() fails for those it has).
        for pending in reversed(self._pooled[self.workers:]):
            if pending.future.cancel():
                pending.result()
        for pending in needed:
            pending.result()
        own = {id(p) for p in self._submitted}
        for pending in needed:
            if id(pending) in own:
                self.compiled_here += bool(pending.compiled_here)
                self.compiled_in_workers += not pending.compiled_here

    def abandon(self) -> None:
        """Drop the block's compiles: cancel the queued ones, forget every placeholder (a running
        compile finishes in its worker, unused)."""
        for pending in self._submitted:
            if pending.future is not None:
                pending.future.cancel()
            COMPILE_CACHE.discard(pending.key, pending)
        if self._needed:
            # JAX caches lowerings: lowering the same function again would reuse a module that
            # calls kernels never built here, and XLA would fail on it. Its caches must go.
            jax.clear_caches()


def _pickled(job: primitive.CompileJob) -> bytes | None:
    """What a worker needs to build ``job``, pickled; None (and a log line) if it cannot be."""
    try:
        return pickle.dumps((job.family, job.avals, job.out_avals))
    except Exception as error:  # noqa: BLE001  (pickling raises several types: compiled here instead)
        _backend.log_once("in-process compile", f"kernel family {job.name!r} cannot be pickled for a compile "
                                                f"worker ({type(error).__name__}: {error}); it compiles in "
                                                "this process")
        return None


def parallel_compiles(workers: int | None = None) -> contextlib.AbstractContextManager[CompileSession]:
    """Context manager: kernels that lowerings inside it need compile in ``workers`` worker
    processes while lowering goes on, and are ready (registered, cached, on disk) when it exits.
    Lower inside it, ``.compile()`` after it (see the module docstring).

    Args:
      workers: worker processes; None: one per CPU core up to 16, less one for this process
        (:func:`default_workers`). ``1`` compiles every kernel in this process at the block's end.

    Returns:
      A context manager whose ``as`` target is the block's :class:`CompileSession`.
    """
    return _session(_check_workers(workers))


@contextlib.contextmanager
def _session(workers: int) -> Iterator[CompileSession]:
    session = CompileSession(workers)
    _session_opened()
    token = primitive.COMPILE_SESSION.set(session)
    try:
        try:
            yield session
        finally:
            primitive.COMPILE_SESSION.reset(token)
        session.finish()
    except BaseException:
        session.abandon()
        raise
    finally:
        _session_closed()
