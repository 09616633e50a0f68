"""The disk cache of compiled kernels (CuTe compiles for sm_90a on this CPU-only machine).

A second process finds every kernel on disk and compiles nothing; corrupt, truncated or foreign
entries are detected, recompiled and replaced; concurrent writers leave valid entries.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import cutelayers as cl
from cutelayers.runtime import disk_cache

# Three kernel families (norm, softmax, reduction) in one lowering.
PROGRAM = textwrap.dedent("""
    import json, jax, jax.numpy as jnp
    import cutelayers as cl

    def f(x, scale):
        return cl.ops.softmax(cl.ops.rms_norm(x, scale)) + cl.ops.reduce_max(x)[..., None]

    jax.jit(f).trace(jax.ShapeDtypeStruct((6, 40, 1000), jnp.bfloat16),
                     jax.ShapeDtypeStruct((1000,), jnp.float32)).lower(lowering_platforms=("cuda",))
    print(json.dumps({k: [v.compiles, v.disk_hits] for k, v in cl.cache_info().items()}))
""")
KERNELS = {"rms_norm_fwd", "softmax_fwd", "reduce_max"}


def start_process(cache_dir) -> subprocess.Popen:
    """PROGRAM in a new process whose disk cache is ``cache_dir``."""
    env = {**os.environ, "CUTELAYERS_CACHE_DIR": str(cache_dir), "CUTE_DSL_ARCH": "sm_90a"}
    return subprocess.Popen([sys.executable, "-c", PROGRAM], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish_process(process: subprocess.Popen) -> dict[str, list[int]]:
    """The process's report: {kernel: [compiles, disk hits]}."""
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def run_process(cache_dir) -> dict[str, list[int]]:
    return finish_process(start_process(cache_dir))


@pytest.fixture(autouse=True)
def fresh_cache():
    cl.clear_cache()
    jax.clear_caches()
    yield
    cl.clear_cache()


def lower_in_process(cache_dir, monkeypatch, n=512):
    monkeypatch.setenv("CUTELAYERS_CACHE_DIR", str(cache_dir))
    cl.clear_cache()
    jax.clear_caches()
    jax.jit(cl.ops.layer_norm).trace(
        jax.ShapeDtypeStruct((3, n), jnp.float16), jax.ShapeDtypeStruct((n,), jnp.float16)
    ).lower(lowering_platforms=("cuda",))
    return cl.cache_info()["layer_norm_fwd"]


@pytest.mark.cute
def test_second_process_compiles_nothing_and_concurrent_writers_leave_valid_entries(tmp_path):
    """A first process alone writes one entry per kernel, which a second process loads, compiling
    nothing; meanwhile two processes writing the same entries at once into another directory
    leave whole ones (no temporary file behind), every kernel there."""
    alone, together = tmp_path / "alone", tmp_path / "together"
    alone.mkdir()
    together.mkdir()
    first, *concurrent = [start_process(alone), start_process(together), start_process(together)]
    first = finish_process(first)
    assert set(first) == KERNELS
    assert all(compiles == 1 and hits == 0 for compiles, hits in first.values()), first
    assert len(list(alone.glob("*.o"))) == len(KERNELS) == len(list(alone.glob("*.json")))
    second = run_process(alone)
    assert all(compiles == 0 and hits == 1 for compiles, hits in second.values()), second
    for process in concurrent:
        report = finish_process(process)
        assert all(compiles + hits == 1 for compiles, hits in report.values()), report
    assert not list(together.glob(".*.tmp"))  # no temporary file left behind
    metas = list(together.glob("*.json"))
    assert len(metas) == len(list(together.glob("*.o"))) == len(KERNELS)
    for meta in metas:
        entry = disk_cache.DiskEntry(together, json.loads(meta.read_text())["key"])
        assert entry.load() is not None  # size and hash match: a whole entry


@pytest.fixture(scope="module")
def one_entry(tmp_path_factory):
    """A cache directory holding one entry, :func:`lower_in_process`'s kernel, compiled once for
    the tests that copy it before damaging or adding to it."""
    directory = tmp_path_factory.mktemp("one_entry")
    with pytest.MonkeyPatch.context() as patch:
        stats = lower_in_process(directory, patch)
    assert (stats.compiles, stats.disk_hits) == (1, 0)
    assert len(list(directory.glob("*.o"))) == len(list(directory.glob("*.json"))) == 1
    return directory


def copy_of(entry_dir, tmp_path, monkeypatch):
    """``entry_dir``'s entries copied into ``tmp_path``: the copy loads without compiling."""
    shutil.copytree(entry_dir, tmp_path, dirs_exist_ok=True)
    first = lower_in_process(tmp_path, monkeypatch)
    assert (first.compiles, first.disk_hits) == (0, 1)
    return first


@pytest.mark.cute
@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "garbage_meta", "other_key", "missing_object"])
def test_damaged_entry_is_recompiled_and_replaced(tmp_path, monkeypatch, damage, one_entry):
    copy_of(one_entry, tmp_path, monkeypatch)  # a whole entry, until damaged here
    (meta,) = tmp_path.glob("*.json")
    obj = meta.with_suffix(".o")
    good = obj.read_bytes()
    if damage == "truncate":
        obj.write_bytes(good[: len(good) // 2])
    elif damage == "flip_byte":
        obj.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    elif damage == "garbage_meta":
        meta.write_text("{not json")
    elif damage == "other_key":
        record = json.loads(meta.read_text())
        meta.write_text(json.dumps({**record, "key": record["key"] + " "}))
    else:
        obj.unlink()

    again = lower_in_process(tmp_path, monkeypatch)
    assert (again.compiles, again.disk_hits) == (1, 0)  # never loaded: compiled afresh
    record = json.loads(meta.read_text())  # ... and the entry is whole again
    assert disk_cache.DiskEntry(tmp_path, record["key"]).load() is not None
    third = lower_in_process(tmp_path, monkeypatch)
    assert (third.compiles, third.disk_hits) == (0, 1)


@pytest.mark.cute
def test_key_covers_shapes_and_source(tmp_path, monkeypatch, one_entry):
    copy_of(one_entry, tmp_path, monkeypatch)  # n=512
    other = lower_in_process(tmp_path, monkeypatch, n=520)
    assert (other.compiles, other.disk_hits) == (1, 0)  # another static dim: another entry
    assert len(list(tmp_path.glob("*.o"))) == 2
    monkeypatch.setattr(disk_cache, "library_source_digest", lambda: "edited source")
    edited = lower_in_process(tmp_path, monkeypatch, n=512)
    assert (edited.compiles, edited.disk_hits) == (1, 0)


def test_source_digest_follows_the_source_not_its_folder(tmp_path):
    # Two copies of the package in different folders: the same digest (entries and kernel target
    # names carry over to another checkout or machine); an edited file: another.
    package = Path(disk_cache.__file__).resolve().parent.parent
    copies = [shutil.copytree(package, tmp_path / side / "cutelayers", ignore=shutil.ignore_patterns("__pycache__"))
              for side in ("a", "b")]
    digests = [disk_cache.package_source_digest(Path(c)) for c in copies]
    assert digests[0] == digests[1] == disk_cache.library_source_digest()
    edited = Path(copies[1]) / "ops" / "mlp.py"
    edited.write_text(edited.read_text() + "\n# edited\n")
    disk_cache._hash_files.cache_clear()
    assert disk_cache.package_source_digest(Path(copies[1])) != digests[0]


@pytest.mark.cute
def test_disabled_by_empty_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTELAYERS_CACHE_DIR", "")
    assert disk_cache.cache_dir() is None
    monkeypatch.chdir(tmp_path)
    stats = lower_in_process("", monkeypatch)
    assert (stats.compiles, stats.disk_hits) == (1, 0)
    assert not list(tmp_path.rglob("*.o"))
    assert lower_in_process("", monkeypatch).compiles == 1


def test_default_directory_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTELAYERS_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "cutelayers" / "kernels"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for ignored in ("relative/cache", ""):  # the XDG spec: a relative path is invalid, ignore it
        monkeypatch.setenv("XDG_CACHE_HOME", ignored)
        assert disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "cutelayers" / "kernels"


@pytest.mark.cute
def test_unwritable_directory_warns_and_still_compiles(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    stats = lower_in_process(blocker / "cache", monkeypatch)
    assert stats.compiles == 1
    assert "not written" in caplog.text


@pytest.mark.cute
def test_user_kernels_persist_only_with_a_compile_key(tmp_path, monkeypatch):
    from user_kernels import add_launcher  # a user launcher defined outside the package

    monkeypatch.setenv("CUTELAYERS_CACHE_DIR", str(tmp_path))
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    out = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    anonymous = cl.cute_call(add_launcher, out_shape=out, name="add_anon")
    keyed = cl.cute_call(add_launcher, out_shape=out, name="add_keyed", compile_key="add/v1")
    for f in (anonymous, keyed):
        jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
    keys = [json.loads(m.read_text())["key"] for m in tmp_path.glob("*.json")]
    assert len(keys) == 1 and "add/v1" in keys[0]
