"""vmap of every op (cutelayers.ops._batching), one set of checks for all: vmap over one and two
axes (in_axes 0 and 1), per-example parameters, vmap(grad), grad(vmap) and jit, each against the op
applied to one example at a time -- values and gradients; and the CUDA lowering of vmapped calls:
the kernels of one call, on all the rows, and no loop over the examples."""

import dataclasses
import os
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, random
from test_linear import lower_cuda

from cutelayers import ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

B1, B2 = 2, 3  # batch sizes of the outer and inner vmap
LEAD = (4,)  # leading (row) dims of one example


@dataclasses.dataclass(frozen=True)
class Case:
    """``fn(*args)`` on one example: ``make(rng, lead, dtype)`` builds its arguments, row-wise ones
    with leading dims ``lead``; ``shared``: the positions of parameters shared by every row;
    ``wrt``: the positions differentiated."""

    name: str
    fn: Callable
    make: Callable
    shared: tuple[int, ...] = ()
    wrt: tuple[int, ...] = (0,)
    dtype: object = jnp.float32
    rows_fold: bool = True  # vmap's kernel calls are one call's on all the rows (the LM head's chunks
    # are each example's tokens)
    cute: bool = False  # fn is CuTe DSL code (a user kernel): the case needs the DSL even off CUDA

    def args(self, rng, lead=LEAD, dtype=None):
        return self.make(rng, lead, dtype or self.dtype)

    def __repr__(self):
        return self.name


def _x(n):
    return lambda rng, lead, dtype: (random(rng, (*lead, n), dtype),)


def _norm(n=64, bias=True, residual=False):
    """(make, shared, wrt) of a norm over n features: x [, residual] row-wise, scale [, bias]."""
    rows = 1 + residual

    def make(rng, lead, dtype):
        params = (random(rng, (n,), dtype, loc=1.0),) + ((random(rng, (n,), dtype),) if bias else ())
        return tuple(random(rng, (*lead, n), dtype) for _ in range(rows)) + params

    shared = tuple(range(rows, rows + 1 + bias))
    return make, shared, tuple(range(rows)) + shared


def _labels(rng, lead, v):
    return jnp.asarray(rng.integers(0, v, lead), jnp.int32)


def _cross_entropy(rng, lead, dtype, v=64):
    return random(rng, (*lead, v), dtype), _labels(rng, lead, v)


def _linear(rng, lead, dtype, k=64, n=32):
    kernel = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return random(rng, (*lead, k), dtype), kernel, random(rng, (n,), dtype), random(rng, (*lead, n), dtype)


def _mlp(rng, lead, dtype, k=32, h=64, n=32):
    w1 = jnp.asarray(rng.standard_normal((k, h)) / np.sqrt(k), dtype)
    w2 = jnp.asarray(rng.standard_normal((h, n)) / np.sqrt(h), dtype)
    return random(rng, (*lead, k), dtype), w1, random(rng, (h,), dtype), w2, random(rng, (n,), dtype)


def _lm_head(rng, lead, dtype, h=32, v=64):
    kernel = jnp.asarray(rng.standard_normal((h, v)) / np.sqrt(h), dtype)
    return random(rng, (*lead, h), dtype), _labels(rng, lead, v), kernel, random(rng, (v,), dtype)


def _pool(rng, lead, dtype, s=8, d=64):
    return random(rng, (*lead, s, d), dtype), jnp.asarray(rng.integers(0, 2, (*lead, s)), jnp.int32)


def _embed(rng, lead, dtype, vocab=20, h=16):
    """Token ids (repeating: few distinct) and the table they index."""
    return jnp.asarray(rng.integers(-5, 5, (*lead, 6)), jnp.int32), random(rng, (vocab, h), dtype)


def _row_scale(rng, lead, dtype, n=64):
    return random(rng, (*lead, n), dtype), random(rng, lead, dtype)


def _row_scale_op(x, s):
    """examples/custom_kernel.py's op, imported when first called (it defines a CuTe kernel)."""
    import custom_kernel

    return custom_kernel.row_scale(x, s)


BF16 = jnp.bfloat16

CASES = [
    Case("reduce_sum", ops.reduce_sum, _x(64)),
    Case("reduce_max", ops.reduce_max, _x(64)),
    Case("layer_norm", ops.layer_norm, *_norm()),
    Case("rms_norm", ops.rms_norm, *_norm(bias=False)),
    Case("add_layer_norm", ops.add_layer_norm, *_norm(residual=True)),
    Case("add_rms_norm", ops.add_rms_norm, *_norm(bias=False, residual=True)),
    Case("softmax", ops.softmax, _x(64)),
    Case("log_softmax", ops.log_softmax, _x(64)),
    Case("logsumexp", ops.logsumexp, _x(64)),
    Case("softmax_cross_entropy", lambda x, labels: ops.softmax_cross_entropy(x, labels, label_smoothing=0.1),
         _cross_entropy),
    # bfloat16: the GEMMs run their kernels' path (float32 runs XLA GEMMs)
    Case("fused_linear", lambda x, k, b, r: ops.fused_linear(x, k, b, activation="gelu", residual=r), _linear,
         (1, 2), (0, 1, 2, 3), BF16),
    Case("mlp", lambda x, w1, b1, w2, b2: ops.mlp(x, w1, b1, w2, b2), _mlp, (1, 2, 3, 4), (0, 1, 2, 3, 4), BF16),
    Case("linear_cross_entropy", lambda h, labels, k, b: ops.linear_cross_entropy(h, k, labels, bias=b), _lm_head,
         (2, 3), (0, 2, 3), BF16, rows_fold=False),
    # no bias: the exp path (the exp GEMM and its passes over flagged rows)
    Case("linear_cross_entropy_exp", lambda h, labels, k: ops.linear_cross_entropy(h, k, labels),
         lambda rng, lead, dtype: _lm_head(rng, lead, dtype)[:3], (2,), (0, 2), BF16, rows_fold=False),
    Case("masked_mean_pool", ops.masked_mean_pool, _pool),
    Case("embed", lambda ids, table: ops.embed(table, ids), _embed, (1,), (1,)),
    Case("cute_call custom_op", _row_scale_op, _row_scale, (), (0, 1), cute=True),
]


def params(cases):
    """``cases`` as pytest parameters, the user kernel's marked `cute`."""
    return [pytest.param(c, id=c.name, marks=[pytest.mark.cute] if c.cute else []) for c in cases]


# --- the op one example at a time ---------------------------------------------------------------------

def _loss(fn):
    """A scalar of ``fn``'s results whose cotangents differ per element."""
    return lambda *args: sum(jnp.sum(jnp.sin(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(fn(*args)))


def _batched(case, rng, batch, per_example_params=False):
    """Arguments of ``prod(batch)`` examples with ``batch`` leading every row-wise one (and every
    parameter if ``per_example_params``; otherwise the first example's), and which are batched."""
    examples = [case.args(rng) for _ in range(int(np.prod(batch)))]
    batched = [i for i in range(len(examples[0])) if per_example_params or i not in case.shared]
    args = [jnp.stack([e[i] for e in examples]).reshape(*batch, *a.shape) if i in batched else a
            for i, a in enumerate(examples[0])]
    return args, batched


def _examples(args, batched, batch):
    """The arguments of each example, in row-major order over ``batch``."""
    count = int(np.prod(batch))
    flat = [a.reshape(count, *a.shape[len(batch):]) if i in batched else a for i, a in enumerate(args)]
    return [[a[e] if i in batched else a for i, a in enumerate(flat)] for e in range(count)]


def _stack(results, batch):
    """Per-example pytrees stacked into one with the batch leading."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves).reshape(*batch, *leaves[0].shape), *results)


def _assert_trees_close(got, want, dtype):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        assert_close(g, np.asarray(jnp.asarray(w, jnp.float32)), dtype, scale=2.0)


def _in_axes(args, batched, axis=0):
    return tuple(axis if i in batched else None for i in range(len(args)))


# --- values -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("case", params(CASES))
def test_vmap_matches_the_op_per_example(case, axis, rng):
    args, batched = _batched(case, rng, (B1,))
    want = _stack([case.fn(*e) for e in _examples(args, batched, (B1,))], (B1,))
    moved = [jnp.moveaxis(a, 0, axis) if i in batched else a for i, a in enumerate(args)]
    got = jax.vmap(case.fn, _in_axes(args, batched, axis))(*moved)
    _assert_trees_close(got, want, case.dtype)


@pytest.mark.parametrize("case", params(CASES))
def test_nested_vmap_under_jit_matches_the_op_per_example(case, rng):
    args, batched = _batched(case, rng, (B1, B2))
    want = _stack([case.fn(*e) for e in _examples(args, batched, (B1, B2))], (B1, B2))
    in_axes = _in_axes(args, batched)
    got = jax.jit(jax.vmap(jax.vmap(case.fn, in_axes), in_axes))(*args)
    _assert_trees_close(got, want, case.dtype)


@pytest.mark.parametrize("case", params([c for c in CASES if c.shared]))
def test_per_example_parameters(case, rng):
    args, batched = _batched(case, rng, (B1,), per_example_params=True)
    examples = _examples(args, batched, (B1,))
    _assert_trees_close(jax.vmap(case.fn)(*args), _stack([case.fn(*e) for e in examples], (B1,)), case.dtype)
    # grad(vmap): each example's parameters get their own gradient
    got = jax.grad(_loss(jax.vmap(case.fn)), case.wrt)(*args)
    want = _stack([jax.grad(_loss(case.fn), case.wrt)(*e) for e in examples], (B1,))
    _assert_trees_close(got, want, case.dtype)


# --- gradients ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", params(CASES))
def test_vmap_of_grad_gives_per_example_gradients(case, rng):
    args, batched = _batched(case, rng, (B1,))
    grad = jax.grad(_loss(case.fn), case.wrt)
    want = _stack([grad(*e) for e in _examples(args, batched, (B1,))], (B1,))
    _assert_trees_close(jax.vmap(grad, _in_axes(args, batched))(*args), want, case.dtype)


@pytest.mark.parametrize("case", params(CASES))
def test_grad_of_vmap_sums_shared_gradients(case, rng):
    args, batched = _batched(case, rng, (B1, B2))
    grad = jax.grad(_loss(case.fn), case.wrt)
    per_example = _stack([grad(*e) for e in _examples(args, batched, (B1, B2))], (B1, B2))
    want = tuple(g if i in batched else jnp.sum(g.astype(jnp.float32), (0, 1)).astype(g.dtype)
                 for i, g in zip(case.wrt, per_example))
    in_axes = _in_axes(args, batched)
    got = jax.jit(jax.grad(_loss(jax.vmap(jax.vmap(case.fn, in_axes), in_axes)), case.wrt))(*args)
    _assert_trees_close(got, want, case.dtype)


# --- CUDA lowering: the kernels of one call on all the rows ---------------------------------------------

_TARGET = re.compile(r"@cutelayers_(\w+?)_[0-9a-f]{16}\(")


def kernel_calls(hlo: str, operands_only: bool = False) -> list[str]:
    """The kernel custom calls, as target name and operand (and result) types."""
    calls = []
    for line in hlo.splitlines():
        match = _TARGET.search(line)
        if match:
            types = line.rsplit(" : ", 1)[1]
            calls.append(f"{match.group(1)} {types.split(' -> ')[0] if operands_only else types}")
    return calls


def _avals(case, rng, batch):
    """Avals of ``case``'s bfloat16 arguments with ``batch`` leading the row-wise ones."""
    args, batched = _batched(dataclasses.replace(case, dtype=BF16), rng, batch)
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args], batched


@pytest.mark.cute
@pytest.mark.parametrize("case", params(CASES))
def test_vmapped_calls_lower_to_the_kernels_of_one_call(case, rng):
    """vmap(vmap(f)) and grad(vmap(vmap(f))): the kernels of f called once on all the rows (row
    folds: the same rows in each call); vmap(grad(f)): the kernels of grad(f), each launched once."""
    batched_avals, batched = _avals(case, rng, (B1, B2))
    in_axes = _in_axes(batched_avals, batched)
    twice = jax.vmap(jax.vmap(case.fn, in_axes), in_axes)
    one_avals, _ = _avals(case, rng, ())
    if case.rows_fold:  # the same arguments with every batch folded into their rows
        one_avals = [jax.ShapeDtypeStruct((B1 * B2 * LEAD[0], *a.shape[len(LEAD):]), a.dtype) if i in batched else a
                     for i, a in enumerate(one_avals)]

    def names(calls):
        return [c.split()[0] for c in calls]

    values = kernel_calls(lower_cuda(twice, *batched_avals))
    one_call = kernel_calls(lower_cuda(case.fn, *one_avals))
    assert values == one_call if case.rows_fold else names(values) == names(one_call)

    grads = lower_cuda(jax.grad(_loss(twice), case.wrt), *batched_avals)
    one_grad = lower_cuda(jax.grad(_loss(case.fn), case.wrt), *one_avals)
    if case.rows_fold:
        # operands alike: the norms' batched backward writes dx only (dscale / dbias stay per example)
        assert kernel_calls(grads, operands_only=True) == kernel_calls(one_grad, operands_only=True)
        assert "stablehlo.while" not in grads
    else:
        assert names(kernel_calls(grads)) == names(kernel_calls(one_grad))

    per_example = lower_cuda(jax.vmap(jax.grad(_loss(case.fn), case.wrt), _in_axes(batched_avals, batched)),
                             *_avals(case, rng, (B1,))[0])
    assert names(kernel_calls(per_example)) == names(kernel_calls(one_grad))
    if case.rows_fold:
        assert "stablehlo.while" not in per_example
