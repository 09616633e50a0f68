"""Rematerialization: every op under ``jax.checkpoint`` with JAX's policies has the gradients it
has without it (alone, under vmap, under jit), and :func:`cutelayers.remat_policy` keeps the GEMM
kernels' results where the policy keeps dots -- in the saved residuals, and, lowered for CUDA, no
forward GEMM launched again in the backward -- where the policy as given recomputes them. And the
way deep models apply their blocks with it: ``lax.scan`` over stacked layers."""

import contextlib
import io
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from numerics import random, same_tree
from test_batching import BF16, CASES, _assert_trees_close, _batched, _in_axes, _loss, params
from test_linear import kernel_targets, lower_cuda

import cutelayers as cl
from cutelayers import ops

policies = jax.checkpoint_policies
DOTS = cl.remat_policy(policies.dots_with_no_batch_dims_saveable)
POLICIES = {
    "nothing_saveable": policies.nothing_saveable,
    "dots_saveable": policies.dots_saveable,  # as given: our GEMMs recomputed, gradients the same
    "remat_policy(dots_with_no_batch_dims_saveable)": DOTS,
    "everything_saveable": policies.everything_saveable,
    "remat_policy(offload_dot_with_no_batch_dims)": cl.remat_policy(
        policies.offload_dot_with_no_batch_dims("device", "pinned_host")),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", params(CASES))
def test_every_op_under_checkpoint_has_its_gradients(case, policy, rng):
    args = case.args(rng, lead=(3, 5))
    want = jax.grad(_loss(case.fn), case.wrt)(*args)
    got = jax.jit(jax.grad(_loss(jax.checkpoint(case.fn, policy=POLICIES[policy])), case.wrt))(*args)
    _assert_trees_close(got, want, case.dtype)


@pytest.mark.parametrize("case", params(CASES))
def test_checkpoint_and_vmap_compose(case, rng):
    """grad of vmap of checkpoint, and of checkpoint of vmap: the gradients of grad(vmap)."""
    args, batched = _batched(case, rng, (2,))
    in_axes = _in_axes(args, batched)
    want = jax.grad(_loss(jax.vmap(case.fn, in_axes)), case.wrt)(*args)
    for fn in (jax.vmap(jax.checkpoint(case.fn, policy=DOTS), in_axes),
               jax.checkpoint(jax.vmap(case.fn, in_axes), policy=DOTS)):
        _assert_trees_close(jax.jit(jax.grad(_loss(fn), case.wrt))(*args), want, case.dtype)


def test_remat_policy_arguments():
    assert cl.remat_policy(policies.dots_saveable) == cl.remat_policy(policies.dots_saveable)
    assert hash(cl.remat_policy(policies.dots_saveable)) == hash(cl.remat_policy(policies.dots_saveable))
    assert cl.remat_policy(DOTS) is DOTS  # wrapping twice changes nothing
    with pytest.raises(TypeError, match=r"remat_policy: 'policy' must be a jax.checkpoint policy .*; got str 'dots'"):
        cl.remat_policy("dots")


# --- what the policy is asked and what it keeps --------------------------------------------------------

def _block(x, w1, w2):
    """A transformer MLP of two fused linears: fc1 with gelu (its pre-activation kept for the
    backward), fc2 adding the residual."""
    return ops.fused_linear(ops.fused_linear(x, w1, activation="gelu"), w2, residual=x)


def _block_args(rng, rows=2048, d=128, hidden=512):
    return (random(rng, (rows, d), BF16), 0.05 * random(rng, (d, hidden), jnp.float32),
            0.05 * random(rng, (hidden, d), jnp.float32))


def _saved(fn, *args) -> Counter:
    """The residuals the gradient of ``fn`` keeps from cutelayers' kernel calls in its forward, by
    type and producer."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_saved_residuals(_loss(fn), *args)
    return Counter(re.sub(r" from .*", "", line.replace(" output of ", " ")) for line in printed.getvalue().splitlines()
                   if "cutelayers" in line and "from the argument" not in line)


def test_the_policy_is_asked_about_each_gemm_as_a_dot(rng):
    """The wrapped policy sees a dot_general of the GEMM's (M, K) @ (K, N) for each kernel call,
    the batch of a vmap folded into M, and keeps the kernels' results where it keeps dots."""
    asked = []

    def policy(prim, *avals, **params):
        if prim is jax.lax.dot_general_p:
            asked.append(([tuple(a.shape) for a in avals], params["dimension_numbers"]))
            return True
        return False

    x, w1, w2 = _block_args(rng)
    batched = jax.vmap(_block, (0, None, None))
    saved = _saved(jax.checkpoint(batched, policy=cl.remat_policy(policy)), x.reshape(2, 1024, 128), w1, w2)
    contraction = (((1,), (0,)), ((), ()))
    assert asked == [([(2048, 128), (128, 512)], contraction), ([(2048, 512), (512, 128)], contraction)]
    # fc1's two results (gelu(z) and z, both needed by the backward); fc2's output is not needed
    assert saved == Counter({"bf16[2,1024,512] cutelayers_fold_batch": 2}), saved
    # the same policy as given is never asked about a dot here: nothing kept
    asked.clear()
    assert _saved(jax.checkpoint(batched, policy=policy), x.reshape(2, 1024, 128), w1, w2) == Counter()
    assert asked == []


def test_the_offload_policy_moves_the_gemm_results_to_the_host(rng):
    """JAX's offloading dot policy, wrapped, moves fc1's two results to pinned host memory and back
    (two transfers, as it moves a stock layer's matmul); as given, it moves none."""
    offload = policies.offload_dot_with_no_batch_dims("device", "pinned_host")

    def transfers(policy):
        grad = jax.grad(_loss(jax.checkpoint(_block, policy=policy)), (1, 2))
        return str(jax.make_jaxpr(grad)(*_block_args(rng))).count("device_put")

    assert (transfers(cl.remat_policy(offload)), transfers(offload)) == (2, 0)


@pytest.mark.cute
def test_gemms_are_not_launched_again_under_the_dots_policy(rng):
    """Lowered for CUDA with backend 'cute': the block's gradient launches each forward GEMM once
    under the wrapped dot policy (as without checkpoint), fc1's forward twice where the policy
    keeps nothing -- and where JAX's dot policy is given as is."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _block_args(rng)]

    def forward_gemms(policy):
        fn = _block if policy is None else jax.checkpoint(_block, policy=policy)
        with cl.use_backend("cute"):
            hlo = lower_cuda(jax.grad(_loss(fn), (1, 2)), *avals)
        return Counter(kernel_targets(hlo))["linear_fwd"]

    assert forward_gemms(None) == 2
    assert forward_gemms(DOTS) == 2
    assert forward_gemms(policies.nothing_saveable) == 3
    assert forward_gemms(policies.dots_with_no_batch_dims_saveable) == 3


@pytest.mark.cute
def test_a_checkpointed_lm_head_runs_once_under_the_dots_policy():
    """The LM head computes its gradients in its forward (the exp path: P from the logits GEMM's
    epilogue, then dh and dkernel): checkpointed under the wrapped dot policy, its loss and
    gradients launch each kernel as without checkpoint; under a policy that keeps nothing, twice
    (README: checkpoint the blocks, not the head)."""
    avals = (jax.ShapeDtypeStruct((8192, 256), BF16), jax.ShapeDtypeStruct((256, 4096), jnp.float32),
             jax.ShapeDtypeStruct((8192,), jnp.int32))

    def launches(policy):
        head = lambda h, kernel, labels: ops.linear_cross_entropy(h, kernel, labels)
        fn = head if policy is None else jax.checkpoint(head, policy=policy)
        with cl.use_backend("cute"):
            return Counter(kernel_targets(lower_cuda(jax.value_and_grad(fn, (0, 1)), *avals)))

    once = launches(None)
    assert once["linear_fwd"] > 0 and once["linear_dkernel"] > 0, once
    assert launches(DOTS) == once
    assert launches(policies.nothing_saveable) == once + once


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["nothing_saveable", "remat_policy(dots_with_no_batch_dims_saveable)"])
def test_checkpointed_block_on_the_gpu(policy, rng):
    """On the GPU (the kernels run): the checkpointed block's gradients are the block's without
    checkpoint (to the rounding of the stream-K weight gradients' adds, whose order varies)."""
    args = _block_args(rng, rows=4104)
    want = jax.jit(jax.grad(_loss(_block), (0, 1, 2)))(*args)
    got = jax.jit(jax.grad(_loss(jax.checkpoint(_block, policy=POLICIES[policy])), (0, 1, 2)))(*args)
    _assert_trees_close(got, want, BF16)


# --- scan over stacked layers -------------------------------------------------------------------------

def _norm_mlp(x, layer):
    """A pre-norm MLP block with one layer's parameters (a scan body: carry, params -> carry)."""
    w1, w2, scale, bias = layer
    h = ops.layer_norm(x, scale, bias).astype(x.dtype)
    return ops.mlp(h, w1, None, w2, None, activation="gelu", residual=x), None


def _stacked_layers(rng, layers=3, d=128, hidden=512):
    return (0.05 * random(rng, (layers, d, hidden), jnp.float32), 0.05 * random(rng, (layers, hidden, d), jnp.float32),
            random(rng, (layers, d), jnp.float32, loc=1.0), random(rng, (layers, d), jnp.float32))


def _scanned(policy):
    body = _norm_mlp if policy is None else jax.checkpoint(_norm_mlp, policy=policy)
    return lambda layers, x: jax.lax.scan(body, x, layers)[0]


@pytest.mark.parametrize("policy", [None, DOTS])
def test_scan_over_layers(policy, rng):
    """Blocks applied by ``lax.scan`` over stacked parameters (checkpointed or not) give the
    gradients of the same blocks in a Python loop."""
    layers, x = _stacked_layers(rng), random(rng, (2048, 128), BF16)

    def looped(layers, x):
        for i in range(layers[0].shape[0]):
            x = _norm_mlp(x, [p[i] for p in layers])[0]
        return x

    got = jax.jit(jax.grad(_loss(_scanned(policy)), (0, 1)))(layers, x)
    want = jax.jit(jax.grad(_loss(looped), (0, 1)))(layers, x)
    _assert_trees_close(got, want, BF16)


@pytest.mark.cute
@pytest.mark.parametrize("policy", [None, DOTS])
def test_scan_over_layers_runs_each_kernel_in_its_body(policy, rng):
    """Lowered for CUDA, the scanned blocks run each kernel in the loop body: one launch site per
    kernel however many layers (the forward GEMMs' too under the dot policy; the norm's forward
    again, recomputed)."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (_stacked_layers(rng), random(rng, (2048, 128), BF16)))
    with cl.use_backend("cute"):
        targets = Counter(kernel_targets(lower_cuda(jax.grad(_loss(_scanned(policy))), *avals)))
    again = 0 if policy is None else 1
    assert targets == Counter({"linear_fwd": 2, "linear_dx": 2, "linear_dkernel": 2, "layer_norm_fwd": 1 + again,
                               "layer_norm_bwd": 1}), targets


# --- the frameworks' own layer stacking, with their remat ----------------------------------------------

def _output_and_grads(value_and_grad, fn, params):
    """``fn(params)`` and the gradient of :func:`_loss` of it w.r.t. ``params``, by the framework's
    ``value_and_grad`` (the output is what the test compares: the scalar loss, a sum of sines,
    cancels)."""
    def loss_and_output(params):
        y = fn(params)
        return _loss(lambda: y)(), y

    (_, y), grads = value_and_grad(loss_and_output, has_aux=True)(params)
    return y, grads


def _nnx_stack(ours: bool, policy, x):
    from flax import nnx

    from cutelayers.flax import nnx as cl_nnx

    Linear, LayerNorm = (cl_nnx.Linear, cl_nnx.LayerNorm) if ours else (nnx.Linear, nnx.LayerNorm)

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.norm = LayerNorm(x.shape[-1], dtype=BF16, rngs=rngs)
            self.linear = Linear(x.shape[-1], x.shape[-1], dtype=BF16, rngs=rngs)

        def __call__(self, x):
            return x + self.linear(self.norm(x))

    stack = nnx.vmap(lambda key: Layer(nnx.Rngs(key)))(jax.random.split(jax.random.key(0), 3))
    apply = nnx.scan(nnx.remat(lambda x, layer: layer(x), policy=policy), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    y, grads = _output_and_grads(nnx.value_and_grad, lambda stack: apply(x, stack), stack)
    return y, nnx.state(grads, nnx.Param)


def _linen_stack(ours: bool, policy, x):
    import flax.linen as nn

    from cutelayers.flax import linen as cl_linen

    Dense, LayerNorm = (cl_linen.Dense, cl_linen.LayerNorm) if ours else (nn.Dense, nn.LayerNorm)

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return x + Dense(x.shape[-1], dtype=BF16)(LayerNorm(dtype=BF16)(x)), None

    stack = nn.scan(nn.remat(Layer, policy=policy), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)()
    params = stack.init(jax.random.key(0), x, None)
    return _output_and_grads(jax.value_and_grad, lambda p: stack.apply(p, x, None)[0], params)


def _equinox_stack(ours: bool, policy, x):
    import equinox as eqx

    from cutelayers import equinox as cl_eqx

    Linear, LayerNorm = (cl_eqx.Linear, cl_eqx.LayerNorm) if ours else (eqx.nn.Linear, eqx.nn.LayerNorm)
    d = x.shape[-1]
    stack = eqx.filter_vmap(lambda key: (LayerNorm(d, dtype=BF16), Linear(d, d, dtype=BF16, key=key)))(
        jax.random.split(jax.random.key(0), 3))
    params, static = eqx.partition(stack, eqx.is_array)

    def layer(x, params):
        norm, linear = eqx.combine(params, static)
        rows = x.reshape(-1, d)
        return x + jax.vmap(lambda r: linear(norm(r)))(rows).reshape(x.shape), None

    scanned = lambda params: jax.lax.scan(eqx.filter_checkpoint(layer, policy=policy), x, params)[0]
    return _output_and_grads(jax.value_and_grad, scanned, params)


@pytest.mark.parametrize("stack", [_nnx_stack, _linen_stack, _equinox_stack], ids=["nnx", "linen", "equinox"])
def test_stacked_layers_in_each_framework_match_stock(stack, rng):
    """Layers stacked and applied the framework's way (nnx.vmap + nnx.scan, linen nn.scan, Equinox
    filter_vmap + lax.scan), each rematerialized by the framework's own transform: ours under
    ``remat_policy`` of JAX's dot policy, stock under that policy as given -- the same parameters,
    outputs and gradients."""
    x = random(rng, (4, 16, 64), BF16)
    y, grads = stack(True, DOTS, x)
    stock_y, stock_grads = stack(False, policies.dots_with_no_batch_dims_saveable, x)
    same_tree(grads, stock_grads)  # (Equinox: our module classes, the stock ones' leaves)
    _assert_trees_close(y, stock_y, BF16)
    _assert_trees_close(jax.tree.leaves(grads), jax.tree.leaves(stock_grads), BF16)
