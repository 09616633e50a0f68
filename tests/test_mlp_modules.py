"""``MLP`` modules (Flax linen, Flax NNX, Equinox) against a stock two-layer MLP built from the
framework's own Dense / Linear layers: the same parameter tree (a stock MLP's parameters load
unchanged; equal keys draw equal parameters), outputs and gradients within the compute dtype's
tolerance (bfloat16 / float32, with and without a residual, several leading shapes, Equinox under
``jax.vmap``), the stock computation for what the op cannot take, errors naming the argument,
and the CUDA lowering: one ``ops.mlp``, its hidden-gradient GEMM holding the activation's
derivative.
"""

import functools
from typing import Any

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
    least_precise,
    perturbed_stock_checkpoint,
    random,
    same_tree,
)
from test_linear import kernel_operand_counts, kernel_targets, lower_cuda
from test_linear_modules import assert_equal_leaves, weighted_sum

import cutelayers as cl
from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx
from cutelayers.ops.linear import ACTIVATION_FUNCTIONS, GATED_ACTIVATIONS

HIGHEST = jax.lax.Precision.HIGHEST
NORMAL = nn.initializers.normal(1.0)  # non-zero biases, so that the bias paths are compared
IN, HIDDEN, OUT = 48, 64, 24
LEADING = [(), (7,), (2, 5, 3)]
MLP_KERNELS = ["linear_dkernel", "linear_dkernel", "linear_dx", "linear_dx", "linear_fwd", "linear_fwd"]


def stock_activation(activation):
    """The function a stock MLP applies to its first layer's output for ``activation`` (a fused
    name, None, a callable, or a gated name: act(gate) * value of the output's two halves)."""
    if activation is None:
        return lambda h: h
    if activation in GATED_ACTIVATIONS:
        def gated(z, act=ACTIVATION_FUNCTIONS[GATED_ACTIVATIONS[activation]]):
            gate, value = jnp.split(z, 2, axis=-1)
            return act(gate) * value
        return gated
    return ACTIVATION_FUNCTIONS[activation] if isinstance(activation, str) else activation


def stock_fc1_features(activation, hidden_features):
    """A stock MLP's first-layer width: twice the hidden width for a gated activation."""
    return 2 * hidden_features if activation in GATED_ACTIVATIONS else hidden_features


def add_residual(y, residual):
    """``y + residual`` in y's dtype, as a stock block adds its residual (None: none)."""
    return y if residual is None else y + residual.astype(y.dtype)


# --- stock MLPs: the framework's own layers ---------------------------------------------------------

class StockLinenMLP(nn.Module):
    """A compact module calling ``nn.Dense`` twice: its layers are ``Dense_0`` and ``Dense_1``."""

    hidden_features: int
    features: int
    activation: Any = "gelu"
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    bias_init: Any = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x, residual=None):
        layer = {"use_bias": self.use_bias, "dtype": self.dtype, "param_dtype": self.param_dtype,
                 "precision": self.precision, "bias_init": self.bias_init}
        h = stock_activation(self.activation)(nn.Dense(stock_fc1_features(self.activation, self.hidden_features),
                                                       **layer)(x))
        return add_residual(nn.Dense(self.features, **layer)(h), residual)


class StockNnxMLP(nnx.Module):
    """Two ``nnx.Linear`` attributes, ``fc1`` and ``fc2``, built in that order."""

    def __init__(self, in_features, hidden_features, out_features, *, activation="gelu", rngs, **layer):
        self.fc1 = nnx.Linear(in_features, stock_fc1_features(activation, hidden_features), rngs=rngs, **layer)
        self.fc2 = nnx.Linear(hidden_features, out_features, rngs=rngs, **layer)
        self.activation = activation

    def __call__(self, x, residual=None):
        return add_residual(self.fc2(stock_activation(self.activation)(self.fc1(x))), residual)


class StockEqxMLP(eqx.Module):
    """Two ``eqx.nn.Linear`` fields, ``fc1`` and ``fc2``, from a key split in two."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    activation: Any = eqx.field(static=True)

    def __init__(self, in_features, hidden_features, out_features, use_bias=True, dtype=None, *,
                 activation="gelu", key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(in_features, stock_fc1_features(activation, hidden_features), use_bias, dtype, key=k1)
        self.fc2 = eqx.nn.Linear(hidden_features, out_features, use_bias, dtype, key=k2)
        self.activation = activation

    def __call__(self, x, residual=None):
        return add_residual(self.fc2(stock_activation(self.activation)(self.fc1(x))), residual)


# --- linen ---------------------------------------------------------------------------------------

# the Flax modules' options, shared by linen and nnx
FLAX_CASES = [
    {},
    {"use_bias": False},
    {"dtype": jnp.bfloat16, "bias_init": NORMAL},
    {"param_dtype": jnp.bfloat16, "bias_init": NORMAL},
    {"precision": HIGHEST, "bias_init": NORMAL},
]


def pairwise(cases):
    """Each case (a tuple of case arguments) in both input dtypes, with and without a residual,
    and one leading shape of the input: the residual alternates with the case and the dtype, so
    that every case, and every dtype, runs both ways (the residual is one add in the op's last
    epilogue, the same for every case); the leading shape cycles through LEADING with the case, so
    that every dtype runs every leading shape (the op folds them into rows whatever the options)."""
    return [pytest.param(*case, xdtype, (i + j) % 2 == 1, LEADING[i % len(LEADING)],
                         id=f"{i}-{jnp.dtype(xdtype).name}-{'residual' if (i + j) % 2 else 'no_residual'}")
            for i, case in enumerate(cases) for j, xdtype in enumerate((jnp.bfloat16, jnp.float32))]


@pytest.mark.parametrize("kwargs, xdtype, with_residual, lead", pairwise([(kwargs,) for kwargs in FLAX_CASES]))
def test_linen_mlp_matches_stock(kwargs, xdtype, with_residual, lead, rng):
    stock, ours = StockLinenMLP(HIDDEN, OUT, **kwargs), cl_linen.MLP(HIDDEN, OUT, **kwargs)
    x = random(rng, (*lead, IN), xdtype)
    r = random(rng, (*lead, OUT), xdtype) if with_residual else None
    variables = stock.init(jax.random.key(0), x)
    ours_init = ours.init(jax.random.key(0), x)
    same_tree(variables, ours_init)  # the stock MLP's parameters load into ours ...
    assert_equal_leaves(variables, ours_init)  # ... and equal keys draw equal ones
    ref = stock.apply(variables, x, r)
    assert_matches(jax.jit(ours.apply)(variables, x, r), ref)

    def loss(m, v, x, *r):
        return weighted_sum(m.apply(v, x, *r))

    args = (variables, x, r) if with_residual else (variables, x)
    argnums = tuple(range(1, 1 + len(args)))  # parameters, input and residual
    grads = jax.jit(jax.grad(loss, argnums), static_argnums=0)(ours, *args)
    assert_trees_match(grads, jax.grad(loss, argnums)(stock, *args), ref.dtype)


# --- nnx -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, xdtype, with_residual, lead", pairwise([(kwargs,) for kwargs in FLAX_CASES]))
def test_nnx_mlp_matches_stock(kwargs, xdtype, with_residual, lead, rng):
    stock = StockNnxMLP(IN, HIDDEN, OUT, rngs=nnx.Rngs(0), **kwargs)
    params = nnx.state(stock, nnx.Param)
    assert_equal_leaves(params, nnx.state(cl_nnx.MLP(IN, HIDDEN, OUT, rngs=nnx.Rngs(0), **kwargs), nnx.Param))
    ours = cl_nnx.MLP(IN, HIDDEN, OUT, rngs=nnx.Rngs(1), **kwargs)
    same_tree(params, nnx.state(ours, nnx.Param))
    nnx.update(ours, params)  # the stock MLP's state loads into ours
    x = random(rng, (*lead, IN), xdtype)
    r = random(rng, (*lead, OUT), xdtype) if with_residual else None
    ref = stock(x, r)
    assert_matches(nnx.jit(lambda m, x, r: m(x, r))(ours, x, r), ref)

    def loss(m, x, *r):
        return weighted_sum(m(x, *r))

    args = (x, r) if with_residual else (x,)
    argnums = tuple(range(1 + len(args)))
    assert_trees_match(nnx.grad(loss, argnums=argnums)(ours, *args),
                       nnx.grad(loss, argnums=argnums)(stock, *args), ref.dtype)


# --- equinox -------------------------------------------------------------------------------------

EQX_CASES = [
    (IN, OUT, {}),
    (IN, OUT, {"use_bias": False}),
    (IN, OUT, {"dtype": jnp.bfloat16}),
    ("scalar", "scalar", {}),
]


def vmapped(module, n):
    """``module`` under ``n`` nested ``jax.vmap`` s (the Equinox way to batch)."""
    for _ in range(n):
        module = jax.vmap(module)
    return module


def call_vmapped(module, n, *args):
    """``module(*args)`` batched over the ``n`` leading axes of every argument."""
    return vmapped(module, n)(*args)


@eqx.filter_grad
def vmapped_grad(module_and_args, n):
    """Gradients of a weighted sum of the module's outputs, as a pair (module, args)."""
    module, args = module_and_args
    return weighted_sum(call_vmapped(module, n, *args))


def input_grad_terms(stock, y, x_shape):
    """A bound on the size of the terms the input gradient of the (Equinox, gelu) block sums, per
    element: |dy| |W2| |W1| max|gelu'|, with dy the cotangent :func:`weighted_sum` gives ``y``."""
    dy = np.abs(np.asarray(jax.grad(weighted_sum)(jnp.asarray(y, jnp.float32)), np.float64))
    w1, w2 = (np.abs(np.asarray(layer.weight, np.float64)) for layer in (stock.fc1, stock.fc2))
    return (dy.reshape(-1, w2.shape[0]) @ w2 @ w1 * 1.13).reshape(x_shape)  # |gelu'| <= 1.13


@pytest.mark.parametrize("n_in, n_out, kwargs, xdtype, with_residual, lead", pairwise(EQX_CASES))
def test_equinox_mlp_matches_stock_under_vmap(n_in, n_out, kwargs, xdtype, with_residual, lead, rng):
    stock = StockEqxMLP(n_in, HIDDEN, n_out, **kwargs, key=jax.random.key(3))
    ours = cl_eqx.MLP(n_in, HIDDEN, n_out, **kwargs, key=jax.random.key(3))
    same_tree(stock, ours)
    assert_equal_leaves(stock, ours)  # equal keys draw equal arrays
    stock, ours = perturbed_stock_checkpoint(stock, ours, rng)  # a stock checkpoint restored into ours
    x_shape = () if n_in == "scalar" else (n_in,)
    out_shape = () if n_out == "scalar" else (n_out,)
    x = random(rng, (*lead, *x_shape), xdtype)
    r = random(rng, (*lead, *out_shape), xdtype) if with_residual else None
    args = (x, r) if with_residual else (x,)
    ref = call_vmapped(stock, len(lead), *args)
    assert_matches(eqx.filter_jit(call_vmapped)(ours, len(lead), *args), ref)
    # each leaf at its own dtype's tolerance and the output's
    (module_grads, arg_grads) = eqx.filter_jit(vmapped_grad)((ours, args), len(lead))
    (stock_module_grads, stock_arg_grads) = vmapped_grad((stock, args), len(lead))
    assert_trees_match(module_grads, stock_module_grads, ref.dtype)
    assert_trees_match(arg_grads[1:], stock_arg_grads[1:], ref.dtype)  # the residual's: the cotangent
    # Each element of x's gradient sums terms over the hidden layer, which can cancel: a scalar
    # x's gradient is only such sums, one per example (one value without leading axes), so it
    # is measured against the size of those terms; a vector x's against its own norm.
    terms = input_grad_terms(stock, ref, x.shape) if n_in == "scalar" else None
    assert_close(arg_grads[0], np.asarray(stock_arg_grads[0], np.float32), least_precise(x.dtype, ref.dtype),
                 scale=5.0, scale_ref=terms)


# --- activations, and the stock computation (all three frameworks) -------------------------------

def framework_calls(activation, dtype=None):
    """{framework: (ours(x, residual), stock(x, residual))} of equal parameters, float32."""
    x = jnp.zeros((1, IN), dtype or jnp.float32)
    linen_stock = StockLinenMLP(HIDDEN, OUT, activation=activation, bias_init=NORMAL)
    variables = linen_stock.init(jax.random.key(0), x)
    linen_ours = cl_linen.MLP(HIDDEN, OUT, activation=activation, bias_init=NORMAL)
    nnx_kwargs = {"activation": activation, "bias_init": NORMAL}
    eqx_kwargs = {"dtype": dtype, "activation": activation, "key": jax.random.key(0)}
    return {
        "linen": (lambda x, r: linen_ours.apply(variables, x, r),
                  lambda x, r: linen_stock.apply(variables, x, r)),
        "nnx": (cl_nnx.MLP(IN, HIDDEN, OUT, **nnx_kwargs, rngs=nnx.Rngs(0)),
                StockNnxMLP(IN, HIDDEN, OUT, **nnx_kwargs, rngs=nnx.Rngs(0))),
        "equinox": (jax.vmap(cl_eqx.MLP(IN, HIDDEN, OUT, **eqx_kwargs)),
                    jax.vmap(StockEqxMLP(IN, HIDDEN, OUT, **eqx_kwargs))),
    }


@pytest.mark.parametrize("activation", ["relu", "silu", "gelu_exact", None, jax.nn.gelu, jnp.sin, "swiglu", "geglu"])
def test_activations(activation, rng):
    """Fused names and ``jax.nn`` functions, None, a callable the GEMM epilogue cannot fuse, and
    the gated blocks (a first layer of twice the hidden width: gate and value halves)."""
    x, r = random(rng, (5, IN), jnp.float32), random(rng, (5, OUT), jnp.float32)
    def loss(f, x, r):
        return weighted_sum(f(x, r))

    for ours, stock in framework_calls(activation).values():
        assert_matches(ours(x, r), stock(x, r))
        grad = jax.grad(loss, (1, 2))
        assert_trees_match(grad(ours, x, r), grad(stock, x, r), jnp.float32)


def test_complex_input_runs_the_stock_computation(rng):
    """What the op cannot take (complex) runs the stock layers, activation and residual included;
    backend 'cute' refuses such a call with an error naming the module and the reason."""
    dtype = jnp.complex64
    x = (random(rng, (3, IN), jnp.float32) + 1j * random(rng, (3, IN), jnp.float32)).astype(dtype)
    r = random(rng, (3, OUT), jnp.float32).astype(dtype)
    for name, (ours, stock) in framework_calls("tanh", dtype).items():
        out, ref = ours(x, r), stock(x, r)
        assert out.dtype == ref.dtype == dtype, name
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
        with cl.use_backend("cute"), pytest.raises(RuntimeError, match="MLP: backend 'cute' .*complex64"):
            ours(x, r)


# --- bad arguments -------------------------------------------------------------------------------

def test_bad_arguments_name_the_argument():
    x = jnp.ones((2, IN))
    for make in (lambda a, h: cl_linen.MLP(h, OUT, activation=a).init(jax.random.key(0), x),
                 lambda a, h: cl_nnx.MLP(IN, h, OUT, activation=a, rngs=nnx.Rngs(0)),
                 lambda a, h: cl_eqx.MLP(IN, h, OUT, activation=a, key=jax.random.key(0))):
        with pytest.raises(ValueError, match="MLP: argument 'activation' must be None, one of 'relu'"):
            make("swish2", HIDDEN)
        with pytest.raises(TypeError, match="MLP: argument 'activation' must be .*or a callable; got 3"):
            make(3, HIDDEN)
        with pytest.raises(ValueError, match="MLP: argument 'hidden_features' must be a positive integer"):
            make("gelu", 0)
    with pytest.raises(ValueError, match="MLP: argument 'features' must be a positive integer; got '8'"):
        cl_linen.MLP(HIDDEN, "8").init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="MLP: argument 'in_features' must be a positive"):
        cl_nnx.MLP(-1, HIDDEN, OUT, rngs=nnx.Rngs(0))
    # call arguments: the op names them
    with pytest.raises(ValueError, match=r"mlp: argument 'residual' must have shape \(2, 24\); got"):
        cl_nnx.MLP(IN, HIDDEN, OUT, rngs=nnx.Rngs(0))(x, jnp.ones((2, OUT - 1)))
    with pytest.raises(ValueError, match="mlp: argument 'x' has 47 features"):
        cl_nnx.MLP(IN, HIDDEN, OUT, rngs=nnx.Rngs(0))(jnp.ones((2, IN - 1)))


# --- CUDA lowering: one ops.mlp --------------------------------------------------------------------

@pytest.mark.cute
def test_modules_lower_to_the_mlp_kernels_for_cuda():
    """Each framework's bfloat16 MLP, differentiated, lowers (backend 'cute': no fallback anywhere)
    to the op's six GEMMs: fc1 (storing the pre-activation) and fc2 forward; the hidden gradient
    with gelu's derivative in its epilogue (three operands), dx, and two weight gradients."""
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    x, r = S((4, 50, 128), bf16), S((4, 50, 64), bf16)
    linen = cl_linen.MLP(256, 64, dtype=bf16)
    variables = jax.eval_shape(linen.init, jax.random.key(0), x)
    nnx_mlp = nnx.eval_shape(lambda: cl_nnx.MLP(128, 256, 64, dtype=bf16, rngs=nnx.Rngs(0)))
    nnx_graph, nnx_params = nnx.split(nnx_mlp)
    eqx_params, eqx_static = eqx.partition(eqx.filter_eval_shape(cl_eqx.MLP, 128, 256, 64, dtype=bf16,
                                                                 key=jax.random.key(0)),
                                           lambda leaf: isinstance(leaf, S))
    applies = {
        "linen": (linen.apply, variables),
        "nnx": (lambda p, x, r: nnx.merge(nnx_graph, p)(x, r), nnx_params),
        "equinox": (lambda p, x, r: jax.vmap(jax.vmap(eqx.combine(p, eqx_static)))(x, r), eqx_params),
    }
    def loss(apply, p, x, r):  # not linear in the output, so the forward stays live
        return jnp.sum(jnp.square(apply(p, x, r).astype(jnp.float32)))

    cl.clear_cache()
    for name, (apply, params) in applies.items():
        with cl.use_backend("cute"):
            hlo = lower_cuda(jax.grad(functools.partial(loss, apply), (0, 1, 2)), params, x, r)
        assert sorted(kernel_targets(hlo)) == MLP_KERNELS, name
        assert sorted(kernel_operand_counts(hlo, "linear_dx")) == [2, 3], name
        assert "tanh" not in hlo, name  # gelu and its derivative live in the GEMM epilogues
