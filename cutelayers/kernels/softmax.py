"""Softmax-family row kernels: softmax / log-softmax forward and backward, logsumexp and
cross-entropy forward (one streaming read), cross-entropy backward (one read, one write).

Built on the row core of :mod:`.reduction`. The logsumexp of a row is computed online: each thread
keeps (running max m, s = sum exp(x - shift(m))) and rescales ``s`` when the max grows, so a row
streamed in several steps is still read once; rows that fit (:func:`.reduction_config.row_geometry`)
stay in registers, and softmax then writes y without a second read. Shifts shift(m) are the max
when it is finite and 0 otherwise, so rows of -inf give lse = -inf, rows holding +inf give +inf and
NaN propagates -- the same rule as ``jax.nn.logsumexp``. Where N (or a cut row's share) is not a
multiple of the step, every kernel runs the whole steps without column predicates and the partial
ones alone with them (:func:`.reduction.share_steps`). Where N leaves row starts misaligned (odd N
in 16 bits), a row that shares no CTA -- one CTA's or cut over a cluster -- is walked in 16-byte
accesses from the aligned address before it (:attr:`.reduction_config.RowGeometry.shifted`), not in
scalar ones: its window's first step is partial too.

Each kernel takes its config (a :class:`.reduction_config.RowGeometry`) at construction; the
heuristic and the autotuner's candidates come from :mod:`.reduction_config` with the kernel's values
per thread (:mod:`.softmax_config`).
"""

from __future__ import annotations

import math
import operator

import cutlass
from cutlass import Float32, Int32, const_expr, cute

from cutelayers.kernels.reduction import (
    cluster_gather,
    cluster_launch,
    cluster_slot_bytes,
    cluster_slots,
    cluster_sum,
    column_mask,
    cta_share,
    load_step,
    nan_max,
    partial_step,
    prefetch_shares,
    row_allreduce,
    row_sum,
    row_tiled_copy,
    save_step,
    share_steps,
    shared_buffer_bytes,
    shared_buffers,
    slot_total,
    staged_smem,
    store_step,
)
from cutelayers.kernels.reduction_config import RowGeometry, staged

LOG2E = math.log2(math.e)


@cute.jit
def finite_shift(m):
    """``m`` if finite, else 0 (inf - inf and NaN - NaN are not 0)."""
    shift = m
    if m - m != Float32(0.0):
        shift = Float32(0.0)
    return shift


@cute.jit
def exp(values):
    return cute.math.exp2(values * LOG2E, fastmath=True)


@cute.jit
def soft_capped(values, cap: cutlass.Constexpr):
    """(cap * tanh(values / cap), tanh(values / cap)): logit soft-capping and its tanh, whose
    1 - tanh^2 is the derivative."""
    t = cute.math.tanh(values * (1.0 / cap), fastmath=True)
    return t * cap, t


@cute.jit
def rescaled(mx, s, shift):
    """A thread's sum ``s`` of exp(x - finite_shift(mx)) rescaled to ``shift`` (the shift of a max at
    least ``mx``). The factor is held at 1 at most: a state that has folded nothing in yet (max
    -inf, shift 0, s 0) against a shift below -88 would otherwise give 0 * exp(inf) = NaN -- rows
    of logits under -88, such as scores masked with a large negative value. Only a max of +inf
    makes the factor exceed 1, and then the row's sum is +inf whatever it is."""
    return s * exp(cute.arch.fmin(finite_shift(mx) - shift, Float32(0.0)))


@cute.jit
def online_lse_step(vals, size: cutlass.Constexpr, mx, s):
    """Fold one step's values (masked columns already -inf) into a thread's (max, sum of exp(x -
    finite_shift(max)))."""
    local = -Float32.inf
    for i in cutlass.range_constexpr(size):
        local = nan_max(local, vals[i])
    top = nan_max(mx, local)
    shift = finite_shift(top)
    return top, rescaled(mx, s, shift) + row_sum(exp(vals - shift))


@cute.jit
def row_lse(mx, s, geometry: cutlass.Constexpr, buffers):
    """Combine the threads' online states (max, sum exp) into the row's logsumexp (every thread
    gets it): the row's max, then the sums rescaled to its shift. Two reductions: one merge of the
    (max, sum) pairs would meet at one barrier, but its exps in every butterfly step cost a decode
    batch's rows more than the barrier (H100, 8 rows of 1024 / 32768: 1.6 -> 1.7 / 5.3 -> 5.6 us;
    docs/benchmarks.md, sixty-third session)."""
    row_max = row_allreduce(mx, nan_max, geometry.row, buffers[0])
    shift = finite_shift(row_max)
    total = row_allreduce(rescaled(mx, s, shift), operator.add, geometry.row, buffers[1])
    return shift + cute.math.log(total, fastmath=True)


@cute.jit
def grad_scale(dloss, label, n: cutlass.Constexpr, ignore_index: cutlass.Constexpr):
    """A row's gradient factor: ``dloss``, NaN for a label outside [0, n), 0 for ``ignore_index``."""
    scale = dloss
    if label < 0:
        scale = Float32(math.nan)
    if label >= n:
        scale = Float32(math.nan)
    if const_expr(ignore_index is not None):
        if label == ignore_index:
            scale = Float32(0.0)
    return scale


@cute.jit
def cross_entropy_grad(kernel: cutlass.Constexpr, vals, mask, lse, scale):
    """dx of one step's logits ``vals`` (fp32) for ``kernel``'s loss options: scale (exp(x - lse)
    (1 + 2 z lse) - (1-a) onehot - a/V), times 1 - tanh^2 of the capping under soft-capping (x
    then the capped logits); ``mask``: column == label."""
    a = kernel.smoothing
    t = vals
    if const_expr(kernel.soft_cap > 0.0):
        vals, t = soft_capped(vals, kernel.soft_cap)
    d = exp(vals - lse) * (1.0 + 2.0 * kernel.z_loss * lse) - a / kernel.geometry.n
    d = cute.where(mask, d - (1.0 - a), d)
    if const_expr(kernel.soft_cap > 0.0):
        d = d * (1.0 - t * t)
    return d * scale


@cute.jit
def combined_lse(slots, geometry: cutlass.Constexpr):
    """The logsumexp of a row from its CTAs' logsumexps (gathered by :func:`cluster_gather`)."""
    top = -Float32.inf
    for r in cutlass.range_constexpr(geometry.cluster):
        top = nan_max(top, slots.values[0, 0, r])
    shift = finite_shift(top)
    total = Float32(0.0)
    for r in cutlass.range_constexpr(geometry.cluster):
        total = total + exp(slots.values[0, 0, r] - shift)
    return shift + cute.math.log(total, fastmath=True)


def _launch(kernel, geometry: RowGeometry, rows, stream, buffers: int, extra_smem: int = 0, slot_values: int = 1):
    """One CTA per ``rows_per_cta`` rows -- ``cluster`` CTAs, a cluster, where rows are cut (their
    CTAs exchanging ``slot_values`` values: :func:`.reduction.cluster_slots`; 0: nothing to
    exchange, the CTAs launched as a plain grid)."""
    kernel.launch(
        grid=[cute.ceil_div(rows, geometry.row.rows_per_cta) * geometry.cluster, 1, 1],
        block=[geometry.row.num_threads, 1, 1],
        smem=shared_buffer_bytes(geometry, buffers) + cluster_slot_bytes(geometry, slot_values) + extra_smem,
        stream=stream,
        **(cluster_launch(geometry) if slot_values else {}),
    )


@cute.jit
def masked(op, step, vals, fill, edge: cutlass.Constexpr):
    """``vals`` with columns past N replaced by ``fill`` (only for a partial step: ``edge`` as in
    :func:`.reduction.partial_step`)."""
    if const_expr(partial_step(op.geometry, edge)):
        vals = cute.where(column_mask(op.coords[None, None, None, step], op.frag, op.limit, op.geometry), vals,
                          Float32(fill))
    return vals


def column_lane(column, owner, geometry: RowGeometry, start=0):
    """The position, among a cluster's threads of a row (a CTA's without a cluster), of the thread
    whose fragments hold ``column`` of CTA ``owner``'s share: ``row_tv_layout`` gives column j of a
    share -- whose steps count from its start -- to lane ((j - start) // vec) % threads_per_row.
    ``start``: a shifted row's window's columns before the row (whose shares count from there)."""
    tpr = geometry.row.threads_per_row
    return owner * tpr + ((column + start - owner * geometry.share_width) // geometry.vec) % tpr


@cute.jit
def grad_step(kernel: cutlass.Constexpr, opx, source, dest, step, edge: cutlass.Constexpr, label, lse, scale):
    """Write the cross-entropy's dx of ``step`` of the row (``opx``: its logits' operand) to
    ``dest``, the logits loaded into ``opx``'s fragment from ``source`` (None: still there).
    ``edge``: as in :func:`.reduction.partial_step` (predicated loads and stores)."""
    if const_expr(source is not None):
        load_step(source, step, edge)
    vals = opx.frag.load().to(Float32)
    store_step(dest, step, cross_entropy_grad(kernel, vals, label_mask(opx, step, label), lse, scale), edge)


@cute.jit
def label_mask(op, step, label):
    """Per-element ``column == label`` for this thread's step fragment."""
    mask = cute.make_rmem_tensor(op.frag.layout, cutlass.Boolean)
    coords = op.coords[None, None, None, step]
    for i in cutlass.range_constexpr(cute.size(op.frag)):
        mask[i] = coords[i][1] == label
    return mask.load()


class SoftmaxForwardKernel:
    """y = exp(x - lse) (softmax) or x - lse (log-softmax). Launcher ``(stream, x, y)``.

    A row in registers is read once; a streamed row is staged in shared memory where its share
    fits (:func:`.reduction_config.split_rows` cuts a long row over a cluster for that: each CTA
    stages its share and the CTAs' logsumexps are combined through distributed shared memory),
    else read again from global memory by the second pass."""

    def __init__(self, geometry: RowGeometry, *, log: bool):
        self.geometry = geometry
        self.log = log

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, y: cute.Tensor):
        g = self.geometry
        kernel = self.kernel(x, y, row_tiled_copy(x.element_type, g), row_tiled_copy(y.element_type, g))
        _launch(kernel, g, x.shape[0], stream, 2, staged_smem(g, (x,)))

    @cute.kernel
    def kernel(self, x, y, copy_x, copy_y):
        g = self.geometry
        tidx, _, _ = cute.arch.thread_idx()
        share = cta_share(g, x.shape, tidx)
        steps = share.steps
        opx = share.operand(x, copy_x)
        opy = share.operand(y, copy_y)
        valid_row = opx.coords[0][0] < x.shape[0]
        source, copy_to, again, prefetch = share.staging(x, opx, staged(g, x.element_type.width // 8))
        buffers = shared_buffers(g, 2)  # after the staged row (see reduction.shared_row_tensor)
        slots = cluster_slots(g)
        opx.frag.fill(0.0)
        prefetch_shares((prefetch,), valid_row, steps, g)
        # the row's whole steps without column predicates, its partial ones alone with them
        mx, s = share_steps(steps, g.edge_steps, lambda step, edge, state: self.lse_step(
            opx, source, copy_to, valid_row, step, edge, *state), (-Float32.inf, Float32(0.0)))
        lse = row_lse(mx, s, g, buffers)
        if const_expr(g.cluster > 1):
            cluster_gather((lse,), slots, g)
            lse = combined_lse(slots, g)
        share_steps(steps, g.edge_steps, lambda step, edge, _: self.output_step(
            opx, again, opy, valid_row, step, edge, lse))

    @cute.jit
    def lse_step(self, opx, source, copy_to, valid_row, step, edge: cutlass.Constexpr, mx, s):
        """Fold ``step`` of the row (loaded from ``source``, staged to ``copy_to``) into a thread's
        online (max, sum exp)."""
        if valid_row:
            load_step(source, step, edge)
            if const_expr(copy_to is not None):
                save_step(copy_to, step, edge)
        vals = masked(opx, step, opx.frag.load().to(Float32), -math.inf, edge)
        return online_lse_step(vals, cute.size(opx.frag), mx, s)

    @cute.jit
    def output_step(self, opx, again, opy, valid_row, step, edge: cutlass.Constexpr, lse):
        """Write y of ``step`` of the row, x loaded again from ``again`` (None: still in registers)."""
        if valid_row:
            if const_expr(again is not None):
                load_step(again, step, edge)
            vals = opx.frag.load().to(Float32)
            store_step(opy, step, vals - lse if const_expr(self.log) else exp(vals - lse), edge)


class SoftmaxBackwardKernel:
    """dx = y (dy - sum(dy y)) (softmax) or dy - exp(y) sum(dy) (log-softmax). y and dy are held
    between the passes as the forward holds x (a cluster's CTAs add their sums through
    distributed shared memory). Launcher ``(stream, y, dy, dx)``."""

    def __init__(self, geometry: RowGeometry, *, log: bool):
        self.geometry = geometry
        self.log = log

    @cute.jit
    def __call__(self, stream, y: cute.Tensor, dy: cute.Tensor, dx: cute.Tensor):
        g = self.geometry
        kernel = self.kernel(y, dy, dx, row_tiled_copy(y.element_type, g), row_tiled_copy(dy.element_type, g),
                             row_tiled_copy(dx.element_type, g))
        _launch(kernel, g, y.shape[0], stream, 1, staged_smem(g, (y, dy)))

    @cute.kernel
    def kernel(self, y, dy, dx, copy_y, copy_dy, copy_dx):
        g = self.geometry
        tidx, _, _ = cute.arch.thread_idx()
        share = cta_share(g, y.shape, tidx)
        steps = share.steps
        opy = share.operand(y, copy_y)
        opg = share.operand(dy, copy_dy)
        opd = share.operand(dx, copy_dx)
        valid_row = opy.coords[0][0] < y.shape[0]
        stage = staged(g, max(y.element_type.width, dy.element_type.width) // 8, 2)
        source_y, copy_y_to, again_y, prefetch_y = share.staging(y, opy, stage)
        source_g, copy_g_to, again_g, prefetch_g = share.staging(dy, opg, stage)
        buffers = shared_buffers(g, 1)  # after the staged rows (see reduction.shared_row_tensor)
        slots = cluster_slots(g)
        opy.frag.fill(0.0)
        opg.frag.fill(0.0)
        prefetch_shares((prefetch_y, prefetch_g), valid_row, steps, g)
        # the row's whole steps without column predicates, its partial ones alone with them
        acc = share_steps(steps, g.edge_steps, lambda step, edge, acc: self.dot_step(
            opy, opg, (source_y, source_g), (copy_y_to, copy_g_to), valid_row, step, edge, acc), Float32(0.0))
        dot = row_allreduce(acc, operator.add, g.row, buffers[0])
        (dot,) = cluster_sum((dot,), slots, g)
        share_steps(steps, g.edge_steps, lambda step, edge, _: self.dx_step(
            opy, opg, (again_y, again_g), opd, valid_row, step, edge, dot))

    @cute.jit
    def dot_step(self, opy, opg, sources, copies_to, valid_row, step, edge: cutlass.Constexpr, acc):
        """Add ``step``'s sum(dy y) (log-softmax: sum(dy)) to ``acc``, y and dy loaded from
        ``sources`` and staged to ``copies_to`` (None: not staged); columns past N load as 0."""
        if valid_row:
            for i in cutlass.range_constexpr(2):
                load_step(sources[i], step, edge)
                if const_expr(copies_to[i] is not None):
                    save_step(copies_to[i], step, edge)
        grad = opg.frag.load().to(Float32)
        if const_expr(self.log):
            return acc + row_sum(grad)
        return acc + row_sum(grad * opy.frag.load().to(Float32).reshape(grad.shape))

    @cute.jit
    def dx_step(self, opy, opg, agains, opd, valid_row, step, edge: cutlass.Constexpr, dot):
        """Write dx of ``step``, y and dy loaded again from ``agains`` (None: still in registers)."""
        if valid_row:
            if const_expr(agains[0] is not None):
                for i in cutlass.range_constexpr(2):
                    load_step(agains[i], step, edge)
            grad = opg.frag.load().to(Float32)
            out = opy.frag.load().to(Float32).reshape(grad.shape)
            if const_expr(self.log):
                out = grad - exp(out) * dot
            else:
                out = out * (grad - dot)
            store_step(opd, step, out, edge)


class CrossEntropyForwardKernel:
    """Per row: lse, and with labels the loss lse - (1-a) x[label] - (a/V) sum(x) + z lse^2
    (0 for ``ignore_index``, NaN for other labels outside [0, V)), where with ``soft_cap`` c > 0
    x is the capped c tanh(logits / c). One read of the logits, plus x[label] read once by the
    thread that writes the row's loss. Columns past V exist only in a ragged row's last step,
    the only one masked; the row sum is kept only for label smoothing.
    A row cut over a cluster (a few rows of a long vocabulary: :func:`.softmax_config.few_rows_cut`)
    is read by its CTAs a share each, their logsumexps (and row sums) combined through distributed
    shared memory; the cluster's first CTA writes the row's results.
    Launcher ``(stream, x, [labels], lse, [loss])``."""

    def __init__(self, geometry: RowGeometry, with_labels: bool, ignore_index, smoothing: float, z_loss: float,
                 soft_cap: float = 0.0):
        self.geometry = geometry
        self.with_labels, self.ignore_index = with_labels, ignore_index
        self.smoothing, self.z_loss, self.soft_cap = smoothing, z_loss, soft_cap
        self.buffers = 2 + (with_labels and smoothing > 0.0)  # max, sum [, the row sum]

    @property
    def slot_values(self) -> int:
        """Values the CTAs of a cut row exchange: their logsumexps [, row sums]."""
        return self.buffers - 1

    @cute.jit
    def __call__(self, stream, *tensors):
        g = self.geometry
        if const_expr(self.with_labels):
            x, labels, lse, loss = tensors
        else:
            x, lse = tensors
            labels, loss = None, None
        kernel = self.kernel(x, labels, lse, loss, row_tiled_copy(x.element_type, g))
        _launch(kernel, g, x.shape[0], stream, self.buffers, 0, self.slot_values)

    @cute.jit
    def fold_step(self, opx, step, valid_row, edge: cutlass.Constexpr, mx, s, total, stage=None):
        """Fold ``step`` of the row into a thread's (max, sum exp, row sum); ``edge``: the
        ragged last step, whose columns past V are masked; ``stage``: a shared-memory operand
        that keeps a copy of the step (:class:`CrossEntropyWithGradKernel`)."""
        if valid_row:
            load_step(opx, step, edge)
            if const_expr(stage is not None):
                save_step(stage, step, edge)
        vals = opx.frag.load().to(Float32)  # columns past N hold 0 (capped: still 0)
        if const_expr(self.soft_cap > 0.0):
            vals, _ = soft_capped(vals, self.soft_cap)
        if const_expr(self.buffers > 2):
            total = total + row_sum(vals)
        vals = masked(opx, step, vals, -math.inf, edge)
        mx, s = online_lse_step(vals, cute.size(opx.frag), mx, s)
        return mx, s, total

    @cute.jit
    def row_statistics(self, share, opx, valid_row, buffers, slots, stage=None):
        """(lse, row sum) of this thread's row from its CTA's share (``opx``: its operand), read in
        one pass (``stage``: as :meth:`fold_step`'s); a cut row's CTAs combine theirs. The row sum
        is kept only for label smoothing (else 0)."""
        g = self.geometry
        steps = share.steps
        mx, s, total = share_steps(steps, g.edge_steps, lambda step, edge, state: self.fold_step(
            opx, step, valid_row, edge, *state, stage), (-Float32.inf, Float32(0.0), Float32(0.0)))
        lse = row_lse(mx, s, g, buffers)
        if const_expr(self.buffers > 2):
            total = row_allreduce(total, operator.add, g.row, buffers[2])
        if const_expr(g.cluster > 1):
            buffer = cluster_gather((lse, total)[:self.slot_values], slots, g)
            lse = combined_lse(slots, g)
            if const_expr(self.buffers > 2):
                total = slot_total(slots, buffer, 1, g)
        return lse, total

    @cute.kernel
    def kernel(self, x, labels, lse_out, loss_out, copy_x):
        g = self.geometry
        n = g.n
        tidx, _, _ = cute.arch.thread_idx()
        share = cta_share(g, x.shape, tidx)  # the row's share: all of it without a cluster
        opx = share.operand(x, copy_x)
        row = opx.coords[0][0]
        valid_row = row < x.shape[0]
        buffers = shared_buffers(g, self.buffers)
        slots = cluster_slots(g, self.slot_values)
        opx.frag.fill(0.0)
        lse, total = self.row_statistics(share, opx, valid_row, buffers, slots)
        if valid_row and tidx % g.row.threads_per_row == 0 and share.rank == 0:
            lse_out[row] = lse
            if const_expr(self.with_labels):
                label = Int32(labels[row])
                picked = Float32(0.0)
                if label >= 0:
                    if label < n:
                        picked = x[row, label].to(Float32)
                        if const_expr(self.soft_cap > 0.0):
                            picked, _ = soft_capped(picked, self.soft_cap)
                loss = lse - (1.0 - self.smoothing) * picked - (self.smoothing / n) * total + self.z_loss * lse * lse
                if label < 0:
                    loss = Float32(math.nan)
                if label >= n:
                    loss = Float32(math.nan)
                if const_expr(self.ignore_index is not None):
                    if label == self.ignore_index:
                        loss = Float32(0.0)
                loss_out[row] = loss


class CrossEntropyBackwardKernel:
    """dx = dloss (exp(x - lse)(1 + 2 z lse) - (1-a) onehot(label) - a/V), times 1 - tanh^2 of
    the capping with ``soft_cap`` (x then the capped logits): one read of the logits, one write
    of dx, no reduction. A row cut over CTAs (a few rows of a long vocabulary:
    :func:`.softmax_config.few_rows_cut`) is written by each a share, with nothing to exchange: a
    plain grid, not a cluster. Launcher ``(stream, x, labels, lse, dloss, dx)``."""

    def __init__(self, geometry: RowGeometry, ignore_index, smoothing: float, z_loss: float, soft_cap: float = 0.0):
        self.geometry = geometry
        self.ignore_index, self.smoothing, self.z_loss, self.soft_cap = ignore_index, smoothing, z_loss, soft_cap

    @cute.jit
    def __call__(self, stream, x, labels, lse, dloss, dx):
        g = self.geometry
        kernel = self.kernel(x, labels, lse, dloss, dx, row_tiled_copy(x.element_type, g),
                             row_tiled_copy(dx.element_type, g))
        _launch(kernel, g, x.shape[0], stream, 0, slot_values=0)

    @cute.kernel
    def kernel(self, x, labels, lse_in, dloss, dx, copy_x, copy_dx):
        g = self.geometry
        n = g.n
        tidx, _, _ = cute.arch.thread_idx()
        share = cta_share(g, x.shape, tidx)  # the row's share: all of it where rows are not cut
        opx = share.operand(x, copy_x)
        opd = share.operand(dx, copy_dx)
        row = opx.coords[0][0]
        if row < x.shape[0]:
            label = labels[row]
            lse = lse_in[row]
            scale = grad_scale(dloss[row], label, n, self.ignore_index)
            # the row's whole steps without column predicates, its partial ones alone with them
            share_steps(share.steps, g.edge_steps, lambda step, edge, _: grad_step(
                self, opx, opx, opd, step, edge, label, lse, scale))


class CrossEntropyWithGradKernel(CrossEntropyForwardKernel):
    """The cross-entropy forward and its gradient in one pass over the logits: per row, lse and
    the loss as :class:`CrossEntropyForwardKernel`, and dx as :class:`CrossEntropyBackwardKernel`
    with ``dloss`` given, written over x. Launcher ``(stream, x, labels, dloss, lse, loss)``.

    Pass 1 folds the row's online (max, sum exp); after the row reductions pass 2 computes dx.
    Where the row stays in registers it is read once. A streamed row is read once too, into
    shared memory: with cp.async, every step issued at once when the CTA starts (the whole share
    in flight, no registers held: on an H200 0.206 ms at 4096 x 50304 bf16, against 0.246 ms for
    copying each step from registers as pass 1 loads it), or from registers where accesses are
    narrower than cp.async's 4 bytes (odd V in 16 bits). A row whose share does not fit one CTA
    (a Llama-3 vocabulary, 128256 bf16 logits: 250 KiB) is cut over a cluster
    (:func:`.reduction_config.split_rows`): each CTA stages its share, and the CTAs' logsumexps
    (and, with label smoothing, row sums) are combined through distributed shared memory. Both
    passes read the steps from shared memory; each thread reads back only the elements it wrote
    itself, so no barrier orders them. Rows too long even for a cluster are read from global
    memory again in pass 2.

    x is overwritten as pass 2 goes. The label's logit is read by the one thread of the cluster
    whose fragment holds its column -- the only thread that writes that element -- before its own
    pass 2, and that thread writes the row's loss (the row's first thread does for ignored and
    out-of-range labels); no thread reads an element another may have overwritten.
    """

    def __init__(self, geometry: RowGeometry, ignore_index, smoothing: float, z_loss: float,
                 soft_cap: float = 0.0):
        super().__init__(geometry, True, ignore_index, smoothing, z_loss, soft_cap)

    @cute.jit
    def __call__(self, stream, x, labels, dloss, lse, loss):
        g = self.geometry
        kernel = self.kernel(x, labels, dloss, lse, loss, row_tiled_copy(x.element_type, g))
        _launch(kernel, g, x.shape[0], stream, self.buffers, staged_smem(g, (x,)), self.slot_values)

    @cute.kernel
    def kernel(self, x, labels, dloss, lse_out, loss_out, copy_x):
        g = self.geometry
        n, a = g.n, self.smoothing
        tidx, _, _ = cute.arch.thread_idx()
        share = cta_share(g, x.shape, tidx)  # the row's share: all of it without a cluster
        steps, rank = share.steps, share.rank
        opx = share.operand(x, copy_x)
        row = opx.coords[0][0]
        valid_row = row < x.shape[0]
        source, stage, again, prefetch = share.staging(x, opx, staged(g, x.element_type.width // 8))
        buffers = shared_buffers(g, self.buffers)  # after the staged row (see reduction.shared_row_tensor)
        slots = cluster_slots(g, self.slot_values)
        opx.frag.fill(0.0)
        prefetch_shares((prefetch,), valid_row, steps, g)
        lse, total = self.row_statistics(share, source, valid_row, buffers, slots, stage)
        if valid_row:
            lane = column_lane(opx.coords[0][1], rank, g, share.start)  # this thread's, from a column it holds
            label = Int32(labels[row])
            loss = Float32(math.nan)
            scale = grad_scale(dloss[row], label, n, self.ignore_index)
            writer = lane == 0
            if label >= 0:
                if label < n:
                    # column j lies in the share of CTA (j + start) // share_width; the thread holding
                    # it alone overwrites x[row, label], in its pass 2 below
                    owner = (label + share.start) // g.share_width
                    writer = column_lane(label, owner, g, share.start) == lane
                    if writer:
                        picked = x[row, label].to(Float32)
                        if const_expr(self.soft_cap > 0.0):
                            picked, _ = soft_capped(picked, self.soft_cap)
                        loss = lse - (1.0 - a) * picked - (a / n) * total + self.z_loss * lse * lse
            if const_expr(self.ignore_index is not None):
                if label == self.ignore_index:
                    loss = Float32(0.0)
                    writer = lane == 0
            if writer:
                loss_out[row] = loss
            if lane == 0:
                lse_out[row] = lse
            share_steps(steps, g.edge_steps, lambda step, edge, _: grad_step(
                self, opx, again, opx, step, edge, label, lse, scale))
