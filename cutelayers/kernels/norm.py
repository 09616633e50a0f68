"""LayerNorm / RMSNorm row kernels (forward and backward), built on :mod:`.reduction`.

Both kernels use the row layout of :mod:`cutelayers.kernels.reduction`: ``threads_per_row``
threads own a row, each thread ``vec`` contiguous elements (128-bit where N allows) ``unroll``
times per step of ``threads_per_row * vec * unroll`` columns. The heuristic config table
(:func:`.reduction_config.row_geometry` with the kernel's values per thread from
:mod:`.norm_config`) picks the smallest ``threads_per_row`` (<= 512) for which the whole row is one
step, i.e. stays in registers between the statistics and the normalize pass -- one HBM read of
x. Larger rows stream in steps, one row per 256-thread CTA, and are staged in shared memory for
the second pass (the forward's x, the backward's x and dy -- or, as its config says, dy alone or
neither, or in two buffers: :class:`.norm_config.StagingConfig`): a row whose share does not fit one CTA
is cut evenly over a thread-block cluster, each CTA staging its share, and the CTAs' partial statistics
(the forward's mean and M2 of its share, or sum of squares; the backward's sums of g * xhat and g)
are combined through distributed shared memory (:func:`.reduction_config.split_rows`,
:func:`.reduction.cluster_gather`). The forward may also cut CTAs of several rows, each row slot's
statistics exchanged on its own, so a CTA reads a parameter's step once for all its rows (tuned
where it wins: LayerNorm's with float32 scale and bias at 131072 and 262144 columns). Only rows
too long even for that are read twice. The
backward of a streamed row is a persistent loop of clusters (:meth:`NormBackwardKernel.streamed_rows`)
that also sums dscale / dbias over its rows in shared memory, and reads its share of scale from
shared memory too, staged once where it fits. Where N (or a cut row's share) is not a multiple
of the step, only a share's last step can be partial: both kernels run the whole steps without
column predicates and the last one with them (up to the share's end:
:func:`.reduction.share_steps`). The config (a :class:`.reduction_config.RowGeometry`) is given to
the kernel; the autotuner may pick another one from :func:`.reduction_config.row_geometry_space`.

Statistics are fp32. LayerNorm's variance never uses E[x^2] - E[x]^2 (which cancels for inputs
such as 1000 + N(0, 1)): each thread keeps a (count, mean, M2) that each step's own two-pass
statistics are merged into (Chan et al.'s pairwise update), and a row's threads merge theirs the
same way in one butterfly (:func:`.reduction.row_merge`: one barrier where a row spans warps, not
one for the mean and one for M2); a cut row's CTAs then combine theirs as
M2 = sum(M2_r + n_r (mean_r - mean)^2), a sum of non-negative terms.

Tensors as the launchers take them (M is the symbolic row count):

* forward: ``x (M, N)``, [``residual (M, N)``], [``scale (N,)``], [``bias (N,)``] -> ``y (M, N)``,
  [``summed (M, N)``], [``mean (M, 1)``], ``rstd (M, 1)`` -- mean only for LayerNorm (``center``),
  fp32 statistics;
* backward: ``x (M, N)``, ``dy (M, N)``, [``dsummed (M, N)``], [``mean (M, 1)``], ``rstd (M, 1)``,
  [``scale (N,)``] -> ``dx (M, N)``, [``partials (P*W*N,)``]: fp32 partial sums of dscale and / or
  dbias (W of them), one row per CTA of a fixed persistent grid (per cluster and row slot for a
  streamed row, each CTA writing its share's columns) holding the W sums side by side (dscale
  first), summed by the caller (deterministic, no atomics) with one reduction.

The fused residual add (``has_residual``, for pre-norm transformers): the forward's row is
s = x + residual, added in fp32 and rounded to ``summed``'s dtype; it writes s as ``summed`` and
normalizes s as stored (so y is the norm of the ``summed`` it returns, as if the add ran
separately). A register-resident row stays in registers as s; a streamed one is staged as s
(copied from registers as pass 1 computes it), or else read back from ``summed`` for the
normalize pass (one read of s instead of x and the residual again). The
backward takes s as its ``x`` and the gradient of ``summed`` as ``dsummed``, which it adds to dx:
dx = norm_backward(dy) + dsummed, the gradient of both x and the residual.
"""

from __future__ import annotations

import operator

import cutlass
from cutlass import Float32, const_expr, cute

from cutelayers.kernels.norm_config import (
    FORWARD_VALUES_PER_THREAD,
    backward_ctas_per_sm,
    forward_cache_hints,
    partial_rows,
    scale_fits,
    staged_shares,
    staging_stages,
    streamed_cta_bytes,
    streamed_ctas_per_sm,
    sums_fit,
)
from cutelayers.kernels.reduction import (
    STAGED_ROW_ALIGNMENT,
    can_prefetch,
    cluster_gather,
    cluster_launch,
    cluster_slot_bytes,
    cluster_slots,
    cluster_sum,
    column_mask,
    cta_share,
    held_to,
    load_step,
    prefetch_shares,
    prefetch_step,
    row_allreduce,
    row_merge,
    row_operand,
    row_prefetch,
    row_share,
    row_staging,
    row_sum,
    row_tiled_copy,
    save_step,
    share_steps,
    shared_buffer_bytes,
    shared_buffers,
    shared_row_bytes,
    shared_row_operand,
    shared_row_tensor,
    staged_smem,
    store_step,
    widest_bytes,
)
from cutelayers.kernels.reduction_config import RowGeometry, staged

# The forward's reduction buffers: one per value of a ragged share's (count, mean, M2).
STAT_BUFFERS = 3


def merged_halves(a, b):
    """Two (mean, variance) over as many values each, merged (Chan et al.'s update with equal
    counts): the means' midpoint, and the variances' mean plus half the means' gap squared. Symmetric
    in ``a`` and ``b``, so both lanes of a butterfly pair get the same bits."""
    half_gap = (b[0] - a[0]) * 0.5
    return (a[0] + b[0]) * 0.5, (a[1] + b[1]) * 0.5 + half_gap * half_gap


def merged_by_counts(a, b):
    """Two (count, mean, M2), merged (Chan et al.'s pairwise update; counts may be 0), written
    symmetric in ``a`` and ``b``: the mean as the midpoint plus a correction that is small where the
    means are close, as they are for inputs such as 1000 + N(0, 1)."""
    (count_a, mean_a, m2_a), (count_b, mean_b, m2_b) = a, b
    count = count_a + count_b
    inverse = cute.arch.rcp_approx(cute.arch.fmax(count, Float32(1.0)))
    gap = mean_b - mean_a
    mean = (mean_a + mean_b) * 0.5 + gap * ((count_b - count_a) * 0.5 * inverse)
    return count, mean, m2_a + m2_b + gap * gap * (count_a * count_b * inverse)


def _broadcast_rows(vector, config: RowGeometry):
    """A (N,) parameter viewed as (rows_per_cta, N) with row stride 0."""
    return cute.make_tensor(vector.iterator, cute.make_layout((config.row.rows_per_cta, config.n), stride=(0, 1)))


class NormForwardKernel:
    """y = (x - mean) * rstd * scale + bias (``center``) or y = x * rstd * scale (RMSNorm); with
    ``has_residual``, of the row s = x + residual, also written as ``summed``.

    Launcher ``(stream, x, [residual], [scale], [bias], y, [summed], [mean], rstd)``; which
    optional tensors are present is fixed at construction (``has_residual``, ``has_scale``,
    ``has_bias``, ``center``), as is ``params_first`` (a register-resident row loads scale and bias
    with itself, before its reductions: :func:`.norm_config.params_first` decides).
    """

    def __init__(self, config: RowGeometry, *, center: bool, has_residual: bool, has_scale: bool,
                 has_bias: bool, epsilon: float, params_first: bool = False):
        self.config, self.center, self.has_residual = config, center, has_residual
        self.has_scale, self.has_bias, self.epsilon = has_scale, has_bias, epsilon
        if params_first and not (config.resident or config.one_step_shares):
            raise ValueError(f"params_first takes register-resident rows or one-step shares; a {config.n}-column "
                             f"row streams")
        self.params_first = params_first

    @cute.jit
    def __call__(self, stream, *tensors):
        rest = list(tensors)
        x = rest.pop(0)
        residual = rest.pop(0) if const_expr(self.has_residual) else None
        scale = rest.pop(0) if const_expr(self.has_scale) else None
        bias = rest.pop(0) if const_expr(self.has_bias) else None
        y = rest.pop(0)
        summed = rest.pop(0) if const_expr(self.has_residual) else None
        mean = rest.pop(0) if const_expr(self.center) else None
        rstd = rest.pop(0)
        config = self.config
        # a register-resident row's inputs are read once and its outputs written once: their
        # accesses leave L1 to the parameters, which every row reads (up to a width)
        read, written = ("load", "store") if forward_cache_hints(config) else (None, None)
        self.kernel(
            x, residual, scale, bias, y, summed, mean, rstd,
            row_tiled_copy(x.element_type, config, read),
            row_tiled_copy(residual.element_type, config, read) if const_expr(self.has_residual) else None,
            row_tiled_copy(scale.element_type, config) if const_expr(self.has_scale) else None,
            row_tiled_copy(bias.element_type, config) if const_expr(self.has_bias) else None,
            row_tiled_copy(y.element_type, config, written),
            row_tiled_copy(summed.element_type, config, written) if const_expr(self.has_residual) else None,
        ).launch(
            grid=[cute.ceil_div(x.shape[0], config.row.rows_per_cta) * config.cluster, 1, 1],
            block=[config.row.num_threads, 1, 1],
            smem=shared_buffer_bytes(config, STAT_BUFFERS) + cluster_slot_bytes(config, self.cluster_values)
            + (0 if config.one_step_shares else staged_smem(config, (summed if const_expr(self.has_residual) else x,),
                                                      widest_bytes(x, scale, bias, y))),
            stream=stream,
            **self.two_ctas_an_sm(x),
            **cluster_launch(config),
        )

    def two_ctas_an_sm(self, x) -> dict:
        """Launch keywords that hold a register-resident forward to two 512-thread CTAs an SM (64
        registers a thread) where a 16-bit row meets a 32-bit operand (a vector of 4) in steps of
        32 values a thread: ptxas gave such a kernel 66 registers, one CTA an SM, and RMSNorm's bf16
        forward with float32 scale and bias at 16384 ran at 63.5 % of copy bandwidth, 89.9 % held
        to two (16000: 62.6 -> 88.2 %; LayerNorm's 87.7 -> 91.2 %). Elsewhere the hold lost 3-6 %:
        bf16 parameters at 16000 / 16384 (63 registers already), float32 ones at 12288 (24 values
        a thread) (H200; docs/benchmarks.md, thirty-sixth session)."""
        config = self.config
        # Not a kernel that loads its parameters first: they spilled 608 bytes a thread when held
        # (and a few rows' small grid is not held back by occupancy).
        if self.params_first:
            return {}
        if not (config.resident and config.row.num_threads == 512 and x.element_type.width == 16
                and config.vec == 4 and config.vec * config.row.unroll == FORWARD_VALUES_PER_THREAD):
            return {}
        return held_to(2)

    @property
    def cluster_values(self) -> int:
        """Values each CTA of a cut row shares: the share's mean and M2 (LayerNorm), sum of squares."""
        return 2 if self.center else 1

    @cute.kernel
    def kernel(self, x, residual, scale, bias, y, summed, mean, rstd,
               copy_x, copy_residual, copy_scale, copy_bias, copy_y, copy_summed):
        config = self.config
        n = config.n
        tidx, _, _ = cute.arch.thread_idx()
        share = cta_share(config, x.shape, tidx)
        rank, steps = share.rank, share.steps
        opx = share.operand(x, copy_x)
        opr = share.operand(residual, copy_residual) if const_expr(self.has_residual) else None
        # the row being normalized: x's share, or summed's (x + residual)
        normalized = summed if const_expr(self.has_residual) else x
        ops_sum = share.operand(summed, copy_summed) if const_expr(self.has_residual) else None
        opy = share.operand(y, copy_y)
        pcoords = row_share(cute.make_identity_tensor((config.row.rows_per_cta, n)), config, 0, rank)
        ops = row_operand(row_share(_broadcast_rows(scale, config), config, 0, rank), copy_scale, pcoords, config, (0, None), tidx) if const_expr(self.has_scale) else None
        opb = row_operand(row_share(_broadcast_rows(bias, config), config, 0, rank), copy_bias, pcoords, config, (0, None), tidx) if const_expr(self.has_bias) else None
        # The row being normalized, a step at a time: x's fragment, or summed's (x + residual).
        src = ops_sum if const_expr(self.has_residual) else opx
        row = src.coords[0][0]
        valid_row = row < x.shape[0]
        # A streamed row kept in shared memory for the normalize pass: x prefetched, or summed
        # copied from registers as pass 1 computes it.
        stage = staged(config, widest_bytes(x, scale, bias, y)) and not config.one_step_shares
        source, copy_to, again, prefetch = share.staging(normalized, src, stage, prefetch=not self.has_residual)
        if const_expr(config.one_step_shares):
            again = None  # the share's one step stays in registers (neither staged nor read again)
        buffers = shared_buffers(config, STAT_BUFFERS)  # after the staged row (see reduction.shared_row_tensor)
        slots = cluster_slots(config, self.cluster_values)
        if const_expr(self.has_residual):
            source = opx  # pass 1 reads x (and the residual) from global memory; it stages summed
        src.frag.fill(0.0)
        prefetch_shares((prefetch,), valid_row, steps, config)
        if const_expr(self.params_first):
            # The parameters' loads go out with the row's, not after its reductions: one memory
            # round trip fewer on each CTA's critical path.
            for op in (ops, opb):
                if const_expr(op is not None):
                    load_step(op, 0)

        # --- statistics ------------------------------------------------------------------------
        # this thread's statistics: a ragged row's whole steps first, then the share's last one --
        # the row's partial step -- alone, so only it pays for column masks (a resident row: its
        # one step, which stays in registers)
        stats = share_steps(
            steps, config.edge_steps,
            lambda step, edge, stats: self.statistics_step(
                source, opr, ops_sum, copy_to, src, valid_row, step, edge, stats),
            (Float32(0.0),) * (3 if self.center else 1))
        row_mean = Float32(0.0)
        if const_expr(self.center):
            row_mean, m2 = self.share_moments(stats, rank, buffers)
            if const_expr(config.cluster > 1):
                cluster_gather((row_mean, m2), slots, config)
                row_mean, m2 = self.combined_moments(slots)
            var = m2 / n
        else:
            sq = row_allreduce(stats[0], operator.add, config.row, buffers[0])
            (sq,) = cluster_sum((sq,), slots, config)
            var = sq / n
        row_rstd = cute.math.rsqrt(var + self.epsilon)

        if valid_row and tidx % config.row.threads_per_row == 0 and rank == 0:
            rstd[row, 0] = row_rstd
            if const_expr(self.center):
                mean[row, 0] = row_mean
        # --- normalize -----------------------------------------------------------------------
        share_steps(steps, config.edge_steps, lambda step, edge, _: self.normalize_step(
            src, again, ops, opb, opy, valid_row, step, row_mean, row_rstd, edge))

    @cute.jit
    def share_moments(self, stats, rank, buffers):
        """(mean, M2) of CTA ``rank``'s share of the row from its threads' (count, mean, M2), in one
        reduction (:func:`row_merge`): an unragged share's threads hold as many values each, so
        their (mean, variance) merge by halves without counts; a ragged one's merge by counts."""
        config = self.config
        count, mean, m2 = stats
        if const_expr(config.ragged):
            _, mean, m2 = row_merge(stats, merged_by_counts, config.row, buffers)
        else:
            mean, var = row_merge((mean, m2 / count), merged_halves, config.row, buffers)
            m2 = var * self.share_columns(rank)
        return mean, m2

    @cute.jit
    def share_columns(self, rank):
        """Columns of the row in CTA ``rank``'s share (the row's width without a cluster)."""
        config = self.config
        columns = Float32(config.n)
        if const_expr(config.cluster > 1):
            columns = Float32(config.share_width)
            if rank == config.cluster - 1:
                columns = Float32(config.last_share_width)
        return columns

    @cute.jit
    def combined_moments(self, slots):
        """The row's (mean, M2) from its CTAs' (mean, M2) over their shares (Chan et al.'s pairwise
        update, all at once: M2 = sum(M2_r + n_r (mean_r - mean)^2))."""
        config = self.config
        total = Float32(0.0)
        for r in cutlass.range_constexpr(config.cluster):
            total = total + self.share_columns(r) * slots.values[0, 0, r]
        row_mean = total / config.n
        m2 = Float32(0.0)
        for r in cutlass.range_constexpr(config.cluster):
            spread = slots.values[0, 0, r] - row_mean
            m2 = m2 + slots.values[0, 1, r] + self.share_columns(r) * spread * spread
        return row_mean, m2

    @cute.jit
    def load_row_step(self, source, opr, ops_sum, copy_to, step, edge: cutlass.Constexpr = None):
        """Load ``step`` of the row into its fragment: x's (from ``source``: global memory or its
        shared copy); with a residual, summed's -- x + residual added in fp32, rounded to summed's
        dtype and stored to summed as well. ``copy_to``: where the row is staged (None: not).
        ``edge``: whether the step may be partial (:func:`.reduction.partial_step`)."""
        load_step(source, step, edge)
        if const_expr(self.has_residual):
            residual = load_step(opr, step, edge).reshape(source.frag.shape)
            store_step(ops_sum, step, source.frag.load().to(Float32) + residual, edge)
        if const_expr(copy_to is not None):
            save_step(copy_to, step, edge)

    @cute.jit
    def statistics_step(self, source, opr, ops_sum, copy_to, src, valid_row, step, edge: cutlass.Constexpr,
                        stats):
        """Pass 1 over ``step`` of a streamed row (``edge``: it may be partial): the step loaded
        (:meth:`load_row_step`, where ``valid_row``) and folded into this thread's ``stats`` --
        (count, mean, M2) with ``center`` (:meth:`merged_moments`), else (sum of squares,)."""
        if valid_row:
            self.load_row_step(source, opr, ops_sum, copy_to, step, edge)
        if const_expr(self.center):
            return self.merged_moments(src, step, edge, *stats)
        vals = src.frag.load().to(Float32)  # a partial step's columns past n load as zeros
        return (stats[0] + row_sum(vals * vals),)

    @cute.jit
    def merged_moments(self, src, step, edge: cutlass.Constexpr, count, mean, m2):
        """This thread's (count, mean, M2) with its values of ``step`` (in ``src``'s fragment)
        merged in by Chan et al.'s pairwise update; ``edge``: the step may be partial (its columns
        past n left out). Written with an exact division, not as :func:`merged_by_counts`: merged
        into the empty state, a step's mean stays its own to the bit, so a register-resident row
        (one step) keeps its two-pass statistics."""
        vals = src.frag.load().to(Float32)
        if const_expr(edge):
            mask = column_mask(src.coords[None, None, None, step], src.frag, src.limit)
            s_count = row_sum(cute.where(mask, cute.full_like(vals, 1.0), Float32(0.0)))
        else:
            s_count = Float32(cute.size(src.frag))
        s_mean = row_sum(vals) / cute.arch.fmax(s_count, Float32(1.0))
        dev = vals - s_mean
        if const_expr(edge):
            dev = cute.where(mask, dev, Float32(0.0))
        s_m2 = row_sum(dev * dev)
        new_count = count + s_count
        delta = s_mean - mean
        weight = s_count / cute.arch.fmax(new_count, Float32(1.0))
        return new_count, mean + delta * weight, m2 + s_m2 + delta * delta * count * weight

    @cute.jit
    def normalize_step(self, src, again, ops, opb, opy, valid_row, step, row_mean, row_rstd,
                       edge: cutlass.Constexpr = None):
        """y of ``step`` (``edge``: it may be partial), where ``valid_row``."""
        if valid_row:
            if const_expr(again is not None):
                # a streamed row: x or summed again, from shared or global memory
                load_step(again, step, edge)
            vals = src.frag.load().to(Float32)
            out = (vals - row_mean) * row_rstd if const_expr(self.center) else vals * row_rstd
            if const_expr(self.has_scale):
                out = out * self.param_step(ops, step, edge).reshape(out.shape)
            if const_expr(self.has_bias):
                out = out + self.param_step(opb, step, edge).reshape(out.shape)
            store_step(opy, step, out, edge)

    @cute.jit
    def param_step(self, op, step, edge: cutlass.Constexpr = None):
        """A parameter's ``step`` in fp32: loaded now, or already (``params_first``)."""
        if const_expr(self.params_first):
            return op.frag.load().to(Float32)
        return load_step(op, step, edge)


class NormBackwardKernel:
    """dx (and dscale/dbias partials) of :class:`NormForwardKernel`.

    With g = dy * scale and xhat = (x - mean) * rstd (x * rstd without ``center``):
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g)), the last term only with ``center``, plus
    dsummed with ``has_residual`` (x is then the forward's ``summed``);
    dscale = sum_rows dy * xhat, dbias = sum_rows dy (as per-CTA partials: ``want_dscale`` /
    ``want_dbias``).

    Launcher ``(stream, x, dy, [dsummed], [mean], rstd, [scale], dx, [partials])``.
    """

    def __init__(self, config: RowGeometry, *, center: bool, has_residual: bool, has_scale: bool,
                 want_dscale: bool, want_dbias: bool, grid: int):
        self.wanted = want_dscale + want_dbias  # W: partial sums a CTA writes side by side
        if self.wanted and not config.resident and not sums_fit(config, self.wanted):
            raise ValueError(f"dscale/dbias sums of a {config.share_width}-column share do not fit shared memory")
        self.config, self.center, self.has_residual, self.has_scale = config, center, has_residual, has_scale
        self.want_dscale, self.want_dbias = want_dscale, want_dbias
        # a streamed row always runs the persistent loop (its dscale / dbias sums, if wanted, in
        # shared memory); a resident one where it accumulates partials
        self.persistent = bool(self.wanted) or not config.resident
        self.grid = grid  # CTAs -- clusters for a streamed row -- of the persistent grid (norm_config.backward_grid)
        self.partial_rows = partial_rows(config, grid)

    @cute.jit
    def __call__(self, stream, *tensors):
        rest = list(tensors)
        x = rest.pop(0)
        dy = rest.pop(0)
        dsummed = rest.pop(0) if const_expr(self.has_residual) else None
        mean = rest.pop(0) if const_expr(self.center) else None
        rstd = rest.pop(0)
        scale = rest.pop(0) if const_expr(self.has_scale) else None
        dx = rest.pop(0)
        partials = rest.pop(0) if const_expr(self.wanted) else None
        config = self.config
        groups = cute.ceil_div(x.shape[0], config.row.rows_per_cta)
        grid = self.grid if const_expr(self.persistent) else groups
        self.kernel(
            x, dy, dsummed, mean, rstd, scale, dx,
            self.partial_view(partials, 0) if const_expr(self.want_dscale) else None,
            self.partial_view(partials, int(self.want_dscale)) if const_expr(self.want_dbias) else None,
            row_tiled_copy(x.element_type, config),
            row_tiled_copy(dy.element_type, config),
            row_tiled_copy(dsummed.element_type, config) if const_expr(self.has_residual) else None,
            row_tiled_copy(scale.element_type, config) if const_expr(self.has_scale) else None,
            row_tiled_copy(dx.element_type, config),
            row_tiled_copy(Float32, config),
        ).launch(
            grid=[grid * config.cluster, 1, 1],
            block=[config.row.num_threads, 1, 1],
            # the reduction buffers (and cluster slots) come first here, so the staged rows start
            # after one alignment's padding at most (placed first, RMSNorm's backward at 32768 x 4096
            # ran 20 % slower, for no reason the profile showed: docs/benchmarks.md, 24th session)
            smem=(shared_buffer_bytes(config, 2) + STAGED_ROW_ALIGNMENT + self.ring_bytes(x, dy, dsummed)
                  + self.slot_sum_bytes()
                  + cluster_slot_bytes(config, self.cluster_values, 2) + self.sum_bytes()
                  + self.staged_share_bytes(x, dy, dsummed, scale)
                  + (shared_row_bytes(config, scale.element_type.width // 8)
                     if const_expr(self.stages_scale(x, dy, dsummed, scale)) else 0)),
            stream=stream,
            **self.held_residency(x, dy, dsummed, scale),
            **cluster_launch(config),
        )

    def held_residency(self, x, dy, dsummed, scale) -> dict:
        """Launch keywords that hold a persistent backward to the CTAs an SM its grid counts on:
        a register-resident row's (:func:`.norm_config.backward_ctas_per_sm`: registers a thread
        at most 65536 / its threads an SM, so the grid runs in one wave), and a streamed row's
        (:func:`.norm_config.streamed_ctas_per_sm`) -- in two staging buffers, or RMSNorm's in one
        (LayerNorm's one-buffer kernels are left free). Unbounded, ptxas gave the
        two-buffer loop (unrolled by two) 57 registers; held to two 256-thread CTAs an SM it takes
        80, and RMSNorm's backward ran 7.5 % faster at 65536 and 131072 (1.9 % at 50304). Of the
        one-buffer streamed kernels, RMSNorm's gain held too (5 % at 262144, 22 % for the 512-thread
        config at 50304) while LayerNorm's lose 1-3 % (68-74 -> 94-126 registers), so those are left
        free (H200: docs/benchmarks.md, thirty-eighth and thirty-ninth sessions)."""
        if not self.persistent:
            return {}
        if self.config.resident:
            return held_to(backward_ctas_per_sm(self.config))
        if staging_stages(self.config.row) != 2 and self.center:
            return {}
        cta_bytes = streamed_cta_bytes(self.config, widest_bytes(x, dy, dsummed, scale), self.streamed_sums)
        return held_to(streamed_ctas_per_sm(cta_bytes))

    @property
    def cluster_values(self) -> int:
        """Values each CTA of a cut row shares: its sums of g * xhat and (LayerNorm) of g."""
        return 2 if self.center else 1

    @property
    def streamed_sums(self) -> int:
        """fp32 sums a column a streamed row's CTA keeps in shared memory (its dscale / dbias)."""
        return 0 if self.config.resident else self.wanted

    def stages_scale(self, x, dy, dsummed, scale) -> bool:
        """Whether a streamed row's persistent CTA stages its share of scale once, for every row it
        visits (else it reads it step by step from global memory, in both passes of every row),
        where cp.async can copy it and it fits next to the CTA's shares (:func:`.scale_fits`)."""
        config = self.config
        if not self.has_scale or config.resident or not can_prefetch(config, scale.element_type.width):
            return False
        return scale_fits(config, widest_bytes(x, dy, dsummed, scale), self.streamed_sums,
                          scale.element_type.width // 8)

    def staged_shares(self, x, dy, dsummed, scale) -> tuple[bool, bool]:
        """Whether a streamed row's CTA stages its share of x, and its share of dy
        (:func:`.norm_config.staged_shares`)."""
        return staged_shares(self.config, widest_bytes(x, dy, dsummed, scale), self.streamed_sums)

    def staged_share_bytes(self, x, dy, dsummed, scale) -> int:
        """Shared memory of a streamed row's staged shares (:meth:`staged_shares`), in each of the
        config's stages (:func:`.norm_config.staging_stages`)."""
        kept = zip((x, dy), self.staged_shares(x, dy, dsummed, scale))
        share = sum(shared_row_bytes(self.config, t.element_type.width // 8) for t, stage in kept if stage)
        return share * staging_stages(self.config.row)

    def sum_bytes(self) -> int:
        """Shared memory of a streamed row's dscale / dbias sums (one fp32 share each)."""
        return self.streamed_sums * shared_row_bytes(self.config, 4)

    def partial_view(self, partials, index: int):
        """Partial sum ``index`` (0: the first wanted of dscale, dbias) of ``partials`` as a (grid,
        N) tensor: one row per CTA (:meth:`store_partial`) -- per cluster for a streamed row, each
        CTA its share's columns (:meth:`streamed_rows`) -- the W sums of a row side by side."""
        n = self.config.n
        return cute.make_tensor(partials.iterator + index * n,
                                cute.make_layout((self.partial_rows, n), stride=(self.wanted * n, 1)))

    def staged(self, *rows) -> bool:
        """Whether the persistent loop prefetches its next row group's ``rows`` operands (x, dy,
        [dsummed]) into shared memory while it computes the current one: with a CTA's few
        resident warps, the loads are otherwise in flight only between its reductions
        (add_layer_norm's backward at 16384 x 768 bf16 on an H200: 38.3 -> 34.7 us)."""
        return self.persistent and self.config.resident and all(
            can_prefetch(self.config, t.element_type.width) for t in rows if t is not None)

    def slot_sum_bytes(self) -> int:
        """Shared memory of :meth:`store_partial`'s row-slot sums (one buffer per partial): only
        register-resident rows store through it (a streamed row's slots keep their sums in
        :meth:`sum_bytes` and store them as partial rows of their own)."""
        slots = self.config.row.rows_per_cta
        if not (self.persistent and self.config.resident) or slots == 1:
            return 0
        return self.wanted * (slots * self.config.n * 4 + 16)

    def ring_bytes(self, *rows) -> int:
        """Shared memory of the two-stage prefetch ring (0 when not :meth:`staged`)."""
        if not self.staged(*rows):
            return 0
        return 2 * sum(shared_row_bytes(self.config, t.element_type.width // 8) for t in rows if t is not None)

    @cute.kernel
    def kernel(self, x, dy, dsummed, mean, rstd, scale, dx, dscale, dbias,
               copy_x, copy_dy, copy_dsummed, copy_scale, copy_dx, copy_partial):
        config = self.config
        n = config.n
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        buffers = shared_buffers(config, 2)
        coords = cute.make_identity_tensor(x.shape)
        pcoords = cute.make_identity_tensor((config.row.rows_per_cta, n))
        ops = row_operand(_broadcast_rows(scale, config), copy_scale, pcoords, config, (0, None), tidx) if const_expr(self.has_scale) else None
        if const_expr(self.has_scale and config.resident):
            load_step(ops, 0)  # the same columns for every row this thread visits
        # Accumulators of dscale / dbias over this thread's rows, in the flat order of x's fragment.
        probe = row_operand(x, copy_x, coords, config, (0, None), tidx)
        acc_scale = cute.make_rmem_tensor(probe.frag.layout, Float32)
        acc_bias = cute.make_rmem_tensor(probe.frag.layout, Float32)
        acc_scale.fill(0.0)
        acc_bias.fill(0.0)
        groups = cute.ceil_div(x.shape[0], config.row.rows_per_cta)

        if const_expr(self.staged(x, dy, dsummed)):
            # two-stage ring: group g's rows are read from shared memory while g + gdim's arrive
            rows = [(t, c) for t, c in ((x, copy_x), (dy, copy_dy), (dsummed, copy_dsummed)) if t is not None]
            ring = [[shared_row_tensor(config, t.element_type) for t, _ in rows] for _ in range(2)]
            self.prefetch_rows(rows, ring[0], coords, groups, bidx, tidx)
            for group in cutlass.range(bidx, groups, 2 * gdim, unroll=1):
                for stage in cutlass.range_constexpr(2):
                    current = group + stage * gdim
                    if current < groups:
                        self.prefetch_rows(rows, ring[1 - stage], coords, groups, current + gdim, tidx)
                        cute.arch.cp_async_wait_group(1)
                        self.backward_rows(x, dy, dsummed, mean, rstd, dx, ops, acc_scale, acc_bias, copy_x,
                                           copy_dy, copy_dsummed, copy_dx, coords, buffers, current, tidx,
                                           ring[stage])
        elif const_expr(config.resident):
            for group in cutlass.range(bidx, groups, gdim, unroll=1):
                self.backward_rows(x, dy, dsummed, mean, rstd, dx, ops, acc_scale, acc_bias, copy_x, copy_dy,
                                   copy_dsummed, copy_dx, coords, buffers, group, tidx)
        else:
            self.streamed_rows(x, dy, dsummed, mean, rstd, scale, dx, dscale, dbias, copy_x, copy_dy,
                               copy_dsummed, copy_scale, copy_dx, copy_partial, buffers, tidx)

        if const_expr(self.persistent and config.resident):
            for acc, partial in ((acc_scale, dscale), (acc_bias, dbias)):
                if const_expr(partial is not None):
                    self.store_partial(acc, partial, probe, copy_partial, bidx, tidx)

    @cute.jit
    def streamed_rows(self, x, dy, dsummed, mean, rstd, scale, dx, dscale, dbias, copy_x, copy_dy,
                      copy_dsummed, copy_scale, copy_dx, copy_partial, buffers, tidx):
        """The persistent loop of a streamed row: cluster c (a CTA without one) walks row groups
        c, c + clusters, ... (one row a group where rows are cut), each CTA its share of every row
        (:func:`.reduction.row_share`): x and dy -- or those the config stages -- staged in shared
        memory where they fit (read once; else the dx pass reads them again, mostly from L2:
        :meth:`staged_shares`), the row's sums of g * xhat and g combined over
        the cluster once per row (double-buffered slots), dscale / dbias summed over the rows in
        shared memory, one fp32 per share column and row slot, and stored at the end as the
        cluster's partial rows (each CTA its share's columns). The staged shares are in one buffer,
        or in two where the config says (:class:`.norm_config.StagingConfig`'s ``stages``: each
        row's shares copied in whole while the row before it is computed)."""
        config = self.config
        n = config.n
        gdim, _, _ = cute.arch.grid_dim()
        share = cta_share(config, x.shape, tidx)  # of its first row group
        cid, rank, steps = share.tile, share.rank, share.steps
        clusters = gdim // config.cluster
        slots = cluster_slots(config, self.cluster_values, 2)
        stage_x, stage_g = self.staged_shares(x, dy, dsummed, scale)
        ring = staging_stages(config.row) == 2
        # one buffer of each staged share, or two (a ring: row i in buffer i % 2)
        shared = [(shared_row_tensor(config, x.element_type) if const_expr(stage_x) else None,
                   shared_row_tensor(config, dy.element_type) if const_expr(stage_g) else None)
                  for _ in range(2 if ring else 1)]
        ops = None
        if const_expr(self.has_scale):
            pshare = row_share(cute.make_identity_tensor((config.row.rows_per_cta, n)), config, 0, rank)
            ops = row_operand(row_share(_broadcast_rows(scale, config), config, 0, rank), copy_scale, pshare,
                              config, (0, None), tidx)
        sums = [None, None]  # dscale's, dbias's: fp32 shares in shared memory, zeroed
        for i, want in enumerate((self.want_dscale, self.want_dbias)):
            if const_expr(want):
                # the share's columns (its rows unused)
                sums[i] = row_operand(shared_row_tensor(config, Float32), copy_partial, share.coords, config,
                                      (0, None), tidx)
                sums[i].frag.fill(0.0)
                share_steps(steps, config.edge_steps, lambda step, edge, _, op=sums[i]: save_step(op, step, edge))
        groups = cute.ceil_div(x.shape[0], config.row.rows_per_cta)
        first_row, (_, _, _, first_x), (_, _, _, first_g) = self.streamed_staging(share, x, dy, copy_x, copy_dy,
                                                                                  shared[0])
        # x and dy copied in whole, asynchronously, where cp.async can (each on its own: a bf16 x
        # with odd N is copied from registers, a float32 dy of it still prefetched)
        prefetched = first_x is not None or first_g is not None
        prefetch_shares((first_x, first_g), first_row < x.shape[0], steps, config, wait=False)
        if const_expr(self.stages_scale(x, dy, dsummed, scale)):
            # scale's share, the same columns every row: copied in once (waited for with the first
            # row's share where that is prefetched)
            scale_share = row_share(_broadcast_rows(scale, config), config, 0, rank)
            _, _, ops, scale_copy = row_staging(config, scale_share, ops, (0, None), tidx, True)
            prefetch_shares((scale_copy,), True, steps, config, wait=not prefetched)
        row_args = (x, dy, dsummed, mean, rstd, dx, ops, sums, copy_x, copy_dy, copy_dsummed, copy_dx, buffers,
                    slots, tidx)
        if const_expr(ring):
            # row i in buffer i % 2: the loop unrolled by two, so each step's buffers are known
            for tile in cutlass.range(cid, groups, 2 * clusters, unroll=1):
                for stage in cutlass.range_constexpr(2):
                    current = tile + stage * clusters
                    if current < groups:
                        self.streamed_row(share, current, cid, clusters, row_args, shared[stage],
                                          shared[1 - stage], prefetched)
        else:
            for tile in cutlass.range(cid, groups, clusters, unroll=1):
                self.streamed_row(share, tile, cid, clusters, row_args, shared[0], None, prefetched)
        for acc, partial in zip(sums, (dscale, dbias)):
            if const_expr(partial is not None):
                pcoords = row_share(cute.make_identity_tensor(partial.shape), config, cid, rank)
                out = row_operand(row_share(partial, config, cid, rank), copy_partial, pcoords, config, (0, None),
                                  tidx)
                share_steps(steps, config.edge_steps, lambda step, edge, _, out=out, acc=acc: store_step(
                    out, step, load_step(acc, step, edge), edge))

    @cute.jit
    def streamed_row(self, share, tile, cid, clusters, row_args, shared, ring_next, prefetched: cutlass.Constexpr):
        """Row tile ``tile`` of :meth:`streamed_rows`' loop, its shares staged in ``shared`` (x's,
        dy's tensors). The next row's shares (where ``prefetched``: copied asynchronously) go into
        ``ring_next``, the ring's other buffer, in whole before this row's work -- or, without a
        ring (None), into ``shared`` step by step as the dx pass frees it (``refill``).
        ``row_args``: what :meth:`backward_rows` takes of the kernel's (tensors, tiled copies,
        reduction buffers, cluster slots, thread index)."""
        x, dy, dsummed, mean, rstd, dx, ops, sums, copy_x, copy_dy, copy_dsummed, copy_dx, buffers, slots, tidx = \
            row_args
        group_share = share.for_tile(tile)
        row, (source_x, copy_x_to, again_x, _), (source_g, copy_g_to, again_g, _) = \
            self.streamed_staging(group_share, x, dy, copy_x, copy_dy, shared)
        stats = self.row_statistics(mean, rstd, row, row < x.shape[0])  # loaded while the share arrives
        refill = None
        if const_expr(prefetched):
            next_row, (_, _, _, next_x), (_, _, _, next_g) = self.streamed_staging(
                share.for_tile(tile + clusters), x, dy, copy_x, copy_dy, shared if ring_next is None else ring_next)
            if const_expr(ring_next is None):
                refill = (next_x, next_g, next_row < x.shape[0])
                cute.arch.cp_async_wait_group(0)  # this row's share, copied in during the last row
            else:
                prefetch_shares((next_x, next_g), next_row < x.shape[0], share.steps, self.config, wait=False)
                # all but the next row's cp.async groups (one an operand): this row's shares
                cute.arch.cp_async_wait_group((next_x is not None) + (next_g is not None))
        self.backward_rows(x, dy, dsummed, mean, rstd, dx, ops, sums[0], sums[1], copy_x, copy_dy,
                           copy_dsummed, copy_dx, group_share.coords, buffers, 0, tidx,
                           cut=(group_share, slots, (source_x, source_g), (copy_x_to, copy_g_to),
                                (again_x, again_g), (tile - cid) // clusters), refill=refill,
                           stats=stats)

    def streamed_staging(self, share, x, dy, copy_x, copy_dy, shared):
        """This thread's row in ``share`` (a :class:`.reduction.CtaShare` of one row group; past the
        last row where the group is) and x's and dy's staging there (:func:`.reduction.row_staging`,
        in the ``shared`` tensors allocated once; None: that operand is not staged)."""
        opx, opg = share.operand(x, copy_x), share.operand(dy, copy_dy)
        return (opx.coords[0][0],
                share.staging(x, opx, shared[0] is not None, shared=shared[0]),
                share.staging(dy, opg, shared[1] is not None, shared=shared[1]))

    @cute.jit
    def store_partial(self, acc, partial, probe, copy_partial, bidx, tidx):
        """Row ``bidx`` of the (grid, N) ``partial``: the sum of this CTA's row slots'
        accumulators ``acc`` -- through shared memory when the CTA has several slots, so the
        caller sums one row per CTA, not one per slot."""
        config = self.config
        n, slots = config.n, config.row.rows_per_cta
        if const_expr(slots == 1):
            pcoords = cute.make_identity_tensor(partial.shape)
            store_step(row_operand(partial, copy_partial, pcoords, config, (bidx, None), tidx), 0, acc.load())
        else:
            shared = cutlass.memory.SmemAllocator().allocate_tensor(
                Float32, cute.make_layout((slots, n), stride=(n, 1)), byte_alignment=16)
            slot = tidx // config.row.threads_per_row
            cols = probe.coords[None, None, None, 0]
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cute.elem_less(cols[i][1], n):
                    shared[slot, cols[i][1]] = acc[i]
            cute.arch.barrier()
            for col in cutlass.range(tidx, n, config.row.num_threads, unroll=1):
                total = Float32(0.0)
                for s in cutlass.range_constexpr(slots):
                    total = total + shared[s, col]
                partial[bidx, col] = total

    @cute.jit
    def prefetch_rows(self, rows, shared, coords, groups, group, tidx):
        """Start copying ``group``'s rows of each of ``rows`` ((tensor, its tiled copy) pairs) into
        ``shared`` (one tensor each) and commit them as one cp.async group -- an empty one past
        the last group, so that waiting for all but the newest group always means the current rows."""
        config = self.config
        if group < groups:
            likes = [row_operand(t, copy, coords, config, (group, None), tidx) for t, copy in rows]
            if likes[0].coords[0][0] < rows[0][0].shape[0]:  # this thread's row, the same in each
                for (tensor, _), like, buffer in zip(rows, likes, shared):
                    prefetch_step(row_prefetch(tensor, buffer, like, (group, None), tidx), 0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def backward_rows(self, x, dy, dsummed, mean, rstd, dx, ops, acc_scale, acc_bias, copy_x, copy_dy,
                      copy_dsummed, copy_dx, coords, buffers, group, tidx, staged=None, cut=None, refill=None,
                      stats=None):
        """dx of the ``rows_per_cta`` rows of ``group``; adds their dscale/dbias terms to the
        accumulators. ``staged``: shared tensors holding the group's x, dy [, dsummed] (read
        from there, not from global memory). ``cut``: a streamed row's share (``coords`` then its
        coordinates, ``group`` 0): (its :class:`.reduction.CtaShare`, the cluster's slots, where pass 1
        loads x and dy from, where it copies them to, where the dx pass loads them from, the row's
        number in the CTA's loop); the accumulators are then its shared dscale / dbias sums.
        ``refill``: (x's, dy's :class:`.reduction.RowPrefetch` of the next row's share into the
        same shared memory -- None for one not prefetched --, whether this thread has a next
        row): each step of it is copied in
        once the dx pass has read the step of this row (every thread copies the elements it
        reads, so no barrier is needed), overlapping the next row's loads with this row's work.
        ``stats``: the row's (mean, rstd), already loaded (default: loaded here)."""
        config = self.config
        n = config.n
        rows = x.shape[0]
        steps, slots, index, copies = config.num_steps, None, None, (None, None)
        if const_expr(cut is not None):  # the operands' shares (rows_per_cta rows: group 0)
            share, slots, sources, copies, agains, index = cut
            steps, dx = share.steps, share.view(dx)
            if const_expr(self.has_residual):
                dsummed = share.view(dsummed)
            (source_x, source_g), (again_x, again_g) = sources, agains  # x's and dy's, staged by the caller
        else:
            source_x = row_operand(x, copy_x, coords, config, (group, None), tidx)
            source_g = row_operand(dy, copy_dy, coords, config, (group, None), tidx)
            if const_expr(staged is not None):  # the loads below read the shared copies (same fragments)
                source_x = shared_row_operand(staged[0], source_x, tidx)
                source_g = shared_row_operand(staged[1], source_g, tidx)
            again_x, again_g = source_x, source_g
        opds = row_operand(dsummed, copy_dsummed, coords, config, (group, None), tidx) if const_expr(self.has_residual) else None
        if const_expr(staged is not None and self.has_residual):
            opds = shared_row_operand(staged[2], opds, tidx)
        opd = row_operand(dx, copy_dx, coords, config, (group, None), tidx)
        opx, opg = source_x, source_g  # the fragments pass 1 fills (the dx pass's operands share them)
        row = opx.coords[0][0]
        valid_row = row < rows
        opx.frag.fill(0.0)
        opg.frag.fill(0.0)
        if const_expr(stats is not None):
            row_mean, row_rstd = stats
        else:
            row_mean, row_rstd = self.row_statistics(mean, rstd, row, valid_row)
        # mean(g * xhat) and mean(g) over the row; padding has dy = 0, so it adds nothing. A ragged
        # row's whole steps skip the column predicates; the share's last step alone takes them.
        dot, g_sum = share_steps(
            steps, config.edge_steps,
            lambda step, edge, sums: self.row_sums_step(
                source_x, source_g, copies, ops, step, edge, valid_row, row_mean, row_rstd, *sums),
            (Float32(0.0), Float32(0.0)))
        c_dot = row_allreduce(dot, operator.add, config.row, buffers[0])
        c_sum = Float32(0.0)
        if const_expr(self.center):
            c_sum = row_allreduce(g_sum, operator.add, config.row, buffers[1])
        elif const_expr(config.row.warps_per_row > 1):
            cute.arch.barrier()  # the next row's reduction reuses buffers[0]
        if const_expr(self.center):  # the row's sums from its CTAs' ones
            c_dot, c_sum = cluster_sum((c_dot, c_sum), slots, config, index)
        else:
            (c_dot,) = cluster_sum((c_dot,), slots, config, index)
        c_dot, c_sum = c_dot / n, c_sum / n
        share_steps(steps, config.edge_steps, lambda step, edge, _: self.dx_step(
            again_x, again_g, opds, ops, opd, acc_scale, acc_bias, step, edge, valid_row, row_mean, row_rstd,
            c_dot, c_sum, refill))
        if const_expr(refill is not None):
            cute.arch.cp_async_commit_group()

    @cute.jit
    def row_statistics(self, mean, rstd, row, valid_row):
        """The forward's (mean, rstd) of ``row`` (mean 0 for RMSNorm; both 0 where ``valid_row`` is
        false: past the last row)."""
        row_mean, row_rstd = Float32(0.0), Float32(0.0)
        if valid_row:
            row_rstd = rstd[row, 0]
            if const_expr(self.center):
                row_mean = mean[row, 0]
        return row_mean, row_rstd

    @cute.jit
    def row_sums_step(self, source_x, source_g, copies, ops, step, edge: cutlass.Constexpr, valid_row, row_mean,
                      row_rstd, dot, g_sum):
        """Pass 1 over ``step`` (``edge``: it may be partial): x and dy loaded (and copied to
        ``copies``, a streamed row's staging), the row's running sums of g * xhat and g."""
        if valid_row:
            load_step(source_x, step, edge)
            load_step(source_g, step, edge)
            for copy in copies:
                if const_expr(copy is not None):
                    save_step(copy, step, edge)
            if const_expr(self.has_scale and not self.config.resident):
                load_step(ops, step, edge)
        xhat = (source_x.frag.load().to(Float32) - row_mean) * row_rstd
        g = source_g.frag.load().to(Float32)
        if const_expr(self.has_scale):
            g = g * ops.frag.load().to(Float32).reshape(g.shape)
        dot = dot + row_sum(g * xhat)
        if const_expr(self.center):
            g_sum = g_sum + row_sum(g)
        return dot, g_sum

    @cute.jit
    def dx_step(self, opx, opg, opds, ops, opd, acc_scale, acc_bias, step, edge: cutlass.Constexpr, valid_row,
                row_mean, row_rstd, c_dot, c_sum, refill):
        """dx of ``step`` (``edge``: it may be partial) and its dscale / dbias terms; then, with
        ``refill``, the next row's copy of the step (its x and dy are in registers now)."""
        if valid_row:
            if const_expr(not self.config.resident):
                load_step(opx, step, edge)
                load_step(opg, step, edge)
                if const_expr(self.has_scale):
                    load_step(ops, step, edge)
            xhat = (opx.frag.load().to(Float32) - row_mean) * row_rstd
            dyv = opg.frag.load().to(Float32)
            g = dyv
            if const_expr(self.has_scale):
                g = g * ops.frag.load().to(Float32).reshape(g.shape)
            dxv = (g - xhat * c_dot - c_sum) * row_rstd
            if const_expr(self.has_residual):
                dxv = dxv + load_step(opds, step, edge).reshape(dxv.shape)
            store_step(opd, step, dxv, edge)
            if const_expr(self.want_dscale):
                self.accumulate(acc_scale, step, dyv * xhat, edge)
            if const_expr(self.want_dbias):
                self.accumulate(acc_bias, step, dyv, edge)
        if const_expr(refill is not None):
            if refill[2]:
                for prefetch in refill[:2]:
                    if const_expr(prefetch is not None):
                        prefetch_step(prefetch, step, edge)

    @cute.jit
    def accumulate(self, acc, step, values, edge: cutlass.Constexpr = None):
        """Add ``values`` (fp32, a row step's fragment) to a dscale / dbias accumulator: registers
        for a resident row, the step's columns of the CTA's shared sums for a streamed one
        (``edge``: the step may be partial)."""
        if const_expr(self.config.resident):
            acc.store(acc.load() + values)
        else:
            store_step(acc, step, load_step(acc, step, edge) + values.reshape(acc.frag.shape), edge)
