"""Hopper GEMM with a fused epilogue (CuTe DSL, sm_90a): warp-specialized, persistent, clustered.

The kernel computes, for every batch index ``l``::

    z[m, n, l]   = sum_k a[m, k, l] * b[n, k, l]  (+ bias[n])            fp32 accumulation
    c[m, n, l]   = act(z[m, n, l])  (+ residual[m, n, l])                  stored in c's dtype
    preact       = z                                                       stored only if asked

``a`` is (M, K, L) and ``b`` (N, K, L); each may be K-major or M/N-major (a transposed view of a
row-major buffer: the op passes ``modes`` to the primitive instead of transposing), which is how
one kernel serves the forward (x @ W), dX = dZ @ Wᵀ and dW = Xᵀ @ dZ.

Structure (one CTA per SM, looping over output tiles; ``1 + consumer_warpgroups`` warpgroups):

* producer warpgroup (registers lowered with ``setmaxnreg``): one warp walks the same tile
  sequence as the consumers and streams (tile_m, tile_k) slices of A and (tile_n, tile_k) slices
  of B with TMA into a ``stages``-deep ring of swizzled shared-memory buffers, running ahead
  across tile boundaries, so the next tile's operands arrive while the consumers run the
  epilogue. In a cluster of ``cluster_m x cluster_n`` CTAs, the CTAs of one cluster column share
  their B tile and those of one row their A tile: each loads a slice and multicasts it.
* consumer warpgroups (registers raised with ``setmaxnreg``): each owns ``tile_m /
  consumer_warpgroups`` rows of the tile, issues ``wgmma`` on the stage in front of it with one
  batch in flight, and hands each stage back (to every CTA that multicast into it) once read.
  TMA zero-fills reads past M / K, so tails need no predication in the mainloop.
* epilogue (consumers, per tile): bias, activation and residual on the fp32 accumulators in
  registers (the MMA partition of an identity tensor gives every accumulator its (row, column));
  results go to a dedicated ring of ``EPI_STAGES`` shared-memory buffers through ``stmatrix`` and
  out with asynchronous TMA stores, which clip rows / columns past the tensor. The stores drain
  while the next tile's mainloop runs. The pre-activation, when asked for, goes out first through
  the same ring.

Tiles are visited in groups of up to ``GROUP_N`` cluster columns (a divisor of the column count,
so no padding tile is ever scheduled): CTAs running together share A and B tiles in L2.
"""

from __future__ import annotations

import dataclasses
import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

ACTIVATIONS = ("none", "relu", "gelu", "gelu_exact", "silu", "sigmoid", "tanh", "leaky_relu", "hardswish")

WARPGROUP = 128
SMEM_CAPACITY = 227 * 1024  # sm_90 dynamic shared memory per CTA
EPI_STAGES = 4  # epilogue smem buffers in flight to TMA stores
GROUP_N = 8  # most cluster columns per rasterization group
# SMs the persistent grid is sized for: H100 SXM and H200 have 132. A GPU with fewer runs the
# extra CTAs as a short second wave (correct, slightly unbalanced); one with more idles a few SMs.
PERSISTENT_SMS = 132
PRODUCER_REGISTERS = 40  # the TMA warpgroup only computes addresses
CONSUMER_REGISTERS = 232  # accumulators: 40 * 128 + 232 * 256 fits the SM's 64K registers
LEAKY_SLOPE = 0.01  # jax.nn.leaky_relu's default
GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape, warpgroups, pipeline depth and cluster shape of one kernel instance.

    ``consumer_warpgroups`` split ``tile_m`` (each owns tile_m / groups rows; at most 64 rows x
    tile_n columns of accumulators per 128 threads keeps the accumulator in registers). A
    ``cluster_m x cluster_n`` cluster multicasts B over its ``cluster_m`` CTAs and A over its
    ``cluster_n``.
    """

    tile_m: int
    tile_n: int
    consumer_warpgroups: int
    stages: int
    cluster_m: int = 1
    cluster_n: int = 1
    tile_k: int = 64

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumer_warpgroups)  # + the producer warpgroup

    def epi_tile(self) -> tuple[int, int]:
        """The epilogue's (rows, columns) per smem buffer: 64 rows per consumer warpgroup (their
        stmatrix stores together), 32 columns."""
        return (64 * self.consumer_warpgroups, 32)

    def smem_bytes(self, elem_bytes: int) -> int:
        per_stage = (self.tile_m + self.tile_n) * self.tile_k * elem_bytes
        rows, cols = self.epi_tile()
        return self.stages * per_stage + EPI_STAGES * rows * cols * elem_bytes + 1024  # + mbarriers, alignment


# Shape classes -> config. "small_m": decode-like row counts, where 128-row tiles would be mostly
# padding; "wide": large outputs, where a 128x256 tile halves the operand traffic per FLOP and a
# 2x1 cluster halves B's L2 -> smem traffic.
CONFIGS = {
    "small_m": GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1, stages=8),
    "default": GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6),
    "wide": GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_m=2),
}
# Further points of the autotuning space (not picked by the heuristic).
EXTRA_CONFIGS = (
    GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4),
    GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, cluster_m=2),
    GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_n=2),
)


SMALL_M_MAX = 64  # rows up to this are "small_m"
WIDE_MIN = 2048  # "wide" from this many rows and columns


def config_class(m: int, n: int) -> str:
    """The config table key for an (m, n) output: see ``CONFIGS``.

    ``m`` is the concrete row count at trace time; the kernel itself keeps M symbolic, so rows
    within one class share a compile.
    """
    if m <= SMALL_M_MAX:
        return "small_m"
    if m >= WIDE_MIN and n >= WIDE_MIN:
        return "wide"
    return "default"


def row_bucket(m: int) -> str:
    """The range of row counts ``m`` belongs to, out of those between which :func:`config_class`
    changes for a fixed n: a tuned config for a symbolic M applies to its whole bucket."""
    if m <= SMALL_M_MAX:
        return f"1-{SMALL_M_MAX}"
    if m < WIDE_MIN:
        return f"{SMALL_M_MAX + 1}-{WIDE_MIN - 1}"
    return f"{WIDE_MIN}+"


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What the epilogue does after the fp32 accumulation (see the module docstring)."""

    activation: str = "none"
    has_bias: bool = False
    has_residual: bool = False
    store_preact: bool = False

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}; got {self.activation!r}")


@cute.jit
def apply_activation(x: Float32, name: cutlass.Constexpr) -> Float32:
    """act(x) in fp32, the formulas of the matching jax.nn function."""
    y = x
    if const_expr(name == "relu"):
        y = cute.arch.fmax(x, Float32(0.0), nan=True)
    elif const_expr(name == "gelu"):
        inner = GELU_TANH_SCALE * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (1.0 + cute.math.tanh(inner))
    elif const_expr(name == "gelu_exact"):
        y = 0.5 * x * (1.0 + cute.math.erf(x * (1.0 / math.sqrt(2.0))))
    elif const_expr(name == "silu"):
        y = x / (1.0 + cute.math.exp(-x))
    elif const_expr(name == "sigmoid"):
        y = 1.0 / (1.0 + cute.math.exp(-x))
    elif const_expr(name == "tanh"):
        y = cute.math.tanh(x)
    elif const_expr(name == "leaky_relu"):
        # max(x, slope * x) is x for x >= 0 and slope * x below, as slope < 1.
        y = cute.arch.fmax(x, LEAKY_SLOPE * x, nan=True)
    elif const_expr(name == "hardswish"):
        relu6 = cute.arch.fmin(cute.arch.fmax(x + 3.0, Float32(0.0)), Float32(6.0))
        y = x * relu6 * (1.0 / 6.0)
    return y


class HopperGemmKernel:
    """C = epilogue(A @ Bᵀ) on Hopper: persistent, warp-specialized TMA + wgmma, fp32 accumulation.

    Launcher ``(stream, a, b, [bias], [residual], c, [preact])``, which optional tensors are
    present being fixed by ``epilogue``:

    * a: (M, K, L), b: (N, K, L): bfloat16 or float16 (same dtype), any one of the two modes
      M/N or K contiguous; M, K and L may be symbolic, N static, every contiguous extent a
      multiple of 8;
    * bias: (N,) in c's dtype; residual, c, preact: (M, N, L), N contiguous, c's dtype.
    """

    def __init__(self, config: GemmConfig, epilogue: Epilogue):
        self.config, self.epilogue = config, epilogue
        self.tile_mnk = (config.tile_m, config.tile_n, config.tile_k)
        if config.consumer_warpgroups not in (1, 2):
            raise ValueError("consumer_warpgroups must be 1 or 2")
        if config.tile_m % (64 * config.consumer_warpgroups):
            raise ValueError("tile_m must be a multiple of 64 rows per consumer warpgroup (wgmma's M)")
        if config.tile_n not in (64, 128, 256):
            raise ValueError("tile_n must be 64, 128 or 256")
        if config.cluster_m * config.cluster_n > 2 or min(config.cluster_m, config.cluster_n) < 1:
            raise ValueError("cluster shape must be 1x1, 2x1 or 1x2")

    @cute.jit
    def __call__(self, stream, *tensors):
        epilogue, config = self.epilogue, self.config
        rest = list(tensors)
        a = rest.pop(0)
        b = rest.pop(0)
        bias = rest.pop(0) if const_expr(epilogue.has_bias) else None
        residual = rest.pop(0) if const_expr(epilogue.has_residual) else None
        c = rest.pop(0)
        preact = rest.pop(0) if const_expr(epilogue.store_preact) else None

        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        a_layout = LayoutEnum.from_tensor(a)
        b_layout = LayoutEnum.from_tensor(b)
        c_layout = LayoutEnum.from_tensor(c)
        tiled_mma = sm90.make_trivial_tiled_mma(
            a.element_type, b.element_type, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            Float32, (config.consumer_warpgroups, 1, 1), tiler_mn=(64, config.tile_n),
        )
        a_smem = sm90.make_smem_layout_a(a_layout, self.tile_mnk, a.element_type, config.stages)
        b_smem = sm90.make_smem_layout_b(b_layout, self.tile_mnk, b.element_type, config.stages)
        epi_tile = config.epi_tile()
        epi_smem = sm90.make_smem_layout_epi(c.element_type, c_layout, epi_tile, EPI_STAGES)

        # A is shared by the cluster_n CTAs of a cluster row, B by the cluster_m of a column.
        tma_a, tma_tensor_a = self.load_atom(a, a_smem, (config.tile_m, config.tile_k), config.cluster_n)
        tma_b, tma_tensor_b = self.load_atom(b, b_smem, (config.tile_n, config.tile_k), config.cluster_m)
        store = cpasync.CopyBulkTensorTileS2GOp()
        epi_smem_one = cute.slice_(epi_smem, (None, None, 0))
        tma_c, tma_tensor_c = cpasync.make_tiled_tma_atom(store, c, epi_smem_one, epi_tile)
        tma_z, tma_tensor_z = None, None
        if const_expr(epilogue.store_preact):
            tma_z, tma_tensor_z = cpasync.make_tiled_tma_atom(store, preact, epi_smem_one, epi_tile)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, config.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[a.element_type, cute.cosize(a_smem)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[b.element_type, cute.cosize(b_smem)], 1024]
            sc: cute.struct.Align[cute.struct.MemRange[c.element_type, cute.cosize(epi_smem)], 1024]

        self.shared_storage = SharedStorage
        tiles = (cute.ceil_div(c.shape[0], config.tile_m), cute.ceil_div(c.shape[1], config.tile_n), c.shape[2])
        schedule = utils.PersistentTileSchedulerParams(
            tiles, (config.cluster_m, config.cluster_n, 1), self.raster_group(c.shape[1]), True
        )
        clusters_per_wave = PERSISTENT_SMS // (config.cluster_m * config.cluster_n)
        grid = utils.StaticPersistentTileScheduler.get_grid_shape(schedule, clusters_per_wave)
        self.kernel(
            tiled_mma, tma_a, tma_tensor_a, tma_b, tma_tensor_b, tma_c, tma_tensor_c, tma_z, tma_tensor_z,
            bias, residual, a_smem, b_smem, epi_smem, epi_tile, schedule,
        ).launch(
            grid=grid,
            block=[config.threads, 1, 1],
            cluster=(config.cluster_m, config.cluster_n, 1),
            min_blocks_per_mp=1,
            smem=SharedStorage.size_in_bytes(),
            stream=stream,
        )

    def raster_group(self, n) -> int:
        """Cluster columns per rasterization group for N = ``n`` columns: the largest divisor of
        the cluster-column count up to ``GROUP_N``, so the grouped order never schedules a padding
        tile; 1 (column by column) when N is symbolic."""
        if not isinstance(n, int):
            return 1
        clusters = -(-n // (self.config.tile_n * self.config.cluster_n))
        return max(g for g in range(1, GROUP_N + 1) if clusters % g == 0)

    def load_atom(self, tensor, smem_staged, tile, multicast: int):
        """TMA load atom for one operand, multicast to ``multicast`` CTAs when above 1."""
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()
        return cpasync.make_tiled_tma_atom(
            op, tensor, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=multicast
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        tma_tensor_a: cute.Tensor,
        tma_b: cute.CopyAtom,
        tma_tensor_b: cute.Tensor,
        tma_c: cute.CopyAtom,
        tma_tensor_c: cute.Tensor,
        tma_z,
        tma_tensor_z,
        bias,
        residual,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
        epi_tile: cutlass.Constexpr,
        schedule: utils.PersistentTileSchedulerParams,
    ):
        config = self.config
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        # --- cluster position, shared memory and the load pipeline ------------------------------
        cluster_layout = cute.make_layout((config.cluster_m, config.cluster_n, 1))
        cluster_coord = cluster_layout.get_flat_coord(
            cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()))
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sa = storage.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sb = storage.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sc = storage.sc.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        stage_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0))) + \
            cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0)))
        consumer_threads = WARPGROUP * config.consumer_warpgroups
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=config.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # Every consumer thread releases a stage; the pipeline turns that into one arrive per
            # multicast partner CTA.
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, config.cluster_m, config.cluster_n, 1)),
            enable_multicast_signaling=True,
            defer_sync=True,
        )
        cluster_mn = (config.cluster_m, config.cluster_n)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)

        # (tile, tile_k, tiles, k tiles, L) views of A and B, split for (multicast) TMA.
        ga = cute.local_tile(tma_tensor_a, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gb = cute.local_tile(tma_tensor_b, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        tsa, tga = cpasync.tma_partition(
            tma_a, cluster_coord[1], cute.make_layout(config.cluster_n),
            cute.group_modes(sa, 0, 2), cute.group_modes(ga, 0, 2))
        tsb, tgb = cpasync.tma_partition(
            tma_b, cluster_coord[0], cute.make_layout(config.cluster_m),
            cute.group_modes(sb, 0, 2), cute.group_modes(gb, 0, 2))
        k_tiles = cute.size(ga, mode=[3])

        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_mn)
        scheduler = utils.StaticPersistentTileScheduler.create(
            schedule, cute.arch.block_idx(), cute.arch.grid_dim())
        work = scheduler.initial_work_tile_info()

        if warp < 4:
            # --- producer warpgroup: warp 0 streams A and B for every tile of this CTA -----------
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                a_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=1)
                b_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=0)
                producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, config.stages)
                while work.is_valid_tile:
                    m, n, batch = work.tile_idx
                    tga_tile = tga[(None, m, None, batch)]
                    tgb_tile = tgb[(None, n, None, batch)]
                    for k in cutlass.range(k_tiles, unroll=1):
                        loads.producer_acquire(producer)
                        barrier = loads.producer_get_barrier(producer)
                        cute.copy(tma_a, tga_tile[(None, k)], tsa[(None, producer.index)], tma_bar_ptr=barrier,
                                  mcast_mask=a_mask if const_expr(config.cluster_n > 1) else 0)
                        cute.copy(tma_b, tgb_tile[(None, k)], tsb[(None, producer.index)], tma_bar_ptr=barrier,
                                  mcast_mask=b_mask if const_expr(config.cluster_m > 1) else 0)
                        loads.producer_commit(producer)
                        producer.advance()
                    scheduler.advance_to_next_work()
                    work = scheduler.get_current_work()
                # Keep this CTA alive until every partner has released the stages it fed.
                loads.producer_tail(producer)
        else:
            # --- consumer warpgroups: mainloop and epilogue per tile ----------------------------
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            ctidx = tidx - WARPGROUP
            group = cute.arch.make_warp_uniform(ctidx // WARPGROUP)
            thr_mma = tiled_mma.get_slice(cute.make_layout(config.consumer_warpgroups, stride=WARPGROUP)(group))
            frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sa))
            frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sb))
            # wgmma operands are per warpgroup, but each thread holds its own accumulators: their
            # coordinates (for bias and residual) come from the thread's own slice.
            tile_coords_c = tiled_mma.get_slice(ctidx).partition_C(
                cute.make_identity_tensor((config.tile_m, config.tile_n)))
            acc = cute.make_rmem_tensor(tile_coords_c.shape, Float32)
            k_blocks = cute.size(frag_a, mode=[2])
            consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, config.stages)
            released = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, config.stages)

            stores = pipeline.PipelineTmaStore.create(
                num_stages=EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
            )
            copy_r2s = cute.make_tiled_copy_S(
                sm90.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, Float32),
                cute.make_tiled_copy_C_atom(
                    cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.c_dtype), tiled_mma
                ),
            )
            stores_per_tile = self.epi_tiles(epi_tile) * (2 if const_expr(self.epilogue.store_preact) else 1)
            tiles_done = Int32(0)
            while work.is_valid_tile:
                # Accumulate from zero rather than switching ACCUMULATE off for the first k tile:
                # the flag is fixed when the loop body is traced.
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for k in cutlass.range(k_tiles, unroll=1):
                    loads.consumer_wait(consumer)
                    for kb in cutlass.range_constexpr(k_blocks):
                        stage = (None, None, kb, consumer.index)
                        cute.gemm(tiled_mma, acc, frag_a[stage], frag_b[stage], acc)
                    warpgroup.commit_group()
                    consumer.advance()
                    if k > 0:
                        # The batch before this one has finished reading its stage: release it.
                        warpgroup.wait_group(1)
                        loads.consumer_release(released)
                        released.advance()
                warpgroup.wait_group(0)
                loads.consumer_release(released)
                released.advance()

                self.epilogue_tile(acc, tile_coords_c, work.tile_idx, copy_r2s, sc, tma_c, tma_tensor_c,
                                   tma_z, tma_tensor_z, bias, residual, epi_tile, stores, ctidx, warp,
                                   tiles_done * stores_per_tile)
                tiles_done += 1
                scheduler.advance_to_next_work()
                work = scheduler.get_current_work()
            if warp == 4:
                stores.producer_tail()

    def epi_tiles(self, epi_tile) -> int:
        return (self.config.tile_m // epi_tile[0]) * (self.config.tile_n // epi_tile[1])

    @cute.jit
    def epilogue_tile(self, acc, tile_coords_c, tile_idx, copy_r2s, sc, tma_c, tma_tensor_c, tma_z, tma_tensor_z,
                      bias, residual, epi_tile: cutlass.Constexpr, stores, ctidx, warp, first_store):
        """Bias, [pre-activation store], activation, residual and the store of one finished tile."""
        config, epilogue = self.config, self.epilogue
        m, n, batch = tile_idx
        tile_coord = (m, n, None, batch)
        m0 = m * config.tile_m
        n0 = n * config.tile_n
        if const_expr(epilogue.has_bias):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                col = n0 + tile_coords_c[i][1]
                if col < bias.shape[0]:
                    acc[i] = acc[i] + bias[col].to(Float32)
        if const_expr(epilogue.store_preact):
            self.store_tile(acc, copy_r2s, sc, tma_z, tma_tensor_z, tile_coord, epi_tile, stores, ctidx, warp,
                            first_store)
            first_store += self.epi_tiles(epi_tile)
        if const_expr(epilogue.activation != "none" or epilogue.has_residual):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                value = apply_activation(acc[i], epilogue.activation)
                if const_expr(epilogue.has_residual):
                    row = m0 + tile_coords_c[i][0]
                    col = n0 + tile_coords_c[i][1]
                    if row < residual.shape[0] and col < residual.shape[1]:
                        value = value + residual[row, col, batch].to(Float32)
                acc[i] = value
        self.store_tile(acc, copy_r2s, sc, tma_c, tma_tensor_c, tile_coord, epi_tile, stores, ctidx, warp,
                        first_store)

    @cute.jit
    def store_tile(self, acc, copy_r2s, sc, tma_out, tma_tensor_out, tile_coord, epi_tile: cutlass.Constexpr,
                   stores, ctidx, warp, first_store):
        """Write the fp32 accumulators ``acc`` to ``tma_tensor_out``'s tile ``tile_coord`` in its
        dtype: registers -> smem (stmatrix) -> global (TMA store), one epilogue tile at a time
        through the ``EPI_STAGES`` ring (buffer = running store count mod EPI_STAGES). TMA clips
        what lies past the tensor."""
        consumer_threads = WARPGROUP * self.config.consumer_warpgroups
        thr_r2s = copy_r2s.get_slice(ctidx)
        r2s_dst = thr_r2s.partition_D(sc)
        acc_view = copy_r2s.retile(acc)
        part_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sc))[:3])
        part = cute.make_rmem_tensor(part_layout, Float32)
        part_out = cute.make_rmem_tensor(part_layout, self.c_dtype)

        g_tile = cute.local_tile(tma_tensor_out, self.tile_mnk, tile_coord, proj=(1, 1, None))
        g_epi = cute.zipped_divide(g_tile, epi_tile)
        s_tma, g_tma = cpasync.tma_partition(
            tma_out, 0, cute.make_layout(1), cute.group_modes(sc, 0, 2), g_epi
        )
        epi_grid = g_epi.shape[1]
        epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))
        for e in cutlass.range_constexpr(self.epi_tiles(epi_tile)):
            for v in cutlass.range_constexpr(cute.size(part)):
                part[v] = acc_view[e * cute.size(part) + v]
            part_out.store(part.load().to(self.c_dtype))
            buffer = (first_store + e) % EPI_STAGES
            cute.copy(copy_r2s, part_out, r2s_dst[(None, None, None, buffer)])
            # Make the smem writes visible to the TMA (async proxy), then let one warp send them.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=1, number_of_threads=consumer_threads)
            if warp == 4:
                cute.copy(tma_out, s_tma[(None, buffer)], g_tma[(None, epi_order.get_hier_coord(e))])
                stores.producer_commit()
                stores.producer_acquire()
            cute.arch.barrier(barrier_id=1, number_of_threads=consumer_threads)
