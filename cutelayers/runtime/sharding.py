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

Two kinds of dim are *viewed* as several around the call (:class:`Views`), and the per-device
program joins each view back to the one dim the kernel reads:

* a dim whose factor is :class:`~cutelayers.runtime.family.Halves` -- a gated layer's gate and
  value columns side by side -- as (2, H): the rule names H, so each device holds its part of both
  halves. Where such an array arrives sharded another way (a weight split in contiguous blocks of
  its 2 H), XLA reshards it to that view.
* the rows (the factor ``"rows"``), as the leading dims the op flattened into them (``lead`` of
  :func:`kernel_call`: (batch, sequence) ...), each its own factor: a sharded sequence axis, which
  no sharding of the flattened rows can express, stays sharded (no gather), and each device's
  kernel runs on its (batch part x sequence part) rows. Results summed over the rows are summed
  over every axis that shards one of those dims. An op may give the rows unflattened
  (:func:`kernel_call`'s ``rows_at``): no reshape of a sharded array happens at the program's
  level then, which over ``Explicit`` axes jax would type (or refuse) itself.
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

from cutelayers.runtime._jax_compat import DynamicJaxprTracer, Tracer, get_axis_env
from cutelayers.runtime.family import ROWS, Halves, KernelFamily, ShardingRule
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


@dataclasses.dataclass(frozen=True)
class Views:
    """The dims of a call's arrays that are viewed as several around the kernel (module
    docstring): Halves dims as (2, H); with ``lead`` of two dims or more, the rows as ``lead``."""

    lead: tuple[int, ...] = ()

    def of(self, factor) -> tuple | None:
        """The factors of a dim's view, or None where the dim is not viewed."""
        if isinstance(factor, Halves):
            return None, factor.factor
        if factor == ROWS and len(self.lead) > 1:
            return (ROWS,) + tuple(f"{ROWS}_{i}" for i in range(1, len(self.lead)))
        return None

    def any_in(self, rule: ShardingRule) -> bool:
        """Whether any dim of the rule's arrays is viewed."""
        return any(self.of(f) for dims in (*rule.operands, *rule.results) for f in dims)

    def rule(self, rule: ShardingRule) -> ShardingRule:
        """The rule of the arrays as :meth:`split` views them."""
        def viewed(dims):
            return tuple(g for f in dims for g in (self.of(f) or (f,)))

        return dataclasses.replace(rule, operands=tuple(map(viewed, rule.operands)),
                                   results=tuple(map(viewed, rule.results)))

    @staticmethod
    def _sizes(n: int, factor, lead) -> tuple[int, ...]:
        """The sizes of a viewed dim of ``n`` elements: (2, n / 2) for Halves, else the rows' ``lead``."""
        return (2, n // 2) if isinstance(factor, Halves) else tuple(lead)

    def shape(self, shape, dims) -> tuple[int, ...]:
        return tuple(g for n, f in zip(shape, dims) for g in (self._sizes(n, f, self.lead) if self.of(f) else (n,)))

    def split(self, a, dims, lead=None, rows: bool = True):
        """``a`` with each viewed dim of ``dims`` (its factors) as its view; ``lead``: the rows'
        view (default: :attr:`lead`; a device's part of it in the per-device program).
        ``rows=False``: ``a`` holds its rows as that view already (:func:`kernel_call`'s
        ``rows_at``), so only its other viewed dims are split."""
        lead = self.lead if lead is None else lead
        for d in reversed(range(len(dims))):
            if self.of(dims[d]) and (rows or dims[d] != ROWS):
                at = d if rows else self._position(dims, d, len(lead))
                sizes = self._sizes(a.shape[at], dims[d], lead)
                a = a.reshape(*a.shape[:at], *sizes, *a.shape[at + 1:])
        return a

    def join(self, a, dims, rows: bool = True):
        """The inverse of :meth:`split`: each viewed dim's view as one dim (``rows=False``: all
        but the rows', which stay viewed)."""
        at = 0  # where dim d of ``dims`` starts in ``a``: the dims before it are joined already
        for f in dims:
            view = self.of(f)
            if view and (rows or f != ROWS):
                a = a.reshape(*a.shape[:at], math.prod(a.shape[at:at + len(view)]), *a.shape[at + len(view):])
            at += len(view) if view and not rows and f == ROWS else 1
        return a

    @staticmethod
    def _position(dims, d, width) -> int:
        """Where dim ``d`` of ``dims`` starts in an array holding its rows dims as a view of
        ``width`` dims and every other dim as one."""
        return d + sum(width - 1 for f in dims[:d] if f == ROWS)


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
    results as the call sees them (viewed: :class:`Views`), which mesh axes shard each factor (the
    rows' view's dims merged into ``"rows"``), and a device's part of the rows' view."""

    rule: ShardingRule
    views: Views
    operand_specs: tuple[PartitionSpec, ...]
    result_specs: tuple[PartitionSpec, ...]
    context: ShardContext
    local_lead: tuple[int, ...]


def plan(family: KernelFamily, avals, shardings: Sequence, views: Views = Views()) -> Plan:
    """The per-device sharding of a call on ``avals`` (as the kernel sees them) whose operands,
    viewed by ``views``, come with ``shardings``.

    Raises ``ValueError`` naming the argument when an operand is sharded along a dim the kernel
    needs whole, or along a dim that does not divide evenly over its mesh axes.
    """
    full_rule = rule_for(family, avals)
    rule = views.rule(full_rule)  # the arrays as the call sees them (module docstring)
    avals = [jax.ShapeDtypeStruct(views.shape(a.shape, dims), a.dtype) for a, dims in zip(avals, full_rule.operands)]
    axes_of: dict[str, tuple[str, ...]] = {}  # size-1 axes included: they stay in the specs
    # those of them that split the dim: the per-device program sums over (and branches on) only these
    split: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    axis_size: dict[str, int] = {}  # of the axes taken, from their own operand's mesh (a
    # parameter made outside the mesh context has an empty one)
    for i, (dims, aval, sharding) in enumerate(zip(rule.operands, avals, shardings)):
        dim_axes = list(_dim_axes(family, i, sharding, len(aval.shape)))
        at = 0
        for f in full_rule.operands[i]:
            if isinstance(f, Halves):
                # Its halves' 2 sharded (a contiguous split of the 2 H: one device's gates,
                # another's values): those axes split H instead, each device then holding its part
                # of both halves (XLA reshards the operand to that)
                dim_axes[at + 1], dim_axes[at] = dim_axes[at] + dim_axes[at + 1], ()
            at += len(views.of(f) or (f,))
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
                    f"every device. {_sharding_hint(rule, i, views)}, or call the op inside jax.shard_map "
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
            axis_size.update((a, sharding.mesh.shape[a]) for a in axes)
            if kept := tuple(a for a in axes if sharding.mesh.shape[a] > 1):
                split[factor] = kept
            taken.update(axes)

    def spec(dims) -> PartitionSpec:
        def entry(factor):
            axes = axes_of.get(factor, ()) if factor is not None else ()
            return None if not axes else axes[0] if len(axes) == 1 else axes

        return PartitionSpec(*(entry(f) for f in dims))

    # The rows' view: a device runs its part of each of its dims, and sums over all their axes
    row_factors = views.of(ROWS) or (ROWS,)
    local_lead = tuple(n // math.prod(axis_size[a] for a in axes_of.get(f, ()))
                       for n, f in zip(views.lead, row_factors))
    if row_axes := tuple(a for f in row_factors for a in split.pop(f, ())):
        split[ROWS] = row_axes
    return Plan(full_rule, views, tuple(spec(d) for d in rule.operands), tuple(spec(d) for d in rule.results),
                ShardContext(split), local_lead)


def _sharding_hint(rule: ShardingRule, i: int, views: Views) -> str:
    named = [d for d, f in enumerate(rule.operands[i]) if f is not None]
    fix = "(jax.sharding.reshard or jax.lax.with_sharding_constraint)"
    if not named:
        return f"Every device needs all of it: replicate it {fix}"
    if {rule.operands[i][d] for d in named} <= set(views.of(ROWS) or (ROWS,)):
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
    return _joining_views(p.rule, p.views, p.local_lead, program)


def _joining_views(rule: ShardingRule, views: Views, lead, program: Callable) -> Callable:
    """``program`` of the kernel's operands and results taking and giving them viewed (a
    device's [gate_d | value_d] columns, its rows of ``lead``, joined, are what the kernel reads)."""
    if not views.any_in(rule):
        return program

    def joined(*operands):
        results = program(*(views.join(a, dims) for a, dims in zip(operands, rule.operands)))
        return tuple(views.split(r, dims, lead) for r, dims in zip(results, rule.results))

    return joined


# --- custom_partitioning -------------------------------------------------------------------------

def _sdy_rule(family, avals, views, mesh, operand_types, result_types) -> SdyShardingRule:
    """Shardy's view of the rule. Whole dims get a factor of their own, marked need-replication,
    so shardings never propagate through them from one array to another."""
    rule = views.rule(rule_for(family, avals))
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


def _partition(family, avals, views, mesh, arg_shapes, result_shape):
    p = plan(family, avals, [a.sharding for a in arg_shapes], views)
    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
    return mesh, per_shard_program(family, p), named(p.result_specs), named(p.operand_specs)


def _infer_result_shardings(family, avals, views, mesh, arg_shapes, result_shape):
    # Only the GSPMD partitioner (jax_use_shardy_partitioner=False) asks this.
    p = plan(family, avals, [a.sharding for a in arg_shapes], views)
    return tuple(NamedSharding(mesh, s) for s in p.result_specs)


def _global_call(family, avals, views, *arrays):
    return _joining_views(rule_for(family, avals), views, views.lead, functools.partial(run_kernel, family))(*arrays)


_partitioned_call = custom_partitioning(_global_call, static_argnums=(0, 1, 2))
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


def explicitly_sharded(*arrays) -> bool:
    """Whether any of ``arrays``' types is sharded over an ``Explicit`` mesh axis: jax then
    checks every intermediate's sharding while tracing, as it does the ops' reshapes."""
    return _explicit_shardings(arrays) is not None


def explicit_sharding(x, spec_from=lambda spec: spec):
    """Where ``x``'s type is sharded over ``Explicit`` mesh axes, the sharding ``spec_from(x's
    spec)`` (one entry per dim of x) on x's own (abstract) mesh -- for a result jax does not infer
    (a gather's, a scatter's, zeros made beside x); None elsewhere (``Auto`` axes, inside
    ``jax.shard_map``, one device). Built from x's sharding because jax >= 0.11 takes a bare
    PartitionSpec only inside ``jax.set_mesh``."""
    if not explicitly_sharded(x):
        return None
    sharding = jax.typeof(x).sharding
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    return sharding.update(spec=spec_from(PartitionSpec(*spec)))


def typed_like(primals, cotangents) -> tuple:
    """``cotangents`` (None passes through), each resharded to its primal's sharding where that
    is over ``Explicit`` mesh axes: a custom_vjp's backward must give its primals' types, and a
    parameter that the kernel call gathered whole (fsdp) gets its gradient whole on every device."""
    def like(p, c):
        return c if c is None or p is None or not explicitly_sharded(p) else jax.sharding.reshard(
            c, jax.typeof(p).sharding)

    return tuple(like(p, c) for p, c in zip(primals, cotangents, strict=True))


def _explicit_axes(mesh) -> set[str]:
    return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}


def _explicit_call(family, avals, views, arrays, shardings):
    """Explicit sharding is known while tracing: run the per-device program in ``jax.shard_map``
    over the mesh's explicit axes, with the plan's specs (operands resharded to them first).

    ``check_vma=False``: the plan, not JAX's varying-axes types, says which results are the same
    on every device of an axis. Its type inference cannot see it where a result does not depend
    on a sharded operand dim (a row-parallel weight gradient's bias sums, of dz, replicated over
    the kernel's K axis, while the kernel call's results vary like x), nor over an axis of size 1
    (never psum'd); the per-device program psums every partial sum itself."""
    p = plan(family, avals, shardings, views)
    _check_halves_whole(family, p)
    mesh = next(s.mesh for s in shardings if isinstance(s, NamedSharding) and not s.mesh.empty)
    operands = [jax.sharding.reshard(a, NamedSharding(mesh, spec))
                for a, spec in zip(arrays, p.operand_specs)]
    # Inside jax.vmap of an array sharded along the mapped dim, shard_map may not map over that
    # dim's mesh axes (a per-example value is not sharded over them): it maps over the others
    names = _explicit_axes(mesh) - get_axis_env().explicit_mesh_axis_names
    program = jax.shard_map(per_shard_program(family, p), mesh=mesh, in_specs=p.operand_specs,
                            out_specs=p.result_specs, axis_names=names, check_vma=False)
    return tuple(program(*operands))


def _check_halves_whole(family: KernelFamily, p: Plan) -> None:
    """Over ``Explicit`` axes a :class:`Halves` dim must not be split: a device's [gate_d |
    value_d] share of it has no ``PartitionSpec`` of the 2 H dim, so the program could not hold
    such a result (jax refuses the reshape) without gathering it."""
    for i, dims in enumerate(p.rule.operands):
        for f in dims:
            if isinstance(f, Halves) and p.context.sharded(f.factor):
                raise ValueError(
                    f"{family.name}: argument {_argument_name(family, i)!r} holds a gated layer's gate and value "
                    f"halves side by side and is sharded along them over Explicit mesh axes "
                    f"{p.context.axes[f.factor]}: each device would hold its part of both halves, which no "
                    "sharding of the 2 H dim expresses. Replicate the gated layer's 2 H dim (and the "
                    "width it is contracted with), or use Auto mesh axes or jax.shard_map for a "
                    "tensor-parallel gated layer.")


def kernel_call(family: KernelFamily, *arrays, lead: tuple[int, ...] = (),
                rows_at: Sequence[int | None] = ()) -> tuple[jax.Array, ...]:
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

    ``lead``: the leading dims the op flattened into the rows (its input's shape but the features),
    which the sharding rules see as they were (:class:`Views`): a sharded sequence axis stays
    sharded. Ignored unless every rows dim of the call is their product (a chunk of the rows).

    ``rows_at``: per operand, the dim where the op gives its rows as ``lead``'s dims, not
    flattened (the kernel's rows dim; None, or the operands after the last given: as the kernel
    reads them). Each device then flattens its own part, and every result's rows dim comes back as
    ``lead``'s dims too: no reshape of a sharded array at the program's level, which under
    ``Explicit`` mesh axes jax refuses, or types in a layout other than the operands' (a (data,
    seq) sharding of (batch, sequence) rows).
    """
    at = _rows_at(arrays, lead, rows_at)
    given = any(d is not None for d in at)
    tracers = [a for a in arrays if isinstance(a, Tracer)]
    staged = tracers and all(isinstance(t, DynamicJaxprTracer) for t in tracers)
    direct = not staged or _inside_shard_map()
    if direct and not given:
        return run_kernel(family, *arrays)
    avals = kernel_avals(arrays, lead, at)
    rule = rule_for(family, avals)
    views = Views(_row_view(rule, avals, family.out_avals(avals), lead))
    if given and not views.lead:
        raise AssertionError(f"{family.name}: operands given as rows of {tuple(lead)}, but not every rows dim "
                             "of the call holds their product")
    arrays = [views.split(a, dims, rows=d is None) for a, d, dims in zip(arrays, at, rule.operands)]
    shardings = None if direct else _explicit_shardings(arrays)
    if direct:  # a device's own rows: joined for the kernel here
        results = _global_call(family, avals, views, *arrays)
    elif shardings is not None:
        results = _explicit_call(family, avals, views, arrays, shardings)
    else:
        results = _partitioned_call(family, avals, views, *arrays)
    return tuple(views.join(r, dims, rows=not given) for r, dims in zip(results, rule.results))


def _rows_at(arrays, lead, rows_at) -> tuple[int | None, ...]:
    """:func:`kernel_call`'s ``rows_at``, one per operand; none given where ``lead`` is one dim or
    none (the rows are flat already)."""
    at = tuple(rows_at)[:len(arrays)] if len(lead) > 1 else ()
    return at + (None,) * (len(arrays) - len(at))


def kernel_avals(arrays, lead: tuple[int, ...] = (), rows_at: Sequence[int | None] = ()) -> tuple:
    """The operands of :func:`kernel_call` as the kernel reads them: each given as rows (its
    ``rows_at``) with ``lead``'s dims as one."""
    width = len(lead)

    def flat(shape, d):
        return tuple(shape) if d is None else (*shape[:d], math.prod(shape[d:d + width]), *shape[d + width:])

    return tuple(jax.ShapeDtypeStruct(flat(a.shape, d), a.dtype) for a, d in zip(arrays, _rows_at(arrays, lead, rows_at)))


def rows_as_lead(family: KernelFamily, avals, results, lead: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """``results`` of the kernel on ``avals`` (flat rows, e.g. the reference's) with each rows
    dim as ``lead``'s dims, as :func:`kernel_call` gives them for operands given as rows."""
    def as_lead(r, dims):
        d = dims.index(ROWS) if ROWS in dims else None
        return r if d is None else r.reshape(*r.shape[:d], *lead, *r.shape[d + 1:])

    return tuple(as_lead(r, dims) for r, dims in zip(results, rule_for(family, avals).results))


def _row_view(rule: ShardingRule, avals, out_avals, lead) -> tuple[int, ...]:
    """``lead`` if every rows dim of the call holds its product of rows, else () (no rows view)."""
    lead = tuple(lead)
    rows = [a.shape[d] for a, dims in zip((*avals, *out_avals), (*rule.operands, *rule.results))
            for d, f in enumerate(dims) if f == ROWS]
    return lead if len(lead) > 1 and rows and all(n == math.prod(lead) for n in rows) else ()
