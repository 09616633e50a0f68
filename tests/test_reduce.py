"""reduce_sum / reduce_mean / reduce_max: values, gradients, vmap/jit/grad, errors.

CPU runs the reference lowering of the same op (so the custom_vjp/vmap plumbing and the
backward formulas are checked against jax.grad of plain jnp); `gpu` tests run the CuTe kernels.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, dtype_cover, random

import cutelayers as cl
from cutelayers.ops.reduce import RowReduce
from cutelayers.runtime.sharding import kernel_call

OPS = {
    "sum": (cl.ops.reduce_sum, lambda a, axis=-1: np.sum(a, axis=axis), jnp.sum),
    "mean": (cl.ops.reduce_mean, lambda a, axis=-1: np.mean(a, axis=axis), jnp.mean),
    "max": (cl.ops.reduce_max, lambda a, axis=-1: np.max(a, axis=axis), jnp.max),
}
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def _check_values(op, x, axis=-1):
    ours, ref64, _ = OPS[op]
    out = ours(x, axis) if axis != -1 else ours(x)
    x64 = np.asarray(x, np.float64)
    ref = ref64(x64, axis=axis)
    assert out.dtype == x.dtype
    if op == "max":
        assert_close(out, ref, x.dtype)
        return
    # Sums of N terms carry ~sqrt(N) more rounding than one element in fp32, and terms of either
    # sign can cancel to a sum far below their size (a rare draw: 1000 normals summing to 0.03),
    # so the error is measured against the terms' root-sum-square, the sum's typical size.
    size = np.sqrt(np.sum(x64**2, axis=axis)) / (x.shape[axis] if op == "mean" else 1)
    assert_close(out, ref, x.dtype, scale=10.0, scale_ref=size)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype,shape", dtype_cover([(1,), (7,), (3, 5, 33), (1, 1000), (4, 4096)]))
def test_values_reference(op, dtype, shape, rng):
    _check_values(op, random(rng, shape, dtype))


@pytest.mark.parametrize("op", OPS)
def test_grad_matches_jnp(op, rng):
    ours, _, plain = OPS[op]
    x = random(rng, (3, 4, 37), jnp.float32)
    w = random(rng, (3, 4), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(ours(x) * w))(x)
    g_ref = jax.grad(lambda x: jnp.sum(plain(x, axis=-1) * w))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-7)


def test_max_grad_splits_ties_like_jnp():
    x = jnp.array([[1.0, 3.0, 3.0, -2.0], [5.0, 0.5, 5.0, 5.0]])
    g = jax.grad(lambda x: jnp.sum(cl.ops.reduce_max(x) * jnp.array([2.0, 3.0])))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jnp.max(x, -1) * jnp.array([2.0, 3.0])))(x)
    np.testing.assert_allclose(g, g_ref)
    np.testing.assert_allclose(g, [[0, 1, 1, 0], [1, 0, 1, 1]])


@pytest.mark.parametrize("op", OPS)
def test_other_axis(op, rng):
    x = random(rng, (6, 9, 5), jnp.float32)
    for axis in (0, 1, -2):
        _check_values(op, x, axis)


@pytest.mark.parametrize("op", OPS)
def test_vmap_jit_grad_compositions(op, rng):
    ours, _, plain = OPS[op]
    x = random(rng, (2, 3, 4, 50), jnp.float32)

    def loss(f):
        return lambda x: jnp.sum(jnp.sin(f(x)))

    ref = jax.vmap(jax.vmap(lambda x: plain(x, axis=-1)))(x)
    # nested vmap over several axes, including a non-leading one
    np.testing.assert_allclose(jax.vmap(jax.vmap(ours))(x), ref, rtol=1e-5)
    np.testing.assert_allclose(jax.vmap(ours, in_axes=2, out_axes=2)(x), plain(x, axis=-1), rtol=1e-5)
    # jit(grad(vmap)), vmap(grad), grad(jit(vmap(vmap)))
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss(jax.vmap(ours))))(x),
        jax.grad(loss(lambda x: plain(x, axis=-1)))(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.vmap(jax.grad(loss(ours)))(x),
        jax.vmap(jax.grad(loss(lambda x: plain(x, axis=-1))))(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        jax.grad(jax.jit(loss(jax.vmap(jax.vmap(ours)))))(x),
        jax.grad(loss(lambda x: plain(x, axis=-1)))(x), rtol=1e-5, atol=1e-6)


def test_empty_rows_and_nonfinite():
    assert cl.ops.reduce_sum(jnp.ones((0, 5))).shape == (0,)
    assert cl.ops.reduce_sum(jnp.ones((2, 0, 5))).shape == (2, 0)
    x = jnp.array([[1.0, jnp.nan, 2.0], [1.0, jnp.inf, 2.0], [-jnp.inf, -jnp.inf, -1.0]])
    out = cl.ops.reduce_max(x)
    assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -1.0
    assert np.isnan(cl.ops.reduce_sum(x)[0])


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="'x' has dtype int32; allowed: bfloat16, float16, float32"):
        cl.ops.reduce_sum(jnp.ones((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="'x' has rank 0"):
        cl.ops.reduce_sum(jnp.float32(1.0))
    with pytest.raises(ValueError, match="empty axis 1 to reduce"):
        cl.ops.reduce_mean(jnp.ones((3, 0)))
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        cl.ops.reduce_max(jnp.ones((3, 4)), axis=2)
    with pytest.raises(TypeError, match="'axis' must be an int"):
        cl.ops.reduce_max(jnp.ones((3, 4)), axis=(0, 1))
    with pytest.raises(TypeError, match="must be an array"):
        cl.ops.reduce_sum([1.0, 2.0])
    # a NumPy float64 array is what JAX makes of it: float32 where x64 is off
    x = np.random.default_rng(0).standard_normal((3, 4))
    assert cl.ops.reduce_sum(x).dtype == jnp.float32
    np.testing.assert_allclose(cl.ops.reduce_sum(x), x.sum(-1), rtol=1e-5)
    # the reduced axis is checked, not only the last one
    with pytest.raises(ValueError, match=r"reduce_sum: argument 'x' has an empty axis 0 to reduce \(shape \(0, 5\)\)"):
        cl.ops.reduce_sum(jnp.zeros((0, 5)), axis=0)
    with pytest.raises(ValueError, match="empty axis 1"):
        cl.ops.reduce_max(jnp.zeros((3, 0, 5)), axis=1)
    assert cl.ops.reduce_mean(jnp.ones((0, 5)), axis=1).shape == (0,)  # zero rows reduce to nothing


def test_max_gradient_of_a_nan_row_is_nan_as_jnp_max():
    x = jnp.array([[1.0, jnp.nan, 0.0], [3.0, 1.0, 3.0]])
    got = jax.grad(lambda x: cl.ops.reduce_max(x).sum())(x)
    want = jax.grad(lambda x: jnp.max(x, axis=-1).sum())(x)
    assert np.all(np.isnan(got[0])) and np.all(np.isnan(want[0]))
    np.testing.assert_array_equal(got[1], want[1])  # ties split: 0.5, 0, 0.5


def test_raw_primitive_refuses_grad_and_vmap():
    fam = RowReduce("sum")
    x = jnp.ones((4, 8))
    with pytest.raises(NotImplementedError, match="custom_vjp and vmap rules"):
        jax.grad(lambda x: kernel_call(fam, x)[0].sum())(x)
    with pytest.raises(NotImplementedError, match="Batching"):
        jax.vmap(lambda x: kernel_call(fam, x)[0])(jnp.ones((2, 4, 8)))


# --- on the GPU: the CuTe kernels themselves ----------------------------------------------------

GPU_N = [1, 7, 128, 1000, 4096, 65537]


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", GPU_N)
def test_kernel_values_gpu(op, dtype, n, rng):
    with cl.use_backend("cute"):
        for rows in ((1,), (37,), (3, 5)):
            _check_values(op, random(rng, (*rows, n), dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_kernel_grads_and_vmap_gpu(op, rng):
    ours, _, plain = OPS[op]
    x = random(rng, (3, 4, 1000), jnp.float32)
    with cl.use_backend("cute"):
        g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(ours)(x) ** 2)))(x)
        v = jax.vmap(jax.vmap(ours), in_axes=1)(x)
    g_ref = jax.grad(lambda x: jnp.sum(plain(x, axis=-1) ** 2))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(v, jnp.swapaxes(plain(x, axis=-1), 0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_kernel_large_mean_and_nonfinite_gpu(rng):
    x = random(rng, (64, 4096), jnp.float32, loc=1000.0)
    with cl.use_backend("cute"):
        _check_values("mean", x)
        y = x.at[3, 17].set(jnp.nan).at[5, 4095].set(jnp.inf)
        out = cl.ops.reduce_max(y)
    assert np.isnan(out[3]) and out[5] == np.inf


@pytest.mark.cute
@pytest.mark.parametrize("kernel", ["reduce_sum", "reduce_max"])
def test_a_ragged_rows_whole_steps_load_back_to_back(tmp_path, kernel):
    # Only a ragged row's last step takes column predicates (reduction.share_steps): at 50257 bf16
    # (scalar accesses) a predicated step held each load in its own branch, one after another.
    from conftest import ROW_KERNEL_PTX_PROGRAM, kept_ptx, longest_load_run

    from cutelayers.bench import autotune

    ((_, _, default),) = autotune.list_candidates(kernel, [(16384, 50257)], ["bfloat16"])
    ptx = kept_ptx(tmp_path, ROW_KERNEL_PTX_PROGRAM, kernel, "50257").read_text()
    assert longest_load_run(ptx) >= default.unroll > 1
