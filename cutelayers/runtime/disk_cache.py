"""Persistent (on-disk) cache of compiled CuTe kernels, so a second process compiles nothing.

Where: ``$CUTELAYERS_CACHE_DIR`` if set (an empty value disables the disk cache), otherwise
``$XDG_CACHE_HOME/cutelayers/kernels`` or ``~/.cache/cutelayers/kernels``.

An entry is two files named by the SHA-256 of its key text (the kernel's compile key, the GPU
arch, the library versions and a hash of the kernel source):

* ``<digest>.o`` -- the compiled kernel as a relocatable object (CuTe DSL's ``export_to_c``), loaded
  back with ``cutlass.cute.runtime.load_module`` as a TVM-FFI function;
* ``<digest>.json`` -- the key text, the object's size and SHA-256.

Both are written to a temporary file and renamed into place, so concurrent processes never see a
half-written file. An entry whose metadata is unreadable, whose key text differs (a digest
collision or a hand-edited file) or whose object does not match its recorded size and hash is
ignored, recompiled and replaced -- never loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from cutelayers import backend as _backend

FORMAT = 1  # bump when the entry layout changes
_FUNCTION = "cutelayers_kernel"  # symbol prefix inside every object file (one function per file)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # an object repr: not stable across processes


def user_cache_path(variable: str, *parts: str) -> Path | None:
    """``$variable`` if set (an empty value: None, the feature is off), else ``parts`` under
    ``$XDG_CACHE_HOME/cutelayers`` (an absolute path; the XDG spec ignores a relative one) or
    ``~/.cache/cutelayers``."""
    configured = os.environ.get(variable)
    if configured is not None:
        return Path(configured).expanduser() if configured else None
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG spec says to ignore it
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).joinpath("cutelayers", *parts)


def cache_dir() -> Path | None:
    """The disk cache's directory, or None when ``CUTELAYERS_CACHE_DIR=""`` disables it."""
    return user_cache_path("CUTELAYERS_CACHE_DIR", "kernels")


@functools.cache
def _hash_files(paths: tuple[str, ...], root: str | None = None) -> str:
    """SHA-256 over each file's name -- relative to ``root`` if given -- and its bytes."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update((os.path.relpath(path, root) if root else path).encode())
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def package_source_digest(root: Path) -> str:
    """SHA-256 over every Python file under the package folder ``root``, named relative to it:
    the same source anywhere (another checkout, another machine) has the same digest."""
    return _hash_files(tuple(str(p) for p in sorted(root.rglob("*.py"))), str(root))


def library_source_digest() -> str:
    """:func:`package_source_digest` of the cutelayers package (the kernels and their callers):
    a kernel's entry is found again wherever the same source is installed."""
    return package_source_digest(Path(__file__).resolve().parent.parent)


def source_digest(extra_files: tuple[str, ...]) -> str:
    """The library's source digest combined with ``extra_files`` (a user kernel's module)."""
    return _hash_files((*sorted(extra_files),)) + library_source_digest() if extra_files else library_source_digest()


def stable_key_text(key: Any) -> str | None:
    """``repr(key)`` if it is the same in every process, else None (the entry stays in memory)."""
    text = repr(key)
    return None if _ADDRESS.search(text) else text


def object_bytes(compiled) -> bytes:
    """The relocatable object of a CuTe DSL compiled function (what an entry stores)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.o")
        compiled.export_to_c(path, function_name=_FUNCTION)
        return Path(path).read_bytes()


def load_object(path: Path):
    """Load an object file written by :func:`object_bytes` as a TVM-FFI function."""
    from cutlass.cute.runtime import load_module

    return getattr(load_module(str(path), enable_tvm_ffi=True), _FUNCTION)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it into place: readers see
    the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    """One kernel's place in the disk cache."""

    directory: Path
    key_text: str

    @property
    def digest(self) -> str:
        """SHA-256 of the key text: the entry's file names."""
        return hashlib.sha256(self.key_text.encode()).hexdigest()

    @property
    def object_path(self) -> Path:
        """The compiled kernel's relocatable object."""
        return self.directory / f"{self.digest}.o"

    @property
    def meta_path(self) -> Path:
        """The metadata: key text, the object's size and SHA-256."""
        return self.directory / f"{self.digest}.json"

    def load(self):
        """``(function, object bytes)`` from disk, or None if absent or invalid (logged)."""
        if not self.meta_path.exists():
            return None
        try:
            meta = json.loads(self.meta_path.read_text())
            data = self.object_path.read_bytes()
        except (OSError, ValueError) as error:
            return self._reject(f"unreadable ({error})")
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("key") != self.key_text:
            return self._reject("written for another key or format")
        if meta.get("size") != len(data) or meta.get("sha256") != hashlib.sha256(data).hexdigest():
            return self._reject("object file does not match its recorded size and hash")
        try:
            return load_object(self.object_path), data
        except Exception as error:  # noqa: BLE001 -- a corrupt object that still hashes right (e.g. hand-written)
            return self._reject(f"object file failed to load ({type(error).__name__}: {error})")

    def _reject(self, why: str):
        _backend.warn_once(f"disk cache entry {self.meta_path} ignored and recompiled: {why}")

    def store(self, data: bytes) -> None:
        """Write the object and then its metadata, each by atomic rename."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomically(self.object_path, data)
            meta = {"format": FORMAT, "key": self.key_text, "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest()}
            write_atomically(self.meta_path, json.dumps(meta, indent=1).encode())
        except OSError as error:  # a read-only or full disk costs a recompile next time, no more
            _backend.warn_once(f"disk cache entry not written under {self.directory}: {error}")


def entry_for(key_text: str | None) -> DiskEntry | None:
    """The disk entry for a key's :func:`stable_key_text`, or None (disk cache disabled, or the
    key is not stable)."""
    directory = cache_dir()
    return DiskEntry(directory, key_text) if directory is not None and key_text else None
