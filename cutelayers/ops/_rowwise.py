"""Shared plumbing of row-wise ops: argument checks, (rows, features) views, vmap folding (also
ahead of differentiation), and the tunable row-kernel family."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.extend.core import Primitive, jaxpr_as_fun
from jax.interpreters import ad, batching, mlir

from cutelayers.runtime.family import TunableFamily
from cutelayers.runtime.placement import check_arrays
from cutelayers.runtime.sharding import kernel_call
from cutelayers.runtime.tensors import FLOAT_DTYPES
from cutelayers.tuning import dtype_names, resolve


class RowKernelFamily(TunableFamily):
    """The row kernels' shared implementation of :class:`~cutelayers.runtime.family.TunableFamily`:
    kernels on (rows, n) operands whose config is a :class:`cutelayers.kernels.reduction.RowConfig`.

    Subclasses give ``kernel_class()`` (imported when called: importing cutelayers does not import
    CuTe), whose ``VALUES_PER_THREAD`` selects the heuristic (:func:`.row_geometry`) and the space
    (:func:`.row_geometry_space`) of :mod:`cutelayers.kernels.reduction` for register-resident row
    kernels -- or override ``default_config`` and ``config_space`` (the row-reduce kernel) -- and
    may override ``row_dtypes(avals)``: the dtypes of the operands the kernel walks along the row
    (the widest sets the vector width; default: the first operand's). The tuned table's key is
    those dtypes and N. ``per_row_rank`` says which operands have a symbolic row count.
    """

    per_row_rank: int | None = None
    """The rank of the operands and results that hold one value per row (their leading dim the
    symbolic row count); None: all of them. The norms' are rank 2: their rank-1 arrays are
    per-feature parameters and flat partial sums, fully static."""

    def dynamic_dims_at(self, position, aval) -> tuple[bool, ...]:
        per_row = self.per_row_rank in (None, len(aval.shape))
        return tuple(per_row and i == 0 for i in range(len(aval.shape)))

    def kernel_class(self):
        raise NotImplementedError

    def row_dtypes(self, avals) -> tuple:
        return (avals[0].dtype,)

    def row_length(self, avals) -> int:
        return avals[0].shape[-1]

    def elem_bits(self, avals) -> int:
        return max(jnp.dtype(d).itemsize * 8 for d in self.row_dtypes(avals))

    def default_config(self, avals):
        from cutelayers.kernels.reduction import row_geometry

        return row_geometry(self.row_length(avals), self.elem_bits(avals), self.kernel_class().VALUES_PER_THREAD).row

    def config_space(self, avals) -> tuple:
        from cutelayers.kernels.reduction import row_geometry_space

        space = row_geometry_space(self.row_length(avals), self.elem_bits(avals), self.kernel_class().VALUES_PER_THREAD)
        return tuple(g.row for g in space)

    def tuning_key(self, avals):
        return dtype_names(self.row_dtypes(avals)), (("n", self.row_length(avals)),)

    def config_from_fields(self, fields: dict):
        from cutelayers.kernels.reduction import RowConfig

        return RowConfig(**fields)

    def geometry(self, avals):
        """The chosen config applied to these operands' rows."""
        from cutelayers.kernels.reduction import geometry_for

        return geometry_for(self.chosen_config(), self.row_length(avals), self.elem_bits(avals))


def check_float_array(op: str, name: str, x, min_rank: int = 1) -> jax.Array:
    """Validate a floating-point operand; returns it as a JAX array (or tracer)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: argument {name!r} must be an array; got {type(x).__name__}")
    dtype = jnp.dtype(x.dtype)
    if dtype not in FLOAT_DTYPES:
        allowed = ", ".join(d.name for d in FLOAT_DTYPES)
        raise TypeError(f"{op}: argument {name!r} has dtype {dtype.name}; allowed: {allowed}")
    if len(x.shape) < min_rank:
        raise ValueError(
            f"{op}: argument {name!r} has rank {len(x.shape)} (shape {tuple(x.shape)}); "
            f"it needs rank >= {min_rank}"
        )
    if min_rank and x.shape[-1] < 1:
        raise ValueError(f"{op}: argument {name!r} has an empty last axis (shape {tuple(x.shape)})")
    check_arrays({name: x}, op)
    return jnp.asarray(x)


def normalize_axis(op: str, axis, ndim: int) -> int:
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{op}: argument 'axis' must be an int; got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def call_kernel(family: TunableFamily, *operands: jax.Array) -> tuple[jax.Array, ...]:
    """``family``, its config chosen for these operands, called on them; the first operand is
    (rows, ...), and zero rows skip the launch."""
    family = resolve(family, operands)
    if operands[0].shape[0] == 0:
        return tuple(jnp.zeros(o.shape, o.dtype) for o in family.out_avals(operands))
    return kernel_call(family, *operands)


def call_on_rows(family: RowKernelFamily, *row_args: jax.Array) -> tuple[jax.Array, ...]:
    """Run ``family`` on row-wise arrays viewed as (rows, ...), then restore the leading shape.

    The first argument's leading dims (all but the last) are the rows; every argument has those
    leading dims plus its own trailing ones (x (..., N), labels (...)), and so has every result.
    """
    lead = row_args[0].shape[:-1]
    rows = tuple(a.reshape(-1, *a.shape[len(lead):]) for a in row_args)
    return tuple(o.reshape(*lead, *o.shape[1:]) for o in call_kernel(family, *rows))


def row_batched(fn, shared: tuple[int, ...] = ()):
    """Wrap ``fn(*args)`` in a ``custom_vmap`` that folds batch dims into rows.

    Every positional argument not listed in ``shared`` is row-wise: a pytree of arrays with any
    leading shape, rows lined up across arguments. The rule moves each batch dim to the front and
    calls the wrapped function again, so nested vmaps become one kernel launch over more rows; an
    unbatched row-wise argument next to batched ones is broadcast first.

    ``shared`` arguments (parameters such as a scale vector) are the same for every row. When one
    of them is batched (a per-example parameter) rows can no longer share it, and the rule falls
    back to ``jax.lax.map`` over the batch: correct, one launch per example.
    """
    batched_fn = custom_vmap(fn)

    @batched_fn.def_vmap
    def rule(axis_size, in_batched, *args):
        shared_batched = any(
            any(jax.tree.leaves(in_batched[i])) for i in shared if i < len(args)
        )
        if shared_batched:
            def one(example):
                return batched_fn(*example)

            example_args = [
                jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)), arg, bat)
                for arg, bat in zip(args, in_batched)
            ]
            out = jax.lax.map(one, tuple(example_args))
        else:
            args = [
                arg if i in shared else jax.tree.map(
                    lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)), arg, bat)
                for i, (arg, bat) in enumerate(zip(args, in_batched))
            ]
            out = batched_fn(*args)
        return out, jax.tree.map(lambda _: True, out)

    return functools.wraps(fn)(batched_fn)


# --- vmap folding ahead of differentiation ----------------------------------------------------------
#
# JAX batches a custom_vjp's forward and backward separately, so under grad(vmap(f)) the backward
# runs per example and the gradients of unbatched inputs are summed afterwards -- for a GEMM's
# weight, a (batch, K, N) intermediate. No custom_vmap rule inside the custom_vjp can avoid that:
# the backward is batched the same way under vmap(grad(f)), where per-example gradients are the
# result, so nothing a rule sees tells the two apart. And custom_vmap around the custom_vjp is
# not differentiable in reverse mode (custom_vmap_p has a JVP rule but no partial evaluation or
# transpose: jax.grad raises "Linearization failed to produce known values"). A primitive can have
# both rules: its batching rule folds the batch into rows and binds it again, its JVP rule
# differentiates the custom_vjp, so whichever transformation comes first decides.

_row_call_p = Primitive("cutelayers_row_call")
_row_call_p.multiple_results = True


def _eval_call(*flat_args, call, **_):
    return jaxpr_as_fun(call)(*flat_args)


_row_call_p.def_impl(_eval_call)
_row_call_p.def_abstract_eval(lambda *avals, call, **_: call.out_avals)
mlir.register_lowering(_row_call_p, mlir.lower_fun(_eval_call, multiple_results=True))


def _bind_row_call(fn, in_tree, shared_leaves, flat_args):
    # Traced now, where the caller runs (inside shard_map, with sharded types), not when lowered.
    def flat_fn(*a):
        return fn(*jax.tree.unflatten(in_tree, a))

    call, out_shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
    out = _row_call_p.bind(*flat_args, fn=fn, in_tree=in_tree, shared_leaves=shared_leaves, call=call)
    return jax.tree.unflatten(jax.tree.structure(out_shapes), out)


def _row_call_batching(flat_args, dims, *, fn, in_tree, shared_leaves, call):
    del call
    if any(d is not None and shared for d, shared in zip(dims, shared_leaves)):
        # Per-example parameters: rows cannot share them; fn's own rules batch it.
        out = jax.vmap(fn, in_axes=jax.tree.unflatten(in_tree, dims))(*jax.tree.unflatten(in_tree, flat_args))
    else:
        size = next(a.shape[d] for a, d in zip(flat_args, dims) if d is not None)
        leading = [
            a if shared else jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
            for a, d, shared in zip(flat_args, dims, shared_leaves)
        ]
        out = _bind_row_call(fn, in_tree, shared_leaves, leading)
    flat_out = jax.tree.leaves(out)
    return flat_out, [0] * len(flat_out)


def _row_call_jvp(primals, tangents, *, fn, in_tree, shared_leaves, call):
    del shared_leaves, call
    tangents = [ad.instantiate_zeros(t) for t in tangents]  # jax.jvp takes arrays only
    args, arg_tangents = (jax.tree.unflatten(in_tree, leaves) for leaves in (primals, tangents))
    out, out_tangents = jax.jvp(fn, args, arg_tangents)
    return jax.tree.leaves(out), jax.tree.leaves(out_tangents)


batching.primitive_batchers[_row_call_p] = _row_call_batching
ad.primitive_jvps[_row_call_p] = _row_call_jvp


def row_batched_vjp(fn, shared: tuple[int, ...] = ()):
    """``fn`` -- a ``jax.custom_vjp`` function on rows -- with a vmap rule that folds batch dims
    into rows *before* differentiation sees the call.

    Arguments are as for :func:`row_batched` (row-wise pytrees with any leading shape; ``shared``
    parameters the same for every row). Under ``grad(vmap(f))`` the vmap folds first and ``fn``'s
    backward runs once on all rows, so a shared parameter's gradient is one sum over every row
    instead of per-example gradients summed afterwards. Under ``vmap(grad(f))`` (per-example
    gradients) ``fn`` is differentiated first and JAX batches its forward and backward, which
    should therefore be vmappable themselves (:func:`row_batched` pieces). A batched shared
    parameter makes the call ``jax.vmap(fn)`` (fn's own batching). Forward-mode ``jax.jvp`` fails
    as for any custom_vjp.
    """

    def call(*args):
        flat_args, in_tree = jax.tree.flatten(args)
        shared_leaves = tuple(i in shared for i, arg in enumerate(args) for _ in jax.tree.leaves(arg))
        return _bind_row_call(fn, in_tree, shared_leaves, flat_args)

    return functools.wraps(fn)(call)
