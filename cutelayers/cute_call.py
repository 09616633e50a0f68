"""Bring your own kernel: call a user-written CuTe DSL launcher from JAX.

``cute_call`` gives user kernels the machinery the layers use: the kernel-call primitive, the
compile-once cache (statistics under ``name`` in :func:`cutelayers.cache_info`), placement checks,
per-platform lowering, and helpers for differentiation (:func:`custom_op`) and batching
(:func:`rowwise_vmap`).

Signature rules. The launcher is a ``@cute.jit`` function
``launcher(stream, *inputs, *outputs, **constexpr)``:

* ``inputs`` are the call's positional arguments, pytrees flattened in order; ``outputs`` are the
  leaves of ``out_shape`` in order, minus those written in place of an input
  (``input_output_aliases``);
* ``constexpr`` values are the keyword arguments given to :func:`cute_call` (Python values, never
  arrays); they are compile-time constants and part of the compile key;
* ``stream`` is XLA's stream for the call.

Dynamic vs static dims. Each dim a kernel sees is either static (a compile-time constant, part of
the compile key) or dynamic (``cute.sym_int``: one compile serves every size). By default the
leading dim of every array is dynamic and the rest static, so one compile serves every batch size.
Dynamic dims that are equal at a call share one symbol (the kernel may rely on that); a call where
they differ compiles separately.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import marshal
import os
import re
import sysconfig
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cutelayers.ops._batching import fold_batch
from cutelayers.runtime.family import KernelFamily, ShardingRule
from cutelayers.runtime.placement import check_arrays
from cutelayers.runtime.sharding import kernel_call
from cutelayers.runtime.tensors import cutlass_dtype

__all__ = ["custom_op", "cute_call", "rowwise_vmap"]


@dataclasses.dataclass(frozen=True)
class UserKernel(KernelFamily):
    """A user launcher with its call plan; a hashable primitive parameter."""

    user_launcher: Callable
    kernel_name: str
    out_structs: tuple[tuple[tuple[int, ...], str], ...]
    out_tree: Any
    in_tree: Any
    dynamic: tuple[tuple[int, ...], ...]  # per operand, then per result
    modes: tuple[tuple[int, ...] | None, ...]
    aliases: tuple[tuple[int, int], ...]
    constexpr: tuple[tuple[str, Hashable], ...]
    compile_key: Hashable | None
    user_reference: Callable | None
    graph_safe: bool = True

    @property
    def name(self) -> str:
        return self.kernel_name

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(f"input[{i}]" for i in range(self.in_tree.num_leaves))

    def identity(self):
        # Result shapes enter the key through out_avals (dynamic dims masked), not through here;
        # the reference never shapes the kernel; a user compile_key stands for the launcher, with
        # the code of what it reaches that has no file on disk (a notebook cell, ``python -c``).
        plan = dataclasses.replace(self, out_structs=None, user_reference=None)
        if self.compile_key is None:
            return plan
        return (self.compile_key, dataclasses.replace(plan, user_launcher=None),
                reached_code(self.user_launcher)[1])

    def sharding_rule(self, avals):
        # out_shape is the global, fixed result shape, so the kernel cannot run on a shard: under
        # sharded jit every operand must be replicated (per-device calls: use jax.shard_map).
        def whole(shape):
            return (None,) * len(shape)

        return ShardingRule(tuple(whole(a.shape) for a in avals), tuple(whole(s) for s, _ in self.out_structs))

    def source_files(self):
        # Editing the launcher's module, or a user module it reaches (its kernel's), invalidates
        # the disk cache entries.
        return reached_code(self.user_launcher)[0]

    def out_avals(self, avals):
        return tuple(jax.ShapeDtypeStruct(s, d) for s, d in self.out_structs)

    def dynamic_dims_at(self, position, aval):
        return tuple(axis in self.dynamic[position] for axis in range(len(aval.shape)))

    def modes_at(self, position):
        return self.modes[position]

    def operand_output_aliases(self):
        return dict(self.aliases) or None

    def kept_outputs(self, n_outputs):
        aliased = {o for _, o in self.aliases}
        return tuple(o for o in range(n_outputs) if o not in aliased)

    def constexpr_items(self):
        return self.constexpr

    def launcher(self, avals, out_avals):
        return self.user_launcher

    def reference(self, *arrays):
        if self.user_reference is None:
            raise NotImplementedError(
                f"cute_call {self.kernel_name!r} has no reference implementation, so it only lowers "
                "for CUDA with a Hopper target. Pass reference=fn (jnp, same inputs and outputs) to "
                "run it on other platforms and under the 'reference' backend."
            )
        inputs = jax.tree.unflatten(self.in_tree, arrays)
        outs = self.user_reference(*inputs, **dict(self.constexpr))
        flat, tree = jax.tree.flatten(outs)
        if tree != self.out_tree:
            raise ValueError(f"reference of {self.kernel_name!r} returned structure {tree}; out_shape is {self.out_tree}")
        for i, (out, (shape, dtype)) in enumerate(zip(flat, self.out_structs)):
            got = (tuple(jnp.shape(out)), jnp.result_type(out).name)
            if got != (shape, dtype):
                raise ValueError(f"reference of {self.kernel_name!r} returned {got[1]}{list(got[0])} as output "
                                 f"{i}, where out_shape declares {dtype}{list(shape)}")
        return tuple(flat)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_INSTALLED = tuple(os.path.join(p, "") for p in
                   {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} if p)


def _file_of(obj) -> str | None:
    """``obj``'s source file if it is on disk (not a notebook cell's or ``python -c``'s)."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:  # builtins, C extensions
        return None
    return os.path.abspath(path) if path and os.path.isfile(path) else None


def _is_user_code(obj, home: str) -> bool:
    """Whether ``obj`` (a function or module) is the user's: in ``__main__``, in the launcher's
    own top-level package ``home``, or in a file outside the Python installation and cutelayers."""
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None) or ""
    if module == "__main__" or module.partition(".")[0] == home:
        return module != "cutelayers" and not module.startswith("cutelayers.")
    path = _file_of(obj)
    return bool(path) and not path.startswith((os.path.join(_PACKAGE, ""), *_INSTALLED))


def _names(code) -> set[str]:
    """The global names ``code`` and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


@functools.lru_cache(maxsize=256)
def reached_code(launcher) -> tuple[tuple[str, ...], str]:
    """The user code ``launcher`` reaches, for the disk cache's key: the source files of the
    launcher, of the user functions it calls (its ``@cute.kernel`` functions, transitively) and of the user
    modules it names; and a digest of those functions' code that has no file on disk."""
    root = inspect.unwrap(launcher)
    home = (getattr(root, "__module__", None) or "").partition(".")[0]
    files, fileless, seen, todo = {}, [], set(), [root]
    while todo:
        fn = inspect.unwrap(todo.pop())
        fn = getattr(fn, "__func__", fn) if inspect.ismethod(fn) else fn  # a launcher may be a method
        if id(fn) in seen or not inspect.isfunction(fn):
            continue
        seen.add(id(fn))
        path = _file_of(fn)
        if path:
            files[path] = None
        else:
            try:
                fileless.append(inspect.getsource(fn).encode())
            except OSError:  # ``python -c``: the code itself
                fileless.append(marshal.dumps(fn.__code__))
        cells = [c.cell_contents for c in fn.__closure__ or () if c.cell_contents is not None]
        for obj in [fn.__globals__[n] for n in _names(fn.__code__) if n in fn.__globals__] + cells:
            if inspect.ismodule(obj) and _is_user_code(obj, home) and (module_file := _file_of(obj)):
                files[module_file] = None
            elif inspect.isfunction(obj) and _is_user_code(inspect.unwrap(obj), home):
                todo.append(obj)
    return tuple(sorted(files)), hashlib.sha256(b"".join(fileless)).hexdigest() if fileless else ""


def _tensor_params(launcher, constexpr: Mapping[str, Any]) -> tuple[int, int] | None:
    """How many tensors the launcher takes after ``stream``: (fewest, most), its positional
    parameters less those the constexpr keywords fill, the fewest without the defaulted ones
    (None: it takes *args)."""
    try:
        params = list(inspect.signature(launcher).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params[1:] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name not in constexpr]
    return sum(p.default is p.empty for p in positional), len(positional)


def _is_count(value) -> bool:
    """Whether ``value`` is an integer >= 0 (a dim or a leaf index; not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _dims(where: str, shape) -> tuple:
    """``shape`` as a tuple of dims: ints >= 0, or ``jax.export`` symbolic dims."""
    dims = []
    for d in shape:
        if jax.export.is_symbolic_dim(d):
            dims.append(d)
        elif _is_count(d):
            dims.append(int(d))
        else:
            raise ValueError(f"cute_call: {where} has shape {tuple(shape)}; dims must be integers >= 0 "
                             "(or jax.export symbolic dims)")
    return tuple(dims)


def _check_aliases(aliases) -> tuple[tuple[int, int], ...]:
    if aliases is None:
        return ()
    if not isinstance(aliases, Mapping):
        raise TypeError(f"cute_call: input_output_aliases={aliases!r}; expected a dict {{input leaf index: "
                        "output leaf index}}")
    for i, o in aliases.items():
        if not (_is_count(i) and _is_count(o)):
            raise ValueError(f"cute_call: input_output_aliases {i!r}: {o!r}; indices must be integers >= 0 "
                             "(leaf positions among the inputs and among out_shape's leaves)")
    outputs = [int(o) for o in aliases.values()]
    if len(set(outputs)) != len(outputs):
        raise ValueError(f"cute_call: input_output_aliases={dict(aliases)!r} writes one output in place of two "
                         "inputs; each output takes at most one input's buffer")
    return tuple(sorted((int(i), int(o)) for i, o in aliases.items()))


def _check_modes(kind: str, modes, ranks: Sequence[int]):
    if modes is None:
        return (None,) * len(ranks)
    if not isinstance(modes, (tuple, list)):
        raise TypeError(f"{kind}_modes={modes!r}; expected one entry per {kind} array: None or a tuple of dims")
    if len(modes) != len(ranks):
        raise ValueError(f"{kind}_modes has {len(modes)} entries; there are {len(ranks)} {kind} arrays")
    out = []
    for i, (m, rank) in enumerate(zip(modes, ranks)):
        if m is not None:
            if not isinstance(m, (tuple, list)) or not all(isinstance(a, int) for a in m):
                raise TypeError(f"{kind}_modes[{i}] = {m!r}; expected None or a tuple of dims such as "
                                f"{tuple(range(rank))}")
            m = tuple(m)
            if sorted(m) != list(range(rank)):
                raise ValueError(
                    f"{kind}_modes[{i}] = {m} is not a permutation of the dims of a rank-{rank} array "
                    f"(expected an ordering of {tuple(range(rank))})"
                )
        out.append(m)
    return tuple(out)


def _dynamic_spec(dynamic_dims, ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Normalize ``dynamic_dims``: one tuple for every array, or one tuple per array."""
    if dynamic_dims is ... or dynamic_dims is None:
        dynamic_dims = (0,)
    if not isinstance(dynamic_dims, (tuple, list)):
        raise TypeError(f"dynamic_dims={dynamic_dims!r}; expected a tuple of dims for every array, e.g. (0,), "
                        "or one such tuple per array")
    dynamic_dims = tuple(dynamic_dims)
    per_array = dynamic_dims and all(isinstance(d, (tuple, list)) for d in dynamic_dims)
    spec = tuple(tuple(d) for d in dynamic_dims) if per_array else (dynamic_dims,) * len(ranks)
    if len(spec) != len(ranks):
        raise ValueError(f"dynamic_dims has {len(spec)} entries; there are {len(ranks)} arrays (inputs then outputs)")
    for i, (dims, rank) in enumerate(zip(spec, ranks)):
        for d in dims:
            if not isinstance(d, int) or not -rank <= d < max(rank, 1):
                raise ValueError(f"dynamic_dims entry {i} names dim {d!r}, but that array has rank {rank}")
    return tuple(tuple(sorted({d % rank for d in dims})) if rank else () for dims, rank in zip(spec, ranks))


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _kernel_name(name, launcher) -> str:
    """``name``, which becomes part of the kernel's FFI target (``cutelayers_<name>_<digest>``)."""
    if name is None:
        return re.sub(r"[^A-Za-z0-9_]", "_", getattr(launcher, "__name__", "")) or "cute_call"
    if not isinstance(name, str):
        raise TypeError(f"cute_call: name={name!r}; expected a str")
    if not _NAME.fullmatch(name):
        raise ValueError(f"cute_call: name={name!r}; expected ASCII letters, digits and underscores, not "
                         "starting with a digit (it names the kernel's FFI target)")
    return name


def cute_call(
    launcher: Callable,
    *,
    out_shape,
    input_output_aliases: dict[int, int] | None = None,
    dynamic_dims=...,
    input_modes=None,
    output_modes=None,
    compile_key: Hashable | None = None,
    name: str | None = None,
    reference: Callable | None = None,
    graph_safe: bool = True,
    **constexpr,
) -> Callable:
    """Make a JAX-callable from a CuTe DSL launcher (see the module docstring for the rules).

    Args:
      launcher: ``@cute.jit`` function ``launcher(stream, *inputs, *outputs, **constexpr)``.
      out_shape: pytree of ``jax.ShapeDtypeStruct`` (or objects with ``shape`` and ``dtype``).
      input_output_aliases: ``{input leaf index: output leaf index}``; that output is written in
        place of the input (pass it donated, e.g. ``jax.jit(..., donate_argnums=...)``, or XLA
        copies it first). The launcher does not receive aliased outputs.
      dynamic_dims: dims that are symbolic: one tuple for every array (default ``(0,)``, the
        leading dim), or one tuple per array, inputs then outputs (``()`` for fully static).
      input_modes, output_modes: per array, ``None`` or the order in which the kernel sees its
        dims (e.g. ``(1, 0)`` to see a row-major (M, K) array as (K, M)).
      compile_key: a hashable that identifies the launcher (instead of the function object), so
        re-created launchers share compiled kernels. Only kernels with a compile_key (whose repr,
        like the constexpr values', is the same in every process) are kept in the disk cache, keyed
        also by a hash of the user code the launcher reaches (:func:`reached_code`); others are
        compiled once per process.
      name: kernel name in cache statistics, profiles and its FFI target: ASCII letters, digits and
        underscores (default: the launcher's name).
      reference: optional jnp function with the kernel's inputs/outputs (and the constexpr
        keywords); used on non-CUDA platforms and under the 'reference' backend.
      graph_safe: whether the kernel may be captured in CUDA graphs.
      **constexpr: compile-time constants passed to the launcher as keywords.

    Returns:
      ``f(*inputs)`` returning a pytree shaped like ``out_shape``. Differentiate it with
      :func:`custom_op`; vmap it with :func:`rowwise_vmap` (or :func:`custom_op`'s ``rowwise``).
    """
    if not callable(launcher):
        raise TypeError(f"cute_call: launcher must be a @cute.jit function; got {type(launcher).__name__}")
    for key, value in constexpr.items():
        if any(isinstance(leaf, (jax.Array, jax.core.Tracer)) or hasattr(leaf, "__jax_array__")
               for leaf in jax.tree.leaves(value)):
            raise TypeError(
                f"cute_call: keyword {key!r} holds a JAX array. Keywords are compile-time constants; "
                "pass arrays positionally to the returned function."
            )
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"cute_call: keyword {key!r} = {value!r} is not hashable; constexpr values must be") from None
    try:
        hash(compile_key)
    except TypeError:
        raise TypeError(f"cute_call: compile_key={compile_key!r} is not hashable; pass e.g. a str or a tuple") from None
    if not isinstance(graph_safe, bool):
        raise TypeError(f"cute_call: graph_safe={graph_safe!r}; expected True or False")
    out_leaves, out_tree = jax.tree.flatten(out_shape)
    for i, leaf in enumerate(out_leaves):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"cute_call: out_shape leaf {i} is {leaf!r}; expected jax.ShapeDtypeStruct")
        cutlass_dtype(leaf.dtype)  # raises for dtypes CuTe cannot take
    out_structs = tuple((_dims(f"out_shape leaf {i}", leaf.shape), jnp.dtype(leaf.dtype).name)
                        for i, leaf in enumerate(out_leaves))
    kernel_name = _kernel_name(name, launcher)
    aliases = _check_aliases(input_output_aliases)
    tensor_params = _tensor_params(launcher, constexpr)

    def call(*inputs):
        flat, in_tree = jax.tree.flatten(inputs)
        for i, x in enumerate(flat):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")):
                raise TypeError(f"{kernel_name}: input leaf {i} is {type(x).__name__}; expected an array")
            try:
                cutlass_dtype(x.dtype)
            except TypeError as e:
                raise TypeError(f"{kernel_name}: input leaf {i}: {e}") from None
        check_arrays({f"input[{i}]": x for i, x in enumerate(flat)}, kernel_name)
        n_kept = len(out_leaves) - len(aliases)
        if tensor_params is not None and not tensor_params[0] <= len(flat) + n_kept <= tensor_params[1]:
            fewest, most = tensor_params
            raise TypeError(
                f"{kernel_name}: the launcher takes {fewest if fewest == most else f'{fewest} to {most}'} "
                f"tensors after stream, but the call passes {len(flat)} input(s) and {n_kept} output(s) "
                "(launcher(stream, *inputs, *outputs, **constexpr); outputs aliased to inputs are not passed)"
            )
        for i, o in aliases:
            if i >= len(flat) or o >= len(out_leaves):
                raise ValueError(f"{kernel_name}: input_output_aliases {i}: {o} is out of range "
                                 f"({len(flat)} inputs, {len(out_leaves)} outputs)")
            want, have = out_structs[o], (tuple(flat[i].shape), jnp.dtype(flat[i].dtype).name)
            if want != have:
                raise ValueError(f"{kernel_name}: input {i} (shape/dtype {have}) is aliased to output {o}, "
                                 f"which out_shape declares as {want}")
        ranks = [len(x.shape) for x in flat] + [len(s) for s, _ in out_structs]
        family = UserKernel(
            user_launcher=launcher, kernel_name=kernel_name, out_structs=out_structs, out_tree=out_tree,
            in_tree=in_tree, dynamic=_dynamic_spec(dynamic_dims, ranks),
            modes=_check_modes("input", input_modes, ranks[: len(flat)])
            + _check_modes("output", output_modes, ranks[len(flat):]),
            aliases=aliases, constexpr=tuple(sorted(constexpr.items())), compile_key=compile_key,
            user_reference=reference, graph_safe=graph_safe,
        )
        with jax.named_scope(kernel_name):
            outs = kernel_call(family, *flat)
        return jax.tree.unflatten(out_tree, outs)

    return call


def rowwise_vmap(fn: Callable, *, shared: tuple[int, ...] = ()) -> Callable:
    """Make ``fn`` vmappable by folding batch dims into rows (one launch under nested vmaps).

    Every positional argument of ``fn`` not in ``shared`` must be row-wise: arrays (or pytrees of
    arrays) whose leading dims are rows, lined up across arguments, with outputs row-wise too.
    A batched ``shared`` argument (per-example parameters) falls back to ``jax.lax.map``.
    """
    if not isinstance(shared, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in shared):
        raise TypeError(f"rowwise_vmap: shared={shared!r}; expected a tuple of argument positions (ints >= 0)")
    folded = fold_batch(fn, shared=tuple(shared))

    @functools.wraps(fn)
    def call(*args):
        if shared and max(shared) >= len(args):
            raise ValueError(f"rowwise_vmap: shared={tuple(shared)} names argument {max(shared)}, but "
                             f"{getattr(fn, '__name__', 'the function')} was called with {len(args)}")
        return folded(*args)

    return call


def custom_op(forward: Callable, backward: Callable, *, rowwise: bool = False):
    """Turn a forward and a backward kernel call into a differentiable (and vmappable) op.

    Args:
      forward: ``forward(*args) -> (outputs, residuals)``; residuals are a pytree of arrays.
      backward: ``backward(residuals, cotangents) -> tuple`` of cotangents, one per arg.
      rowwise: wrap both in :func:`rowwise_vmap`; every arg, output, residual and cotangent must
        then be row-wise. (Ops with shared parameters combine :func:`rowwise_vmap` with
        ``shared=`` and ``jax.custom_vjp`` directly, as ``cutelayers.ops`` does.)

    Returns:
      ``op(*args) -> outputs`` with ``jax.custom_vjp`` rules (and the row-folding vmap rule if
      rowwise).
    """
    fwd = rowwise_vmap(forward) if rowwise else forward
    bwd = rowwise_vmap(backward) if rowwise else backward

    @jax.custom_vjp
    def op(*args):
        return fwd(*args)[0]

    def op_bwd(residuals, cotangents):
        return tuple(bwd(residuals, cotangents))

    op.defvjp(fwd, op_bwd)
    return op
