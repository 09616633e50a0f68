"""Rematerialization: every op under ``jax.checkpoint`` with JAX's policies has the gradients it
has without it (alone, under vmap, under jit), and :func:`cutelayers.remat_policy` keeps the GEMM
kernels' results where the policy keeps dots -- in the saved residuals, and, lowered for CUDA, no
forward GEMM launched again in the backward -- where the policy as given recomputes them."""

import contextlib
import io
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from numerics import random
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
