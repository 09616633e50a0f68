"""Shared plumbing of row-wise ops: the row kernels' family, argument checks, kernel calls on
(rows, features) views. (Their vmap: :mod:`cutelayers.ops._batching`.)"""

from __future__ import annotations

import dataclasses
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from cutelayers import backend as _backend
from cutelayers.kernels.hopper import concrete_dim
from cutelayers.kernels.reduction_config import (
    FEW_ROWS,
    SHARE_BUDGETS,
    STAGED_ROW_BYTES,
    RowConfig,
    geometry_for,
    row_count_bucket,
    row_geometry,
    row_geometry_space,
    split_rows,
)
from cutelayers.runtime.family import TunableFamily
from cutelayers.runtime.placement import check_arrays
from cutelayers.runtime.sharding import kernel_avals, kernel_call, rows_as_lead
from cutelayers.runtime.tensors import FLOAT_DTYPES
from cutelayers.tuning import dtype_names, resolve

# The fewest steps of a row walked shifted (RowKernelFamily.shift): a row of one step ran 6-7 %
# slower shifted in the softmax forward and backward (H100, 4097 bf16 columns).
SHIFTED_MIN_STEPS = 2


class RowKernelFamily(TunableFamily):
    """The row kernels' shared implementation of :class:`~cutelayers.runtime.family.TunableFamily`:
    kernels on (rows, n) operands whose config is a
    :class:`cutelayers.kernels.reduction_config.RowConfig`.

    Subclasses give ``values_per_thread``, the kernel's register budget (from its CuTe-free config
    module, e.g. :mod:`cutelayers.kernels.norm_config`), or override ``register_values(avals)``
    (a budget by element width, the norm backward's); it selects the heuristic
    (:func:`.row_geometry`) and the space (:func:`.row_geometry_space`) of
    :mod:`cutelayers.kernels.reduction_config` for register-resident row kernels -- or override
    ``default_config`` and ``config_space`` (the row-reduce kernel) -- and may override
    ``row_dtypes(avals)``: the dtypes of the operands the kernel walks along the row (the widest
    sets the vector width; default: the first operand's). The tuned table's key is those dtypes,
    N and the row count's range; an entry without the range holds for every row count past the
    first range (a decode batch's).
    ``per_row_rank`` says which operands have a symbolic row count. Their ``launcher`` imports the
    kernel module, so only building a kernel needs the CuTe DSL.
    """

    per_row_rank: int | None = None
    """The rank of the operands and results that hold one value per row (their leading dim the
    symbolic row count); None: all of them. The norms' are rank 2: their rank-1 arrays are
    per-feature parameters and flat partial sums, fully static."""

    values_per_thread: int
    """fp32 values a thread of the kernel holds per row step (register-resident row kernels)."""

    staged_operands: int = 0
    """Row operands a two-pass kernel stages in shared memory when its row streams, its long rows
    cut over a cluster of CTAs (:func:`cutelayers.kernels.reduction_config.split_rows`); 0: a
    kernel that stages nothing, whose rows are cut only where its config's share budget says (a
    decode batch's: :class:`cutelayers.ops.softmax.FewRowsCut`)."""

    staged_sums: int = 0
    """fp32 sums a column that a streamed row's CTA keeps in shared memory next to its staged
    operands (the norm backward's dscale / dbias): they count against the same budget."""

    share_budget: int = STAGED_ROW_BYTES
    """Shared memory a CTA's share of a streamed row may take before the row is cut over more CTAs
    (:func:`cutelayers.kernels.reduction_config.split_rows`)."""

    cuts_row_slots: bool = False
    """Whether the kernel's streamed rows may be cut over a cluster with several rows a CTA (each
    row slot's statistics exchanged on its own: :func:`cutelayers.kernels.reduction.cluster_gather`),
    so its CTAs read a parameter's step once for all their rows; else only one-row CTAs are cut."""

    streamed_threads: int | None = None
    """Threads per row (one row a CTA) of a streamed row's heuristic config; None: the table's."""

    shifts_rows: bool = False
    """Whether the kernel can walk rows whose starts N leaves misaligned in full vectors from the
    aligned address before each (:attr:`cutelayers.kernels.reduction_config.RowGeometry.shifted`,
    one row a CTA), and does where :meth:`shift` says; else it walks them in the narrower accesses
    that keep every row start aligned."""

    def shift(self, avals) -> bool:
        """Whether the kernel walks these rows shifted: it can (``shifts_rows``), N leaves their
        starts misaligned, and its heuristic walks a row in at least :data:`.SHIFTED_MIN_STEPS`
        steps, whether one CTA takes the row or a cluster cuts it. H100, bf16, against scalar
        accesses (docs/benchmarks.md, sixty-seventh session): the softmax forward 1.25x faster at
        10682 x 50257 and 1.31x at 4096 x 131071 (cut over 4 CTAs), the backward 1.27x and 1.53x
        (cut over 2 and 8), the cross-entropy fwd+bwd 1.28x and 1.49x."""
        if not self.shifts_rows:
            return False
        g = row_geometry(self.row_length(avals), self.elem_bits(avals), self.register_values(avals), True)
        return g.shifted and g.num_steps >= SHIFTED_MIN_STEPS

    def register_values(self, avals) -> int:
        """``values_per_thread`` for these operands (a kernel may budget by element width)."""
        return self.values_per_thread

    def dynamic_dims_at(self, position, aval) -> tuple[bool, ...]:
        per_row = self.per_row_rank in (None, len(aval.shape))
        return tuple(per_row and i == 0 for i in range(len(aval.shape)))

    def row_dtypes(self, avals) -> tuple:
        return (avals[0].dtype,)

    def row_length(self, avals) -> int:
        return avals[0].shape[-1]

    def elem_bits(self, avals) -> int:
        return max(jnp.dtype(d).itemsize * 8 for d in self.row_dtypes(avals))

    def default_config(self, avals):
        g = row_geometry(self.row_length(avals), self.elem_bits(avals), self.register_values(avals),
                         self.shift(avals))
        if self.streamed_threads is None or g.resident:
            return g.row
        return next(c for c in self.config_space(avals)
                    if c.threads_per_row == c.num_threads == self.streamed_threads)

    def config_space(self, avals) -> tuple:
        """:func:`.row_geometry_space`'s configs; where the kernel stages streamed rows, also each
        one-row config (each config, where it ``cuts_row_slots``) with the other ``SHARE_BUDGETS``
        that cut its rows differently."""
        space = row_geometry_space(self.row_length(avals), self.elem_bits(avals), self.register_values(avals),
                                   self.shift(avals))
        configs = [g.row for g in space]
        if not self.staged_operands or space[0].resident:
            return tuple(configs)

        def how(c):  # the cut itself, whichever budget gave it
            g = self.cut(c, avals)
            return g.cluster, g.row.unroll, g.share_width

        for config in [c for c in configs if c.rows_per_cta == 1 or self.cuts_row_slots]:
            cuts = {how(config)}
            for budget in SHARE_BUDGETS:
                other = dataclasses.replace(config, share_budget=budget)
                cut = how(other)
                if cut not in cuts:
                    configs.append(other)
                    cuts.add(cut)
        return tuple(configs)

    @staticmethod
    def decode_batch(avals) -> bool:
        """Whether the rows are a concrete count of at most :data:`.reduction_config.FEW_ROWS` (a
        symbolic one, under shape polymorphism, is not known to be few)."""
        rows = concrete_dim(avals[0].shape[0])
        return rows is not None and rows <= FEW_ROWS

    def tuning_key(self, avals):
        """The row dtypes and N, and the range of a concrete row count (:func:`.row_count_bucket`):
        a config the autotuner found best at a row count holds near it."""
        dims = (("n", self.row_length(avals)),)
        rows = concrete_dim(avals[0].shape[0]) if len(avals[0].shape) == 2 else None
        if rows is not None:
            dims += (("rows", row_count_bucket(rows)),)
        return dtype_names(self.row_dtypes(avals)), dims

    def tuning_keys(self, avals):
        """:meth:`tuning_key`, then the key of every row count (N's alone) -- but for the first of
        :func:`.row_count_bucket`'s ranges (a decode batch), whose kernel is a short wave's latency
        rather than the stream of rows an entry of every row count was swept on (the H100's
        layer_norm entry at 8192, two rows a CTA: 3.1 us on 8 rows against 2.3 without it,
        docs/benchmarks.md, sixty-first session)."""
        key = self.tuning_key(avals)
        every = (key[0], (("n", self.row_length(avals)),))
        if key == every:
            return (every,)
        return (key,) if dict(key[1])["rows"] == row_count_bucket(1) else (key, every)

    def config_from_fields(self, fields: dict):
        return RowConfig(**fields)

    def geometry(self, avals):
        """The chosen config applied to these operands' rows (cut over a cluster where the kernel
        stages a streamed row that one CTA cannot hold)."""
        return self.cut(self.chosen_config(), avals)

    def cut(self, config: RowConfig, avals):
        """``config`` applied to these operands' rows: :func:`.split_rows` with the config's share
        budget, or the family's, where the kernel stages streamed rows; with the config's (shares
        of one row operand) where one that stages nothing has one."""
        g = geometry_for(config, self.row_length(avals), self.elem_bits(avals), self.shift(avals))
        if self.staged_operands or config.share_budget:
            g = split_rows(g, self.elem_bits(avals) // 8, max(self.staged_operands, 1), self.staged_sums,
                           budget=config.share_budget or self.share_budget, row_slots=self.cuts_row_slots)
        return g


def check_float_array(op: str, name: str, x, min_rank: int = 1) -> jax.Array:
    """Validate a floating-point operand; returns it as a JAX array (or tracer). Its dtype is read
    as JAX reads it: a NumPy float64 array is float32 where x64 is off, as ``jnp.asarray`` makes it."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: argument {name!r} must be an array; got {type(x).__name__}")
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
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


def check_number(op: str, name: str, value) -> float:
    """A real-number option (a Python or NumPy scalar, or a concrete 0-d array) as a finite
    float: no bools, strings (``float('0.1')`` would parse them), traced values or infinities."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{op}: argument {name!r} must be a number; got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):  # traced (a ConcretizationTypeError is a TypeError), or not 0-d
        raise TypeError(f"{op}: argument {name!r} must be a number (concrete, not traced, one "
                        f"element); got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{op}: argument {name!r} must be finite; got {number}")
    return number


def check_int(op: str, name: str, value) -> int:
    """An integer option (a Python or NumPy integer, or a concrete 0-d integer array) as an int:
    no bools, floats (``int(1.5)`` would truncate) or traced values."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        return operator.index(value)
    except TypeError:  # a float, a string, a traced value (TracerIntegerConversionError)
        raise TypeError(f"{op}: argument {name!r} must be an int (concrete, not traced); got {value!r}") from None


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def as_int32(ids: jax.Array) -> jax.Array:
    """Integer ids (labels, embedding rows) as int32, the kernels' index type. Narrower ones widen
    first, so that ``ids + n`` or ``ids < n`` does not wrap in their own dtype (uint8 200 + 256);
    wider ones are bounded to int32's range before the cast, so one out of range stays out of
    range rather than wrapping onto a valid index (int64 2^32 + 1 -> 1)."""
    ids = jnp.asarray(ids)
    if ids.dtype.itemsize >= 4 and ids.dtype != jnp.int32:
        unsigned = jnp.issubdtype(ids.dtype, jnp.unsignedinteger)
        ids = jnp.minimum(ids, INT32_MAX) if unsigned else jnp.clip(ids, INT32_MIN, INT32_MAX)
    return ids.astype(jnp.int32)


def check_dtype(op: str, name: str, dtype) -> jnp.dtype:
    """A floating dtype argument (anything ``jnp.dtype`` reads) as a dtype of FLOAT_DTYPES."""
    try:
        given = jnp.dtype(dtype)
    except TypeError:
        given = None
    if given not in FLOAT_DTYPES:
        allowed = ", ".join(d.name for d in FLOAT_DTYPES)
        raise TypeError(f"{op}: argument {name!r} is {given.name if given is not None else repr(dtype)}; "
                        f"allowed: {allowed}")
    return given


def normalize_axis(op: str, axis, ndim: int) -> int:
    axis = check_int(op, "axis", axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def symbolic_width(family: TunableFamily, avals) -> bool:
    """Whether the rows of ``avals[0]`` (rows, ...) have a symbolic width (``jax.export``'s
    shape polymorphism), which no config can be chosen for: then the call takes the reference,
    after the backend's one fallback line."""
    width = avals[0].shape[1:]
    if all(concrete_dim(d) is not None for d in width):
        return False
    _backend.fall_back(family.name, f"its rows are {width} wide, symbolic; the kernels' configs need a number")
    return True


def call_kernel(family: TunableFamily, *operands: jax.Array, lead=(), rows_at=()) -> tuple[jax.Array, ...]:
    """``family``, its config chosen for these operands, called on them; the first operand is
    (rows, ...), and zero rows skip the launch. Rows of a symbolic width take the reference
    (:func:`symbolic_width`). ``lead``: the dims flattened into the rows; ``rows_at``: the
    operands given with their rows as ``lead`` instead, as the results then come (see
    :func:`~cutelayers.runtime.sharding.kernel_call`)."""
    avals = kernel_avals(operands, lead, rows_at)
    given = any(d is not None for d in rows_at) and len(lead) > 1
    if symbolic_width(family, avals):
        results = family.reference(*(a.reshape(v.shape) for a, v in zip(operands, avals)))
    elif avals[0].shape[0] == 0:
        results = [jnp.zeros(o.shape, o.dtype) for o in resolve(family, avals).out_avals(avals)]
    else:
        return kernel_call(resolve(family, avals), *operands, lead=lead, rows_at=rows_at)
    return rows_as_lead(family, avals, results, lead) if given else tuple(results)


def rows_of(lead, *row_args: jax.Array) -> tuple[list, tuple[int, ...]]:
    """Row-wise arrays (``lead``, then each its own trailing dims) as a kernel call's operands,
    and :func:`call_kernel`'s ``rows_at`` for them: flattened to (rows, ...) where ``lead`` is
    one dim or none; else as they are, their rows given at dim 0 -- each device flattens its own
    part."""
    if len(lead) > 1:
        return list(row_args), (0,) * len(row_args)
    return [a.reshape(-1, *a.shape[len(lead):]) for a in row_args], ()


def call_on_rows(family: RowKernelFamily, *row_args: jax.Array) -> tuple[jax.Array, ...]:
    """Run ``family`` on row-wise arrays: the first argument's leading dims (all but the last) are
    the rows; every argument has those leading dims plus its own trailing ones (x (..., N), labels
    (...)), and so has every result."""
    lead = row_args[0].shape[:-1]
    operands, given = rows_of(lead, *row_args)
    return tuple(o.reshape(*lead, *o.shape[len(lead) if given else 1:])
                 for o in call_kernel(family, *operands, lead=lead, rows_at=given))
