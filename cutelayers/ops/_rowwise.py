"""Shared plumbing of row-wise ops: argument checks, (rows, features) views, vmap folding, and
the tunable row-kernel family."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from cutelayers.runtime.placement import check_arrays
from cutelayers.runtime.primitive import kernel_call
from cutelayers.runtime.tensors import FLOAT_DTYPES
from cutelayers.tuning import TunableFamily, dtype_names


class RowKernelFamily(TunableFamily):
    """A tunable family of row kernels on (rows, n) operands; its config is a
    :class:`cutelayers.kernels.reduction.RowConfig`.

    Subclasses give ``kernel_class()`` (imported when called: importing cutelayers does not import
    CuTe), whose ``VALUES_PER_THREAD`` selects the heuristic (:func:`.row_geometry`) and the space
    (:func:`.row_geometry_space`) of :mod:`cutelayers.kernels.reduction` for register-resident row
    kernels -- or override ``default_config`` and ``config_space`` (the row-reduce kernel) -- and
    may override ``row_dtypes(avals)``: the dtypes of the operands the kernel walks along the row
    (the widest sets the vector width; default: the first operand's). The tuned table's key is
    those dtypes and N.
    """

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


def call_on_rows(family: RowKernelFamily, *row_args: jax.Array, params: tuple = ()) -> tuple[jax.Array, ...]:
    """Run ``family`` (its config chosen for these operands) on row-wise arrays viewed as
    (rows, ...), then restore the leading shape.

    The first argument's leading dims (all but the last) are the rows; every row-wise argument
    has those leading dims plus its own trailing ones (x (..., N), labels (...)). ``params`` pass
    through unchanged. Each result of the kernel is (rows, ...); zero rows skip the launch.
    """
    lead = row_args[0].shape[:-1]
    rows = tuple(a.reshape(-1, *a.shape[len(lead):]) for a in row_args)
    operands = (*rows, *params)
    family = family.resolved(operands)
    if rows[0].shape[0] == 0:
        outs = [jnp.zeros(o.shape, o.dtype) for o in family.out_avals(operands)]
    else:
        outs = kernel_call(family, *operands)
    return tuple(o.reshape(*lead, *o.shape[1:]) for o in outs)


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
