"""AoT export: a function with cutelayers kernels exported for CUDA, bundled with its compiled
kernels, loaded in a fresh process without compiling anything.

On CPU the bundle is exported for ("cuda", "cpu"): the loading process registers the CUDA kernels
(no GPU needed to load) and runs the CPU branch, the jnp reference, to check the round trip end to
end. The GPU test runs the CUDA branch. A whole model's train step is exported in
tests/test_models.py, with the kernels its module compiles anyway.
"""

import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_GPU
from numerics import assert_close

import cutelayers as cl

pytestmark = pytest.mark.cute  # a bundle holds compiled kernels

H, V = 64, 128


def head_loss(x, w, scale, labels):
    """A small LM head: norm, fused linear, cross-entropy; gradients through all of them."""
    h = cl.ops.layer_norm(x, scale, dtype=x.dtype)  # default: promoted with the float32 scale
    logits = cl.ops.fused_linear(h, w, activation="gelu")
    return jnp.mean(cl.ops.softmax_cross_entropy(logits, labels))


loss_and_grads = jax.value_and_grad(head_loss, argnums=(0, 1, 2))


def operands(rng, dtype=jnp.bfloat16, rows=24):
    x = jnp.asarray(rng.standard_normal((rows, H)), dtype)
    w = jnp.asarray(rng.standard_normal((H, V)) / np.sqrt(H), dtype)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, H), jnp.float32)
    labels = jnp.asarray(rng.integers(0, V, rows), jnp.int32)
    return x, w, scale, labels


def specs(args):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]


def bundle_for(args, platforms):
    exported = cl.aot.export(loss_and_grads, *specs(args), platforms=platforms)
    return exported, cl.aot.serialize(exported)


def rewrite(bundle: bytes, name: str, change) -> bytes:
    """The bundle with member ``name`` replaced by ``change(old bytes)``."""
    source, out = zipfile.ZipFile(io.BytesIO(bundle)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for item in source.namelist():
            data = source.read(item)
            target.writestr(item, change(data) if item == name else data)
    return out.getvalue()


LOADER = textwrap.dedent("""
    import json, sys
    import numpy as np, jax
    import cutelayers as cl
    from cutelayers.runtime import primitive

    exported = cl.aot.deserialize(open(sys.argv[1], "rb").read())
    args = np.load(sys.argv[2])
    out = exported.call(*[jax.numpy.asarray(args[f"a{i}"], aval.dtype) for i, aval in enumerate(exported.in_avals)])
    leaves = jax.tree.leaves(out)
    np.savez(sys.argv[3], *[np.asarray(leaf, np.float32) for leaf in leaves])
    print(json.dumps({"registered": sorted(primitive._REGISTERED), "compiled": len(cl.cache_info()),
                      "platforms": list(exported.platforms)}))
""")


def load_in_fresh_process(tmp_path, bundle, args):
    (tmp_path / "bundle.zip").write_bytes(bundle)
    # npz has no bfloat16: store exact float32 copies, cast back to the exported dtypes on load
    np.savez(tmp_path / "args.npz", **{f"a{i}": np.asarray(a, np.float32 if a.dtype == jnp.bfloat16 else a.dtype)
                                       for i, a in enumerate(args)})
    env = {**os.environ, "CUTELAYERS_CACHE_DIR": ""}
    env.pop("CUTE_DSL_ARCH", None)  # the loading process compiles nothing, so needs no target arch
    done = subprocess.run([sys.executable, "-c", LOADER, str(tmp_path / "bundle.zip"), str(tmp_path / "args.npz"),
                           str(tmp_path / "out.npz")], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    outs = np.load(tmp_path / "out.npz")
    return report, [outs[f"arr_{i}"] for i in range(len(outs.files))]


def check_against_direct(results, args):
    with cl.use_backend("reference"):
        expected = jax.tree.leaves(jax.jit(loss_and_grads)(*args))
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        assert_close(got, want, jnp.bfloat16)


def test_concrete_dim_reads_numbers_and_gives_none_for_a_symbol():
    from cutelayers.kernels.gemm_config import SYMBOLIC_DIM, stream_k_pays
    from cutelayers.kernels.hopper import concrete_dim

    rows = jax.export.symbolic_shape("rows")[0]
    assert concrete_dim(7) == 7 and concrete_dim(np.int64(7)) == 7 and type(concrete_dim(np.int32(3))) is int
    assert concrete_dim(rows) is None and concrete_dim(2 * rows) is None
    assert concrete_dim(None) is None
    # a GEMM config decides a symbolic row count as SYMBOLIC_DIM rows
    assert stream_k_pays(rows, 768, 3072) == stream_k_pays(SYMBOLIC_DIM, 768, 3072)


def test_a_symbolic_row_count_exports(rng):
    # under shape polymorphism the row count is not known to be few: the norm forward takes the
    # many-rows kernel instead of comparing a symbolic dimension with FEW_ROWS
    rows = jax.export.symbolic_shape("rows")[0]
    x, w, scale, labels = specs(operands(rng))
    symbolic = (jax.ShapeDtypeStruct((rows, H), x.dtype), w, scale, jax.ShapeDtypeStruct((rows,), labels.dtype))
    exported = cl.aot.export(loss_and_grads, *symbolic, platforms=("cuda", "cpu"))
    assert str(exported.in_avals[0].shape[0]) == "rows"
    text = exported.mlir_module()
    assert "layer_norm_fwd" in text and "linear_fwd" in text and "tensor<?x64xbf16>" in text
    assert cl.aot.serialize(exported)  # every kernel compiled for a dynamic row count
    for rows in (5, 300):  # the CPU branch, the reference: any row count
        args = operands(rng, rows=rows)
        (loss, grads), (want, want_grads) = exported.call(*args), loss_and_grads(*args)
        assert_close(loss, want, jnp.float32)
        assert grads[0].shape == (rows, H)
        assert_close(grads[0], want_grads[0], jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_symbolic_token_count_exports_the_head_and_the_embedding_gradient(dtype, rng):
    # the LM head cannot choose a chunk count for a symbolic token count (one chunk, then), nor the
    # embedding gradient cut its tokens into blocks (one scatter-add): both export, for CUDA with
    # their kernels and on the CPU with the same values as the direct call
    tokens = jax.export.symbolic_shape("tokens")[0]
    vocab = 256

    def head_and_table_grads(h, kernel, table, labels):
        loss, (dh, dkernel) = jax.value_and_grad(cl.ops.linear_cross_entropy, argnums=(0, 1))(h, kernel, labels)
        dtable = jax.grad(lambda t: cl.ops.embed(t, labels).astype(jnp.float32).sum())(table)
        return loss, dh, dkernel, dtable

    specs = (jax.ShapeDtypeStruct((tokens, H), dtype), jax.ShapeDtypeStruct((H, vocab), dtype),
             jax.ShapeDtypeStruct((vocab, H), dtype), jax.ShapeDtypeStruct((tokens,), jnp.int32))
    exported = cl.aot.export(head_and_table_grads, *specs, platforms=("cuda", "cpu"))
    assert str(exported.in_avals[0].shape[0]) == "tokens"
    kinds = {t.split("_")[1] for t in cl.aot.kernel_targets(str(exported.mlir_module()))}
    assert kinds & {"linear", "cross"}, kinds  # the head's kernels, not its reference
    for n in (1, 7, 300):
        args = (jnp.asarray(rng.standard_normal((n, H)), dtype), jnp.asarray(rng.standard_normal((H, vocab)), dtype),
                jnp.asarray(rng.standard_normal((vocab, H)), dtype), jnp.asarray(rng.integers(0, vocab, n), jnp.int32))
        for got, want in zip(exported.call(*args), jax.jit(head_and_table_grads)(*args), strict=True):
            assert got.shape == want.shape
            assert_close(got, want, dtype)


@pytest.mark.parametrize("lead", [(4,), (2, 2)], ids=["rows", "batch_seq"])
def test_a_symbolic_row_width_exports_the_row_ops_reference(lead, rng):
    # no row kernel config can be chosen for a symbolic width: the norms, losses and reductions
    # take their reference (one fallback line each), for CUDA too, with the direct call's values;
    # backend 'cute' refuses it naming why. (batch, seq) rows: the kernel calls take them
    # unflattened, and the reference's results come back in that shape.
    width = jax.export.symbolic_shape("width")[0]

    def row_ops(x, labels):
        norm_grad = jax.grad(lambda x: jnp.sum(cl.ops.layer_norm(x) ** 2))(x)
        loss, ce_grad = jax.value_and_grad(lambda x: cl.ops.softmax_cross_entropy(x, labels).mean())(x)
        return norm_grad, loss, ce_grad, cl.ops.reduce_max(x), cl.ops.rms_norm(x)

    specs = (jax.ShapeDtypeStruct((*lead, width), jnp.float32), jax.ShapeDtypeStruct(lead, jnp.int32))
    exported = cl.aot.export(row_ops, *specs, platforms=("cuda", "cpu"))
    assert not cl.aot.kernel_targets(str(exported.mlir_module()))
    for n in (1, 9, 700):
        args = (jnp.asarray(rng.standard_normal((*lead, n)), jnp.float32),
                jnp.asarray(rng.integers(0, n, lead), jnp.int32))
        for got, want in zip(exported.call(*args), jax.jit(row_ops)(*args), strict=True):
            assert got.shape == want.shape
            assert_close(got, want, jnp.float32)
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match=r"rows are \(width,\) wide, symbolic"):
        jax.export.export(jax.jit(cl.ops.rms_norm), platforms=("cuda",))(specs[0])


def test_round_trip_in_a_fresh_process(tmp_path, rng):
    args = operands(rng)
    exported, bundle = bundle_for(args, ("cuda", "cpu"))
    targets = cl.aot.kernel_targets(str(exported.mlir_module()))
    # forward: norm, linear, CE; backward: CE, linear dX and dW, norm
    assert {t.split("_")[1] for t in targets} >= {"layer", "linear", "cross"}
    assert len(targets) >= 6
    report, results = load_in_fresh_process(tmp_path, bundle, args)
    assert report["registered"] == sorted(targets)  # every kernel loaded and registered
    assert report["compiled"] == 0  # ... and not one compiled
    assert report["platforms"] == ["cuda", "cpu"]
    if not HAS_GPU:
        check_against_direct(results, args)  # the cpu branch ran


@pytest.mark.gpu
def test_round_trip_runs_the_kernels_on_gpu(tmp_path, rng):
    args = operands(rng, rows=1000)
    direct = jax.tree.leaves(jax.jit(loss_and_grads)(*args))
    _, bundle = bundle_for(args, ("cuda",))
    report, results = load_in_fresh_process(tmp_path, bundle, args)
    assert report["compiled"] == 0
    for got, want in zip(results, direct):
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))  # the same kernels, bit for bit


def test_damaged_or_foreign_bundles_are_refused(rng, monkeypatch):
    _, bundle = bundle_for(operands(rng), ("cuda",))
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(bundle)).read("manifest.json"))
    first = f"kernels/{manifest['kernels'][0]['target']}.o"

    flipped = rewrite(bundle, first, lambda d: d[:64] + bytes([d[64] ^ 1]) + d[65:])
    with pytest.raises(ValueError, match="does not match its hash"):
        cl.aot.deserialize(flipped)
    older = rewrite(bundle, "manifest.json", lambda d: json.dumps(
        {**manifest, "versions": {**manifest["versions"], "nvidia-cutlass-dsl": "4.0.0"}}).encode())
    with pytest.raises(ValueError, match="nvidia-cutlass-dsl 4.0.0"):
        cl.aot.deserialize(older)
    with pytest.raises(ValueError, match="not a valid cutelayers bundle"):
        cl.aot.deserialize(b"PK\x03\x04 not really a zip")
    with pytest.raises(ValueError, match="not a valid cutelayers bundle"):
        cl.aot.deserialize(rewrite(bundle, "manifest.json", lambda d: b"{"))
    for broken in ([], {**manifest, "versions": None}, {k: v for k, v in manifest.items() if k != "versions"},
                   {**manifest, "kernels": [{"target": manifest["kernels"][0]["target"]}]}):
        with pytest.raises(ValueError, match="not a valid cutelayers bundle"):
            cl.aot.deserialize(rewrite(bundle, "manifest.json", lambda d, m=broken: json.dumps(m).encode()))
    with pytest.raises(ValueError, match="exported.jax is not a jax.export serialization"):
        cl.aot.deserialize(rewrite(bundle, "exported.jax", lambda d: b"garbage"))
    carries_none = rewrite(bundle, "manifest.json", lambda d: json.dumps({**manifest, "kernels": []}).encode())
    monkeypatch.setattr(cl.aot, "registered_kernel", lambda target: None)  # as in a fresh process
    with pytest.raises(ValueError, match="calls kernels the bundle does not carry: .*cutelayers_"):
        cl.aot.deserialize(carries_none)


def test_export_names_a_platforms_string():
    spec = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with pytest.raises(TypeError, match=r"platforms='cuda'; expected a sequence of platform names"):
        cl.aot.export(jnp.sin, spec, platforms="cuda")
