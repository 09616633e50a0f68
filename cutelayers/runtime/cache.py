"""Compile-once cache for CuTe kernels, with per-kernel statistics.

One process-wide :class:`CompileCache` maps a compile key to a compiled kernel (and the name of the
XLA FFI target it is registered under). The key never contains the row count: kernels are compiled
with a symbolic row count, so one compile serves every batch size. Behind it sits the disk cache
(:mod:`cutelayers.runtime.disk_cache`), so a second process loads kernels instead of compiling them.

An entry may be a :class:`Pending` placeholder: a kernel whose compile was handed to a worker
process (:mod:`cutelayers.runtime.parallel_compile`). Lookups that can use one get it; the others
wait for it. Its compile is counted when it is filled in (:meth:`CompileCache.fill`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")
_MISSING = object()


class Pending(abc.ABC):
    """A cache entry still being produced elsewhere (a kernel compiling in a worker process)."""

    @abc.abstractmethod
    def result(self):
        """The finished value, once produced (waits for it, or produces it here); it is also
        filled into the cache (:meth:`CompileCache.fill`)."""


@dataclasses.dataclass
class KernelStats:
    """Statistics of one kernel name.

    ``compiles``: CuTe DSL compiles; ``memory_hits``: lowerings that reused a kernel already loaded
    in this process; ``disk_hits``: kernels loaded from the disk cache instead of compiled;
    ``compile_seconds`` / ``load_seconds``: time spent in each.
    """

    compiles: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    compile_seconds: float = 0.0
    load_seconds: float = 0.0


class CompileCache:
    """Thread-safe compile-once cache.

    CuTe DSL tracing mutates process-global state, so compiles are serialized under one lock; a
    thread that waited for a compile of the same key finds it done and counts a hit.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[Hashable, object] = {}
        self._stats: dict[str, KernelStats] = {}

    def get_or_compile(self, name: str, key: Hashable, compile: Callable[[], T],
                       load: Callable[[], T | None] | None = None,
                       defer: Callable[[], Pending] | None = None) -> T:
        """Return the entry for ``key``; if it is missing, ``load()`` it (from disk; None: not
        there) or else ``compile()`` it, once.

        ``defer``: instead of compiling, make a :class:`Pending` placeholder, store it and return
        it; a later lookup with ``defer`` gets the placeholder (a memory hit, as it would be once
        compiled), one without waits for its result.
        """
        while True:
            with self._lock:
                stats = self._stats.setdefault(name, KernelStats())
                value = self._entries.get(key, _MISSING)
                if value is _MISSING:
                    return self._produce(stats, key, compile, load, defer)
                if defer is not None or not isinstance(value, Pending):
                    stats.memory_hits += 1
                    return value  # type: ignore[return-value]
            # A compile in flight elsewhere: wait outside the lock (filling it in takes the lock),
            # then look again -- a memory hit, or missing again if that compile failed.
            value.result()

    def _produce(self, stats: KernelStats, key: Hashable, compile, load, defer):
        start = time.perf_counter()
        value = load() if load is not None else None
        if value is not None:
            stats.disk_hits += 1
            stats.load_seconds += time.perf_counter() - start
        elif defer is not None:
            value = defer()
        else:
            start = time.perf_counter()
            value = compile()
            stats.compiles += 1
            stats.compile_seconds += time.perf_counter() - start
        self._entries[key] = value
        return value

    def exclusive(self) -> contextlib.AbstractContextManager:
        """The lock that serializes compiles in this process (CuTe DSL tracing mutates
        process-global state): hold it to compile or load outside :meth:`get_or_compile`."""
        return self._lock

    def fill(self, name: str, key: Hashable, pending: Pending, value: T, compile_seconds: float) -> None:
        """Replace placeholder ``pending`` by its finished ``value`` and count the compile (and its
        seconds); also where the entry is gone (the cache was cleared, or the placeholder
        discarded), but not where another value took its place (that one was counted)."""
        with self._lock:
            if self._entries.get(key, pending) is pending:
                self._entries[key] = value
                stats = self._stats.setdefault(name, KernelStats())
                stats.compiles += 1
                stats.compile_seconds += compile_seconds

    def discard(self, key: Hashable, pending: Pending) -> None:
        """Forget placeholder ``pending`` (its compile was abandoned or failed): the next lookup of
        ``key`` compiles again."""
        with self._lock:
            if self._entries.get(key) is pending:
                del self._entries[key]

    def info(self) -> dict[str, KernelStats]:
        """A snapshot of the statistics, keyed by kernel name."""
        with self._lock:
            return {k: dataclasses.replace(v) for k, v in sorted(self._stats.items())}

    def clear(self) -> None:
        """Forget every compiled kernel and every statistic."""
        with self._lock:
            self._entries.clear()
            self._stats.clear()


COMPILE_CACHE = CompileCache()


def cache_info() -> dict[str, KernelStats]:
    """Per-kernel statistics: ``{name: KernelStats(compiles, memory_hits, disk_hits, ...)}``.

    A *compile* is a CuTe DSL compile; a *memory hit* is a lowering that reused a kernel of this
    process (the same kernel, dtypes, static dims, alignment, config, GPU arch and library
    versions); a *disk hit* loaded that kernel from the disk cache, written by an earlier process.
    """
    return COMPILE_CACHE.info()


def clear_cache() -> None:
    """Empty the in-memory compile cache and reset its statistics (the disk cache stays; delete
    its directory, :func:`cutelayers.runtime.disk_cache.cache_dir`, to empty it)."""
    COMPILE_CACHE.clear()
