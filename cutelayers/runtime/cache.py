"""Compile-once cache for CuTe kernels, with per-kernel statistics.

One process-wide :class:`CompileCache` maps a compile key to a compiled kernel (and the name of the
XLA FFI target it is registered under). The key never contains the row count: kernels are compiled
with a symbolic row count, so one compile serves every batch size. Behind it sits the disk cache
(:mod:`cutelayers.runtime.disk_cache`), so a second process loads kernels instead of compiling them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


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
                       load: Callable[[], T | None] | None = None) -> T:
        """Return the entry for ``key``; if it is missing, ``load()`` it (from disk; None: not
        there) or else ``compile()`` it, once."""
        with self._lock:
            stats = self._stats.setdefault(name, KernelStats())
            if key in self._entries:
                stats.memory_hits += 1
                return self._entries[key]  # type: ignore[return-value]
            start = time.perf_counter()
            value = load() if load is not None else None
            if value is not None:
                stats.disk_hits += 1
                stats.load_seconds += time.perf_counter() - start
            else:
                start = time.perf_counter()
                value = compile()
                stats.compiles += 1
                stats.compile_seconds += time.perf_counter() - start
            self._entries[key] = value
            return value

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
