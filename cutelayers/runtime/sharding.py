"""Sharding rules of the kernel-call primitive, and :func:`kernel_call`, through which ops call
kernels: kernels under ``jax.jit`` with sharded inputs.

A CuTe kernel runs on one device's arrays. Inside ``jax.shard_map`` every array already is one
device's shard, so kernel calls bind the primitive directly (ops pass their shared parameters
through :func:`vary_like`, so their gradients are summed over the shards). Under plain ``jax.jit``
with ``NamedSharding`` inputs:

* ``Auto`` mesh axes: each kernel call is wrapped in ``jax.experimental.custom_partitioning``.
  Shardy propagates shardings through it with an einsum-like rule, and when XLA partitions the
  program it asks :func:`_partition` how to run the call per device;
* ``Explicit`` mesh axes (``jax.make_mesh``'s default): the shardings are in the operands' types,
  so the same plan is made while tracing and runs in a ``jax.shard_map``.

Either way every device runs the kernel on its own shard (no all-gather of activations), and
results that are sums over a sharded dim are summed across devices with one ``psum``.

A family describes its dims with a :class:`~cutelayers.runtime.family.ShardingRule`, from its
``sharding_rule(avals)`` hook (:class:`~cutelayers.runtime.family.KernelFamily`; by default only
rows may be sharded): every dim of every operand and result gets a factor, a name (the dim may be
sharded; a result lacking a name of its operands is a sum over it) or ``None`` (the kernel needs
the whole dim: an operand sharded there is an error that names it; results are replicated there).

Mesh axes are given out first come, first served in operand order, so when two factors ask for
the same mesh axis the activations (always the first operand) keep it and the weight is
resharded -- also where the weight's dim is one the kernel needs whole (fsdp: a parameter sharded
over the axes that shard the batch is gathered for the call). A sharded dim must divide evenly over
its mesh axes (padding rows would enter sums).

A dim whose factor is :class:`~cutelayers.runtime.family.Halves` -- a gated layer's gate and value
columns side by side -- is viewed as (2, H) around the call (:func:`split_halves`): the rule names
H, so each device holds its part of both halves, and the per-device program joins the view back
to the (2 H / devices) columns the kernel reads. Where such an array arrives sharded another way (a
weight split in contiguous blocks of its 2 H), XLA reshards it to that view.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from cutelayers.runtime._jax_compat import DynamicJaxprTracer, Tracer
from cutelayers.runtime.family import Halves, KernelFamily, ShardingRule
from cutelayers.runtime.primitive import kernel_call_p


@dataclasses.dataclass(frozen=True)
class ShardContext:
    """Which mesh axes shard each named factor, as the per-device program sees it."""

    axes: Mapping[str, tuple[str, ...]]

    def sharded(self, *factors: str) -> bool:
        return any(self.axes.get(f) for f in factors)

    def psum(self, value, factors) -> jax.Array:
        """``value`` summed over the mesh axes of ``factors``, in float32 at least (the library
        accumulates in fp32); the caller casts back."""
        axes = tuple(a for f in sorted(factors) for a in self.axes.get(f, ()))
        value = value.astype(jnp.promote_types(value.dtype, jnp.float32))
        return jax.lax.psum(value, axes) if axes else value


def _halves_at(dims) -> list[int]:
    return [d for d, f in enumerate(dims) if isinstance(f, Halves)]


def split_halves(a, dims):
    """``a`` with each :class:`Halves` dim of ``dims`` (its factors) viewed as (2, H)."""
    for d in reversed(_halves_at(dims)):
        a = a.reshape(*a.shape[:d], 2, a.shape[d] // 2, *a.shape[d + 1:])
    return a


def join_halves(a, dims):
    """The inverse of :func:`split_halves`: each (2, H) view of a :class:`Halves` dim as 2 H."""
    for d in _halves_at(dims):  # left to right: the dims before d are joined already
        a = a.reshape(*a.shape[:d], a.shape[d] * a.shape[d + 1], *a.shape[d + 2:])
    return a


def _split_shape(shape, dims) -> tuple[int, ...]:
    return tuple(g for n, f in zip(shape, dims) for g in ((2, n // 2) if isinstance(f, Halves) else (n,)))


def _has_halves(rule: ShardingRule) -> bool:
    return any(_halves_at(dims) for dims in (*rule.operands, *rule.results))


def _split_rule(rule: ShardingRule) -> ShardingRule:
    """The rule of the arrays as :func:`split_halves` views them: a Halves dim's (2, H) as (None,
    its factor)."""
    def split(dims):
        return tuple(g for f in dims for g in ((None, f.factor) if isinstance(f, Halves) else (f,)))

    return dataclasses.replace(rule, operands=tuple(map(split, rule.operands)), results=tuple(map(split, rule.results)))


def rule_for(family: KernelFamily, avals) -> ShardingRule:
    rule = family.sharding_rule(avals)
    n_out = len(family.out_avals(avals))
    if len(rule.operands) != len(avals) or len(rule.results) != n_out:
        raise AssertionError(f"{family.name}: sharding rule covers {len(rule.operands)} operands and "
                             f"{len(rule.results)} results; the call has {len(avals)} and {n_out}")
    return rule


# --- choosing the per-device sharding -----------------------------------------------------------

def _argument_name(family: KernelFamily, i: int) -> str:
    names = family.arg_names
    return names[i] if i < len(names) else f"operand {i}"


def _spec_axes(sharding: NamedSharding, ndim: int) -> tuple[tuple[str, ...], ...]:
    """Per dim: the mesh axes that shard it, size-1 axes included: they split nothing, but they
    are part of the spec (of the type, under ``Explicit`` axes) that the results must keep -- a
    (data=1, model=2) mesh's batch stays ``data``."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))

    def axes(entry) -> tuple[str, ...]:
        return (entry,) if isinstance(entry, str) else entry if isinstance(entry, tuple) else ()

    return tuple(axes(entry) for entry in spec[:ndim])


def _dim_axes(family, i, sharding, ndim) -> tuple[tuple[str, ...], ...]:
    """Per dim of operand ``i``: the mesh axes that shard it (:func:`_spec_axes`)."""
    if isinstance(sharding, NamedSharding):
        return _spec_axes(sharding, ndim)
    if sharding is None or sharding.is_fully_replicated:
        return ((),) * ndim
    raise ValueError(
        f"{family.name}: argument {_argument_name(family, i)!r} has sharding {sharding}; the kernel's "
        "sharding rules read jax.sharding.NamedSharding (a PartitionSpec over a Mesh). Shard it with "
        "a NamedSharding, or call the op inside jax.shard_map.")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one kernel call runs on a mesh: the family's rule, the shardings of the operands and
    results as the call sees them (Halves dims split), and which mesh axes shard each factor."""

    rule: ShardingRule
    operand_specs: tuple[PartitionSpec, ...]
    result_specs: tuple[PartitionSpec, ...]
    context: ShardContext


def plan(family: KernelFamily, avals, shardings: Sequence) -> Plan:
    """The per-device sharding of a call on ``avals`` whose operands come with ``shardings``.

    Raises ``ValueError`` naming the argument when an operand is sharded along a dim the kernel
    needs whole, or along a dim that does not divide evenly over its mesh axes.
    """
    full_rule = rule_for(family, avals)
    # the arrays as the call sees them: Halves dims split (module docstring)
    rule = _split_rule(full_rule)
    avals = [jax.ShapeDtypeStruct(_split_shape(a.shape, dims), a.dtype) for a, dims in zip(avals, full_rule.operands)]
    axes_of: dict[str, tuple[str, ...]] = {}  # size-1 axes included: they stay in the specs
    # those of them that split the dim: the per-device program sums over (and branches on) only these
    split: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    for i, (dims, aval, sharding) in enumerate(zip(rule.operands, avals, shardings)):
        dim_axes = list(_dim_axes(family, i, sharding, len(aval.shape)))
        for n, d in enumerate(_halves_at(full_rule.operands[i])):
            # Its halves' 2 sharded (a contiguous split of the 2 H: one device's gates, another's
            # values): those axes split H instead, each device then holding its part of both
            # halves (XLA reshards the operand to that)
            at = d + n
            dim_axes[at + 1], dim_axes[at] = dim_axes[at] + dim_axes[at + 1], ()
        for d, (factor, axes) in enumerate(zip(dims, dim_axes)):
            if not axes:
                continue
            name = _argument_name(family, i)
            devices = math.prod(sharding.mesh.shape[a] for a in axes)
            if factor is None and devices == 1:
                continue  # size-1 axes split nothing: the dim is whole on every device anyway
            if factor is None and i > 0 and set(axes) <= taken:
                continue  # a parameter sharded over the activations' axes (fsdp): gathered whole
            if factor is None:
                raise ValueError(
                    f"{family.name}: argument {name!r} is sharded over mesh axes {axes} along dim {d} "
                    f"of the kernel's {tuple(aval.shape)} view of it, a dim the kernel needs whole on "
                    f"every device. {_sharding_hint(rule, i)}, or call the op inside jax.shard_map "
                    "and combine the shards yourself.")
            if factor in axes_of or taken & set(axes):
                continue  # already decided by an earlier operand: this one is resharded to match
            if aval.shape[d] % devices:
                raise ValueError(
                    f"{family.name}: argument {name!r} (shape {tuple(aval.shape)}) is sharded over "
                    f"mesh axes {axes} ({devices} devices) along dim {d} of size {aval.shape[d]}, "
                    "which does not divide evenly. Make that dim a multiple of the device count "
                    "(e.g. the batch size), or replicate it.")
            axes_of[factor] = axes
            if kept := tuple(a for a in axes if sharding.mesh.shape[a] > 1):
                split[factor] = kept
            taken.update(axes)

    def spec(dims) -> PartitionSpec:
        def entry(factor):
            axes = axes_of.get(factor, ()) if factor is not None else ()
            return None if not axes else axes[0] if len(axes) == 1 else axes

        return PartitionSpec(*(entry(f) for f in dims))

    return Plan(full_rule, tuple(spec(d) for d in rule.operands), tuple(spec(d) for d in rule.results),
                ShardContext(split))


def _sharding_hint(rule: ShardingRule, i: int) -> str:
    named = [d for d, f in enumerate(rule.operands[i]) if f is not None]
    fix = "(jax.sharding.reshard or jax.lax.with_sharding_constraint)"
    if not named:
        return f"Every device needs all of it: replicate it {fix}"
    if [rule.operands[i][d] for d in named] == ["rows"]:
        return (f"Shard only its rows (the leading axes of the op's input, e.g. batch or sequence) "
                f"and replicate the rest {fix}")
    return f"Shard only dims {named} of that view and replicate the rest {fix}"


def run_kernel(family: KernelFamily, *operands) -> tuple[jax.Array, ...]:
    """The kernel call itself, on one device's operands."""
    return tuple(kernel_call_p.bind(*operands, family=family))


def sum_partials(rule: ShardingRule, ctx: ShardContext, results) -> tuple[jax.Array, ...]:
    """Each result psum'd over the sharded factors it lacks (see :class:`ShardingRule`)."""
    out = []
    for j, r in enumerate(results):
        summed = rule.summed_factors(j)
        out.append(ctx.psum(r, summed).astype(r.dtype) if ctx.sharded(*summed) else r)
    return tuple(out)


def per_shard_program(family: KernelFamily, p: Plan) -> Callable:
    if p.rule.per_shard is not None:
        program = functools.partial(p.rule.per_shard, p.context)
    else:
        def program(*operands):
            return sum_partials(p.rule, p.context, run_kernel(family, *operands))
    return _joining_halves(p.rule, program)


def _joining_halves(rule: ShardingRule, program: Callable) -> Callable:
    """``program`` of the kernel's operands and results taking and giving them with their Halves
    dims split (a device's [gate_d | value_d] columns, joined, are what the kernel reads)."""
    if not _has_halves(rule):
        return program

    def joined(*operands):
        results = program(*(join_halves(a, dims) for a, dims in zip(operands, rule.operands)))
        return tuple(split_halves(r, dims) for r, dims in zip(results, rule.results))

    return joined


# --- custom_partitioning -------------------------------------------------------------------------

def _sdy_rule(family, avals, mesh, operand_types, result_types) -> SdyShardingRule:
    """Shardy's view of the rule. Whole dims get a factor of their own, marked need-replication,
    so shardings never propagate through them from one array to another."""
    rule = _split_rule(rule_for(family, avals))
    whole: list[str] = []

    def mapping(tag, dims):
        names = []
        for d, factor in enumerate(dims):
            if factor is None:
                whole.append(f"whole_{tag}_{d}")
                names.append(whole[-1])
            else:
                names.append(f"f_{factor}")
        return ArrayMapping(*names)

    operands = tuple(mapping(f"o{i}", dims) for i, dims in enumerate(rule.operands))
    results = tuple(mapping(f"r{j}", dims) for j, dims in enumerate(rule.results))
    in_results = {f for dims in rule.results for f in dims}
    reduced = tuple(sorted({f"f_{f}" for dims in rule.operands for f in dims if f is not None}
                           - {f"f_{f}" for f in in_results if f is not None}))
    return SdyShardingRule(operands, results, reduction_factors=reduced,
                           need_replication_factors=tuple(whole))


def _partition(family, avals, mesh, arg_shapes, result_shape):
    p = plan(family, avals, [a.sharding for a in arg_shapes])
    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
    return mesh, per_shard_program(family, p), named(p.result_specs), named(p.operand_specs)


def _infer_result_shardings(family, avals, mesh, arg_shapes, result_shape):
    # Only the GSPMD partitioner (jax_use_shardy_partitioner=False) asks this.
    p = plan(family, avals, [a.sharding for a in arg_shapes])
    return tuple(NamedSharding(mesh, s) for s in p.result_specs)


def _global_call(family, avals, *arrays):
    return _joining_halves(rule_for(family, avals), functools.partial(run_kernel, family))(*arrays)


_partitioned_call = custom_partitioning(_global_call, static_argnums=(0, 1))
_partitioned_call.def_partition(_partition, infer_sharding_from_operands=_infer_result_shardings,
                                sharding_rule=_sdy_rule)


def vary_like(reference, *arrays):
    """``arrays`` (None passes through) cast to vary over every manual mesh axis ``reference``
    varies over -- inside ``jax.shard_map``; elsewhere they come back unchanged.

    An op passes its shared parameters (a norm's scale, a linear's kernel) through this before
    its custom_vjp: the backward's per-shard partial gradient then has the parameter's type, and
    the transpose of the cast sums it across the shards, as for any jnp code in shard_map.
    """
    def vma(a) -> frozenset:  # the manual axes a value varies over, as its type says
        aval = jax.typeof(a)
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)  # jax 0.10, 0.11
        return varying or getattr(aval, "vma", frozenset())

    out = []
    for a in arrays:
        missing = () if a is None else tuple(sorted(vma(reference) - vma(a)))
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def _inside_shard_map() -> bool:
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def _explicit_shardings(arrays) -> list | None:
    """The operands' shardings when any operand's type is sharded over an ``Explicit`` mesh axis
    (``jax.make_mesh``'s default); None otherwise (``Auto`` axes: XLA decides at compile time)."""
    shardings = [getattr(jax.typeof(a), "sharding", None) for a in arrays]
    for s in shardings:
        if (isinstance(s, NamedSharding) and not s.mesh.empty
                and any(set(axes) & _explicit_axes(s.mesh) for axes in _spec_axes(s, len(s.spec)))):
            return shardings
    return None


def _explicit_axes(mesh) -> set[str]:
    return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}


def _explicit_call(family, avals, arrays, shardings):
    """Explicit sharding is known while tracing: run the per-device program in ``jax.shard_map``
    over the mesh's explicit axes, with the plan's specs (operands resharded to them first).

    ``check_vma=False``: the plan, not JAX's varying-axes types, says which results are the same
    on every device of an axis. Its type inference cannot see it where a result does not depend
    on a sharded operand dim (a row-parallel weight gradient's bias sums, of dz, replicated over
    the kernel's K axis, while the kernel call's results vary like x), nor over an axis of size 1
    (never psum'd); the per-device program psums every partial sum itself."""
    p = plan(family, avals, shardings)
    mesh = next(s.mesh for s in shardings if isinstance(s, NamedSharding) and not s.mesh.empty)
    operands = [jax.sharding.reshard(a, NamedSharding(mesh, spec))
                for a, spec in zip(arrays, p.operand_specs)]
    program = jax.shard_map(per_shard_program(family, p), mesh=mesh, in_specs=p.operand_specs,
                            out_specs=p.result_specs, axis_names=_explicit_axes(mesh), check_vma=False)
    return tuple(program(*operands))


def kernel_call(family: KernelFamily, *arrays) -> tuple[jax.Array, ...]:
    """Call ``family``'s kernel on ``arrays``; returns the tuple of results. Where arrays are
    sharded, each device runs it on its shard per the family's rule:

    * inside ``jax.shard_map``, eagerly (ops accept only single-device concrete arrays, see
      :mod:`cutelayers.runtime.placement`), or under a transformation (grad, vmap of the raw call:
      the primitive's rules say to use the op): the kernel is called as is;
    * traced, with operands whose types are sharded over ``Explicit`` mesh axes: the rule is
      applied now (errors name the argument) through ``jax.shard_map``;
    * otherwise traced (``jax.jit`` with ``Auto`` axes, or one device): through
      ``custom_partitioning``, whose rule XLA applies when it partitions the program (one device
      inlines it).
    """
    tracers = [a for a in arrays if isinstance(a, Tracer)]
    staged = tracers and all(isinstance(t, DynamicJaxprTracer) for t in tracers)
    if not staged or _inside_shard_map():
        return run_kernel(family, *arrays)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    rule = rule_for(family, avals)
    arrays = [split_halves(a, dims) for a, dims in zip(arrays, rule.operands)]
    shardings = _explicit_shardings(arrays)
    if shardings is not None:
        results = _explicit_call(family, avals, arrays, shardings)
    else:
        results = _partitioned_call(family, avals, *arrays)
    return tuple(join_halves(r, dims) for r, dims in zip(results, rule.results))
