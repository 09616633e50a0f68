"""LM head and pooling: ``linear_cross_entropy`` and ``masked_mean_pool`` (values, gradients,
vmap/jit/grad, memory: no (tokens, vocab) array, CUDA lowering), and the ``LMHead`` /
``MeanPoolClassifier`` modules of Flax linen, NNX and Equinox against the stock layers they
compose.
"""

import collections
import contextlib
import functools
import math
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from numerics import assert_close, assert_matches, assert_trees_match, random, same_tree
from test_linear import kernel_targets, lower_cuda

import cutelayers as cl
from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx
from cutelayers.ops import linear_cross_entropy, masked_mean_pool
from cutelayers.ops.lm_head import chunk_layout

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


def reference_loss(logits, labels, ignore_index=None, reduction="mean", label_smoothing=0.0, z_loss=0.0,
                   logit_soft_cap=None):
    """optax's per-token cross-entropy in float32 (soft-capped logits, smoothed targets, plus
    z_loss * lse^2), ignored tokens zeroed, then reduced."""
    logits = logits.astype(F32)
    if logit_soft_cap is not None:
        logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    ignored = labels == ignore_index if ignore_index is not None else jnp.zeros(labels.shape, bool)
    targets = optax.smooth_labels(jax.nn.one_hot(jnp.where(ignored, 0, labels), logits.shape[-1]), label_smoothing)
    losses = optax.softmax_cross_entropy(logits, targets) + z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
    losses = jnp.where(ignored, 0.0, losses)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return jnp.sum(losses)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(~ignored), 1)


def head_operands(rng, lead, hidden, vocab, dtype, ignore_index=None, param_dtype=None):
    """h in ``dtype``, kernel and bias in ``param_dtype`` (default: ``dtype``), labels."""
    param_dtype = param_dtype or dtype
    h = random(rng, (*lead, hidden), dtype)
    kernel = jnp.asarray(rng.standard_normal((hidden, vocab)) / np.sqrt(hidden), param_dtype)
    bias = random(rng, (vocab,), param_dtype)
    labels = rng.integers(0, vocab, lead)
    if ignore_index is not None:
        labels = np.where(rng.random(lead) < 0.3, ignore_index, labels)
    return h, kernel, bias, jnp.asarray(labels, jnp.int32)


def f32_logits(h, kernel, bias):
    logits = jnp.matmul(h.astype(F32), kernel.astype(F32), precision=HIGHEST)
    return logits if bias is None else logits + jnp.broadcast_to(bias.astype(F32), logits.shape)


# --- linear_cross_entropy --------------------------------------------------------------------------

CASES = [  # (leading shape, H, V, chunk_size, with bias, ignore_index)
    ((37,), 16, 40, 10, True, None),      # 4 chunks of 10 rows: 3 padded
    ((4, 6), 16, 40, 10, False, -100),    # 3 chunks of 8 rows (3 divides 6 tokens per leading index)
    ((3, 21), 24, 64, None, False, -100),  # default chunk: one chunk
    ((2, 3, 5), 8, 33, 1, True, 0),       # one row per chunk; ignore a valid class
    ((1,), 32, 16, 7, False, None),       # chunk larger than the tokens
]


# Each case with "mean" and "none", the two paths of the chunks (a weighted total whose gradients
# the forward computes; per-token losses whose backward recomputes the logits), which treat the
# padded rows each their own way; "sum" is "mean"'s total undivided: two cases, with and without
# ignored tokens.
REDUCTION_CASES = [pytest.param(*case, reduction, id=f"{reduction}-case{i}") for i, case in enumerate(CASES)
                   for reduction in ("mean", "none", "sum")[:3 if i in (0, 1) else 2]]


@pytest.mark.parametrize("lead,hidden,vocab,chunk,with_bias,ignore_index,reduction", REDUCTION_CASES)
def test_values_and_grads_match_optax(lead, hidden, vocab, chunk, with_bias, ignore_index, reduction, rng):
    h, kernel, bias, labels = head_operands(rng, lead, hidden, vocab, F32, ignore_index)
    bias = bias if with_bias else None

    def ours(h, kernel, bias):
        return linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=ignore_index,
                                    reduction=reduction, chunk_size=chunk)

    def ref(h, kernel, bias):
        return reference_loss(f32_logits(h, kernel, bias), labels, ignore_index, reduction)

    # a random linear weighting of every per-token value, so "none" checks each token's gradient;
    # linear keeps it well conditioned (sin of a summed loss amplifies rounding near its zeros)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, lead if reduction == "none" else ()), F32)

    def scalar(f):
        return lambda *a: jnp.sum(weights * f(*a))

    with jax.default_matmul_precision("highest"):
        out = ours(h, kernel, bias)
        assert out.dtype == F32 and out.shape == (lead if reduction == "none" else ())
        np.testing.assert_allclose(out, ref(h, kernel, bias), rtol=1e-5, atol=1e-6)
        args = (0, 1, 2) if with_bias else (0, 1)
        grads = jax.jit(jax.grad(scalar(ours), args))(h, kernel, bias)
        for g, g_ref in zip(grads, jax.grad(scalar(ref), args)(h, kernel, bias)):
            np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_through_the_kernel_path(dtype, rng):
    # H and V multiples of 8: on CPU the kernels' reference lowering runs, chunk by chunk
    h, kernel, bias, labels = head_operands(rng, (4, 50), 64, 256, dtype, ignore_index=-1)

    def ours(h, kernel, bias):
        return linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=-1, chunk_size=64)

    def ref(h, kernel, bias):
        return reference_loss(f32_logits(h, kernel, bias), labels, -1)

    assert_close(ours(h, kernel, bias), ref(h, kernel, bias), dtype)
    grads = jax.jit(jax.grad(ours, (0, 1, 2)))(h, kernel, bias)
    refs = jax.grad(ref, (0, 1, 2))(*(a.astype(F32) for a in (h, kernel, bias)))
    for g, g_ref, primal in zip(grads, refs, (h, kernel, bias)):
        assert g.dtype == primal.dtype and g.shape == primal.shape
        assert_close(g, g_ref, dtype, scale=2.0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float32_params_through_the_kernel_path(reduction, rng):
    # mixed precision: bfloat16 h, float32 kernel and bias -- cast for the GEMMs, their gradients
    # the float32 sums over the chunks as they are
    h, kernel, bias, labels = head_operands(rng, (4, 50), 64, 256, jnp.bfloat16, -1, param_dtype=F32)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, labels.shape), F32)

    def ours(h, kernel, bias):
        out = linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=-1, chunk_size=64, reduction=reduction)
        return jnp.sum(out * weights) if reduction == "none" else out

    def ref(h, kernel, bias):
        out = reference_loss(f32_logits(h, kernel, bias), labels, -1, reduction)
        return jnp.sum(out * weights) if reduction == "none" else out

    grads = jax.jit(jax.grad(ours, (0, 1, 2)))(h, kernel, bias)
    refs = jax.grad(ref, (0, 1, 2))(*(a.astype(F32) for a in (h, kernel, bias)))
    for g, g_ref, primal in zip(grads, refs, (h, kernel, bias)):
        assert g.dtype == primal.dtype and g.shape == primal.shape
        assert_close(g, g_ref, jnp.bfloat16, scale=2.0)


@pytest.mark.parametrize("ignore_index", [None, -100])
def test_mean_gradient_is_not_scaled_in_a_pass_of_its_own(ignore_index):
    # the mean's 1 / count rides the per-token weights (the cross-entropy kernels' dloss): the
    # backward's scale is the loss's own cotangent, the constant 1 of value_and_grad, which XLA
    # drops -- no multiply over the (H, V) gradient in the compiled program (here XLA's CPU one:
    # the same custom_vjp around the reference path)
    t, hidden, vocab = 512, 96, 1024
    S = jax.ShapeDtypeStruct
    grad = jax.jit(jax.value_and_grad(lambda h, w, labels: linear_cross_entropy(
        h, w, labels, ignore_index=ignore_index, chunk_size=128), (0, 1)))
    compiled = grad.lower(S((t, hidden), jnp.bfloat16), S((hidden, vocab), F32), S((t,), jnp.int32)).compile()
    passes = [line for line in compiled.as_text().splitlines() if "multiply" in line and f"[{hidden},{vocab}]" in line]
    assert not passes, passes


@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.parametrize("reduction,z_loss,smoothing", [("mean", 0.0, 0.0), ("sum", 1e-2, 0.0), ("none", 1e-2, 0.0),
                                                       ("mean", 1e-2, 0.1), ("none", 0.0, 0.2)])
def test_exp_path_with_rows_out_of_its_range(reduction, z_loss, smoothing, layout, rng):
    # bf16 heads (either kernel layout) without bias or soft cap take the exp path (P =
    # exp(logits), module docstring), label smoothing's mean logit from the kernel's column sums
    # (rank-one terms of the gradients). Rows it cannot hold -- logits past its clamp (scaled h), a
    # label whose exp underflows, an ignored such row -- take the exp GEMM's second passes (their
    # max logit as the shift); with the reference lowering here, the same decomposition as on the
    # GPU
    lead, hidden, vocab, ignore_index = (3, 50), 32, 200, -100
    h, kernel, _, labels = head_operands(rng, lead, hidden, vocab, jnp.bfloat16, ignore_index)
    # rows scaled to set logits: the largest |logit| of (0, 5) and (0, 20) to 400, the smallest
    # logit of (2, 9) to -100 (whatever the draw)
    logits = f32_logits(h, kernel, None)
    h = (h.at[0, 5].multiply(float(400.0 / jnp.max(jnp.abs(logits[0, 5]))))
         .at[0, 20].multiply(float(400.0 / jnp.max(jnp.abs(logits[0, 20]))))
         .at[2, 9].multiply(float(100.0 / -jnp.min(logits[2, 9]))))
    logits = f32_logits(h, kernel, None)
    labels = labels.at[0, 5].set(3).at[0, 20].set(ignore_index).at[2, 9].set(jnp.argmin(logits[2, 9]))
    assert jnp.max(jnp.abs(logits[0, 5])) > 200 and jnp.min(logits[2, 9]) < -70
    options = {"z_loss": z_loss, "label_smoothing": smoothing, "kernel_layout": layout}
    ours, ref = head_call(options, labels, ignore_index, reduction, chunk=64)
    if reduction == "none":  # the per-token losses, fixed rows included, then a weighted sum's gradients
        assert_close(jax.jit(ours)(h, kernel, None), ref(h.astype(F32), kernel.astype(F32), None), jnp.bfloat16)
        weights = jnp.asarray(rng.uniform(0.5, 1.5, lead), F32)
        ours, ref = weighted_sum(ours, weights), weighted_sum(ref, weights)
    value, grads = check_value_and_grads(ours, ref, (h, kernel), None)
    assert jnp.isfinite(value) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    # and the ordinary rows alone: no row is flagged
    keep = jnp.ones(lead, bool).at[0, 5].set(False).at[0, 20].set(False).at[2, 9].set(False)
    check_value_and_grads(ours, ref, (jnp.where(keep[..., None], h, 0.1), kernel), None)


@pytest.mark.parametrize("layout,vocab", [("hv", 253), ("vh", 253), ("hv", 256), ("vh", 256)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_exp_path_label_smoothing(layout, vocab, reduction, rng):
    """Label smoothing on the exp path: its mean logit is h . (the kernel's column sums) / V and
    its gradient's uniform part -a w / V per class is rank-one -- (column sums) in dh, sum_t of h
    in every column of dkernel -- over the V classes alone where V is padded (253 -> 256). The
    operands share a column component and a row component, so both rank-one terms are a large
    part of the gradients (each alone off fails this), and a = 0.5."""
    h, kernel, _, labels = head_operands(rng, (2, 150), 64, vocab, jnp.bfloat16, ignore_index=-100)
    h = (h.astype(F32) + random(rng, (64,), F32)).astype(jnp.bfloat16)
    kernel = (kernel.astype(F32) + 0.5 * random(rng, (64, 1), F32)).astype(jnp.bfloat16)
    ours, ref = odd_vocabulary_head(layout, False, reduction, labels, smoothing=0.5)
    check_value_and_grads(ours, ref, (h, kernel))


def test_exp_path_with_most_rows_out_of_its_range(rng):
    # 90 of 150 tokens out of the exp path's range, in every chunk: the second passes shift them
    # all, the other rows' P as the first pass gave it
    lead, hidden, vocab = (150,), 32, 200
    h, kernel, _, labels = head_operands(rng, lead, hidden, vocab, jnp.bfloat16)
    h = h.at[::5].multiply(300.0).at[1::5].multiply(300.0).at[2::5].multiply(300.0)
    check_value_and_grads(*head_call({}, labels, None, "mean", chunk=64), (h, kernel), None)


def test_exp_path_label_outside_the_vocabulary_is_nan(rng):
    # as on the cross-entropy path (test_argument_errors): under jit a label outside [0, V) cannot
    # be checked, and the loss comes out NaN -- and the gradients, on the exp path too
    h, kernel, _, labels = head_operands(rng, (40,), 32, 200, jnp.bfloat16)
    total = jax.jit(jax.value_and_grad(lambda h, y: linear_cross_entropy(h, kernel, y, reduction="sum")))
    assert np.isfinite(total(h, labels)[0]) and np.isnan(total(h, labels.at[7].set(200))[0])
    assert np.all(np.isnan(total(h, labels.at[7].set(200))[1][7]))


@pytest.mark.gpu
def test_float32_params_kernel_path_gpu(rng):
    h, kernel, bias, labels = head_operands(rng, (3, 333), 256, 1000, jnp.bfloat16, -100, param_dtype=F32)
    check_value_and_grads(*head_call({}, labels, -100, "mean", chunk=128), (h, kernel, bias), on_kernels=True)


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("layout", ["hv", "vh"])
def test_exp_path_kernels_gpu(layout, reduction, rng):
    """The exp path's kernels on the GPU, both kernel layouts (a (V, H) table read as stored by
    the logits GEMM): several chunks, z-loss, ignored tokens, and rows out of the exp's range
    for the fix loop -- loss (per token for "none", then a weighted sum) and gradients vs a
    float32 reference."""
    h, kernel, _, labels = head_operands(rng, (3, 333), 256, 1000, jnp.bfloat16, -100)
    h = h.at[0, 5].multiply(100.0).at[1, 7].multiply(100.0)  # logits past the clamp
    ours, ref = head_call({"z_loss": 1e-3, "kernel_layout": layout}, labels, -100, reduction, chunk=128)
    if reduction == "none":
        with cl.use_backend("cute"):
            assert_close(jax.jit(ours)(h, kernel, None), ref(h.astype(F32), kernel.astype(F32), None), jnp.bfloat16)
        weights = jnp.asarray(rng.uniform(0.5, 1.5, labels.shape), F32)
        ours, ref = weighted_sum(ours, weights), weighted_sum(ref, weights)
    check_value_and_grads(ours, ref, (h, kernel), None, on_kernels=True)


OPTIONS = [  # the loss options, each alone and all together, with an (H, V) or (V, H) kernel
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"logit_soft_cap": 3.0},
    {"kernel_layout": "vh"},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "logit_soft_cap": 5.0, "kernel_layout": "vh"},
]


def head_call(options, labels, ignore_index, reduction, chunk):
    """(ours, ref): loss functions of (h, kernel as the test draws it (H, V), bias) with
    ``options``; a "vh" layout hands our op the transposed table."""
    options = dict(options)
    layout = options.pop("kernel_layout", "hv")

    def ours(h, kernel, bias):
        table = kernel.T if layout == "vh" else kernel
        return linear_cross_entropy(h, table, labels, bias=bias, ignore_index=ignore_index, reduction=reduction,
                                    chunk_size=chunk, kernel_layout=layout, **options)

    def ref(h, kernel, bias):
        return reference_loss(f32_logits(h, kernel, bias), labels, ignore_index, reduction, **options)

    return ours, ref


def weighted_sum(loss_fn, weights):
    """Per-token losses summed with ``weights`` (positive: a signed sum would cancel, and its
    relative error be noise): a scalar whose gradients weigh every token."""
    def total(*args):
        return jnp.sum(loss_fn(*args) * weights)

    return total


def check_value_and_grads(ours, ref, primals, *rest, on_kernels=False):
    """ours (jitted; under backend "cute" if ``on_kernels``) against ref on float32 copies of
    ``primals``, both differentiated w.r.t. the primals (``rest`` follows them undifferentiated):
    the value and each gradient within bf16 tolerance, each gradient in its primal's dtype and
    shape. Returns ours' (value, gradients)."""
    argnums = tuple(range(len(primals)))
    with cl.use_backend("cute") if on_kernels else contextlib.nullcontext():
        value, grads = jax.jit(jax.value_and_grad(ours, argnums))(*primals, *rest)
    want, refs = jax.jit(jax.value_and_grad(ref, argnums))(*(a.astype(F32) for a in primals), *rest)
    assert_close(value, want, jnp.bfloat16)
    for g, g_ref, primal in zip(grads, refs, primals, strict=True):
        assert g.dtype == primal.dtype and g.shape == primal.shape
        assert_close(g, g_ref, jnp.bfloat16, scale=2.0)
    return value, grads


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_options(options, reduction, rng):
    lead, ignore_index = (3, 13), -100
    h, kernel, bias, labels = head_operands(rng, lead, 16, 40, F32, ignore_index)
    ours, ref = head_call(options, labels, ignore_index, reduction, chunk=7)
    weights = jnp.asarray(rng.uniform(0.5, 1.5, lead if reduction == "none" else ()), F32)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(ours(h, kernel, bias), ref(h, kernel, bias), rtol=1e-5, atol=1e-6)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(weights * ours(*a)), (0, 1, 2)))(h, kernel, bias)
        refs = jax.grad(lambda *a: jnp.sum(weights * ref(*a)), (0, 1, 2))(h, kernel, bias)
    for g, g_ref in zip(grads, refs):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6)


def test_return_lse(rng):
    h, kernel, bias, labels = head_operands(rng, (2, 9), 16, 40, F32, ignore_index=-100)
    for reduction in ("mean", "sum", "none"):
        loss, lse = linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=-100, reduction=reduction,
                                         logit_soft_cap=4.0, chunk_size=4, return_lse=True)
        assert lse.shape == (2, 9) and lse.dtype == F32
        logits = f32_logits(h, kernel, bias)
        want = jax.nn.logsumexp(4.0 * jnp.tanh(logits / 4.0), axis=-1)
        np.testing.assert_allclose(lse, want, rtol=1e-5, atol=1e-5)
        assert loss.shape == ((2, 9) if reduction == "none" else ())
    # lse carries no gradient; the loss's gradient is the same with or without it
    head = functools.partial(linear_cross_entropy, kernel=kernel, labels=labels, ignore_index=-100)
    g_with = jax.grad(lambda h: jnp.sum(head(h, return_lse=True)[1]))(h)
    assert not np.any(g_with)
    g = jax.grad(lambda h: head(h, return_lse=True)[0])(h)
    np.testing.assert_allclose(g, jax.grad(head)(h))


def odd_vocabulary_head(layout, with_bias, reduction, labels, z_loss=1e-3, smoothing=0.0):
    """(ours, reference) of a head whose kernel is given (H, V) and read in ``layout``, ignoring
    label -100, as a weighted sum where ``reduction`` is "none"."""
    options = {"z_loss": z_loss, "label_smoothing": smoothing}

    def ours(h, kernel, *bias):
        return linear_cross_entropy(h, kernel if layout == "hv" else kernel.T, labels, bias=bias[0] if bias else None,
                                    ignore_index=-100, reduction=reduction, chunk_size=128, kernel_layout=layout,
                                    **options)

    def ref(h, kernel, *bias):
        return reference_loss(f32_logits(h, kernel, bias[0] if bias else None), labels, -100, reduction, **options)

    if reduction == "none":
        weights = jnp.linspace(0.5, 1.5, labels.size, dtype=F32).reshape(labels.shape)
        ours, ref = weighted_sum(ours, weights), weighted_sum(ref, weights)
    return ours, ref


def far_below_zero(h, kernel, tokens):
    """h and kernel with the logits of ``tokens`` (flat indices) all about -100 (and every other
    token's moved by its first feature): the exp path's second pass shifts those rows by their
    max logit, which a padded vocabulary's zero columns (logit 0) must not be."""
    kernel = kernel.at[0].set(1.0)
    flat = h.reshape(-1, h.shape[-1])
    return flat.at[jnp.asarray(tokens), 0].set(-100.0).reshape(h.shape), kernel


@pytest.mark.parametrize("layout,with_bias,vocab,smoothing", [
    ("hv", False, 253, 0.0), ("vh", False, 253, 0.0), ("hv", True, 253, 0.0), ("vh", True, 253, 0.0),
    ("hv", False, 200, 0.0), ("vh", True, 200, 0.0), ("hv", False, 253, 0.1), ("vh", False, 200, 0.1)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_odd_vocabulary_through_the_kernel_path(layout, with_bias, vocab, smoothing, reduction, rng):
    """V not a multiple of 64 -- of 8 (the kernels' TMA alignment) or not -- runs the kernel path
    on a vocabulary padded to one, its padding left out by the exp path's GEMMs (no bias; rows far
    below zero too; label smoothing's mean over the V classes alone) or masked by a -inf bias:
    loss and gradients of the head as given, in their shapes (on the CPU the kernels' reference
    lowering runs, chunk by chunk)."""
    h, kernel, bias, labels = head_operands(rng, (2, 150), 64, vocab, jnp.bfloat16, ignore_index=-100)
    if not with_bias:  # the exp path (bf16 logits about -100 would be 0.25 apart on the other)
        h, kernel = far_below_zero(h, kernel, [1, 200])
    ours, ref = odd_vocabulary_head(layout, with_bias, reduction, labels, smoothing=smoothing)
    check_value_and_grads(ours, ref, (h, kernel, bias) if with_bias else (h, kernel))


def test_odd_vocabulary_padding_is_no_class(rng):
    """A label in the padding, [V, V rounded up to 64), is outside the vocabulary as any other: a
    NaN loss, not the padding's -inf logit (an infinite loss); ignore_index there is ignored."""
    h, kernel, _, labels = head_operands(rng, (6,), 64, 201, jnp.bfloat16)  # padded to 256
    labels = labels.at[2].set(230)  # traced labels (concrete ones outside the vocabulary raise)
    head = jax.jit(linear_cross_entropy, static_argnames=("ignore_index", "reduction"))
    loss = head(h, kernel, labels, reduction="none")
    assert np.isnan(loss[2]) and np.isfinite(np.delete(np.asarray(loss), 2)).all()
    loss = head(h, kernel, labels, ignore_index=230, reduction="none")
    assert loss[2] == 0 and np.isfinite(np.asarray(loss)).all()


@pytest.mark.cute
@pytest.mark.parametrize("vocab", [50257, 50280])
def test_odd_vocabulary_lowers_to_the_kernels_for_cuda(vocab):
    """V = 50257 (GPT-2's) or 50280 (a multiple of 8, not of 64): the head's GEMMs on the padded
    50304 columns -- the exp path's, which leave the padding out (label smoothing too: its mean
    over the classes is a rank-one term of the kernel's columns), or with a bias the
    cross-entropy path's and its kernel; label smoothing with a bias keeps the vocabulary
    unpadded: XLA's GEMMs at 50257 (its mean over the classes would count the -inf padding), the
    kernels at 50280."""
    tokens, hidden = 4096, 128
    S = jax.ShapeDtypeStruct
    avals = (S((tokens, hidden), jnp.bfloat16), S((hidden, vocab), jnp.bfloat16), S((tokens,), jnp.int32))

    def loss(h, kernel, labels, *bias, smoothing=0.0):
        return linear_cross_entropy(h, kernel, labels, bias=bias[0] if bias else None, ignore_index=-100,
                                    label_smoothing=smoothing)

    with cl.use_backend("auto"):
        plain = lower_cuda(jax.value_and_grad(loss, (0, 1)), *avals)
        smoothed = lower_cuda(jax.value_and_grad(functools.partial(loss, smoothing=0.1), (0, 1)), *avals)
        for hlo in (plain, smoothed):
            calls = collections.Counter(kernel_targets(hlo))
            # one chunk: the exp GEMM and its two passes over rows out of range, dh and dkernel
            assert calls == {"linear_fwd": 1, "linear_exp_fix": 2, "linear_dkernel": 1, "linear_dx": 1}, calls
        biased = lower_cuda(jax.value_and_grad(loss, (0, 1, 3)), *avals, S((vocab,), jnp.bfloat16))
        assert collections.Counter(kernel_targets(biased)) == {"linear_fwd": 1, "cross_entropy_with_grad": 1,
                                                               "linear_dkernel": 1, "linear_dx": 1}
        for hlo in (plain, smoothed, biased):  # every kernel reads and writes the padded width
            calls = [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]
            assert all("50304" in line and str(vocab) not in line for line in calls), calls
        smoothed_biased = lower_cuda(jax.value_and_grad(functools.partial(loss, smoothing=0.1), (0, 1, 3)),
                                     *avals, S((vocab,), jnp.bfloat16))
        gemms = [t for t in kernel_targets(smoothed_biased) if t.startswith("linear_")]
        assert bool(gemms) == (vocab % 8 == 0)  # XLA's GEMMs at 50257


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["hv", "vh"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("vocab", [1001, 1000])
def test_odd_vocabulary_kernel_path_gpu(layout, with_bias, reduction, vocab, rng):
    """The padded vocabulary on the GPU (V = 1001 or 1000, padded to 1024; several chunks, the
    last one partial), the padding left out by the exp path's GEMMs (with rows far below zero: its
    second pass) or masked by a -inf bias appended to the head's own: loss and every gradient vs a
    float32 reference."""
    h, kernel, bias, labels = head_operands(rng, (3, 333), 256, vocab, jnp.bfloat16, ignore_index=-100)
    if not with_bias:
        h, kernel = far_below_zero(h, kernel, [5, 400, 998])
    ours, ref = odd_vocabulary_head(layout, with_bias, reduction, labels)
    check_value_and_grads(ours, ref, (h, kernel, bias) if with_bias else (h, kernel), on_kernels=True)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,vocab", [("hv", 1001), ("vh", 1000)])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_exp_path_label_smoothing_gpu(layout, vocab, reduction, rng):
    """Label smoothing on the exp path's kernels (its mean logit and the gradients' rank-one terms
    from the kernel's column sums), at a vocabulary padded to 1024 and one not, with z-loss and
    rows far below zero (the second pass): loss and every gradient vs a float32 reference."""
    h, kernel, _, labels = head_operands(rng, (3, 333), 256, vocab, jnp.bfloat16, ignore_index=-100)
    h, kernel = far_below_zero(h, kernel, [5, 400, 998])
    ours, ref = odd_vocabulary_head(layout, False, reduction, labels, smoothing=0.1)
    with cl.use_backend("cute"):
        assert "linear_exp_fix" in kernel_targets(lower_cuda(jax.grad(ours, (0, 1)), h, kernel))
    check_value_and_grads(ours, ref, (h, kernel), on_kernels=True)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, OPTIONS[-1]], ids=["plain", "all-options"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_kernel_path_gpu(options, reduction, rng):
    """The kernels on the GPU, several chunks (the last one padded): loss and every gradient vs a
    float32 reference, dkernel summed over the chunks by its GEMM."""
    h, kernel, bias, labels = head_operands(rng, (3, 333), 256, 1000, jnp.bfloat16, ignore_index=-100)
    ours, ref = head_call(options, labels, -100, reduction, chunk=128)
    if reduction == "none":
        weights = jnp.asarray(rng.uniform(0.5, 1.5, labels.shape), F32)
        ours, ref = weighted_sum(ours, weights), weighted_sum(ref, weights)
    check_value_and_grads(ours, ref, (h, kernel, bias), on_kernels=True)


def test_vmap_jit_grad_compositions(rng):
    h, kernel, bias, labels = head_operands(rng, (3, 4, 9), 16, 24, F32, ignore_index=-100)

    def ours(h, labels, kernel, bias):
        return linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=-100, chunk_size=5)

    def ref(h, labels, kernel, bias):
        return reference_loss(f32_logits(h, kernel, bias), labels, -100)

    tol = {"rtol": 1e-4, "atol": 1e-6}
    shared = (0, 0, None, None)
    args = (h, labels, kernel, bias)
    with jax.default_matmul_precision("highest"):
        # nested vmap: a mean per example
        np.testing.assert_allclose(jax.vmap(jax.vmap(ours, shared), shared)(*args),
                                   jax.vmap(jax.vmap(ref, shared), shared)(*args), **tol)
        # per-example kernels
        kernels = jnp.stack([kernel, -kernel, 2 * kernel])
        np.testing.assert_allclose(jax.vmap(ours, (0, 0, 0, None))(h, labels, kernels, bias),
                                   jax.vmap(ref, (0, 0, 0, None))(h, labels, kernels, bias), **tol)
        # jit(grad(vmap)): summed over examples
        total = lambda f: lambda *a: jnp.sum(jax.vmap(f, shared)(*a))
        for g, g_ref in zip(jax.jit(jax.grad(total(ours), (0, 2, 3)))(*args), jax.grad(total(ref), (0, 2, 3))(*args)):
            np.testing.assert_allclose(g, g_ref, **tol)
        # vmap(grad): per-example gradients of the shared kernel and bias
        per_example = jax.vmap(jax.grad(ours, (2, 3)), shared)(*args)
        for g, g_ref in zip(per_example, jax.vmap(jax.grad(ref, (2, 3)), shared)(*args)):
            assert g.shape[0] == 3
            np.testing.assert_allclose(g, g_ref, **tol)


@pytest.mark.parametrize("on_kernels", [pytest.param(False), pytest.param(True, marks=pytest.mark.gpu)],
                         ids=["reference", "gpu"])
def test_exp_path_under_vmap(on_kernels, rng):
    """The exp path (bfloat16, no bias) under jax.vmap: nested vmaps, a per-example kernel,
    grad(vmap) and vmap(grad) against the reference, with a row past the clamp in one example
    only (its passes over flagged rows run on the folded rows of all examples)."""
    h, kernel, _, labels = head_operands(rng, (3, 2, 70), 32, 200, jnp.bfloat16, ignore_index=-100)
    h = h.at[1, 0, 9].multiply(100.0)

    def ours(h, labels, kernel):
        return linear_cross_entropy(h, kernel, labels, ignore_index=-100, chunk_size=64)

    def ref(h, labels, kernel):
        return reference_loss(f32_logits(h, kernel, None), labels, -100)

    shared = (0, 0, None)
    f32 = lambda *a: tuple(x.astype(F32) if x.dtype == jnp.bfloat16 else x for x in a)
    args = (h, labels, kernel)
    with cl.use_backend("cute") if on_kernels else contextlib.nullcontext():
        nested = jax.jit(jax.vmap(jax.vmap(ours, shared), shared))(*args)
        kernels = jnp.stack([kernel, -kernel, 2 * kernel])
        per_kernel = jax.jit(jax.vmap(ours, (0, 0, 0)))(h, labels, kernels)
        total = lambda f: lambda *a: jnp.sum(jax.vmap(f, shared)(*a))
        grads = jax.jit(jax.grad(total(ours), (0, 2)))(*args)
        per_example = jax.jit(jax.vmap(jax.grad(ours, 2), shared))(*args)
    assert_close(nested, jax.vmap(jax.vmap(ref, shared), shared)(*f32(*args)), jnp.bfloat16)
    assert_close(per_kernel, jax.vmap(ref, (0, 0, 0))(*f32(h, labels, kernels)), jnp.bfloat16)
    for g, g_ref in zip(grads, jax.grad(total(ref), (0, 2))(*f32(*args)), strict=True):
        assert_close(g, g_ref, jnp.bfloat16, scale=2.0)
    assert per_example.shape == (3, *kernel.shape)
    assert_close(per_example, jax.vmap(jax.grad(ref, 2), shared)(*f32(*args)), jnp.bfloat16, scale=2.0)


@pytest.mark.cute
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_exp_path_under_vmap_lowers_to_one_launch_per_kernel(reduction):
    """A vmapped head's batch folds into the exp GEMM's rows and those of its passes: the launches
    of the unbatched call, on every example's tokens at once."""
    batch, tokens, hidden, vocab = 4, 512, 128, 1024
    S = jax.ShapeDtypeStruct

    def loss(h, kernel, labels):
        return jnp.sum(linear_cross_entropy(h, kernel, labels, reduction=reduction))

    batched = jax.vmap(loss, (0, None, 0))
    hlo = lower_cuda(jax.value_and_grad(lambda *a: jnp.sum(batched(*a)), (0, 1)), S((batch, tokens, hidden), jnp.bfloat16),
                     S((hidden, vocab), jnp.bfloat16), S((batch, tokens), jnp.int32))
    exp_gemms = 1 + (reduction == "none")  # one chunk; per-token losses recompute it in the backward
    calls = collections.Counter(kernel_targets(hlo))
    assert calls["linear_fwd"] == exp_gemms and calls["linear_exp_fix"] == 2 * exp_gemms, calls
    fixes = [line for line in hlo.splitlines() if "@cutelayers_linear_exp_fix" in line]
    assert all(f"tensor<1x{batch * tokens}x{hidden}xbf16>" in line for line in fixes), fixes


def test_no_tokens_by_vocab_array(rng):
    tokens, hidden, vocab, chunk = 2048, 64, 512, 256
    S = jax.ShapeDtypeStruct
    avals = (S((2, tokens // 2, hidden), F32), S((hidden, vocab), F32), S((vocab,), F32), S((2, tokens // 2), jnp.int32))

    def loss(h, kernel, bias, labels):
        return linear_cross_entropy(h, kernel, labels, bias=bias, chunk_size=chunk)

    def naive(h, kernel, bias, labels):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ kernel + bias[None, None], labels))

    def hlo(f):
        return jax.jit(jax.value_and_grad(f, (0, 1, 2))).trace(*avals).lower().as_text()

    assert f"{tokens // 2}x{vocab}x" in hlo(naive)  # what the string looks like when it is there
    text = hlo(loss)
    assert f"{chunk}x{vocab}xf32" in text
    assert f"{tokens}x{vocab}x" not in text and f"{tokens // 2}x{vocab}x" not in text


def token_sized_copies(hlo: str, size: int) -> list[tuple[str, str]]:
    """(op, shape) of every transpose or copy of at least ``size`` elements, fused or not."""
    return [(op, dims) for dims, op in re.findall(r"= \w+\[([\d,]+)\]\S* (transpose|copy)\(", hlo)
            if math.prod(int(d) for d in dims.split(",")) >= size]


def test_strided_chunks_never_copy_h_whole():
    """Chunk c is column c of the (rows, chunks) view of the tokens: the loops read h's chunks
    and write dh's in place, and neither array is transposed or copied as a whole."""
    tokens, hidden, vocab, chunk = 4096, 128, 1024, 512
    S = jax.ShapeDtypeStruct
    avals = (S((tokens, hidden), F32), S((hidden, vocab), F32), S((tokens,), jnp.int32))

    def loss(h, kernel, labels):
        return linear_cross_entropy(h, kernel, labels, chunk_size=chunk)

    def transposed(h):  # what a whole-h transpose looks like when it is there
        return jnp.swapaxes(h.reshape(chunk, -1, hidden), 0, 1) * 2

    assert token_sized_copies(jax.jit(transposed).lower(avals[0]).compile().as_text(), tokens * hidden)
    hlo = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(*avals).compile().as_text()
    assert f"f32[{chunk},1,{hidden}]" in hlo  # a chunk read from the strided view
    assert token_sized_copies(hlo, tokens * hidden) == []


@pytest.mark.cute
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_lowers_to_the_kernels_for_cuda(reduction):
    """Every chunk's GEMMs are our kernels, and a bfloat16 head without bias runs the exp path:
    one GEMM per chunk gives exp(logits) and their row sums (two results), and no cross-entropy
    pass runs; two more launches of it per chunk run the tiles of the rows out of its range, in
    place, and the program has no loop whose trip count depends on the data (the host would wait
    for the device). A mean or sum computes the gradients in the forward; per-token losses
    recompute the exp GEMM in the backward. With a bias, the cross-entropy kernels instead."""
    tokens, hidden, vocab, chunk = 4096, 128, 1024, 512
    S = jax.ShapeDtypeStruct
    avals = (S((tokens, hidden), jnp.bfloat16), S((hidden, vocab), jnp.bfloat16), S((tokens,), jnp.int32))

    def loss(h, kernel, labels, bias=None):
        out = linear_cross_entropy(h, kernel, labels, bias=bias, ignore_index=-100, chunk_size=chunk,
                                   reduction=reduction)
        return jnp.sum(out)

    hlo = lower_cuda(jax.value_and_grad(loss, (0, 1)), *avals)
    calls = collections.Counter(kernel_targets(hlo))
    # The loops that sum gradients run their first chunk before the loop over the others (the
    # sums start from it): their calls are in the program twice.
    exp_gemms = 2 + (reduction == "none")  # per-token losses: the forward's loop, then the backward's
    assert calls == {"linear_fwd": exp_gemms, "linear_exp_fix": 2 * exp_gemms, "linear_dkernel": 2,
                     "linear_dx": 2}, calls
    forwards = [line for line in hlo.splitlines() if "@cutelayers_linear_fwd" in line]
    assert all(f"-> (tensor<1x{chunk}x{vocab}xbf16>, tensor<1x{chunk}x{vocab // 64}xf32>)" in line
               for line in forwards), forwards
    # the second passes write exp(logits) in place of the first's
    fixes = [line for line in hlo.splitlines() if "@cutelayers_linear_exp_fix" in line]
    assert all("output_operand_aliases" in line and f"-> (tensor<1x{chunk}x{vocab}xbf16>" in line
               for line in fixes), fixes
    # the loops: the chunks' scans, one for a total, forward and backward for per-token losses
    assert hlo.count("stablehlo.while") == 1 + (reduction == "none")
    # with a bias: the logits GEMM and the cross-entropy kernels (the loss and its gradient in one
    # pass for a total; forward, then the backward recomputing the logits, for per-token losses)
    biased = collections.Counter(kernel_targets(lower_cuda(jax.value_and_grad(loss, (0, 1, 3)), *avals,
                                                           S((vocab,), jnp.bfloat16))))
    if reduction == "none":
        assert biased == {"linear_fwd": 1 + 2, "cross_entropy_fwd": 1, "cross_entropy_bwd": 2, "linear_dkernel": 2,
                          "linear_dx": 2}, biased
    else:
        assert biased == {"linear_fwd": 2, "cross_entropy_with_grad": 2, "linear_dkernel": 2, "linear_dx": 2}, biased
    # dkernel is summed over the chunks by the GEMM itself: the first chunk's is a float32
    # result, to which each later chunk's GEMM adds its own in the float32 carry it aliases; no
    # (H, V) zeros are made and no (H, V) add runs per chunk, and one cast gives the gradient its
    # dtype at the end
    first, running = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    out = f"tensor<1x{hidden}x{vocab}xf32>"
    assert first.endswith(f"xbf16>) -> {out}") and "output_operand_aliases" not in first
    assert running.endswith(f"{out}) -> {out}") and "output_operand_aliases" in running
    # the only scalar spread over (H, V) is a total's gradient scale (there are no zeros)
    scalar_fills = re.findall(rf"broadcast_in_dim %\w+, dims = \[\] : \(tensor<f32>\) -> tensor<(1x)?{hidden}x{vocab}xf32>",
                              hlo)
    assert len(scalar_fills) == (reduction != "none")
    assert not re.findall(rf"stablehlo\.add .*tensor<(1x)?{hidden}x{vocab}x", hlo)
    assert len(re.findall(rf"stablehlo\.convert .*tensor<{hidden}x{vocab}xf32>\) ->", hlo)) == 1
    # without differentiation: the exp GEMM and its passes only
    assert collections.Counter(kernel_targets(lower_cuda(loss, *avals))) == {"linear_fwd": 1, "linear_exp_fix": 2}
    assert f"{tokens}x{vocab}x" not in hlo
    # a float32 kernel: cast to bfloat16 for the GEMMs (again in the backward that recomputes the
    # logits), and its gradient is the float32 sum as it is: no convert of an (H, V) gradient
    hlo = lower_cuda(jax.value_and_grad(loss, (0, 1)), avals[0], S((hidden, vocab), F32), avals[2])
    converts = re.findall(rf"stablehlo\.convert .*tensor<(?:1x)?{hidden}x{vocab}x(\w+)>\) -> tensor<(?:1x)?{hidden}x{vocab}x(\w+)>",
                          hlo)
    assert converts == [("f32", "bf16")] * (1 + (reduction == "none")), converts


@pytest.mark.cute
def test_vocab_major_exp_path_lowers_to_the_kernels_for_cuda():
    """A (V, H) table (an Equinox head, a tied embedding) takes the exp path too: the logits GEMM
    reads the table as stored and gives exp(logits) with their row sums, no cross-entropy kernel
    runs, dh is the plain forward GEMM on the table and dkernel a (V, H) float32 sum."""
    tokens, hidden, vocab, chunk = 4096, 128, 1024, 512
    S = jax.ShapeDtypeStruct
    avals = (S((tokens, hidden), jnp.bfloat16), S((vocab, hidden), jnp.bfloat16), S((tokens,), jnp.int32))

    def loss(h, table, labels):
        return linear_cross_entropy(h, table, labels, chunk_size=chunk, kernel_layout="vh")

    hlo = lower_cuda(jax.value_and_grad(loss, (0, 1)), *avals)
    calls = collections.Counter(kernel_targets(hlo))
    # per chunk (the first one before the loop): the exp GEMM and dh, both linear_fwd, the exp
    # GEMM's two passes over rows out of its range, and the dkernel GEMMs
    assert calls == {"linear_fwd": 2 + 2, "linear_exp_fix": 2 * 2, "linear_dkernel": 2}, calls
    forwards = [line for line in hlo.splitlines() if "@cutelayers_linear_fwd" in line]
    exp_gemms = [line for line in forwards if f"tensor<1x{chunk}x{vocab // 64}xf32>" in line]
    assert len(exp_gemms) == 2 and all(f"tensor<1x{vocab}x{hidden}xbf16>" in line for line in exp_gemms), forwards
    dkernels = [line for line in hlo.splitlines() if "@cutelayers_linear_dkernel" in line]
    assert all(line.endswith(f"-> tensor<1x{vocab}x{hidden}xf32>") for line in dkernels), dkernels


def test_chunk_layout():
    assert chunk_layout((16384,), 50304, None) == (4, 4096)  # CHUNK_ROWS
    assert chunk_layout((10_000,), 500_000, None) == (10, 1000)  # <= 1073 rows of 500k float32 logits
    assert chunk_layout((5,), 2**30, None) == (5, 1)
    # chunk counts from the fewest (here 5) up to twice that: the first dividing the tokens
    assert chunk_layout((48,), 40, 10) == (6, 8)  # not 5 chunks of 10, 2 rows padded
    # ... preferring one that divides the tokens of each leading index (batch row)
    assert chunk_layout((3, 16), 40, 10) == (8, 6)  # 6 divides 48 but not 16
    # ... else padded equal chunks
    assert chunk_layout((37,), 40, 10) == (4, 10)  # prime
    assert chunk_layout((41,), 40, 10) == (5, 9)  # 4 padded rows, not 9
    assert chunk_layout((34,), 40, 10) == (4, 9)  # 17 divides 34: more than twice the fewest


def test_empty_and_fully_ignored(rng):
    h, kernel, bias, _ = head_operands(rng, (0, 4), 8, 16, F32)
    labels = jnp.zeros((0, 4), jnp.int32)
    assert linear_cross_entropy(h, kernel, labels, bias=bias) == 0.0
    assert linear_cross_entropy(h, kernel, labels, reduction="none").shape == (0, 4)
    g = jax.grad(lambda k: linear_cross_entropy(h, k, labels))(kernel)
    assert g.shape == kernel.shape and not np.any(g)
    h, kernel, bias, _ = head_operands(rng, (6,), 8, 16, F32)
    labels = jnp.full((6,), -1)
    assert linear_cross_entropy(h, kernel, labels, ignore_index=-1) == 0.0
    g = jax.grad(lambda k: linear_cross_entropy(h, k, labels, ignore_index=-1))(kernel)
    assert not np.any(g)


def test_linear_cross_entropy_errors():
    h, kernel, labels = jnp.ones((4, 8)), jnp.ones((8, 10)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="reduction must be one of 'mean', 'sum', 'none'; got 'avg'"):
        linear_cross_entropy(h, kernel, labels, reduction="avg")
    with pytest.raises(ValueError, match=r"'labels' has shape \(3,\); expected \(4,\) \(h's shape"):
        linear_cross_entropy(h, kernel, labels[:3])
    with pytest.raises(ValueError, match=r"'labels' holds 1 value\(s\) outside \[0, 10\)"):
        linear_cross_entropy(h, kernel, jnp.array([0, 1, 10, 2]))
    with pytest.raises(TypeError, match="'kernel' has dtype bfloat16 but 'h' has float32"):
        linear_cross_entropy(h, kernel.astype(jnp.bfloat16), labels)
    with pytest.raises(ValueError, match="'h' has 8 features .* 'kernel' expects K=10"):
        linear_cross_entropy(h, kernel.T, labels)
    with pytest.raises(ValueError, match=r"'bias' must have shape \(10,\)"):
        linear_cross_entropy(h, kernel, labels, bias=jnp.ones((8,)))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        linear_cross_entropy(h, kernel, labels, chunk_size=0)
    with pytest.raises(TypeError, match="'chunk_size' must be an int"):
        linear_cross_entropy(h, kernel, labels, chunk_size=2.5)
    with pytest.raises(ValueError, match="kernel_layout must be one of 'hv', 'vh'; got 'kn'"):
        linear_cross_entropy(h, kernel, labels, kernel_layout="kn")
    with pytest.raises(ValueError, match=r"'h' has 8 features .* 'kernel' expects K=10 \(shape \(8, 10\)\)"):
        linear_cross_entropy(h, kernel, labels, kernel_layout="vh")  # a (V, H) table wanted
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\); got 1.0"):
        linear_cross_entropy(h, kernel, labels, label_smoothing=1.0)
    with pytest.raises(ValueError, match="z_loss must be >= 0; got -1"):
        linear_cross_entropy(h, kernel, labels, z_loss=-1)
    with pytest.raises(ValueError, match="logit_soft_cap must be None or a finite number > 0; got 0"):
        linear_cross_entropy(h, kernel, labels, logit_soft_cap=0)
    with pytest.raises(TypeError, match="'logit_soft_cap' must be a number; got 'big'"):
        linear_cross_entropy(h, kernel, labels, logit_soft_cap="big")
    with pytest.raises(TypeError, match="'label_smoothing' must be a number; got '0.1'"):
        linear_cross_entropy(h, kernel, labels, label_smoothing="0.1")
    with pytest.raises(TypeError, match="'logit_soft_cap' must be a number; got True"):
        linear_cross_entropy(h, kernel, labels, logit_soft_cap=True)
    with pytest.raises(ValueError, match="'z_loss' must be finite; got inf"):
        linear_cross_entropy(h, kernel, labels, z_loss=float("inf"))
    with pytest.raises(TypeError, match="'chunk_size' must be an int .*; got True"):
        linear_cross_entropy(h, kernel, labels, chunk_size=True)
    with pytest.raises(TypeError, match="'ignore_index' must be an int .*; got 1.5"):
        linear_cross_entropy(h, kernel, labels, ignore_index=1.5)  # int() would make it 1
    # under jit out-of-range labels cannot be checked: NaN for that token
    out = jax.jit(lambda l: linear_cross_entropy(h, kernel, l, reduction="none"))(jnp.array([0, 11, 1, 2]))
    assert np.isnan(out[1]) and np.all(np.isfinite(np.asarray(out)[[0, 2, 3]]))


# --- masked_mean_pool ------------------------------------------------------------------------------

def reference_pool(x, mask):
    keep = np.asarray(mask != 0, np.float64)[..., None]
    total = np.sum(np.asarray(x, np.float64) * keep, axis=-2)
    return total / np.maximum(np.sum(keep, axis=-2), 1.0)


@pytest.mark.parametrize("mask_dtype", [bool, jnp.int32, F32])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32])
def test_masked_mean_pool_values_and_grads(mask_dtype, dtype, rng):
    for lead in [(), (3,), (2, 4)]:
        x = random(rng, (*lead, 7, 5), dtype)
        mask = rng.random((*lead, 7)) < 0.5
        if lead:
            mask[(0,) * len(lead)] = False  # a row that keeps nothing pools to 0
        mask = jnp.asarray(mask, mask_dtype)
        out = masked_mean_pool(x, mask)
        assert out.dtype == x.dtype and out.shape == (*lead, 5)
        assert_close(out, reference_pool(x, mask), dtype, scale_ref=np.asarray(x, np.float64))
        if lead:
            assert not np.any(out[(0,) * len(lead)])

        cot = random(rng, out.shape, F32)
        dx = jax.grad(lambda x: jnp.sum(masked_mean_pool(x, mask).astype(F32) * cot))(x)
        dx_ref = jax.grad(lambda x: jnp.sum(jnp.asarray(reference_pool_jnp(x, mask)) * cot))(x.astype(F32))
        assert dx.dtype == x.dtype
        assert_close(dx, dx_ref, dtype)


def reference_pool_jnp(x, mask):
    keep = (mask != 0).astype(F32)[..., None]
    return jnp.sum(x * keep, axis=-2) / jnp.maximum(jnp.sum(keep, axis=-2), 1.0)


def test_masked_mean_pool_vmap_and_errors(rng):
    x = random(rng, (4, 6, 3), F32)
    mask = jnp.asarray(rng.random((4, 6)) < 0.5)
    np.testing.assert_allclose(jax.vmap(masked_mean_pool)(x, mask), masked_mean_pool(x, mask), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(lambda x, m: jnp.sum(masked_mean_pool(x, m)))))(x, mask),
                               jax.grad(lambda x: jnp.sum(masked_mean_pool(x, mask)))(x), rtol=1e-6)
    with pytest.raises(ValueError, match=r"'mask' has shape \(4, 5\); expected \(4, 6\)"):
        masked_mean_pool(x, mask[:, :5])
    with pytest.raises(ValueError, match="'x' has rank 1"):
        masked_mean_pool(x[0, 0], mask[0, :3])
    with pytest.raises(TypeError, match="'mask' must be an array"):
        masked_mean_pool(x, [[True] * 6] * 4)
    with pytest.raises(TypeError, match="'mask' must be bool or numeric; got dtype <U1"):
        masked_mean_pool(x, np.full((4, 6), "a"))
    # a NaN or inf where the mask drops the position stays out of the mean and of the gradient
    poisoned = x.at[0, 0, 0].set(jnp.nan).at[0, 1, 1].set(jnp.inf)
    drop_first = jnp.ones((4, 6), bool).at[0, :2].set(False)
    np.testing.assert_allclose(masked_mean_pool(poisoned, drop_first), masked_mean_pool(x, drop_first), rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(masked_mean_pool(x, drop_first)))(poisoned)
    assert np.all(np.isfinite(grad)) and np.all(grad[0, :2] == 0)


# --- LMHead modules --------------------------------------------------------------------------------

def test_linen_lm_head(rng):
    h, _, _, labels = head_operands(rng, (2, 9), 32, 48, jnp.bfloat16, ignore_index=-100)
    head = cl_linen.LMHead(48, ignore_index=-100, bias_init=nn.initializers.normal(1.0), chunk_size=8)
    stock = nn.Dense(48, bias_init=nn.initializers.normal(1.0))
    variables = head.init(jax.random.key(0), h, labels)
    stock_variables = stock.init(jax.random.key(0), h)
    same_tree(variables, stock_variables)  # a Dense head's checkpoint loads unchanged
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(stock_variables)):
        np.testing.assert_array_equal(a, b)

    def ref(v, h):
        return reference_loss(stock.apply(v, h), labels, -100)

    loss = lambda v, h: head.apply(v, h, labels)
    assert_matches(loss(variables, h), ref(variables, h), F32, scale=1.0)
    assert_trees_match(jax.jit(jax.grad(loss, (0, 1)))(variables, h), jax.grad(ref, (0, 1))(variables, h), F32)
    none = cl_linen.LMHead(48, reduction="none").apply(variables, h, jnp.where(labels < 0, 0, labels))
    assert none.shape == labels.shape and none.dtype == F32


def test_linen_lm_head_tied(rng):
    h, _, _, labels = head_operands(rng, (2, 9), 32, 48, F32)
    embed = nn.Embed(48, 32)
    table = embed.init(jax.random.key(1), labels)["params"]["embedding"]
    head = cl_linen.LMHead(48, tie_embedding=True, reduction="sum")
    variables = head.init(jax.random.key(0), h, labels, embedding=table)
    assert set(variables["params"]) == {"bias"}  # no kernel of its own

    def ours(v, table):
        return head.apply(v, h, labels, embedding=table)

    def ref(v, table):
        return reference_loss(h @ table.T + v["params"]["bias"][None, None], labels, reduction="sum")

    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(ours(variables, table), ref(variables, table), rtol=1e-5)
        for g, g_ref in zip(jax.grad(ours, (0, 1))(variables, table), jax.grad(ref, (0, 1))(variables, table)):
            assert_trees_match(g, g_ref, F32)
    with pytest.raises(ValueError, match="tie_embedding=True needs the embedding table"):
        head.apply(variables, h, labels)
    with pytest.raises(ValueError, match="got an embedding table but tie_embedding=False"):
        cl_linen.LMHead(48).init(jax.random.key(0), h, labels, embedding=table)
    with pytest.raises(ValueError, match=r"embedding has shape \(32, 48\); expected \(vocab_size, hidden\)"):
        head.apply(variables, h, labels, embedding=table.T)


def test_nnx_lm_head(rng):
    h, _, _, labels = head_operands(rng, (3, 5), 32, 40, F32, ignore_index=-100)
    kwargs = {"bias_init": nnx.initializers.normal(1.0), "param_dtype": jnp.bfloat16}
    head = cl_nnx.LMHead(32, 40, ignore_index=-100, chunk_size=4, rngs=nnx.Rngs(0), **kwargs)
    stock = nnx.Linear(32, 40, rngs=nnx.Rngs(0), **kwargs)
    state = nnx.state(stock, nnx.Param)
    same_tree(state, nnx.state(head, nnx.Param))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(head, nnx.Param))):
        np.testing.assert_array_equal(a, b)  # equal Rngs draw equal parameters

    def ref(m, h):
        return reference_loss(m(h), labels, -100)

    assert_matches(head(h, labels), ref(stock, h), jnp.bfloat16, scale=1.0)
    grads = nnx.jit(nnx.grad(lambda m, h: m(h, labels), argnums=(0, 1)))(head, h)
    assert_trees_match(grads, nnx.grad(ref, argnums=(0, 1))(stock, h), jnp.bfloat16)

    tied = cl_nnx.LMHead(32, 40, tie_embedding=True, use_bias=False, rngs=nnx.Rngs(0))
    assert tied.kernel is None and tied.bias is None
    embed = nnx.Embed(40, 32, rngs=nnx.Rngs(2))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(tied(h, jnp.where(labels < 0, 1, labels), embedding=embed.embedding[...]),
                                   reference_loss(embed.attend(h), jnp.where(labels < 0, 1, labels)), rtol=1e-5)


def test_equinox_lm_head(rng):
    h, _, _, labels = head_operands(rng, (3, 5), 32, 40, F32, ignore_index=-100)
    head = cl_eqx.LMHead(32, 40, ignore_index=-100, chunk_size=6, key=jax.random.key(4))
    stock = eqx.nn.Linear(32, 40, key=jax.random.key(4))
    same_tree(stock, head)  # a Linear head's checkpoint loads unchanged
    for a, b in zip(jax.tree.leaves(stock), jax.tree.leaves(head)):
        np.testing.assert_array_equal(a, b)

    def ref(m, h):
        return reference_loss(jax.vmap(jax.vmap(m))(h), labels, -100)

    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(head(h, labels), ref(stock, h), rtol=1e-5)
        grads = eqx.filter_jit(eqx.filter_grad(lambda m, h: m(h, labels)))(head, h)
        assert_trees_match(grads, eqx.filter_grad(ref)(stock, h), F32)

        tied = cl_eqx.LMHead(32, 40, tie_embedding=True, reduction="none", key=jax.random.key(4))
        assert tied.weight is None
        embed = eqx.nn.Embedding(40, 32, key=jax.random.key(5))
        ok = jnp.where(labels < 0, 3, labels)
        # per-token losses as a whole (one token's small loss may cancel to a large relative error)
        assert_close(tied(h, ok, embedding=embed.weight),
                     reference_loss(h @ embed.weight.T + tied.bias[None, None], ok, reduction="none"), F32)


def test_equinox_lm_head_under_x64_names_the_promoting_parameter(rng):
    # Equinox's default parameters are float64 under jax_enable_x64: they promote a float32 h, and
    # the error says so instead of blaming h; float32 parameters run as usual
    h = jnp.asarray(rng.standard_normal((4, 8)), F32)
    labels = jnp.arange(4) % 16
    with jax.enable_x64(True):
        head = cl_eqx.LMHead(8, 16, key=jax.random.key(0))
        with pytest.raises(TypeError, match=r"LMHead: the operands \(h float32, weight float64, bias float64\) "
                                            r"promote to float64; the head computes in bfloat16"):
            head(h, labels)
        loss = cl_eqx.LMHead(8, 16, dtype=F32, key=jax.random.key(0))(h, labels)
    assert loss.dtype == F32 and np.isfinite(loss)


@pytest.mark.parametrize("framework", ["linen", "nnx", "equinox"])
@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_modules_pass_the_loss_options(framework, tied, rng):
    """Every LMHead hands its loss options (and a tied or Equinox (V, H) table, read as stored) to
    linear_cross_entropy: the module's loss is the op's on the same arrays."""
    h, kernel, _, labels = head_operands(rng, (2, 7), 16, 24, F32, ignore_index=-1)
    options = {"ignore_index": -1, "label_smoothing": 0.1, "z_loss": 1e-2, "logit_soft_cap": 2.0, "chunk_size": 5}
    table = kernel.T  # (V, H)
    embedding = {"embedding": table} if tied else {}
    if framework == "linen":
        head = cl_linen.LMHead(24, use_bias=False, tie_embedding=tied, **options)
        variables = head.init(jax.random.key(0), h, labels, **embedding)
        if not tied:
            variables = {"params": {"kernel": kernel}}
        loss = head.apply(variables, h, labels, **embedding)
    elif framework == "nnx":
        head = cl_nnx.LMHead(16, 24, use_bias=False, tie_embedding=tied, rngs=nnx.Rngs(0), **options)
        if not tied:
            head.kernel[...] = kernel
        loss = head(h, labels, **embedding)
    else:
        head = cl_eqx.LMHead(16, 24, use_bias=False, tie_embedding=tied, key=jax.random.key(0), **options)
        if not tied:
            head = eqx.tree_at(lambda m: m.weight, head, table)
        loss = head(h, labels, **embedding)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(loss, linear_cross_entropy(h, kernel, labels, **options), rtol=1e-5)
        np.testing.assert_allclose(loss, reference_loss(h @ kernel, labels, -1, label_smoothing=0.1, z_loss=1e-2,
                                                        logit_soft_cap=2.0), rtol=1e-5)


# --- MeanPoolClassifier modules ----------------------------------------------------------------------

def pooled_operands(rng, lead, dtype):
    x = random(rng, (*lead, 10, 16), dtype)
    mask = rng.random((*lead, 10)) < 0.6
    mask[..., 0] = True
    return x, jnp.asarray(mask)


def test_linen_mean_pool_classifier(rng):
    x, mask = pooled_operands(rng, (3,), jnp.bfloat16)
    model = cl_linen.MeanPoolClassifier(5, bias_init=nn.initializers.normal(1.0))
    variables = model.init(jax.random.key(0), x, mask)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"head": {"kernel": (16, 5), "bias": (5,)}}}
    pooled = reference_pool_jnp(x.astype(F32), mask).astype(jnp.bfloat16)
    ref = lambda v, x: nn.Dense(5).apply({"params": v["params"]["head"]}, reference_pool_jnp(x, mask))
    # the pooled features are rounded to bfloat16, where a different summation order may land one
    # ulp apart: bfloat16 tolerance on the float32 logits
    assert_matches(model.apply(variables, x, mask), nn.Dense(5).apply({"params": variables["params"]["head"]}, pooled),
                   jnp.bfloat16)
    grads = jax.grad(lambda v, x: jnp.sum(jnp.sin(model.apply(v, x, mask))), (0, 1))(variables, x)
    grads_ref = jax.grad(lambda v, x: jnp.sum(jnp.sin(ref(v, x))), (0, 1))(variables, x.astype(F32))
    assert_trees_match(grads[0], grads_ref[0], jnp.bfloat16)
    assert_close(grads[1], grads_ref[1], jnp.bfloat16)


def test_nnx_mean_pool_classifier(rng):
    x, mask = pooled_operands(rng, (2, 3), F32)
    model = cl_nnx.MeanPoolClassifier(16, 5, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    stock = nnx.Linear(16, 5, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
    same_tree(nnx.state(model.head, nnx.Param), nnx.state(stock, nnx.Param))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(nnx.jit(lambda m, x: m(x, mask))(model, x), stock(reference_pool_jnp(x, mask)),
                                   rtol=1e-5, atol=1e-6)


def test_equinox_mean_pool_classifier(rng):
    x, mask = pooled_operands(rng, (4,), F32)
    model = cl_eqx.MeanPoolClassifier(16, 5, key=jax.random.key(0))
    stock = eqx.nn.Linear(16, 5, key=jax.random.key(0))
    same_tree(model.head, stock)
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(jax.vmap(model)(x, mask), jax.vmap(stock)(reference_pool_jnp(x, mask)),
                                   rtol=1e-5, atol=1e-6)
        grads = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(x, mask))))(model)
        grads_ref = eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(reference_pool_jnp(x, mask)))))(stock)
        assert_trees_match(grads.head, grads_ref, F32)
