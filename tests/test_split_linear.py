"""split_linear: a projection returned as equal column blocks, each its own array (q, k, v).

Off CUDA the kernel families run their jnp references, so the CPU tests check the planar
decomposition (forward, dx over every plane, dkernel as stored, bias) against jax.grad of the
plain jnp projection; the CUDA lowering shows the three kernels and no activation-sized slice or
concatenation; the gpu tests run the kernels.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, random
from test_linear import lower_cuda, zeros_filled_after_an_operand

import cutelayers as cl
from cutelayers.kernels.gemm import Planes
from cutelayers.kernels.gemm_config import stream_k_pays, stream_k_workspace_pays
from cutelayers.ops import split_linear
from cutelayers.ops.split_linear import SplitForward, SplitInputGrad, SplitWeightGrad, as_planes


def plain(x, kernel, bias, parts, kernel_nk=False):
    """The float32 jnp projection, split."""
    kernel = kernel.T if kernel_nk else kernel
    y = x.astype(jnp.float32) @ kernel.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32).reshape((1,) * (y.ndim - 1) + bias.shape)
    return tuple(jnp.split(y, parts, axis=-1))


def operands(rng, lead, k, n, dtype, kernel_nk=False, bias=True, param_dtype=None):
    """x in ``dtype``, kernel and bias in ``param_dtype`` (default: ``dtype``)."""
    param_dtype = param_dtype or dtype
    x = random(rng, (*lead, k), dtype)
    kernel = (random(rng, (n, k) if kernel_nk else (k, n), jnp.float32) / np.sqrt(k)).astype(param_dtype)
    return x, kernel, random(rng, (n,), param_dtype) if bias else None


def loss_of(f, weights):
    """A loss that is not linear in any part, with a different weight per part."""
    def loss(x, kernel, bias):
        parts = f(x, kernel, bias)
        return sum(jnp.sum(jnp.sin(p.astype(jnp.float32)) * w) for p, w in zip(parts, weights))
    return loss


def check(rng, lead, k, n, parts, dtype, kernel_nk=False, bias=True, scale=3.0, param_dtype=None):
    x, kernel, b = operands(rng, lead, k, n, dtype, kernel_nk, bias, param_dtype)
    layout = "nk" if kernel_nk else "kn"
    out = split_linear(x, kernel, b, parts=parts, kernel_layout=layout)
    ref = plain(x, kernel, b, parts, kernel_nk)
    assert len(out) == parts
    for o, r in zip(out, ref):
        assert o.dtype == x.dtype and o.shape == (*lead, n // parts)
        assert_close(o, r, dtype, scale=scale)
    weights = [random(rng, (*lead, n // parts), jnp.float32) for _ in range(parts)]
    argnums = (0, 1, 2) if bias else (0, 1)
    got = jax.grad(loss_of(lambda *a: split_linear(*a, parts=parts, kernel_layout=layout), weights), argnums)(
        x, kernel, b)
    want = jax.grad(loss_of(lambda *a: plain(*a, parts, kernel_nk), weights), argnums)(
        *(None if a is None else a.astype(jnp.float32) for a in (x, kernel, b)))
    for g, w, a in zip(got, want, (x, kernel, b)):
        assert g.dtype == a.dtype and g.shape == a.shape
        assert_close(g, w, dtype, scale=scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_values_and_grads(dtype, kernel_nk, rng):
    # float32 runs the op's jnp path, the half dtypes the kernel families' references
    check(rng, (3, 7), 48, 72, 3, jnp.dtype(dtype), kernel_nk)


@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_float32_params(kernel_nk, rng):
    # mixed precision: bfloat16 x, float32 kernel and bias, whose gradients come back float32
    check(rng, (3, 7), 48, 72, 3, jnp.bfloat16, kernel_nk, param_dtype=jnp.float32)


@pytest.mark.cute
def test_lowering_float32_params_gradients():
    # a float32 kernel's gradient: the stream-K float32 sum as it is where the partial tiles are
    # added into zeros (3 cluster tiles); elsewhere (GPT-2's qkv: a workspace; whole tiles) the
    # kernel's bfloat16 result and a convert, which XLA fuses into the gradient's readers
    for m, k, d, path in ((4096, 256, 256, "zeros"), (16384, 768, 768, "workspace"), (4096, 1024, 4096, "tiles")):
        assert stream_k_pays(k, d, m, 3) == (path != "tiles")
        assert stream_k_workspace_pays(k, d, 3) == (path == "workspace") or path == "tiles"
        x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 3 * d), jnp.float32)
        hlo = lower_cuda(jax.grad(lambda x, w: jnp.sum(split_linear(x, w, parts=3)[1].astype(jnp.float32)), 1), x, w)
        (call,) = [line for line in hlo.splitlines() if "@cutelayers_split_linear_dkernel" in line]
        assert re.search(rf"-> \(?tensor<{k}x3x{d}x{'f32' if path == 'zeros' else 'bf16'}>", call), call
        widened = [line for line in hlo.splitlines()
                   if "stablehlo.convert" in line and f"(tensor<{k}x3x{d}xbf16>) -> tensor<{k}x3x{d}xf32>" in line]
        assert len(widened) == (path != "zeros"), widened


def test_without_bias_other_part_counts_and_one_row(rng):
    check(rng, (1,), 32, 64, 2, jnp.bfloat16, bias=False)
    check(rng, (5,), 16, 128, 4, jnp.bfloat16, kernel_nk=True)
    x, kernel, b = operands(rng, (2, 3), 16, 24, jnp.bfloat16)
    (y,) = split_linear(x, kernel, b, parts=1)  # one part: fused_linear
    assert_close(y, plain(x, kernel, b, 1)[0], jnp.bfloat16, scale=2.0)


def test_float32_is_exact():
    rng = np.random.default_rng(0)
    x, kernel, b = operands(rng, (4, 5), 16, 24, jnp.float32)
    out = split_linear(x, kernel, b, parts=3, precision="highest")
    for o, r in zip(out, plain(x, kernel, b, 3)):
        np.testing.assert_allclose(o, r, rtol=1e-6, atol=1e-6)


def test_empty_rows(rng):
    x, kernel, b = operands(rng, (0,), 16, 24, jnp.bfloat16)
    out = split_linear(x, kernel, b, parts=3)
    assert [o.shape for o in out] == [(0, 8)] * 3
    g = jax.grad(lambda k: sum(jnp.sum(p.astype(jnp.float32)) for p in split_linear(x, k, b, parts=3)))(kernel)
    assert g.shape == kernel.shape and not np.any(np.asarray(g, np.float32))


def test_vmap_compositions(rng):
    x, kernel, b = operands(rng, (2, 3, 5), 16, 24, jnp.bfloat16)
    folded = jax.vmap(jax.vmap(lambda x: split_linear(x, kernel, b, parts=3)))(x)
    for o, r in zip(folded, plain(x, kernel, b, 3)):
        assert_close(o, r, jnp.bfloat16, scale=2.0)
    weights = [random(rng, (2, 3, 5, 8), jnp.float32) for _ in range(3)]
    # grad(vmap): one dkernel over all rows
    f = loss_of(lambda x, k, b: jax.vmap(lambda x: split_linear(x, k, b, parts=3))(x), weights)
    g = jax.grad(f, (1, 2))(x, kernel, b)
    want = jax.grad(loss_of(lambda *a: plain(*a, 3), weights), (1, 2))(
        *(a.astype(jnp.float32) for a in (x, kernel, b)))
    for a, w in zip(g, want):
        assert_close(a, w, jnp.bfloat16, scale=3.0)
    # vmap(grad): one dkernel per example
    per = jax.vmap(jax.grad(lambda x, k: jnp.sum(jnp.sin(split_linear(x, k, parts=3)[1].astype(jnp.float32))), 1),
                   (0, None))(x, kernel)
    ref = jax.vmap(jax.grad(lambda x, k: jnp.sum(jnp.sin(plain(x, k, None, 3)[1])), 1), (0, None))(
        x.astype(jnp.float32), kernel.astype(jnp.float32))
    assert per.shape == (2, *kernel.shape)
    assert_close(per, ref, jnp.bfloat16, scale=3.0)


def test_bad_inputs_name_the_argument():
    x = jnp.ones((4, 16), jnp.bfloat16)
    kernel = jnp.ones((16, 24), jnp.bfloat16)
    with pytest.raises(ValueError, match="'parts' must be a positive int; got 0"):
        split_linear(x, kernel, parts=0)
    with pytest.raises(TypeError, match="'parts' must be an int .*; got True"):
        split_linear(x, kernel, parts=True)
    with pytest.raises(TypeError, match="'parts' must be an int .*; got 3.0"):
        split_linear(x, kernel, parts=3.0)
    assert len(split_linear(x, kernel, parts=np.int64(3))) == 3  # a NumPy integer is an int
    with pytest.raises(ValueError, match="N=24 output features, which 5 parts cannot share"):
        split_linear(x, kernel, parts=5)
    with pytest.raises(ValueError, match="'bias' must have shape \\(24,\\)"):
        split_linear(x, kernel, jnp.ones((8,), jnp.bfloat16), parts=3)


def test_planes_are_validated():
    with pytest.raises(ValueError, match="static plane count"):
        Planes(a="shared")
    with pytest.raises(ValueError, match="one of"):
        Planes(3, a="sliced")
    assert Planes(3, a="split", c="shared").summed


def test_families_reference_the_planar_layout(rng):
    """The planar kernel view is the (K, N) kernel's column blocks, so each family's reference
    (what runs off CUDA) matches the unsplit products."""
    x, kernel, b = operands(rng, (6,), 16, 24, jnp.float32)
    planar = as_planes(kernel, 3, False)
    assert planar.shape == (16, 3, 8) and np.array_equal(planar[:, 1], kernel[:, 8:16])
    out = SplitForward(3, True).reference(x[None], planar, b.reshape(3, 8))
    for o, r in zip(out, plain(x, kernel, b, 3)):
        np.testing.assert_allclose(o[0], r, rtol=1e-5, atol=1e-5)
    dys = [random(rng, (1, 6, 8), jnp.float32) for _ in range(3)]
    (dx,) = SplitInputGrad(3).reference(*dys, planar)
    np.testing.assert_allclose(dx[0], jnp.concatenate([d[0] for d in dys], -1) @ kernel.T, rtol=1e-5, atol=1e-5)
    (dk,) = SplitWeightGrad(3).reference(x[None], *dys)
    np.testing.assert_allclose(dk.reshape(16, 24), x.T @ jnp.concatenate([d[0] for d in dys], -1),
                               rtol=1e-5, atol=1e-5)


# --- CUDA lowering on CPU ----------------------------------------------------------------------------

@pytest.mark.cute
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_lowering_has_three_kernels_and_no_activation_sized_slice_or_concatenation(kernel_nk):
    layout = "nk" if kernel_nk else "kn"
    k, d, m = 768, 768, 4096
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3 * d, k) if kernel_nk else (k, 3 * d), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((3 * d,), jnp.bfloat16)

    def loss(x, w, b):
        q, kk, v = split_linear(x, w, b, parts=3, kernel_layout=layout)
        return jnp.sum((q * kk + v).astype(jnp.float32))

    hlo = lower_cuda(jax.grad(loss, (0, 1, 2)), x, w, b)
    calls = re.findall(r"stablehlo\.custom_call @cutelayers_(\w+)_[0-9a-f]+\(([^)]*)\)", hlo)
    assert [name for name, _ in calls] == ["split_linear_fwd", "split_linear_dx", "split_linear_dkernel"]
    # the forward's three outputs and dx's three dy planes are separate buffers
    assert re.search(r"custom_call @cutelayers_split_linear_fwd\w*\([^)]*\).*->\s*\((tensor<[^>]*>,\s*){2}tensor",
                     hlo)
    assert len(calls[1][1].split(",")) == 4  # dq, dk, dv, kernel
    for op in ("slice", "concatenate"):
        for line in re.findall(rf"stablehlo\.{op}.*", hlo):
            assert not re.search(rf"tensor<{m}x", line.split("->")[-1]), line  # only the bias's (3d,)
    # dbias is the dkernel launch's (3, d) second result: no reduction over the rows in XLA
    # (and the gradient in the kernel's dtype, stream-K's workspace after the sums)
    dkernel_out = rf"tensor<3x{d}x{k}xbf16>" if kernel_nk else rf"tensor<{k}x3x{d}xbf16>"
    assert re.search(rf"custom_call @cutelayers_split_linear_dkernel.*-> \({dkernel_out}, tensor<3x{d}xf32>, "
                     r"tensor<\d+x\d+xf32>, tensor<\d+xi32>\)", hlo)
    assert not [line for line in hlo.splitlines() if "stablehlo.reduce" in line and f"{m}x" in line]
    (dkernel_call,) = [line for line in hlo.splitlines() if "@cutelayers_split_linear_dkernel" in line]
    assert zeros_filled_after_an_operand(hlo, dkernel_call) == 2  # the sums' and stream-K's flags


# --- sharded (four fake CPU devices): data- and row-parallel run the families' rules per device ------

@pytest.mark.cute
def test_lowering_few_tiles_adds_stream_k_partials_into_zeros():
    # 3 cluster tiles (d = 256 a plane), each cut over ~22 clusters: the dkernel launch adds its
    # partial tiles into float32 zeros it aliases (not a workspace), cast after
    k, d, m = 256, 256, 4096
    assert stream_k_pays(k, d, m, 3) and not stream_k_workspace_pays(k, d, 3)
    x, w = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, 3 * d), jnp.bfloat16)
    hlo = lower_cuda(jax.grad(lambda x, w: jnp.sum(split_linear(x, w, parts=3)[1].astype(jnp.float32)), 1), x, w)
    (call,) = [line for line in hlo.splitlines() if "@cutelayers_split_linear_dkernel" in line]
    assert call.endswith(f"tensor<{k}x3x{d}xf32>) -> tensor<{k}x3x{d}xf32>") and "output_operand_aliases" in call
    assert zeros_filled_after_an_operand(hlo, call) == 1


@pytest.mark.parametrize("layout", ["row-parallel", "column-parallel"])
def test_sharded_kernel_matches_one_device(layout, rng):
    """K sharded (row-parallel: partial products psum'd, the bias added once after) or N sharded
    (the weight's [q | k | v] columns cut across devices, resharded to planes by XLA): values and
    gradients are one device's."""
    from jax.sharding import PartitionSpec as P
    from test_sharding import Case, assert_step_matches, loss_and_grads, make_mesh, put, random_cotangent

    def fn(x, w, b):
        return jnp.concatenate(split_linear(x, w, b, parts=3), axis=-1)

    mesh = make_mesh((2, 2), ("data", "model"))
    args = operands(rng, (8, 6), 32, 96, jnp.float16)
    specs = ((P("data", None, "model"), P("model", None), P()) if layout == "row-parallel"
             else (P("data"), P(None, "model"), P("model")))
    cotangent = random_cotangent(rng, Case(layout, fn, None, (), (0, 1, 2)), args)
    step = jax.jit(loss_and_grads, static_argnums=(0, 2))
    ref = step(fn, args, (0, 1, 2), cotangent)
    sharded = put(mesh, args, specs)
    assert_step_matches(step(fn, sharded, (0, 1, 2), cotangent), ref, jnp.float16)


# --- GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_kernels_gpu(dtype, kernel_nk, rng):
    with cl.use_backend("cute"):
        # GPT-2's qkv at 4096 tokens (stream-K dkernel, its partial tiles in a workspace), a narrow
        # one (stream-K into float32 zeros: 3 cluster tiles); odd rows and a d not a multiple of
        # the tiles
        check(rng, (4096,), 768, 2304, 3, jnp.dtype(dtype), kernel_nk, scale=4.0)
        check(rng, (4096,), 256, 768, 3, jnp.dtype(dtype), kernel_nk, scale=4.0)
        check(rng, (3, 37), 200, 216, 3, jnp.dtype(dtype), kernel_nk, scale=4.0)
        check(rng, (1,), 64, 128, 2, jnp.dtype(dtype), kernel_nk, bias=False, scale=4.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_float32_params_kernels_gpu(kernel_nk, rng):
    with cl.use_backend("cute"):
        # stream-K into float32 zeros (GPT-2's qkv), and whole tiles storing float32
        check(rng, (4096,), 768, 2304, 3, jnp.bfloat16, kernel_nk, scale=4.0, param_dtype=jnp.float32)
        check(rng, (1000,), 256, 3 * 1024, 3, jnp.bfloat16, kernel_nk, scale=4.0, param_dtype=jnp.float32)


@pytest.mark.gpu
def test_vmap_per_example_grads_gpu(rng):
    x, kernel, _ = operands(rng, (3, 300), 128, 384, jnp.bfloat16)
    with cl.use_backend("cute"):
        per = jax.jit(jax.vmap(jax.grad(
            lambda x, k: jnp.sum(jnp.sin(split_linear(x, k, parts=3)[2].astype(jnp.float32))), 1), (0, None)))(
            x, kernel)
    ref = jax.vmap(jax.grad(lambda x, k: jnp.sum(jnp.sin(plain(x, k, None, 3)[2])), 1), (0, None))(
        x.astype(jnp.float32), kernel.astype(jnp.float32))
    assert_close(per, ref, jnp.bfloat16, scale=3.0)
