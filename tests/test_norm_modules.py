"""Flax linen / NNX and Equinox LayerNorm / RMSNorm: drop-in compatibility with the stock modules.

Checkpoint compatibility: the stock module's parameters load into ours (same pytree structure,
shapes, dtypes) and the outputs and gradients agree within the output dtype's tolerance.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numerics import assert_matches, assert_trees_match, perturbed_stock_checkpoint, random, same_tree

import cutelayers as cl
from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx

# --- linen ---------------------------------------------------------------------------------------

LINEN_CASES = [
    ("LayerNorm", {}),
    ("LayerNorm", {"use_bias": False, "epsilon": 1e-3}),
    ("LayerNorm", {"use_scale": False, "dtype": jnp.bfloat16}),
    ("LayerNorm", {"param_dtype": jnp.bfloat16, "bias_init": nn.initializers.normal(1.0),
                   "scale_init": nn.initializers.normal(1.0)}),
    ("LayerNorm", {"use_fast_variance": False, "force_float32_reductions": False}),
    ("RMSNorm", {}),
    ("RMSNorm", {"use_scale": False, "epsilon": 1e-5}),
    ("RMSNorm", {"dtype": jnp.float16, "param_dtype": jnp.bfloat16, "scale_init": nn.initializers.normal(1.0)}),
]


@pytest.mark.parametrize("name,kwargs", LINEN_CASES)
@pytest.mark.parametrize("xdtype", [jnp.bfloat16, jnp.float32])
def test_linen_drop_in(name, kwargs, xdtype, rng):
    stock, ours = getattr(nn, name)(**kwargs), getattr(cl_linen, name)(**kwargs)
    x = random(rng, (2, 5, 48), xdtype, loc=0.5)
    variables = stock.init(jax.random.key(0), x)
    same_tree(variables, ours.init(jax.random.key(0), x))
    # force_float32_reductions=False: Flax computes in x's dtype, we in float32 (more precise).
    tol_dtype = None if kwargs.get("force_float32_reductions", True) else xdtype
    y = stock.apply(variables, x)
    assert_matches(ours.apply(variables, x), y, tol_dtype)

    def loss(m):
        return lambda v, x: jnp.sum(jnp.sin(m.apply(v, x).astype(jnp.float32)))

    g, g_ref = (jax.grad(loss(m), argnums=(0, 1))(variables, x) for m in (ours, stock))
    assert_trees_match(g, g_ref, tol_dtype or y.dtype)


@pytest.mark.parametrize("kwargs,call,named", [
    ({"reduction_axes": (1, 2)}, {}, "reduction_axes=\\(1, 2\\)"),
    ({"reduction_axes": (1, 2), "feature_axes": (1, 2)}, {}, "reduction_axes"),
    ({}, {"mask": True}, "mask is an array of shape \\(2, 3, 4\\)"),
])
def test_linen_stock_options_fall_back(kwargs, call, named, rng):
    """What only Flax's computation implements runs it (the same result), and backend 'cute',
    which insists on kernels, refuses it with an error naming the argument."""
    x = random(rng, (2, 3, 4), jnp.float32)
    call = {"mask": x > 0} if call else {}
    stock, ours = nn.LayerNorm(**kwargs), cl_linen.LayerNorm(**kwargs)
    variables = stock.init(jax.random.key(0), x, **call)
    same_tree(variables, ours.init(jax.random.key(0), x, **call))
    np.testing.assert_array_equal(ours.apply(variables, x, **call), stock.apply(variables, x, **call))
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match=f"LayerNorm: backend 'cute' .*{named}"):
        ours.apply(variables, x, **call)
    # -1 spelled as a positive axis or a tuple is the last axis: the op serves it (and, lowered for
    # the CPU or without the CuTe DSL, is what refuses backend 'cute')
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match="rms_norm_fwd: backend 'cute'"):
        cl_linen.RMSNorm(reduction_axes=(2,), feature_axes=2).init(jax.random.key(0), x)


# --- nnx -----------------------------------------------------------------------------------------

NNX_CASES = [
    ("LayerNorm", {}),
    ("LayerNorm", {"use_bias": False, "epsilon": 1e-3, "param_dtype": jnp.bfloat16}),
    ("LayerNorm", {"use_scale": False, "dtype": jnp.bfloat16}),
    ("LayerNorm", {"scale_init": nnx.initializers.normal(1.0), "bias_init": nnx.initializers.normal(1.0)}),
    ("RMSNorm", {}),
    ("RMSNorm", {"use_scale": False}),
    ("RMSNorm", {"dtype": jnp.float16, "scale_init": nnx.initializers.normal(1.0)}),
]


@pytest.mark.parametrize("name,kwargs", NNX_CASES)
@pytest.mark.parametrize("xdtype", [jnp.bfloat16, jnp.float32])
def test_nnx_drop_in(name, kwargs, xdtype, rng):
    stock = getattr(nnx, name)(48, rngs=nnx.Rngs(0), **kwargs)
    ours = getattr(cl_nnx, name)(48, rngs=nnx.Rngs(1), **kwargs)
    state = nnx.state(stock, nnx.Param)
    same_tree(state, nnx.state(ours, nnx.Param))
    nnx.update(ours, state)  # load the stock module's parameters
    x = random(rng, (3, 7, 48), xdtype, loc=0.5)
    y = stock(x)
    assert_matches(ours(x), y)

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x).astype(jnp.float32)))

    g, g_ref = nnx.grad(loss)(ours, x), nnx.grad(loss)(stock, x)
    assert_trees_match(g, g_ref, y.dtype)


def test_nnx_jit_and_stock_options(rng):
    x = random(rng, (16, 16), jnp.float32)
    m = cl_nnx.LayerNorm(16, rngs=nnx.Rngs(0))
    assert_matches(nnx.jit(lambda m, x: m(x))(m, x), nnx.LayerNorm(16, rngs=nnx.Rngs(0))(x))
    stock, ours = (cls(16, reduction_axes=0, rngs=nnx.Rngs(0)) for cls in (nnx.RMSNorm, cl_nnx.RMSNorm))
    assert_matches(nnx.jit(lambda m, x: m(x))(ours, x), stock(x))
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match="RMSNorm: .*reduction_axes=0"):
        ours(x)


# --- equinox -------------------------------------------------------------------------------------

EQX_CASES = [
    ("LayerNorm", 48, {}),
    ("LayerNorm", (4, 12), {"use_bias": False, "eps": 1e-3}),
    ("LayerNorm", 48, {"use_weight": False, "dtype": jnp.bfloat16}),
    ("LayerNorm", (), {}),
    ("RMSNorm", 48, {}),
    ("RMSNorm", (6, 8), {"use_bias": False}),
    ("RMSNorm", 48, {"use_weight": False, "eps": 1e-6}),
]


@pytest.mark.parametrize("name,shape,kwargs", EQX_CASES)
@pytest.mark.parametrize("xdtype", [jnp.bfloat16, jnp.float32])
def test_equinox_drop_in(name, shape, kwargs, xdtype, rng):
    stock = getattr(eqx.nn, name)(shape, **kwargs)
    ours = getattr(cl_eqx, name)(shape, **kwargs)
    same_tree(stock, ours)
    stock, ours = perturbed_stock_checkpoint(stock, ours, rng)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(stock), strict=True):
        np.testing.assert_array_equal(a, b)
    x = random(rng, (5, *ours.shape), xdtype, loc=0.5)
    y = jax.vmap(stock)(x)
    assert_matches(jax.vmap(ours)(x), y)
    out, state = ours(x[0], "state")
    assert state == "state"
    assert_matches(out, stock(x[0]))

    def loss(m, x):
        return jnp.sum(jnp.sin(jax.vmap(m)(x).astype(jnp.float32)))

    g, g_ref = (eqx.filter_jit(eqx.filter_grad(loss))(m, x) for m in (ours, stock))
    assert_trees_match(g, g_ref, y.dtype)


def test_equinox_shape_check():
    with pytest.raises(ValueError, match="shape == x.shape"):  # Equinox's own check and error
        cl_eqx.LayerNorm(8)(jnp.ones((2, 8)))


# --- the residual call argument: the fused add, against stock norm(x + residual) -----------------

RESIDUAL_DTYPES = [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.float32)]


def stock_add(norm, x, residual):
    """What ``norm(x, residual=residual)`` stands for: the stock norm of the sum, and the sum (in the
    residual's dtype)."""
    summed = (x + residual).astype(residual.dtype)
    return norm(summed), summed


def _add_loss(outputs):
    normed, summed = outputs
    return jnp.sum(jnp.sin(normed.astype(jnp.float32))) + jnp.sum(jnp.cos(summed.astype(jnp.float32)))


def _check_add(got, ref):
    (normed, summed), (ref_normed, ref_summed) = got, ref
    np.testing.assert_array_equal(summed, ref_summed)
    assert_matches(normed, ref_normed)


@pytest.mark.parametrize("name,kwargs", [("LayerNorm", {}), ("LayerNorm", {"use_bias": False, "dtype": jnp.bfloat16}),
                                         ("RMSNorm", {}), ("RMSNorm", {"param_dtype": jnp.bfloat16})])
@pytest.mark.parametrize("xdtype,rdtype", RESIDUAL_DTYPES)
def test_linen_residual(name, kwargs, xdtype, rdtype, rng):
    stock, ours = getattr(nn, name)(**kwargs), getattr(cl_linen, name)(**kwargs)
    x = random(rng, (2, 5, 48), xdtype, loc=0.5)
    r = random(rng, x.shape, rdtype)
    variables = stock.init(jax.random.key(0), x)
    same_tree(variables, ours.init(jax.random.key(0), x, residual=r))  # a plain norm's parameters
    ref = stock_add(lambda s: stock.apply(variables, s), x, r)
    _check_add(ours.apply(variables, x, residual=r), ref)
    g = jax.grad(lambda v, x, r: _add_loss(ours.apply(v, x, residual=r)), argnums=(0, 1, 2))(variables, x, r)
    g_ref = jax.grad(lambda v, x, r: _add_loss(stock_add(lambda s: stock.apply(v, s), x, r)),
                     argnums=(0, 1, 2))(variables, x, r)
    assert_trees_match(g, g_ref, ref[0].dtype)


@pytest.mark.parametrize("name,kwargs", [("LayerNorm", {}), ("LayerNorm", {"use_scale": False}),
                                         ("LayerNorm", {"dtype": jnp.bfloat16}),
                                         ("RMSNorm", {}), ("RMSNorm", {"param_dtype": jnp.bfloat16})])
@pytest.mark.parametrize("xdtype,rdtype", RESIDUAL_DTYPES)
def test_nnx_residual(name, kwargs, xdtype, rdtype, rng):
    """(A narrowing dtype: NNX rounds the sum to it before normalizing, the kernel only its result;
    both are within that dtype's tolerance.)"""
    stock = getattr(nnx, name)(48, rngs=nnx.Rngs(0), **kwargs)
    ours = getattr(cl_nnx, name)(48, rngs=nnx.Rngs(0), **kwargs)
    x = random(rng, (3, 7, 48), xdtype, loc=0.5)
    r = random(rng, x.shape, rdtype)
    ref = stock_add(stock, x, r)
    _check_add(ours(x, residual=r), ref)
    _check_add(nnx.jit(lambda m, x, r: m(x, residual=r))(ours, x, r), ref)

    def loss(m, x, r):
        return _add_loss(m(x, residual=r) if m is ours else stock_add(m, x, r))

    g, g_ref = (nnx.grad(loss, argnums=(0, 1, 2))(m, x, r) for m in (ours, stock))
    assert_trees_match(g, g_ref, ref[0].dtype)


@pytest.mark.parametrize("name,shape", [("LayerNorm", 48), ("LayerNorm", (4, 12)), ("RMSNorm", 48)])
@pytest.mark.parametrize("xdtype,rdtype", RESIDUAL_DTYPES)
def test_equinox_residual(name, shape, xdtype, rdtype, rng):
    stock = getattr(eqx.nn, name)(shape)
    ours = getattr(cl_eqx, name)(shape)
    stock, ours = perturbed_stock_checkpoint(stock, ours, rng)
    x = random(rng, (5, *ours.shape), xdtype, loc=0.5)
    r = random(rng, x.shape, rdtype)
    ref = stock_add(jax.vmap(stock), x, r)
    _check_add(jax.vmap(lambda x, r: ours(x, residual=r))(x, r), ref)
    (normed, summed), state = ours(x[0], "state", residual=r[0])
    assert state == "state"
    _check_add((normed, summed), stock_add(stock, x[0], r[0]))

    def loss(mxr):
        m, x, r = mxr
        if m is ours:
            return _add_loss(jax.vmap(lambda x, r: m(x, residual=r))(x, r))
        return _add_loss(stock_add(jax.vmap(m), x, r))

    g, g_ref = (eqx.filter_grad(loss)((m, x, r)) for m in (ours, stock))
    assert_trees_match(g, g_ref, ref[0].dtype)


def test_residual_stock_paths(rng):
    """A call the op cannot serve runs the stock norm of the sum (the same result), and backend
    'cute' refuses it naming why: linen's mask, and a residual of another shape (stock broadcasts)."""
    x = random(rng, (2, 3, 8), jnp.float32)
    r = random(rng, x.shape, jnp.float32)
    mask = x > 0
    stock, ours = nn.LayerNorm(), cl_linen.LayerNorm()
    v = stock.init(jax.random.key(0), x)
    got = ours.apply(v, x, residual=r, mask=mask)
    ref = stock_add(lambda s: stock.apply(v, s, mask=mask), x, r)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(a, b)
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match="LayerNorm: backend 'cute' .*mask"):
        ours.apply(v, x, residual=r, mask=mask)
    row = r[0, 0]
    m_stock, m_ours = nnx.RMSNorm(8, rngs=nnx.Rngs(0)), cl_nnx.RMSNorm(8, rngs=nnx.Rngs(0))
    for a, b in zip(m_ours(x, residual=row), stock_add(m_stock, x, row), strict=True):
        np.testing.assert_array_equal(a, b)
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match=r"RMSNorm: .*residual has shape \(8,\)"):
        m_ours(x, residual=row)


def test_a_residual_no_computation_takes_is_an_error(rng):
    # on either path: an integer residual would truncate the sum (kept in the residual's dtype),
    # and one that does not broadcast to x's shape would change the result's shape
    x = random(rng, (2, 3, 8), jnp.float32)
    v = nn.LayerNorm().init(jax.random.key(0), x)
    calls = {"linen": lambda r, **kw: cl_linen.LayerNorm().apply(v, x, residual=r, **kw),
             "nnx": lambda r, **kw: cl_nnx.RMSNorm(8, rngs=nnx.Rngs(0))(x, residual=r, **kw),
             "equinox": lambda r, **kw: cl_eqx.LayerNorm(8)(x[0, 0], residual=r[0, 0] if getattr(r, "ndim", 0) > 1 else r)}
    for name, call in calls.items():
        with pytest.raises(TypeError, match=r"Norm: argument 'residual' has dtype int32; expected a floating or complex"):
            call(jnp.ones(x.shape, jnp.int32))
        with pytest.raises(TypeError, match=r"Norm: argument 'residual' has dtype int32"):
            call(jnp.ones(x.shape, jnp.int32), **({} if name == "equinox" else {"mask": x > 0}))  # stock path too
        with pytest.raises(ValueError, match=r"Norm: argument 'residual' has shape \(5,\); expected x's shape"):
            call(jnp.ones(5))
        with pytest.raises(TypeError, match=r"Norm: argument 'residual' must be an array; got list"):
            call([1.0] * 8)


@pytest.mark.gpu
def test_modules_on_kernels_gpu(rng):
    x = random(rng, (4, 16, 1024), jnp.bfloat16)
    with cl.use_backend("cute"):
        stock, ours = nn.LayerNorm(), cl_linen.LayerNorm()
        v = stock.init(jax.random.key(0), x)
        assert_matches(jax.jit(ours.apply)(v, x), stock.apply(v, x))
        e_stock, e_ours = eqx.nn.RMSNorm(1024), cl_eqx.RMSNorm(1024)
        assert_matches(jax.jit(jax.vmap(jax.vmap(e_ours)))(x), jax.vmap(jax.vmap(e_stock))(x))
        n_stock, n_ours = nnx.RMSNorm(1024, rngs=nnx.Rngs(0)), cl_nnx.RMSNorm(1024, rngs=nnx.Rngs(0))
        assert_matches(nnx.jit(lambda m, x: m(x))(n_ours, x), n_stock(x))
        # the fused residual add, a float32 residual stream
        r = random(rng, x.shape, jnp.float32)
        _check_add(jax.jit(lambda v, x, r: ours.apply(v, x, residual=r))(v, x, r),
                   stock_add(lambda s: stock.apply(v, s), x, r))
        _check_add(jax.jit(jax.vmap(jax.vmap(lambda x, r: e_ours(x, residual=r))))(x, r),
                   stock_add(jax.vmap(jax.vmap(e_stock)), x, r))
        _check_add(nnx.jit(lambda m, x, r: m(x, residual=r))(n_ours, x, r), stock_add(n_stock, x, r))
