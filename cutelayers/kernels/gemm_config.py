"""The GEMM's configs without CuTe: :class:`GemmConfig` (tiles, warpgroups, stages, cluster) and
its shared-memory budget, the heuristic table (:data:`CONFIGS` by :func:`config_class`), the rest
of the autotuning space, the tuned table's row buckets and the stream-K choice for weight gradients.

Ops choose a config when they trace, on every platform and also where the CuTe DSL is not
installed, so this module imports no CuTe; the kernel (:mod:`.gemm`) imports it.
"""

from __future__ import annotations

import dataclasses
import functools

from cutelayers.kernels.hopper import HOPPER_SMS, RESIDENT_CLUSTERS, concrete_dim

WARPGROUP = 128
SMEM_CAPACITY = 227 * 1024  # sm_90 dynamic shared memory per CTA
SMEM_RESERVED = 2048  # mbarriers and the 1 KiB alignment of each buffer
ROW_SUM_BLOCK = 64  # columns each row sum of an exp_row_sums epilogue covers (every tile_n a multiple)
EXP_CLAMP = 80.0  # an exp_row_sums epilogue's exponents stop here: e^80 is finite in bf16 (max ~e^88.7)
# Epilogue smem buffers in flight to TMA stores, each a subtile EPI_ROW_BYTES of an output row wide
# (GemmConfig.epi_tile: 64 columns of a 16-bit output, 32 of a float32 one): on the GPT-2 step's
# bf16 GEMMs two 64-column buffers beat four of 32 columns (half the barriers per tile, the same
# shared memory): fc1 with z 130.8 -> 126.4 us, dh 134.7 -> 128.8 (H200).
EPI_STAGES = 2
# Bytes of an output row per epilogue subtile: one 128-byte swizzle atom, so a float32 output (a
# weight gradient: stream-K's partial tiles, the LM head's running sum) keeps the shared memory of
# a 16-bit one and leaves the mainloop a stage more (GPT-2 stream-K weight gradients, 16384 rows,
# 64 -> 32 float32 columns: 87.9 / 111.2 / 110.3 / 35.8 -> 84.2 / 108.9 / 109.0 / 34.8 us, H200).
EPI_ROW_BYTES = 128
SOURCE_STAGES = 2  # epilogue source tiles (residual / pre-activation) in flight
# Which operand's sums over the contraction a GEMM also gives (a weight gradient's bias gradient):
# none, A or B.
OPERAND_SUMS = (None, "a", "b")
# SMs the persistent grid is sized for. A GPU with fewer runs the extra CTAs as a short second wave
# (correct, slightly unbalanced); one with more idles a few SMs.
PERSISTENT_SMS = HOPPER_SMS


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tile shape, warpgroups, pipeline depth and cluster shape of one kernel instance.

    ``consumer_warpgroups`` split ``tile_m`` (each owns tile_m / groups rows; at most 64 rows x
    tile_n columns of accumulators per 128 threads keeps the accumulator in registers), unless
    ``pingpong``: then two warpgroups each compute whole (tile_m, tile_n) tiles, alternately. A
    ``cluster_m x cluster_n`` cluster multicasts B over its ``cluster_m`` CTAs and A over its
    ``cluster_n``. ``split_k`` > 1 instead cuts each tile's contraction over a cluster of that many
    CTAs (one tile a cluster, not persistent): each sends its float32 partial tile to the first
    one's shared memory, which adds them and runs the epilogue -- for outputs of few tiles, such as
    a decode step's. ``stages`` is an upper bound: an epilogue that needs a source ring gets as
    many as fit next to it.
    """

    tile_m: int
    tile_n: int
    consumer_warpgroups: int
    stages: int
    cluster_m: int = 1
    cluster_n: int = 1
    pingpong: bool = False
    tile_k: int = 64
    split_k: int = 1

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumer_warpgroups)  # + the producer warpgroup

    @property
    def epilogue_groups(self) -> int:
        """Warpgroups that run epilogues independently: two in pingpong, else one (all together)."""
        return 2 if self.pingpong else 1

    @property
    def mma_warpgroups(self) -> int:
        """Warpgroups sharing one tile's MMAs."""
        return 1 if self.pingpong else self.consumer_warpgroups

    def epi_tile(self, c_bytes: int) -> tuple[int, int]:
        """The epilogue's (rows, columns) per smem buffer for an output of ``c_bytes`` per element:
        64 rows per warpgroup sharing the tile (their stmatrix stores go together), 128 bytes of an
        output row (one swizzle atom wide: 64 columns of a 16-bit output, 32 of a float32 one)."""
        return (64 * self.mma_warpgroups, EPI_ROW_BYTES // c_bytes)

    def ring_bytes(self, c_bytes: int, source: bool) -> int:
        """Shared memory of the epilogue rings: stores, plus sources if the epilogue reads one."""
        rows, cols = self.epi_tile(c_bytes)
        buffers = EPI_STAGES + (SOURCE_STAGES if source else 0)
        return self.epilogue_groups * buffers * rows * cols * c_bytes

    def stage_bytes(self, ab_bytes: int) -> int:
        return (self.tile_m + self.tile_n) * self.tile_k * ab_bytes

    @property
    def partial_bytes(self) -> int:
        """Shared memory of the float32 partial tiles a split-K cluster's first CTA receives."""
        return (self.split_k - 1) * self.tile_m * self.tile_n * 4

    @property
    def stream_k_workspace(self) -> tuple[int, int]:
        """(CTAs of the persistent grid, float32 elements of a tile): the global scratch of a
        stream-K kernel whose partial tiles meet in a workspace (one partial tile a CTA at most),
        not in c -- and, by its first size, the count of its ready flags."""
        size = self.cluster_m * self.cluster_n
        return PERSISTENT_SMS // size * size, self.tile_m * self.tile_n

    def stages_for(self, ab_bytes: int, c_bytes: int, source: bool) -> int:
        """Mainloop stages: ``stages``, or fewer where the epilogue's rings (and split-K's partial
        tiles) leave less room."""
        room = SMEM_CAPACITY - SMEM_RESERVED - self.ring_bytes(c_bytes, source) - self.partial_bytes
        return min(self.stages, room // self.stage_bytes(ab_bytes))

    def smem_bytes(self, ab_bytes: int, c_bytes: int | None = None, source: bool = False) -> int:
        c_bytes = ab_bytes if c_bytes is None else c_bytes
        return (self.stages_for(ab_bytes, c_bytes, source) * self.stage_bytes(ab_bytes)
                + self.ring_bytes(c_bytes, source) + self.partial_bytes + SMEM_RESERVED)


# Shape classes -> config (chosen from the H100 sweeps in docs/benchmarks.md). "small_m":
# decode-like row counts, where 128-row tiles would be mostly padding; "wide": long mainloops (K
# >= 2048) on a large output, where a 128x256 tile halves the operand traffic per FLOP and the
# shared epilogue is amortised; "default": short mainloops or few tiles, where pingpong hides one
# warpgroup's epilogue behind the other's MMAs. "wide" runs 2x1 clusters (B multicast), "default"
# 1x2 (A multicast; on an H200 against 2x1: GPT-2 qkv forward 87.0 -> 84.1 us, an LM-head chunk's
# logits 417.4 -> 397.8, fc1 with z 126.3 -> 124.7).
CONFIGS = {
    "small_m": GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1, stages=8),
    "default": GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, cluster_n=2, pingpong=True),
    "wide": GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_m=2),
}
# Further points of the autotuning space (not picked by the heuristic).
EXTRA_CONFIGS = (
    GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6),
    GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4),
    GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, cluster_m=2),
    GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_n=2),
    GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, pingpong=True),
    GemmConfig(tile_m=128, tile_n=128, consumer_warpgroups=2, stages=6, cluster_m=2, pingpong=True),
    GemmConfig(tile_m=64, tile_n=256, consumer_warpgroups=2, stages=6, pingpong=True),
    # 128 x 192 pingpong: each warpgroup's tile is 1.5x the 128 x 128 one, so its epilogue hides
    # behind a longer mainloop at K = 768 (GPT-2 fc2's input gradient on the H100: 101 us against
    # 116-118 on 128 x 128 / 128 x 256 tiles; cuBLAS 97); ptxas: no spills but 124 bytes in the
    # bias + gelu forward that stores z.
    GemmConfig(tile_m=128, tile_n=192, consumer_warpgroups=2, stages=5, cluster_m=2, pingpong=True),
    GemmConfig(tile_m=128, tile_n=192, consumer_warpgroups=2, stages=5, cluster_n=2, pingpong=True),
    # Decode rows over a short N: twice the CTAs of the small_m tile, in 128-deep k tiles (H100,
    # 16 x 4096 x 4096: forward 19.5 -> 17.2 us, input gradient 18.2 -> 16.2; 64-deep ones, as many
    # stages as fit, 17.8 / 16.8). Its 64-column tiles lose where N fills the GPU (16 x 4096 x
    # 16384: 52.8 us against small_m's 47.9).
    GemmConfig(tile_m=64, tile_n=64, consumer_warpgroups=1, stages=6, cluster_n=2, tile_k=128),
)


# Split-K over a cluster (GemmConfig.split_k), for outputs of few tiles such as a decode step's, in
# the order decode_split_config prefers them: candidates of the families whose kernel takes them
# (one consumer warpgroup; no stream-K, accumulation, operand sums or planes:
# GemmFamily.takes_split_k). At 16 x 4096 x 4096 they put 128 CTAs on the weight where the small_m
# tile puts 32 (docs/gemm_notes.md).
SPLIT_K_CONFIGS = tuple(
    GemmConfig(tile_m=64, tile_n=64, consumer_warpgroups=1, stages=6, tile_k=128, split_k=split)
    for split in (4, 3, 2)
) + (GemmConfig(tile_m=64, tile_n=128, consumer_warpgroups=1, stages=4, split_k=2),)


# Stream-K (the weight gradient's small (K, N) outputs, contracting many rows): 128 x 256 tiles over
# a 2x1 cluster, every cluster one equal share of the (tile, k tile) steps. At GPT-2's four layers
# it beat every split-K count on every config (.ci/dkernel_sweep.py, docs/benchmarks.md, seventh
# session); at 4096 x 4096 (512 tiles, 3.9 waves) whole tiles won.
STREAM_K_CONFIG = GemmConfig(tile_m=128, tile_n=256, consumer_warpgroups=2, stages=4, cluster_m=2)
STREAM_K_MIN_ROWS = 2048  # shorter contractions run whole tiles
STREAM_K_BELOW = 0.8  # stream-K when whole tiles would keep less than this of the grid's waves busy


# Stream-K's partial tiles meet in a workspace, the segment owning a tile adding them before its
# epilogue (gemm.HopperGemmKernel.fix_up: no float32 zeros, no cast), where a cluster tile is cut
# over a few clusters; over many, the owners' reads of the partials pile up at the end of the
# kernel and adding them into float32 zeros by TMA, then a cast, was faster. H100, fwd+bwd of the
# GPT-2 layers (docs/benchmarks.md, 28th session), ms, zeros -> workspace: qkv (27 cluster tiles
# on 66 clusters) 0.310 -> 0.306, fc1 (36) 0.540 -> 0.529, fc2 (36) 0.341 -> 0.338; attention out
# (9: ~7 clusters a tile) 0.129 -> 0.132 with its best workspace config (0.140 with this one).
STREAM_K_WORKSPACE_MAX_CUTS = 3


SYMBOLIC_DIM = 1 << 20  # what a symbolic dimension (jax.export's shape polymorphism) decides as


def _concrete_dims(choice):
    """``choice`` of GEMM dims, a symbolic one deciding as ``SYMBOLIC_DIM`` -- many rows, or a long
    contraction over them --: a decision needs a number, and the kernels keep M dynamic anyway."""
    @functools.wraps(choice)
    def decide(*dims, **kwargs):
        return choice(*map(_number_or_symbolic, dims), **kwargs)
    return decide


def _number_or_symbolic(dim) -> int:
    number = concrete_dim(dim)
    return SYMBOLIC_DIM if number is None else number


@_concrete_dims
def stream_k_workspace_pays(m: int, n: int, batch: int = 1) -> bool:
    """Whether the stream-K partial tiles of an (m, n) output per batch meet in a workspace rather
    than in float32 zeros: where ``STREAM_K_CONFIG``'s clusters cut each of its cluster tiles
    over at most ``STREAM_K_WORKSPACE_MAX_CUTS`` of them on average."""
    c = STREAM_K_CONFIG
    cluster_tiles = batch * -(-m // (c.tile_m * c.cluster_m)) * -(-n // (c.tile_n * c.cluster_n))
    return PERSISTENT_SMS // (c.cluster_m * c.cluster_n) <= STREAM_K_WORKSPACE_MAX_CUTS * cluster_tiles


@_concrete_dims
def stream_k_pays(m: int, n: int, k: int, batch: int = 1) -> bool:
    """Whether an (m, n) output per batch contracting k runs stream-K: a contraction of at least
    ``STREAM_K_MIN_ROWS`` whose output tiles (``STREAM_K_CONFIG``'s), one per SM at a time, fill
    less than ``STREAM_K_BELOW`` of the persistent grid's waves. It depends on k only through that
    threshold, so every row count of a bucket (:func:`row_bucket`) shares one compiled kernel.
    Never for ``m`` up to ``SMALL_M_MAX`` (decode): ``STREAM_K_CONFIG``'s 128-row tiles would be
    mostly padding, and the small_m config was faster (16 x 4096 x 4096 input gradient on an H200:
    16.4 us against ~21 with the zeroing and the cast)."""
    if k < STREAM_K_MIN_ROWS or m <= SMALL_M_MAX:
        return False
    tiles = batch * -(-m // STREAM_K_CONFIG.tile_m) * -(-n // STREAM_K_CONFIG.tile_n)
    waves = -(-tiles // PERSISTENT_SMS)
    return tiles / (waves * PERSISTENT_SMS) < STREAM_K_BELOW


@_concrete_dims
def weight_grad_stream_k(m: int, n: int, k: int, batch: int = 1) -> str | None:
    """How a weight gradient of an (m, n) output per batch contracting k (adding into no running
    sum) meets its stream-K partial tiles: None (whole tiles, :func:`stream_k_pays` says no),
    ``"workspace"`` (:func:`stream_k_workspace_pays`) or ``"zeros"`` (added into float32 zeros)."""
    if not stream_k_pays(m, n, k, batch):
        return None
    return "workspace" if stream_k_workspace_pays(m, n, batch) else "zeros"


SMALL_M_MAX = 64  # rows up to this are "small_m"
# A decode GEMM's default where its kernel takes split-K: the first of SPLIT_K_CONFIGS whose
# clusters, one a tile, are all resident at once (hopper.RESIDENT_CLUSTERS) -- the most CTAs on the
# weight in one wave. H100, 16 rows, bias + gelu (docs/benchmarks.md, twenty-second session), us:
# N = 4096 (64 tiles: split 2), K = 1024 ... 16384: 6.6 / 15.1 / 47.6 (small_m 7.8 / 19.4 / 67.5,
# XLA 6.5 / 15.5 / 49.3); N = 2048 (32 tiles: split 3; 32 clusters of 4 are not resident), K =
# 4096 / 16384: 11.0 / 27.1 (split 2 11.3 / 32.8, split 4 13.5 / 33.2, XLA 9.6 / 26.5); N = 1024
# (split 4), K = 16384: 15.3 (split 3 16.5, XLA 16.9); N = 6144 (64 x 128 tiles): 21.1 (24.0, 20.9).


@_concrete_dims
def decode_split_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The split-K config of a decode-sized GEMM (at most ``SMALL_M_MAX`` rows) into ``n`` columns
    contracting ``k``: the first of ``SPLIT_K_CONFIGS`` whose clusters, one per output tile, are
    resident at once, with a k tile for each of its CTAs; None where none is (whole small_m tiles
    fill the GPU) or the rows are not decode rows."""
    if m > SMALL_M_MAX:
        return None
    return next((c for c in SPLIT_K_CONFIGS if -(-n // c.tile_n) <= RESIDENT_CLUSTERS[c.split_k]
                 and k >= c.split_k * c.tile_k), None)


# A decode-sized forward (rows up to SMALL_M_MAX) over a long contraction whose split-K grid
# (decode_split_config) still leaves most SMs idle: stream-K on all of them, into float32 zeros,
# with the epilogue in XLA. Where the split grid keeps more than a quarter of the SMs busy it won
# (H100, bias + gelu, K = 16384: N = 1024, 64 CTAs: 15.3 us against 17.1; N = 2048: 27.1 against
# 28.2); the small_m tiles' 32 CTAs lost to it (16 x 16384 x 4096: 66.0 against 50.8). Over
# shorter contractions the zeros and the epilogue pass cost more than they save.
DECODE_STREAM_K_MIN_K = 8192
DECODE_STREAM_K_SMS = HOPPER_SMS // 4  # stream-K where the split grid has at most this many CTAs
WIDE_MIN = 2048  # "wide" from this contraction and this many rows or columns


@_concrete_dims
def decode_stream_k_pays(m: int, n: int, k: int) -> bool:
    """Whether a forward of ``m`` rows (decode: at most ``SMALL_M_MAX``) into ``n`` columns
    contracting ``k`` runs stream-K: a contraction of at least ``DECODE_STREAM_K_MIN_K`` whose
    split-K clusters (or small_m tiles, where none splits) would run at most
    ``DECODE_STREAM_K_SMS`` CTAs."""
    if m > SMALL_M_MAX or k < DECODE_STREAM_K_MIN_K:
        return False
    split = decode_split_config(m, n, k) or CONFIGS["small_m"]
    return split.split_k * -(-n // split.tile_n) <= DECODE_STREAM_K_SMS


@_concrete_dims
def stream_k_config(m: int) -> GemmConfig:
    """The stream-K config of an output of ``m`` rows: ``STREAM_K_CONFIG``, or small_m's 64-row
    tiles for decode rows (16 x 16384 x 4096 on an H100: 48.3 us against 60.0)."""
    return CONFIGS["small_m"] if m <= SMALL_M_MAX else STREAM_K_CONFIG


@_concrete_dims
def config_class(m: int, n: int, k: int) -> str:
    """The config table key for an (m, n) output contracting k: see ``CONFIGS``.

    ``m`` is the concrete row count at trace time; the kernel itself keeps M symbolic, so rows
    within one class share a compile.
    """
    if m <= SMALL_M_MAX:
        return "small_m"
    if k >= WIDE_MIN and (m >= WIDE_MIN or n >= WIDE_MIN):
        return "wide"
    return "default"


@_concrete_dims
def row_bucket(m: int) -> str:
    """The range of row counts ``m`` belongs to, out of those between which :func:`config_class`
    changes for a fixed (n, k): a tuned config for a symbolic M applies to its whole bucket."""
    if m <= SMALL_M_MAX:
        return f"1-{SMALL_M_MAX}"
    if m < WIDE_MIN:
        return f"{SMALL_M_MAX + 1}-{WIDE_MIN - 1}"
    return f"{WIDE_MIN}+"
