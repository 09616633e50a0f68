"""Compile-once cache for CuTe kernels, with per-kernel statistics.

One process-wide :class:`CompileCache` maps a compile key to a compiled kernel (and the name of the
XLA FFI target it is registered under). The key never contains the row count: kernels are compiled
with a symbolic row count, so one compile serves every batch size.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


@dataclasses.dataclass
class KernelStats:
    """Statistics of one kernel name: compiles, cache hits and seconds spent compiling."""

    compiles: int = 0
    hits: int = 0
    compile_seconds: float = 0.0


class CompileCache:
    """Thread-safe compile-once cache.

    CuTe DSL tracing mutates process-global state, so compiles are serialized under one lock; a
    thread that waited for a compile of the same key finds it done and counts a hit.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[Hashable, object] = {}
        self._stats: dict[str, KernelStats] = {}
        self.generation = 0  # bumped by clear(), so names derived from keys stay unique

    def get_or_compile(self, name: str, key: Hashable, build: Callable[[], T]) -> T:
        """Return the entry for ``key``, calling ``build()`` once if it is missing."""
        with self._lock:
            stats = self._stats.setdefault(name, KernelStats())
            if key in self._entries:
                stats.hits += 1
                return self._entries[key]  # type: ignore[return-value]
            start = time.perf_counter()
            value = build()
            stats.compile_seconds += time.perf_counter() - start
            stats.compiles += 1
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
            self.generation += 1


COMPILE_CACHE = CompileCache()


def cache_info() -> dict[str, KernelStats]:
    """Per-kernel compile statistics: ``{name: KernelStats(compiles, hits, compile_seconds)}``.

    A *compile* is a CuTe DSL compile; a *hit* is a lowering that reused a compiled kernel (the same
    kernel, dtypes, static dims, alignment, config, GPU arch and library versions).
    """
    return COMPILE_CACHE.info()


def clear_cache() -> None:
    """Empty the compile cache and reset its statistics."""
    COMPILE_CACHE.clear()
