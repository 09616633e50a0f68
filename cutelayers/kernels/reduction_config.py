"""The row kernels' configs without CuTe: :class:`RowConfig` (threads per row, CTA size, unroll),
:class:`RowGeometry` (a config applied to rows of ``n`` elements), the heuristic tables and the
config spaces the autotuner sweeps (see :mod:`.reduction` for the layout they describe).

Ops choose a config when they trace, on every platform and also where the CuTe DSL is not
installed, so this module imports no CuTe; the kernels import it.
"""

from __future__ import annotations

import dataclasses
import math

WARP = 32


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """How a row kernel maps threads to a row: see the module docstring. ``share_budget``: the
    shared memory (bytes) a CTA's share of a streamed row may take before the row is cut over
    more CTAs (:func:`split_rows`); 0, the kernel family's own."""

    threads_per_row: int
    num_threads: int
    unroll: int
    share_budget: int = 0

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def warps_per_row(self) -> int:
        return max(self.threads_per_row // WARP, 1)


def vector_width(n: int, elem_bits: int) -> int:
    """Elements per access: 128 bits where ``n`` keeps every row start aligned, else less."""
    vec = 128 // elem_bits
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def row_chunks(n: int, elem_bits: int) -> int:
    """Vector accesses needed to cover a row of ``n`` elements once."""
    return math.ceil(n / vector_width(n, elem_bits))


def row_config(n: int, elem_bits: int) -> RowConfig:
    """The heuristic config table for a row of ``n`` elements (see docs/benchmarks.md)."""
    chunks = row_chunks(n, elem_bits)
    if chunks <= 64:
        tpr = 1 << max(math.ceil(math.log2(max(chunks, 1))), 0)
        tpr = min(max(tpr, 4), 32)
        return RowConfig(threads_per_row=tpr, num_threads=128, unroll=1)
    if chunks <= 512:
        return RowConfig(threads_per_row=32, num_threads=128, unroll=2)
    if chunks <= 4096:
        return RowConfig(threads_per_row=128, num_threads=256, unroll=4)
    return RowConfig(threads_per_row=256, num_threads=256, unroll=4)


# The row counts between which a row kernel's best config may change for a fixed N, and so the
# ranges a tuned entry names (:func:`row_count_bucket`): a few rows (decode: one short wave, latency);
# a training step's tokens (arrays of 16-64 MiB at the model widths, a wave or two of CTAs, whose
# ramp and last wave weigh); more (the 256 MiB arrays most entries were timed on). H100, layer_norm
# bf16 at N = 1024: 512-thread CTAs of two-warp rows 5 % faster than the heuristic at 131072 rows,
# 2.5 % slower at 16384 (docs/benchmarks.md, sixtieth session).
ROW_COUNT_EDGES = (64, 32768)
# A decode batch: a concrete row count in the first of those ranges (RowKernelFamily.decode_batch),
# whose kernel is one short wave's latency rather than a stream of rows.
FEW_ROWS = ROW_COUNT_EDGES[0]


def row_count_bucket(rows: int) -> str:
    """The range of :data:`ROW_COUNT_EDGES` that ``rows`` falls in ("1-64", "65-32768", "32769+")."""
    low = 1
    for edge in ROW_COUNT_EDGES:
        if rows <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f"{low}+"


MIN_THREADS_PER_ROW = 4
MAX_THREADS_PER_ROW = 512  # 1024-thread CTAs would cap a thread at 64 registers
CTA_THREADS = (128, 256, 512)  # CTA sizes the config spaces offer
REDUCE_UNROLLS = (1, 2, 4)


def _step_limit(chunks: int) -> int:
    """Widest useful step, in accesses: the row's accesses rounded up to a power of two (a wider
    step leaves at least half of it past the row's end)."""
    return max(MIN_THREADS_PER_ROW, 1 << (chunks - 1).bit_length())


def _threads_per_row_options(chunks: int) -> list[int]:
    """Powers of two from MIN_THREADS_PER_ROW to MAX_THREADS_PER_ROW, at most the step limit."""
    options, tpr = [], MIN_THREADS_PER_ROW
    while tpr <= min(_step_limit(chunks), MAX_THREADS_PER_ROW):
        options.append(tpr)
        tpr *= 2
    return options


def row_config_space(n: int, elem_bits: int) -> tuple[RowConfig, ...]:
    """The configs :class:`RowReduceKernel` can run rows of ``n`` elements with: threads per row
    (see :func:`_threads_per_row_options`) x unroll in ``REDUCE_UNROLLS`` (a step no wider than
    :func:`_step_limit`) x CTA sizes in ``CTA_THREADS`` that hold whole rows."""
    chunks = row_chunks(n, elem_bits)
    return tuple(
        RowConfig(threads_per_row=tpr, num_threads=threads, unroll=unroll)
        for tpr in _threads_per_row_options(chunks)
        for unroll in REDUCE_UNROLLS
        if unroll == 1 or tpr * unroll <= _step_limit(chunks)
        for threads in CTA_THREADS
        if threads >= tpr
    )


@dataclasses.dataclass(frozen=True)
class RowGeometry:
    """A row config plus the step geometry for rows of ``n`` elements.

    ``cluster`` > 1 cuts each row over that many CTAs of a thread-block cluster (a kernel that
    supports it: the softmax kernels' long rows): CTA ``r`` of a cluster covers columns
    ``[r * share_width, (r + 1) * share_width)`` of its rows (the last CTA what is left, at least
    a column) in ``steps_per_cta`` steps from the share's start, the last of them partial where
    the share is not whole steps; the row's statistics are combined through distributed shared
    memory.

    ``shifted``: rows whose starts are not all aligned to full vectors (N not a multiple of them)
    are walked in full vectors anyway, each one-row CTA from the aligned address at or before its
    row's start: a window of :attr:`span` columns whose first and last steps are partial (see
    :func:`.reduction.cta_share`). Shares, steps and cuts count the window's columns.
    """

    row: RowConfig
    n: int
    vec: int
    cluster: int = 1
    shifted: bool = False

    def __post_init__(self):
        if self.last_share_width < 1:
            raise ValueError(f"cluster {self.cluster} leaves a CTA none of the row's {self.span} columns "
                             f"(shares of {self.share_width})")
        if self.shifted and self.row.rows_per_cta != 1:
            raise ValueError(f"shifted rows need one row a CTA; got {self.row.rows_per_cta}")

    @property
    def span(self) -> int:
        """Columns a row's walk covers: ``n``, or a shifted row's window -- up to ``vec - 1``
        columns before the row's start, from the aligned address at or before it."""
        return self.n + self.vec - 1 if self.shifted else self.n

    @property
    def tile_n(self) -> int:
        return self.row.threads_per_row * self.vec * self.row.unroll

    @property
    def num_steps(self) -> int:
        return math.ceil(self.span / self.tile_n)

    @property
    def share_width(self) -> int:
        """Columns of a row one CTA covers: the row's own width (its window's, if shifted) without
        a cluster, else :func:`cut_share_width`."""
        return cut_share_width(self.span, self.cluster, self.share_quantum)

    @property
    def share_quantum(self) -> int:
        """Columns a cut row's shares are whole multiples of: ``SHARE_QUANTUM_ACCESSES`` vector
        accesses (fewer where a step has fewer)."""
        return self.vec * min(SHARE_QUANTUM_ACCESSES, self.row.threads_per_row * self.row.unroll)

    @property
    def last_share_width(self) -> int:
        """Columns of the cluster's last CTA's share (the rest of the row)."""
        return self.span - (self.cluster - 1) * self.share_width

    @property
    def steps_per_cta(self) -> int:
        """Steps of a CTA's share (the last CTA's may have fewer: :attr:`last_steps`)."""
        return math.ceil(self.share_width / self.tile_n)

    @property
    def last_steps(self) -> int:
        """Steps of the cluster's last CTA's share."""
        return math.ceil(self.last_share_width / self.tile_n)

    @property
    def resident(self) -> bool:
        """The whole row is one step: it stays in registers."""
        return self.num_steps == 1

    @property
    def one_step_shares(self) -> bool:
        """A row cut over a cluster in shares of one step each (a decode batch's wide rows): a
        two-pass kernel keeps each CTA's share in registers between its passes, as it does a
        register-resident row."""
        return not self.resident and self.steps_per_cta == 1 and self.last_steps == 1

    @property
    def edge_steps(self) -> tuple[bool, bool]:
        """Whether a share's first step may be partial (a shifted row's window's), and whether its
        last may be (:attr:`ragged`): the steps that need column predicates
        (:func:`.reduction.share_steps`)."""
        return self.shifted, self.ragged

    @property
    def ragged(self) -> bool:
        """A share's last step may be partial: its loads and stores need column predicates (up to
        the share's end: :func:`.reduction.share_limit`). Where the row's window starts depends
        on the row if it is shifted, so its last step may always be."""
        return self.shifted or self.share_width % self.tile_n != 0 or self.last_share_width % self.tile_n != 0


# A cut row's shares start this many vector accesses apart at least: 128 bytes of a row of full
# 16-byte vectors, so every share starts on whole L2 sectors and stages into aligned shared memory
# (reduction.STAGED_ROW_ALIGNMENT) as the row's start does.
SHARE_QUANTUM_ACCESSES = 8


def cut_share_width(n: int, cluster: int, quantum: int) -> int:
    """Columns of each CTA's share of a row of ``n`` cut over ``cluster`` CTAs: the row split
    evenly, rounded up to whole ``quantum`` columns (the last CTA gets the rest). Shares are
    balanced whatever the step: until the twenty-sixth session they were whole steps, and a row
    of 50304 in steps of 8192 was cut over 4 CTAs as 16384, 16384, 16384 and 1152 columns -- a
    persistent cluster walks its rows at the pace of its widest share."""
    if cluster == 1:
        return n
    return -(-n // (cluster * quantum)) * quantum


def row_geometry(n: int, elem_bits: int, values_per_thread: int, shift: bool = False) -> RowGeometry:
    """The config table of register-resident row kernels.

    The smallest ``threads_per_row`` (4 .. 512) for which a thread holds at most
    ``values_per_thread`` elements of the row in one step; rows that still do not fit are streamed
    in steps of ``512 * values_per_thread`` elements. ``elem_bits`` is the widest element among
    the row-shaped operands (it bounds the vector width). ``shift``: a kernel that can walk
    misaligned rows in full vectors (:attr:`RowGeometry.shifted`) does so where N leaves row
    starts misaligned and the row takes a CTA of its own.
    """
    full = shift_vector(n, elem_bits, shift)
    if full:
        config = _table_config(n + full - 1, full, values_per_thread)
        if config.rows_per_cta == 1:
            return RowGeometry(config, n, full, shifted=True)
    vec = vector_width(n, elem_bits)
    return RowGeometry(_table_config(n, vec, values_per_thread), n, vec)


def shift_vector(n: int, elem_bits: int, shift: bool) -> int:
    """The full vector width a kernel that can ``shift`` rows walks rows of ``n`` in where their
    starts are misaligned (N not a multiple of it); 0 where it walks them unshifted."""
    full = 128 // elem_bits
    return full if shift and n % full else 0


def _table_config(span: int, vec: int, values_per_thread: int) -> RowConfig:
    """:func:`row_geometry`'s config for a walk of ``span`` columns at vector width ``vec``."""
    chunks = math.ceil(span / vec)
    max_unroll = max(values_per_thread // vec, 1)
    tpr = MIN_THREADS_PER_ROW
    while tpr < MAX_THREADS_PER_ROW and math.ceil(chunks / tpr) > max_unroll:
        tpr *= 2
    unroll = min(math.ceil(chunks / tpr), max_unroll)
    return RowConfig(threads_per_row=tpr, num_threads=max(128, tpr), unroll=unroll)


def latency_geometry(n: int, elem_bits: int, values_per_thread: int, values: int) -> RowGeometry | None:
    """A config for rows whose kernel is one short wave -- a few rows, each row's latency the
    kernel's time -- rather than a stream of them: one row a CTA (several where the row's step is
    narrower than a CTA's 128 threads), spread over the power of two of threads (at least 128, at
    most ``MAX_THREADS_PER_ROW``, no wider than the row's step) that gives a thread about
    ``values`` elements, so each thread's loads are few and the row's all in flight at once. None
    where the row would not then be register resident (``values_per_thread`` its budget, as
    :func:`row_geometry`), or has fewer accesses than those threads (a bf16 row of 768 with bf16
    parameters, 96 on 128 threads, lost 0.1 us of 1.4-1.8 in add_layer_norm and add_rms_norm:
    docs/benchmarks.md, sixty-first session). One of :func:`row_geometry_space`'s configs."""
    vec = vector_width(n, elem_bits)
    chunks = math.ceil(n / vec)
    wanted = 1 << (math.ceil(n / values) - 1).bit_length()
    tpr = min(max(wanted, CTA_THREADS[0]), MAX_THREADS_PER_ROW, _step_limit(chunks))
    unroll = math.ceil(chunks / tpr)
    if chunks < tpr or unroll > max(values_per_thread // vec, 1):
        return None
    return RowGeometry(RowConfig(threads_per_row=tpr, num_threads=max(tpr, CTA_THREADS[0]), unroll=unroll), n, vec)


def row_geometry_space(n: int, elem_bits: int, values_per_thread: int, shift: bool = False) -> tuple[RowGeometry, ...]:
    """The configs a register-resident row kernel can run rows of ``n`` elements with.

    Threads per row: see :func:`_threads_per_row_options`; unroll: the fewest steps for that width
    with at most ``values_per_thread`` elements per thread (as :func:`row_geometry`); CTA sizes in
    ``CTA_THREADS`` that hold whole rows. A row that :func:`row_geometry` keeps in registers only
    gets configs that keep it there, and a streamed one only streamed configs: whether the row is
    resident decides the kernels' code path (one read of x; the norm backward's dscale partials).
    Where the heuristic shifts the rows (``shift``), so does every config: one row a CTA.
    """
    heuristic = row_geometry(n, elem_bits, values_per_thread, shift)
    vec, shifted = heuristic.vec, heuristic.shifted
    chunks = math.ceil(heuristic.span / vec)
    max_unroll = max(values_per_thread // vec, 1)
    candidates = (
        RowGeometry(RowConfig(threads_per_row=tpr, num_threads=threads,
                              unroll=min(math.ceil(chunks / tpr), max_unroll)), n, vec, shifted=shifted)
        for tpr in _threads_per_row_options(chunks)
        for threads in CTA_THREADS
        if threads >= tpr and (threads == tpr or not shifted)
    )
    return tuple(g for g in candidates if g.resident == heuristic.resident)


def geometry_for(config: RowConfig, n: int, elem_bits: int, shift: bool = False) -> RowGeometry:
    """``config`` applied to rows of ``n`` elements whose widest row operand has ``elem_bits``
    (shifted where the kernel can ``shift`` rows, N leaves them misaligned and a CTA has one)."""
    full = shift_vector(n, elem_bits, shift)
    if full and config.rows_per_cta == 1:
        return RowGeometry(config, n, full, shifted=True)
    return RowGeometry(config, n, vector_width(n, elem_bits))


# --- staged rows and rows cut over a cluster (kernels with a two-pass streamed row) -------------

# Shared memory a CTA may give a staged row: two CTAs per SM (228 KiB on Hopper, 1 KiB of it
# reserved per CTA), less the reduction buffers. A bf16 row of 50304 (GPT-2) takes 98 KiB.
STAGED_ROW_BYTES = 112 * 1024
# Where even a full cluster's shares exceed that (a bf16 LayerNorm backward's x, dy and fp32
# dscale / dbias sums at 262144: 216 KiB a CTA over 16), one CTA per SM may stage up to this much
# (an opt-in CTA has 227 KiB).
STAGED_ROW_BYTES_ALONE = 216 * 1024
# Share budgets the config spaces of kernels that stage streamed rows offer besides their own
# (more CTAs a row, more of them an SM): the best cut differs by width and kernel (the norm
# forward at N = 32768 ... 262144 in docs/benchmarks.md, eighteenth session). The largest, one CTA
# an SM, cuts a row over fewer CTAs (a bf16 row of 131072 over 2, not 4): clusters of 4 or more
# fit only 120-124 of the H100's 132 SMs at once (hopper.RESIDENT_CLUSTERS). (It was offered for
# LayerNorm's forward at 131072 and 262144, under 90 % of copy until the twenty-fourth session;
# that gap was misaligned staging, reduction.STAGED_ROW_ALIGNMENT, and the default cut now wins.)
SHARE_BUDGETS = (28 * 1024, 40 * 1024, 64 * 1024, 136 * 1024)
# CTAs a row may be cut over: Hopper's largest (non-portable) cluster, which CuTe DSL allows on
# every kernel. A bf16 softmax backward at 262144 stages 64 KiB a CTA over 16 (128 KiB over 8).
MAX_CLUSTER = 16


def share_bytes(geometry: RowGeometry, elem_bytes: int, operands: int = 1, accumulators: int = 0) -> int:
    """Shared memory one CTA needs to stage its share of ``operands`` row operands, plus
    ``accumulators`` fp32 sums per column of the share (the norm backward's dscale / dbias)."""
    return geometry.row.rows_per_cta * geometry.share_width * (operands * elem_bytes + 4 * accumulators)


def staged(geometry: RowGeometry, elem_bytes: int, operands: int = 1, accumulators: int = 0) -> bool:
    """Whether a two-pass kernel keeps a streamed row (one read in several steps) in shared memory
    for its second pass, instead of reading it from global memory again (then mostly from L2);
    ``accumulators``: fp32 sums per column the CTA keeps in shared memory as well."""
    limit = STAGED_ROW_BYTES if geometry.cluster == 1 else STAGED_ROW_BYTES_ALONE
    return not geometry.resident and share_bytes(geometry, elem_bytes, operands, accumulators) <= limit


def can_prefetch(geometry: RowGeometry, elem_bits: int) -> bool:
    """Whether cp.async can copy a staged row's accesses (4, 8 or 16 bytes): rows whose vector
    width gives at least 4 bytes of ``elem_bits``-bit elements."""
    return geometry.vec * elem_bits >= 32


def split_rows(geometry: RowGeometry, elem_bytes: int, operands: int, accumulators: int = 0,
               budget: int = STAGED_ROW_BYTES, row_slots: bool = False) -> RowGeometry:
    """``geometry`` with a streamed row of one-row CTAs -- or, for a kernel that exchanges each
    row slot's statistics on its own (``row_slots``), of CTAs of several rows, each CTA the same
    columns of each -- cut over the fewest CTAs (a power of two, at most ``MAX_CLUSTER``, each
    with a column) whose shares of ``operands`` row operands (and ``accumulators`` fp32 sums a
    column) stage in ``budget`` (``STAGED_ROW_BYTES`` by default, two CTAs an SM; a kernel may
    want smaller shares, more CTAs a row, or larger ones, fewer CTAs a row and one of them an SM)
    -- or failing that, the cut with the smallest shares, where they stage in
    ``STAGED_ROW_BYTES_ALONE`` or the kernel keeps sums there; the row is read from global memory
    once instead of twice. The cut runs at the unroll :func:`_fitted_steps` picks for its shares.
    Other geometries are returned as they are."""
    if geometry.resident or (geometry.row.rows_per_cta != 1 and not row_slots):
        return geometry
    if share_bytes(geometry, elem_bytes, operands, accumulators) <= min(budget, STAGED_ROW_BYTES):
        return geometry  # a row a CTA stages only where two CTAs fit an SM (``staged``)

    def size(g):
        return share_bytes(g, elem_bytes, operands, accumulators)

    candidates = _cuts(geometry)
    fitting = [cut for cut in candidates if size(cut) <= budget]
    if fitting:
        return _fitted_steps(fitting[0])
    smallest = min(candidates, key=size, default=None)
    if smallest is not None and (accumulators or staged(smallest, elem_bytes, operands, accumulators)):
        return _fitted_steps(smallest)
    return geometry


def cut_budget(config: RowConfig, n: int, elem_bits: int, cluster: int, operands: int = 1) -> int:
    """The share budget with which :func:`split_rows` cuts rows of ``n`` elements (``elem_bits``
    the widest row operand's) run with ``config`` over ``cluster`` CTAs: the bytes of one such
    share of ``operands`` staged row operands."""
    geometry = geometry_for(config, n, elem_bits)
    return cut_share_width(n, cluster, geometry.share_quantum) * operands * elem_bits // 8


def _fitted_steps(cut: RowGeometry) -> RowGeometry:
    """``cut`` at the unroll (at most its config's) whose steps cover the shares: in whole steps if
    any do -- a share of 8192 columns in one step of 8192 (512 threads at unroll 2), not of 12288
    with a third of its accesses past the share --, else in the fewest, each as narrow as that
    many allow."""
    options = [dataclasses.replace(cut, row=dataclasses.replace(cut.row, unroll=u))
               for u in range(cut.row.unroll, 0, -1)]
    return min(options, key=lambda g: (g.ragged, g.steps_per_cta, g.steps_per_cta * g.tile_n))


def _cuts(geometry: RowGeometry) -> list[RowGeometry]:
    """``geometry`` cut over 2, 4, ... ``MAX_CLUSTER`` CTAs, each of which gets a column -- and no
    more CTAs than a row has threads (:func:`.reduction.cluster_gather`: a row's thread t stores
    to CTA t)."""
    n, quantum = geometry.span, geometry.share_quantum
    return [dataclasses.replace(geometry, cluster=c) for c in (2, 4, 8, 16)
            if c <= min(MAX_CLUSTER, geometry.row.threads_per_row) and (c - 1) * cut_share_width(n, c, quantum) < n]
