"""CUDA lowering on a CPU-only machine: CuTe kernels compile (CUTE_DSL_ARCH=sm_90a), the HLO holds
the custom calls, and the compile-once cache behaves as promised."""

import threading

import jax
import jax.numpy as jnp
import pytest

import cutelayers as cl


def lower_cuda(f, *avals):
    return jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(hlo: str) -> list[str]:
    return [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]


def blocks(x, n_blocks=12):
    """12 identical "transformer blocks": each applies the same reduction."""
    for _ in range(n_blocks):
        x = x - cl.ops.reduce_mean(x)[..., None]
    return x


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setenv("CUTELAYERS_CACHE_DIR", "")  # compiles counted here: none loaded from the run's disk cache
    cl.clear_cache()
    jax.clear_caches()  # JAX caches lowerings too; each test starts from nothing
    yield
    cl.clear_cache()


@pytest.mark.cute
def test_twelve_blocks_compile_once():
    hlo = lower_cuda(blocks, jax.ShapeDtypeStruct((4, 256, 1024), jnp.bfloat16))
    assert len(custom_calls(hlo)) == 12
    assert "CustomSPMDPartitioning" not in hlo  # one device: the sharding rules inline away
    assert cl.cache_info()["reduce_mean"].compiles == 1
    # another feature size: a second compile
    lower_cuda(blocks, jax.ShapeDtypeStruct((4, 256, 2048), jnp.bfloat16))
    assert cl.cache_info()["reduce_mean"].compiles == 2
    # another batch size (row count is symbolic): nothing new
    before = cl.cache_info()["reduce_mean"]
    lower_cuda(blocks, jax.ShapeDtypeStruct((9, 77, 1024), jnp.bfloat16))
    after = cl.cache_info()["reduce_mean"]
    assert after.compiles == 2 and after.memory_hits > before.memory_hits
    assert after.compile_seconds > 0


@pytest.mark.cute
def test_dtype_and_kernel_are_part_of_the_key():
    lower_cuda(cl.ops.reduce_sum, jax.ShapeDtypeStruct((8, 64), jnp.bfloat16))
    lower_cuda(cl.ops.reduce_sum, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    lower_cuda(cl.ops.reduce_max, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    info = cl.cache_info()
    assert info["reduce_sum"].compiles == 2 and info["reduce_max"].compiles == 1


@pytest.mark.cute
def test_vjp_and_vmap_plumbing_lowers_to_one_kernel_per_call():
    def loss(x):
        return jnp.sum(jax.vmap(jax.vmap(cl.ops.reduce_sum))(x) ** 2)

    hlo = lower_cuda(jax.jit(jax.grad(loss)), jax.ShapeDtypeStruct((2, 3, 5, 128), jnp.float32))
    calls = custom_calls(hlo)
    assert len(calls) == 1  # nested vmap folded into rows: one launch on (30, 128)
    assert "tensor<30x128xf32>" in calls[0]


@pytest.mark.cute
def test_concurrent_lowering_compiles_once():
    errors = []

    def work(rows):
        try:
            lower_cuda(cl.ops.reduce_max, jax.ShapeDtypeStruct((rows, 320), jnp.float16))
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = cl.cache_info()["reduce_max"]
    assert stats.compiles == 1 and stats.memory_hits == 7


def test_reference_backend_lowers_no_kernel():
    with cl.use_backend("reference"):
        hlo = lower_cuda(cl.ops.reduce_sum, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    assert custom_calls(hlo) == [] and "stablehlo.reduce" in hlo
    assert cl.cache_info() == {}


@pytest.mark.cute
def test_backend_switch_is_not_served_from_jit_cache():
    f = jax.jit(cl.ops.reduce_sum)
    aval = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    with cl.use_backend("reference"):
        ref_hlo = f.trace(aval).lower(lowering_platforms=("cuda",)).as_text()
    cute_hlo = f.trace(aval).lower(lowering_platforms=("cuda",)).as_text()
    assert custom_calls(cute_hlo) and not custom_calls(ref_hlo)


@pytest.mark.cute
@pytest.mark.parametrize("arch", [None, "sm_9x", "sm_100a", "SM_90A"])
def test_cute_backend_without_a_hopper_target_is_an_error(monkeypatch, arch):
    if arch is None:
        monkeypatch.delenv("CUTE_DSL_ARCH")
    else:  # a target the kernels are not built for (sm_9x: not an arch at all)
        monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match="needs a Hopper GPU"):
        lower_cuda(cl.ops.reduce_sum, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    # auto falls back to the reference and says why
    hlo = lower_cuda(cl.ops.reduce_sum, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    assert custom_calls(hlo) == []


def test_use_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="backend must be one of auto, cute, reference"):
        cl.use_backend("triton")


def test_cpu_lowering_is_the_reference():
    x = jnp.arange(12.0).reshape(3, 4)
    assert jnp.allclose(jax.jit(cl.ops.reduce_sum)(x), x.sum(-1))
    assert cl.cache_info() == {}


TORCH_PROBE = """
import jax, jax.numpy as jnp, cutelayers as cl, os, sys
x = jax.ShapeDtypeStruct((64, 768), jnp.bfloat16)
with cl.use_backend("cute"):
    jax.jit(lambda x: cl.ops.rms_norm(x, jnp.ones(768, jnp.bfloat16))).trace(x).lower(lowering_platforms=("cuda",))
assert "tvm_ffi" in sys.modules and cl.cache_info()["rms_norm_fwd"].compiles == 1
print("built; torch imported:", os.path.exists(sys.argv[1]))
try:
    import torch
except ImportError as e:
    print("torch:", e)
"""


@pytest.mark.cute
@pytest.mark.parametrize("allow_torch", [False, True])
def test_building_a_kernel_does_not_import_torch(tmp_path, allow_torch):
    """TVM-FFI imports torch where it is installed (seconds per process); building a kernel keeps it
    out unless CUTELAYERS_TVM_FFI_TORCH=1, and torch stays importable afterwards. A stand-in
    ``torch`` module records each import attempt (and fails it, as TVM-FFI would use a real one);
    one process reports whether the build imported it, then imports it itself."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    marker = tmp_path / "imported"
    (tmp_path / "torch.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\nraise ImportError('stand-in torch')\n")
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)]), "CUTE_DSL_ARCH": "sm_90a",
           "CUTELAYERS_CACHE_DIR": "", "JAX_PLATFORMS": "cpu"}
    env.pop("CUTELAYERS_TVM_FFI_TORCH", None)
    if allow_torch:
        env["CUTELAYERS_TVM_FFI_TORCH"] = "1"
    proc = subprocess.run([sys.executable, "-c", TORCH_PROBE, str(marker)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"built; torch imported: {allow_torch}" in proc.stdout, proc.stdout  # by the build, before ours
    assert "torch: stand-in torch" in proc.stdout and marker.exists()  # the module is reached after
