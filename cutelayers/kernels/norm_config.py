"""What the norm kernels' callers need without CuTe: the kernels' values per thread (their
heuristic configs, :func:`.reduction_config.row_geometry`) and the backward's persistent grid,
which fixes the shape of its dscale / dbias partials (:mod:`.norm`)."""

from __future__ import annotations

import dataclasses
import math

from cutelayers.kernels.hopper import HOPPER_SMS, RESIDENT_CLUSTERS
from cutelayers.kernels.reduction_config import (
    MAX_CLUSTER,
    STAGED_ROW_BYTES,
    STAGED_ROW_BYTES_ALONE,
    RowConfig,
    RowGeometry,
    row_chunks,
    share_bytes,
    staged,
)

# fp32 values a thread holds per row step: the forward keeps x; the backward keeps x, dy and the
# dscale/dbias accumulators, so it gets fewer -- 24 for 16-bit rows, 16 for 32-bit ones (whose
# fragments take twice the registers). 24 lets N = 768 bf16 run one warp a row (32 threads x 3 x 8
# values: no shared-memory reduction, no barrier): add_layer_norm's backward 34.7 -> 32.4 us, the
# plain one 30.8 -> 28.9, at 16384 rows on an H200 (docs/benchmarks.md, thirteenth session).
FORWARD_VALUES_PER_THREAD = 32
BACKWARD_VALUES_PER_THREAD = {16: 24, 32: 16}  # by the row operands' widest element, in bits
# A streamed row (staged in shared memory, cut over a cluster when long) runs one row a CTA of
# these many threads. The forward 256: with 512, LayerNorm's forward (its per-step moments take
# registers) ran one CTA an SM and lost to the unstaged kernel (H200, 2048 x 65536 bf16: 181 ->
# 189 us). The persistent backward, by ``center``: RMSNorm's 512 (H100, bf16, fwd+bwd 256 -> 512:
# rms_norm 480 -> 467 us at 16384, 551 -> 526 at 65536, 650 -> 610 at 262144; add_rms_norm
# 863 -> 844, 945 -> 914, 1048 -> 966), LayerNorm's 256 (add_layer_norm 913 -> 1027 at 16384,
# 977 -> 1117 at 65536 with 512; layer_norm 525 -> 544 at 16384): docs/benchmarks.md, eighteenth
# session. Where another wins (layer_norm at 262144: 512; the RMSNorms' at 50304: 256 threads over
# clusters of 8) is in the tuned table (twenty-fifth and twenty-sixth sessions).
STREAMED_THREADS = 256
STREAMED_BACKWARD_THREADS = {True: 256, False: 512}
# Shared memory a streamed row's forward CTA may stage before the row is cut over more CTAs, by
# ``center``: RMSNorm's forward runs faster on shares of at most 40 KiB (more, shorter CTAs an SM;
# H100, 256 MiB of bf16 x, % of copy bandwidth at 112 / 40 KiB: rms_norm 96 / 90 at N = 32768,
# 77 / 97 at 50304, 89 / 98 at 65536, 94 / 92 at 131072, 88 / 91 at 262144; add_rms_norm 85-96 /
# 96-98 over the same widths), LayerNorm's on the largest (96 / 88 at 65536, 86 / 74 at 262144):
# docs/benchmarks.md, eighteenth session. Those figures are confounded: until the twenty-fourth
# session a staged row sat 16 bytes off a 32-byte boundary for some cuts (twice the L2 reads; see
# reduction.STAGED_ROW_ALIGNMENT). Re-swept with aligned staging, both defaults are within 1.3 % of
# the best cut at 32768 ... 262144 (docs/benchmarks.md, twenty-fourth session); add_layer_norm's
# forward, swept on its own, takes 40 KiB shares at 50304 from the tuned table (twenty-fifth).
FORWARD_SHARE_BYTES = {True: STAGED_ROW_BYTES, False: 40 * 1024}
# Up to reduction_config.FEW_ROWS rows (a decode batch) the forward's register-resident rows always
# load scale and bias before their reductions, not after: one memory round trip fewer where the
# kernel is a few rows' latency (H100, bf16, 8 rows: 1.05-1.34x faster at N = 256 to 8192, layer_norm
# 8 x 256 2.0 -> 1.5 us). On many rows the registers they then hold may cost occupancy (LayerNorm's
# 63 -> 80 registers: 181 -> 244 us at 16384 x 8192, 180 -> 198 at 131072 x 1024: docs/benchmarks.md,
# 21st session), so there :func:`params_first` decides. That row range is the first of
# reduction_config.row_count_bucket, which tuned entries of every row count leave to its own
# (RowKernelFamily.tuning_keys).
# Elements a thread of such a batch's register-resident forward holds
# (:func:`.reduction_config.latency_geometry`: one row a CTA of N / 16 threads, 128 to 512) where
# many rows' heuristic packs 4 rows of 32-thread rows into a CTA at 768 / 1024 and gives each thread
# 32 elements. H100, 8 rows of bf16 x, float32 parameters, the best of 11-22 configs each: this
# rule's config was the fastest or within 0.1 us at 768-8192 for all four forwards; against the
# heuristic, us: layer_norm 1024 1.7 -> 1.5, 2048 2.3 -> 1.6, 4096 2.3 -> 1.7, 8192 2.6 -> 2.3 (the
# parameters loaded first); rms_norm 1.6 -> 1.3, 1.9 -> 1.4, 1.8 -> 1.5, 2.3 -> 2.0; add_layer_norm
# 2048 2.7 -> 1.7, 4096 3.2 -> 1.9 (docs/benchmarks.md, sixty-first session).
FEW_ROWS_VALUES = 16
# Wider rows of such a batch -- where that rule would take more threads a row than this -- are cut
# over a cluster of one-row CTAs of this many threads, each CTA one step of the row
# (:func:`few_rows_cluster`, at most reduction_config.MAX_CLUSTER CTAs), their statistics combined
# through distributed shared memory: each SM then reads its share of the parameters, not all of
# them. H100, 8 rows of bf16 x, us, the register-resident row on 512 threads -> cut: float32
# parameters, layer_norm 8192 2.30 -> 2.08 (8 CTAs), 16384 3.33 -> 2.46 (16), rms_norm 1.79 -> 1.76,
# 2.66 -> 2.02; bf16 parameters at 16384 3.17 -> 2.14 and 2.53 -> 1.81 (8 CTAs). At 4096 the
# resident row of 256 threads was faster than every cut (1.76 against 1.95-2.24 us):
# docs/benchmarks.md, sixty-first session. Each CTA loads its share of the parameters with its share
# of the row, before the exchange (:func:`params_first`), not after it: H100, float32 parameters, us
# at 8192 / 16384, layer_norm 1.9 -> 1.7 / 2.2 -> 2.1, rms_norm 1.7 -> 1.5 / 1.9 -> 1.8, the fused
# residual adds 0.1 us each (two alternating rounds: docs/benchmarks.md, sixty-third session).
FEW_ROWS_CUT_THREADS = 256
# Many register-resident rows of at most PARAMS_FIRST_MAX_N columns load their parameters first too
# where one warp holds the row or a thread's parameter values take at most PARAMS_FIRST_BYTES: after
# the reductions, every row read them again through L1 (LayerNorm's float32 scale and bias are 8
# bytes a column against x's 2), a latency on each CTA's critical path. H100, 16384 rows of bf16 x,
# us after -> first (parameters' dtype): layer_norm 768 19.7 -> 18.6 (bf16), 20.2 -> 19.0 (float32),
# 2048 48.3 -> 46.2 (bf16); rms_norm 768 19.5 -> 18.4, 2048 47.5 -> 46.2 (float32). Where neither
# holds it lost: layer_norm with float32 scale and bias at 2048 / 4096, 48.2 -> 54.1 / 92.4 -> 103.5
# (64 parameter registers a thread, two and four warps a row). Wider rows were not measured.
# docs/benchmarks.md, fifty-ninth session. A tuned :class:`ForwardConfig` overrides the rule.
PARAMS_FIRST_MAX_N = 4096
PARAMS_FIRST_BYTES = 128
# Register-resident forward rows of at most this many columns load x ``L1::evict_first`` and store
# y ``.cs`` (:func:`forward_cache_hints`), which leaves L1 to the parameters every row reads: 1-4 %
# faster at 768-4096 (H100, 16384 rows: fifty-ninth session). At 8192 LayerNorm's forward lost
# 1.0-1.4 % with them (182.4-183.2 against 180.5-180.9 us, bf16 and float32 parameters, three
# alternating rounds; RMSNorm's gained 0.4 %): docs/benchmarks.md, sixtieth session.
CACHE_HINTS_MAX_N = 4096
# Resident threads an SM that the register-resident backward's grid counts on (backward_grid), and
# that its launch holds it to (backward_ctas_per_sm: at most 65536 / that registers a thread), by
# the values a thread holds in a step. Up to 16 values: 512 (128 registers; a 1024-thread target
# launched a second wave of CTAs and twice the dscale / dbias partials). 24 values (bf16 rows of
# 768, 1536, 3072, ...): 384 (170 registers). Left free, such a thread took 130-218 registers, so
# three or two of the grid's four 128-thread CTAs an SM were resident, and the rest ran as a second
# wave (H200, 16384 x 768 bf16, backward us with grids of 2 / 3 / 4 CTAs an SM, unbounded: layer_norm
# 23.7 / 21.2 / 25.6, rms_norm 21.2 / 20.2 / 22.0, add_rms_norm 26.0 / 25.5 / 28.3, add_layer_norm
# (218 registers) 26.9 / 30.4 / 28.4; at 1024 and 2048, 128 registers or fewer, four won:
# docs/benchmarks.md, thirty-seventh session).
THREADS_PER_SM = 512
WIDE_THREADS_PER_SM = 384


# Row operands the backward stages (x and dy): with its fp32 dscale / dbias sums, a streamed row's
# shared memory (:func:`streamed_cta_bytes`). Its rows are cut for both
# (:func:`.reduction_config.split_rows`), also where a :class:`StagingConfig` stages otherwise.
STAGED_OPERANDS = 2
# (staged operands, stages) a StagingConfig names: dy alone or neither, once; or x and dy, or dy
# alone, in two buffers -- the next row's shares copied in whole while this row is computed.
STAGING_CHOICES = ((1, 1), (0, 1), (2, 2), (1, 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagingConfig(RowConfig):
    """A config of the backward whose streamed row stages otherwise than a plain :class:`RowConfig`
    (x and dy, in one buffer that the next row's shares are copied into as the dx pass frees it).

    ``staged_operands``: 1, dy alone -- the dx pass reads x from global memory again, mostly from
    L2, pass 1 having just read it --, or 0, neither. Their smaller shares may fit two CTAs an SM
    where x and dy fit one (:func:`streamed_ctas_per_sm`): RMSNorm's bf16 row of 262144, cut over
    16 CTAs, takes 96 KiB a CTA with dy and the dscale sums, 128 with x too.

    ``stages`` 2: the staged operands in two buffers. Each row's shares are copied in whole as the
    row before it starts, so the copies stay in flight through that row's sums, its cluster
    exchange and its dx pass; with one buffer, the next row's copies start only as the dx pass
    frees each step, and nothing is in flight from the end of a dx pass until the next one starts.
    Twice the shared memory: RMSNorm's bf16 row of 262144 takes 192 KiB a CTA over 16."""

    staged_operands: int
    stages: int = 1

    def __post_init__(self):
        if (self.staged_operands, self.stages) not in STAGING_CHOICES:
            raise ValueError(f"staged_operands {self.staged_operands!r} in {self.stages!r} stages: a StagingConfig "
                             f"stages one of (operands, stages) {STAGING_CHOICES} (a RowConfig stages "
                             f"{STAGED_OPERANDS} in 1)")


def staging_variants(config: RowConfig) -> tuple[StagingConfig, ...]:
    """``config`` staging otherwise (:data:`STAGING_CHOICES`): dy alone, neither, then x and dy in
    two buffers, dy alone in two."""
    return tuple(StagingConfig(**dataclasses.asdict(config), staged_operands=operands, stages=stages)
                 for operands, stages in STAGING_CHOICES)


def staged_operands(config: RowConfig) -> int:
    """Row operands the backward with ``config`` stages of a streamed row (:class:`StagingConfig`)."""
    return config.staged_operands if isinstance(config, StagingConfig) else STAGED_OPERANDS


def staging_stages(config: RowConfig) -> int:
    """Buffers of each staged operand the backward with ``config`` keeps (:class:`StagingConfig`)."""
    return config.stages if isinstance(config, StagingConfig) else 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig(RowConfig):
    """A forward config that says whether its register-resident rows load scale and bias before
    their reductions (``params_first``) where :func:`params_first`'s rule would say otherwise: a
    tuned entry where the rule loses (layer_norm's bf16 rows of 1024 on 512-thread CTAs on the H100:
    25.5 us after, 27.4 first)."""

    params_first: bool


def forward_config(config: RowConfig, params_first: bool) -> ForwardConfig:
    """``config``'s row fields (a :class:`ForwardConfig`'s choice dropped) with ``params_first``."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(RowConfig)}
    return ForwardConfig(**fields, params_first=params_first)


def few_rows_cluster(n: int, elem_bits: int) -> int:
    """CTAs a few rows of ``n`` elements are cut over (:data:`FEW_ROWS_CUT_THREADS`): one step of
    their one-row CTAs each, a power of two, at most MAX_CLUSTER."""
    steps = math.ceil(row_chunks(n, elem_bits) / FEW_ROWS_CUT_THREADS)
    return min(1 << (steps - 1).bit_length(), MAX_CLUSTER)


def params_first(config: RowConfig, geometry: RowGeometry, param_bytes: int, few_rows: bool = False) -> bool:
    """Whether the forward with ``config`` (``geometry`` its rows) loads scale and bias with the row,
    before its reductions: only a register-resident row or a one-step share can
    (``RowGeometry.one_step_shares``); then always for ``few_rows`` (at most
    :data:`.reduction_config.FEW_ROWS`), else as a :class:`ForwardConfig` says, else where the row
    has at most :data:`PARAMS_FIRST_MAX_N` columns and one warp holds it or a thread's parameter
    values (``param_bytes``: one column's scale and bias together) take at most
    :data:`PARAMS_FIRST_BYTES`."""
    if not (geometry.resident or geometry.one_step_shares):
        return False
    if few_rows:
        return True
    if isinstance(config, ForwardConfig):
        return config.params_first
    values = geometry.vec * config.unroll  # a thread's, of its one step
    return geometry.n <= PARAMS_FIRST_MAX_N and (config.threads_per_row <= 32
                                                 or values * param_bytes <= PARAMS_FIRST_BYTES)


def forward_cache_hints(geometry: RowGeometry) -> bool:
    """Whether the forward's row operands are moved once with cache hints: register-resident rows
    (a streamed row is read again for its normalize pass) of at most :data:`CACHE_HINTS_MAX_N`
    columns."""
    return geometry.resident and geometry.n <= CACHE_HINTS_MAX_N


def staged_shares(geometry: RowGeometry, elem_bytes: int, sums: int) -> tuple[bool, bool]:
    """Whether the backward's CTA keeps its share of a streamed row's x, and its share of dy, in
    shared memory for the dx pass (else that pass reads them again): those its config stages, dy
    first (:func:`staged_operands`), where they fit next to ``sums`` fp32 sums a column
    (:func:`.reduction_config.staged`)."""
    operands = staged_operands(geometry.row)
    stage = staged(geometry, elem_bytes, operands * staging_stages(geometry.row), sums)
    return stage and operands > 1, stage and operands > 0


def sums_fit(geometry: RowGeometry, sums: int) -> bool:
    """Whether a CTA holds ``sums`` fp32 sums a column of its share of a streamed row in shared
    memory (the backward's dscale / dbias, summed over the rows a persistent CTA visits)."""
    return share_bytes(geometry, 0, 0, sums) <= STAGED_ROW_BYTES_ALONE


def streamed_cta_bytes(geometry: RowGeometry, elem_bytes: int, sums: int) -> int:
    """Shared memory of the backward's share of a streamed row: x and dy where they stage
    (:func:`staged_shares`), in as many buffers as its config has stages, and ``sums`` fp32 sums a
    column."""
    kept = sum(staged_shares(geometry, elem_bytes, sums)) * staging_stages(geometry.row)
    return share_bytes(geometry, elem_bytes, kept, sums)


def streamed_ctas_per_sm(cta_bytes: int) -> int:
    """CTAs of the streamed backward an SM holds with ``cta_bytes`` of shared memory each."""
    return 2 if cta_bytes <= STAGED_ROW_BYTES else 1


def scale_fits(geometry: RowGeometry, elem_bytes: int, sums: int, scale_bytes: int) -> bool:
    """Whether the backward's CTA of a streamed row also holds its share of scale (``scale_bytes``
    an element) in shared memory -- staged once and read by every row it visits -- with as many
    CTAs an SM as :func:`backward_grid` counts on."""
    used = streamed_cta_bytes(geometry, elem_bytes, sums)
    with_scale = used + share_bytes(geometry, scale_bytes)
    return (with_scale <= STAGED_ROW_BYTES_ALONE
            and streamed_ctas_per_sm(with_scale) == streamed_ctas_per_sm(used))


def backward_ctas_per_sm(geometry: RowGeometry) -> int:
    """CTAs of the register-resident backward an SM holds: :data:`THREADS_PER_SM`'s worth where a
    thread holds at most 16 values a step, :data:`WIDE_THREADS_PER_SM`'s where it holds more (at
    least one CTA)."""
    values = geometry.vec * geometry.row.unroll
    threads = THREADS_PER_SM if values <= 16 else WIDE_THREADS_PER_SM
    return max(threads // geometry.row.num_threads, 1)


def partial_rows(geometry: RowGeometry, grid: int) -> int:
    """Rows of the backward's dscale / dbias partials on a persistent ``grid``: one per CTA, or per
    row slot of a streamed row's cluster."""
    return grid if geometry.resident else grid * geometry.row.rows_per_cta


def backward_grid(geometry: RowGeometry, rows: int | None = None, elem_bytes: int = 2, sums: int = 0) -> int:
    """The persistent backward grid, enough to fill the GPU -- or, for ``rows`` rows that need
    fewer, the power of two that covers their row groups (every CTA or cluster writes a row of
    partials, so a decode-sized batch should not launch a GPU's worth): CTAs for
    register-resident rows; for a streamed row (one a cluster, or a CTA), clusters, as many as are
    resident at once with the CTAs' shared memory (``elem_bytes`` the row operands' widest element,
    ``sums`` the fp32 sums they keep)."""
    config = geometry.row
    if geometry.resident:
        full = HOPPER_SMS * backward_ctas_per_sm(geometry)
        groups = None if rows is None else max(1, -(-rows // config.rows_per_cta))
    else:
        cta_bytes = streamed_cta_bytes(geometry, elem_bytes, sums)
        full = RESIDENT_CLUSTERS[geometry.cluster] * streamed_ctas_per_sm(cta_bytes)
        groups = None if rows is None else max(1, rows)
    if groups is None:
        return full
    return min(full, 1 << (groups - 1).bit_length())
