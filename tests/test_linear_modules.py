"""Flax linen ``Dense``, NNX ``Linear`` and Equinox ``Linear``: drop-in compatibility with the stock
modules, the fused ``activation``, the stock computation for what only it serves, and the CUDA
lowering of a module.

Checkpoint compatibility: the stock module's parameters load into ours (same pytree paths,
shapes, dtypes; equal seeds draw equal parameters) and outputs and gradients agree within the
result dtype's tolerance.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numerics import (
    assert_close,
    assert_matches,
    assert_trees_match,
    perturbed_stock_checkpoint,
    random,
    same_tree,
)
from test_linear import kernel_targets, lower_cuda

import cutelayers as cl
from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx

HIGHEST = jax.lax.Precision.HIGHEST
NORMAL = nn.initializers.normal(1.0)  # a non-zero bias, so that the bias path is compared
LEADING = [(), (7,), (2, 5, 3)]


def with_leading(cases):
    """Each case with one leading shape of the input, cycling through LEADING: the op folds the
    leading dims into rows whatever the module's options, so a case need not run all three; the
    input dtype is a separate parameter, so every (input dtype, leading shape) pair still runs."""
    return [(case, LEADING[i % len(LEADING)]) for i, case in enumerate(cases)]


def assert_equal_leaves(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(u, v)


def weighted_sum(y):
    """A scalar loss whose cotangent (fixed weights in [0.5, 1.5]) is the same for our module and
    the stock one: the gradients then differ by the backward's rounding only. A nonlinear loss
    (sin of the output) would feed the output's own rounding back as O(eps · |y|) cotangent error."""
    weights = jax.random.uniform(jax.random.key(y.size), y.shape, minval=0.5, maxval=1.5)
    return jnp.sum(weights * y.astype(jnp.float32))


# --- linen ---------------------------------------------------------------------------------------

LINEN_CASES = [
    {},
    {"use_bias": False},
    {"bias_init": NORMAL, "param_dtype": jnp.bfloat16},
    {"bias_init": NORMAL, "dtype": jnp.bfloat16},
    {"bias_init": NORMAL, "dtype": jnp.float16, "param_dtype": jnp.bfloat16},
    {"bias_init": NORMAL, "precision": HIGHEST, "kernel_init": nn.initializers.xavier_uniform()},
]


@pytest.mark.parametrize("kwargs, lead", with_leading(LINEN_CASES))
@pytest.mark.parametrize("xdtype", [jnp.bfloat16, jnp.float32])
def test_linen_dense_drop_in(kwargs, lead, xdtype, rng):
    stock, ours = nn.Dense(24, **kwargs), cl_linen.Dense(24, **kwargs)
    x = random(rng, (*lead, 48), xdtype)
    variables = stock.init(jax.random.key(0), x)
    ours_init = ours.init(jax.random.key(0), x)
    same_tree(variables, ours_init)
    assert_equal_leaves(variables, ours_init)
    ref = stock.apply(variables, x)
    assert_matches(ours.apply(variables, x), ref)

    def loss(m):
        return lambda v, x: weighted_sum(m.apply(v, x))

    # gradients are no more precise than the compute dtype (the output's)
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(variables, x)
    assert_trees_match(grads, jax.grad(loss(stock), argnums=(0, 1))(variables, x), ref.dtype)


@pytest.mark.parametrize("activation,stock_fn", [("gelu", nn.gelu), (jax.nn.relu, nn.relu), (jnp.sin, jnp.sin)])
def test_linen_dense_activation(activation, stock_fn, rng):
    x = random(rng, (4, 9, 32), jnp.bfloat16)
    dense = cl_linen.Dense(16, param_dtype=jnp.bfloat16, bias_init=NORMAL, activation=activation)
    variables = dense.init(jax.random.key(1), x)
    ref = stock_fn(nn.Dense(16, param_dtype=jnp.bfloat16).apply(variables, x).astype(jnp.float32))
    assert_matches(dense.apply(variables, x), ref.astype(jnp.bfloat16))


@pytest.mark.cute
def test_linen_dense_lowers_to_the_gemm_kernels_for_cuda():
    S = jax.ShapeDtypeStruct
    dense = cl_linen.Dense(256, dtype=jnp.bfloat16, activation="gelu")
    x = S((4, 256, 128), jnp.bfloat16)  # float32 parameters: fewer rows would go to XLA (test_linear)
    variables = jax.eval_shape(dense.init, jax.random.key(0), x)

    def loss(v, x):  # not linear in the output, so the forward stays live
        return jnp.sum(jnp.square(dense.apply(v, x).astype(jnp.float32)))

    assert kernel_targets(lower_cuda(dense.apply, variables, x)) == ["linear_fwd"]
    assert kernel_targets(lower_cuda(jax.grad(loss, (0, 1)), variables, x)) == [
        "linear_fwd", "linear_dx", "linear_dkernel"]


# --- nnx -----------------------------------------------------------------------------------------

NNX_CASES = [
    {},
    {"use_bias": False},
    {"bias_init": NORMAL, "param_dtype": jnp.bfloat16},
    {"bias_init": NORMAL, "dtype": jnp.bfloat16, "preferred_element_type": jnp.bfloat16},
    {"bias_init": NORMAL, "precision": HIGHEST, "kernel_metadata": {"note": "checkpointed"}},
]


@pytest.mark.parametrize("kwargs, lead", with_leading(NNX_CASES))
@pytest.mark.parametrize("xdtype", [jnp.bfloat16, jnp.float32])
def test_nnx_linear_drop_in(kwargs, lead, xdtype, rng):
    stock = nnx.Linear(48, 24, rngs=nnx.Rngs(0), **kwargs)
    # equal Rngs draw equal parameters ...
    assert_equal_leaves(nnx.state(stock, nnx.Param),
                 nnx.state(cl_nnx.Linear(48, 24, rngs=nnx.Rngs(0), **kwargs), nnx.Param))
    # ... and the stock module's parameters load into ours
    ours = cl_nnx.Linear(48, 24, rngs=nnx.Rngs(1), **kwargs)
    state = nnx.state(stock, nnx.Param)
    same_tree(state, nnx.state(ours, nnx.Param))
    nnx.update(ours, state)
    assert ours.kernel.get_metadata() == stock.kernel.get_metadata()
    x = random(rng, (*lead, 48), xdtype)
    ref = stock(x)
    assert_matches(ours(x), ref)

    def loss(m, x):
        return weighted_sum(m(x))

    grads = nnx.grad(loss, argnums=(0, 1))(ours, x)
    assert_trees_match(grads, nnx.grad(loss, argnums=(0, 1))(stock, x), ref.dtype)


def test_nnx_linear_activation_and_jit(rng):
    x = random(rng, (3, 5, 32), jnp.float32)
    ours = cl_nnx.Linear(32, 16, activation=jax.nn.silu, bias_init=NORMAL, rngs=nnx.Rngs(0))
    stock = nnx.Linear(32, 16, bias_init=NORMAL, rngs=nnx.Rngs(0))
    assert_matches(nnx.jit(lambda m, x: m(x))(ours, x), jax.nn.silu(stock(x)))


def _dot_general(*args, **kwargs):
    return jax.lax.dot_general(*args, **kwargs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64])
def test_stock_options_keep_activation_and_residual(dtype, rng):
    """Where only the stock computation serves an argument (a custom dot_general, complex
    parameters), ``activation`` and ``residual`` still apply, after it; backend 'cute' refuses such
    a call with an error naming the argument."""
    x, r = random(rng, (3, 8), dtype), random(rng, (3, 4), dtype)
    dense = cl_linen.Dense(4, dot_general_cls=lambda: _dot_general, activation="tanh")
    variables = dense.init(jax.random.key(0), x)
    linear = cl_nnx.Linear(8, 4, dot_general=_dot_general, activation="tanh", rngs=nnx.Rngs(0))
    eqx_linear = cl_eqx.Linear(8, 4, dtype=jnp.complex64, activation="tanh", key=jax.random.key(0))
    cases = {
        "linen": (lambda x, r: dense.apply(variables, x, residual=r), nn.Dense(4).apply(variables, x)),
        "nnx": (lambda x, r: linear(x, residual=r), nnx.Linear(8, 4, rngs=nnx.Rngs(0))(x)),
        "equinox": (jax.vmap(lambda x, r: eqx_linear(x, residual=r)),
                    jax.vmap(eqx.nn.Linear(8, 4, dtype=jnp.complex64, key=jax.random.key(0)))(x)),
    }
    for name, (call, stock) in cases.items():
        out = call(x, r)
        assert out.dtype == stock.dtype, name
        np.testing.assert_allclose(out, jnp.tanh(stock) + r.astype(stock.dtype), rtol=1e-5, atol=1e-5)
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match="Linear: backend 'cute' .*dot_general is"):
        linear(x)


# --- equinox -------------------------------------------------------------------------------------

EQX_CASES = [
    (48, 24, {}),
    (48, 24, {"use_bias": False}),
    (48, 24, {"dtype": jnp.bfloat16}),
    ("scalar", 24, {}),
    (48, "scalar", {}),
    ("scalar", "scalar", {"dtype": jnp.bfloat16}),
]


@pytest.mark.parametrize("n_in,n_out,kwargs", EQX_CASES)
@pytest.mark.parametrize("xdtype", [jnp.bfloat16, jnp.float32])
def test_equinox_linear_drop_in(n_in, n_out, kwargs, xdtype, rng):
    stock = eqx.nn.Linear(n_in, n_out, **kwargs, key=jax.random.key(3))
    ours = cl_eqx.Linear(n_in, n_out, **kwargs, key=jax.random.key(3))
    same_tree(stock, ours)
    assert_equal_leaves(stock, ours)  # equal keys draw equal arrays
    stock, ours = perturbed_stock_checkpoint(stock, ours, rng)
    assert_equal_leaves(stock, ours)

    x_shape = () if n_in == "scalar" else (n_in,)
    x = random(rng, (4, 3, *x_shape), xdtype)
    ref = jax.vmap(jax.vmap(stock))(x)
    # |W| |x| + |b|: the size of the terms; x @ W + b can cancel far below it (a scalar output
    # especially), and the stock module rounds its product before adding the bias
    terms = jax.vmap(jax.vmap(jax.tree.map(jnp.abs, stock)))(jnp.abs(x))
    out = jax.vmap(jax.vmap(ours))(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert_close(out, ref, ref.dtype, scale=2.0, scale_ref=terms)
    assert_close(ours(x[0, 0]), stock(x[0, 0]), ref.dtype, scale=2.0, scale_ref=terms[0, 0])

    def loss(m, x):
        return weighted_sum(jax.vmap(jax.vmap(m))(x))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(ours, x)
    # each leaf at its own dtype's tolerance: bfloat16 weights get bfloat16 gradients (rounded once)
    assert_trees_match(grads, eqx.filter_grad(loss)(stock, x))


def test_equinox_linear_activation_and_shape_check(rng):
    ours = cl_eqx.Linear(32, 16, activation="tanh", key=jax.random.key(0))
    stock = eqx.nn.Linear(32, 16, key=jax.random.key(0))
    x = random(rng, (6, 32), jnp.float32)
    assert_matches(jax.vmap(ours)(x), jnp.tanh(jax.vmap(stock)(x)))
    # a batch without vmap, a scalar layer's non-scalar input: Equinox's own errors
    with pytest.raises(TypeError, match="dot_general requires contracting dimensions"):
        ours(x)
    with pytest.raises(ValueError, match="x must have scalar shape"):
        cl_eqx.Linear("scalar", 4, key=jax.random.key(0))(jnp.ones((1,)))


# --- residual= (all three frameworks) -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_residual_is_added_after_the_activation(dtype, rng):
    """``layer(x, residual=r)`` == ``layer(x) + r`` in the result dtype, and its gradient reaches r
    (per example for Equinox's Linear, also under nested vmap)."""
    x = random(rng, (2, 3, 16), dtype)
    r = random(rng, (2, 3, 24), jnp.float32)  # another dtype on purpose: cast to the result's
    dense = cl_linen.Dense(24, activation="gelu", bias_init=NORMAL)
    variables = dense.init(jax.random.key(1), x)
    linear = cl_nnx.Linear(16, 24, activation="gelu", bias_init=NORMAL, rngs=nnx.Rngs(1))
    eqx_linear = cl_eqx.Linear(16, 24, activation="gelu", dtype=dtype, key=jax.random.key(1))
    calls = {
        "linen": (lambda x, r: dense.apply(variables, x, residual=r), lambda x: dense.apply(variables, x)),
        "nnx": (lambda x, r: linear(x, residual=r), linear),
        "equinox": (jax.vmap(jax.vmap(lambda x, r: eqx_linear(x, residual=r))), jax.vmap(jax.vmap(eqx_linear))),
    }
    for name, (with_residual, plain) in calls.items():
        out = with_residual(x, r)
        expected = plain(x)
        assert out.dtype == expected.dtype, name
        assert_matches(out, expected + r.astype(expected.dtype), dtype)
        grad_r = jax.grad(lambda r: jnp.sum(jnp.sin(with_residual(x, r).astype(jnp.float32))))(r)
        assert_matches(grad_r, jnp.cos(out.astype(jnp.float32)), dtype)
