"""layer_norm / rms_norm: values, gradients, vmap/jit/grad, errors, CUDA lowering.

CPU runs the reference lowering of the same ops (same decomposition and residuals as the kernels),
so the custom_vjp/vmap plumbing and the backward formulas are checked against jax.grad of
the plain jnp formula; `gpu` tests run the CuTe kernels; the lowering test compiles them on CPU.
"""

import dataclasses
import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROW_KERNEL_PTX_PROGRAM, kept_ptx, ptxas_report
from numerics import assert_close, assert_same_where_special, dtype_cover, random

import cutelayers as cl
from cutelayers.kernels import norm as norm_kernels
from cutelayers.kernels import norm_config
from cutelayers.kernels.reduction_config import FEW_ROWS, RowConfig
from cutelayers.ops.norm import NormBackward, NormForward, add_layer_norm, add_rms_norm, layer_norm, rms_norm

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
OPS = {"layer_norm": (layer_norm, True), "rms_norm": (rms_norm, False)}
ADD_OPS = {"add_layer_norm": (add_layer_norm, True), "add_rms_norm": (add_rms_norm, False)}
# (N, leading shape): large N with few rows keeps CPU time modest.
SHAPES = [(1, (3, 5)), (3, ()), (64, (3, 5)), (1000, (1,)), (1024, (3, 5)), (4095, (2,)),
          (8192, (2,)), (50257, ()), (65536, (1,))]


def ref64(x, scale=None, bias=None, *, center=True, epsilon=1e-6):
    """The float64 numpy reference."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    mean = x.mean(-1, keepdims=True) if center else 0.0
    y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    if scale is not None:
        y = y * np.asarray(jnp.asarray(scale, jnp.float32), np.float64)
    if bias is not None:
        y = y + np.asarray(jnp.asarray(bias, jnp.float32), np.float64)
    return y


def plain(x, scale=None, bias=None, *, center=True, epsilon=1e-6):
    """The plain jnp formula (fp32), differentiated by jax.grad for the gradient checks."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, -1, keepdims=True) if center else 0.0
    y = (x - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), -1, keepdims=True) + epsilon)
    if scale is not None:
        y = y * jnp.broadcast_to(scale.astype(jnp.float32), y.shape)
    if bias is not None:
        y = y + jnp.broadcast_to(bias.astype(jnp.float32), y.shape)
    return y


def _params(rng, n, dtype, with_scale, with_bias):
    scale = random(rng, (n,), dtype) if with_scale else None
    bias = random(rng, (n,), dtype) if with_bias else None
    return scale, bias


def _kernel_names(family, configs, avals) -> list[str]:
    """The custom-call names of ``family``'s kernel with each of ``configs``, lowered for CUDA on
    ``avals`` (one each: a config is part of the compile key)."""
    from cutelayers.runtime.sharding import kernel_call

    names = []
    for config in configs:
        with cl.use_backend("cute"):
            lowered = jax.jit(functools.partial(kernel_call, dataclasses.replace(family, config=config))).trace(
                *avals).lower(lowering_platforms=("cuda",))
        names += re.findall(rf"custom_call @(cutelayers_{re.escape(family.name)}_[0-9a-f]{{16}})\(", lowered.as_text())
    return names


def _run_config(family, config, operands):
    """``family``'s kernel with ``config`` run on ``operands`` (on the GPU): its raw results."""
    from cutelayers.runtime.sharding import kernel_call

    with cl.use_backend("cute"):
        return jax.jit(functools.partial(kernel_call, dataclasses.replace(family, config=config)))(*operands)


def _check_values(op, x, scale, bias, epsilon=1e-6, tol_scale=1.0, **kw):
    fn, center = OPS[op]
    if not center and bias is None:
        out = fn(x, scale, epsilon=epsilon, **kw)
    else:
        out = fn(x, scale, bias, epsilon=epsilon, **kw)
    assert out.shape == x.shape
    # default: the promoted dtype of x and the parameters (Flax's rule)
    assert out.dtype == jnp.dtype(kw.get("dtype") or jnp.result_type(*(a for a in (x, scale, bias) if a is not None)))
    assert_close(out, ref64(x, scale, bias, center=center, epsilon=epsilon), out.dtype, scale=tol_scale)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype,shape", dtype_cover(SHAPES))
def test_values_reference(op, dtype, shape, rng):
    n, lead = shape
    x = random(rng, (*lead, n), dtype)
    for with_scale, with_bias in ((True, True), (False, False)):
        scale, bias = _params(rng, n, jnp.float32, with_scale, with_bias and op == "layer_norm")
        _check_values(op, x, scale, bias)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("epsilon", [0.0, 1e-6, 1e-5, 0.1])
def test_epsilon_and_param_dtypes(op, epsilon, rng):
    x = random(rng, (4, 100), jnp.bfloat16)
    scale, bias = _params(rng, 100, jnp.bfloat16, True, True)
    _check_values(op, x, scale, bias, epsilon=epsilon)
    _check_values(op, x, scale, None, epsilon=epsilon, dtype=jnp.float32)
    _check_values(op, x, None, bias, epsilon=epsilon, dtype=jnp.float16)


def test_forward_moments_merge_by_halves_like_two_pass_statistics(rng):
    # The butterfly of norm.merged_halves over a row's threads, as reduction.row_merge runs it
    # (lane t merges with t ^ offset), on x = 1000 + N(0, 1) in float32: every lane ends with the
    # same bits, and with the row's float64 mean and variance.
    threads, per_thread = 128, 16
    x = (1000.0 + rng.standard_normal((threads, per_thread))).astype(np.float32)
    lanes = [(v.mean(dtype=np.float32), np.square(v - v.mean(dtype=np.float32)).mean(dtype=np.float32)) for v in x]
    offset = threads // 2
    while offset:
        lanes = [norm_kernels.merged_halves(lanes[t], lanes[t ^ offset]) for t in range(threads)]
        offset //= 2
    assert len(set(lanes)) == 1
    mean, var = lanes[0]
    exact = x.astype(np.float64)
    assert abs(mean - exact.mean()) <= 2 * np.spacing(np.float32(1000.0))
    np.testing.assert_allclose(var, exact.var(), rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_mean_inputs(dtype, rng):
    """x = 1000 + N(0, 1): E[x^2] - E[x]^2 would lose every digit in fp32; two-pass keeps them.

    The input itself carries |x| * eps of rounding, i.e. ~1000 eps relative to its spread, which
    bounds any method; the tolerance allows that and nothing like cancellation (errors ~ 1).
    """
    x = random(rng, (8, 4096), jnp.float32, loc=1000.0).astype(dtype)
    tol = {"bfloat16": 1.0, "float16": 1.0, "float32": 20.0}[jnp.dtype(dtype).name]
    _check_values("layer_norm", x, None, None, tol_scale=tol)


def latin(rows, cols, values):
    """(row, col, value) triples, each row and each column of the rows x cols grid meeting every
    value (a Latin-square cycle, values[(i + j) % len(values)]): the grid's cases with every value
    of a parameter whose code path does not change with it (a row count, a width) spread over
    them, not repeated in each."""
    return [(r, c, values[(i + j) % len(values)]) for i, r in enumerate(rows) for j, c in enumerate(cols)]


# The widths: N = 1 (an epsilon-sized gradient), odd, and a power of two; each op's every
# (scale, bias) case at one, each op at all three.
@pytest.mark.parametrize("op,params,n", latin(list(OPS), [(True, True), (True, False), (False, True), (False, False)],
                                              [1, 37, 1024]))
def test_grad_matches_jnp(op, params, n, rng):
    with_scale, with_bias = params
    fn, center = OPS[op]
    x = random(rng, (3, 4, n), jnp.float32, loc=2.0)
    scale, bias = _params(rng, n, jnp.float32, with_scale, with_bias)
    w = random(rng, (3, 4, n), jnp.float32)

    def loss(f):
        return lambda x, s, b: jnp.sum(f(x, s, b) * w)

    ours = lambda x, s, b: fn(x, s, b, epsilon=1e-5)
    ref = lambda x, s, b: plain(x, s, b, center=center, epsilon=1e-5)
    g = jax.grad(loss(ours), argnums=(0, 1, 2))(x, scale, bias)
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(x, scale, bias)
    _assert_grads_close(g, g_ref, x, w, scale, center=center, epsilon=1e-5)


def _assert_grads_close(g, g_ref, normalized, w, scale, *, center, epsilon):
    """fp32 gradients against the jnp reference's, for a loss sum(norm(normalized) * w).

    dx = rstd * (g - mean(g) - y * mean(g * y)) with g = w * scale: at N = 1 it is an
    epsilon-sized difference of terms of size |g| * rstd, so fp32 rounding is judged on that scale.
    """
    g_scale = jnp.abs(w * (1.0 if scale is None else jnp.broadcast_to(scale, w.shape)))
    spread = (jnp.var(normalized, -1, keepdims=True) if center
              else jnp.mean(normalized * normalized, -1, keepdims=True))
    terms = float(jnp.max(g_scale * jax.lax.rsqrt(spread + epsilon)))
    for a, b in zip(g, g_ref):
        if b is None:
            assert a is None
        else:
            assert a.dtype == b.dtype
            atol = 1e-6 + 2e-5 * max(float(jnp.max(jnp.abs(b))), terms)
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=atol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_param_grad_dtypes(dtype, rng):
    x = random(rng, (6, 64), jnp.bfloat16)
    scale, bias = _params(rng, 64, dtype, True, True)
    g = jax.grad(lambda x, s, b: jnp.sum(layer_norm(x, s, b, dtype=jnp.float32) ** 2), argnums=(0, 1, 2))(x, scale, bias)
    assert [a.dtype for a in g] == [jnp.dtype(jnp.bfloat16), jnp.dtype(dtype), jnp.dtype(dtype)]


@pytest.mark.parametrize("op", OPS)
def test_vmap_jit_grad_compositions(op, rng):
    fn, center = OPS[op]
    x = random(rng, (2, 3, 4, 50), jnp.float32)
    scale, bias = _params(rng, 50, jnp.float32, True, True)
    ours = lambda x, s=scale, b=bias: fn(x, s, b)
    ref = lambda x, s=scale, b=bias: plain(x, s, b, center=center)

    def loss(f):
        return lambda x, s, b: jnp.sum(jnp.sin(f(x, s, b)))

    kw = {"rtol": 1e-5, "atol": 1e-5}
    np.testing.assert_allclose(jax.vmap(jax.vmap(ours))(x), ref(x), **kw)
    np.testing.assert_allclose(jax.vmap(ours, in_axes=2, out_axes=2)(x), ref(x), **kw)
    args = (x, scale, bias)
    shared = (0, None, None)
    g = jax.jit(jax.grad(loss(jax.vmap(fn, in_axes=shared)), argnums=(0, 1, 2)))(*args)
    g_ref = jax.grad(loss(lambda x, s, b: plain(x, s, b, center=center)), argnums=(0, 1, 2))(*args)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, **kw)
    # vmap(grad): per-example gradients, also of the shared scale and bias
    g = jax.vmap(jax.grad(loss(fn), argnums=(0, 1, 2)), in_axes=shared)(*args)
    g_ref = jax.vmap(jax.grad(loss(lambda x, s, b: plain(x, s, b, center=center)), argnums=(0, 1, 2)), in_axes=shared)(*args)
    for a, b in zip(g, g_ref):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, **kw)
    # grad(jit(vmap(vmap)))
    g = jax.grad(jax.jit(loss(jax.vmap(jax.vmap(fn, in_axes=shared), in_axes=shared))), argnums=(0, 1))(*args)
    for a, b in zip(g, g_ref[:2]):
        np.testing.assert_allclose(a, b.sum(0) if a.ndim == 1 else b, **kw)


@pytest.mark.parametrize("op", OPS)
def test_grad_of_vmap_has_no_per_example_param_grads(op, rng):
    # The Equinox style, grad(vmap(norm)) over a shared scale / bias: the batch folds into rows
    # before differentiation, so dscale / dbias are one sum over all rows -- no (batch, N) stack of
    # per-example sums (float32 runs the reference, which computes what the kernel does)
    fn, center = OPS[op]
    x = random(rng, (6, 5, 50), jnp.float32)
    scale, bias = _params(rng, 50, jnp.float32, True, True)
    loss = lambda x, s, b: jnp.sum(jnp.sin(jax.vmap(fn, in_axes=(0, None, None))(x, s, b)))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias))
    assert "f32[6,50]" not in jaxpr
    g = jax.grad(loss, argnums=(0, 1, 2))(x, scale, bias)
    g_ref = jax.grad(lambda x, s, b: jnp.sum(jnp.sin(plain(x, s, b, center=center))), argnums=(0, 1, 2))(x, scale, bias)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", OPS)
def test_per_example_params_under_vmap(op, rng):
    fn, center = OPS[op]
    x = random(rng, (3, 5, 40), jnp.float32)
    scales = random(rng, (3, 40), jnp.float32)
    biases = random(rng, (3, 40), jnp.float32)
    out = jax.vmap(fn)(x, scales, biases)
    np.testing.assert_allclose(out, ref64(x, scales[:, None], biases[:, None], center=center), rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda x, s, b: jnp.sum(jnp.cos(jax.vmap(f)(x, s, b)))

    g = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(x, scales, biases)
    g_ref = jax.grad(loss(lambda x, s, b: plain(x, s, b, center=center)), argnums=(0, 1, 2))(x, scales, biases)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # batched scale, shared bias; and nested vmap with the scale batched only on the outer one
    np.testing.assert_allclose(jax.vmap(fn, in_axes=(0, 0, None))(x, scales, biases[0]),
                               ref64(x, scales[:, None], biases[0], center=center), rtol=1e-5, atol=1e-5)
    nested = jax.vmap(lambda xs, s: jax.vmap(lambda r: fn(r, s))(xs))(x, scales)
    np.testing.assert_allclose(nested, ref64(x, scales[:, None], center=center), rtol=1e-5, atol=1e-5)


def test_empty_rows_and_output_dtype(rng):
    for lead in ((0,), (2, 0)):  # (2, 0): rows given to the kernel call as (batch, sequence)
        assert layer_norm(jnp.ones((*lead, 5))).shape == (*lead, 5)
        g = jax.grad(lambda s, lead=lead: jnp.sum(layer_norm(jnp.ones((*lead, 5)), s)))(jnp.ones(5))
        np.testing.assert_array_equal(g, 0.0)
    x = random(rng, (4, 16), jnp.bfloat16)
    assert layer_norm(x).dtype == jnp.bfloat16
    assert rms_norm(x, dtype=jnp.float32).dtype == jnp.float32
    # mixed dtypes promote, as in the Flax modules
    assert rms_norm(x, jnp.ones(16, jnp.float32)).dtype == jnp.float32
    assert rms_norm(x.astype(jnp.float32), jnp.ones(16, jnp.bfloat16)).dtype == jnp.float32


def test_bad_inputs_name_the_argument():
    x = jnp.ones((3, 4))
    with pytest.raises(TypeError, match="'x' has dtype int32"):
        layer_norm(jnp.ones((3, 4), jnp.int32))
    with pytest.raises(ValueError, match="'x' has rank 0"):
        rms_norm(jnp.float32(1.0))
    with pytest.raises(ValueError, match="empty last axis"):
        layer_norm(jnp.ones((3, 0)))
    with pytest.raises(ValueError, match=r"'scale' has shape \(5,\); expected \(4,\)"):
        layer_norm(x, jnp.ones(5))
    with pytest.raises(ValueError, match=r"'bias' has shape \(1, 4\); expected \(4,\)"):
        layer_norm(x, None, jnp.ones((1, 4)))
    with pytest.raises(TypeError, match="'scale' has dtype int32"):
        rms_norm(x, jnp.ones(4, jnp.int32))
    with pytest.raises(TypeError, match="'bias' must be an array"):
        layer_norm(x, None, [0.0] * 4)
    with pytest.raises(TypeError, match="'dtype' is int8"):
        layer_norm(x, dtype=jnp.int8)
    with pytest.raises(ValueError, match="'epsilon' must be >= 0"):
        rms_norm(x, epsilon=-1.0)
    with pytest.raises(TypeError, match="'epsilon' must be a number \\(concrete, not traced"):
        jax.jit(lambda e: rms_norm(x, epsilon=e))(1e-6)
    with pytest.raises(TypeError, match="'epsilon' must be a number; got '1e-5'"):
        layer_norm(x, epsilon="1e-5")  # float() would parse it
    with pytest.raises(TypeError, match="'epsilon' must be a number; got True"):
        rms_norm(x, epsilon=True)
    with pytest.raises(ValueError, match="'epsilon' must be finite; got inf"):
        layer_norm(x, epsilon=float("inf"))
    with pytest.raises(TypeError, match="'dtype' is 'foo'; allowed: bfloat16, float16, float32"):
        layer_norm(x, dtype="foo")
    np.testing.assert_allclose(rms_norm(x, epsilon=np.float32(1e-5)), rms_norm(x, epsilon=1e-5))


# --- the fused residual add: add_layer_norm / add_rms_norm ---------------------------------------

def summed_reference(x, residual):
    """The documented sum: added in float32, rounded to the residual's dtype."""
    return (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(residual.dtype)


def plain_add(x, residual, scale=None, bias=None, *, center=True, epsilon=1e-6):
    """(normed, summed) by the plain jnp formula, differentiated by jax.grad."""
    summed = summed_reference(x, residual)
    return plain(summed, scale, bias, center=center, epsilon=epsilon), summed


def _two_output_loss(f, w_normed, w_summed, through=("normed", "summed")):
    """A loss of ``f``'s (normed, summed) through the named outputs only."""

    def loss(x, r, s, b):
        normed, summed = f(x, r, s, b)
        parts = {"normed": jnp.sum(normed.astype(jnp.float32) * w_normed),
                 "summed": jnp.sum(jnp.sin(summed.astype(jnp.float32)) * w_summed)}
        return sum(parts[name] for name in through)

    return loss


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtype,shape", dtype_cover([(777, (3, 5)), (777, (1,)), (1, (4,)), (64, ()), (4095, (2,)),
                                                     (65536, (1,))]))
def test_add_values_reference(op, dtype, shape, rng):
    n, lead = shape
    fn, center = ADD_OPS[op]
    x = random(rng, (*lead, n), dtype)
    # the residual stream in x's dtype with parameters, and in float32 (mixed precision) without
    for rdtype, with_params in ((dtype, True), (jnp.float32, False)):
        residual = random(rng, x.shape, rdtype, loc=1.0)
        scale, bias = _params(rng, n, dtype, with_params, with_params)
        normed, summed = fn(x, residual, scale, bias)
        assert summed.dtype == jnp.dtype(rdtype) and summed.shape == x.shape
        np.testing.assert_array_equal(summed, summed_reference(x, residual))
        # default dtype: what the plain norm of summed gives (Flax's rule)
        assert normed.dtype == jnp.result_type(summed, *(p for p in (scale, bias) if p is not None))
        assert_close(normed, ref64(summed, scale, bias, center=center), normed.dtype)
    assert fn(x, residual, dtype=jnp.float16)[0].dtype == jnp.float16


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("through,params,n", latin([("normed",), ("summed",), ("normed", "summed")],
                                                   [(True, True), (True, False), (False, False)], [1, 37, 777]),
                         ids=lambda v: "+".join(v) if isinstance(v, tuple) and isinstance(v[0], str) else None)
def test_add_grads_match_jnp(op, through, params, n, rng):
    """Gradients through normed, through summed alone (the one peer libraries have dropped: dx must
    be exactly d_summed there) and through both; each with every (scale, bias) case and width."""
    with_scale, with_bias = params
    fn, center = ADD_OPS[op]
    x = random(rng, (3, 4, n), jnp.float32, loc=2.0)
    residual = random(rng, x.shape, jnp.float32)
    scale, bias = _params(rng, n, jnp.float32, with_scale, with_bias)
    w_normed, w_summed = random(rng, x.shape, jnp.float32), random(rng, x.shape, jnp.float32)
    ours = lambda x, r, s, b: fn(x, r, s, b, epsilon=1e-5)
    ref = lambda x, r, s, b: plain_add(x, r, s, b, center=center, epsilon=1e-5)
    argnums = (0, 1, 2, 3)
    g = jax.grad(_two_output_loss(ours, w_normed, w_summed, through), argnums)(x, residual, scale, bias)
    g_ref = jax.grad(_two_output_loss(ref, w_normed, w_summed, through), argnums)(x, residual, scale, bias)
    _assert_grads_close(g, g_ref, x + residual, w_normed, scale, center=center, epsilon=1e-5)
    np.testing.assert_array_equal(g[0], g[1])  # x and the residual: the same gradient
    if through == ("summed",):
        np.testing.assert_allclose(g[0], jnp.cos(x + residual) * w_summed, rtol=1e-6, atol=1e-6)


def test_add_grad_dtypes(rng):
    """Mixed precision: a bfloat16 block output added to a float32 residual stream; each input's
    gradient comes back in its dtype."""
    x = random(rng, (6, 64), jnp.bfloat16)
    residual = random(rng, (6, 64), jnp.float32)
    scale, bias = _params(rng, 64, jnp.bfloat16, True, True)
    w_normed, w_summed = random(rng, x.shape, jnp.float32), random(rng, x.shape, jnp.float32)
    argnums = (0, 1, 2, 3)
    g = jax.grad(_two_output_loss(add_layer_norm, w_normed, w_summed), argnums)(x, residual, scale, bias)
    g_ref = jax.grad(_two_output_loss(plain_add, w_normed, w_summed), argnums)(x, residual, scale, bias)
    assert [a.dtype.name for a in g] == ["bfloat16", "float32", "bfloat16", "bfloat16"]
    for a, b in zip(g, g_ref):
        assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), a.dtype)


@pytest.mark.parametrize("op", ADD_OPS)
def test_add_vmap_jit_grad_compositions(op, rng):
    fn, center = ADD_OPS[op]
    x = random(rng, (2, 3, 4, 50), jnp.float32)
    residual = random(rng, x.shape, jnp.float32)
    scale, bias = _params(rng, 50, jnp.float32, True, True)
    ref = lambda x, r, s, b: plain_add(x, r, s, b, center=center)
    kw = {"rtol": 1e-5, "atol": 1e-5}

    def check(got, want):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, **kw)

    # vmap over two axes; and a residual shared across the inner axis (broadcast into the rows)
    check(jax.vmap(jax.vmap(lambda x, r: fn(x, r, scale, bias)))(x, residual), ref(x, residual, scale, bias))
    inner_shared = jax.vmap(jax.vmap(lambda x, r: fn(x, r, scale, bias), in_axes=(0, None)))
    check(inner_shared(x, residual[:, 0]), ref(x, jnp.broadcast_to(residual[:, :1], x.shape), scale, bias))
    w_normed, w_summed = random(rng, x.shape, jnp.float32), random(rng, x.shape, jnp.float32)
    args, argnums, shared = (x, residual, scale, bias), (0, 1, 2, 3), (0, 0, None, None)
    g_ref = jax.grad(_two_output_loss(ref, w_normed, w_summed), argnums)(*args)
    # grad(jit(vmap(vmap))): folded into one launch each way
    nested = jax.vmap(jax.vmap(fn, in_axes=shared), in_axes=shared)
    check(jax.grad(jax.jit(_two_output_loss(nested, w_normed, w_summed)), argnums)(*args), g_ref)
    # vmap(grad): per-example gradients, also of the shared scale and bias
    def per_example(f):
        return jax.vmap(jax.grad(_two_output_loss(f, w_normed[0], w_summed[0]), argnums), in_axes=shared)

    check(jax.jit(per_example(fn))(*args), per_example(ref)(*args))


@pytest.mark.parametrize("op", ADD_OPS)
def test_add_per_example_params_under_vmap(op, rng):
    fn, center = ADD_OPS[op]
    x = random(rng, (3, 5, 40), jnp.float32)
    residual = random(rng, x.shape, jnp.float32)
    scales, biases = random(rng, (3, 40), jnp.float32), random(rng, (3, 40), jnp.float32)
    w_normed, w_summed = random(rng, x.shape, jnp.float32), random(rng, x.shape, jnp.float32)
    argnums = (0, 1, 2, 3)
    args = (x, residual, scales, biases)
    normed, summed = jax.vmap(fn)(*args)
    np.testing.assert_allclose(normed, ref64(summed, scales[:, None], biases[:, None], center=center),
                               rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(_two_output_loss(jax.vmap(fn), w_normed, w_summed), argnums))(*args)
    ref = jax.vmap(lambda x, r, s, b: plain_add(x, r, s, b, center=center))
    g_ref = jax.grad(_two_output_loss(ref, w_normed, w_summed), argnums)(*args)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_add_empty_rows():
    normed, summed = add_rms_norm(jnp.ones((0, 5)), jnp.ones((0, 5), jnp.bfloat16))
    assert normed.shape == summed.shape == (0, 5) and normed.dtype == summed.dtype == jnp.bfloat16
    g = jax.grad(lambda s: jnp.sum(add_layer_norm(jnp.ones((0, 5)), jnp.ones((0, 5)), s)[0]))(jnp.ones(5))
    np.testing.assert_array_equal(g, 0.0)


def test_add_bad_inputs_name_the_argument():
    x = jnp.ones((3, 4))
    residual_shape = r"add_layer_norm: argument 'residual' has shape \(4,\); expected \(3, 4\)"
    with pytest.raises(ValueError, match=residual_shape):
        add_layer_norm(x, jnp.ones(4))
    with pytest.raises(TypeError, match="add_rms_norm: argument 'residual' has dtype int32"):
        add_rms_norm(x, jnp.ones((3, 4), jnp.int32))
    with pytest.raises(TypeError, match="add_layer_norm: argument 'residual' must be an array"):
        add_layer_norm(x, [[0.0] * 4] * 3)
    with pytest.raises(TypeError, match="add_rms_norm: argument 'x' has dtype int32"):
        add_rms_norm(jnp.ones((3, 4), jnp.int32), x)
    with pytest.raises(ValueError, match=r"add_layer_norm: argument 'scale' has shape \(5,\); expected"):
        add_layer_norm(x, x, jnp.ones(5))
    with pytest.raises(ValueError, match="add_rms_norm: argument 'epsilon' must be >= 0"):
        add_rms_norm(x, x, epsilon=-1.0)
    # without a residual the plain norm's one (3, 4) result would unpack as (normed, summed)
    with pytest.raises(TypeError, match="add_layer_norm: argument 'residual' is None; .*layer_norm normalizes"):
        add_layer_norm(x, None)
    with pytest.raises(TypeError, match="add_rms_norm: argument 'residual' is None"):
        add_rms_norm(x[:2], None, jnp.ones(4))


# (N, dtype) -> CTAs a streamed row is cut over: forward (stages x), dx-only backward (stages x and
# dy), backward with dscale / dbias (stages x and dy, and keeps two fp32 sums a column)
CUT_ROWS = {
    (50257, jnp.bfloat16): (1, 2, 8),  # scalar accesses: the forward's 98 KiB stage in one CTA
    (65536, jnp.bfloat16): (2, 4, 8),
    (65536, jnp.float32): (4, 8, 16),
    (262144, jnp.bfloat16): (8, 16, 16),  # with the sums, 192 KiB a CTA: one CTA an SM
}


def test_streamed_rows_are_staged_and_cut_over_clusters():
    """A streamed norm row runs one row a CTA (norm_config.STREAMED_THREADS threads forward,
    STREAMED_BACKWARD_THREADS backward), staged
    in shared memory and cut over a cluster so that each CTA's share fits -- with the backward's
    dscale / dbias sums where it computes them; model widths stay in registers, uncut."""
    from cutelayers.kernels.norm_config import STREAMED_BACKWARD_THREADS, STREAMED_THREADS, sums_fit
    from cutelayers.kernels.reduction_config import STAGED_ROW_BYTES_ALONE, share_bytes, staged
    from cutelayers.tuning import resolve

    S = jax.ShapeDtypeStruct
    for n, dtype in [*CUT_ROWS, (768, jnp.bfloat16), (8192, jnp.float32)]:
        # more rows than a decode batch (whose forward cuts wide rows: test_a_decode_batch_...)
        x, p, stat = S((128, n), dtype), S((n,), dtype), S((128, 1), jnp.float32)
        fwd_avals, bwd_avals = (x, p, p), (x, x, stat, stat, p)
        forward = resolve(NormForward(True, True, True, 1e-6, jnp.dtype(dtype).name), fwd_avals)
        dx_only = resolve(NormBackward(True, True, False, False), bwd_avals)
        with_sums = resolve(NormBackward(True, True, True, True), bwd_avals)
        geometries = tuple(f.geometry(a) for f, a in ((forward, fwd_avals), (dx_only, bwd_avals),
                                                        (with_sums, bwd_avals)))
        if (n, dtype) not in CUT_ROWS:
            assert all(g.resident and g.cluster == 1 for g in geometries), n
            continue
        assert tuple(g.cluster for g in geometries) == CUT_ROWS[n, dtype], (n, dtype)
        assert with_sums.holds_sums(bwd_avals)
        for g, operands, sums, threads in zip(geometries, (1, 2, 2), (0, 0, 2),
                                              (STREAMED_THREADS, *(STREAMED_BACKWARD_THREADS[True],) * 2)):
            itemsize = jnp.dtype(dtype).itemsize
            assert g.row.threads_per_row == g.row.num_threads == threads
            assert staged(g, itemsize, operands, sums)
            assert share_bytes(g, itemsize, operands, sums) <= STAGED_ROW_BYTES_ALONE
            assert sums_fit(g, sums)
            assert 0 < g.last_share_width <= g.share_width and g.steps_per_cta * g.tile_n >= g.share_width


# --- CUDA lowering on CPU: compiles every kernel variant ----------------------------------------

LOWERING_CASES = [
    # (op, N, x dtype, param dtype, out dtype, scale, bias)
    ("layer_norm", 1, "float16", "float16", None, False, False),
    ("layer_norm", 1000, "bfloat16", "float32", None, True, True),
    ("layer_norm", 4095, "float32", "bfloat16", "bfloat16", False, True),
    ("layer_norm", 8192, "bfloat16", "bfloat16", "float32", True, False),
    ("layer_norm", 50257, "bfloat16", "float32", None, True, True),
    ("layer_norm", 65536, "float32", "float32", None, True, True),
    ("rms_norm", 3, "float32", "float32", None, True, False),
    ("rms_norm", 1024, "bfloat16", "float32", None, True, False),
    ("rms_norm", 4096, "float16", "float16", None, False, False),
    ("rms_norm", 16384, "bfloat16", "bfloat16", None, True, True),
    ("rms_norm", 262144, "bfloat16", "float32", None, True, False),
]


@pytest.mark.cute
@pytest.mark.parametrize("op,n,xdt,pdt,odt,with_scale,with_bias", LOWERING_CASES)
def test_lowers_for_cuda_and_compiles_kernels(op, n, xdt, pdt, odt, with_scale, with_bias):
    fn, _ = OPS[op]
    x = jax.ShapeDtypeStruct((6, n), jnp.dtype(xdt))
    p = jax.ShapeDtypeStruct((n,), jnp.dtype(pdt))

    def f(x, s, b):
        y = fn(x, s if with_scale else None, b if with_bias else None, dtype=odt)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with cl.use_backend("cute"):
        lowered = jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(x, p, p).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert f"custom_call @cutelayers_{op}_fwd_" in text
    assert f"custom_call @cutelayers_{op}_bwd_" in text


ADD_LOWERING_CASES = [
    # (op, N, x dtype, residual dtype, param dtype, out dtype, scale, bias)
    ("add_layer_norm", 1, "float16", "float16", "float16", None, False, False),
    ("add_layer_norm", 777, "bfloat16", "float32", "float32", None, True, True),
    ("add_layer_norm", 4096, "bfloat16", "bfloat16", "bfloat16", None, True, True),
    ("add_layer_norm", 65536, "float32", "bfloat16", "float32", "bfloat16", True, True),  # streamed rows
    ("add_rms_norm", 777, "float16", "float16", "float32", None, True, False),
    ("add_rms_norm", 4096, "bfloat16", "float32", "bfloat16", None, True, False),
    ("add_rms_norm", 262144, "bfloat16", "bfloat16", "bfloat16", None, True, True),  # streamed rows
]


@pytest.mark.cute
@pytest.mark.parametrize("op,n,xdt,rdt,pdt,odt,with_scale,with_bias", ADD_LOWERING_CASES)
def test_add_lowers_for_cuda_to_one_kernel_each_way(op, n, xdt, rdt, pdt, odt, with_scale, with_bias):
    """The residual add, the norm and both outputs' gradients: one forward kernel and one backward
    kernel (with dscale/dbias partials; under vmap the dx-only one), nothing else."""
    fn, _ = ADD_OPS[op]
    x, r = (jax.ShapeDtypeStruct((2, 3, n), jnp.dtype(d)) for d in (xdt, rdt))
    p = jax.ShapeDtypeStruct((n,), jnp.dtype(pdt))

    def f(x, r, s, b):
        normed, summed = fn(x, r, s if with_scale else None, b if with_bias else None, dtype=odt)
        return jnp.sum(normed.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(summed.astype(jnp.float32)))

    for g in (f, lambda *args: jnp.sum(jax.vmap(f, in_axes=(0, 0, None, None))(*args))):
        with cl.use_backend("cute"):
            traced = jax.jit(jax.grad(g, argnums=(0, 1, 2, 3))).trace(x, r, p, p)
        hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
        kernels = re.findall(r"stablehlo\.custom_call @cutelayers_(\w+)_[0-9a-f]{16}\(", hlo)
        assert kernels == [f"{op}_fwd", f"{op}_bwd"]


def test_backward_grid_is_sized_for_the_rows():
    from cutelayers.kernels.reduction_config import RowGeometry

    config = RowConfig(threads_per_row=64, num_threads=128, unroll=2)  # two rows per CTA
    geometry = RowGeometry(config, 1024, 8)
    full = norm_config.backward_grid(geometry)
    assert full == norm_config.HOPPER_SMS * (norm_config.THREADS_PER_SM // 128)  # a GPU's worth
    assert norm_config.backward_grid(geometry, 8) == 4  # four row groups
    assert norm_config.backward_grid(geometry, 9) == 8  # five groups: the next power of two
    assert norm_config.backward_grid(geometry, 1) == 1
    assert norm_config.backward_grid(geometry, 16384) == full  # more groups than CTAs: persistent
    # 24 values a thread (bf16 x 768, one warp a row): three 128-thread CTAs an SM
    wide = RowGeometry(RowConfig(threads_per_row=32, num_threads=128, unroll=3), 768, 8)
    assert norm_config.backward_grid(wide) == norm_config.HOPPER_SMS * (norm_config.WIDE_THREADS_PER_SM // 128)


def test_rms_norm_forward_cuts_streamed_rows_into_smaller_shares():
    """RMSNorm's forward stages shares of at most norm_config.FORWARD_SHARE_BYTES[False] (more CTAs a
    row than LayerNorm's, which fills STAGED_ROW_BYTES)."""
    from cutelayers.kernels.reduction_config import share_bytes
    from cutelayers.tuning import resolve

    S = jax.ShapeDtypeStruct
    for n in (32768, 50304, 65536, 131072, 262144):
        x, p = S((8, n), jnp.bfloat16), S((n,), jnp.bfloat16)
        rms, ln = (resolve(NormForward(center, True, center, 1e-6, "bfloat16"), (x, p, p)[:2 + center])
                   for center in (False, True))
        g_rms, g_ln = rms.geometry((x, p)), ln.geometry((x, p, p))
        assert share_bytes(g_rms, 2) <= norm_config.FORWARD_SHARE_BYTES[False], n
        assert g_rms.cluster >= g_ln.cluster and (g_rms.cluster, n) != (1, 65536)


def test_streamed_backward_grid_counts_resident_clusters():
    """A streamed row's persistent grid is in clusters, as many as are resident at once: two CTAs
    an SM where a CTA's shares fit STAGED_ROW_BYTES, else one."""
    from cutelayers.kernels.reduction_config import RowGeometry

    streamed = RowConfig(threads_per_row=256, num_threads=256, unroll=2)
    cut = RowGeometry(streamed, 65536, 8, cluster=8)  # 8192 columns a CTA
    assert not cut.resident and cut.share_width == 8192
    # x and dy (4 bytes a column) and two fp32 sums: 96 KiB, two CTAs an SM
    assert norm_config.streamed_cta_bytes(cut, 2, 2) == 96 * 1024
    assert norm_config.backward_grid(cut, None, 2, 2) == 2 * norm_config.RESIDENT_CLUSTERS[8]
    # float32 rows: 128 KiB, one CTA an SM
    assert norm_config.backward_grid(cut, None, 4, 2) == norm_config.RESIDENT_CLUSTERS[8]
    assert norm_config.backward_grid(cut, 3, 4, 2) == 4  # three rows: four clusters
    whole = RowGeometry(streamed, 16384, 8)
    assert norm_config.backward_grid(whole, None, 2, 0) == 2 * norm_config.HOPPER_SMS


def test_streamed_backward_stages_its_scale_share_where_residency_keeps():
    """The backward of a streamed row stages its CTA's share of scale once (every row it visits
    reads it from there) only where it fits next to x, dy and the fp32 sums without fewer CTAs an
    SM than backward_grid counts: under STAGED_ROW_BYTES where those fit it (two an SM), else
    under STAGED_ROW_BYTES_ALONE."""
    from cutelayers.kernels.reduction_config import STAGED_ROW_BYTES, STAGED_ROW_BYTES_ALONE, RowGeometry

    streamed = RowConfig(threads_per_row=256, num_threads=256, unroll=2)
    cut = RowGeometry(streamed, 65536, 8, cluster=8)  # 8192 columns a CTA
    # bf16 x, dy and two sums: 96 KiB, + a 16 KiB bf16 scale share = 112 KiB: still two an SM
    assert norm_config.streamed_cta_bytes(cut, 2, 2) + 16 * 1024 == STAGED_ROW_BYTES
    assert norm_config.scale_fits(cut, 2, 2, 2)
    assert not norm_config.scale_fits(cut, 2, 2, 4)  # a float32 scale would cost the second CTA
    # float32 rows: 128 KiB, one CTA an SM, room up to STAGED_ROW_BYTES_ALONE
    assert norm_config.scale_fits(cut, 4, 2, 4)
    wide = RowGeometry(streamed, 262144, 8, cluster=16)  # 16384 columns a CTA
    assert norm_config.streamed_cta_bytes(wide, 2, 2) + 32 * 1024 > STAGED_ROW_BYTES_ALONE
    assert not norm_config.scale_fits(wide, 2, 2, 2)


def test_staging_fewer_operands_fits_two_ctas_an_sm():
    """A backward config that stages dy alone (norm_config.StagingConfig) keeps RMSNorm's bf16 row of
    262144 -- cut over 16 CTAs as with x and dy -- in 96 KiB a CTA with its dscale sums, not 128:
    two CTAs an SM, twice the resident clusters; staging neither, 64 KiB, which leaves room for
    scale's share too. A plain RowConfig stages both, as before. In two buffers (``stages`` 2),
    x and dy take 192 KiB (one CTA an SM, no room for scale), dy alone 128."""
    from cutelayers.kernels.reduction_config import RowGeometry

    row = RowConfig(threads_per_row=512, num_threads=512, unroll=3)
    plain = RowGeometry(row, 262144, 8, cluster=16)  # 16384 columns a CTA
    variants = [dataclasses.replace(plain, row=other) for other in norm_config.staging_variants(row)]
    assert [(g.row.staged_operands, g.row.stages) for g in variants] == [(1, 1), (0, 1), (2, 2), (1, 2)]
    geometries = [plain, *variants]
    assert [norm_config.staged_shares(g, 2, 1) for g in geometries] == [
        (True, True), (False, True), (False, False), (True, True), (False, True)]
    assert [norm_config.streamed_cta_bytes(g, 2, 1) // 1024 for g in geometries] == [128, 96, 64, 192, 128]
    clusters = norm_config.RESIDENT_CLUSTERS[16]
    assert [norm_config.backward_grid(g, None, 2, 1) for g in geometries] == [
        clusters, 2 * clusters, 2 * clusters, clusters, clusters]
    # a bf16 scale's 32 KiB share: next to x and dy (one CTA an SM either way) and next to the sums
    # alone, not next to dy's share (it would cost the second CTA), nor next to two buffers of both
    assert [norm_config.scale_fits(g, 2, 1, 2) for g in geometries] == [True, False, True, False, True]
    # LayerNorm's two sums: two buffers of x and dy would take 256 KiB, so they stage nothing
    assert norm_config.staged_shares(variants[2], 2, 2) == (False, False)
    with pytest.raises(ValueError, match=r"staged_operands 2 in 1 stages: a StagingConfig stages one of"):
        norm_config.StagingConfig(**dataclasses.asdict(row), staged_operands=2)
    with pytest.raises(ValueError, match=r"staged_operands 0 in 2 stages"):
        norm_config.StagingConfig(**dataclasses.asdict(row), staged_operands=0, stages=2)


def test_staging_configs_round_trip_the_tuning_table(tmp_path, monkeypatch):
    """The backward's configs that stage otherwise (fewer operands, or two buffers) are candidates of
    its space at a streamed width (not at a register-resident one), written to the tuned table with
    their staged_operands and stages and read back as themselves; an entry without the fields (all
    written before them) reads as the plain RowConfig, one without stages as a single buffer, and
    one naming another count is refused for the heuristic."""
    from cutelayers import tuning

    S = jax.ShapeDtypeStruct
    device = "Fake H100 for tests"
    monkeypatch.setattr(tuning, "device_kind", lambda: device)
    n = 262144
    x, stat, p = S((8, n), jnp.bfloat16), S((8, 1), jnp.float32), S((n,), jnp.bfloat16)
    family, avals = NormBackward(False, True, True, False), (x, x, stat, p)
    space = family.config_space(avals)
    fewer = [c for c in space if isinstance(c, norm_config.StagingConfig)]
    assert {(c.staged_operands, c.stages) for c in fewer} == set(norm_config.STAGING_CHOICES)
    small = (S((8, 768), jnp.bfloat16),) * 2 + (stat, S((768,), jnp.bfloat16))
    assert not [c for c in family.config_space(small) if isinstance(c, norm_config.StagingConfig)]
    dtype, dims = family.tuning_key(avals)
    plain_256 = {"threads_per_row": 256, "num_threads": 256, "unroll": 3}

    def resolved(i, config):
        path = tmp_path / f"tuned{i}.json"
        tuning.write_entries(path, [{"device": device, "kernel": family.name, "dtype": dtype, "dims": dict(dims),
                                     "config": config}])
        monkeypatch.setenv("CUTELAYERS_TUNING_FILE", str(path))
        return tuning.resolve(family, avals).config

    for i, config in enumerate(fewer):
        assert tuning.config_fields(config)["staged_operands"] == config.staged_operands
        assert tuning.config_fields(config)["stages"] == config.stages
        assert resolved(i, tuning.config_fields(config)) == config
    assert resolved(len(fewer), plain_256) == RowConfig(**plain_256)
    assert type(resolved(len(fewer) + 1, {**plain_256, "staged_operands": 2})) is RowConfig
    # an entry written before ``stages`` (a single buffer)
    assert resolved(len(fewer) + 3, {**plain_256, "staged_operands": 0}) == norm_config.StagingConfig(
        **plain_256, staged_operands=0)
    with pytest.warns(tuning.TuningTableWarning, match="names an invalid config"):
        assert resolved(len(fewer) + 2, {**plain_256, "staged_operands": 3}) == family.default_config(avals)


@pytest.mark.cute
@pytest.mark.parametrize("center,residual,n", [(False, False, 262144), (False, True, 262144), (True, True, 50257)])
def test_backward_staging_fewer_operands_lowers_for_cuda(center, residual, n):
    """The heuristic backward config staging dy alone, or neither of x and dy, or them in two
    buffers, compiles for sm_90a, each its own kernel: RMSNorm's with and without the residual at N
    = 262144, and add_layer_norm's at an odd N (dy staged from registers: 2-byte accesses, no
    cp.async -- so no second buffer is a candidate there)."""

    S = jax.ShapeDtypeStruct
    x, stat, p = S((64, n), jnp.bfloat16), S((64, 1), jnp.float32), S((n,), jnp.bfloat16)
    family = NormBackward(center, True, True, center, residual)
    avals = (x,) * (2 + residual) + (stat,) * (1 + center) + (p,)
    default = family.default_config(avals)
    space = family.config_space(avals)
    fewer = [c for c in norm_config.staging_variants(default) if c in space]
    assert [c.stages for c in fewer] == ([1, 1] if n % 2 else [1, 1, 2, 2])
    names = _kernel_names(family, fewer, avals)
    assert len(names) == len(set(names)) == len(fewer)


@pytest.mark.cute
def test_forward_cuts_several_rows_a_cta_over_a_cluster():
    """The norm forward's space (cuts_row_slots) holds configs of several rows a CTA cut over a
    cluster -- never over more CTAs than a row has threads, as cluster_gather's row thread t
    stores to CTA t -- with cluster slots for each row slot; the backward's configs of several
    rows stay uncut (its streamed loop gathers one row a CTA). Two such forwards lower for sm_90a,
    each a kernel of its own."""
    from cutelayers.kernels.reduction import cluster_slot_bytes

    S = jax.ShapeDtypeStruct
    n = 262144
    x, p, stat = S((64, n), jnp.bfloat16), S((n,), jnp.float32), S((64, 1), jnp.float32)
    forward, fwd_avals = NormForward(True, True, True, 1e-6, "bfloat16"), (x, p, p)
    slotted = {}
    for config in forward.config_space(fwd_avals):
        g = forward.cut(config, fwd_avals)
        if config.rows_per_cta > 1 and g.cluster > 1:
            assert g.cluster <= config.threads_per_row
            assert cluster_slot_bytes(g, 2) == 8 + 4 * 2 * g.cluster * config.rows_per_cta + 8
            slotted[config.threads_per_row, config.num_threads, config.share_budget] = config
    assert (256, 512, 0) in slotted and (128, 512, 0) not in slotted  # 4 x 16384 bf16 shares: staged alone
    backward = NormBackward(True, True, True, True)
    bwd_avals = (x, x, stat, stat, p)
    assert all(backward.cut(c, bwd_avals).cluster == 1 for c in backward.config_space(bwd_avals) if c.rows_per_cta > 1)
    names = _kernel_names(forward, [slotted[key] for key in ((256, 512, 0), (64, 128, 0))], fwd_avals)
    assert len(names) == len(set(names)) == 2


@pytest.mark.cute
def test_decode_sized_backward_writes_few_partials():
    # 8 rows: the dscale / dbias partials are a few rows of N, not a GPU's worth (~1000 rows)
    n = 768
    x = jax.ShapeDtypeStruct((8, n), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((n,), jnp.bfloat16)
    with cl.use_backend("cute"):
        hlo = jax.jit(jax.grad(lambda x, s, b: jnp.sum(layer_norm(x, s, b).astype(jnp.float32) ** 2),
                               argnums=(0, 1, 2))).trace(x, p, p).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in hlo.splitlines() if "custom_call @cutelayers_layer_norm_bwd_" in line]
    (partials,) = set(re.findall(r"tensor<(\d+)xf32>", call.split("->")[1]))
    assert int(partials) % n == 0 and int(partials) // n <= 8


@pytest.mark.cute
def test_few_rows_run_their_own_forward_kernel():
    # Up to FEW_ROWS register-resident rows the forward is another kernel: one row a
    # CTA over wide CTAs (norm_config.FEW_ROWS_VALUES), its parameters loaded before the reductions;
    # one row more is the many-rows kernel again, one compile per kind. A streamed row's kernel is
    # the same for any row count.
    def target(rows, n, param_dtype):
        x, p = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16), jax.ShapeDtypeStruct((n,), param_dtype)
        with cl.use_backend("cute"):
            hlo = jax.jit(layer_norm).trace(x, p, p).lower(lowering_platforms=("cuda",)).as_text()
        (name,) = re.findall(r"custom_call @(cutelayers_layer_norm_fwd_[0-9a-f]+)\(", hlo)
        return name

    few, many = FEW_ROWS, FEW_ROWS + 1
    for n, param_dtype in ((2048, jnp.float32), (1024, jnp.bfloat16), (8192, jnp.float32)):
        assert target(1, n, param_dtype) == target(few, n, param_dtype) != target(many, n, param_dtype)
        assert target(many, n, param_dtype) == target(4096, n, param_dtype)
    assert target(few, 65536, jnp.bfloat16) == target(many, 65536, jnp.bfloat16)


@pytest.mark.parametrize("n,param_dtype,threads,unroll,cluster", [
    (768, jnp.float32, 128, 2, 1),      # 192 accesses of 4 values: 128 threads, some with one
    (1000, jnp.float32, 128, 2, 1),
    (2048, jnp.float32, 128, 4, 1),
    (4096, jnp.bfloat16, 256, 2, 1),
    (4096, jnp.float32, 256, 4, 1),
    (8192, jnp.float32, 256, 1, 8),     # cut: 8 CTAs of one 1024-column step each
    (8192, jnp.bfloat16, 256, 1, 4),
    (16384, jnp.float32, 256, 1, 16),
    (12000, jnp.bfloat16, 256, 1, 8),   # ragged: 1504-column shares, the last one 1472
])
def test_a_decode_batch_runs_wide_ctas_and_cuts_wide_rows(n, param_dtype, threads, unroll, cluster):
    """A few rows' forward config (NormForward.default_config): one row a CTA of about
    FEW_ROWS_VALUES values a thread; rows that would take more than FEW_ROWS_CUT_THREADS threads
    so are cut over a cluster of such CTAs, a step each. Every such config is one of the space's,
    and the cuts are candidates at a few rows only."""
    family = NormForward(True, True, True, 1e-6, "bfloat16")
    avals = (jax.ShapeDtypeStruct((8, n), jnp.bfloat16), *[jax.ShapeDtypeStruct((n,), param_dtype)] * 2)
    config = family.default_config(avals)
    geometry = dataclasses.replace(family, config=config).geometry(avals)
    assert (config.threads_per_row, config.num_threads, geometry.row.unroll, geometry.cluster) == (
        threads, threads, unroll, cluster)
    assert geometry.resident == (cluster == 1) and geometry.steps_per_cta == geometry.last_steps == 1
    space = family.config_space(avals)
    assert config in space
    many = (jax.ShapeDtypeStruct((4096, n), jnp.bfloat16), *avals[1:])
    cut = [c for c in space if dataclasses.replace(family, config=c).geometry(avals).cluster > 1]
    assert len(cut) == len(set(cut)) and (cluster == 1 or config in cut)
    assert not set(cut) & set(family.config_space(many))
    assert family.default_config(many) != config


def test_a_decode_batch_of_rows_narrower_than_a_cta_keeps_the_many_rows_heuristic():
    # 96 accesses of a bf16 row of 768 with bf16 parameters would leave 32 of 128 threads idle
    family = NormForward(True, True, True, 1e-6, "bfloat16")
    params = (jax.ShapeDtypeStruct((768,), jnp.bfloat16),) * 2
    few, many = (jax.ShapeDtypeStruct((rows, 768), jnp.bfloat16) for rows in (8, 4096))
    assert family.default_config((few, *params)) == family.default_config((many, *params))


# Lowers the forward of the norm op argv[1] on (argv[3], argv[4]) bf16 x, scale + bias of dtype
# argv[2], for sm_90a, the PTX kept in CUTE_DSL_DUMP_DIR (a fresh process: the DSL reads
# CUTE_DSL_KEEP at import).
FORWARD_PTX_PROGRAM = """
import sys
import jax, jax.numpy as jnp
import cutelayers as cl
op, dtype, rows, n = getattr(cl.ops, sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
x = jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
p = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))
with cl.use_backend("cute"):
    jax.jit(lambda x, s, b: op(x, s, b, dtype=jnp.bfloat16)).trace(x, p, p).lower(lowering_platforms=("cuda",))
"""


@pytest.mark.cute
def test_resident_forward_with_float32_parameters_holds_two_ctas_an_sm(tmp_path):
    # A bf16 row of 16384 with float32 scale and bias runs 512-thread CTAs of 32 values a thread;
    # unheld, ptxas gave it 66 registers (one CTA an SM, 63.5 % of copy bandwidth on an H200). Held
    # to two CTAs an SM (NormForwardKernel.two_ctas_an_sm) it takes 64 and spills nothing; the same
    # row with bf16 parameters (63 registers already) is not held, nor the kernel of a few rows
    # (FEW_ROWS: the row cut over a cluster, test_a_few_rows_cut_keeps_its_shares_in_registers).
    ptxas = shutil.which("ptxas")
    many, few = str(FEW_ROWS + 1), str(FEW_ROWS)
    for dtype, rows, held in (("float32", many, True), ("bfloat16", many, False), ("float32", few, False)):
        out = tmp_path / f"{dtype}_{rows}"
        out.mkdir()
        path = kept_ptx(out, FORWARD_PTX_PROGRAM, "rms_norm", dtype, rows, "16384")
        assert (".minnctapersm 2" in path.read_text()) == held, (dtype, rows)
        if held and ptxas is not None:
            notes = ptxas_report(ptxas, path)
            (registers,) = re.findall(r"Used (\d+) registers", notes)
            assert int(registers) <= 64 and " 0 bytes spill stores" in notes, notes


@pytest.mark.cute
def test_a_few_rows_cut_keeps_its_shares_in_registers(tmp_path):
    # A decode batch's row of 16384 is cut over a cluster in shares of one step
    # (RowGeometry.one_step_shares): the CTAs exchange their statistics (st.async into each
    # other's shared memory) but stage nothing -- no cp.async copy of the row, read back for the
    # normalize pass -- where many rows of 65 ... stream. Its share of the float32 scale (32-bit
    # loads; x's are 16-bit) is loaded with the share, before the exchange, not after it
    # (norm_config.params_first).
    path = kept_ptx(tmp_path, FORWARD_PTX_PROGRAM, "rms_norm", "float32", str(FEW_ROWS), "16384")
    ptx = path.read_text()
    assert "st.async" in ptx and "cp.async" not in ptx
    assert ptx.index("ld.global.v4.b32") < ptx.index("st.async")


@pytest.mark.cute
@pytest.mark.parametrize("rows, n", [(8, 4096), (16384, 2048), (8, 16384)])
def test_layer_norm_forward_moments_meet_at_one_barrier(tmp_path, rows, n):
    # A row over several warps -- resident (a decode batch of 4096, many rows of 2048) or a
    # cluster's share (8 x 16384) -- merges its threads' (mean, variance) in one butterfly
    # (reduction.row_merge), so its warps meet at one barrier, where the mean and then M2 took two.
    ptx = kept_ptx(tmp_path, FORWARD_PTX_PROGRAM, "layer_norm", "float32", str(rows), str(n)).read_text()
    assert len(re.findall(r"\bbar(?:rier)?\.sync", ptx)) == 1


@pytest.mark.cute
@pytest.mark.parametrize("kernel,n,ctas", [("add_layer_norm_bwd", 768, 3), ("rms_norm_bwd", 3072, 3),
                                           ("layer_norm_bwd", 1024, 4), ("add_layer_norm_bwd", 8192, 1)])
def test_resident_backward_holds_the_ctas_its_grid_counts_on(tmp_path, kernel, n, ctas):
    # The register-resident backward's persistent grid counts on norm_config.backward_ctas_per_sm
    # CTAs an SM, and its launch holds it there: bf16 rows of 768 or 3072 (24 values a thread) three
    # 128-thread CTAs (unheld, add_layer_norm's took 218 registers: two were resident, and a grid of
    # four an SM ran a second wave), 1024 four, 8192 one of 512 threads. ptxas fits the registers
    # without spilling.
    from cutelayers.bench import autotune

    ((case, _, default),) = autotune.list_candidates(kernel, [(16384, n)], ["bfloat16"])
    geometry = dataclasses.replace(case.family, config=default).geometry(case.avals)
    assert norm_config.backward_ctas_per_sm(geometry) == ctas
    assert norm_config.backward_grid(geometry) == norm_config.HOPPER_SMS * ctas
    path = kept_ptx(tmp_path, ROW_KERNEL_PTX_PROGRAM, kernel, str(n))
    assert f".minnctapersm {ctas}" in path.read_text()
    if (ptxas := shutil.which("ptxas")) is not None:
        notes = ptxas_report(ptxas, path)
        (registers,) = re.findall(r"Used (\d+) registers", notes)
        assert int(registers) * default.num_threads * ctas <= 65536 and " 0 bytes spill stores" in notes, notes


# Lowers the streamed backward of the row kernel argv[1] at (64, argv[2]) bf16 with its heuristic
# config staging argv[3] operands in argv[4] buffers for sm_90a, its PTX kept (as above).
STAGED_BACKWARD_PTX_PROGRAM = """
import dataclasses, functools, sys
import jax
import cutelayers as cl
from cutelayers.bench import autotune
from cutelayers.kernels import norm as norm_kernels
from cutelayers.kernels import norm_config
from cutelayers.runtime.sharding import kernel_call
((case, _, default),) = autotune.list_candidates(sys.argv[1], [(64, int(sys.argv[2]))], ["bfloat16"])
config = norm_config.StagingConfig(**dataclasses.asdict(default), staged_operands=int(sys.argv[3]),
                                   stages=int(sys.argv[4]))
with cl.use_backend("cute"):
    jax.jit(functools.partial(kernel_call, dataclasses.replace(case.family, config=config))).trace(
        *case.avals).lower(lowering_platforms=("cuda",))
"""


@pytest.mark.cute
@pytest.mark.parametrize("kernel,n,operands,stages,held", [("rms_norm_bwd", 65536, 2, 2, True),
                                                           ("rms_norm_bwd", 65536, 1, 1, True),
                                                           ("layer_norm_bwd", 131072, 1, 1, False)])
def test_streamed_backward_held_to_two_ctas_an_sm(tmp_path, kernel, n, operands, stages, held):
    # The two-buffer streamed backward is held to the CTAs an SM its grid counts on: ptxas then
    # gives its loop (unrolled by two) 80 registers instead of 57, and RMSNorm's ran 7.5 % faster at
    # 65536 and 131072 on an H200; so is RMSNorm's one-buffer kernel (5 % faster at 262144), while
    # LayerNorm's, which lost held, is left free.
    path = kept_ptx(tmp_path, STAGED_BACKWARD_PTX_PROGRAM, kernel, str(n), str(operands), str(stages))
    assert (".minnctapersm 2" in path.read_text()) == held
    if held and (ptxas := shutil.which("ptxas")) is not None:
        notes = ptxas_report(ptxas, path)
        (registers,) = re.findall(r"Used (\d+) registers", notes)
        assert int(registers) <= 128 and " 0 bytes spill stores" in notes, notes


@pytest.mark.cute
@pytest.mark.parametrize("center,n,param_dtype,rows,first", [
    (True, 768, jnp.bfloat16, 16384, True),   # one warp a row
    (True, 768, jnp.float32, 16384, True),
    (True, 1024, jnp.float32, 16384, True),
    (True, 2048, jnp.bfloat16, 16384, True),   # 32 values x 4 bytes of parameters a thread
    (True, 2048, jnp.float32, 16384, False),   # 32 x 8 bytes over two warps a row
    (True, 4096, jnp.float32, 16384, False),
    (False, 4096, jnp.float32, 16384, True),
    (True, 8192, jnp.bfloat16, 16384, False),  # wider than PARAMS_FIRST_MAX_N
    (True, 2048, jnp.float32, 8, True),        # few rows: always
    (False, 65536, jnp.bfloat16, 8, False),    # a streamed row: never
])
def test_forward_loads_its_parameters_first_by_the_rule(monkeypatch, center, n, param_dtype, rows, first):
    """Which heuristic forwards load scale and bias before their reductions
    (norm_config.params_first, as measured on the H100), and the kernel's flag follows it."""
    from cutelayers import tuning

    monkeypatch.setattr(tuning, "device_kind", lambda: "Fake H100 for tests")  # no table entries
    S = jax.ShapeDtypeStruct
    avals = (S((rows, n), jnp.bfloat16),) + (S((n,), param_dtype),) * (1 + center)
    family = tuning.resolve(NormForward(center, True, center, 1e-6, "bfloat16"), avals)  # few_rows set for rows
    assert family.loads_params_first(avals) == first
    assert family.launcher(avals, None).params_first == first


def test_forward_parameter_order_round_trips_the_tuning_table(tmp_path, monkeypatch):
    """A register-resident forward's space holds each config also with the other choice than the
    rule's of when the parameters load (norm_config.ForwardConfig); written to the tuned table with
    its params_first and read back as itself, it decides over the rule; an entry without the field
    (every one written before it) is the plain RowConfig, which the rule decides for."""
    from cutelayers import tuning

    S = jax.ShapeDtypeStruct
    device = "Fake H100 for tests"
    monkeypatch.setattr(tuning, "device_kind", lambda: device)
    avals = (S((16384, 1024), jnp.bfloat16), S((1024,), jnp.bfloat16), S((1024,), jnp.bfloat16))
    family = NormForward(True, True, True, 1e-6, "bfloat16")
    space = family.config_space(avals)
    plain = [c for c in space if type(c) is RowConfig]
    others = [c for c in space if isinstance(c, norm_config.ForwardConfig)]
    # every config resident at 1024: each plain one again, with the choice its rule does not make
    assert others == [norm_config.forward_config(c, not dataclasses.replace(family, config=c).loads_params_first(avals))
                      for c in plain]
    streamed = (S((8, 65536), jnp.bfloat16),) + (S((65536,), jnp.bfloat16),) * 2
    assert not [c for c in family.config_space(streamed) if isinstance(c, norm_config.ForwardConfig)]
    dtype, dims = family.tuning_key(avals)

    def resolved(i, config):
        path = tmp_path / f"tuned{i}.json"
        tuning.write_entries(path, [{"device": device, "kernel": family.name, "dtype": dtype, "dims": dict(dims),
                                     "config": config}])
        monkeypatch.setenv("CUTELAYERS_TUNING_FILE", str(path))
        return tuning.resolve(family, avals)

    for i, config in enumerate(others):
        chosen = resolved(i, tuning.config_fields(config))
        assert chosen.config == config and chosen.loads_params_first(avals) == config.params_first
    fields = {k: v for k, v in tuning.config_fields(others[0]).items() if k != "params_first"}
    assert type(resolved(len(others), fields).config) is RowConfig


# Lowers layer_norm's forward of (argv[2], argv[3]) bf16 x with scale and bias of the dtype argv[1]
# for sm_90a, the PTX kept in CUTE_DSL_DUMP_DIR (a fresh process, as above).
LAYER_NORM_PTX_PROGRAM = """
import sys
import jax, jax.numpy as jnp
import cutelayers as cl
x = jax.ShapeDtypeStruct((int(sys.argv[2]), int(sys.argv[3])), jnp.bfloat16)
p = jax.ShapeDtypeStruct((int(sys.argv[3]),), jnp.dtype(sys.argv[1]))
with cl.use_backend("cute"):
    jax.jit(lambda x, s, b: cl.ops.layer_norm(x, s, b, dtype=jnp.bfloat16)).trace(x, p, p).lower(
        lowering_platforms=("cuda",))
"""


@pytest.mark.cute
@pytest.mark.parametrize("param_dtype,n,first", [("float32", 768, True), ("float32", 2048, False),
                                                 ("bfloat16", 1000, True)])
def test_resident_forward_keeps_l1_for_its_parameters(tmp_path, param_dtype, n, first):
    # A register-resident row is read once and written once: x's loads evict first from L1 and y's
    # stores stream (.cs), so L1 keeps the parameters that every row reads (reduction.row_tiled_copy).
    # The parameters' own loads are plain, and go out before the row's first shuffle where the
    # kernel loads them first (norm_config.params_first), after its last one otherwise.
    path = kept_ptx(tmp_path, LAYER_NORM_PTX_PROGRAM, param_dtype, "16384", str(n))
    lines = path.read_text().splitlines()
    row_loads = [i for i, line in enumerate(lines) if "ld.global.L1::evict_first" in line]
    param_loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global\.v", line)]
    shuffles = [i for i, line in enumerate(lines) if "shfl.sync" in line]
    stores = [line for line in lines if re.search(r"\bst\.global\.", line)]
    assert row_loads and param_loads and shuffles
    assert any(".cs." in line for line in stores) and not any(re.search(r"st\.global\.v", line) for line in stores)
    assert (max(param_loads) < min(shuffles)) == first and (min(param_loads) > max(shuffles)) == (not first)


@pytest.mark.cute
@pytest.mark.parametrize("rows,n", [(8, 65536), (16384, 8192)])
def test_forward_without_cache_hints(tmp_path, rows, n):
    # A streamed row is read again for its normalize pass, and a resident row wider than
    # norm_config.CACHE_HINTS_MAX_N ran slower with the hints: plain accesses.
    path = kept_ptx(tmp_path, LAYER_NORM_PTX_PROGRAM, "bfloat16", str(rows), str(n))
    text = path.read_text()
    assert "ld.global" in text and "L1::evict_first" not in text and "st.global.cs" not in text


@pytest.mark.cute
def test_parameters_first_take_rows_held_in_registers():
    # A register-resident row, or a decode batch's row cut in one-step shares, holds its parameters'
    # step from the start; a streamed row's steps would each need their own.
    from cutelayers.kernels.norm import NormForwardKernel
    from cutelayers.tuning import resolve

    S = jax.ShapeDtypeStruct
    family = NormForward(False, True, False, 1e-6, "bfloat16")
    for n, held in ((65536, False), (16384, True)):
        avals = (S((8, n), jnp.bfloat16), S((n,), jnp.bfloat16))
        geometry = resolve(family, avals).geometry(avals)
        assert not geometry.resident and geometry.one_step_shares == held
        make = functools.partial(NormForwardKernel, geometry, center=False, has_residual=False, has_scale=True,
                                 has_bias=False, epsilon=1e-6, params_first=True)
        if held:
            assert make().params_first
        else:
            with pytest.raises(ValueError, match="params_first takes register-resident rows or one-step shares; "
                                                 "a 65536-column row streams"):
                make()


@pytest.mark.cute
def test_only_resident_rows_take_the_row_slot_sum_buffer():
    # The persistent backward sums its row slots' dscale through a shared buffer only for
    # register-resident rows; a streamed row's slots keep their sums in their shares' buffer and
    # store them as partial rows of their own. The slot buffer was allocated for streamed rows too:
    # 4 slots of a float32 12000-column RMSNorm row asked for 384 KiB, and the launch failed.

    S = jax.ShapeDtypeStruct
    family = NormBackward(False, True, True, False)
    for n in (12000, 1000):
        x, stat, scale = S((512, n), jnp.float32), S((512, 1), jnp.float32), S((n,), jnp.float32)
        avals = (x, x, stat, scale)
        slotted = [c for c in family.config_space(avals) if c.rows_per_cta > 1]
        assert slotted, n
        for config in slotted:
            member = dataclasses.replace(family, config=config)
            kernel = member.launcher(avals, None)
            if member.geometry(avals).resident:
                assert kernel.slot_sum_bytes() == config.rows_per_cta * n * 4 + 16
            else:
                assert kernel.slot_sum_bytes() == 0 and kernel.sum_bytes() > 0


# --- on the GPU: the CuTe kernels themselves ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 1000, 1024, 4095, 8192, 50257, 65536, 262144])
def test_kernel_values_and_grads_gpu(op, dtype, n, rng):
    fn, _ = OPS[op]
    lead = (37,) if n <= 65536 else (3,)
    x = random(rng, (*lead, n), dtype, loc=2.0)
    for pdt, with_scale, with_bias in ((jnp.float32, True, True), (dtype, True, False), (dtype, False, False)):
        scale, bias = _params(rng, n, pdt, with_scale, with_bias)
        w = random(rng, x.shape, jnp.float32)

        def loss(x, s, b, w=w):
            return jnp.sum(fn(x, s, b).astype(jnp.float32) * w)

        with cl.use_backend("cute"):
            _check_values(op, x, scale, bias)
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)
        with cl.use_backend("reference"):
            g_ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)
        for a, b in zip(g, g_ref):
            if b is not None:
                # N = 1 gradients are ~epsilon-sized differences: compare against their scale.
                assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), a.dtype, scale=10.0 if n > 1 else 1e4)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("n,rows,dtype", [(1000, 9000, jnp.bfloat16), (768, 9000, jnp.bfloat16),
                                          (3072, 3000, jnp.float16), (12000, 300, jnp.float32),
                                          (16384, 500, jnp.bfloat16), (50257, 100, jnp.bfloat16),
                                          (65536, 200, jnp.bfloat16), (262144, 40, jnp.float16),
                                          (262144, 24, jnp.float32)])
def test_grads_with_more_rows_than_the_persistent_grid_gpu(op, n, rows, dtype, rng):
    # More rows than the persistent backward grid has CTAs (N = 1000, register-resident rows; 768
    # and 3072, 24 values a thread, three CTAs an SM: norm_config.backward_ctas_per_sm) or
    # clusters (streamed rows, cut over clusters past 12288 bf16 columns): each takes several and
    # sums their dscale / dbias into its partials -- for streamed rows in shared memory, with
    # per-row cluster exchanges that alternate slot buffers and barrier phases. The forward's
    # values are checked first, with float32 parameters and with parameters of x's dtype.
    fn, center = OPS[op]
    x = random(rng, (rows, n), dtype, loc=1.0)
    scale, bias = _params(rng, n, jnp.float32, True, True)
    w = random(rng, x.shape, jnp.float32)
    for s, b in ((scale, bias), (scale.astype(dtype), bias.astype(dtype))):
        with cl.use_backend("cute"):
            out = jax.jit(functools.partial(fn, dtype=jnp.float32))(x, s, b)
        assert_close(out, ref64(x, s, b, center=center), dtype, scale=2.0)

    def loss(x, s, b):
        return jnp.sum(fn(x, s, b).astype(jnp.float32) * w)

    with cl.use_backend("cute"):
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)
    with cl.use_backend("reference"):
        g_ref = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias)
    for a, b in zip(g, g_ref):
        assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), a.dtype, scale=10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_kernel_vmap_and_large_mean_gpu(op, rng):
    fn, center = OPS[op]
    x = random(rng, (4, 33, 1000), jnp.float32, loc=1000.0)
    scale, bias = _params(rng, 1000, jnp.float32, True, True)
    with cl.use_backend("cute"):
        out = jax.vmap(lambda x: fn(x, scale, bias))(x)
        g = jax.jit(jax.grad(lambda x, s: jnp.sum(jnp.sin(jax.vmap(fn, in_axes=(0, None))(x, s))), argnums=(0, 1)))(x, scale)
    # |x| ~ 1000 carries ~1e-4 rounding relative to its spread in fp32, whatever the method; the
    # two paths sum in different orders, so they agree to that level, not to 1e-5.
    assert_close(out, ref64(x, scale, bias, center=center), jnp.float32, scale=20.0)
    with cl.use_backend("reference"):
        g_ref = jax.jit(jax.grad(lambda x, s: jnp.sum(jnp.sin(fn(x, s))), argnums=(0, 1)))(x, scale)
    for a, b in zip(g, g_ref):
        assert_close(a, np.asarray(b), jnp.float32, scale=100.0)


def special_rows(rng, rows, n, dtype, non_finite: bool):
    """Rows of N(1, 1) but for a constant one first and last (zero variance: y is the bias) and,
    with ``non_finite``, a NaN in the second row and a +inf in the third (NaN rows in LayerNorm; in
    RMSNorm NaN at the +inf, 0 beside it), so that rows sharing a CTA's reductions and row slots
    with them show whether anything leaks."""
    x = np.array(random(rng, (rows, n), jnp.float32, loc=1.0))
    x[0] = x[-1] = 0.75
    if non_finite:
        x[1, n // 2] = np.nan
        x[2, n - 1] = np.inf
    return jnp.asarray(x, dtype)


def special_row_outputs(op, x, scale, bias):
    """The norm's output and its gradients (x, scale, bias) for a fixed cotangent."""
    fn, _ = OPS[op]
    w = jnp.asarray(np.cos(np.arange(x.size)).reshape(x.shape), jnp.float32)

    def loss(x, s, b):
        return jnp.sum(fn(x, s, b).astype(jnp.float32) * w)

    return (jax.jit(fn)(x, scale, bias), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, scale, bias))


@pytest.mark.parametrize("op", OPS)
def test_special_rows_reference(op, rng):
    """The ops' jnp path on constant, NaN and +inf rows: the plain formula's values, NaNs and infinities."""
    _, center = OPS[op]
    x = special_rows(rng, 6, 7, jnp.float32, non_finite=True)
    scale, bias = _params(rng, 7, jnp.float32, True, True)
    y = special_row_outputs(op, x, scale, bias)[0]
    assert_same_where_special(y, plain(x, scale, bias, center=center), jnp.float32, op)
    # a constant row: the bias (LayerNorm; jnp.mean's rounding of its mean, an ulp, times rstd =
    # 1 / sqrt(epsilon) leaves ~1e-4), or scale * x / |x| + bias (RMSNorm)
    constant = np.asarray(bias) if center else np.asarray(scale) * 0.75 / np.sqrt(0.75**2 + 1e-6) + np.asarray(bias)
    np.testing.assert_allclose(np.asarray(y)[[0, -1]], np.broadcast_to(constant, (2, 7)), rtol=1e-5, atol=1e-3)
    assert np.isnan(np.asarray(y)[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("n,rows", [(1000, 6), (1000, 66), (8192, 6), (8192, 66), (65536, 6), (65536, 66)])
def test_special_rows_gpu(op, dtype, n, rows, rng):
    """The kernels -- register-resident rows (several a CTA), a decode batch's wide CTAs, rows cut
    over a cluster -- on constant rows give the jnp path's values and gradients, and on NaN and
    +inf rows its NaNs and infinities, with every other row's results untouched."""
    scale, bias = _params(rng, n, jnp.float32, True, True)
    for non_finite in (False, True):
        x = special_rows(rng, rows, n, dtype, non_finite)
        with cl.use_backend("reference"):
            expected = special_row_outputs(op, x, scale, bias)
        with cl.use_backend("cute"):
            got = special_row_outputs(op, x, scale, bias)
        for name, a, b in zip(("y", "dx", "dscale", "dbias"), got, expected):
            assert_same_where_special(a, b, dtype, f"{op} {name} (non-finite rows: {non_finite})", scale=10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("op", [*OPS, *ADD_OPS])
@pytest.mark.parametrize("n", [768, 4095, 8192, 12000, 16384])
def test_decode_rows_forward_gpu(op, n, rng):
    # A decode batch (1 to FEW_ROWS rows) runs wide one-row CTAs, its rows past 4096
    # columns cut over a cluster whose CTAs combine their statistics (LayerNorm's by Chan's merge:
    # a mean of 100 and a spread of 1 would lose digits to E[x^2] - E[x]^2), with float32
    # parameters and parameters of x's dtype.
    fn, center = {**OPS, **ADD_OPS}[op]
    adds = op in ADD_OPS
    for rows, dtype in ((1, jnp.bfloat16), (8, jnp.float16), (FEW_ROWS, jnp.float32)):
        x = random(rng, (rows, n), dtype, loc=100.0)
        residual = random(rng, (rows, n), dtype)
        scale, bias = _params(rng, n, jnp.float32, True, center)
        for s, b in ((scale, bias), (scale.astype(dtype), None if bias is None else bias.astype(dtype))):
            params = (s, b) if center else (s,)
            with cl.use_backend("cute"):
                out = jax.jit(fn)(x, residual, *params) if adds else jax.jit(fn)(x, *params)
            normed, summed = out if adds else (out, x)
            if adds:
                assert_close(summed, np.asarray(x, np.float64) + np.asarray(residual, np.float64), dtype)
            assert_close(normed, ref64(summed, *params, center=center), dtype, scale=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("n,rows", [(20001, 5), (50257, 3), (262144, 2)])
def test_streamed_layer_norm_large_mean_gpu(n, rows, rng):
    # Streamed rows (cut over a cluster at 50257 and 262144, a ragged last step at the odd widths)
    # merge per-step moments (norm.py's module docstring); with a mean of 1000 and a spread of 1,
    # E[x^2] - E[x]^2 would lose every digit in float32. The fused residual add's row is its sum.
    x = random(rng, (rows, n), jnp.float32, loc=1000.0)
    scale, bias = _params(rng, n, jnp.float32, True, True)
    residual = random(rng, (rows, n), jnp.float32)
    with cl.use_backend("cute"):
        out = jax.jit(layer_norm)(x, scale, bias)
        normed, summed = jax.jit(add_layer_norm)(x, residual, scale, bias)
    assert_close(out, ref64(x, scale, bias), jnp.float32, scale=20.0)
    assert_close(normed, ref64(summed, scale, bias), jnp.float32, scale=20.0)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 777, 1024, 4095, 8192, 65536, 262144])
def test_add_kernel_values_and_grads_gpu(op, dtype, n, rng):
    fn, center = ADD_OPS[op]
    lead = (37,) if n <= 65536 else (3,)
    x = random(rng, (*lead, n), dtype)
    argnums = (0, 1, 2, 3)
    # (residual dtype, parameter dtype, scale, bias): a float32 residual stream with a float32 scale
    for rdtype, pdt, with_scale, with_bias in [(dtype, dtype, True, True), (jnp.float32, jnp.float32, True, False),
                                               (dtype, dtype, False, False)]:
        residual = random(rng, x.shape, rdtype, loc=2.0)
        scale, bias = _params(rng, n, pdt, with_scale, with_bias)
        w_normed, w_summed = random(rng, x.shape, jnp.float32), random(rng, x.shape, jnp.float32)
        args = (x, residual, scale, bias)

        def grads(through, w_normed=w_normed, w_summed=w_summed, args=args):
            return jax.jit(jax.grad(_two_output_loss(fn, w_normed, w_summed, through), argnums))(*args)

        with cl.use_backend("cute"):
            normed, summed = jax.jit(fn)(*args)
            g_both, g_summed = grads(("normed", "summed")), grads(("summed",))
        np.testing.assert_array_equal(summed, summed_reference(x, residual))
        assert_close(normed, ref64(summed, scale, bias, center=center), normed.dtype)
        with cl.use_backend("reference"):
            g_ref, g_summed_ref = grads(("normed", "summed")), grads(("summed",))
        for a, b in zip(g_both, g_ref):
            if b is not None:
                # N = 1 gradients are ~epsilon-sized differences: compare against their scale. A row
                # of three can draw near-equal sums, whose rstd amplifies the one-ulp difference
                # between our rounded sum and the reference's (XLA may keep it in float32): seeds
                # 809872388 (0.50 in bfloat16) and 2633691409 (0.029 in float16) on an H200.
                assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), a.dtype,
                             scale=1e4 if n == 1 else 100.0 if n < 8 else 10.0)
        # through summed alone, d_normed is zero: dx = dresidual = d_summed. Not bit-equal to the
        # reference program's: XLA may keep that program's summed in float32 inside a fusion
        # (excess precision) where ours is the rounded kernel output, so cos(summed) differs by
        # an ulp of the dtype -- and cos near its zeros magnifies that (N = 1, bfloat16: 0.0103
        # against 0.01 once on an H100), hence twice the dtype's tolerance.
        for a, b in zip(g_summed[:2], g_summed_ref[:2]):
            assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), a.dtype, scale=2.0)
        if rdtype == dtype:  # x and the residual share one gradient
            np.testing.assert_array_equal(g_summed[0], g_summed[1])


@pytest.mark.gpu
@pytest.mark.parametrize("op", ADD_OPS)
def test_add_kernel_vmap_gpu(op, rng):
    fn, center = ADD_OPS[op]
    x = random(rng, (4, 33, 1000), jnp.bfloat16)
    residual = random(rng, x.shape, jnp.float32)
    scale, bias = _params(rng, 1000, jnp.float32, True, True)
    w_normed, w_summed = random(rng, x.shape, jnp.float32), random(rng, x.shape, jnp.float32)
    shared = (0, 0, None, None)
    nested = jax.vmap(jax.vmap(fn, in_axes=shared), in_axes=shared)
    args, argnums = (x, residual, scale, bias), (0, 1, 2, 3)
    with cl.use_backend("cute"):
        normed, summed = jax.jit(nested)(*args)
        g = jax.jit(jax.grad(_two_output_loss(nested, w_normed, w_summed), argnums))(*args)
    assert_close(normed, ref64(summed, scale, bias, center=center), jnp.float32, scale=10.0)
    with cl.use_backend("reference"):
        g_ref = jax.jit(jax.grad(_two_output_loss(fn, w_normed, w_summed), argnums))(*args)
    for a, b in zip(g, g_ref):
        assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), a.dtype, scale=10.0)


# (backward kernel, rows x N, dtype): more rows than the persistent grid has clusters, so each walks
# several, copying the next row's staged share in during the dx pass
STAGING_CASES = [("rms_norm_bwd", (40, 262144), "bfloat16"), ("add_rms_norm_bwd", (40, 262144), "bfloat16"),
                 ("rms_norm_bwd", (24, 262144), "float32"),  # dy alone: 128 KiB, one CTA an SM
                 ("add_layer_norm_bwd", (100, 50257), "bfloat16"),  # odd N: dy staged from registers
                 ("add_layer_norm_bwd", (40, 131072), "bfloat16")]  # two buffers: 128 KiB over 16 CTAs


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,shape,dtype", STAGING_CASES)
def test_backward_staging_fewer_operands_gpu(kernel, shape, dtype):
    """The heuristic backward config staging dy alone, or neither of x and dy, or them in two
    buffers (norm_config.StagingConfig), gives the heuristic's dx exactly -- the same arithmetic on
    the same values, read from global memory or another buffer instead of the one shared one -- and
    dscale / dbias within float32's tolerance of the reference (their rows summed in another order:
    twice the clusters). Two buffers are candidates where both fit with cp.async (bf16, even N)."""
    from cutelayers.bench import autotune

    ((case, configs, default),) = autotune.list_candidates(kernel, [shape], [dtype])
    fewer = [c for c in norm_config.staging_variants(default) if c in configs]
    assert 2 in {c.stages for c in fewer} or dtype == "float32" or shape[1] % 2
    operands = case.make_operands()

    def run(config):
        return case.observe(_run_config(case.family, config, operands))

    dx, *_ = run(default)
    _, *expected = case.observe(dataclasses.replace(case.family, config=default).reference(*operands))
    for config in fewer:
        got_dx, *got = run(config)
        np.testing.assert_array_equal(got_dx, dx)
        for a, b in zip(got, expected, strict=True):
            assert_close(a, b, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,n,param_dtype", [("layer_norm_fwd", 768, "float32"), ("layer_norm_fwd", 2048, "float32"),
                                                  ("rms_norm_fwd", 1000, "bfloat16"), ("add_layer_norm_fwd", 4095, "float32"),
                                                  ("add_rms_norm_fwd", 3072, "float32")])
def test_forward_parameter_order_gives_the_same_results_gpu(kernel, n, param_dtype):
    """A register-resident forward that loads its parameters before its reductions and one that
    loads them after (norm_config.ForwardConfig) compute the same thing: results within one unit in
    the last place of each other, or within float32 rounding at the array's scale where y cancels
    to near zero (ptxas may contract the scale and bias into an FMA in one and not the other:
    add_layer_norm at 4095 differed so in 0.001 % of y on an H200), on many rows (ragged where N
    is odd), with the residual add too."""
    from cutelayers.bench import autotune

    ((case, _, default),) = autotune.list_candidates(kernel, [(9000, n)], ["bfloat16"], param_dtype)
    family = case.family
    assert family.cut(default, case.avals).resident
    operands = case.make_operands()
    first, after = (_run_config(family, norm_config.forward_config(default, flag), operands)
                    for flag in (True, False))
    for a, b in zip(first, after, strict=True):
        ulp = float(jnp.finfo(b.dtype).eps)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        rounding = 8 * float(jnp.finfo(jnp.float32).eps) * float(np.max(np.abs(b)))
        np.testing.assert_allclose(a, b, rtol=ulp, atol=rounding)


# Streamed forwards of several rows a CTA, cut over a cluster: (kernel, (rows, N), x dtype, param
# dtype). Odd row counts leave the last CTA's later row slots past the last row; 50257 is ragged
# and stages from registers; 65536 float32 cuts four rows a CTA of 128 threads each.
ROW_SLOT_CASES = [("layer_norm_fwd", (41, 262144), "bfloat16", "float32"),
                  ("rms_norm_fwd", (23, 262144), "bfloat16", "bfloat16"),
                  ("add_layer_norm_fwd", (37, 50257), "bfloat16", "float32"),
                  ("add_rms_norm_fwd", (9, 131072), "float16", "float32"),
                  ("layer_norm_fwd", (30, 65536), "float32", "float32")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,shape,dtype,param_dtype", ROW_SLOT_CASES)
def test_forward_of_several_rows_a_cta_over_a_cluster_gpu(kernel, shape, dtype, param_dtype):
    """Every config of the space that cuts CTAs of several rows over a cluster gives the heuristic
    (one row a CTA)'s results within rounding -- each row slot's statistics gathered over the
    cluster on their own (reduction.cluster_gather) -- and exactly where its rows' shares and
    threads are the heuristic's (the same arithmetic in the same order)."""
    from cutelayers.bench import autotune

    ((case, configs, default),) = autotune.list_candidates(kernel, [shape], [dtype], param_dtype)
    family = case.family
    slotted = [c for c in configs if c.rows_per_cta > 1 and c.threads_per_row >= 128
               and family.cut(c, case.avals).cluster > 1]
    assert slotted, configs
    operands = case.make_operands()

    expected = _run_config(family, default, operands)
    base = family.cut(default, case.avals)
    for config in slotted:
        got = _run_config(family, config, operands)
        g = family.cut(config, case.avals)
        same = (g.cluster, g.share_width, g.row.threads_per_row, g.row.unroll) == (
            base.cluster, base.share_width, base.row.threads_per_row, base.row.unroll)
        for a, b in zip(got, expected, strict=True):
            if same:
                np.testing.assert_array_equal(a, b, err_msg=str(config))
            else:
                assert_close(a, np.asarray(jnp.asarray(b, jnp.float32)), b.dtype, scale=2.0)
