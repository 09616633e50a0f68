"""Tuned kernel configs: a JSON table the runtime reads and :mod:`cutelayers.bench.autotune` writes.

Every tunable kernel family (:class:`cutelayers.runtime.family.TunableFamily`) has a heuristic
config (the table in its kernel module) and a config space (the candidates the autotuner sweeps;
the heuristic's config is always one of them). When an op builds a family for its operands it
calls :func:`resolve`, which picks

1. the tuned entry for (GPU, kernel, dtype, dims), if the tables hold one that names a config of
   the family's space for these operands -- the GPU being the visible one, or on a host without
   one ``$CUTELAYERS_DEVICE_KIND`` (:func:`device_kind`);
2. otherwise the heuristic.

The chosen config is a field of the family, and the family is part of the compile key, so a tuned
config compiles its own kernel and no cache (memory or disk) serves a kernel built for another.
Functions already traced keep the config they were traced with (``jax.clear_caches()`` re-traces).

Tables, later ones winning for the same key:

* shipped: ``cutelayers/tuning/tuned_configs.json`` (package data): the winners of the sweeps
  recorded in docs/benchmarks.md, for the GPUs they ran on (an H100 SXM and an H200); a GPU,
  kernel or shape without an entry runs its heuristic config;
* the user's: ``$CUTELAYERS_TUNING_FILE`` if set (empty: no user table), otherwise
  ``$XDG_CACHE_HOME/cutelayers/tuned_configs.json`` or ``~/.cache/cutelayers/tuned_configs.json``
  -- where ``python -m cutelayers.bench.autotune`` writes by default.

Format::

    {"format": 1,
     "entries": [{"device": "NVIDIA H100 80GB HBM3",          # jax device_kind of the GPU
                  "kernel": "layer_norm_fwd",                  # the family's name
                  "dtype": "bfloat16",                         # the operands' ("bfloat16+float32": mixed)
                  "dims": {"n": 4096},
                  "config": {"threads_per_row": 256, "num_threads": 256, "unroll": 2},
                  "time_us": 101.2, "default_time_us": 104.9}]}  # informational

Row kernels' dims are ``{"n": N, "rows": "65-32768"}``, ``rows`` a range of row counts
(:func:`cutelayers.kernels.reduction_config.row_count_bucket`), or ``{"n": N}`` for every row count
where no entry names the range (but the first range's, a decode batch's: those take a ranged entry
or the heuristic); the GEMM's are ``{"m": "2048+", "k": K, "n":
N}``, ``m`` a range of row counts (:func:`cutelayers.kernels.gemm_config.row_bucket`), except for
``linear_dkernel``, whose rows are the contraction: ``{"m": K, "n": N}``.

A table that cannot be read, or an entry that is malformed or names a config outside the family's
space, gives a :class:`TuningTableWarning` that names the file and the key, and the heuristic runs:
never a crash, never a kernel built from an invalid config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from cutelayers.runtime.disk_cache import user_cache_path, write_atomically
from cutelayers.runtime.family import Dims, TunableFamily

FORMAT = 1
SHIPPED_TABLE = Path(__file__).resolve().parent / "tuned_configs.json"
# field -> (Python type, JSON name) of an entry's required fields
ENTRY_FIELDS = {"device": (str, "string"), "kernel": (str, "string"), "dtype": (str, "string"),
                "dims": (dict, "object"), "config": (dict, "object")}


class TuningTableWarning(UserWarning):
    """A tuned-config table or entry was ignored (the heuristic config runs instead)."""


def user_table_path() -> Path | None:
    """The user's table: ``$CUTELAYERS_TUNING_FILE`` (empty: none), else under the user cache dir."""
    return user_cache_path("CUTELAYERS_TUNING_FILE", "tuned_configs.json")


@functools.cache
def visible_gpu_kind() -> str | None:
    """The first CUDA device's ``device_kind``; None without a CUDA device."""
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return None
    return gpus[0].device_kind if gpus else None


def device_kind() -> str | None:
    """The GPU whose tuned entries apply: the visible one (:func:`visible_gpu_kind`); without a
    CUDA device, ``$CUTELAYERS_DEVICE_KIND`` if set -- compiling for ``CUTE_DSL_ARCH`` on a CPU-only
    host the configs that GPU would run (e.g. "NVIDIA H100 80GB HBM3", to read their PTX) --, else
    None (the heuristic)."""
    return visible_gpu_kind() or os.environ.get("CUTELAYERS_DEVICE_KIND") or None


TableKey = tuple[str, str, str, Dims]


def table_key(device: str, kernel: str, dtype: str, dims) -> TableKey:
    """The lookup key of an entry; ``dims`` a mapping or pairs, order free."""
    return device, kernel, dtype, tuple(sorted(dict(dims).items()))


def describe_key(key: TableKey) -> str:
    device, kernel, dtype, dims = key
    return f"(device={device!r}, kernel={kernel!r}, dtype={dtype!r}, dims={dict(dims)})"


@dataclasses.dataclass(frozen=True)
class TableEntry:
    """One tuned config, as read from ``source``."""

    key: TableKey
    config: dict
    source: str


def _warn(message: str) -> None:
    warnings.warn(message, TuningTableWarning, stacklevel=3)


def _entry_problem(entry) -> str | None:
    """Why ``entry`` is malformed, or None."""
    if not isinstance(entry, dict):
        return f"an entry must be an object; got {type(entry).__name__}"
    for name, (kind, json_name) in ENTRY_FIELDS.items():
        if not isinstance(entry.get(name), kind):
            return f"field {name!r} must be a JSON {json_name}; got {entry.get(name)!r}"
    for name, value in entry["dims"].items():
        if not isinstance(value, (int, str)):  # bool is an int: flags such as a GEMM's source
            return f"dims[{name!r}] must be an integer, a boolean or a string; got {value!r}"
    for name, value in entry["config"].items():
        if not isinstance(value, int):  # bool is an int: flags such as a GEMM's pingpong
            return f"config[{name!r}] must be an integer or a boolean; got {value!r}"
    return None


def read_table(path: Path) -> list[TableEntry]:
    """The well-formed entries of the table at ``path`` (none if it does not exist); a warning
    for an unreadable file and for every malformed entry, which is skipped."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as e:
        _warn(f"tuned-config table {path}: cannot read it ({e}); ignoring it")
        return []
    try:
        table = json.loads(text)
    except ValueError as e:
        _warn(f"tuned-config table {path}: not valid JSON ({e}); ignoring it")
        return []
    if not _is_table(table):
        _warn(f"tuned-config table {path}: expected an object with \"format\": {FORMAT} and an "
              f"\"entries\" list; ignoring it")
        return []
    entries = []
    for index, entry in enumerate(table["entries"]):
        problem = _entry_problem(entry)
        if problem:
            _warn(f"tuned-config table {path}: entry {index} ignored: {problem}")
            continue
        entries.append(TableEntry(_entry_key(entry), entry["config"], str(path)))
    return entries


def _is_table(obj) -> bool:
    """The table format's outer shape: an object with the current "format" and an "entries" list."""
    return isinstance(obj, dict) and obj.get("format") == FORMAT and isinstance(obj.get("entries"), list)


def _entry_key(entry: dict) -> TableKey:
    """The lookup key of an entry that has passed :func:`_entry_problem`."""
    return table_key(entry["device"], entry["kernel"], entry["dtype"], entry["dims"])


def _table_files() -> tuple[Path, ...]:
    user = user_table_path()
    return (SHIPPED_TABLE,) + ((user,) if user is not None else ())


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


@functools.lru_cache(maxsize=8)
def _merged(files: tuple[tuple[Path, tuple[int, int] | None], ...]) -> dict[TableKey, TableEntry]:
    merged: dict[TableKey, TableEntry] = {}
    for path, _ in files:
        merged.update((e.key, e) for e in read_table(path))
    return merged


def tuned_entries() -> dict[TableKey, TableEntry]:
    """Every tuned entry, the user's table over the shipped one; re-read when a file changes."""
    return _merged(tuple((p, _stamp(p)) for p in _table_files()))


def config_fields(config) -> dict:
    """A config's JSON form."""
    return dataclasses.asdict(config)


def describe_config(config) -> str:
    return " ".join(f"{k}={v}" for k, v in config_fields(config).items())


def choose_config(family: TunableFamily, avals: Sequence) -> Any:
    """The tuned config of ``family`` for ``avals`` on this GPU if the tables name a valid one (by
    the first of its keys, :meth:`~cutelayers.runtime.family.TunableFamily.tuning_keys`, that an
    entry has), else the heuristic."""
    default = family.default_config(avals)
    device = device_kind()
    if device is None:
        return default
    entries = tuned_entries()
    keys = (table_key(device, family.name, *key) for key in family.tuning_keys(avals))
    key = next((key for key in keys if key in entries), None)
    if key is None:
        return default
    entry = entries[key]
    where = f"tuned-config table {entry.source}: entry {describe_key(key)}"
    try:
        config = family.config_from_fields(entry.config)
    except (TypeError, ValueError) as e:
        _warn(f"{where} names an invalid config {entry.config} ({e}); using the heuristic config")
        return default
    space = family.config_space(avals)
    if config not in space:
        fields = tuple(config_fields(default))
        allowed = ", ".join(str(tuple(config_fields(c).values())) for c in space)
        _warn(f"{where} names {entry.config}, which is not a candidate config for these operands; "
              f"allowed {fields}: {allowed}. Using the heuristic config")
        return default
    return config


def resolve(family: TunableFamily, avals: Sequence) -> TunableFamily:
    """``family`` with its config chosen for ``avals`` (see :func:`choose_config`); itself if it
    has one already."""
    if family.config is not None:
        return family
    return family.with_config(choose_config(family, avals), avals)


def dtype_names(dtypes) -> str:
    """Distinct dtype names in order of appearance, joined by '+' ('bfloat16', 'bfloat16+float32')."""
    return "+".join(dict.fromkeys(jnp.dtype(d).name for d in dtypes))


def write_entries(path: Path, entries: list[dict]) -> None:
    """Add ``entries`` (JSON objects in the table format) to the table at ``path``, replacing
    entries with the same key; written to a temporary file and renamed into place.

    Raises ValueError if ``path`` exists and is not a readable table (it is not overwritten).
    """
    table: dict = {"format": FORMAT, "entries": []}
    if path.exists():
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot add tuned configs to {path}: it is not a readable table ({e})") from None
        if not _is_table(table):
            raise ValueError(f"cannot add tuned configs to {path}: expected an object with "
                             f"\"format\": {FORMAT} and an \"entries\" list")

    def key_of(entry):
        return _entry_key(entry) if _entry_problem(entry) is None else None

    new_keys = {key_of(e) for e in entries}
    kept = [e for e in table["entries"] if (key := key_of(e)) is None or key not in new_keys]
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({**table, "entries": kept + list(entries)}, indent=1) + "\n"
    write_atomically(path, text.encode())
