"""vmap for every op: one rule that folds batch dimensions into a kernel's rows.

A CuTe kernel runs on (rows, ...) operands, so a batch of calls is one call on more rows. Ops make
their functions vmappable with :func:`fold_batch`::

    layer = fold_batch(fn, shared=(1, 2))

``fn`` takes *row-wise* arguments -- pytrees of arrays with any leading shape, the rows lined up
across arguments (x (..., N), labels (...)) -- and *shared* ones, the positions in ``shared``:
parameters that are the same for every row (a norm's scale, a GEMM's kernel and bias). Its results
are row-wise. Under ``jax.vmap`` (any ``in_axes``, nested, under ``jax.jit``) the rule is:

1. No shared argument batched: every row-wise argument gets the batch as its leading axis (moved
   there, or broadcast when that argument is not batched), and the wrapped function is called
   again on them -- ``fn`` sees one more leading dim, i.e. more rows. Nested vmaps fold one after
   another: one kernel launch on all their rows.

   ``batched=`` replaces that call where more rows are not the answer: a result that sums over
   the rows (a norm's dscale, a GEMM's dkernel) must keep one sum per example. It is called with
   the same arguments (the batch leading every row-wise one) and gives every result with the
   batch leading.
2. A shared argument batched (a per-example parameter): the rows cannot share it. With
   ``per_example`` (a function of one example's arguments that ``jax.vmap`` batches by itself:
   the op's jnp reference, or a ``jax.custom_vjp`` built of folding pieces), ``jax.vmap`` of it;
   otherwise ``jax.lax.map`` of the wrapped function over the examples, one launch each.

Where ops apply it. The rule is the batching rule of one primitive, whose JVP rule differentiates
``fn``; so whichever of ``jax.vmap`` and ``jax.grad`` reaches the call first decides:

* Around the pieces inside an op's ``jax.custom_vjp`` (the forward and backward kernel calls):
  JAX batches a custom_vjp's forward and backward separately, and each piece folds its batch. This
  is every op's vmap: under ``vmap(grad(f))`` it is all there is.
* Around the ``jax.custom_vjp`` itself, too, for ops whose backward reduces a shared weight's
  gradient over the rows with a kernel (``fused_linear``, ``mlp``, the norms): under ``grad(vmap(f))`` (the
  Equinox style) the batch folds *before* differentiation, so the backward runs once on all rows
  and dkernel is one GEMM over all of them, not a (batch, K, N) stack of per-example gradients
  summed afterwards. No rule inside the custom_vjp could do that: the backward is batched the same
  way under ``vmap(grad(f))``, where per-example gradients are the result. (JAX's
  ``custom_vmap`` around the custom_vjp cannot either: it is not differentiable in reverse mode.)
  Its ``per_example`` is the custom_vjp, whose pieces batch a per-example kernel themselves.

Forward-mode ``jax.jvp`` of an op fails as for any ``jax.custom_vjp``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

fold_batch_p = Primitive("cutelayers_fold_batch")
fold_batch_p.multiple_results = True


def _evaluate(*flat_args, call, **_):
    return jaxpr_as_fun(call)(*flat_args)


fold_batch_p.def_impl(_evaluate)
fold_batch_p.def_abstract_eval(lambda *avals, call, **_: call.out_avals)
mlir.register_lowering(fold_batch_p, mlir.lower_fun(_evaluate, multiple_results=True))


@dataclasses.dataclass(frozen=True)
class _Folding:
    """The primitive's parameters besides the traced call: ``fn`` and the options of
    :func:`fold_batch`, ``shared`` per flattened argument leaf."""

    fn: Callable
    shared: tuple[bool, ...]
    per_example: Callable | None
    batched: Callable | None


def _bind(folding: _Folding, in_tree, flat_args):
    # Traced now, where the caller runs (inside shard_map, with sharded types), not when lowered.
    def flat_fn(*leaves):
        return folding.fn(*jax.tree.unflatten(in_tree, leaves))

    call, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
    out = fold_batch_p.bind(*flat_args, folding=folding, in_tree=in_tree, call=call)
    return jax.tree.unflatten(jax.tree.structure(out_shapes), out)


def _batching_rule(flat_args, dims, *, folding: _Folding, in_tree, call):
    del call
    size = next(a.shape[d] for a, d in zip(flat_args, dims) if d is not None)
    leading = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(flat_args, dims)]

    def broadcast(a, d):
        return jnp.broadcast_to(a, (size, *a.shape)) if d is None else a

    if any(d is not None and shared for d, shared in zip(dims, folding.shared)):
        # Per-example parameters: the rows cannot share them.
        if folding.per_example is not None:
            in_axes = jax.tree.unflatten(in_tree, [None if d is None else 0 for d in dims])
            out = jax.vmap(folding.per_example, in_axes=in_axes)(*jax.tree.unflatten(in_tree, leading))
        else:
            examples = [broadcast(a, d) for a, d in zip(leading, dims)]
            out = jax.lax.map(lambda leaves: _bind(folding, in_tree, leaves), examples)
    else:
        leading = [a if shared else broadcast(a, d) for a, d, shared in zip(leading, dims, folding.shared)]
        if folding.batched is not None:
            out = folding.batched(*jax.tree.unflatten(in_tree, leading))
        else:
            out = _bind(folding, in_tree, leading)
    flat_out = jax.tree.leaves(out)
    return flat_out, [0] * len(flat_out)


def _jvp_rule(primals, tangents, *, folding: _Folding, in_tree, call):
    del call
    tangents = [ad.instantiate_zeros(t) for t in tangents]  # jax.jvp takes arrays only
    args, arg_tangents = (jax.tree.unflatten(in_tree, leaves) for leaves in (primals, tangents))
    out, out_tangents = jax.jvp(folding.fn, args, arg_tangents)
    return jax.tree.leaves(out), jax.tree.leaves(out_tangents)


batching.primitive_batchers[fold_batch_p] = _batching_rule
ad.primitive_jvps[fold_batch_p] = _jvp_rule


def fold_batch(fn: Callable, *, shared: tuple[int, ...] = (), per_example: Callable | None = None,
               batched: Callable | None = None) -> Callable:
    """``fn`` with the vmap rule of this module: batch dims fold into rows.

    Args:
      fn: takes row-wise arguments and, at the positions ``shared``, parameters shared by every
        row; its results are row-wise (see the module docstring).
      shared: positions of the shared arguments.
      per_example: a function of one example's arguments that ``jax.vmap`` batches, for a batched
        shared argument; None: ``jax.lax.map`` over the examples.
      batched: called instead of the folded call when no shared argument is batched, with the
        batch leading every row-wise argument; for results that sum over rows per example.

    Returns:
      A function of the same arguments and results.
    """

    @functools.wraps(fn)
    def call(*args):
        flat_args, in_tree = jax.tree.flatten(args)
        shared_leaves = tuple(i in shared for i, arg in enumerate(args) for _ in jax.tree.leaves(arg))
        return _bind(_Folding(fn, shared_leaves, per_example, batched), in_tree, flat_args)

    return call
