"""The kernel-family interface: every hook the runtime and the tuned-config tables read from a
family of CuTe kernels, declared once, with its type and its default.

A family describes one kernel and its static options (activation, epsilon, config ...). It is a
small frozen dataclass: hashable, because it is a parameter of the kernel-call primitive and part
of the compile key. An op builds a family for its operands and calls it through
:func:`cutelayers.runtime.sharding.kernel_call`.

Hooks receive *avals*: the operands or results as the kernel sees them (arrays, tracers,
``jax.ShapeDtypeStruct``\\ s or the lowering's ``ShapedArray``\\ s; only ``shape`` and ``dtype``
are read). Operands and results share one position numbering, results after operands.

Two classes, one per reader:

* :class:`KernelFamily`, what the runtime reads (:mod:`~cutelayers.runtime.primitive`: compile,
  lower; :mod:`~cutelayers.runtime.sharding`: run on a mesh). Required: :attr:`~KernelFamily.name`,
  :meth:`~KernelFamily.out_avals`, :meth:`~KernelFamily.reference`,
  :meth:`~KernelFamily.launcher`. The other hooks default to a kernel on (rows, ...) arrays: the
  leading dim of each is the symbolic row count, buffers are seen as stored, every result is
  written by the launcher, and only rows may be sharded.
* :class:`TunableFamily`, a family whose kernel takes a config: the four hooks
  :mod:`cutelayers.tuning` reads to choose one (``tuning.resolve``) and the autotuner reads to
  sweep them, and :meth:`~TunableFamily.with_config`, which both use to set it.

Implementations, each in its own file: :class:`cutelayers.ops._rowwise.RowKernelFamily` (row
kernels' configs) and its families in ``ops/norm.py``, ``ops/softmax.py``, ``ops/reduce.py``;
:class:`cutelayers.ops.linear.GemmFamily` (the GEMM's operand kinds) and its families in the same
file; :class:`cutelayers.cute_call.UserKernel` (a user launcher and its call plan).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import jax


class Aval(Protocol):
    """What hooks read of an operand or result."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's dims."""

    @property
    def dtype(self) -> Any:
        """The array's dtype."""


@dataclasses.dataclass(frozen=True)
class Halves:
    """The factor of a dim of 2 H elements that holds two halves side by side -- a gated layer's
    gate and value columns -- and may be sharded along H: a device's share is its part of each
    half, [gate_d | value_d], which the kernel reads as a gated layer of its own. On a mesh the
    runtime views the dim as (2, H), the 2 whole and H named ``factor`` (a contiguous block of the
    2 H would give one device gates and another their values)."""

    factor: str


ROWS = "rows"
"""The factor of the rows: the dim an op flattens its row-wise arrays' leading dims into (the
default rule's name for it; the runtime sees it as those dims again, ``sharding.Views``)."""

Factor = str | Halves | None
Factors = tuple[Factor, ...]  # per dim: a factor name, two halves of one, or None (the kernel needs it whole)
Dims = tuple[tuple[str, Any], ...]  # a tuned-table key's dims: (name, value) pairs


def factor_name(factor: Factor) -> str | None:
    """The name a dim's factor shards it by: its own, a :class:`Halves`' factor, or None."""
    return factor.factor if isinstance(factor, Halves) else factor


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    """How a kernel call runs on a mesh: the factor of every dim of every operand and result.

    * a **name**: the dim may be sharded. Arrays that share the name are sharded alike (the rows of
      a norm's x, y and statistics; the N of a GEMM's kernel, bias and output). A result that lacks
      a name its operands have is a sum over that dim (einsum's rule: a GEMM's K, the rows of a
      weight gradient), so each device's partial result is psum'd over the mesh axes that shard it.
    * ``None``: the kernel needs the whole dim (the feature axis a norm or softmax reduces over).
    * a :class:`Halves`: a dim of two halves side by side, sharded along the halves' length.

    ``per_shard(ctx, *operands) -> results``, if given, replaces the default per-device program
    (the kernel, then a psum of each result over the sharded factors it lacks); ``ctx`` is the
    :class:`~cutelayers.runtime.sharding.ShardContext` of the chosen sharding.
    """

    operands: tuple[Factors, ...]
    results: tuple[Factors, ...]
    per_shard: Callable | None = None

    def summed_factors(self, result: int) -> frozenset[str]:
        """Named factors of the operands that result ``result`` lacks: it is a sum over them."""
        named = {factor_name(f) for dims in self.operands for f in dims} - {None}
        return frozenset(named - {factor_name(f) for f in self.results[result]})


class KernelFamily(abc.ABC):
    """One family of CuTe kernels, as the runtime sees it (see the module docstring)."""

    # --- required ---------------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The kernel's name: cache statistics, FFI target names, tuned-table entries, errors."""

    @abc.abstractmethod
    def out_avals(self, avals: Sequence[Aval]) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The output contract: one ``jax.ShapeDtypeStruct`` per result, for these operands."""

    @abc.abstractmethod
    def reference(self, *arrays: jax.Array) -> Sequence[jax.Array]:
        """The results computed with jnp: what runs off CUDA and under the ``reference`` backend."""

    @abc.abstractmethod
    def launcher(self, avals: Sequence[Aval], out_avals: Sequence[Aval]) -> Callable:
        """The ``@cute.jit`` callable ``launcher(stream, *inputs, *outputs, **constexpr)`` for these
        dtypes and static dims (inputs and outputs as :meth:`modes_at` and :meth:`kept_outputs`
        present them)."""

    # --- optional, with their defaults ------------------------------------------------------------

    arg_names: tuple[str, ...] = ()
    """Operand names, for error messages (default: none; errors say "operand i")."""

    graph_safe: bool = True
    """Whether the kernel may be captured in a CUDA graph."""

    def dynamic_dims_at(self, position: int, aval: Aval) -> tuple[bool, ...]:
        """Which dims of operand / result ``position`` are symbolic (one compile serves every size);
        the others are static and part of the compile key. Default: the leading one, the rows."""
        return tuple(i == 0 for i in range(len(aval.shape)))

    def modes_at(self, position: int) -> tuple[int, ...] | None:
        """The order in which the launcher sees the dims of operand / result ``position`` (a view,
        no copy), or None: as stored (default)."""
        return None

    def kept_outputs(self, n_outputs: int) -> tuple[int, ...]:
        """Indices of the results the launcher receives (default: all); the others are written in
        place of an operand (:meth:`operand_output_aliases`)."""
        return tuple(range(n_outputs))

    def operand_output_aliases(self) -> dict[int, int] | None:
        """``{operand index: result index}`` for results written in place of an operand (default:
        None, no aliasing)."""
        return None

    def constexpr_items(self) -> tuple[tuple[str, Hashable], ...]:
        """Compile-time keyword arguments passed to the launcher (default: none)."""
        return ()

    def identity(self) -> Hashable:
        """What identifies the kernel in the compile key, besides the dtypes and static dims
        (default: the family itself, all its fields)."""
        return self

    def source_files(self) -> tuple[str, ...]:
        """Source files, besides the cutelayers package, whose change must invalidate the disk
        cache (default: none; a user kernel's module)."""
        return ()

    def sharding_rule(self, avals: Sequence[Aval]) -> ShardingRule:
        """How the call runs on a mesh (see :class:`ShardingRule`).

        Default, the rows rule: an operand or result is row-wise when its leading dim is operand
        0's and symbolic (:meth:`dynamic_dims_at`: the kernel serves every row count), and only
        those rows may be sharded; every other dim is whole. When some result is not row-wise (a
        reduction over rows) the default cannot tell how to combine shards, so nothing may be
        sharded: such a family declares its own rule.
        """
        out_avals = self.out_avals(avals)
        every = (*avals, *out_avals)
        m = avals[0].shape[0] if avals and avals[0].shape else None

        def row_wise(position, aval) -> bool:
            return bool(aval.shape) and aval.shape[0] == m and self.dynamic_dims_at(position, aval)[0]

        shardable = m is not None and all(row_wise(len(avals) + j, o) for j, o in enumerate(out_avals))

        def factors(position, aval) -> Factors:
            lead = ROWS if shardable and row_wise(position, aval) else None
            return (lead,) + (None,) * (len(aval.shape) - 1) if aval.shape else ()

        dims = [factors(i, a) for i, a in enumerate(every)]
        return ShardingRule(tuple(dims[:len(avals)]), tuple(dims[len(avals):]))


class TunableFamily(KernelFamily):
    """A kernel family whose kernel takes a config: a frozen dataclass held in the family's
    ``config`` field, None until ``cutelayers.tuning.resolve(family, avals)`` chooses it (the
    tuned table's entry, else :meth:`default_config`). The launcher reads it through
    :meth:`chosen_config`.
    """

    config: Any
    """The kernel's config (a dataclass field of every implementation, default None)."""

    @abc.abstractmethod
    def default_config(self, avals: Sequence[Aval]) -> Any:
        """The heuristic config for these operands (one of :meth:`config_space`'s)."""

    @abc.abstractmethod
    def config_space(self, avals: Sequence[Aval]) -> tuple:
        """Every config the kernel compiles and computes correctly with for these operands: the
        autotuner's candidates, and the configs a tuned entry may name."""

    @abc.abstractmethod
    def tuning_key(self, avals: Sequence[Aval]) -> tuple[str, Dims]:
        """``(dtype, dims)``: with the GPU and :attr:`name`, the tuned table's key for these
        operands (dims: what the heuristic and the space depend on)."""

    def tuning_keys(self, avals: Sequence[Aval]) -> tuple[tuple[str, Dims], ...]:
        """The keys a config is looked up by, the most specific first: :meth:`tuning_key` alone,
        unless the family's entries may also cover more shapes (a row kernel's: those of its row
        count's range, then those of every row count)."""
        return (self.tuning_key(avals),)

    @abc.abstractmethod
    def config_from_fields(self, fields: dict) -> Any:
        """A config from its JSON form (``dataclasses.asdict`` of one)."""

    def with_config(self, config: Any, avals: Sequence[Aval]) -> TunableFamily:
        """This family running ``config`` on these operands: what :func:`cutelayers.tuning.resolve`
        returns, and what the autotuner times for each candidate. A family whose kernel depends on
        more of the operands than its compile key holds (the norm forward's few rows) sets it here."""
        return dataclasses.replace(self, config=config)

    def chosen_config(self) -> Any:
        """The config; an error if none has been chosen yet."""
        if self.config is None:
            raise ValueError(f"{self.name}: no config chosen; build the family with "
                             "cutelayers.tuning.resolve(family, operands)")
        return self.config
