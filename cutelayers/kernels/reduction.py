"""Row reductions: building blocks shared by every row kernel, and the row-reduce kernel family.

Layout: a CTA owns ``rows_per_cta`` rows; each row is covered by ``threads_per_row`` consecutive
threads (so a row's threads share a warp, or whole warps). A thread loads ``vec`` contiguous
elements per access (128-bit when the row length allows it) and ``unroll`` such accesses per step,
all issued before any is used, then the CTA walks the row in steps of
``threads_per_row * vec * unroll`` elements. Partial sums are kept in fp32 per thread, reduced
across the row's lanes with butterfly shuffles and across its warps through shared memory.

Configs (:mod:`.reduction_config`, no CuTe): each kernel has a heuristic table (``row_config`` for
the row-reduce kernel, ``row_geometry`` for the register-resident row kernels) and a config space
(``row_config_space``, ``row_geometry_space``) that the autotuner sweeps; the heuristic's choice is
always one of the space's candidates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import cutlass
from cutlass import Float32, const_expr, cute

from cutelayers.kernels.reduction_config import (
    WARP,
    RowConfig,
    RowGeometry,
    can_prefetch,
    staged,
    vector_width,
)


def warp_merge(values, merge, group: int):
    """Butterfly reduction of the tuple ``values`` by ``merge`` over ``group`` consecutive lanes (a
    power of two <= 32)."""
    offset = group // 2
    while offset > 0:
        values = merge(values, tuple(cute.arch.shuffle_sync_bfly(v, offset=offset) for v in values))
        offset //= 2
    return values


@cute.jit
def row_merge(values, merge: cutlass.Constexpr, config: cutlass.Constexpr, buffers):
    """Reduce the tuple ``values`` (fp32 values) over the threads of a row by ``merge(a, b)``, which
    takes and returns such tuples; every thread of the row gets the result -- the same bits on
    each where ``merge`` is symmetric in a and b, as a butterfly merges each pair both ways.

    ``buffers``: one shared-memory tensor of shape (rows_per_cta, warps_per_row) per value, used
    only when a row spans several warps; its warps then meet at one barrier whatever the number
    of values (two reductions of one value each would meet at two)."""
    values = warp_merge(values, merge, min(config.threads_per_row, WARP))
    if const_expr(config.warps_per_row > 1):
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        row = warp // config.warps_per_row
        if lane == 0:
            for i in cutlass.range_constexpr(len(values)):
                buffers[i][row, warp % config.warps_per_row] = values[i]
        cute.arch.barrier()
        # every lane reads a warp's values (lane l the l % warps_per_row-th), so each group of
        # warps_per_row lanes holds the row's and merges them in log2(warps_per_row) steps
        gathered = list(values)
        for i in cutlass.range_constexpr(len(values)):
            gathered[i] = buffers[i][row, lane % config.warps_per_row]
        values = warp_merge(tuple(gathered), merge, config.warps_per_row)
    return values


@cute.jit
def row_allreduce(val, op: cutlass.Constexpr, config: cutlass.Constexpr, buffer):
    """Reduce ``val`` over the threads of a row by ``op`` (commutative); every thread of the row
    gets the result. ``buffer``: as one of :func:`row_merge`'s."""
    return row_merge((val,), lambda a, b: (op(a[0], b[0]),), config, (buffer,))[0]


def row_tv_layout(config: RowConfig, vec: int):
    """(tiler, thread-value layout) for one step over ``rows_per_cta`` rows.

    Thread t handles row ``t // threads_per_row`` and, inside it, the ``vec``-wide chunk
    ``t % threads_per_row`` of every ``threads_per_row * vec`` elements, ``unroll`` times.
    """
    tpr, rpc, unroll = config.threads_per_row, config.rows_per_cta, config.unroll
    tiler = (rpc, tpr * vec * unroll)
    tv = cute.make_layout(
        ((tpr, rpc), (vec, unroll)),
        stride=((vec * rpc, 1), (rpc, tpr * vec * rpc)),
    )
    return tiler, tv


def nan_max(a, b):
    return cute.arch.fmax(a, b, nan=True)  # IEEE maximum: NaN propagates, as jnp.max does


class RowReduceKernel:
    """out[r] = scale * reduce(x[r, :]) for ``op`` in {"sum", "max"}; fp32 accumulation.

    ``x``: (M, n) with M symbolic; ``out``: (M,) in any float dtype.
    """

    def __init__(self, n: int, op: str, scale: float, elem_bits: int, config: RowConfig):
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max'; got {op!r}")
        self.n, self.op, self.scale = n, op, scale
        self.vec = vector_width(n, elem_bits)
        self.config = config
        self.tile_n = self.config.threads_per_row * self.vec * self.config.unroll
        self.num_steps = math.ceil(n / self.tile_n)

    @cute.jit
    def __call__(self, stream, x: cute.Tensor, out: cute.Tensor):
        config = self.config
        tiler, tv = row_tv_layout(config, self.vec)
        atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), x.element_type, num_bits_per_copy=x.element_type.width * self.vec
        )
        tiled_copy = cute.make_tiled_copy(atom, tv, tiler)
        smem_bytes = config.rows_per_cta * config.warps_per_row * 4
        self.kernel(x, out, tiled_copy, tiler).launch(
            grid=[cute.ceil_div(x.shape[0], config.rows_per_cta), 1, 1],
            block=[config.num_threads, 1, 1],
            smem=smem_bytes,
            stream=stream,
        )

    @cute.kernel
    def kernel(self, x: cute.Tensor, out: cute.Tensor, tiled_copy: cute.TiledCopy, tiler: cutlass.Constexpr):
        config = self.config
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        buffer = smem.allocate_tensor(
            Float32, cute.make_layout((config.rows_per_cta, config.warps_per_row), stride=(config.warps_per_row, 1)), byte_alignment=4
        )
        is_sum = const_expr(self.op == "sum")
        init = Float32(0.0) if is_sum else -Float32.inf
        combine = operator.add if is_sum else nan_max

        thr = tiled_copy.get_slice(tidx)
        tXgX = thr.partition_S(cute.local_tile(x, tiler, (bidx, None)))
        tXcX = thr.partition_S(cute.local_tile(cute.make_identity_tensor(x.shape), tiler, (bidx, None)))
        frag = cute.make_fragment_like(tXgX[None, None, None, 0])
        row = tXcX[0][0]
        acc = init
        if row < x.shape[0]:
            # a ragged row's whole steps without column predicates, its last one alone with them
            acc = share_steps(self.num_steps, (False, self.n % self.tile_n != 0), lambda step, edge, acc: self.fold_step(
                tiled_copy, tXgX, tXcX, frag, step, edge, acc), acc)
        acc = row_allreduce(acc, combine, config, buffer)
        if row < x.shape[0]:
            if tidx % config.threads_per_row == 0:
                out[row] = (acc * self.scale).to(out.element_type) if is_sum else acc.to(out.element_type)

    @cute.jit
    def fold_step(self, tiled_copy, tXgX, tXcX, frag, step, edge: cutlass.Constexpr, acc):
        """Fold ``step`` of the row into ``acc``; ``edge``: the ragged last step (columns past n
        load as the reduction's identity)."""
        is_sum = const_expr(self.op == "sum")
        if const_expr(edge):
            pred = column_predicate(tXcX[None, None, None, step], self.n)
            frag.fill(0.0 if is_sum else -math.inf)
            cute.copy(tiled_copy, tXgX[None, None, None, step], frag, pred=pred)
        else:
            cute.copy(tiled_copy, tXgX[None, None, None, step], frag)
        vals = frag.load().to(Float32)
        if const_expr(is_sum):
            return acc + vals.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
        for i in cutlass.range_constexpr(cute.size(frag)):
            acc = nan_max(acc, vals[i])
        return acc


# --- row operands: the shared machinery of every row kernel --------------------------------------




def row_tiled_copy(dtype, geometry: RowGeometry, once: str | None = None):
    """A tiled copy of ``geometry``'s layout for ``dtype``: 128-bit accesses at most, so a wider
    dtype than the one that set ``vec`` splits a vector in two; flat value order stays the same,
    so fragments of different dtypes line up after a reshape.

    ``once``: ``"load"`` or ``"store"``, for a global tensor whose every element the kernel moves
    once in that direction -- its accesses then leave L1 to what is read again (loads
    ``L1::evict_first``, stores ``.cs``). The norm forwards' register-resident rows so keep their
    parameters in L1: H100, 16384 rows of 768 to 4096 bf16 columns, 1-4 % faster
    (docs/benchmarks.md, fifty-ninth session)."""
    tiler, tv = row_tv_layout(geometry.row, geometry.vec)
    bits = min(dtype.width * geometry.vec, 128)
    if once == "load":
        atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits,
                                   l1c_evict_priority=cute.nvgpu.CacheEvictionPriority.EVICT_FIRST)
    elif once == "store":
        atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), dtype, num_bits_per_copy=bits,
                                   store_cache_mode=cute.nvgpu.StoreCacheMode.STREAMING)
    elif once is None:
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
    else:
        raise ValueError(f"once must be 'load', 'store' or None; got {once!r}")
    return cute.make_tiled_copy(atom, tv, tiler)


@cute.jit
def in_row(column, n, before: cutlass.Constexpr):
    """``column < n``, and for a shifted row's window (``before``, else None) ``column > before``:
    the window starts before the row's column 0."""
    inside = cute.elem_less(column, n)
    if const_expr(before is not None):
        inside = inside & cute.elem_less(before, column)
    return inside


def row_start_bound(geometry: RowGeometry | None, access: bool):
    """The bound :func:`in_row` keeps a shifted row's window's columns above: those of the row, or
    for an ``access`` (``vec`` columns from its first), those holding one; None for unshifted rows
    (or no geometry)."""
    if geometry is None or not geometry.shifted:
        return None
    return -geometry.vec if access else -1


@cute.jit
def column_predicate(coords, n, geometry: cutlass.Constexpr = None):
    """Per-access ``column < n`` for one step of a partitioned identity tensor (and in a shifted
    row's window, an access holding any column of the row: its columns past either end are masked
    after the load, :func:`load_step`)."""
    pred = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(coords, mode=[0, 1]), cute.size(coords, mode=[1]), cute.size(coords, mode=[2])),
            stride=(cute.size(coords, mode=[2]), 0, 1),
        ),
        cutlass.Boolean,
    )
    before = row_start_bound(geometry, True)
    for v in cutlass.range_constexpr(cute.size(pred, mode=[0])):
        for k in cutlass.range_constexpr(cute.size(pred, mode=[2])):
            pred[v, 0, k] = in_row(coords[(0, v), 0, k][1], n, before)
    return pred


@cute.jit
def column_mask(coords, frag, n, geometry: cutlass.Constexpr = None):
    """Per-element ``column < n`` (and in a shifted row's window, ``column >= 0``) as a Boolean
    TensorSSA shaped like ``frag``."""
    mask = cute.make_rmem_tensor(frag.layout, cutlass.Boolean)
    before = row_start_bound(geometry, False)
    for i in cutlass.range_constexpr(cute.size(frag)):
        mask[i] = in_row(coords[i][1], n, before)
    return mask.load()


@dataclasses.dataclass(frozen=True)
class RowOperand:
    """A row-shaped (or row-broadcast) operand partitioned for one thread, a step at a time.

    Frozen on purpose: the DSL carries mutable Python objects used in a dynamic loop or branch as
    loop state (and fails); frozen dataclasses are treated as read-only.
    """

    copy: object
    src: object  # (values, 1, 1, steps) view of the tensor
    coords: object  # the same view of its coordinates
    frag: object  # registers for one step
    geometry: RowGeometry
    limit: object  # the column its partial steps stop at (:func:`share_limit`)


def row_operand(tensor, tiled_copy, coords, geometry: RowGeometry, tile_coord, thread) -> RowOperand:
    """``tensor`` (rows, columns: a whole row tensor or a CTA's :func:`row_share` of one; ``coords``
    the same view of its coordinates) tiled in steps, partitioned for ``thread``."""
    thr = tiled_copy.get_slice(thread)
    tiler = (geometry.row.rows_per_cta, geometry.tile_n)
    src = thr.partition_S(cute.local_tile(tensor, tiler, tile_coord))
    return RowOperand(
        copy=tiled_copy,
        src=src,
        coords=thr.partition_S(cute.local_tile(coords, tiler, tile_coord)),
        frag=cute.make_fragment_like(src[None, None, None, 0]),
        geometry=geometry,
        limit=share_limit(coords, geometry),
    )


def share_limit(coords, geometry: RowGeometry):
    """The column where the row columns of ``coords`` end: the row's end, or for a row cut over a
    cluster (``coords`` a :func:`row_share`'s), the CTA's share's -- the next CTA's share starts
    there, and a share's partial last step must not reach into it."""
    if geometry.cluster == 1:
        return geometry.n
    return cutlass.min(coords[0][1] + geometry.share_width, geometry.n)


def partial_step(geometry: RowGeometry, edge) -> bool:
    """Whether a step needs column predicates: ``edge`` if given (False: a step known to be whole),
    else whether any step of the geometry may be partial."""
    return geometry.ragged if edge is None else edge


@cute.jit
def share_steps(steps, edges: cutlass.Constexpr, step_fn: cutlass.Constexpr, state=None):
    """Run ``state = step_fn(step, edge, state)`` over a share's ``steps`` steps: the whole ones in
    a dynamic loop, without column predicates (``edge`` False), and the partial ones alone, with
    them (``edge`` True), so that only they pay for them. ``edges``: (whether the first step may be
    partial -- a shifted row's window's --, whether the last may be), as
    :attr:`.reduction_config.RowGeometry.edge_steps` gives them. ``state`` (DSL values, a tuple of
    them, or None) is carried through the loop; returns the last one."""
    head, tail = edges
    first = 0
    if const_expr(head):
        state = step_fn(0, True, state)
        first = 1
    for step in cutlass.range(first, steps - int(tail), unroll=1):
        state = step_fn(step, False, state)
    if const_expr(tail and head):
        if steps > 1:  # else the first step was the last
            state = step_fn(steps - 1, True, state)
    elif const_expr(tail):
        state = step_fn(steps - 1, True, state)
    return state


@cute.jit
def load_step(op: RowOperand, step, edge: cutlass.Constexpr = None):
    """Load ``step`` into ``op.frag`` (columns past N read as 0); returns fp32 values. ``edge``:
    see :func:`partial_step`."""
    geometry = op.geometry
    if const_expr(partial_step(geometry, edge)):
        op.frag.fill(0.0)
        coords = op.coords[None, None, None, step]
        cute.copy(op.copy, op.src[None, None, None, step], op.frag, pred=column_predicate(coords, op.limit, geometry))
        if const_expr(geometry.shifted):
            # an access at a shifted row's end holds the next (or last) row's columns too
            vals = op.frag.load()
            op.frag.store(cute.where(column_mask(coords, op.frag, op.limit, geometry), vals, cute.zeros_like(vals)))
    else:
        cute.copy(op.copy, op.src[None, None, None, step], op.frag)
    return op.frag.load().to(Float32)


@cute.jit
def store_step(op: RowOperand, step, values, edge: cutlass.Constexpr = None):
    """Store fp32 ``values`` (flat order of the row fragment) to ``step`` of ``op``'s tensor;
    ``edge`` as in :func:`load_step`."""
    op.frag.store(values.reshape(op.frag.shape).to(op.frag.element_type))
    save_step(op, step, edge)


@cute.jit
def save_step(op: RowOperand, step, edge: cutlass.Constexpr = None):
    """Copy ``op.frag`` as it is (no conversion) to ``step`` of ``op``'s tensor: a row staged in
    shared memory by :func:`shared_row_operand`; ``edge`` as in :func:`load_step`. A shifted row's
    partial step stores an access inside the row whole and one holding another row's columns (at
    the row's ends) element by element; which is which is known only at run time where a cluster
    cuts the row. (Every access element by element made the partial steps cost more than scalar
    ones: shifted rows cut over CTAs ran 13-47 % slower than unshifted, sixty-sixth session; stored
    so, 70 and 132 rows cut over CTAs run up to 40 % faster shifted, sixty-ninth session.)"""
    geometry = op.geometry
    coords = op.coords[None, None, None, step]
    if const_expr(partial_step(geometry, edge) and geometry.shifted):
        dst = op.src[None, None, None, step]
        before = row_start_bound(geometry, False)
        for v in cutlass.range_constexpr(cute.size(coords, mode=[0, 1])):
            for k in cutlass.range_constexpr(cute.size(coords, mode=[2])):
                first = coords[(0, v), 0, k][1]
                if in_row(first, op.limit, before) & in_row(first + geometry.vec - 1, op.limit, before):
                    cute.copy(op.copy, op.frag[(None, v), None, k], dst[(None, v), None, k])
                else:
                    for e in cutlass.range_constexpr(cute.size(coords, mode=[0, 0])):
                        if in_row(coords[(e, v), 0, k][1], op.limit, before):
                            dst[(e, v), 0, k] = op.frag[(e, v), 0, k]
    elif const_expr(partial_step(geometry, edge)):
        cute.copy(op.copy, op.frag, op.src[None, None, None, step], pred=column_predicate(coords, op.limit, geometry))
    else:
        cute.copy(op.copy, op.frag, op.src[None, None, None, step])


def row_share(tensor, geometry: RowGeometry, tile, rank):
    """CTA ``rank``'s share of row tile ``tile`` of ``tensor`` (rows, n): ``rows_per_cta`` rows,
    ``share_width`` columns from column ``rank * share_width`` (see ``RowGeometry.cluster``); its
    row operands then count steps from 0. Works on a coordinate tensor too (global columns). An
    uncut row's view spans whole steps, as the row's own layout does: a view one column wide,
    tiled by a wider step, would repeat that column (a size-1 mode keeps no stride) instead of
    running on to columns its predicates turn off (N = 1 failed so on the GPU)."""
    width = geometry.share_width if geometry.cluster > 1 else geometry.steps_per_cta * geometry.tile_n
    return cute.local_tile(tensor, (geometry.row.rows_per_cta, width), (tile, rank))


# Alignment of a staged row in shared memory. cp.async moves whole 32-byte global sectors only
# into 32-byte-aligned shared memory: a destination 16 bytes off (where the reduction buffers and
# cluster slots before it left it) split every sector in two requests, each fetching the whole
# sector from L2 -- twice the row's L2 reads (Nsight Compute on the H100: LayerNorm's forward at
# N = 131072 read 537 MB from L2 for 268 MB of x, at 88 % of copy bandwidth; docs/benchmarks.md,
# twenty-fourth session). Staged rows are rounded up to the alignment, so consecutive ones need no
# padding. The one-pass-per-row kernels (norm forward, softmax, cross-entropy) allocate their
# staged rows first and their small buffers (reductions, cluster slots) after them, so no padding
# is spent at all: three 64 KiB shares and their buffers still fit an SM's 196 KiB shared-memory
# carveout, leaving L1 its 60 KiB for the parameters' reads (with 128 bytes more, add_layer_norm's
# forward at 262144 got the 228 KiB carveout and ran 6 % slower). The norm backward keeps its
# buffers first and counts one alignment's padding.
STAGED_ROW_ALIGNMENT = 128


def shared_row_tensor(geometry: RowGeometry, dtype):
    """Shared memory for the CTA's share of its rows, (rows_per_cta, share_width) of ``dtype``:
    sized to the row where one CTA covers it, not to whole steps (a ragged last step's columns
    past n are never stored or loaded); aligned to ``STAGED_ROW_ALIGNMENT``."""
    rows, width = geometry.row.rows_per_cta, geometry.share_width
    smem = cutlass.memory.SmemAllocator()
    layout = cute.make_layout((rows, width), stride=(width, 1))
    return smem.allocate_tensor(dtype, layout, byte_alignment=STAGED_ROW_ALIGNMENT)


def shared_row_operand(tensor, like: RowOperand, thread) -> RowOperand:
    """``like``'s rows in the shared ``tensor`` of :func:`shared_row_tensor`, partitioned by the
    same tiled copy: every thread stages and reads back exactly its own elements, so no barrier
    orders them. It shares ``like``'s coordinates (the column predicates) and its fragment."""
    geometry = like.geometry
    thr = like.copy.get_slice(thread)
    src = thr.partition_S(cute.local_tile(tensor, (geometry.row.rows_per_cta, geometry.tile_n), (0, None)))
    return dataclasses.replace(like, src=src)


@dataclasses.dataclass(frozen=True)
class RowPrefetch:
    """Asynchronous global -> shared copies (cp.async: no registers held while in flight) of a
    row operand's steps, partitioned as the operand: a thread copies the elements it reads."""

    copy: object
    src: object  # (values, 1, 1, steps) of the global tensor
    dst: object  # the same of the shared one
    coords: object
    geometry: RowGeometry
    limit: object  # as RowOperand's


def row_prefetch(tensor, shared, like: RowOperand, tile_coord, thread) -> RowPrefetch:
    """Prefetches of ``like``'s steps of ``tensor`` into ``shared`` (:func:`shared_row_tensor`)."""
    geometry = like.geometry
    dtype = tensor.element_type
    tiler, tv = row_tv_layout(geometry.row, geometry.vec)
    bits = min(dtype.width * geometry.vec, 128)
    # 16-byte copies may skip L1 (.cg): each element is read once
    cache = cute.nvgpu.cpasync.LoadCacheMode.GLOBAL if bits == 128 else cute.nvgpu.cpasync.LoadCacheMode.ALWAYS
    atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cache), dtype, num_bits_per_copy=bits)
    tiled_copy = cute.make_tiled_copy(atom, tv, tiler)
    thr = tiled_copy.get_slice(thread)
    return RowPrefetch(
        copy=tiled_copy,
        src=thr.partition_S(cute.local_tile(tensor, tiler, tile_coord)),
        dst=thr.partition_D(cute.local_tile(shared, tiler, (0, None))),
        coords=like.coords,
        geometry=geometry,
        limit=like.limit,
    )


@cute.jit
def prefetch_step(op: RowPrefetch, step, edge: cutlass.Constexpr = None):
    """Start copying ``step``; complete after ``cp_async_wait_group``. Accesses past column n
    are skipped with a branch, not a predicate: a predicated cp.async still writes (zeros) to
    shared memory, which ends at column n."""
    geometry = op.geometry
    src, dst = op.src[None, None, None, step], op.dst[None, None, None, step]
    if const_expr(partial_step(geometry, edge)):
        coords = op.coords[None, None, None, step]
        before = row_start_bound(geometry, True)
        for v in cutlass.range_constexpr(cute.size(coords, mode=[0, 1])):
            for k in cutlass.range_constexpr(cute.size(coords, mode=[2])):
                if in_row(coords[(0, v), 0, k][1], op.limit, before):
                    cute.copy(op.copy, src[(None, v), None, k], dst[(None, v), None, k])
    else:
        cute.copy(op.copy, src, dst)


def shared_row_bytes(geometry: RowGeometry, elem_bytes: int) -> int:
    """Shared memory of :func:`shared_row_tensor`, rounded up to its alignment (the kernel allocates
    its staged rows one after another from the start of its shared memory)."""
    size = geometry.row.rows_per_cta * geometry.share_width * elem_bytes
    return -(-size // STAGED_ROW_ALIGNMENT) * STAGED_ROW_ALIGNMENT


@dataclasses.dataclass(frozen=True)
class ClusterSlots:
    """Shared memory for :func:`cluster_gather`: fp32 slots for every row slot of the CTA (a CTA
    of several rows gathers each row's values on its own), ``values`` this thread's row slot's
    (buffers, count, cluster) view -- value i of CTA r at [b, i, r] -- and per buffer the mbarrier
    that counts the bytes the cluster's CTAs store into it."""

    values: object
    barrier: object


def cluster_slots(geometry: RowGeometry, count: int = 1, buffers: int = 1):
    """:class:`ClusterSlots` for ``count`` values per CTA of a cluster and row slot (None without
    a cluster), in ``buffers`` buffers (2 for a kernel that gathers once per row of a persistent
    loop). Thread 0 initializes the barriers, then the CTA arrives on the cluster barrier, which
    :func:`cluster_gather` waits on before any CTA stores into another (the wait is left for
    later: the rows' loads come first)."""
    if geometry.cluster == 1:
        return None
    rows, cluster = geometry.row.rows_per_cta, geometry.cluster
    smem = cutlass.memory.SmemAllocator()
    barrier = smem.allocate_array(cutlass.Int64, buffers)
    base = smem.allocate_array(Float32, buffers * rows * count * cluster)
    mine = base
    if rows > 1:
        tidx, _, _ = cute.arch.thread_idx()
        mine = base + (tidx // geometry.row.threads_per_row) * count * cluster
    values = cute.make_tensor(mine, cute.make_layout((buffers, count, cluster),
                                                     stride=(rows * count * cluster, cluster, 1)))
    _join_cluster(barrier, buffers)
    return ClusterSlots(values, barrier)


@cute.jit
def _join_cluster(barrier, buffers: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        for b in cutlass.range_constexpr(buffers):
            cute.arch.mbarrier_init(barrier + b, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.cluster_arrive_relaxed()


def cluster_slot_bytes(geometry: RowGeometry, count: int = 1, buffers: int = 1) -> int:
    """Shared memory of :func:`cluster_slots` (barriers, slots, alignment); none for a CTA without a
    cluster, or for ``count`` 0 values (a cut row whose CTAs exchange nothing, launched as a plain
    grid)."""
    if geometry.cluster == 1 or count == 0:
        return 0
    return buffers * (8 + 4 * count * geometry.cluster * geometry.row.rows_per_cta) + 8


@cute.jit
def cluster_gather(values, slots: ClusterSlots, geometry: cutlass.Constexpr, index=None):
    """Every CTA's ``values`` (a tuple of fp32 values, each the same on all threads of a row
    slot), gathered into the ``slots.values`` of every CTA of the cluster: thread t of each row
    slot stores them into CTA t's slots of that row slot at the storing CTA's rank (``st.async``,
    counted by CTA t's barrier), then every thread waits for the cluster's values to land; returns
    the buffer they are in.

    ``index``: the gather's number in a kernel that gathers repeatedly (None: once). Gathers
    alternate between two buffers, each barrier's phase flipping every second gather. A CTA
    stores gather i + 2 into a buffer only after gather i + 1 has landed from every peer, which
    each sent after reading gather i -- and after a CTA-wide barrier -- so no slot is overwritten
    before it is read; the caller reads the slots before its next row's reduction barrier."""
    count = len(values)
    buffer, phase = 0, 0
    if const_expr(index is None):
        cute.arch.cluster_wait()  # every peer runs, its barrier initialized
    else:
        if index == 0:
            cute.arch.cluster_wait()
        buffer, phase = index % 2, (index // 2) % 2
    barrier = slots.barrier + buffer
    rows, tpr = geometry.row.rows_per_cta, geometry.row.threads_per_row
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(barrier, 4 * count * geometry.cluster * rows)
    peer = tidx % tpr if const_expr(rows > 1) else tidx  # a row slot's thread t stores to CTA t
    if peer < geometry.cluster:
        bits = cute.make_rmem_tensor(cute.make_layout(count), Float32)
        for i in cutlass.range_constexpr(count):
            bits[i] = values[i]
        as_int = cute.recast_tensor(bits, cutlass.Int32)
        rank = cute.arch.block_idx_in_cluster()
        for i in cutlass.range_constexpr(count):
            # slot [buffer, i, rank] of this row slot's view, at the same address in every CTA
            offset = (buffer * rows * count + i) * geometry.cluster + rank
            cute.arch.store_async_dsmem(slots.values.iterator + offset, as_int[i], barrier, peer)
    cute.arch.mbarrier_wait(barrier, phase)
    return buffer


@cute.jit
def cluster_sum(values, slots: ClusterSlots, geometry: cutlass.Constexpr, index=None):
    """Each of ``values`` (a tuple of a CTA's fp32 partial sums) summed over the CTAs of the
    cluster (:func:`cluster_gather`, ``index`` as there); as they are without a cluster."""
    sums = list(values)
    if const_expr(geometry.cluster > 1):
        buffer = cluster_gather(values, slots, geometry, index)
        for i in cutlass.range_constexpr(len(values)):
            sums[i] = slot_total(slots, buffer, i, geometry)
    return tuple(sums)


@cute.jit
def slot_total(slots: ClusterSlots, buffer, i: cutlass.Constexpr, geometry: cutlass.Constexpr):
    """Value ``i`` of a :func:`cluster_gather` (in its ``buffer``) summed over the cluster's CTAs."""
    total = Float32(0.0)
    for r in cutlass.range_constexpr(geometry.cluster):
        total = total + slots.values[buffer, i, r]
    return total


@cute.jit
def cta_position(geometry: cutlass.Constexpr):
    """(row tile, rank in its cluster, steps of its share) of this CTA."""
    bidx, _, _ = cute.arch.block_idx()
    tile, rank, steps = bidx, 0, geometry.steps_per_cta
    if const_expr(geometry.cluster > 1):
        tile, rank = bidx // geometry.cluster, bidx % geometry.cluster
        if const_expr(geometry.last_steps != geometry.steps_per_cta):
            # the last CTA's share is shorter: the steps of what is left of the row, at most a share's
            rest = geometry.span - rank * geometry.share_width
            steps = min(geometry.steps_per_cta, (rest + geometry.tile_n - 1) // geometry.tile_n)
    return tile, rank, steps


@dataclasses.dataclass(frozen=True)
class CtaShare:
    """This CTA's share of its row tile (:func:`cta_share`): its ``rows_per_cta`` rows -- for a row
    cut over a cluster, the columns of its ``rank`` -- walked in ``steps`` steps; ``row_coords``
    the coordinates of the whole row tensors, or of a shifted row's window (whose columns count
    from the row's start: the window's first ones are negative). Frozen, as :class:`RowOperand`."""

    geometry: RowGeometry
    tile: object
    rank: object
    steps: object
    thread: object
    row_coords: object
    start: object = 0  # a shifted row's window's columns before the row (window_start)

    @functools.cached_property
    def coords(self):
        """The share's coordinates, computed once, where first used: a persistent kernel takes its
        share before it sets up its shared memory and cluster barriers, and a cut row's column
        offsets computed ahead of that setup cost the norm backward registers and instructions
        (add_rms_norm's at N = 50257: 114 -> 116 registers; rms_norm's at 50304: 8 more SASS
        instructions). A kernel that uses them after a dynamic loop or branch must not use them
        first inside it."""
        return row_share(self.row_coords, self.geometry, self.window_tile, self.rank)

    @property
    def window_tile(self):
        """The tile of the row tensors' views that the share is in: the only one of a shifted
        row's window."""
        return 0 if self.geometry.shifted else self.tile

    def for_tile(self, tile) -> CtaShare:
        """The same CTA's share of row tile ``tile`` (a persistent kernel's next rows; not shifted
        ones, whose window is the tile's)."""
        assert not self.geometry.shifted, "a shifted row's window is its own tile's"
        return dataclasses.replace(self, tile=tile)

    def view(self, tensor):
        """The share of ``tensor`` (rows, n)."""
        if self.geometry.shifted:
            tensor = shifted_row(tensor, self.geometry, self.tile, self.start)
        return row_share(tensor, self.geometry, self.window_tile, self.rank)

    def operand(self, tensor, tiled_copy) -> RowOperand:
        """The share of ``tensor`` as this thread's row operand."""
        coords = self.coords  # first: the address arithmetic in the order the kernels were measured with
        return row_operand(self.view(tensor), tiled_copy, coords, self.geometry, (0, None), self.thread)

    def staging(self, tensor, op: RowOperand, stage: bool, prefetch: bool = True, shared=None):
        """How a two-pass kernel holds ``op`` (:meth:`operand` of ``tensor``) between its passes:
        :func:`row_staging`'s ``(source, stage, again, prefetch)`` (``shared`` as there)."""
        return row_staging(self.geometry, self.view(tensor), op, (0, None), self.thread, stage, prefetch,
                           shared)


def cta_share(geometry: RowGeometry, shape, thread) -> CtaShare:
    """This CTA's :class:`CtaShare` of row tensors of ``shape`` (:func:`cta_position`)."""
    tile, rank, steps = cta_position(geometry)
    if not geometry.shifted:
        return CtaShare(geometry, tile, rank, steps, thread, cute.make_identity_tensor(shape))
    start = window_start(geometry, tile)
    window = cute.make_identity_tensor((1, window_width(geometry)))
    return CtaShare(geometry, tile, rank, steps, thread, cute.domain_offset((tile, -start), window), start)


# --- shifted rows: N leaves row starts misaligned, rows are walked in full vectors anyway --------
#
# Row r of a (rows, n) tensor starts r * n elements past its 16-byte aligned base. Where n is not a
# multiple of the full vector (vec elements, 16 bytes of the widest operand), a row start is
# aligned only every few rows, and accesses that keep every start aligned are narrower: scalar at
# odd n. A shifted geometry instead walks each row -- one a CTA -- from the aligned address at or
# before its start, ``window_start`` columns earlier, over a window of ``span`` columns: every
# access but those at the window's two ends lies wholly in the row. Those two are partial steps
# (share_steps' ``head`` and ragged last step): loaded whole, the other rows' columns then masked
# to zero -- 16 aligned bytes around a column of the row never cross a page, so the load cannot
# fault, and the values it reads of other rows (which their CTAs may be writing) are dropped --
# and stored whole where an access lies in the row, element by element where it holds another
# row's columns (:func:`save_step`). Every operand of a kernel has the same window (the same element
# offsets: every buffer's base is aligned), so the fragments of its operands line up as they do
# unshifted.


def window_width(geometry: RowGeometry) -> int:
    """Columns of a shifted row's window view: every CTA's share of it, in whole steps."""
    if geometry.cluster > 1:
        return geometry.cluster * geometry.share_width
    return geometry.steps_per_cta * geometry.tile_n


@cute.jit
def window_start(geometry: cutlass.Constexpr, row):
    """Columns from the aligned address at or before row ``row``'s start to it (the row's offset
    ``row * n`` modulo ``vec``, taken apart so that it does not overflow)."""
    vec = geometry.vec
    return ((row % vec) * (geometry.n % vec)) % vec


def shifted_row(tensor, geometry: RowGeometry, row, start):
    """Row ``row`` of ``tensor`` (rows, n) as its window: a (1, :func:`window_width`) tensor from
    the aligned address at or before the row's start, ``start`` columns before it
    (:func:`window_start`), so that the full-vector accesses of the geometry's tiled copies are
    aligned (the buffer's base is, and ``vec`` columns of the widest operand are 16 bytes)."""
    dtype = tensor.element_type
    elem_bytes = dtype.width // 8
    offset = cutlass.Int64(row) * geometry.n - start
    pointer = cute.make_ptr(dtype, tensor.iterator.toint() + offset * elem_bytes, cute.AddressSpace.gmem,
                            assumed_align=min(geometry.vec * elem_bytes, 16))
    width = window_width(geometry)
    return cute.make_tensor(pointer, cute.make_layout((1, width), stride=(width, 1)))


def row_staging(geometry: RowGeometry, tensor, op, tile_coord, tidx, stage: bool, prefetch: bool = True,
                shared=None):
    """How a two-pass kernel holds ``op``'s row (of ``tensor``, tiled at ``tile_coord``) between
    its passes: ``(source, stage, again, prefetch)`` -- where pass 1 loads it from, where pass 1
    copies it to as it goes (None: nowhere), where pass 2 loads it from (None: it is still in
    registers) and the cp.async prefetch of the whole share into shared memory (None: none).
    ``stage``: keep a streamed row in shared memory (:func:`.reduction_config.staged`): prefetched
    where cp.async can copy its accesses (and ``prefetch``: the row is read, not computed by pass
    1), else copied from registers by pass 1. ``shared``: the :func:`shared_row_tensor` to stage
    in (default: a new one; a persistent kernel allocates it once, outside its row loop)."""
    source, copy_to, again, copies = op, None, None, None
    if not geometry.resident:
        again = op
    if stage:
        if shared is None:
            shared = shared_row_tensor(geometry, tensor.element_type)
        again = shared_row_operand(shared, op, tidx)
        if prefetch and can_prefetch(geometry, tensor.element_type.width):
            copies = row_prefetch(tensor, shared, op, tile_coord, tidx)
            source = again
        else:
            copy_to = again
    return source, copy_to, again, copies


@cute.jit
def prefetch_shares(prefetches, valid_row, steps, geometry: cutlass.Constexpr, wait: cutlass.Constexpr = True):
    """Copy the ``steps`` steps of the CTA's share of each of ``prefetches`` (:func:`row_staging`'s;
    None: nothing to copy) into shared memory, and wait for them (``wait``; else the caller
    waits for the cp.async groups later)."""
    for i in cutlass.range_constexpr(len(prefetches)):
        if const_expr(prefetches[i] is not None):
            if valid_row:
                for step in cutlass.range(steps - 1, unroll=1):
                    prefetch_step(prefetches[i], step, False)
                prefetch_step(prefetches[i], steps - 1, geometry.ragged)
            cute.arch.cp_async_commit_group()
    if const_expr(wait and prefetches.count(None) < len(prefetches)):
        cute.arch.cp_async_wait_group(0)


def widest_bytes(*tensors) -> int:
    """Element bytes of the widest of ``tensors`` (None entries skipped)."""
    return max(t.element_type.width for t in tensors if t is not None) // 8


def held_to(ctas_per_sm: int) -> dict:
    """Launch keywords that hold a kernel to ``ctas_per_sm`` CTAs an SM (``min_blocks_per_mp``:
    ptxas fits its registers to that many). The shared-memory carveout is left to the driver (-1);
    naming it keeps the DSL from asking the device for its shared memory at compile time (without
    it, a CPU compile for sm_90a fails)."""
    return {"min_blocks_per_mp": ctas_per_sm, "preferred_smem_carveout": -1}


def cluster_launch(geometry: RowGeometry) -> dict:
    """The launch's cluster keyword where rows are cut over a cluster of CTAs (none otherwise)."""
    return {"cluster": [geometry.cluster, 1, 1]} if geometry.cluster > 1 else {}


def staged_smem(geometry: RowGeometry, operands, elem_bytes: int | None = None) -> int:
    """Shared memory of the staged rows of ``operands`` (their tensors) if the kernel stages them
    (decided at ``elem_bytes`` an element -- default, the widest operand's)."""
    widest = widest_bytes(*operands) if elem_bytes is None else elem_bytes
    if not staged(geometry, widest, len(operands)):
        return 0
    return sum(shared_row_bytes(geometry, t.element_type.width // 8) for t in operands)


def shared_buffers(geometry: RowGeometry, count: int):
    """``count`` shared buffers for :func:`row_merge` (distinct ones so that back-to-back
    reductions need no barrier between them)."""
    smem = cutlass.memory.SmemAllocator()
    layout = cute.make_layout((geometry.row.rows_per_cta, geometry.row.warps_per_row),
                              stride=(geometry.row.warps_per_row, 1))
    return [smem.allocate_tensor(Float32, layout, byte_alignment=4) for _ in range(count)]


def shared_buffer_bytes(geometry: RowGeometry, count: int) -> int:
    return count * geometry.row.rows_per_cta * geometry.row.warps_per_row * 4


def row_sum(values):
    """Sum of a thread's fp32 values."""
    return values.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
