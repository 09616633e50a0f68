"""fused_linear: values, gradients, vmap/jit/grad, activation resolution, errors, CUDA lowering.

CPU runs the reference lowering of the same op (so the custom_vjp / vmap plumbing and the
backward decomposition are checked against jax.grad of plain jnp); the lowering tests compile the
CuTe kernels for sm_90a without a GPU; `gpu` tests run the kernels.
"""

import dataclasses
import functools
import json
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import built, kept_ptx_env, ptxas_report
from numerics import assert_close, random

import cutelayers as cl
from cutelayers.kernels.gemm_config import (
    CONFIGS,
    EXTRA_CONFIGS,
    PERSISTENT_SMS,
    SMEM_CAPACITY,
    SPLIT_K_CONFIGS,
    STREAM_K_CONFIG,
    GemmConfig,
    config_class,
    decode_split_config,
    decode_stream_k_pays,
    stream_k_pays,
    stream_k_workspace_pays,
)
from cutelayers.ops.linear import (
    ACTIVATION_FUNCTIONS,
    MIXED_PRECISION_KERNEL_ROWS,
    LinearForward,
    LinearInputGrad,
    LinearWeightGrad,
    exp_logits,
    exp_logits_fix,
    fused_linear,
    input_grad_fn,
    kernels_apply,
    resolve_activation,
)
from cutelayers.runtime.family import Halves
from cutelayers.runtime.sharding import kernel_call

ACTS = list(ACTIVATION_FUNCTIONS)  # "none" first, then every fused activation
DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]
HIGHEST = jax.lax.Precision.HIGHEST


def plain(x, kernel, bias=None, residual=None, activation="none", saved_dtype=None):
    """act(x @ kernel + bias) + residual in float32 with full-precision matmul.

    ``saved_dtype``: evaluate act' at z rounded to that dtype, as the op's backward does with the z
    it saved (z keeps its unrounded gradient path). Without it, bf16 rounding that lands z exactly
    on a kink (hardswish at +-3) would make the comparison depend on where jax.grad puts ties.
    """
    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
    z = jnp.matmul(f32(x), f32(kernel), precision=HIGHEST)
    if bias is not None:
        z = z + jnp.broadcast_to(f32(bias), z.shape)
    if saved_dtype is not None:
        z = z + jax.lax.stop_gradient(z.astype(saved_dtype).astype(jnp.float32) - z)
    y = ACTIVATION_FUNCTIONS[activation](z)
    return y if residual is None else y + f32(residual)


def operands(rng, lead, k, n, dtype, bias=True, residual=True):
    x = random(rng, (*lead, k), dtype)
    kernel = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    b = random(rng, (n,), dtype) if bias else None
    r = random(rng, (*lead, n), dtype) if residual else None
    return x, kernel, b, r


def check_values(rng, lead, k, n, dtype, activation, bias=True, residual=True):
    x, kernel, b, r = operands(rng, lead, k, n, dtype, bias, residual)
    out = fused_linear(x, kernel, b, activation=None if activation == "none" else activation, residual=r)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (*lead, n)
    assert_close(out, plain(x, kernel, b, r, activation), dtype, scale=2.0)


def check_grads(rng, lead, k, n, dtype, activation, scale=2.0, param_dtype=None):
    """Gradients of sum(sin(y)) w.r.t. x, kernel, bias, residual against the float32 formula;
    with ``param_dtype`` float32, of float32 parameters (mixed precision: their gradients come
    back float32)."""
    x, kernel, b, r = operands(rng, lead, k, n, dtype)
    if param_dtype is not None:
        kernel = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), param_dtype)
        b = random(rng, (n,), param_dtype)
    act = None if activation == "none" else activation

    def loss(x, kernel, b, r):
        return jnp.sum(jnp.sin(fused_linear(x, kernel, b, activation=act, residual=r).astype(jnp.float32)))

    def loss_ref(x, kernel, b, r):
        return jnp.sum(jnp.sin(plain(x, kernel, b, r, activation, saved_dtype=dtype)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, kernel, b, r)
    f32 = [jnp.asarray(a, jnp.float32) for a in (x, kernel, b, r)]
    refs = jax.grad(loss_ref, argnums=(0, 1, 2, 3))(*f32)
    for name, g, ref, primal in zip(("x", "kernel", "bias", "residual"), grads, refs, (x, kernel, b, r)):
        assert g.dtype == primal.dtype and g.shape == primal.shape, name
        assert_close(g, ref, dtype, scale=scale)


# --- values and gradients through the reference lowering (CPU) ---------------------------------------

SHAPES = [  # (leading shape, K, N): M in {1, 7, 128, 1000}; K/N = 100, 36 take the jnp fallback
    ((1,), 64, 64),
    ((7,), 128, 64),
    ((2, 64), 64, 128),
    ((1000,), 128, 1000),
    ((7,), 1000, 128),
    ((3, 5), 100, 36),
]
GRAD_SHAPES = [((7,), 64, 128), ((2, 64), 128, 64), ((3, 5), 100, 36)]


def reference_shapes(activation, shapes):
    """The shapes ``activation`` is checked at: every one for the plain and the gelu epilogue; for
    the others (the shape handling -- leading dims folded into rows, the jnp fallback for K or N
    not a multiple of 8 -- does not depend on the activation) one on the kernels' path, rows in
    two leading dims, and the fallback's, as the GPU tests spot-check them (gpu_rows)."""
    return shapes if activation in ("none", "gelu") else [s for s in shapes if len(s[0]) == 2]


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_reference(activation, dtype, rng):
    for lead, k, n in reference_shapes(activation, SHAPES):
        check_values(rng, lead, k, n, dtype, activation)


@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True)])
def test_optional_operands(bias, residual, rng):
    check_values(rng, (9,), 64, 128, jnp.bfloat16, "gelu", bias=bias, residual=residual)


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_reference(activation, dtype, rng):
    for lead, k, n in reference_shapes(activation, GRAD_SHAPES):
        check_grads(rng, lead, k, n, dtype, activation)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_float32_params_grads_reference(dtype, rng):
    # kernels' path (K, N multiples of 8) and the jnp fallback's (100 x 36)
    for lead, k, n in GRAD_SHAPES:
        check_grads(rng, lead, k, n, dtype, "gelu", param_dtype=jnp.float32)


@pytest.mark.parametrize("activation", ACTS)
def test_backward_formulas_exact_in_float32(activation, rng):
    # float32 saves z unrounded, so the decomposition must match jax.grad to float32 precision.
    x, kernel, b, r = operands(rng, (4, 6), 64, 32, jnp.float32)
    act = None if activation == "none" else activation
    with jax.default_matmul_precision("highest"):
        ours = jax.grad(lambda *a: jnp.sum(jnp.cos(fused_linear(*a[:3], activation=act, residual=a[3]))),
                        argnums=(0, 1, 2, 3))(x, kernel, b, r)
        ref = jax.grad(lambda *a: jnp.sum(jnp.cos(plain(*a, activation))), argnums=(0, 1, 2, 3))(x, kernel, b, r)
    for g, gr in zip(ours, ref):
        np.testing.assert_allclose(g, gr, rtol=2e-5, atol=2e-5)


def test_leading_shapes_and_empty_rows(rng):
    check_values(rng, (), 64, 64, jnp.bfloat16, "relu")  # x of rank 1
    check_values(rng, (2, 3, 4), 64, 64, jnp.float16, "silu")
    x = jnp.zeros((0, 3, 64), jnp.bfloat16)
    w = jnp.ones((64, 16), jnp.bfloat16)
    assert fused_linear(x, w, activation="gelu").shape == (0, 3, 16)
    g = jax.grad(lambda w: jnp.sum(fused_linear(x, w, activation="gelu").astype(jnp.float32)))(w)
    assert g.shape == w.shape and not np.any(np.asarray(g, np.float32))


# --- activation argument ------------------------------------------------------------------------------

@pytest.mark.parametrize("fn,name", [
    (jax.nn.relu, "relu"), (jax.nn.gelu, "gelu"), (functools.partial(jax.nn.gelu, approximate=False), "gelu_exact"),
    (jax.nn.silu, "silu"), (jax.nn.swish, "silu"), (jax.nn.sigmoid, "sigmoid"), (jnp.tanh, "tanh"),
    (jax.nn.tanh, "tanh"), (jax.nn.leaky_relu, "leaky_relu"), (jax.nn.hard_swish, "hardswish"),
])
def test_jax_functions_fuse(fn, name, rng):
    assert resolve_activation(fn) == (name, None)
    x, kernel, b, r = operands(rng, (5,), 64, 64, jnp.bfloat16)
    np.testing.assert_array_equal(fused_linear(x, kernel, b, activation=fn, residual=r),
                                  fused_linear(x, kernel, b, activation=name, residual=r))


def test_other_callable_runs_unfused_before_the_residual(rng):
    x, kernel, b, r = operands(rng, (6,), 64, 32, jnp.float32)
    fn = lambda z: jnp.sin(z) * 2
    assert resolve_activation(fn) == ("none", fn)
    out = fused_linear(x, kernel, b, activation=fn, residual=r)
    ref = fn(jnp.matmul(x, kernel, precision=HIGHEST) + b[None]) + r
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda k: jnp.sum(fused_linear(x, k, b, activation=fn, residual=r)))(kernel)
    g_ref = jax.grad(lambda k: jnp.sum(fn(jnp.matmul(x, k, precision=HIGHEST) + b[None]) + r))(kernel)
    np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_precision_reaches_every_xla_gemm():
    # float32 runs as XLA GEMMs: forward, dx and dkernel all take the requested precision
    x, kernel, b = jnp.ones((4, 16)), jnp.ones((16, 8)), jnp.ones((8,))
    loss = lambda x, k, b: jnp.sum(fused_linear(x, k, b, activation="gelu", precision="highest") ** 2)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, kernel, b))  # nested jaxprs included
    assert jaxpr.count("dot_general[") == 3
    assert jaxpr.count("precision=(Precision.HIGHEST, Precision.HIGHEST)") == 3


def test_kernel_eligibility():
    assert kernels_apply(jnp.bfloat16, 64, 4096) == (True, "")
    assert kernels_apply(jnp.float16, 1000, 8) == (True, "")
    assert not kernels_apply(jnp.float32, 64, 64)[0]
    assert "multiples of 8" in kernels_apply(jnp.bfloat16, 100, 64)[1]


# --- vmap / jit / grad compositions --------------------------------------------------------------------

def test_vmap_compositions(rng):
    x, kernel, b, r = operands(rng, (3, 4, 5), 64, 32, jnp.float32)

    def ours(x, kernel, b, r):
        return fused_linear(x, kernel, b, activation="gelu", residual=r)

    def ref(x, kernel, b, r):
        return plain(x, kernel, b, r, "gelu")

    tol = {"rtol": 1e-4, "atol": 1e-4}
    shared = (0, None, None, 0)
    with jax.default_matmul_precision("highest"):
        # nested vmap (folded into rows), including a non-leading axis
        np.testing.assert_allclose(jax.vmap(jax.vmap(ours, shared), shared)(x, kernel, b, r), ref(x, kernel, b, r), **tol)
        np.testing.assert_allclose(jax.vmap(ours, (1, None, None, 1), 1)(x, kernel, b, r), ref(x, kernel, b, r), **tol)
        # per-example kernel / bias: lax.map fallback
        kernels = jnp.stack([kernel, 2 * kernel, -kernel])
        np.testing.assert_allclose(jax.vmap(ours, (0, 0, None, 0))(x, kernels, b, r),
                                   jax.vmap(ref, (0, 0, None, 0))(x, kernels, b, r), **tol)


def _sin_loss(f):
    return lambda *args: jnp.sum(jnp.sin(f(*args).astype(jnp.float32)))


ARGS = (0, 1, 2, 3)  # x, kernel, bias, residual


def _assert_grads_close(got, ref, dtype):
    for g, gr in zip(got, ref):
        assert g.shape == gr.shape
        assert_close(g, gr, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_grad_vmap_compositions(dtype, rng):
    """grad(vmap) folds the batch before differentiating; vmap(grad) gives per-example gradients;
    nested vmaps, a non-leading axis and per-example kernels all match the float32 formula."""
    x, kernel, b, r = operands(rng, (3, 4, 5), 64, 32, dtype)
    f32 = [jnp.asarray(a, jnp.float32) for a in (x, kernel, b, r)]

    def ours(x, kernel, b, r):
        return fused_linear(x, kernel, b, activation="gelu", residual=r)

    def ref(x, kernel, b, r):
        return plain(x, kernel, b, r, "gelu", saved_dtype=dtype)

    shared = (0, None, None, 0)
    whole_batch = jax.grad(_sin_loss(ref), ARGS)(*f32)
    with jax.default_matmul_precision("highest"):
        # grad(vmap), jit(grad(vmap(vmap))), and a vmap over the non-leading axis: the shared
        # kernel's and bias's gradients are those of one call on the whole batch
        for grad_fn in (jax.grad(_sin_loss(jax.vmap(ours, shared)), ARGS),
                        jax.jit(jax.grad(_sin_loss(jax.vmap(jax.vmap(ours, shared), shared)), ARGS)),
                        jax.grad(_sin_loss(jax.vmap(ours, (1, None, None, 1), 1)), ARGS)):
            _assert_grads_close(grad_fn(x, kernel, b, r), whole_batch, dtype)
        # vmap(grad): per-example gradients of the shared kernel and bias
        per_example = jax.vmap(jax.grad(_sin_loss(ours), ARGS), shared)(x, kernel, b, r)
        assert per_example[1].shape == (3, 64, 32) and per_example[2].shape == (3, 32)
        per_example_ref = jax.vmap(jax.grad(_sin_loss(ref), ARGS), shared)(*f32)
        _assert_grads_close(per_example, per_example_ref, dtype)
        # vmap(vmap(grad)) and vmap(grad(vmap)): per outer example
        nested = jax.vmap(jax.vmap(jax.grad(_sin_loss(ours), 1), shared), shared)(x, kernel, b, r)
        nested_ref = jax.vmap(jax.vmap(jax.grad(_sin_loss(ref), 1), shared), shared)(*f32)
        _assert_grads_close([nested], [nested_ref], dtype)
        per_outer = jax.vmap(jax.grad(_sin_loss(jax.vmap(ours, shared)), ARGS), shared)(x, kernel, b, r)
        assert per_outer[1].shape == (3, 64, 32)
        _assert_grads_close(per_outer, per_example_ref, dtype)
        # per-example kernels under grad(vmap): one gradient per kernel
        kernels = jnp.stack([kernel, 2 * kernel, -kernel])
        per_kernel = (0, 0, None, 0)
        got = jax.grad(_sin_loss(jax.vmap(ours, per_kernel)), ARGS)(x, kernels, b, r)
        kernels32 = jnp.asarray(kernels, jnp.float32)
        want = jax.grad(_sin_loss(jax.vmap(ref, per_kernel)), ARGS)(f32[0], kernels32, *f32[2:])
        _assert_grads_close(got, want, dtype)


def test_grad_of_vmap_has_no_per_example_weight_grad(rng):
    # float32 runs the jnp decomposition: no (batch, K, N) value anywhere in the backward
    x, kernel, b, _ = operands(rng, (6, 10), 64, 32, jnp.float32, residual=False)
    loss = _sin_loss(jax.vmap(lambda x, k, b: fused_linear(x, k, b, activation="relu"), (0, None, None)))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, kernel, b))
    assert "f32[1,64,32] = dot_general" in jaxpr and "f32[6,64,32]" not in jaxpr  # L = 1: all rows


def test_float32_weight_grad_with_rows_sharded_over_an_explicit_mesh(rng):
    # float32's jnp dkernel sums over rows that the types shard (data parallel), for grad of the
    # op and of its vmap (folded into the same rows) alike
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices("cpu")[:4],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    x, kernel, b, _ = operands(rng, (4, 6), 64, 32, jnp.float32, residual=False)

    def layer(x, k, b):
        return fused_linear(x, k, b, activation="gelu")

    want = jax.grad(_sin_loss(layer), ARGS[:3])(x, kernel, b)
    with jax.set_mesh(mesh):
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        for f in (layer, jax.vmap(layer, (0, None, None))):
            got = jax.jit(jax.grad(_sin_loss(f), ARGS[:3]))(jax.device_put(x, rows), kernel, b)
            _assert_grads_close(got, want, jnp.float32)


# --- errors ------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    x = jnp.ones((4, 64), jnp.bfloat16)
    w = jnp.ones((64, 32), jnp.bfloat16)
    with pytest.raises(TypeError, match="'kernel' has dtype float16 but 'x' has bfloat16; the parameters must be "
                                        "in x's dtype, or float32 for a bfloat16 / float16 x"):
        fused_linear(x, w.astype(jnp.float16))
    with pytest.raises(TypeError, match="'kernel' has dtype bfloat16 but 'x' has float32"):
        fused_linear(x.astype(jnp.float32), w)
    with pytest.raises(TypeError, match="'x' has dtype int32"):
        fused_linear(jnp.ones((4, 64), jnp.int32), w)
    with pytest.raises(ValueError, match="'kernel' must have rank 2"):
        fused_linear(x, jnp.ones((64,), jnp.bfloat16))
    with pytest.raises(ValueError, match="'x' has 64 features .* 'kernel' expects K=32"):
        fused_linear(x, jnp.ones((32, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"'bias' must have shape \(32,\); got \(64,\)"):
        fused_linear(x, w, jnp.ones((64,), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"the parameters must share one dtype \(x's, or float32 for a bfloat16 / "
                                        r"float16 x\); got 'kernel' bfloat16, 'bias' float32"):
        fused_linear(x, w, jnp.ones((32,), jnp.float32))
    with pytest.raises(ValueError, match=r"'residual' must have shape \(4, 32\); got \(4, 64\)"):
        fused_linear(x, w, residual=jnp.ones((4, 64), jnp.bfloat16))
    with pytest.raises(TypeError, match="'residual' has dtype float16"):
        fused_linear(x, w, residual=jnp.ones((4, 32), jnp.float16))
    with pytest.raises(ValueError, match="unknown activation 'swishy'"):
        fused_linear(x, w, activation="swishy")
    with pytest.raises(TypeError, match="'activation' must be None, a name or a callable"):
        fused_linear(x, w, activation=3)
    with pytest.raises(ValueError, match="'x' has rank 0"):
        fused_linear(jnp.bfloat16(1.0), w)


# --- CUDA lowering on CPU: every kernel variant compiles for sm_90a ------------------------------------

def lower_cuda(f, *avals):
    return jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def kernel_targets(hlo: str) -> list[str]:
    """Kernel names of the custom calls, in order (the target name less its hash)."""
    return [line.split("@cutelayers_")[1].split("(")[0].rsplit("_", 1)[0]
            for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]


def zeros_filled_after_an_operand(hlo: str, call: str) -> int:
    """How many operands of the custom call ``call`` (a line of ``hlo``) are float32 / int32 fills
    of a zero that passed an optimization barrier with another of its operands (``ops._zeros``):
    fills XLA cannot schedule before that operand exists. Any other such fill fails the test."""
    defs = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(%[\w#]+)(?::\d+)? = (.*)$", hlo, re.MULTILINE)}
    operands = re.search(r"\(([^()]*)\)", call.split("custom_call", 1)[1]).group(1).split(", ")
    count = 0
    for operand in operands:
        fill = re.match(r"stablehlo\.broadcast_in_dim (%\w+)#0, dims = \[\] : \(tensor<[fi]32>\)", defs[operand])
        if fill is None:
            assert not re.match(r"stablehlo\.broadcast_in_dim .*: \(tensor<[fi]32>\)", defs[operand]), defs[operand]
            continue
        barrier = re.match(r"stablehlo\.optimization_barrier %\w+, (%\w+) :", defs[fill.group(1)])
        assert barrier and barrier.group(1) in operands, defs[fill.group(1)]
        count += 1
    return count


def kernel_operand_counts(hlo: str, name: str) -> list[int]:
    """Operand counts of the custom calls of kernel ``name`` (e.g. "linear_dx"), in order: the
    hidden-gradient GEMM of an MLP is the linear_dx call with three (dz, kernel, pre-activation)."""
    pattern = rf"stablehlo\.custom_call @cutelayers_{name}_[0-9a-f]+\(([^)]*)\)"
    return [len(operands.split(",")) for operands in re.findall(pattern, hlo)]


# (rows, K, N) picking each config class
CLASS_SHAPES = {"small_m": (48, 256, 512), "default": (1000, 256, 512), "wide": (4096, 2048, 512)}


def test_class_shapes_pick_their_config():
    assert set(CLASS_SHAPES) == set(CONFIGS)
    for name, (m, k, n) in CLASS_SHAPES.items():
        assert config_class(m, n, k) == name


@pytest.mark.cute
def test_persistent_grid_keeps_the_rounds_on_the_fewest_clusters():
    # Every cluster-tile count, against a wave of 66 two-CTA clusters (the H100's): the balanced
    # grid takes as many rounds as the full wave would, no cluster fewer could, and never more
    # clusters than tiles.
    from cutelayers.kernels.gemm import balanced_clusters

    assert balanced_clusters(0, 66) == 0
    for tiles in range(1, 3 * 66 * 16):
        clusters = balanced_clusters(tiles, 66)
        rounds = -(-tiles // 66)
        assert 1 <= clusters <= min(tiles, 66), tiles
        assert -(-tiles // clusters) == rounds, tiles
        assert clusters == 1 or -(-tiles // (clusters - 1)) > rounds, tiles
    # 8192 x 16384 in 256 x 256 cluster tiles: 32 rounds on 64 clusters, four whole rows of the
    # 16-column rasterization group each
    assert balanced_clusters(32 * 64, 66) == 64


def full_targets(hlo: str) -> list[str]:
    """FFI targets of the custom calls, in order, with their hash: one per distinct compile key."""
    return re.findall(r"stablehlo\.custom_call @(cutelayers_\w+?)\(", hlo)


def kernel_name_of(target: str) -> str:
    """A target's kernel name: ``cutelayers_linear_fwd_<hash>`` -> ``linear_fwd``."""
    return target.removeprefix("cutelayers_").rsplit("_", 1)[0]


def _lower_fwd_and_bwd(config, dtype, activation, plain_forward=True):
    """The training step's kernels (the forward storing z, dx, dkernel) and, with
    ``plain_forward``, the inference forward's; their FFI targets."""
    m, k, n = CLASS_SHAPES[config]
    S = jax.ShapeDtypeStruct
    avals = (S((m, k), dtype), S((k, n), dtype), S((n,), dtype), S((m, n), dtype))
    act = None if activation == "none" else activation

    def fwd(x, w, b, r):
        return fused_linear(x, w, b, activation=act, residual=r)

    def loss(x, w, b, r):  # not linear in y, so the forward stays live
        return jnp.sum(jnp.square(fwd(x, w, b, r).astype(jnp.float32)))

    plain = full_targets(lower_cuda(fwd, *avals)) if plain_forward else []
    assert [kernel_name_of(t) for t in plain] == (["linear_fwd"] if plain_forward else [])
    step = full_targets(lower_cuda(jax.grad(loss, (0, 1, 2, 3)), *avals))
    assert [kernel_name_of(t) for t in step] == ["linear_fwd", "linear_dx", "linear_dkernel"]
    return plain, step


LOWERED_DTYPES = [jnp.bfloat16, jnp.float16]


def lowering_case(activation):
    """(config class, dtype) test_lowering_every_activation lowers ``activation`` in: classes
    cycle by three and dtypes by two, so the nine activations cover every pair."""
    index = ACTS.index(activation)
    return list(CONFIGS)[index % len(CONFIGS)], LOWERED_DTYPES[index % len(LOWERED_DTYPES)]


@pytest.fixture
def fresh_cache():
    cl.clear_cache()
    jax.clear_caches()
    yield
    cl.clear_cache()


# Activations whose inference forward (no z stored) is lowered too: one per config class, both
# dtypes. The epilogue applies an activation with the same code whether or not it also stores z
# (gemm.apply_activation), so every activation's code compiles in its z-saving forward, and
# the inference forward's epilogue (z not stored) with an activation compiles for these.
PLAIN_FORWARD_ACTS = ACTS[:len(CONFIGS) + 1]


@pytest.mark.cute
@pytest.mark.parametrize("activation", ACTS)
def test_lowering_every_activation(activation):
    # Each activation compiles its z-saving forward (PLAIN_FORWARD_ACTS: and its inference forward,
    # another kernel unless the activation is none) in one config class and dtype, plus dx and
    # dkernel (shared by the activations of a class and dtype: the kernel cache is not cleared).
    plain, (forward, *_) = _lower_fwd_and_bwd(*lowering_case(activation), activation,
                                              plain_forward=activation in PLAIN_FORWARD_ACTS)
    if plain:
        assert (plain[0] == forward) == (activation == "none")


def test_plain_forward_acts_cover_every_config_class_and_dtype():
    assert {lowering_case(a)[0] for a in PLAIN_FORWARD_ACTS} == set(CONFIGS)
    assert {lowering_case(a)[1] for a in PLAIN_FORWARD_ACTS if a != "none"} == set(LOWERED_DTYPES)


def test_activations_lower_every_config_class_in_every_dtype():
    assert {lowering_case(activation) for activation in ACTS} == {(c, d) for c in CONFIGS for d in LOWERED_DTYPES}


@pytest.mark.cute
def test_lowering_compiles_once_across_row_counts_and_batches(fresh_cache):
    S = jax.ShapeDtypeStruct

    def loss(x, w, b):
        return jnp.sum(jax.vmap(lambda x: fused_linear(x, w, b, activation="relu"))(x).astype(jnp.float32))

    grad = jax.grad(loss, (0, 1, 2))
    for batch, rows in ((2, 300), (3, 500), (5, 129)):  # all "default" class
        lower_cuda(grad, S((batch, rows, 128), jnp.bfloat16), S((128, 256), jnp.bfloat16), S((256,), jnp.bfloat16))
    info = cl.cache_info()
    assert built(info["linear_fwd"]) == 1 and built(info["linear_dx"]) == 1
    assert built(info["linear_dkernel"]) == 1


@pytest.mark.cute
def test_lowering_grad_of_vmap_is_one_weight_grad_on_all_rows(fresh_cache):
    # The Equinox style, grad(vmap(layer)) with a shared kernel (vmapped over two axes): one dkernel
    # launch contracting all 6 * 4 * 25 rows into (K, N) = (128, 256), no per-example (6, 128, 256).
    # (test_mlp.py's fc1: the same three kernels, compiled once for both.)
    S = jax.ShapeDtypeStruct

    def layer(x, w, b):
        return fused_linear(x, w, b, activation="gelu")

    loss = _sin_loss(jax.vmap(jax.vmap(layer, (0, None, None)), (0, None, None)))
    hlo = lower_cuda(jax.grad(loss, (0, 1, 2)), S((6, 4, 25, 128), jnp.bfloat16), S((128, 256), jnp.bfloat16),
                     S((256,), jnp.bfloat16))
    assert kernel_targets(hlo) == ["linear_fwd", "linear_dx", "linear_dkernel"]
    (call,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    # (x, dz, zeros for the bias gradient) -> (dkernel, dbias as float32 column sums)
    assert call.endswith("(tensor<1x600x128xbf16>, tensor<1x600x256xbf16>, tensor<1x256xf32>) -> "
                         "(tensor<1x128x256xbf16>, tensor<1x256xf32>)")
    assert "6x128x256" not in hlo


@pytest.mark.cute
@pytest.mark.parametrize("kernel_nk", [False, True], ids=["kn", "nk"])
def test_lowering_bias_grad_comes_from_the_weight_grad_kernel(kernel_nk, fresh_cache):
    # dbias is the dkernel GEMM's second result (dz summed over the rows by its idle producer
    # warps, A of dzᵀ @ x for an (N, K) kernel): no reduction over the (M, N) dz in XLA. Stream-K
    # shapes -- GPT-2's qkv (27 cluster tiles: the partial tiles meet in a workspace, the gradient
    # comes out in the kernel's dtype) and attention output (9 cluster tiles: added into float32
    # zeros, then cast) -- and a whole-tile one.
    S = jax.ShapeDtypeStruct
    layout = "nk" if kernel_nk else "kn"
    for m, k, n, stream_k in ((16384, 768, 2304, "workspace"), (16384, 768, 768, "zeros"), (300, 64, 136, None)):
        assert stream_k_pays(k, n, m) == (stream_k is not None)
        assert stream_k_workspace_pays(k, n) == (stream_k == "workspace") or stream_k is None
        grad = jax.grad(lambda x, w, b: jnp.sum(jnp.sin(fused_linear(x, w, b, kernel_layout=layout)
                                                        .astype(jnp.float32))), (1, 2))
        hlo = lower_cuda(grad, S((m, k), jnp.bfloat16), S((n, k) if kernel_nk else (k, n), jnp.bfloat16),
                         S((n,), jnp.bfloat16))
        (call,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
        assert call.count(f"tensor<1x{n}xf32>") == 2  # zeros in, sums out
        assert "output_operand_aliases" in call
        assert zeros_filled_after_an_operand(hlo, call) == (2 if stream_k else 1)  # + the flags / the zeros
        dkernel = f"tensor<1x{n if kernel_nk else k}x{k if kernel_nk else n}x{'f32' if stream_k == 'zeros' else 'bf16'}>"
        scratch = ", tensor<[0-9]+x[0-9]+xf32>, tensor<[0-9]+xi32>" if stream_k == "workspace" else ""
        assert re.search(rf"-> \({dkernel}, tensor<1x{n}xf32>{scratch}\)$", call), call
        assert not [line for line in hlo.splitlines() if "stablehlo.reduce" in line and f"{m}x" in line]


@pytest.mark.cute
def test_lowering_float32_params_gradients(fresh_cache):
    # float32 parameters of a bfloat16 layer: dbias is the kernel's float32 sums as they are; so is
    # dkernel where stream-K adds into float32 zeros (attention output's shape); elsewhere (whole
    # tiles; qkv's stream-K workspace) the kernel stores bfloat16 and a convert follows, which XLA
    # fuses into the gradient's readers (2 bytes a weight to read, not 4 to write and 4 to read)
    S = jax.ShapeDtypeStruct
    for m, k, n, path in ((300, 64, 136, "tiles"), (16384, 768, 2304, "workspace"), (16384, 768, 768, "zeros")):
        assert stream_k_pays(k, n, m) == (path != "tiles")
        assert stream_k_workspace_pays(k, n) == (path == "workspace") or path == "tiles"
        grad = jax.grad(lambda x, w, b: jnp.sum(jnp.sin(fused_linear(x, w, b).astype(jnp.float32))), (1, 2))
        with cl.use_backend("cute"):  # 300 rows would go to XLA under auto
            hlo = lower_cuda(grad, S((m, k), jnp.bfloat16), S((k, n), jnp.float32), S((n,), jnp.float32))
        (call,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
        stored = "f32" if path == "zeros" else "bf16"
        assert re.search(rf"-> \(tensor<1x{k}x{n}x{stored}>, tensor<1x{n}xf32>", call), call
        converts = [line for line in hlo.splitlines() if "stablehlo.convert" in line]
        widened = [line for line in converts if f"x{k}x{n}xbf16>) -> tensor<1x{k}x{n}xf32>" in line]
        assert len(widened) == (path != "zeros"), widened
        assert not [line for line in converts if f"-> tensor<1x{n}xf32>" in line or f"-> tensor<{n}xf32>" in line]
        # the forward's cast of the float32 kernel for the GEMMs
        assert [line for line in converts if f"(tensor<{k}x{n}xf32>) -> tensor<{k}x{n}xbf16>" in line]


@pytest.mark.cute
def test_lowering_vmapped_weight_grad_is_one_batched_launch(fresh_cache):
    S = jax.ShapeDtypeStruct
    per_example = jax.vmap(jax.grad(lambda x, w: jnp.sum(fused_linear(x, w, activation="silu").astype(jnp.float32)), 1),
                           (0, None))
    hlo = lower_cuda(per_example, S((6, 100, 64), jnp.bfloat16), S((64, 128), jnp.bfloat16))
    calls = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    assert len(calls) == 1 and "tensor<6x64x128xbf16>" in calls[0]


def test_fallback_sizes_lower_no_kernel(fresh_cache):
    S = jax.ShapeDtypeStruct
    hlo = lower_cuda(lambda x, w: fused_linear(x, w, activation="gelu"), S((8, 100), jnp.bfloat16), S((100, 64), jnp.bfloat16))
    assert kernel_targets(hlo) == [] and "dot_general" in hlo


def test_float32_params_at_decode_rows_lower_to_xla(fresh_cache, caplog, monkeypatch):
    # Float32 parameters of few rows: XLA fuses their cast into its GEMM, so "auto" lowers the
    # reference (logged once) and "cute" keeps the kernels; from MIXED_PRECISION_KERNEL_ROWS rows
    # on, or with parameters in x's dtype, the kernels run. The GEMM ops decide alike (the LM head,
    # a loss over many tokens, does not: its chunked design is for memory).
    monkeypatch.setattr(cl.backend, "_logged", set())
    S = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    few, many = S((4, 16, 256), bf), S((MIXED_PRECISION_KERNEL_ROWS, 256), bf)
    ops = {
        "fused_linear": (lambda x, w, b: fused_linear(x, w, b, activation="gelu"), ((256, 512), (512,))),
        "mlp": (lambda x, w1, w2: cl.ops.mlp(x, w1, None, w2, None), ((256, 512), (512, 256))),
        "split_linear": (lambda x, w: cl.ops.split_linear(x, w, parts=2), ((256, 512),)),
    }
    for name, (f, shapes) in ops.items():
        params = [S(shape, f32) for shape in shapes]
        with caplog.at_level("WARNING", logger="cutelayers"):
            assert kernel_targets(lower_cuda(f, few, *params)) == [], name
        assert f"{name}: float32 parameters at fewer than {MIXED_PRECISION_KERNEL_ROWS} rows" in caplog.text
        with cl.use_backend("cute"):
            assert kernel_targets(lower_cuda(f, few, *params)), name
        assert kernel_targets(lower_cuda(f, few, *(S(shape, bf) for shape in shapes))), name
        assert kernel_targets(lower_cuda(f, many, *params)), name


def test_exp_logits_reference(rng):
    # exp(x @ kernel) in x's dtype and its float32 sums over 64-column blocks (the last one
    # partial), as the reference computes them where the kernel cannot run
    x = random(rng, (37, 64), jnp.bfloat16)
    w = jnp.asarray(0.2 * random(rng, (64, 200), jnp.float32), jnp.bfloat16)
    e, sums = jax.jit(exp_logits)(x, w)
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert e.dtype == jnp.bfloat16 and e.shape == (37, 200) and sums.dtype == jnp.float32
    assert_close(e, np.exp(z), jnp.bfloat16)
    want = np.pad(np.exp(z), ((0, 0), (0, 56))).reshape(37, 4, 64).sum(-1)
    assert_close(sums, want, jnp.float32, scale=10.0)
    # a vocabulary padded for TMA: past the first 150 columns e is 0 and nothing is summed
    e, sums = jax.jit(functools.partial(exp_logits, columns=150))(x, w)
    kept = np.where(np.arange(200) < 150, np.exp(z), 0.0)
    assert_close(e, kept, jnp.bfloat16)
    assert np.all(np.asarray(e[:, 150:]) == 0)
    assert_close(sums, np.pad(kept, ((0, 0), (0, 56))).reshape(37, 4, 64).sum(-1), jnp.float32, scale=10.0)


@pytest.mark.cute
def test_lowering_exp_logits(fresh_cache):
    # one GEMM with two results: exp(logits) in bf16 and the (M, ceil(N / 64)) float32 row sums
    S = jax.ShapeDtypeStruct
    hlo = lower_cuda(exp_logits, S((300, 128), jnp.bfloat16), S((128, 1000), jnp.bfloat16))
    (call,) = [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_linear_fwd" in line]
    assert "-> (tensor<1x300x1000xbf16>, tensor<1x300x16xf32>)" in call, call


def exp_fix_expected(x, w, e, flags, labels, shift):
    """What :func:`exp_logits_fix` gives on its flagged rows, in float64: (e, sums, block max,
    label entries), e being the given e on the other rows."""
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) - np.asarray(shift, np.float64)[:, None]
    m, n = z.shape
    blocks = -(-n // 64)

    def per_block(a, fill):  # (m, blocks, 64): the last block filled out with ``fill``
        return np.pad(a, ((0, 0), (0, blocks * 64 - n)), constant_values=fill).reshape(m, blocks, 64)

    new = np.exp(np.minimum(z, 80.0))
    at_label = np.where(np.arange(n)[None] == np.asarray(labels)[:, None], z, -np.inf)
    return (np.where(np.asarray(flags)[:, None] != 0, new, np.asarray(e, np.float64)),
            per_block(new, 0.0).sum(-1), per_block(z, -np.inf).max(-1), per_block(at_label, -np.inf).max(-1))


def exp_fix_operands(rng, m, k, n, flagged):
    """x, w (logits of about +-3, the flagged rows' times 60: past the clamp), a first pass's e
    (7.0 everywhere: a row no pass wrote keeps it), flags at the rows ``flagged``, labels (-1 in
    every fifth row: no column), the flagged rows' max logit as their shift (0 for the others)."""
    x = random(rng, (m, k), jnp.float32)
    x = x.at[jnp.asarray(flagged)].multiply(60.0).astype(jnp.bfloat16)
    w = jnp.asarray(random(rng, (k, n), jnp.float32) * 3.0 / k**0.5, jnp.bfloat16)
    flags = jnp.zeros(m, jnp.int32).at[jnp.asarray(flagged)].set(1)
    labels = jnp.asarray(rng.integers(0, n, m), jnp.int32).at[::5].set(-1)
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    shift = jnp.asarray(np.where(np.asarray(flags) != 0, z.max(axis=1), 0.0), jnp.float32)
    return x, w, jnp.full((m, n), 7.0, jnp.bfloat16), flags, labels, shift


def check_exp_fix(results, x, w, e, flags, labels, shift, whole_tiles: bool):
    """The flagged rows' results against float64; the others' e is the given e, or (``whole_tiles``:
    the kernel runs whole tiles) that or their own pass's."""
    want = exp_fix_expected(x, w, e, flags, labels, shift)
    got = [np.asarray(r, np.float64) for r in results]
    rows = np.flatnonzero(np.asarray(flags))
    assert_close(got[0][rows], want[0][rows], jnp.bfloat16)
    assert_close(got[1][rows], want[1][rows], jnp.float32, scale=100.0)
    for i in (2, 3):  # the blocks' max and label entries: the float32 accumulators, shifted
        finite = np.isfinite(want[i][rows])
        np.testing.assert_array_equal(np.isfinite(got[i][rows]), finite)
        np.testing.assert_allclose(got[i][rows][finite], want[i][rows][finite], rtol=1e-4, atol=1e-2)
    others = np.flatnonzero(np.asarray(flags) == 0)
    kept = np.all(got[0][others] == 7.0, axis=1)
    if whole_tiles:
        passed = np.exp(np.minimum(np.asarray(x, np.float64)[others] @ np.asarray(w, np.float64), 80.0))
        redone = np.all(np.abs(got[0][others] - passed) <= 2**-7 * np.abs(passed) + 1e-30, axis=1)
        assert np.all(kept | redone), others[~(kept | redone)]
    else:
        assert np.all(kept), others[~kept]


def test_exp_logits_fix_reference(rng):
    # the second pass over flagged rows, as the reference computes it where the kernel cannot run
    operands = exp_fix_operands(rng, 37, 64, 200, [0, 17, 36])
    results = jax.jit(exp_logits_fix)(*operands)
    assert [r.dtype for r in results] == [jnp.bfloat16] + [jnp.float32] * 3
    assert [r.shape for r in results] == [(37, 200)] + [(37, 4)] * 3
    check_exp_fix(results, *operands, whole_tiles=False)


@pytest.mark.cute
def test_lowering_exp_logits_fix(fresh_cache):
    # one GEMM writing e in place of its operand, and three (M, ceil(N / 64)) float32 results
    S = jax.ShapeDtypeStruct
    hlo = lower_cuda(exp_logits_fix, S((300, 128), jnp.bfloat16), S((128, 1000), jnp.bfloat16),
                     S((300, 1000), jnp.bfloat16), S((300,), jnp.int32), S((300,), jnp.int32), S((300,), jnp.float32))
    (call,) = [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_linear_exp_fix" in line]
    assert "output_operand_aliases" in call
    assert "-> (tensor<1x300x1000xbf16>, tensor<1x300x16xf32>, tensor<1x300x16xf32>, tensor<1x300x16xf32>)" in call


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,kernel_nk", [(1000, 256, 1000, False), (1000, 256, 1000, True),
                                             (333, 768, 50304, False), (4096, 128, 4104, True)])
def test_exp_logits_fix_gpu(m, k, n, kernel_nk, rng):
    # the kernel against float64 on its flagged rows -- in the first tile, mid-tile, the last row,
    # at a GPT-2 vocabulary and past a last tile reaching over N by whole blocks -- with either
    # kernel layout; a row in no flagged tile keeps the given e; none flagged: e as given
    x, w, e, flags, labels, shift = exp_fix_operands(rng, m, k, n, [0, m // 2 + 3, m - 1])
    fix = jax.jit(functools.partial(exp_logits_fix, kernel_nk=kernel_nk))
    table = w.T if kernel_nk else w
    with cl.use_backend("cute"):
        check_exp_fix(fix(x, table, e, flags, labels, shift), x, w, e, flags, labels, shift, whole_tiles=True)
        unflagged = fix(x, table, e, jnp.zeros_like(flags), labels, shift)
    np.testing.assert_array_equal(np.asarray(unflagged[0], np.float32), 7.0)


@pytest.mark.cute
def test_an_exp_row_sums_epilogue_with_a_bias_is_refused():
    # The exp epilogue is the LM head's logits, which have no bias: the kernel takes exp(A @ Bᵀ) only.
    from cutelayers.kernels.gemm import Epilogue

    with pytest.raises(ValueError, match=r"exp_row_sums=True takes no bias.*; got it with has_bias=True$"):
        Epilogue(has_bias=True, exp_row_sums=True)
    with pytest.raises(ValueError, match="exp_row_sums=True takes no bias"):
        LinearForward("none", True, False, False, exp_row_sums=True).epilogue()
    with pytest.raises(ValueError, match="exp_columns must be 0 or, with exp_row_sums=True, > 0; got 7"):
        Epilogue(exp_columns=7)


@pytest.mark.gpu
def test_exp_logits_gpu(rng):
    # the exp_row_sums epilogue against float64: rows past a tile, a last tile reaching past N by
    # whole 64-column blocks (4104 = 32 x 128 + 8), and a GPT-2 vocabulary
    with cl.use_backend("cute"):
        for m, k, n, columns in ((1000, 256, 1000, 0), (333, 768, 50304, 0), (4096, 128, 4104, 0),
                                 (333, 768, 50264, 50257), (333, 768, 50304, 50257),
                                 (1000, 256, 1024, 1001)):
            x = random(rng, (m, k), jnp.bfloat16)
            w = jnp.asarray(random(rng, (k, n), jnp.float32) * 3.0 / k**0.5, jnp.bfloat16)
            e, sums = jax.jit(functools.partial(exp_logits, columns=columns))(x, w)
            z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
            want = np.where(np.arange(n) < (columns or n), np.exp(z), 0.0)  # past the columns that count: 0
            blocks = -(-n // 64)
            assert_close(e, want, jnp.bfloat16)
            assert np.all(np.asarray(e[:, columns or n:]) == 0)
            assert_close(sums, np.pad(want, ((0, 0), (0, blocks * 64 - n))).reshape(m, blocks, 64).sum(-1),
                         jnp.float32, scale=100.0)


# --- on the GPU: the CuTe kernels themselves ------------------------------------------------------------

GPU_M = [1, 7, 128, 1000, 8192]
GPU_KN = [(64, 64), (64, 128), (128, 4096), (4096, 128), (4096, 4096)]
# Every activation shares the epilogue's loads and stores: the plain and the gelu epilogue run every
# row count at every (K, N), the others one row count at the (K, N) of each config class and tail.
GPU_SPOT_M = {(64, 128): [7], (128, 4096): [1000], (4096, 4096): [8192]}
GPU_DTYPES = ["bfloat16", "float16"]


def gpu_rows(activation, k, n):
    return GPU_M if activation in ("none", "gelu") else GPU_SPOT_M.get((k, n), [])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,k,n", [pytest.param(dtype, k, n, id=f"{dtype}-{k}x{n}")
                                       for dtype in GPU_DTYPES for k, n in GPU_KN])
def test_kernel_grads_gpu(dtype, k, n, rng):
    """Every activation's gradients at one (K, N), in one test: they share the dx and dkernel
    kernels (which do not depend on the activation; the row count is symbolic, so the row counts of
    a config class share one), which therefore compile once, not once per activation."""
    failures = []
    with cl.use_backend("cute"):
        for activation in ACTS:
            for m in gpu_rows(activation, k, n):
                try:
                    check_grads(rng, (m,), k, n, dtype, activation, scale=3.0)
                except AssertionError as e:  # the other activations still run; every failure is reported
                    failures.append(f"{activation}, M = {m}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,k,n,activation", [
    pytest.param(dtype, k, n, act, id=f"{dtype}-{k}x{n}-{act}")
    for dtype in GPU_DTYPES for k, n in GPU_KN for act in ACTS if gpu_rows(act, k, n)])
def test_kernel_values_gpu(dtype, k, n, activation, rng):
    with cl.use_backend("cute"):
        for m in gpu_rows(activation, k, n):
            check_values(rng, (m,), k, n, dtype, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_kernel_values_without_bias_or_residual_gpu(dtype, activation, rng):
    with cl.use_backend("cute"):
        check_values(rng, (3, 37), 128, 64, dtype, activation, bias=False, residual=False)


@pytest.mark.gpu
@pytest.mark.parametrize("lead,k,n", [((7,), 64, 128), ((1000,), 128, 4096), ((16384,), 768, 2304),
                                      ((16384,), 768, 768)], ids=["small", "tiles", "stream_k", "stream_k_few"])
def test_float32_params_grads_gpu(lead, k, n, rng):
    # float32 parameters: dkernel and dbias stored float32 by the weight-gradient kernel (whole
    # tiles; stream-K adding into float32 zeros)
    with cl.use_backend("cute"):
        check_grads(rng, lead, k, n, jnp.bfloat16, "gelu", scale=3.0, param_dtype=jnp.float32)


@pytest.mark.gpu
def test_kernel_vmap_and_per_example_grads_gpu(rng):
    x, kernel, b, r = operands(rng, (4, 300), 128, 256, jnp.bfloat16)
    with cl.use_backend("cute"):
        out = jax.vmap(lambda x, r: fused_linear(x, kernel, b, activation="gelu", residual=r))(x, r)
        per_example = jax.jit(jax.vmap(
            jax.grad(lambda x, k: jnp.sum(fused_linear(x, k, activation="gelu").astype(jnp.float32)), 1),
            (0, None)))(x, kernel)
    assert_close(out, plain(x, kernel, b, r, "gelu"), jnp.bfloat16, scale=2.0)
    ref = jax.vmap(jax.grad(lambda x, k: jnp.sum(plain(x, k, activation="gelu")), 1), (0, None))(
        x.astype(jnp.float32), kernel.astype(jnp.float32))
    assert_close(per_example, ref, jnp.bfloat16, scale=2.0)


# --- stream-K weight gradients --------------------------------------------------------------------------

def test_stream_k_is_chosen_for_small_weight_gradients():
    # GPT-2's layers at 16384 tokens: their (K, N) outputs are a few dozen 128x256 tiles.
    for k, n in ((768, 768), (768, 2304), (768, 3072), (3072, 768)):
        assert stream_k_pays(k, n, 16384), (k, n)
    assert not stream_k_pays(4096, 4096, 16384)  # 512 tiles: 3.9 waves of whole tiles
    assert not stream_k_pays(4096, 16384, 8192)  # 2048 tiles: the output fills the GPU
    assert not stream_k_pays(256, 512, 100)  # two k tiles: nothing to share
    assert not stream_k_pays(16, 4096, 4096)  # decode rows: 128-row tiles would be mostly padding
    assert stream_k_pays(768, 768, 4096, batch=2)  # a batch of outputs counts its tiles together
    assert not stream_k_pays(768, 768, 4096, batch=64)


def test_accumulating_reference_adds_into_the_accumulator(rng):
    x, dz = random(rng, (2, 40, 16), jnp.bfloat16), random(rng, (2, 40, 24), jnp.bfloat16)
    acc = random(rng, (2, 16, 24), jnp.float32)
    (out,) = LinearWeightGrad(accumulate=True, stream_k=True).reference(x, dz, acc)
    want = acc + jnp.einsum("lmk,lmn->lkn", x.astype(jnp.float32), dz.astype(jnp.float32), precision=HIGHEST)
    assert out.dtype == jnp.float32
    assert_close(out, want, jnp.float32, scale=10.0)


def test_stream_k_without_an_accumulator_has_flags_in_and_a_workspace_out(rng):
    # The partial tiles meet in a scratch workspace (one float32 tile a CTA), each announced by an
    # Int32 flag, which the kernel writes in place of its zeros operand: the gradient itself comes
    # out once, in x's dtype.
    x, dz = random(rng, (2, 40, 16), jnp.bfloat16), random(rng, (2, 40, 24), jnp.bfloat16)
    sums, flags = jnp.zeros((2, 24), jnp.float32), jnp.zeros((PERSISTENT_SMS,), jnp.int32)
    family = LinearWeightGrad(config=STREAM_K_CONFIG, stream_k=True, operand_sums="b")
    assert family.fixup and family.arg_names == ("x", "dz", "sums", "flags")
    # the sums and the flags are written in place of their zeros
    assert family.kept_outputs(4) == (0, 2) and family.operand_output_aliases() == {2: 1, 3: 3}
    avals = family.out_avals((x, dz, sums, flags))
    ctas = PERSISTENT_SMS // 2 * 2
    assert [(a.shape, a.dtype) for a in avals] == [((2, 16, 24), jnp.bfloat16), ((2, 24), jnp.float32),
                                                   ((ctas, 128 * 256), jnp.float32), ((PERSISTENT_SMS,), jnp.int32)]
    out, out_sums, workspace, out_flags = family.reference(x, dz, sums, flags)
    assert out.dtype == jnp.bfloat16 and workspace.shape == avals[2].shape and out_flags.shape == flags.shape
    want = jnp.einsum("lmk,lmn->lkn", x.astype(jnp.float32), dz.astype(jnp.float32), precision=HIGHEST)
    assert_close(out, want, jnp.bfloat16)
    assert_close(out_sums, jnp.sum(dz.astype(jnp.float32), axis=1), jnp.float32)


@pytest.mark.cute
def test_lowering_stream_k_weight_grad(fresh_cache):
    # 24 cluster tiles: the dkernel call's partial tiles meet in its workspace, announced by flags
    # filled with zeros once dz exists: the gradient comes out in the kernel's dtype, with no
    # float32 zeros to add into and no cast after.
    S = jax.ShapeDtypeStruct
    m, k, n = 4096, 768, 2048
    assert stream_k_pays(k, n, m) and stream_k_workspace_pays(k, n)
    grad = jax.grad(lambda x, w: jnp.sum(fused_linear(x, w).astype(jnp.float32) ** 2), 1)
    hlo = lower_cuda(grad, S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16))
    (call,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    ctas, elements = STREAM_K_CONFIG.stream_k_workspace
    assert call.endswith(f"(tensor<1x{m}x{k}xbf16>, tensor<1x{m}x{n}xbf16>, tensor<{PERSISTENT_SMS}xi32>) -> "
                         f"(tensor<1x{k}x{n}xbf16>, tensor<{ctas}x{elements}xf32>, tensor<{PERSISTENT_SMS}xi32>)")
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [2], operand_index = 2," \
        in call  # the flags, written in place
    assert zeros_filled_after_an_operand(hlo, call) == 1
    assert f"{k}x{n}xf32" not in hlo
    assert built(cl.cache_info()["linear_dkernel"]) == 1


@pytest.mark.cute
def test_lowering_stream_k_weight_grad_of_few_tiles_adds_into_zeros(fresh_cache):
    # 2 cluster tiles, each cut over ~33 clusters: the partial tiles are added into a zeroed
    # float32 buffer the call aliases; the gradient is that sum in the kernel's dtype. (The (K, N)
    # of the accumulating weight gradients below and of the tuned-config tests' forward: the same
    # kernels, compiled once.)
    S = jax.ShapeDtypeStruct
    m, k, n = 4096, 256, 512
    assert stream_k_pays(k, n, m) and not stream_k_workspace_pays(k, n)
    grad = jax.grad(lambda x, w: jnp.sum(fused_linear(x, w).astype(jnp.float32) ** 2), 1)
    hlo = lower_cuda(grad, S((m, k), jnp.bfloat16), S((k, n), jnp.bfloat16))
    (call,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    assert call.endswith(f"(tensor<1x{m}x{k}xbf16>, tensor<1x{m}x{n}xbf16>, tensor<1x{k}x{n}xf32>) -> "
                         f"tensor<1x{k}x{n}xf32>")
    assert "output_operand_aliases" in call and zeros_filled_after_an_operand(hlo, call) == 1
    assert built(cl.cache_info()["linear_dkernel"]) == 1


def test_stream_k_input_grad_reference_and_checks(rng):
    dz, w = random(rng, (1, 40, 24), jnp.bfloat16), random(rng, (1, 16, 24), jnp.bfloat16)
    (out,) = LinearInputGrad(stream_k=True).reference(dz, w, jnp.zeros((1, 40, 16), jnp.float32))
    want = jnp.matmul(dz[0].astype(jnp.float32), w[0].astype(jnp.float32).T, precision=HIGHEST)
    assert out.dtype == jnp.float32
    assert_close(out[0], want, jnp.float32, scale=10.0)
    with pytest.raises(ValueError, match="activation gradient"):
        LinearInputGrad("gelu", stream_k=True)


@pytest.mark.cute
def test_lowering_stream_k_input_grad(fresh_cache):
    # Few rows against a long contraction (an LM head chunk's dh): dx adds its stream-K partial
    # tiles into float32 zeros it aliases, then is cast to the input's dtype.
    S = jax.ShapeDtypeStruct
    m, k, n = 256, 256, 4096
    assert stream_k_pays(m, k, n)
    hlo = lower_cuda(input_grad_fn(True), S((m, n), jnp.bfloat16), S((k, n), jnp.bfloat16))
    (call,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dx" in line]
    assert call.endswith(f"(tensor<1x{m}x{n}xbf16>, tensor<1x{k}x{n}xbf16>, tensor<1x{m}x{k}xf32>) -> "
                         f"tensor<1x{m}x{k}xf32>")
    assert "output_operand_aliases" in call
    assert built(cl.cache_info()["linear_dx"]) == 1


# --- decode rows over a long contraction: the forward by stream-K ------------------------------------

def test_decode_stream_k_is_chosen_for_long_contractions_of_few_tiles():
    assert decode_stream_k_pays(16, 512, 16384)  # 8 split-K clusters of 4 (32 CTAs) streaming 16 MiB
    assert decode_stream_k_pays(1, 256, 8192)
    assert not decode_stream_k_pays(16, 1024, 16384)  # split-K's 64 CTAs
    assert not decode_stream_k_pays(16, 4096, 16384)  # split-K's 128 CTAs
    assert not decode_stream_k_pays(16, 512, 4096)  # K = 4096: the zeros and the epilogue pass lose
    assert not decode_stream_k_pays(16, 16384, 4096)  # 128 small_m tiles fill the GPU
    assert not decode_stream_k_pays(65, 512, 16384)  # not decode rows


def test_decode_gemms_split_their_contraction_where_tiles_are_few():
    S = jax.ShapeDtypeStruct

    def default(family, m, k, n, *extra):
        x, w = S((1, m, k), jnp.bfloat16), S((1, k, n), jnp.bfloat16)
        return family.default_config((x, w, *extra))

    def bias(n):
        return S((n,), jnp.bfloat16)

    split = {c.split_k: c for c in SPLIT_K_CONFIGS if c.tile_n == 64}
    # the most CTAs whose clusters (one a 64 x 64 tile) are resident at once, then 64 x 128 tiles
    forward = LinearForward("gelu", True, False, False)
    assert default(forward, 16, 4096, 1024, bias(1024)) == split[4]  # 16 clusters of 4
    assert default(forward, 16, 4096, 2048, bias(2048)) == split[3]  # 32 clusters: not of 4
    assert default(forward, 16, 4096, 4096, bias(4096)) == split[2]
    assert default(forward, 1, 4096, 6144, bias(6144)) == SPLIT_K_CONFIGS[-1]
    residual = LinearForward("none", True, True, False)
    assert default(residual, 64, 4096, 4096, bias(4096), S((1, 64, 4096), jnp.bfloat16)) == split[2]
    assert default(LinearInputGrad(), 16, 4096, 4096) == split[2]
    # whole tiles: many columns, many rows, or too short a contraction for a k tile per CTA
    assert default(forward, 16, 4096, 14336, bias(14336)) == CONFIGS["small_m"]
    assert default(forward, 65, 4096, 4096, bias(4096)).split_k == 1
    assert default(forward, 16, 64, 4096, bias(4096)) == CONFIGS["small_m"]
    # a shorter contraction splits over fewer CTAs
    assert decode_split_config(16, 1024, 511) == split[3] and decode_split_config(16, 1024, 383) == split[2]
    assert decode_split_config(16, 4096, 255) == SPLIT_K_CONFIGS[-1]
    assert decode_split_config(16, 6144, 127) is None


DECODE_LONG_K = (16, 8192, 456)  # (m, k, n): four small_m tiles, the last one partial


@pytest.mark.cute
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_decode_forward_over_a_long_contraction_lowers_to_stream_k(layout):
    # The stream-K kernel (the input gradient's, reading the kernel in the other layout) into
    # float32 zeros, then XLA's epilogue; under differentiation too (no fused forward).
    m, k, n = DECODE_LONG_K
    assert decode_stream_k_pays(m, n, k)
    S = jax.ShapeDtypeStruct
    avals = [S((m, k), jnp.bfloat16), S((n, k) if layout == "nk" else (k, n), jnp.bfloat16),
             S((n,), jnp.bfloat16), S((m, n), jnp.bfloat16)]

    def f(x, w, b, r):
        return fused_linear(x, w, b, activation="gelu", residual=r, kernel_layout=layout)

    with cl.use_backend("cute"):
        assert kernel_targets(lower_cuda(f, *avals)) == ["linear_dx"]
        grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))
        targets = kernel_targets(lower_cuda(grad, *avals))
    assert targets[0] == "linear_dx" and "linear_fwd" not in targets


def _check_decode_stream_k(rng):
    """The decode stream-K forward (bias, gelu and residual applied by XLA to the float32 sum):
    values and gradients against the fused formula, and the (N, K) kernel layout against the
    (K, N) one."""
    m, k, n = DECODE_LONG_K
    check_values(rng, (m,), k, n, jnp.bfloat16, "gelu")
    check_grads(rng, (m,), k, n, jnp.bfloat16, "gelu", scale=4.0)
    _nk_matches_kn(rng, (m,), k, n, jnp.bfloat16)


def test_decode_stream_k_forward_matches_the_fused_formula(rng):
    # on CPU each kernel call runs its family's reference: the op's decomposition
    _check_decode_stream_k(rng)


@pytest.mark.gpu
def test_decode_stream_k_forward_values_and_grads_gpu(rng):
    with cl.use_backend("cute"):
        _check_decode_stream_k(rng)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096, 768, 50304), (301, 256, 4096)], ids=["gpt2-head-chunk", "odd-rows"])
def test_stream_k_input_grad_gpu(m, k, n, rng):
    assert stream_k_pays(m, k, n)
    x, kernel, _, _ = operands(rng, (m,), k, n, jnp.bfloat16, bias=False, residual=False)
    dy = random(rng, (m, n), jnp.bfloat16)
    with cl.use_backend("cute"):
        dx = jax.jit(jax.grad(lambda x: jnp.sum(fused_linear(x, kernel).astype(jnp.float32) * dy)))(x)
    want = jnp.matmul(dy.astype(jnp.float32), kernel.astype(jnp.float32).T, precision=HIGHEST)
    assert dx.dtype == jnp.bfloat16
    assert_close(dx, want, jnp.bfloat16)


# every GEMM config adds into an accumulator (pingpong alternates whole tiles), the cooperative
# ones on the stream-K schedule too
ACCUMULATE_CONFIGS = list(dict.fromkeys([*CONFIGS.values(), *EXTRA_CONFIGS, STREAM_K_CONFIG]))
SCHEDULES = ["tiles", "stream_k"]


def _accumulate_case(config, schedule, k=256, n=512, dtype=jnp.bfloat16):
    """A dkernel family adding into an accumulator, and its operands' avals: 4296 rows, 67 k tiles
    (the last one partial), which stream-K's chunks split at odd places."""
    family = LinearWeightGrad(config=config, accumulate=True, stream_k=schedule == "stream_k")
    S = jax.ShapeDtypeStruct
    return family, (S((1, 4296, k), dtype), S((1, 4296, n), dtype), S((1, k, n), jnp.float32))


def _schedule_cases():
    return [(c, s) for c in ACCUMULATE_CONFIGS for s in SCHEDULES if not (s == "stream_k" and c.pingpong)]


@pytest.mark.cute
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_accumulating_weight_grad_compiles_for_every_config(schedule, fresh_cache):
    configs = [c for c, s in _schedule_cases() if s == schedule]
    for config in configs:
        family, avals = _accumulate_case(config, schedule)
        assert kernel_targets(lower_cuda(functools.partial(kernel_call, family), *avals)) == ["linear_dkernel"]
    assert built(cl.cache_info()["linear_dkernel"]) == len(configs)


@pytest.mark.parametrize("sums", ["a", "b"])
def test_weight_grad_operand_sums_reference(sums, rng):
    x, dz = random(rng, (2, 30, 16), jnp.bfloat16), random(rng, (2, 30, 24), jnp.bfloat16)
    acc = random(rng, (2, 16, 24), jnp.float32)
    start = random(rng, (2, 16 if sums == "a" else 24), jnp.float32)
    out, out_sums = LinearWeightGrad(accumulate=True, operand_sums=sums).reference(x, dz, start, acc)
    summed = x if sums == "a" else dz
    assert_close(out_sums, start + jnp.sum(summed.astype(jnp.float32), axis=1), jnp.float32)
    assert_close(out, acc + jnp.einsum("lmk,lmn->lkn", x.astype(jnp.float32), dz.astype(jnp.float32),
                                       precision=HIGHEST), jnp.float32)
    with pytest.raises(ValueError, match="operand_sums"):
        LinearWeightGrad(operand_sums="c")


def test_split_k_configs_are_candidates_where_the_kernel_takes_them():
    S = jax.ShapeDtypeStruct
    x, w, b, r = S((1, 16, 4096), jnp.bfloat16), S((1, 4096, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16), \
        S((1, 16, 4096), jnp.bfloat16)
    takes = {LinearForward("gelu", True, False, True): (x, w, b), LinearInputGrad(): (x, w),
             LinearForward("none", True, True, False): (x, w, b, r), LinearInputGrad("gelu"): (x, w, x)}
    refuses = {LinearInputGrad(stream_k=True): (x, w, r), LinearWeightGrad(operand_sums="b"): (x, x, S((1, 4096), jnp.float32))}
    for family, avals in takes.items():
        assert set(SPLIT_K_CONFIGS) <= set(family.config_space(avals)), family
    for family, avals in refuses.items():
        assert not any(c.split_k > 1 for c in family.config_space(avals)), family


def check_families(cases):
    """Each (kernel family with its config, operands): the kernel's outputs against the family's
    float32 reference, at bfloat16 tolerance."""
    for family, args in cases:
        with cl.use_backend("cute"):
            outs = jax.jit(functools.partial(kernel_call, family))(*args)
        wants = family.reference(*(a.astype(jnp.float32) for a in args))
        for out, want in zip(outs, wants, strict=True):
            assert_close(out, want, jnp.bfloat16)


def test_gated_forward_family():
    # y (1, M, H) from a (K, 2H) kernel, z (1, M, 2H); tiles of 128 columns (64 of each half) only;
    # its own tuning key; rows sharded, the 2H columns as halves (each device its share of both:
    # its columns of y), never the contraction
    S = jax.ShapeDtypeStruct
    x, w, b = S((1, 300, 768), jnp.bfloat16), S((1, 768, 6144), jnp.bfloat16), S((6144,), jnp.bfloat16)
    family = LinearForward("silu", True, False, True, gated=True)
    assert [o.shape for o in family.out_avals((x, w, b))] == [(1, 300, 3072), (1, 300, 6144)]
    assert {c.tile_n for c in family.config_space((x, w, b))} == {128, 256}  # H = 3072: blocks of 64 or 128
    assert family.default_config((x, w, b)) in family.config_space((x, w, b))
    odd = (x, S((1, 768, 2 * 192), jnp.bfloat16), S((384,), jnp.bfloat16))  # H = 192: blocks of 64 only
    assert {c.tile_n for c in family.config_space(odd)} == {128}
    wide = (S((1, 8192, 4096), jnp.bfloat16), S((1, 4096, 32768), jnp.bfloat16), S((32768,), jnp.bfloat16))
    assert family.default_config(wide) == CONFIGS["wide"]  # 128 x 256: H = 16384 is whole 128-blocks
    wide_odd = (wide[0], S((1, 4096, 2 * 11072), jnp.bfloat16), S((2 * 11072,), jnp.bfloat16))
    assert family.default_config(wide_odd).tile_n == 128  # H = 11072 = 173 x 64
    decode = (S((1, 16, 4096), jnp.bfloat16), *wide[1:])
    assert family.default_config(decode).tile_n >= 128
    assert ("gated", True) in family.tuning_key((x, w, b))[1]
    assert ("gated", True) not in LinearForward("silu", True, False, True).tuning_key((x, w, b))[1]
    halves = Halves("n")
    assert family.factors() == (((None, "rows", None), (None, None, halves), (halves,)),
                                ((None, "rows", "n"), (None, "rows", halves)))
    assert dataclasses.replace(family, kernel_nk=True).factors()[0][1] == (None, halves, None)
    (y, z) = family.reference(*(jnp.ones(a.shape, jnp.float32) for a in (x, w, b)))
    assert y.shape == (1, 300, 3072) and z.shape == (1, 300, 6144)


@pytest.mark.gpu
def test_gated_forward_every_config_gpu(rng):
    # The gated forward (h and the stored z) on every config of its space: partial row tiles, H =
    # 192 (three blocks of 64 columns of each half), 300 and 16 rows (split-K configs run too), and
    # H = 256 (two blocks of 128: the 256-column tiles).
    k = 264
    for m, h in ((300, 192), (16, 192), (300, 256)):  # H = 256: 256-column tiles too
        w = jnp.asarray(rng.standard_normal((1, k, 2 * h)) / np.sqrt(k), jnp.bfloat16)
        b = random(rng, (2 * h,), jnp.bfloat16)
        x = random(rng, (1, m, k), jnp.bfloat16)
        family = LinearForward("silu", True, False, True, gated=True)
        check_families([(dataclasses.replace(family, config=c), (x, w, b)) for c in family.config_space((x, w, b))])


def test_gated_input_grad_family():
    # dz1 (1, M, 2H) = both halves' gradients from dh = dy @ w2ᵀ (1, M, H) and z1 (1, M, 2H); tiles of
    # whole 64-column blocks (tile_n dividing H); H sharded as halves in z1 and dz1
    S = jax.ShapeDtypeStruct
    dy, w2, z1 = S((1, 300, 768), jnp.bfloat16), S((1, 3072, 768), jnp.bfloat16), S((1, 300, 6144), jnp.bfloat16)
    family = LinearInputGrad("silu", gated=True)
    assert [o.shape for o in family.out_avals((dy, w2, z1))] == [(1, 300, 6144), (1, 300, 3072)]  # dz1, h
    assert {c.tile_n for c in family.config_space((dy, w2, z1))} == {64, 128, 192, 256}
    odd = (dy, S((1, 320, 768), jnp.bfloat16), S((1, 300, 640), jnp.bfloat16))  # H = 320 = 5 x 64
    assert {c.tile_n for c in family.config_space(odd)} == {64}
    assert family.default_config(odd).tile_n == 64
    assert ("gated", True) in family.tuning_key((dy, w2, z1))[1]
    halves = Halves("k")
    assert family.factors() == (((None, "rows", "n"), (None, "k", "n"), (None, "rows", halves)),
                                ((None, "rows", halves), (None, "rows", "k")))
    with pytest.raises(ValueError, match="gated takes the gate's activation"):
        LinearInputGrad(gated=True)
    dz1, h = family.reference(*(jnp.ones(a.shape, jnp.float32) for a in (dy, w2, z1)))
    assert dz1.shape == (1, 300, 6144) and h.shape == (1, 300, 3072)
    assert_close(h, jnp.full(h.shape, jax.nn.silu(1.0)), jnp.float32)  # act(gate) * value


@pytest.mark.gpu
def test_gated_input_grad_every_config_gpu(rng):
    # dz1 = (dh * value * silu'(gate), dh * silu(gate)) in the dh GEMM's epilogue (two source and
    # two output subtiles per accumulator subtile) on every config of its space: partial row tiles,
    # H = 192 and 256, 300 and 16 rows (split-K configs too).
    n = 264
    for m, h in ((300, 192), (16, 192), (300, 256)):
        dy = random(rng, (1, m, n), jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((1, h, n)) / np.sqrt(n), jnp.bfloat16)
        z1 = random(rng, (1, m, 2 * h), jnp.bfloat16)
        family = LinearInputGrad("silu", gated=True)
        check_families([(dataclasses.replace(family, config=c), (dy, w2, z1))
                        for c in family.config_space((dy, w2, z1))])


@pytest.mark.cute
def test_gated_epilogue_checks():
    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    HopperGemmKernel(CONFIGS["default"], Epilogue("silu", True, False, True, gated=True))
    HopperGemmKernel(SPLIT_K_CONFIGS[0], Epilogue(grad_of="silu", gated=True))  # the backward: 64 columns too
    with pytest.raises(ValueError, match="gated epilogue takes the gate's activation"):
        Epilogue("none", gated=True)
    with pytest.raises(ValueError, match="gated epilogue takes the gate's activation"):
        Epilogue("silu", has_residual=True, gated=True)
    with pytest.raises(ValueError, match="tile_n 128 or 256"):
        HopperGemmKernel(SPLIT_K_CONFIGS[0], Epilogue("silu", gated=True))  # 64 columns
    with pytest.raises(ValueError, match="tile_n 128 or 256"):
        HopperGemmKernel(CONFIGS["default"], Epilogue("silu", gated=True), sums="a")


@pytest.mark.cute
def test_split_k_takes_a_plain_cooperative_kernel():
    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    split = SPLIT_K_CONFIGS[0]
    HopperGemmKernel(split, Epilogue("gelu", True, False, True))  # bias, activation, stored z
    HopperGemmKernel(split, Epilogue(has_residual=True))  # a source tile
    for kwargs in ({"accumulate": True}, {"sums": "a"}):
        with pytest.raises(ValueError, match="split_k takes"):
            HopperGemmKernel(split, Epilogue(), **kwargs)
    with pytest.raises(ValueError, match="split_k takes"):
        HopperGemmKernel(dataclasses.replace(split, cluster_n=2), Epilogue())
    with pytest.raises(ValueError, match="split_k must be one of"):
        HopperGemmKernel(dataclasses.replace(split, split_k=5), Epilogue())
    # its partial tiles take shared memory from the mainloop
    assert split.partial_bytes == 3 * 64 * 64 * 4
    assert split.smem_bytes(2) <= SMEM_CAPACITY


@pytest.mark.gpu
@pytest.mark.parametrize("config", SPLIT_K_CONFIGS, ids=str)
@pytest.mark.parametrize("m,k,n", [(16, 4096, 4096), (37, 264, 712), (5, 64, 200)],
                         ids=["decode", "odd-tiles", "fewer-k-tiles-than-ctas"])
def test_split_k_forward_and_input_grad_gpu(config, m, k, n, rng):
    # The tile's contraction cut over the cluster, summed in the first CTA's shared memory: the
    # forward with bias, gelu and the stored z, with bias and a residual (a source tile), the plain
    # input gradient and the one scaled by gelu'(z) (a source tile); partial tiles along
    # every mode, and (K = 64) ranks with no k tile at all.
    x = random(rng, (1, m, k), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, k, n)) / np.sqrt(k), jnp.bfloat16)
    b, dz = random(rng, (n,), jnp.bfloat16), random(rng, (1, m, n), jnp.bfloat16)
    r, preact = random(rng, (1, m, n), jnp.bfloat16), random(rng, (1, m, k), jnp.bfloat16)
    cases = [(LinearForward("gelu", True, False, True, config=config), (x, w, b)),
             (LinearForward("none", True, True, False, config=config), (x, w, b, r)),
             (LinearInputGrad(config=config), (dz, w)),
             (LinearInputGrad("gelu", config=config), (dz, w, preact))]
    check_families(cases)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [CONFIGS["small_m"], SPLIT_K_CONFIGS[0]], ids=str)
@pytest.mark.parametrize("m", [1, 5, 8, 21, 63, 121, 4104])
def test_row_box_loads_of_a_tile_crossing_m_gpu(config, m, rng):
    # A 64-row tile crossing M loads A in row boxes, only those starting inside M, the rest of the
    # stage's bytes completed without a load: 1 and 5 (one box crossing M), 8 (one box), 21, 63, a
    # second tile of 57 rows, and many whole tiles before one of 8 rows.
    k, n = 384, 200
    x = random(rng, (1, m, k), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, k, n)) / np.sqrt(k), jnp.bfloat16)
    b, r, dz = (random(rng, shape, jnp.bfloat16) for shape in ((n,), (1, m, n), (1, m, n)))
    cases = [(LinearForward("gelu", True, False, True, config=config), (x, w, b)),
             (LinearForward("none", True, True, False, config=config), (x, w, b, r)),
             (LinearInputGrad(config=config), (dz, w))]
    check_families(cases)


@pytest.mark.cute
def test_stream_k_needs_a_cooperative_config():
    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    pingpong = next(c for c in ACCUMULATE_CONFIGS if c.pingpong)
    with pytest.raises(ValueError, match="cooperative"):
        HopperGemmKernel(pingpong, Epilogue(), accumulate=True, stream_k=True)
    with pytest.raises(ValueError, match="no source tile"):
        HopperGemmKernel(STREAM_K_CONFIG, Epilogue(has_residual=True), stream_k=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [*CONFIGS.values(), *EXTRA_CONFIGS], ids=str)
def test_every_config_forward_epilogue_and_input_grad_gpu(config, rng):
    # Every config of the space (a tuned table may name any): the forward with bias, gelu, the
    # stored z and a residual, and the input gradient scaled by gelu'(z) in its epilogue (both
    # read source tiles). 16400 rows: every warpgroup runs several tiles (the source ring's state
    # once restarted every tile, which hung configs of 2 or 6 subtiles from the second one);
    # K = 264 and N = 712 leave partial tiles along every mode.
    m, k, n = 16400, 264, 712
    x, w = random(rng, (1, m, k), jnp.bfloat16), random(rng, (1, k, n), jnp.bfloat16)
    b, r, dz = (random(rng, shape, jnp.bfloat16) for shape in ((n,), (1, m, n), (1, m, n)))
    preact = random(rng, (1, m, k), jnp.bfloat16)
    cases = [(LinearForward("gelu", True, True, True, config=config), (x, w, b, r)),
             (LinearInputGrad("gelu", config=config), (dz, w, preact))]
    check_families(cases)


def test_source_epilogues_are_tuned_on_their_own():
    # A source ring takes shared memory from the mainloop: a tuned entry of the plain kernel
    # (what the autotuner measures) does not name the config of one that reads a residual or a
    # pre-activation.
    S = jax.ShapeDtypeStruct
    x, w, r = (S(shape, jnp.bfloat16) for shape in ((1, 4096, 768), (1, 768, 3072), (1, 4096, 3072)))
    keys = {LinearForward("gelu", True, False, False).tuning_key((x, w)),
            LinearForward("gelu", True, True, False).tuning_key((x, w, r)),
            LinearInputGrad().tuning_key((r, w)), LinearInputGrad("gelu").tuning_key((r, w, x))}
    assert len(keys) == 4
    assert ("source", True) in LinearInputGrad("gelu").tuning_key((r, w, x))[1]


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(256, 512), (64, 128)], ids=["2x2-tiles", "one-tile"])
@pytest.mark.parametrize("config,schedule", _schedule_cases(), ids=str)
def test_accumulating_weight_grad_every_config_gpu(config, schedule, k, n, rng):
    # one tile: a 2-CTA cluster's padding tile aliases tile 0 and must not add it a second time
    family, avals = _accumulate_case(config, schedule, k, n)
    x, dz = (random(rng, a.shape, a.dtype) for a in avals[:2])
    acc = random(rng, avals[2].shape, jnp.float32)
    with cl.use_backend("cute"):
        (out,) = jax.jit(functools.partial(kernel_call, family))(x, dz, acc)
    want = acc + jnp.einsum("lmk,lmn->lkn", x.astype(jnp.float32), dz.astype(jnp.float32), precision=HIGHEST)
    assert_close(out, want, jnp.float32, scale=100.0)  # bf16 products summed in fp32, in another order


@pytest.mark.gpu
@pytest.mark.parametrize("sums", ["a", "b"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_weight_grad_operand_sums_every_config_gpu(schedule, sums, rng):
    # The summing warps' column sums (a bias gradient) for every config of the schedule, whole
    # tiles with and without an accumulator, stream-K segments (rotated, crossing tiles), a batch
    # of 2 and an extent (200, 136) that leaves partial tiles and a partial vector at the edge.
    rows, k, n, batch = 4296, 200, 136, 2
    x, dz = random(rng, (batch, rows, k), jnp.bfloat16), random(rng, (batch, rows, n), jnp.bfloat16)
    want = jnp.einsum("lmk,lmn->lkn", x.astype(jnp.float32), dz.astype(jnp.float32), precision=HIGHEST)
    want_sums = jnp.sum((x if sums == "a" else dz).astype(jnp.float32), axis=1)
    zeros = jnp.zeros(want_sums.shape, jnp.float32)
    failures = []
    for config in [c for c, s in _schedule_cases() if s == schedule]:
        for accumulate in (False, True):
            family = LinearWeightGrad(config=config, accumulate=accumulate, stream_k=schedule == "stream_k",
                                      operand_sums=sums)
            operands = (x, dz, zeros) + ((jnp.zeros(want.shape, jnp.float32),) if accumulate else ())
            operands += (jnp.zeros((PERSISTENT_SMS,), jnp.int32),) * family.fixup
            with cl.use_backend("cute"):
                out, out_sums, *_ = jax.jit(functools.partial(kernel_call, family))(*operands)
            try:
                assert_close(out_sums, want_sums, jnp.float32, scale=100.0)
                assert_close(out, want, jnp.float32 if accumulate else jnp.bfloat16, scale=100.0)
            except AssertionError as e:
                failures.append(f"{config}, accumulate={accumulate}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [False, True], ids=["workspace", "accumulator"])
@pytest.mark.parametrize("rows,k,n,batch", [(16384, 768, 3072, 1), (16384, 768, 768, 1), (5000, 192, 640, 3),
                                            (8192, 64, 64, 1), (70, 64, 64, 1)],
                         ids=["fc1", "attention-out", "odd-batched", "one-tile", "short"])
def test_stream_k_weight_grad_gpu(rows, k, n, batch, accumulate, rng):
    # GPT-2's fc1 (36 cluster tiles over 256 k tiles: every chunk crosses a tile, rotated k) and
    # attention output (9 cluster tiles: each cut over ~7 clusters); a batch of outputs with
    # partial tiles; one tile cut over every cluster of the grid; fewer steps than clusters (empty
    # chunks). The partial tiles added into the accumulator, or meeting in the workspace (the
    # gradient then in x's dtype).
    family = LinearWeightGrad(config=STREAM_K_CONFIG, accumulate=accumulate, stream_k=True)
    x, dz = random(rng, (batch, rows, k), jnp.bfloat16), random(rng, (batch, rows, n), jnp.bfloat16)
    last = jnp.zeros((batch, k, n), jnp.float32) if accumulate else jnp.zeros((PERSISTENT_SMS,), jnp.int32)
    call = jax.jit(functools.partial(kernel_call, family))
    want = jnp.einsum("lmk,lmn->lkn", x.astype(jnp.float32), dz.astype(jnp.float32), precision=HIGHEST)
    # twice on the same operands: the flags, written by the kernel, are a copy of the zeros passed
    for _ in range(2):
        with cl.use_backend("cute"):
            out, *_ = call(x, dz, last)
        assert out.dtype == (jnp.float32 if accumulate else jnp.bfloat16)
        assert_close(out, want, out.dtype, scale=100.0)
    if not accumulate:
        assert not last.any()  # the caller's zeros, untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stream_k_weight_grad_through_the_op_gpu(dtype, rng):
    m, k, n = 4096, 256, 512
    assert stream_k_pays(k, n, m)
    x, kernel, _, _ = operands(rng, (m,), k, n, dtype, bias=False, residual=False)
    dy = random(rng, (m, n), dtype)
    with cl.use_backend("cute"):
        dkernel = jax.jit(jax.grad(lambda w: jnp.sum(fused_linear(x, w).astype(jnp.float32) * dy)))(kernel)
    want = jnp.matmul(x.astype(jnp.float32).T, dy.astype(jnp.float32), precision=HIGHEST)
    assert dkernel.dtype == jnp.dtype(dtype)
    assert_close(dkernel, want, dtype)


# --- kernels stored (N, K): kernel_layout="nk" ------------------------------------------------------

def _nk_matches_kn(rng, lead, k, n, dtype, activation="gelu"):
    """fused_linear on an (N, K) kernel vs the same op on its (K, N) transpose: values and
    gradients, the kernel's gradient in the kernel's own layout."""
    x, kernel, b, r = operands(rng, lead, k, n, dtype)
    weight = jnp.asarray(kernel.T)  # (N, K), as equinox.nn.Linear stores it
    f_nk = lambda x, w, b, r: fused_linear(x, w, b, activation=activation, residual=r, kernel_layout="nk")
    f_kn = lambda x, w, b, r: fused_linear(x, w, b, activation=activation, residual=r)
    assert_close(jax.jit(f_nk)(x, weight, b, r), jax.jit(f_kn)(x, kernel, b, r), dtype)
    got = jax.jit(jax.grad(_sin_loss(f_nk), ARGS))(x, weight, b, r)
    want = jax.jit(jax.grad(_sin_loss(f_kn), ARGS))(x, kernel, b, r)
    assert got[1].shape == (n, k)
    _assert_grads_close((got[0], got[1].T, *got[2:]), want, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_layout_nk_matches_kn(dtype, rng):
    _nk_matches_kn(rng, (3, 5), 48, 40, dtype)


def test_kernel_layout_nk_bad_inputs(rng):
    x, w = jnp.ones((4, 16), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    assert fused_linear(x, w, kernel_layout="nk").shape == (4, 32)
    with pytest.raises(ValueError, match="'kernel_layout' must be one of 'kn', 'nk'; got 'km'"):
        fused_linear(x, w, kernel_layout="km")
    with pytest.raises(ValueError, match=r"'x' has 16 features .* but 'kernel' expects K=32"):
        fused_linear(x, w.T, kernel_layout="nk")


@pytest.mark.cute
def test_lowering_kernel_layout_nk_reads_and_writes_the_kernel_as_stored(fresh_cache):
    # forward, dx and dkernel take the (N, K) kernel / give its (N, K) gradient: no transpose of it
    S = jax.ShapeDtypeStruct
    m, k, n = 4096, 256, 512
    loss = _sin_loss(lambda x, w: fused_linear(x, w, activation="gelu", kernel_layout="nk"))
    hlo = lower_cuda(jax.grad(loss, (0, 1)), S((m, k), jnp.bfloat16), S((n, k), jnp.bfloat16))
    assert kernel_targets(hlo) == ["linear_fwd", "linear_dx", "linear_dkernel"]
    assert "stablehlo.transpose" not in hlo
    (dkernel,) = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    assert dkernel.endswith(f"-> tensor<1x{n}x{k}xf32>")  # stream-K's float32 sum, (N, K)


# --- ptxas on the GEMM kernels' PTX: no serialized wgmmas, no spills --------------------------------

# Lowers each case's GEMM kernels for sm_90a in a fresh process (the CuTe DSL reads CUTE_DSL_KEEP and
# CUTE_DSL_DUMP_DIR once, at import; no disk cache, so every kernel is compiled and dumped; no user
# tuning table, so the heuristic configs) and moves the PTX each case dumped into <dump>/<case>/: one
# file a kernel, named after the launcher's operands, which a later case with the same operands
# (another config) would overwrite. Prints {case: [its PTX files]}.
PTXAS_CASES_PROGRAM = """
import dataclasses, functools, json, os, sys
import jax, jax.numpy as jnp
import cutelayers as cl
from cutelayers.kernels.gemm_config import CONFIGS
from cutelayers.ops.linear import LinearForward, LinearInputGrad, exp_logits, exp_logits_fix, fused_linear
from cutelayers.runtime.sharding import kernel_call

dump = sys.argv[1]
S, bf = jax.ShapeDtypeStruct, jnp.bfloat16

def forward(config, *avals):
    family = LinearForward("none", False, False, False, config=config)
    return functools.partial(kernel_call, family), avals

def gelu_train(x, w, b):  # GPT-2 fc1: the forward storing z, dx through gelu', stream-K dkernel with dbias
    loss = lambda x, w, b: jnp.sum(jnp.sin(fused_linear(x, w, b, activation="gelu").astype(jnp.float32)))
    return jax.grad(loss, (0, 1, 2))(x, w, b)

def gelu(x, w, b):
    return fused_linear(x, w, b, activation="gelu")

def configured(family, *avals):
    return functools.partial(kernel_call, dataclasses.replace(family, config=family.default_config(avals))), avals

gated_avals = (S((1, 4096, 1024), bf), S((1, 1024, 2 * 2816), bf), S((2 * 2816,), bf))
fc1 = (S((16384, 768), bf), S((768, 3072), bf), S((3072,), bf))
cases = {f"forward_8192x4096x4096_{name}": forward(config, S((1, 8192, 4096), bf), S((1, 4096, 4096), bf))
         for name, config in CONFIGS.items()}
cases["fc1_gelu_forward"] = (gelu, fc1)
cases["fc1_gelu_train_step"] = (gelu_train, fc1)
cases["swiglu_forward"] = configured(LinearForward("silu", True, False, False, gated=True), *gated_avals)
# GPT-2 MLP blocks' dh GEMMs: dz1 through gelu' (swiglu's both halves) and h again
cases["mlp_gelu_hidden_grad"] = configured(LinearInputGrad("gelu"), S((1, 16384, 768), bf), S((1, 3072, 768), bf),
                                           S((1, 16384, 3072), bf))
cases["mlp_swiglu_hidden_grad"] = configured(LinearInputGrad("silu", gated=True), S((1, 16384, 768), bf),
                                             S((1, 2048, 768), bf), S((1, 16384, 4096), bf))
cases["decode_split_k_16x4096x4096"] = (gelu, (S((16, 4096), bf), S((4096, 4096), bf), S((4096,), bf)))
cases["lm_head_exp_4096x4096x131072"] = (exp_logits, (S((4096, 4096), bf), S((4096, 131072), bf)))
# the GPT-2 head's pass over rows out of the exponential's range (pingpong, a per-row shift), at
# GPT-2's own vocabulary: 50257 columns of the 50304 its padding makes count
cases["lm_head_exp_fix_4096x768x50304"] = (functools.partial(exp_logits_fix, columns=50257),
                                           (S((4096, 768), bf), S((768, 50304), bf), S((4096, 50304), bf),
                                            S((4096,), jnp.int32), S((4096,), jnp.int32), S((4096,), jnp.float32)))
found = {}
with cl.use_backend("cute"):
    for case, (f, avals) in cases.items():
        jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",))
        os.mkdir(os.path.join(dump, case))
        found[case] = sorted(name for name in os.listdir(dump) if name.endswith(".ptx"))
        for name in found[case]:
            os.rename(os.path.join(dump, name), os.path.join(dump, case, name))
print(json.dumps(found))
"""
# The GEMM kernels each case lowers
PTXAS_CASE_KERNELS = {"forward_8192x4096x4096_small_m": 1, "forward_8192x4096x4096_default": 1,
                      "forward_8192x4096x4096_wide": 1, "fc1_gelu_forward": 1, "fc1_gelu_train_step": 3,
                      "swiglu_forward": 1, "mlp_gelu_hidden_grad": 1, "mlp_swiglu_hidden_grad": 1,
                      "decode_split_k_16x4096x4096": 1, "lm_head_exp_4096x4096x131072": 1,
                      "lm_head_exp_fix_4096x768x50304": 1}
# The cases whose kernel has 64-row tiles (one consumer warpgroup)
ROW_BOX_CASES = {"forward_8192x4096x4096_small_m", "decode_split_k_16x4096x4096"}
# The cases whose one kernel adds a bfloat16 bias (a gated one's gate and value halves included)
BIAS_CASES = {"fc1_gelu_forward", "swiglu_forward", "decode_split_k_16x4096x4096"}


@pytest.mark.cute
def test_ptxas_neither_serializes_the_wgmmas_nor_spills(tmp_path):
    # ptxas's performance advisories on the consumer mainloop: C7514 / C7517 / C7519 (a warpgroup
    # fence or arrive ptxas inserts, accumulators touched while a wgmma is in flight) and C7520 (so
    # the wgmmas are serialized) -- the mainloop's descriptors in uniform registers, a fence before
    # each batch and the first k tile's zeros pinned made every kernel free of them. Kernels: the
    # plain forward at 8192 x 4096 x 4096 in each heuristic config, GPT-2's fc1 (16384 x 768 x 3072,
    # the pingpong "default" config) with bias and gelu -- its inference forward, and its training
    # forward storing z, input gradient through gelu' and stream-K weight gradient with the bias
    # sums -- a swiglu forward, the GPT-2 MLP blocks' dh GEMMs (gelu', swiglu's halves, and h
    # written again), a decode step's split-K forward (16 x 4096 x 4096) and an LM head
    # chunk's logits GEMM with the exp epilogue, and at GPT-2 size its pass over flagged rows.
    # None spills (ptxas -v: 0 bytes spill stores for each). The biased forwards read the bias a
    # pair of columns a load.
    from cutelayers.kernels.gemm import ROW_BOX

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("ptxas (the CUDA toolkit's PTX assembler) is not on PATH")
    proc = subprocess.run([sys.executable, "-c", PTXAS_CASES_PROGRAM, str(tmp_path)], env=kept_ptx_env(tmp_path),
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert {case: len(files) for case, files in found.items()} == PTXAS_CASE_KERNELS
    problems = []
    for case, files in found.items():
        for index, name in enumerate(files):
            path = tmp_path / case / name
            ptx = path.read_text()
            assert "HopperGemmKernel" in ptx, path
            # A 64-row tile loads A in ROW_BOX-row boxes where it crosses M, the bytes of the boxes
            # past M completed without a load; 128-row tiles load whole boxes only
            assert ("mbarrier.complete_tx" in ptx) == (case in ROW_BOX_CASES), case
            if case in BIAS_CASES:
                # the bias two columns a load (a thread's accumulators pair adjacent columns): one
                # 16-bit load a column had ptxas hoist them all and spill to hold them
                assert "ld.global.v2.b16" in ptx and not re.search(r"ld\.global\.b16\s", ptx), case
            if case.startswith("decode"):
                # per 64-column swizzle atom of the k tile, 64 / ROW_BOX box loads beside the whole tile's
                loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx))
                assert loads >= 2 * 64 // ROW_BOX, (case, loads)
            notes = ptxas_report(ptxas, path)
            advisories = sorted(set(re.findall(r"\((C75\d\d)\)", notes)))
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", notes)]
            assert spills, notes  # ptxas -v reports each kernel's spills
            if advisories or any(spills):
                tile = re.search(r"ShapeMNK(\d+)", notes)  # the wgmma atom's M, N, K run together
                lines = [line.strip()[:160] for line in notes.splitlines() if "(C75" in line]
                problems.append(f"{case}, kernel {index} (wgmma {tile and tile.group(1)}): "
                                f"{', '.join(advisories) or 'no advisory'}, {max(spills)} bytes spill stores"
                                + "".join(f"\n    {line}" for line in lines))
    assert not problems, "ptxas -arch=sm_90a on the GEMM kernels:\n" + "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_kernel_layout_nk_gpu(dtype, rng):
    with cl.use_backend("cute"):
        _nk_matches_kn(rng, (1000,), 256, 512, dtype)
        _nk_matches_kn(rng, (4096,), 768, 256, dtype, activation=None)


@pytest.mark.cute
def test_gelu_epilogue_constants_give_tanh_gelu():
    # The epilogue computes tanh-gelu as x * sigmoid(2u), sigmoid from exp2 of
    # x (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC x^2): the same function as jax.nn.gelu(approximate=True).
    from cutelayers.kernels import gemm

    x = np.linspace(-12.0, 12.0, 4801)
    ours = x / (1.0 + np.exp2(x * (gemm.GELU_EXP2_LINEAR + gemm.GELU_EXP2_CUBIC * x * x)))
    expected = 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(ours, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.cute
@pytest.mark.parametrize("epilogue", ["plain", "residual", "preact"])
def test_an_m_major_c_is_refused(epilogue):
    # The epilogue's stmatrix / ldmatrix and its shared-memory subtiles hold rows of N (no op gives
    # the kernel an M-major output since the float32 A went): an M-major c, residual or stored
    # pre-activation is refused when the kernel is traced.
    from cutlass import BFloat16, cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    fake = lambda order: make_fake_compact_tensor(BFloat16, (256, 256, 1), stride_order=order, assumed_align=16)
    n_major, m_major = (1, 0, 2), (0, 1, 2)
    if epilogue == "plain":
        name, kernel, outputs = "c", Epilogue(), [fake(m_major)]
    elif epilogue == "residual":
        name, kernel, outputs = "residual", Epilogue(has_residual=True), [fake(m_major), fake(n_major)]
    else:
        name, kernel, outputs = "preact", Epilogue(store_preact=True), [fake(n_major), fake(m_major)]
    with pytest.raises(ValueError, match=f"^{name} takes N contiguous .*; got an M-major {name}, layout "):
        cute.compile(HopperGemmKernel(CONFIGS["default"], kernel), make_fake_stream(), fake(n_major), fake(n_major),
                     *outputs)


@pytest.mark.cute
def test_a_float32_a_with_a_bfloat16_b_is_refused():
    # The kernel multiplies bfloat16 or float16 A and B of one dtype: a float32 A (a float32 weight
    # as the transposed product's A) with a bf16 B is refused when the kernel is traced.
    from cutlass import BFloat16, Float32, cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    fake = lambda dtype: make_fake_compact_tensor(dtype, (256, 256, 1), stride_order=(1, 0, 2), assumed_align=16)
    with pytest.raises(ValueError, match="a and b take one dtype, bfloat16 or float16; got a Float32, b BFloat16"):
        cute.compile(HopperGemmKernel(CONFIGS["default"], Epilogue()), make_fake_stream(), fake(Float32),
                     fake(BFloat16), fake(BFloat16))


@pytest.mark.cute
def test_a_config_leaving_under_two_mainloop_stages_is_refused():
    # The consumer releases a k tile's stage only after waiting for the next k tile's: a single
    # mainloop stage (the rest of shared memory taken by the tile or the epilogue's ring) would hang.
    from cutlass import BFloat16, cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    fake = lambda: make_fake_compact_tensor(BFloat16, (256, 256, 1), stride_order=(1, 0, 2), assumed_align=16)
    for config in (GemmConfig(tile_m=256, tile_n=256, consumer_warpgroups=2, stages=4, tile_k=128),
                   dataclasses.replace(CONFIGS["wide"], stages=1)):
        with pytest.raises(ValueError, match=r"leaves 1 mainloop stage\(s\)"):
            cute.compile(HopperGemmKernel(config, Epilogue()), make_fake_stream(), fake(), fake(), fake())
