"""mlp: values and gradients against float32 jnp, vmap compositions, errors, the CUDA lowering
(the activation derivative inside a GEMM's epilogue), and the kernels on the GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, random
from test_linear import lower_cuda, plain

import cutelayers as cl
from cutelayers.ops.linear import ACTIVATION_FUNCTIONS, GATED_ACTIVATIONS, LinearInputGrad
from cutelayers.ops.mlp import mlp

ACTS = list(ACTIVATION_FUNCTIONS)
HIGHEST = jax.lax.Precision.HIGHEST


def plain_mlp(x, w1, b1, w2, b2, residual, activation, saved_dtype=None):
    """The block in float32 with full-precision matmuls (two of test_linear's ``plain`` layers);
    ``saved_dtype`` evaluates act' at the pre-activation rounded as the op saves it, and the
    second layer reads h rounded as the op stores it."""
    h = plain(x, w1, b1, None, activation, saved_dtype)
    if saved_dtype is not None:
        h = h + jax.lax.stop_gradient(h.astype(saved_dtype).astype(jnp.float32) - h)
    return plain(h, w2, b2, residual)


def block_operands(rng, lead, k, h, n, dtype, biases=True, residual=True, param_dtype=None):
    """x (and the residual) in ``dtype``, the parameters in ``param_dtype`` (default: ``dtype``)."""
    param_dtype = param_dtype or dtype
    x = random(rng, (*lead, k), dtype)
    w1 = jnp.asarray(rng.standard_normal((k, h)) / np.sqrt(k), param_dtype)
    w2 = jnp.asarray(rng.standard_normal((h, n)) / np.sqrt(h), param_dtype)
    b1 = random(rng, (h,), param_dtype) if biases else None
    b2 = random(rng, (n,), param_dtype) if biases else None
    r = random(rng, (*lead, n), dtype) if residual else None
    return x, w1, b1, w2, b2, r


def check_block(rng, lead, k, h, n, dtype, activation, jit=True, param_dtype=None):
    args = block_operands(rng, lead, k, h, n, dtype, param_dtype=param_dtype)
    act = None if activation == "none" else activation
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (*lead, n)), jnp.float32)

    def loss(*a):
        return jnp.sum(mlp(*a[:5], activation=act, residual=a[5]).astype(jnp.float32) * weights)

    def loss_ref(*a):
        return jnp.sum(plain_mlp(*a, activation, saved_dtype=dtype) * weights)

    out = jax.jit(lambda *a: mlp(*a[:5], activation=act, residual=a[5]))(*args)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (*lead, n)
    assert_close(out, jax.jit(plain_mlp, static_argnums=6)(*args, activation), dtype, scale=3.0)
    grad = jax.grad(loss, argnums=tuple(range(6)))
    grads = (jax.jit(grad) if jit else grad)(*args)
    # One compiled reference (eager ops would each compile and autotune on a GPU).
    refs = jax.jit(jax.grad(loss_ref, argnums=tuple(range(6))))(*(jnp.asarray(a, jnp.float32) for a in args))
    for name, g, ref, primal in zip(("x", "w1", "b1", "w2", "b2", "residual"), grads, refs, args):
        assert g.dtype == primal.dtype and g.shape == primal.shape, name
        assert_close(g, ref, dtype, scale=3.0)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_values_and_grads_reference(activation, dtype, rng):
    check_block(rng, (2, 9), 64, 128, 32, dtype, activation)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_float32_params_reference(activation, rng):
    # mixed precision: bfloat16 x, float32 parameters, whose gradients come back float32
    if activation == "swiglu":
        check_gated_block(rng, (2, 9), 64, 128, 32, jnp.bfloat16, activation, param_dtype=jnp.float32)
    else:
        check_block(rng, (2, 9), 64, 128, 32, jnp.bfloat16, activation, param_dtype=jnp.float32)


def test_float16_and_unaligned_widths_take_the_reference(rng):
    check_block(rng, (5,), 24, 36, 16, jnp.float16, "gelu")  # H = 36: no kernels, same numbers


def test_hidden_grad_reference_is_the_activation_vjp(rng):
    # The dx family's activation-gradient epilogue, as its jnp reference states it, against
    # jax.vjp of the activation: (dz @ w2ᵀ) * act'(z) for every activation, and its second result
    # the activation's output act(z).
    dz = random(rng, (1, 40, 24), jnp.float32)
    w = random(rng, (1, 56, 24), jnp.float32)
    z = 3.0 * random(rng, (1, 40, 56), jnp.float32)
    for activation in ACTS[1:]:
        got, hidden = LinearInputGrad(activation).reference(dz, w, z)
        output, vjp = jax.vjp(ACTIVATION_FUNCTIONS[activation], z[0])
        want = vjp(jnp.matmul(dz[0], w[0].T, precision=HIGHEST))[0]
        assert_close(got[0], want, jnp.float32)
        assert_close(hidden[0], output, jnp.float32)


@pytest.mark.parametrize("activation", ["gelu", "swiglu", None])
def test_the_backward_keeps_the_preactivation_not_the_hidden_layer(activation, rng):
    # The residuals of the block's vjp: x, the parameters and one array of rows of the hidden
    # width -- z1 ((M, 2H) gated), from which the dh GEMM writes h = act(z1) again for dw2; without
    # an activation h itself (h = z1). Never both h and z1.
    m, k, h, n = 24, 64, 256, 32
    width = 2 * h if activation == "swiglu" else h
    x, w1, b1, w2, b2, r = block_operands(rng, (m,), k, width, n, jnp.bfloat16)
    w2 = w2[:h]
    _, vjp = jax.vjp(lambda *a: mlp(*a[:5], activation=activation, residual=a[5]), x, w1, b1, w2, b2, r)
    kept = sorted(leaf.shape for leaf in jax.tree_util.tree_leaves(vjp))
    assert kept == sorted([(m, k), (k, width), (m, width), (h, n), (width,), (n,)])


def test_no_biases_no_residual_and_callable_activation(rng):
    x, w1, _, w2, _, _ = block_operands(rng, (7,), 32, 64, 16, jnp.float32, biases=False, residual=False)
    assert_close(mlp(x, w1, None, w2, activation=jax.nn.relu), plain_mlp(x, w1, None, w2, None, None, "relu"),
                 jnp.float32)
    softplus = mlp(x, w1, None, w2, activation=jax.nn.softplus)
    z = jnp.matmul(x, w1, precision=HIGHEST)
    assert_close(softplus, jnp.matmul(jax.nn.softplus(z), w2, precision=HIGHEST), jnp.float32)


def test_vmap_compositions(rng):
    x, w1, b1, w2, b2, r = block_operands(rng, (3, 4, 5), 16, 32, 8, jnp.float32)
    ref = plain_mlp(x, w1, b1, w2, b2, r, "silu")
    out = jax.vmap(jax.vmap(lambda x, r: mlp(x, w1, b1, w2, b2, activation="silu", residual=r)))(x, r)
    assert_close(out, ref, jnp.float32)

    def loss(w1, x):
        return jnp.sum(mlp(x, w1, b1, w2, b2, activation="silu"))

    per_example = jax.vmap(jax.grad(loss), (None, 0))(w1, x)
    ref_grad = jax.vmap(jax.grad(lambda w1, x: jnp.sum(plain_mlp(x, w1, b1, w2, b2, None, "silu"))), (None, 0))(w1, x)
    assert per_example.shape == (3, *w1.shape)
    assert_close(per_example, ref_grad, jnp.float32)
    summed = jax.grad(lambda w1: jnp.sum(jax.vmap(lambda x: mlp(x, w1, b1, w2, b2, activation="silu"))(x)))(w1)
    assert_close(summed, ref_grad.sum(0), jnp.float32)


def test_bad_inputs_name_the_argument(rng):
    x, w1, b1, w2, b2, r = block_operands(rng, (4,), 16, 32, 8, jnp.float32)
    with pytest.raises(ValueError, match="'w2' must have shape \\(32, N\\)"):
        mlp(x, w1, b1, w2.T, b2)
    with pytest.raises(ValueError, match="'b2' must have shape \\(8,\\)"):
        mlp(x, w1, b1, w2, b1)
    with pytest.raises(ValueError, match="'residual' must have shape"):
        mlp(x, w1, b1, w2, b2, residual=r[:2])
    with pytest.raises(TypeError, match="the parameters must share one dtype .*; got .*'w2' bfloat16"):
        mlp(x, w1, b1, w2.astype(jnp.bfloat16), b2)
    with pytest.raises(TypeError, match="'w2' is required"):
        mlp(x, w1, b1)
    # the first layer's errors name mlp's own arguments, not fused_linear's 'kernel' / 'bias'
    with pytest.raises(ValueError, match=r"'b1' must have shape \(32,\)"):
        mlp(x, w1, b2, w2, b2)
    with pytest.raises(ValueError, match="'x' has 16 features .* but 'w1' expects K=8"):
        mlp(x, w1[:8], b1, w2, b2)
    with pytest.raises(TypeError, match="'w1' has dtype int32"):
        mlp(x, w1.astype(jnp.int32), b1, w2, b2)
    with pytest.raises(ValueError, match="unknown activation 'swish2'"):
        mlp(x, w1, b1, w2, b2, activation="swish2")


# --- gated blocks (swiglu / geglu) ------------------------------------------------------------------

def plain_gated_mlp(x, w1, b1, w2, b2, residual, activation, saved_dtype):
    """act(gate) * value between the layers, in float32; gate and value rounded as the op's
    fc1 output is (``saved_dtype``), h as its fc2 input is."""
    z = plain(x, w1, b1, None, "none", saved_dtype)
    gate, value = jnp.split(z, 2, axis=-1)
    h = ACTIVATION_FUNCTIONS[GATED_ACTIVATIONS[activation]](gate) * value
    h = h + jax.lax.stop_gradient(h.astype(saved_dtype).astype(jnp.float32) - h)
    return plain(h, w2, b2, residual)


def check_gated_block(rng, lead, k, h, n, dtype, activation, kernel_layout="kn", param_dtype=None):
    x, w1, b1, w2, b2, r = block_operands(rng, lead, k, 2 * h, n, dtype, param_dtype=param_dtype)
    w2 = w2[:h]
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (*lead, n)), jnp.float32)
    nk = kernel_layout == "nk"
    as_stored = lambda w: w.T if nk else w

    def loss(x, w1, b1, w2, b2, r):
        y = mlp(x, as_stored(w1), b1, as_stored(w2), b2, activation=activation, residual=r, kernel_layout=kernel_layout)
        return jnp.sum(y.astype(jnp.float32) * weights), y

    def loss_ref(*a):
        return jnp.sum(plain_gated_mlp(*a, activation, dtype) * weights)

    args = (x, w1, b1, w2, b2, r)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (*lead, n)
    f32 = tuple(jnp.asarray(a, jnp.float32) for a in args)
    assert_close(out, plain_gated_mlp(*f32, activation, dtype), dtype, scale=3.0)
    refs = jax.jit(jax.grad(loss_ref, argnums=tuple(range(6))))(*f32)
    for name, g, ref, primal in zip(("x", "w1", "b1", "w2", "b2", "residual"), grads, refs, args):
        assert g.dtype == primal.dtype and g.shape == primal.shape, name
        assert_close(g, ref, dtype, scale=3.0)


@pytest.mark.parametrize("activation", list(GATED_ACTIVATIONS))
@pytest.mark.parametrize("dtype,kernel_layout", [(jnp.bfloat16, "kn"), (jnp.float32, "kn"), (jnp.bfloat16, "nk")])
def test_gated_values_and_grads_reference(activation, dtype, kernel_layout, rng):
    check_gated_block(rng, (3, 5), 48, 40, 24, dtype, activation, kernel_layout)


def test_gated_block_checks_its_widths(rng):
    x, w1, b1, w2, b2, _ = block_operands(rng, (4,), 16, 30, 8, jnp.float32)
    with pytest.raises(ValueError, match="'swiglu' takes w1 with its gate and value halves"):
        mlp(x, w1[:, :29], b1[:29], w2, b2, activation="swiglu")
    with pytest.raises(ValueError, match="'w2' must have shape \\(15, N\\)"):
        mlp(x, w1, b1, w2, b2, activation="geglu")  # w2 must take H = 15 rows


@pytest.mark.cute
def test_gated_block_lowers_to_the_gemm_kernels():
    # fc1 (K -> 2H) and fc2 as kernels each way: nothing falls back under backend "cute"
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    avals = (S((256, 64), bf), S((64, 256), bf), S((256,), bf), S((128, 64), bf), S((64,), bf))

    def loss(*a):
        return jnp.sum(jnp.square(mlp(*a, activation="swiglu").astype(jnp.float32)))

    with cl.use_backend("cute"):
        hlo = lower_cuda(jax.grad(loss, tuple(range(5))), *avals)
    calls = [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]
    targets = sorted(line.split("@cutelayers_")[1].split("(")[0].rsplit("_", 1)[0] for line in calls)
    assert targets == ["linear_dkernel", "linear_dkernel", "linear_dx", "linear_dx", "linear_fwd", "linear_fwd"]
    # fc1 gates in its epilogue: h (256, 128) and the saved z (256, 256) from one launch; the dh
    # GEMM's epilogue reads z and writes both halves' gradients (256, 256) and h again (256, 128):
    # no XLA pass between
    gated = "(tensor<1x256x64xbf16>, tensor<1x64x256xbf16>, tensor<256xbf16>) -> (tensor<1x256x128xbf16>, tensor<1x256x256xbf16>)"
    assert sum(line.endswith(gated) for line in calls) == 1
    gated_grad = ("(tensor<1x256x64xbf16>, tensor<1x128x64xbf16>, tensor<1x256x256xbf16>) -> "
                  "(tensor<1x256x256xbf16>, tensor<1x256x128xbf16>)")
    assert sum(line.endswith(gated_grad) for line in calls) == 1
    assert "logistic" not in hlo  # silu and its derivative live in the kernels


def test_gated_block_takes_xla_where_the_hidden_width_is_not_whole_blocks(rng):
    # H = 40: not a multiple of GATED_BLOCK, so fc1 cannot hold matching gate and value blocks (the
    # reference runs under "auto": test_gated_values_and_grads_reference checks its values)
    x, w1, b1, w2, b2, _ = block_operands(rng, (4,), 16, 80, 8, jnp.bfloat16)
    with cl.use_backend("cute"), pytest.raises(RuntimeError, match="hidden width 40 is not a multiple of 64"):
        mlp(x, w1, b1, w2[:40], b2, activation="swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", list(GATED_ACTIVATIONS))
def test_gated_kernels_gpu(activation, rng):
    # fc1 gates in its epilogue: several tiles of rows and columns (H = 512: 8 blocks), a partial
    # row tile and 3 blocks (H = 192), decode rows split over a cluster (16 x 1024 -> 2 x 256), and
    # the (N, K) layout
    with cl.use_backend("cute"):
        check_gated_block(rng, (1000,), 256, 512, 256, jnp.bfloat16, activation)
        check_gated_block(rng, (2, 4111), 128, 192, 64, jnp.bfloat16, activation)
        check_gated_block(rng, (16,), 1024, 256, 64, jnp.bfloat16, activation)
        check_gated_block(rng, (3, 7), 64, 128, 64, jnp.bfloat16, activation, "nk")


@pytest.mark.cute
def test_lowering_fuses_the_activation_derivative():
    # Forward: fc1 (storing z1) and fc2. Backward: the dh GEMM reads z1 (three operands: the
    # activation derivative is in its epilogue), dx, two weight gradients -- and no separate pass.
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    # test_mlp_modules.py's shapes: the modules' MLPs lower to these kernels
    avals = (S((200, 128), bf), S((128, 256), bf), S((256,), bf), S((256, 64), bf), S((64,), bf), S((200, 64), bf))

    def loss(*a):
        return jnp.sum(jnp.square(mlp(*a[:5], activation="gelu", residual=a[5]).astype(jnp.float32)))

    cl.clear_cache()
    hlo = lower_cuda(jax.grad(loss, tuple(range(6))), *avals)
    calls = [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]
    targets = sorted(line.split("@cutelayers_")[1].split("(")[0].rsplit("_", 1)[0] for line in calls)
    assert targets == ["linear_dkernel", "linear_dkernel", "linear_dx", "linear_dx", "linear_fwd", "linear_fwd"]
    # dh's epilogue: dz1 and h = gelu(z1) again, for dw2 (h is not saved by the forward)
    hidden_signature = ("(tensor<1x200x64xbf16>, tensor<1x256x64xbf16>, tensor<1x200x256xbf16>) -> "
                        "(tensor<1x200x256xbf16>, tensor<1x200x256xbf16>)")
    assert sum(line.endswith(hidden_signature) for line in calls if "@cutelayers_linear_dx" in line) == 1
    assert "tanh" not in hlo  # gelu's derivative lives in the kernel, not in an XLA fusion
    # db1 and db2 are the weight-gradient launches' second results: no reduction over the rows
    assert not [line for line in hlo.splitlines() if "stablehlo.reduce" in line and "200x" in line]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "gelu_exact"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kernels_gpu(activation, dtype, rng):
    with cl.use_backend("cute"):
        check_block(rng, (1000,), 256, 1024, 256, dtype, activation)
        check_block(rng, (3, 7), 64, 128, 64, dtype, activation)


@pytest.mark.gpu
def test_float32_params_kernels_gpu(rng):
    # the weight-gradient kernels storing float32: whole tiles, and GPT-2's widths (stream-K into
    # float32 zeros) -- plain and gated
    with cl.use_backend("cute"):
        check_block(rng, (1000,), 256, 1024, 256, jnp.bfloat16, "gelu", param_dtype=jnp.float32)
        check_block(rng, (16384,), 768, 3072, 768, jnp.bfloat16, "gelu", param_dtype=jnp.float32)
        check_gated_block(rng, (1000,), 256, 512, 256, jnp.bfloat16, "swiglu", param_dtype=jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_layout_nk_matches_kn(dtype, rng):
    x, w1, b1, w2, b2, r = block_operands(rng, (6, 7), 32, 64, 48, dtype)
    f_nk = lambda x, w1, w2: mlp(x, w1, b1, w2, b2, residual=r, kernel_layout="nk")
    f_kn = lambda x, w1, w2: mlp(x, w1, b1, w2, b2, residual=r)
    assert_close(f_nk(x, w1.T, w2.T), f_kn(x, w1, w2), dtype)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
    got = jax.grad(loss(f_nk), (0, 1, 2))(x, w1.T, w2.T)
    want = jax.grad(loss(f_kn), (0, 1, 2))(x, w1, w2)
    for g, w in zip((got[0], got[1].T, got[2].T), want):
        assert_close(g, w, dtype, scale=3.0)
    with pytest.raises(ValueError, match=r"'w2' must have shape \(N, 64\)"):
        mlp(x, w1.T, b1, w2, b2, kernel_layout="nk")


@pytest.mark.gpu
def test_kernel_layout_nk_gpu(rng):
    x, w1, b1, w2, b2, r = block_operands(rng, (1000,), 256, 1024, 256, jnp.bfloat16)
    with cl.use_backend("cute"):
        f_nk = jax.jit(jax.value_and_grad(lambda x, w1, w2: jnp.sum(jnp.sin(
            mlp(x, w1, b1, w2, b2, residual=r, kernel_layout="nk").astype(jnp.float32))), (0, 1, 2)))
        f_kn = jax.jit(jax.value_and_grad(lambda x, w1, w2: jnp.sum(jnp.sin(
            mlp(x, w1, b1, w2, b2, residual=r).astype(jnp.float32))), (0, 1, 2)))
        (v_nk, g_nk), (v_kn, g_kn) = f_nk(x, w1.T, w2.T), f_kn(x, w1, w2)
    np.testing.assert_allclose(v_nk, v_kn, rtol=1e-2)
    for g, w in zip((g_nk[0], g_nk[1].T, g_nk[2].T), g_kn):
        assert_close(g, w, jnp.bfloat16, scale=3.0)
