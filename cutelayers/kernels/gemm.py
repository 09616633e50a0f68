"""Hopper GEMM with a fused epilogue (CuTe DSL, sm_90a): warp-specialized, persistent, clustered.

The kernel computes, for every batch index ``l``::

    z[m, n, l]   = sum_k a[m, k, l] * b[n, k, l]  (+ bias[n])            fp32 accumulation
    c[m, n, l]   = act(z[m, n, l])  (+ residual[m, n, l])                  stored in c's dtype
    preact       = z                                                       stored only if asked

or, with ``Epilogue.grad_of`` (an MLP's backward through its hidden activation, the source
``preact_in`` being the forward's z), ``c = (a @ bᵀ) * act'(preact_in)`` and a second output
``hidden = act(preact_in)``: the forward's hidden activation, rewritten here so that the forward
need not keep it for the next layer's weight gradient.

or, with ``Epilogue.exp_row_sums`` (the LM head's logits), ``c = exp(z)`` and per row the sum of
``exp(z)`` over each ``ROW_SUM_BLOCK`` columns, float32 (see :meth:`HopperGemmKernel.exp_row_sums`);
with ``Epilogue.exp_fix_rows`` too, the same over the tiles of flagged rows only, shifted per row
(:meth:`HopperGemmKernel.skip_unflagged`).

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
  TMA zero-fills reads past M / K, so tails need no predication in the mainloop -- except that a
  64-row tile crossing M loads A in ``ROW_BOX``-row boxes, only those inside M (a box far past M
  is slow to load; :meth:`HopperGemmKernel.load_a_rows`).
* epilogue (consumers, per tile): bias and activation on the fp32 accumulators in registers (the
  MMA partition of an identity tensor gives every accumulator its (row, column)); results go to a
  dedicated ring of ``EPI_STAGES`` shared-memory buffers through ``stmatrix`` and out with
  asynchronous TMA stores, which clip rows / columns past the tensor. The stores drain while the
  next tile's mainloop runs. The pre-activation, when asked for, goes out first through the same
  ring. A *source* tile read by the epilogue -- the residual, or the pre-activation whose
  activation derivative scales the product (an MLP backward) -- comes in by TMA too, into its own
  ring of ``SOURCE_STAGES`` buffers, issued before the tile's mainloop so it lands while the MMAs
  run, and is read back with ``ldmatrix`` in the accumulators' layout.
* pingpong (``GemmConfig.pingpong``): the two consumer warpgroups take alternate tiles, each a
  whole tile on its own, so one warpgroup's epilogue runs while the other's MMAs do -- for short
  mainloops (K of a few hundred) where a shared epilogue would leave the tensor cores idle.

Tiles are visited in groups of up to ``GROUP_N`` cluster columns (a divisor of the column count,
so no padding tile is ever scheduled): CTAs running together share A and B tiles in L2. The grid
has the fewest clusters that take as many rounds of tiles as a full wave would
(:func:`balanced_grid`).

Few output tiles over a long contraction (a weight gradient's (K, N) over all the tokens) would
leave most SMs idle: ``stream_k`` (:class:`StreamKScheduler`) gives every cluster one equal
share of all the (tile, k tile) steps instead. The partial tiles meet in a float32 workspace, the
segment owning a tile adds them and runs its epilogue (:meth:`HopperGemmKernel.fix_up`) -- or,
adding into a running sum (``accumulate``), they meet in c through reduce-add TMA stores.

*Planes* (:class:`Planes`): the P equal column blocks of one fused layer -- the q, k and v of an
attention projection -- as the GEMM's batch mode, with an operand given as P separate buffers
where the layer's neighbours hold them apart (the forward's outputs, dx's contraction over dq, dk,
dv, dW's columns): no slice or concatenation around the GEMM.
"""

from __future__ import annotations

import dataclasses
import math

import cutlass
import cutlass.utils.hopper_helpers as sm90
from cutlass import BFloat16, Float16, Float32, Int32, Int64, const_expr, cute, pipeline, utils
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values
from cutlass.tensor_utils import LayoutEnum

from cutelayers.kernels.gemm_config import (
    EPI_STAGES,
    EXP_CLAMP,
    OPERAND_SUMS,
    PERSISTENT_SMS,
    ROW_SUM_BLOCK,
    SOURCE_STAGES,
    WARPGROUP,
    GemmConfig,
)

ACTIVATIONS = ("none", "relu", "gelu", "gelu_exact", "silu", "sigmoid", "tanh", "leaky_relu", "hardswish")

GROUP_N = 16  # most cluster columns per rasterization group (H200, GPT-2 qkv forward: 8 -> 16, 87.0 -> 83.4 us)
PRODUCER_REGISTERS = 40  # the TMA warpgroup only computes addresses (and, with ``sums``, adds)
SUM_WARPS = 3  # the producer warpgroup's idle warps: they sum an operand (``sums``)
SUM_VECTOR = 8  # elements a summing lane loads at once (16 bytes of bfloat16 / float16)
FLAG_SCAN_LOADS = 8  # loads a thread has in flight in exp_fix_rows' scan of the row flags
CONSUMER_REGISTERS = 232  # accumulators: 40 * 128 + 232 * 256 fits the SM's 64K registers
# Named barriers: 1 + group for a group's epilogue, MMA_TURN_BARRIER + warpgroup for pingpong's
# mainloop turns.
MMA_TURN_BARRIER = 3
SPLIT_K = (1, 2, 3, 4)  # CTAs a split-K cluster cuts a tile's contraction over
# Rows of A per TMA box in a 64-row tile that crosses M (see ``HopperGemmKernel.row_boxes``): one
# 128-byte swizzle atom's rows, so every box starts on a whole atom.
ROW_BOX = 8
LEAKY_SLOPE = 0.01  # jax.nn.leaky_relu's default
GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715
LOG2E = math.log2(math.e)
# -2u log2(e) = x (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC x^2): the exponent of gelu_sigmoid
GELU_EXP2_LINEAR = -2.0 * GELU_TANH_SCALE * LOG2E
GELU_EXP2_CUBIC = GELU_EXP2_LINEAR * GELU_CUBIC


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What the epilogue does after the fp32 accumulation (see the module docstring)."""

    activation: str = "none"
    has_bias: bool = False
    has_residual: bool = False
    store_preact: bool = False
    # c = product * act'(preact): the backward of ``grad_of`` through an activation whose input
    # (preact, an (M, N, L) operand after b) is read as a source tile; and a second output, hidden
    # = act(preact) (M, N, L) in c's dtype. Excludes the fields above.
    grad_of: str = "none"
    # A gated layer (SwiGLU / GeGLU). Forward (``activation`` the gate's): B's N columns are a
    # (K, 2H) weight's gate and value halves, c is (M, H) = act(gate) * value, and bias and the
    # stored preact span both halves; each tile holds tile_n / 2 columns of each half. Backward
    # (``grad_of`` the gate's activation): the product is dh (M, H), the source z and c = dz are
    # (M, 2H): dz = (dh * value * act'(gate), dh * act(gate)), hidden (M, H) = act(gate) * value;
    # each tile reads and writes tile_n columns of each half. Both through
    # ``HopperGemmKernel.gated_view``.
    gated: bool = False
    # c = exp(min(product, EXP_CLAMP)) -- finite in bf16, whatever the logits -- and each row's
    # sum of it over every ROW_SUM_BLOCK columns inside N, in float32 before c's rounding, into an
    # (M, ceil(N / ROW_SUM_BLOCK), L) result: the unnormalized softmax of a chunk of logits and
    # its denominator's parts. Excludes bias (the LM head's logits have none), activation,
    # residual, stored preact, grad_of and gated.
    exp_row_sums: bool = False
    # With exp_row_sums, the LM head's second pass over its rows out of the exponential's range
    # (:meth:`HopperGemmKernel.skip_unflagged`): only the tiles holding a flagged row run, and
    # c = exp(min(z - shift[m], EXP_CLAMP)) is written over the first pass's c (given as an
    # operand, in place); per row and ROW_SUM_BLOCK columns also the block's max of z - shift[m]
    # and its entry at the row's label column (-inf elsewhere), float32 (M, blocks, L) each.
    exp_fix_rows: bool = False
    # With exp_row_sums, the columns that count when fewer than N (0: all N): a vocabulary padded
    # for TMA's 16-byte rows, its buffers wider than the vocabulary. Past them c is 0 and nothing
    # is summed (nor, with exp_fix_rows, maxed), as past N.
    exp_columns: int = 0

    def __post_init__(self):
        for name in (self.activation, self.grad_of):
            if name not in ACTIVATIONS:
                raise ValueError(f"activation must be one of {ACTIVATIONS}; got {name!r}")
        if self.grad_of != "none" and (self.activation != "none" or self.has_bias or self.has_residual
                                       or self.store_preact):
            raise ValueError("an activation-gradient epilogue takes no activation, bias, residual or stored preact")
        if self.gated and ((self.activation == "none") == (self.grad_of == "none") or self.has_residual):
            raise ValueError("a gated epilogue takes the gate's activation (forward) or its gradient (backward), "
                             "and no residual")
        if self.exp_row_sums:
            extra = {"has_bias": self.has_bias, "activation": self.activation != "none",
                     "grad_of": self.grad_of != "none", "has_residual": self.has_residual,
                     "store_preact": self.store_preact, "gated": self.gated}
            if any(extra.values()):
                got = ", ".join(f"{name}={getattr(self, name)!r}" for name, given in extra.items() if given)
                raise ValueError("exp_row_sums=True takes no bias, activation, residual, stored preact or gating "
                                 f"(c = exp(A @ Bᵀ) only); got it with {got}")
        if self.exp_fix_rows and not self.exp_row_sums:
            raise ValueError("exp_fix_rows=True is a pass of the exp epilogue: it takes exp_row_sums=True")
        if self.exp_columns and (not self.exp_row_sums or self.exp_columns < 0):
            raise ValueError(f"exp_columns must be 0 or, with exp_row_sums=True, > 0; got {self.exp_columns} "
                             f"with exp_row_sums={self.exp_row_sums}")

    @property
    def has_source(self) -> bool:
        """Whether the epilogue reads an (M, N, L) tile: the residual or the pre-activation."""
        return self.has_residual or self.grad_of != "none"

    @property
    def second_output(self) -> bool:
        """Whether the kernel writes an output after c: the stored preact (forward) or the hidden
        activation (``grad_of``)."""
        return self.store_preact or self.grad_of != "none"


OPERAND_PLANES = ("batched", "shared", "split")


@dataclasses.dataclass(frozen=True)
class Planes:
    """How the batch mode L reaches each operand.

    Default (``count`` None): every operand has the same L mode, any size (a vmap batch). With a
    static ``count`` P, the L of the GEMM are the P planes of a fused layer, and each of A, B and C
    is one of

    * "batched": one tensor whose L mode has P entries (a strided view of the layer's weight);
    * "shared": one tensor with L = 1 read by every plane (the layer's input); for C, one output
      that sums the planes: the mainloop runs through every plane's k tiles into one accumulator
      (dx = sum over l of dz_l @ W_lᵀ);
    * "split": P separate buffers, one per plane, each with L = 1.
    """

    count: int | None = None
    a: str = "batched"
    b: str = "batched"
    c: str = "batched"

    def __post_init__(self):
        hows = (self.a, self.b, self.c)
        if any(h not in OPERAND_PLANES for h in hows):
            raise ValueError(f"each operand's planes must be one of {OPERAND_PLANES}; got {hows}")
        if self.count is None and hows != ("batched",) * 3:
            raise ValueError("shared or split operands need a static plane count")
        if self.count is not None and self.count < 2:
            raise ValueError(f"a planar GEMM has at least 2 planes; got count={self.count}")

    @property
    def summed(self) -> bool:
        """Whether the planes add up into one output (C shared)."""
        return self.c == "shared"


def require_n_major(name: str, tensor):
    """Refuse an M-major (M, N, L) output or source ``tensor`` (None passes; a tuple: each plane's
    buffer): the epilogue's stmatrix / ldmatrix and shared-memory subtiles hold rows of N."""
    for t in tensor if isinstance(tensor, tuple) else (tensor,):
        if t is not None and LayoutEnum.from_tensor(t).is_m_major_c():
            raise ValueError(f"{name} takes N contiguous (an N-major (M, N, L) tensor); got an M-major {name}, "
                             f"layout {t.layout}")


def per_plane(make, tensor):
    """``make(tensor)`` -- a (TMA atom, TMA tensor) pair --, or for split planes (a tuple of
    buffers) the pair (tuple of atoms, tuple of tensors)."""
    if not isinstance(tensor, tuple):
        return make(tensor)
    atoms, tensors = zip(*(make(t) for t in tensor))
    return tuple(atoms), tuple(tensors)


def as_planes(x) -> tuple:
    """``x`` as a tuple of per-plane values (one value if not split)."""
    return x if isinstance(x, tuple) else (x,)


@cute.jit
def sigmoid_base2(t: Float32) -> Float32:
    """1 / (1 + 2^t), that is sigmoid(-t ln 2), from the SFU's exp2 and reciprocal: relative error
    ~1e-6, where a library exp and an IEEE division cost about three times the instructions (a
    K = 768 GEMM's gelu epilogue is bound by them). 2^t overflows to inf for t above 128: 0."""
    return cute.arch.rcp_approx(1.0 + cute.math.exp2(t, fastmath=True))


@cute.jit
def gelu_sigmoid(x: Float32, x2: Float32) -> Float32:
    """sigmoid(2u) of tanh-gelu, u = sqrt(2/pi) (x + 0.044715 x^3), x2 = x * x: gelu(x) =
    0.5 x (1 + tanh(u)) = x sigmoid(2u), with no cancelling 1 + tanh for negative x."""
    return sigmoid_base2(x * (GELU_EXP2_LINEAR + GELU_EXP2_CUBIC * x2))


@cute.jit
def activation_and_grad(x: Float32, name: cutlass.Constexpr):
    """(act(x), act'(x)) in fp32 from shared intermediates: the formulas of the matching jax.nn
    function and its derivative (jax's at the kinks). A caller using one of the two leaves the
    other's instructions to dead-code elimination."""
    y, d = x, Float32(1.0)
    if const_expr(name == "relu"):
        y = cute.arch.fmax(x, Float32(0.0), nan=True)
        d = Float32(0.0)
        if x > 0.0:
            d = Float32(1.0)
    elif const_expr(name == "gelu"):
        # d/dx x s(2u) = s + x s (1 - s) 2u', s = sigmoid(2u), 2u' = 2 sqrt(2/pi) (1 + 3 0.044715 x^2)
        x2 = x * x
        s = gelu_sigmoid(x, x2)
        y = x * s
        du = 2.0 * GELU_TANH_SCALE + (6.0 * GELU_TANH_SCALE * GELU_CUBIC) * x2
        d = s + y * (1.0 - s) * du
    elif const_expr(name == "gelu_exact"):
        cdf = 0.5 * (1.0 + cute.math.erf(x * (1.0 / math.sqrt(2.0))))
        y = x * cdf
        d = cdf + x * cute.math.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    elif const_expr(name == "silu"):
        sig = sigmoid_base2(x * -LOG2E)
        y = x * sig
        d = sig * (1.0 + x * (1.0 - sig))
    elif const_expr(name == "sigmoid"):
        y = sigmoid_base2(x * -LOG2E)
        d = y * (1.0 - y)
    elif const_expr(name == "tanh"):
        y = cute.math.tanh(x)
        d = 1.0 - y * y
    elif const_expr(name == "leaky_relu"):
        # max(x, slope * x) is x for x >= 0 and slope * x below, as slope < 1.
        y = cute.arch.fmax(x, LEAKY_SLOPE * x, nan=True)
        d = Float32(LEAKY_SLOPE)
        if x >= 0.0:
            d = Float32(1.0)
    elif const_expr(name == "hardswish"):
        # d/dx x * relu6(x + 3) / 6 = (relu6(x + 3) + x * [-3 < x < 3]) / 6
        relu6 = cute.arch.fmin(cute.arch.fmax(x + 3.0, Float32(0.0)), Float32(6.0))
        y = x * relu6 * (1.0 / 6.0)
        d = relu6 * (1.0 / 6.0)
        if x > -3.0 and x < 3.0:
            d = d + x * (1.0 / 6.0)
    return y, d


@cute.jit
def apply_activation(x: Float32, name: cutlass.Constexpr) -> Float32:
    """act(x) in fp32 (:func:`activation_and_grad`)."""
    return activation_and_grad(x, name)[0]


@cute.jit
def pin_zeros(acc):
    """Zeros into every register of ``acc``, each through an empty asm (CUTLASS's
    ``warpgroup_fence_operand``): a value the compiler can neither carry in from the last tile nor
    sink past the next warpgroup fence. The tile's first wgmma runs with ACCUMULATE off, so these
    are never read; what they do is end the accumulators' live range at the tile's start. Carried
    across tiles instead (the first wgmma reads its registers), the accumulators stayed live
    through the epilogue, which spilled (8-48 bytes where it computes gelu on a stored z);
    zeroed with plain moves, the compiler sank those past the fence and ptxas injected a
    warpgroup.arrive of its own, serializing every wgmma (C7519 / C7520)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = Float32(llvm.inline_asm(Float32.mlir_type, [Float32(0.0).ir_value()], "", "=f,0",
                                         has_side_effects=True))


def chunk_start(cluster, steps, clusters):
    """Stream-K: the first of ``steps`` steps in the chunk of ``cluster`` (of ``clusters``); Int64
    inside, as clusters x steps can pass 2^31 on a long contraction."""
    return Int32(Int64(cluster) * Int64(steps) // Int64(clusters))


def balanced_clusters(cluster_tiles, clusters_per_wave: int):
    """The fewest clusters that run ``cluster_tiles`` (an int, or the launch's Int32 where M is
    dynamic) in as many rounds as ``clusters_per_wave`` clusters would: 2048 take 32 rounds on 64
    clusters as on 66."""
    rounds = cutlass.max((cluster_tiles + clusters_per_wave - 1) // clusters_per_wave, 1)
    return (cluster_tiles + rounds - 1) // rounds


def balanced_grid(schedule: utils.PersistentTileSchedulerParams, clusters_per_wave: int):
    """The persistent grid of ``schedule``'s cluster tiles over :func:`balanced_clusters`. With
    power-of-two outputs the count then also divides a rasterization group's tiles (64 clusters, 8
    rounds to a group of 16 x 32), so no round holds two groups' B tiles in L2 at once, as 66
    straddling a group's end did: 8192 x 4096 x 16384 took 2.6 % less time at the settled clock
    (H100, docs/benchmarks.md, seventy-first session)."""
    tiles = cute.size(schedule.problem_layout_ncluster_mnl)
    return (*schedule.cluster_shape_mn, balanced_clusters(tiles, clusters_per_wave))


class StreamKScheduler:
    """Stream-K schedule: the flattened space of (cluster tile, k tile) steps -- every tile's
    contraction in turn, tiles ordered m, n, batch -- cut into one equal contiguous chunk per
    cluster of the grid. A cluster works through its chunk in *segments*, the runs of steps that
    fall in one tile, each ending with a reduce-add store of its partial tile into c: about
    chunk / k_tiles + 1 stores per cluster, however few the tiles.

    Within a tile the k tiles are taken in a rotated order: k tile 0 is the step where the first
    chunk starting inside the tile starts. Chunks start in step with each other, so the clusters
    running together sit at only a couple of distinct k positions and share their A and B k tiles
    in L2 (unrotated, they would spread over the whole contraction).

    The interface of the static persistent scheduler, for the kernel's loops: a work's
    ``tile_idx`` is this CTA's (tile m, tile n, batch, first k tile, k tiles) of the segment.
    """

    def __init__(self, state, clusters_m: int, clusters_n: int, cluster_mn: tuple[int, int]):
        # state: Int32 (position, end of the chunk, k tiles, all steps, clusters in the grid,
        # this CTA's m and n in its cluster)
        self.state, self.clusters_m, self.clusters_n, self.cluster_mn = state, clusters_m, clusters_n, cluster_mn

    @staticmethod
    def create(c_shape, tile_mn, cluster_mn, cluster_coord, k_tiles):
        """The schedule of this CTA's cluster (the grid's third coordinate) for an output of
        ``c_shape`` (M, N, L) in tiles of ``tile_mn``."""
        clusters_m = cute.ceil_div(cute.ceil_div(c_shape[0], tile_mn[0]), cluster_mn[0])
        clusters_n = cute.ceil_div(cute.ceil_div(c_shape[1], tile_mn[1]), cluster_mn[1])
        steps = Int32(clusters_m * clusters_n * c_shape[2] * k_tiles)
        cluster = Int32(cute.arch.block_idx()[2])
        clusters = Int32(cute.arch.grid_dim()[2])
        start, end = chunk_start(cluster, steps, clusters), chunk_start(cluster + 1, steps, clusters)
        state = (start, end, Int32(k_tiles), steps, clusters, Int32(cluster_coord[0]), Int32(cluster_coord[1]))
        return StreamKScheduler(state, clusters_m, clusters_n, cluster_mn)

    def __extract_mlir_values__(self):
        return extract_mlir_values(self.state)

    def __new_from_mlir_values__(self, values):
        return StreamKScheduler(new_from_mlir_values(self.state, values), self.clusters_m, self.clusters_n,
                                self.cluster_mn)

    def initial_work_tile_info(self):
        return self.get_current_work()

    def get_current_work(self):
        pos, end, k_tiles, steps, clusters, cta_m, cta_n = self.state
        tile = pos // k_tiles
        inner = pos - tile * k_tiles
        count = cutlass.min(end - pos, k_tiles - inner)
        # The first chunk that starts in this tile (there may be none: then any rotation will do)
        tile_start = Int64(tile) * Int64(k_tiles)
        first = (tile_start * Int64(clusters) + Int64(steps) - 1) // Int64(steps)
        rotation = Int32(first * Int64(steps) // Int64(clusters) - tile_start) % k_tiles
        k0 = (inner - rotation + k_tiles) % k_tiles
        rest = tile // self.clusters_m
        m = (tile - rest * self.clusters_m) * self.cluster_mn[0] + cta_m
        batch = rest // self.clusters_n
        n = (rest - batch * self.clusters_n) * self.cluster_mn[1] + cta_n
        unit = tuple(cute.arch.make_warp_uniform(v) for v in (m, n, batch, k0, count))
        return utils.WorkTileInfo(unit, cute.arch.make_warp_uniform(pos < end))

    def advance_to_next_work(self):
        pos, end, k_tiles = self.state[:3]
        pos = pos + cutlass.min(end - pos, k_tiles - pos % k_tiles)
        self.state = (pos, *self.state[1:])

    def chunk_start(self, cluster):
        """The first step of ``cluster``'s chunk (its chunk ends where the next one starts)."""
        return chunk_start(cluster, self.state[3], self.state[4])

    def fixup_role(self):
        """Where the current segment's partial tile goes when partial tiles meet in a workspace
        (:meth:`HopperGemmKernel.fix_up`): (its first step within its tile, first and one past
        the last cluster it adds). A segment that does not hold its tile's first step starts its
        cluster's chunk, so each cluster has at most one such *partial* segment, which goes to
        the cluster's workspace slot. The segment holding the first step *owns* the tile: it adds
        the partials of the later clusters whose chunks hold the rest of the tile (each started
        its chunk with it, so it is done or nearly so when the owner, at the end of its own chunk,
        needs it), then stores the tile. A partial never waits, so the waits form no cycle."""
        pos, k_tiles, steps, clusters = self.state[0], self.state[2], self.state[3], self.state[4]
        tile = pos // k_tiles
        # the cluster holding the tile's last step: the last one whose chunk starts at or before
        # it (chunks are empty where there are fewer steps than clusters)
        last = Int32((Int64(tile + 1) * Int64(k_tiles) * Int64(clusters) - 1) // Int64(steps))
        first = Int32(cute.arch.block_idx()[2]) + 1
        return tuple(cute.arch.make_warp_uniform(v) for v in (pos - tile * k_tiles, first, last + 1))


class SplitKScheduler:
    """Split-K's schedule: one work unit a CTA -- its cluster's tile (the grid's third coordinate:
    tile row fastest, then column, then batch) and, by the CTA's rank in the cluster, an equal run
    of the tile's k tiles (possibly none where there are fewer k tiles than CTAs). The interface of
    :class:`StreamKScheduler`."""

    def __init__(self, state):
        self.state = state  # Int32 (m, n, batch, first k tile, k tiles, 1 while the unit is pending)

    @staticmethod
    def create(c_shape, tile_mn, k_tiles, split: int, rank):
        tiles_m = cute.ceil_div(c_shape[0], tile_mn[0])
        tiles_n = cute.ceil_div(c_shape[1], tile_mn[1])
        tile = Int32(cute.arch.block_idx()[2])
        per = (k_tiles + split - 1) // split
        k0 = Int32(rank) * per
        count = cutlass.max(cutlass.min(k_tiles - k0, per), 0)
        rest = tile // tiles_m
        state = (tile - rest * tiles_m, rest % tiles_n, rest // tiles_n, k0, Int32(count), Int32(1))
        return SplitKScheduler(state)

    def __extract_mlir_values__(self):
        return extract_mlir_values(self.state)

    def __new_from_mlir_values__(self, values):
        return SplitKScheduler(new_from_mlir_values(self.state, values))

    def initial_work_tile_info(self):
        return self.get_current_work()

    def get_current_work(self):
        unit = tuple(cute.arch.make_warp_uniform(v) for v in self.state[:5])
        return utils.WorkTileInfo(unit, cute.arch.make_warp_uniform(self.state[5] > 0))

    def advance_to_next_work(self):
        self.state = (*self.state[:5], Int32(0))


class HopperGemmKernel:
    """C = epilogue(A @ Bᵀ) on Hopper: persistent, warp-specialized TMA + wgmma, fp32 accumulation.

    Launcher ``(stream, a, b, [bias], [residual | preact_in], [sums], [flags], c, [preact | hidden],
    [workspace], [row_sums])``, which optional tensors are present being fixed by ``epilogue`` (and
    flags and workspace by stream-K without ``accumulate``), each of a, b and c being
    ``planes.count`` tensors where :class:`Planes` splits it; with ``Epilogue.exp_fix_rows``
    ``(stream, a, b, c, row flags, labels, shifts, row_sums, block max, label entries)``: c
    written in place, the row vectors (M, 1, 1) int32 / int32 / float32, the block results
    shaped as row_sums.

    * a: (M, K, L), b: (N, K, L): bfloat16 or float16 (same dtype), any one of the two modes
      M/N or K contiguous; M, K and L may be symbolic, N static, every contiguous extent a
      multiple of 8;
    * bias: (N,) in c's dtype (16-bit and N even: read two columns a load), (N, P) with a plane
      count (each plane its own); residual, preact_in (the source of ``grad_of``), c, preact,
      hidden: (M, N, L), N contiguous, c's dtype (a gated backward's preact_in and c (M, 2N, L)).

    ``accumulate``: C += A @ Bᵀ, each tile added into c by the TMA store (reduce-add): how a caller
    adds into a running float32 sum without a pass of its own, and how ``stream_k``
    (:class:`StreamKScheduler`) then sums its partial tiles. Without it, stream-K's partial tiles
    meet in a float32 ``workspace`` (CTAs, tile_m * tile_n) (``GemmConfig.stream_k_workspace``),
    each announced by its Int32 ``flags`` (CTAs,) entry, zeros on entry; the segment owning a
    tile adds them and runs the epilogue (:meth:`fix_up`), so c is written once, in its dtype, with
    no zeros to add into and no cast after.

    ``sums`` ("a" or "b"): also the sums of that operand over the contraction, added into a float32
    (M, L) or (N, L) tensor (``sums``, zeros for a plain sum): a weight gradient's bias gradient,
    the column sums of dz (B of ``xᵀ @ dz``; A of ``dzᵀ @ x``) -- see :meth:`sum_operand`.
    """

    def __init__(self, config: GemmConfig, epilogue: Epilogue, accumulate: bool = False, stream_k: bool = False,
                 planes: Planes = Planes(), sums: str | None = None):
        self.config, self.epilogue, self.accumulate, self.stream_k = config, epilogue, accumulate, stream_k
        self.planes, self.sums = planes, sums
        if sums not in OPERAND_SUMS:
            raise ValueError(f"sums must be one of {OPERAND_SUMS}; got {sums!r}")
        if sums is not None and planes.summed:
            raise ValueError("operand sums take planes that are not summed into one output")
        if planes.c == "split" and (epilogue.has_source or epilogue.store_preact):
            raise ValueError("split outputs take an epilogue without source tiles or a stored pre-activation")
        if planes.summed and (stream_k or epilogue.has_bias):
            raise ValueError("summed planes take no stream-K and no bias")
        self.fixup = stream_k and not accumulate  # stream-K's partial tiles meet in a workspace
        if self.fixup and epilogue.has_source:
            raise ValueError("stream-K without accumulate stores only its tiles' owning segments: no source tile")
        if stream_k and config.pingpong:
            raise ValueError("stream_k takes a cooperative (not pingpong) config")
        if accumulate and epilogue != Epilogue():
            raise ValueError("accumulate takes a plain epilogue (c += A @ Bᵀ by TMA)")
        if epilogue.exp_row_sums and (stream_k or planes != Planes() or sums is not None or config.split_k > 1):
            raise ValueError("an exp_row_sums epilogue takes no stream-K, planes, operand sums or split-K")
        self.tile_mnk = (config.tile_m, config.tile_n, config.tile_k)
        if config.consumer_warpgroups not in (1, 2):
            raise ValueError("consumer_warpgroups must be 1 or 2")
        if config.pingpong and config.consumer_warpgroups != 2:
            raise ValueError("pingpong alternates two consumer warpgroups: consumer_warpgroups must be 2")
        if config.tile_m % (64 * config.mma_warpgroups):
            raise ValueError("tile_m must be a multiple of 64 rows per warpgroup sharing a tile (wgmma's M)")
        if config.tile_n not in (64, 128, 192, 256):  # whole 64-column epilogue subtiles
            raise ValueError("tile_n must be 64, 128, 192 or 256")
        if config.cluster_m * config.cluster_n > 2 or min(config.cluster_m, config.cluster_n) < 1:
            raise ValueError("cluster shape must be 1x1, 2x1 or 1x2")
        if epilogue.gated and ((epilogue.grad_of == "none" and config.tile_n not in (128, 256)) or planes != Planes()
                               or accumulate or stream_k or sums is not None):
            raise ValueError("a gated epilogue takes (forward) tile_n 128 or 256 (whole 64-column subtiles of each "
                             "half), and no planes, accumulation, stream-K or operand sums")
        if config.split_k not in SPLIT_K:
            raise ValueError(f"split_k must be one of {SPLIT_K}; got {config.split_k}")
        if config.split_k > 1 and (stream_k or accumulate or sums is not None or planes != Planes()
                                   or config.pingpong
                                   or config.consumer_warpgroups != 1 or config.cluster_m * config.cluster_n != 1):
            raise ValueError("split_k takes one consumer warpgroup, no cluster of its own, no stream-K, "
                             "accumulation, operand sums or planes")

    @cute.jit
    def __call__(self, stream, *tensors):
        epilogue, config = self.epilogue, self.config
        planes = self.planes
        rest = list(tensors)

        def take(how):
            """The next operand: a tuple of its planes' buffers if split."""
            if const_expr(how == "split"):
                return tuple(rest.pop(0) for _ in range(planes.count))
            return rest.pop(0)

        a_in = take(planes.a)
        b_in = take(planes.b)
        bias = rest.pop(0) if const_expr(epilogue.has_bias) else None
        source = rest.pop(0) if const_expr(epilogue.has_source) else None
        sums = rest.pop(0) if const_expr(self.sums is not None) else None
        flags = rest.pop(0) if const_expr(self.fixup) else None
        fix_rows = None
        if const_expr(epilogue.exp_fix_rows):
            c_in = rest.pop(0)  # the first pass's c, written in place
            fix_rows = tuple(rest.pop(0) for _ in range(3))  # the rows' flags, labels and shifts
        else:
            c_in = take(planes.c)
        second = rest.pop(0) if const_expr(epilogue.second_output) else None  # preact | hidden
        workspace = rest.pop(0) if const_expr(self.fixup) else None
        row_sums = rest.pop(0) if const_expr(epilogue.exp_row_sums) else None
        if const_expr(epilogue.exp_fix_rows):
            fix_rows = fix_rows + (rest.pop(0), rest.pop(0))  # + the blocks' max and label entries
        a, b, c = (x[0] if const_expr(isinstance(x, tuple)) else x for x in (a_in, b_in, c_in))
        summed = {None: None, "a": a_in, "b": b_in}[self.sums]  # the operand the summing warps read
        # The tiles' N: c's columns, or for a gated layer (whose tile covers another width of c)
        # the columns of its B.
        c_n = c.shape[1]
        if const_expr(self.c_columns != config.tile_n):
            c_n = c.shape[1] * config.tile_n // self.c_columns

        if const_expr(a.element_type != b.element_type or a.element_type not in (BFloat16, Float16)):
            raise ValueError(f"a and b take one dtype, bfloat16 or float16; got a {a.element_type}, "
                             f"b {b.element_type}")
        require_n_major("c", c_in)
        require_n_major("residual" if const_expr(epilogue.has_residual) else "preact_in", source)
        require_n_major("preact" if const_expr(epilogue.store_preact) else "hidden", second)
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        self.stages = config.stages_for(a.element_type.width // 8, c.element_type.width // 8, epilogue.has_source)
        if const_expr(self.stages < 2):  # a k tile's stage is released once the next one's is waited for
            raise ValueError(f"{config} leaves {self.stages} mainloop stage(s) beside its epilogue's rings "
                             "(at least 2 needed): stages of at least 2, or a smaller tile")
        a_layout = LayoutEnum.from_tensor(a)
        b_layout = LayoutEnum.from_tensor(b)
        c_layout = LayoutEnum.from_tensor(c)
        tiled_mma = sm90.make_trivial_tiled_mma(
            a.element_type, b.element_type, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            Float32, (config.mma_warpgroups, 1, 1), tiler_mn=(64, config.tile_n),
        )
        a_smem = sm90.make_smem_layout_a(a_layout, self.tile_mnk, a.element_type, self.stages)
        b_smem = sm90.make_smem_layout_b(b_layout, self.tile_mnk, b.element_type, self.stages)
        epi_tile = config.epi_tile(c.element_type.width // 8)
        groups = config.epilogue_groups
        epi_smem = sm90.make_smem_layout_epi(c.element_type, c_layout, epi_tile, EPI_STAGES * groups)
        source_smem = sm90.make_smem_layout_epi(c.element_type, c_layout, epi_tile, SOURCE_STAGES * groups)

        # A 16-bit bias of even length is read two columns a 32-bit word: one bf16 load a column
        # had ptxas hoist a thread's 48 loads ahead of the adds and spill to hold them (128 x 192
        # pingpong tiles: docs/gemm_notes.md, fifty-first session).
        self.bias_words = (epilogue.has_bias and bias.element_type.width == 16
                           and cute.size(bias, mode=[0]) % 2 == 0)
        if const_expr(self.bias_words):
            self.bias_dtype = bias.element_type
            bias = cute.recast_tensor(bias, Int32)
        if const_expr(self.paired):
            c_in, c = (self.gated_view(c, 1, config.tile_n),) * 2
            source = self.gated_view(source, 1, config.tile_n)
        elif const_expr(epilogue.gated):
            b_in = self.gated_view(b_in, 0, config.tile_n // 2)
            if const_expr(epilogue.has_bias):
                bias = self.gated_view(bias, 0, config.tile_n // (4 if self.bias_words else 2))
            second = self.gated_view(second, 1, config.tile_n // 2) if const_expr(epilogue.store_preact) else None
        # A is shared by the cluster_n CTAs of a cluster row, B by the cluster_m of a column.
        tma_a, tma_tensor_a = self.load_atom(a_in, a_smem, (config.tile_m, config.tile_k), config.cluster_n)
        self.row_boxes = (config.tile_m == 64 and config.cluster_n == 1 and planes.a != "split"
                          and a_layout.sm90_mma_major_mode() == warpgroup.OperandMajorMode.K)
        tma_a_rows, tma_tensor_a_rows = None, None
        if const_expr(self.row_boxes):
            # the first ROW_BOX rows of a stage: every box of the stage has its layout (a whole
            # swizzle atom further on)
            box_smem = cute.composition(cute.slice_(a_smem, (None, None, 0)),
                                        (cute.make_layout(ROW_BOX), cute.make_layout(config.tile_k)))
            tma_a_rows, tma_tensor_a_rows = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), a_in, box_smem, (ROW_BOX, config.tile_k))
        tma_b, tma_tensor_b = self.load_atom(b_in, b_smem, (config.tile_n, config.tile_k), config.cluster_m)
        # accumulate: the TMA unit adds each tile into c (a running sum such as the LM head's
        # dkernel over token chunks, or stream-K partials into zeros: the decode forward's).
        store = cpasync.CopyReduceBulkTensorTileS2GOp() if const_expr(
            self.accumulate) else cpasync.CopyBulkTensorTileS2GOp()
        epi_smem_one = cute.slice_(epi_smem, (None, None, 0))
        tma_c, tma_tensor_c = per_plane(lambda t: cpasync.make_tiled_tma_atom(store, t, epi_smem_one, epi_tile), c_in)
        tma_z, tma_tensor_z = None, None  # the second output's
        if const_expr(epilogue.second_output):
            tma_z, tma_tensor_z = cpasync.make_tiled_tma_atom(store, second, epi_smem_one, epi_tile)
        tma_s, tma_tensor_s = None, None
        if const_expr(epilogue.has_source):
            tma_s, tma_tensor_s = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), source, cute.slice_(source_smem, (None, None, 0)), epi_tile)

        source_elems = cute.cosize(source_smem) if const_expr(epilogue.has_source) else 1

        # Shared memory, in this order; split-K adds the partial tiles its cluster's first CTA
        # receives, and their barrier.
        split = config.split_k > 1
        fields = {"barriers": cute.struct.MemRange[cutlass.Int64, self.stages * 2],
                  "source_barriers": cute.struct.MemRange[cutlass.Int64, SOURCE_STAGES * groups * 2]}
        if const_expr(split):
            fields["partials_barrier"] = cute.struct.MemRange[cutlass.Int64, 1]
        if const_expr(epilogue.exp_fix_rows):
            fields["flagged_warps"] = cute.struct.MemRange[Int32, config.threads // 32]  # any_flagged_row
        fields["sa"] = cute.struct.Align[cute.struct.MemRange[a.element_type, cute.cosize(a_smem)], 1024]
        fields["sb"] = cute.struct.Align[cute.struct.MemRange[b.element_type, cute.cosize(b_smem)], 1024]
        fields["sc"] = cute.struct.Align[cute.struct.MemRange[c.element_type, cute.cosize(epi_smem)], 1024]
        if const_expr(split):
            fields["partials"] = cute.struct.Align[cute.struct.MemRange[Float32, config.partial_bytes // 4], 1024]
        fields["ss"] = cute.struct.Align[cute.struct.MemRange[c.element_type, source_elems], 1024]
        self.shared_storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        # Work units of the persistent scheduler: output tiles x batch (see ``work_unit``).
        # split outputs: one per plane; summed planes: one output of L = 1
        batches = planes.count if const_expr(planes.c == "split") else c.shape[2]
        tiles = (cute.ceil_div(c.shape[0], config.tile_m), cute.ceil_div(c_n, config.tile_n), batches)
        schedule = utils.PersistentTileSchedulerParams(
            tiles, (config.cluster_m, config.cluster_n, 1), self.raster_group(c_n), True
        )
        clusters_per_wave = PERSISTENT_SMS // (config.cluster_m * config.cluster_n)
        cluster = (config.cluster_m, config.cluster_n, 1)
        if const_expr(self.stream_k):
            grid = (config.cluster_m, config.cluster_n, clusters_per_wave)  # every cluster takes a chunk
        elif const_expr(config.split_k > 1):
            grid = (config.split_k, 1, tiles[0] * tiles[1] * tiles[2])  # a cluster a tile
            cluster = (config.split_k, 1, 1)
        else:
            grid = balanced_grid(schedule, clusters_per_wave)
        self.kernel(
            tiled_mma, tma_a, tma_tensor_a, tma_a_rows, tma_tensor_a_rows, tma_b, tma_tensor_b,
            tma_c, tma_tensor_c, tma_z, tma_tensor_z, tma_s, tma_tensor_s, bias, sums, summed, flags,
            workspace, row_sums, fix_rows, a_smem, b_smem, epi_smem, source_smem, epi_tile, schedule,
            (c.shape[0], c_n, batches),
        ).launch(
            grid=grid,
            block=[config.threads, 1, 1],
            cluster=cluster,
            min_blocks_per_mp=1,
            smem=self.shared_storage.size_in_bytes(),
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

    @staticmethod
    def gated_view(tensor, mode: int, block: int):
        """``tensor`` with its ``mode`` (a gated layer's 2H columns: gate, then value) as (block, 2,
        H / block): columns [n, n + 1) * block of each half, the gate's first, are its n-th
        2 * block (a forward tile: block = tile_n / 2; a backward one reads and writes 2 *
        tile_n). H must be a multiple of ``block`` (the op checks)."""
        shape, stride = tensor.layout.shape, tensor.layout.stride
        width, step = shape[mode] // 2, stride[mode]
        blocks = ((block, 2, width // block),)
        steps = ((step, width * step, block * step),)
        return cute.make_tensor(tensor.iterator, cute.make_layout(
            shape[:mode] + blocks + shape[mode + 1:], stride=stride[:mode] + steps + stride[mode + 1:]))

    def load_atom(self, tensor, smem_staged, tile, multicast: int):
        """TMA load atom for one operand (per plane if split), multicast to ``multicast`` CTAs when
        above 1."""
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if multicast > 1 else cpasync.CopyBulkTensorTileG2SOp()
        return per_plane(lambda t: cpasync.make_tiled_tma_atom(
            op, t, cute.slice_(smem_staged, (None, None, 0)), tile, num_multicast=multicast), tensor)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a,  # CopyAtom, or a tuple of them per plane when split (so are the tensors)
        tma_tensor_a,
        tma_a_rows,  # A's (ROW_BOX, tile_k) boxes (``row_boxes``), or None
        tma_tensor_a_rows,
        tma_b,
        tma_tensor_b,
        tma_c,
        tma_tensor_c,
        tma_z,
        tma_tensor_z,
        tma_s,
        tma_tensor_s,
        bias,
        sums,
        summed,  # the operand ``sums`` adds up, as given (a tuple of planes if split), or None
        flags,  # stream-K's workspace: its ready flags and partial tiles (``fix_up``), or None
        workspace,
        row_sums,  # exp_row_sums' (M, N / ROW_SUM_BLOCK, L) float32 result, or None
        fix_rows,  # exp_fix_rows' (flags, labels, shifts, block max, label entries), or None; the
        # prologue adds whether any row is flagged
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
        source_smem: cute.ComposedLayout,
        epi_tile: cutlass.Constexpr,
        schedule: utils.PersistentTileSchedulerParams,
        c_shape,
    ):
        config, epilogue, planes = self.config, self.epilogue, self.planes
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp == 0:
            for atom in as_planes(tma_a) + as_planes(tma_b):
                cpasync.prefetch_descriptor(atom)

        # --- cluster position, shared memory and the pipelines ----------------------------------
        split = config.split_k
        cluster_layout = cute.make_layout((config.cluster_m, config.cluster_n, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        # a split-K cluster's CTAs share their tile: each loads its own k tiles, unicast
        cluster_coord = (0, 0, 0) if const_expr(split > 1) else cluster_layout.get_flat_coord(rank)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        if const_expr(split > 1):
            if tidx == 0:
                cute.arch.mbarrier_init(storage.partials_barrier.data_ptr(), 1)
        sa = storage.sa.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sb = storage.sb.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sc = storage.sc.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        stage_bytes = cute.size_in_bytes(self.a_dtype, cute.slice_(a_smem, (None, None, 0))) + \
            cute.size_in_bytes(self.b_dtype, cute.slice_(b_smem, (None, None, 0)))
        mma_threads = WARPGROUP * config.mma_warpgroups  # threads that consume one stage
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # Every consumer thread releases a stage; the pipeline turns that into one arrive per
            # warp and multicast partner CTA.
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_threads),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, config.cluster_m, config.cluster_n, 1)),
            enable_multicast_signaling=True,
            defer_sync=True,
        )
        # The source rings of all epilogue groups: group g owns stages [g, g + 1) * SOURCE_STAGES
        # (see ``group_state``), each consumed by the group's own threads.
        sources = None
        if const_expr(epilogue.has_source):
            sources = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.source_barriers.data_ptr(),
                num_stages=SOURCE_STAGES * config.epilogue_groups,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_threads),
                tx_count=cute.size_in_bytes(self.c_dtype, cute.slice_(source_smem, (None, None, 0))),
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                enable_multicast_signaling=True,
                defer_sync=True,
            )
        cluster_mn = (config.cluster_m, config.cluster_n)
        # split-K: every CTA's barriers initialized before any peer sends it a partial tile
        sync_mn = (split, 1) if const_expr(split > 1) else cluster_mn
        pipeline.pipeline_init_arrive(cluster_shape_mn=sync_mn, is_relaxed=True)
        if const_expr(fix_rows is not None):
            fix_rows = fix_rows + (self.any_flagged_row(fix_rows[0], c_shape[0], storage, tidx, warp),)

        # (tile, tile_k, tiles, k tiles, L) views of A and B (per plane if split), split for
        # (multicast) TMA.
        a_parts = self.load_partitions(tma_a, tma_tensor_a, sa, (None, 0, None), cluster_coord[1], config.cluster_n)
        a_box_parts = None
        if const_expr(self.row_boxes):
            a_box_parts = self.row_box_partitions(tma_a_rows, tma_tensor_a_rows, sa)
        b_parts = self.load_partitions(tma_b, tma_tensor_b, sb, (0, None, None), cluster_coord[0], config.cluster_m)
        k_tiles = cute.size((a_parts[0] if const_expr(planes.a == "split") else a_parts)[1], mode=[2])
        # A tile's steps: its k tiles, in every plane when the planes are summed.
        tile_steps = k_tiles * planes.count if const_expr(planes.summed) else k_tiles

        pipeline.pipeline_init_wait(cluster_shape_mn=sync_mn)
        if const_expr(split > 1):
            scheduler = SplitKScheduler.create(c_shape, (config.tile_m, config.tile_n), tile_steps, split, rank)
        elif const_expr(self.stream_k):
            scheduler = StreamKScheduler.create(c_shape, (config.tile_m, config.tile_n), cluster_mn,
                                                cluster_coord, tile_steps)
        else:
            scheduler = utils.StaticPersistentTileScheduler.create(
                schedule, cute.arch.block_idx(), cute.arch.grid_dim())

        if warp < 4:
            # --- producer warpgroup: warp 0 streams A and B for every tile of this CTA -----------
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp == 0:
                a_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=1)
                b_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=0)
                producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                work = scheduler.initial_work_tile_info()
                if const_expr(fix_rows is not None):
                    scheduler, work = self.skip_unflagged(scheduler, work, fix_rows, c_shape[0])
                while work.is_valid_tile:
                    m, n, batch, k0, k_count = self.work_unit(work.tile_idx, tile_steps)
                    for kk in cutlass.range(k_count, unroll=1):
                        k = k0 + kk
                        if const_expr(self.stream_k):
                            k = k % tile_steps  # a rotated segment wraps past the last k tile
                        plane = batch
                        if const_expr(planes.summed):
                            plane = k // k_tiles
                            k = k - plane * k_tiles
                        loads.producer_acquire(producer)
                        barrier = loads.producer_get_barrier(producer)
                        if const_expr(self.row_boxes):
                            self.load_a_rows(tma_a, a_parts, tma_a_rows, a_box_parts, m, k, plane, c_shape[0],
                                             producer.index, barrier)
                        else:
                            self.load_tile(tma_a, a_parts, planes.a, m, k, plane, producer.index, barrier,
                                           a_mask if const_expr(config.cluster_n > 1) else 0)
                        self.load_tile(tma_b, b_parts, planes.b, n, k, plane, producer.index, barrier,
                                       b_mask if const_expr(config.cluster_m > 1) else 0)
                        loads.producer_commit(producer)
                        producer.advance()
                    scheduler, work = self.next_work(scheduler, fix_rows, c_shape[0], 1)
                # Keep this CTA alive until every partner has released the stages it fed.
                loads.producer_tail(producer)
            if const_expr(self.sums is not None):
                if warp >= 1 and warp <= SUM_WARPS:
                    self.sum_operand(summed, sums, warp - 1)
        else:
            # --- consumer warpgroups: mainloop and epilogue per tile ----------------------------
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            ctidx = tidx - WARPGROUP
            # The epilogue group this thread belongs to (pingpong: its warpgroup) and its rank in it.
            group = cute.arch.make_warp_uniform(ctidx // mma_threads) if const_expr(config.pingpong) else 0
            gtidx = ctidx % mma_threads
            store_warp = cute.arch.make_warp_uniform(gtidx // 32) == 0  # the group's first warp sends
            # The warpgroup's index made warp-uniform: its A descriptors (a 64-row slice of the
            # stage) are then built in uniform registers.
            mma_warpgroup = 0
            if const_expr(config.mma_warpgroups > 1):
                mma_warpgroup = cute.arch.make_warp_uniform(gtidx // WARPGROUP)
            thr_mma = tiled_mma.get_slice(
                cute.make_layout(config.mma_warpgroups, stride=WARPGROUP)(mma_warpgroup))
            frag_a = tiled_mma.make_fragment_A(thr_mma.partition_A(sa))
            frag_b = tiled_mma.make_fragment_B(thr_mma.partition_B(sb))
            # wgmma operands are per warpgroup, but each thread holds its own accumulators: their
            # coordinates (for the bias) come from the thread's own slice.
            tile_coords_c = tiled_mma.get_slice(gtidx).partition_C(
                cute.make_identity_tensor((config.tile_m, config.tile_n)))
            acc = cute.make_rmem_tensor(tile_coords_c.shape, Float32)
            k_blocks = cute.size(frag_a, mode=[2])
            consumer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            released = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

            ring = self.epilogue_ring(tiled_mma, sc, storage, source_smem, gtidx) + (sc,)  # + the store ring
            stores = pipeline.PipelineTmaStore.create(
                num_stages=EPI_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, mma_threads),
            )
            source_loaded = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, SOURCE_STAGES)
            source_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, SOURCE_STAGES)
            stores_per_tile = self.out_tiles(epi_tile) + (self.epi_tiles(epi_tile) if const_expr(epilogue.second_output) else 0)
            tiles_done = Int32(0)
            work = scheduler.initial_work_tile_info()
            if const_expr(fix_rows is not None):
                scheduler, work = self.skip_unflagged(scheduler, work, fix_rows, c_shape[0])
            if const_expr(config.pingpong):
                # Warpgroup 1 takes the odd tiles: it starts one tile (and its stages) later, and
                # lets warpgroup 0 take the first mainloop turn.
                if const_expr(fix_rows is None):
                    scheduler.advance_to_next_work(advance_count=group)
                    work = scheduler.get_current_work()
                elif group == 1:
                    scheduler, work = self.next_work(scheduler, fix_rows, c_shape[0], 1)
                consumer.advance(tile_steps * group)
                released.advance(tile_steps * group)
                if group == 1:
                    cute.arch.barrier_arrive(barrier_id=MMA_TURN_BARRIER, number_of_threads=2 * WARPGROUP)
            while work.is_valid_tile:
                m, n, batch, _, k_count = self.work_unit(work.tile_idx, tile_steps)
                tile_idx = (m, n, batch)
                # A cluster's padding tile (past the output) is computed but not stored: along a
                # static extent of one tile its coordinate aliases tile 0 (a size-1 mode has
                # stride 0), and an accumulating store would add that tile twice.
                inside = (m * config.tile_m < c_shape[0]) & (n * config.tile_n < c_shape[1])
                if const_expr(split > 1):
                    inside = inside & (rank == 0)  # the cluster's first CTA stores the summed tile
                if const_expr(epilogue.has_source):
                    # The tile's first source subtiles load while its mainloop runs.
                    for e in cutlass.range_constexpr(min(SOURCE_STAGES, self.out_tiles(epi_tile))):
                        source_loaded = self.load_source(sources, group, source_loaded, ring[5], tma_s,
                                                         tma_tensor_s, tile_idx, epi_tile, e, store_warp)
                if const_expr(config.pingpong):
                    # Mainloops take turns: a warpgroup waits for stages only after the other has
                    # waited for all of its own, so no stage barrier is awaited two phases ahead
                    # (its parity could not tell those phases apart).
                    cute.arch.barrier(barrier_id=MMA_TURN_BARRIER + group, number_of_threads=2 * WARPGROUP)
                # The tile's first k tile runs with ACCUMULATE off (peeled, so the flag is static
                # in the loop); ``pin_zeros`` says why the accumulators are set all the same.
                pin_zeros(acc)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                if k_count > 0:
                    consumer, released = self.mma_k_tile(tiled_mma, acc, frag_a, frag_b, k_blocks, loads, consumer,
                                                         released, True)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                # Set in the branch (the DSL's dynamic if must leave the MMA state the same on both
                # paths: without it no valid IR) and again here, so the loop sees a static True,
                # not a select on k_count.
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                for k in cutlass.range(1, k_count, unroll=1):
                    consumer, released = self.mma_k_tile(tiled_mma, acc, frag_a, frag_b, k_blocks, loads, consumer,
                                                         released, False)
                if const_expr(config.pingpong):
                    cute.arch.barrier_arrive(barrier_id=MMA_TURN_BARRIER + 1 - group,
                                             number_of_threads=2 * WARPGROUP)
                # No k tile (a split-K rank's empty share, an empty contraction) leaves the
                # accumulators unwritten: zeros. Only once no wgmma is in flight (reading them
                # while one is made ptxas serialize the wgmmas: C7514).
                if const_expr(split > 1):
                    warpgroup.wait_group(0)
                    if k_count > 0:  # a split-K rank may have no k tiles: no stage to release
                        loads.consumer_release(released)
                        released.advance()
                    if k_count == 0:
                        acc.fill(0.0)
                    self.gather_partials(acc, storage, rank, gtidx)
                else:
                    warpgroup.wait_group(0)
                    loads.consumer_release(released)
                    released.advance()
                    if k_count == 0:
                        acc.fill(0.0)
                owns = True  # whether this CTA stores the tile
                if const_expr(self.fixup):
                    owns = self.fix_up(acc, scheduler, flags, workspace, rank, gtidx)

                # The source ring's states are assigned here so that the loop carries them to the
                # next tile: the DSL carries what a loop body assigns or calls a method of, not
                # what it only passes to a call (they restarted every tile, which a ring walked an
                # odd number of times per tile -- 2 or 6 subtiles, 2 buffers -- got wrong: a hang).
                if owns:
                    source_loaded, source_read = self.epilogue_tile(
                        acc, tile_coords_c, tile_idx, ring, sources, group, source_loaded, source_read, tma_c,
                        tma_tensor_c, tma_z, tma_tensor_z, tma_s, tma_tensor_s, bias, row_sums, fix_rows, c_shape,
                        epi_tile, stores, store_warp, inside, tiles_done * stores_per_tile, gtidx)
                    tiles_done += 1
                if const_expr(config.pingpong):
                    # Past the other warpgroup's next tile and its stages.
                    consumer.advance(tile_steps)
                    released.advance(tile_steps)
                    scheduler, work = self.next_work(scheduler, fix_rows, c_shape[0], 2)
                else:
                    scheduler, work = self.next_work(scheduler, fix_rows, c_shape[0], 1)
            if store_warp:
                stores.producer_tail()

    @cute.jit
    def next_work(self, scheduler, fix_rows, rows, count: cutlass.Constexpr):
        """(scheduler, its work) ``count`` works on in this CTA's sequence; with ``fix_rows``
        (exp_fix_rows) counting only the tiles :meth:`skip_unflagged` keeps, which the producer
        and every consumer warpgroup then walk alike."""
        if const_expr(fix_rows is None):
            if const_expr(count == 1):  # stream-K's and split-K's schedulers step one at a time
                scheduler.advance_to_next_work()
            else:
                scheduler.advance_to_next_work(advance_count=count)
            work = scheduler.get_current_work()
        else:
            for _ in cutlass.range_constexpr(count):
                scheduler.advance_to_next_work()
                work = scheduler.get_current_work()
                scheduler, work = self.skip_unflagged(scheduler, work, fix_rows, rows)
        return scheduler, work

    @cute.jit
    def skip_unflagged(self, scheduler, work, fix_rows, rows):
        """(scheduler, its work) moved on from ``work`` to the first tile, ``work``'s own
        included, that holds a row whose int32 flags (M, 1, 1) entry ``fix_rows[0]`` is not 0 (or
        past the last tile): exp_fix_rows' pass runs only those. When no row is flagged
        (``fix_rows[-1]``, :meth:`any_flagged_row`) there is no such tile."""
        flags = fix_rows[0]
        work = utils.WorkTileInfo(work.tile_idx, work.is_valid_tile & fix_rows[-1])
        searching = work.is_valid_tile & self.no_flagged_row(work, flags, rows)
        while searching:
            scheduler.advance_to_next_work()
            work = scheduler.get_current_work()
            searching = work.is_valid_tile & self.no_flagged_row(work, flags, rows)
        return scheduler, work

    @cute.jit
    def any_flagged_row(self, flags, rows, storage, tidx, warp):
        """Whether any of the ``rows`` int32 ``flags`` (M, 1, 1) is not 0: every thread of the CTA
        reads its share (FLAG_SCAN_LOADS loads in flight at a time), each warp's vote goes to
        shared memory, and after a barrier of the whole CTA each thread ORs the warps'. It spares
        the common launch -- no row flagged -- a walk over the flags of each of its tiles (one
        load's latency a tile: tens of microseconds a launch)."""
        threads = self.config.threads
        found = Int32(0)
        for base in cutlass.range(0, rows, threads * FLAG_SCAN_LOADS, unroll=1):
            for j in cutlass.range_constexpr(FLAG_SCAN_LOADS):
                row = base + j * threads + tidx
                found = found | self.row_flag(flags, row, rows)
        voted = storage.flagged_warps.get_tensor(cute.make_layout(threads // 32))
        in_warp = cutlass.select_(cute.arch.vote_any_sync(found != Int32(0)), Int32(1), Int32(0))  # every lane votes
        if cute.arch.lane_idx() == 0:
            voted[warp] = in_warp
        cute.arch.barrier()
        flagged = Int32(0)
        for w in cutlass.range_constexpr(threads // 32):
            flagged = flagged | voted[w]
        return flagged != Int32(0)

    @cute.jit
    def no_flagged_row(self, work, flags, rows):
        """Whether no row of ``work``'s tile is flagged -- of the tiles of its cluster along M,
        which share B's multicast loads and so must run or skip together. A warp's vote: every
        lane of the warp calls it. ``rows`` (M) >= 1."""
        config = self.config
        m = work.tile_idx[0]
        if const_expr(config.cluster_m > 1):
            m = m - m % config.cluster_m
        lane = cute.arch.lane_idx()
        found = Int32(0)
        for j in cutlass.range_constexpr(config.tile_m * config.cluster_m // 32):
            row = m * config.tile_m + lane + 32 * j
            found = found | self.row_flag(flags, row, rows)
        return cute.arch.vote_all_sync(found == Int32(0))

    @cute.jit
    def row_flag(self, flags, row, rows):
        """The int32 ``flags`` (M, 1, 1) entry of ``row``, 0 past the ``rows`` (M >= 1): read
        clamped to the last row, so no load leaves the tensor."""
        return cutlass.select_(row < rows, flags[(cutlass.min(row, rows - 1), 0, 0)], Int32(0))

    @cute.jit
    def mma_k_tile(self, tiled_mma, acc, frag_a, frag_b, k_blocks: cutlass.Constexpr, loads, consumer, released,
                   first: cutlass.Constexpr):
        """One k tile of the consumer's mainloop: wait for the stage ``consumer`` stands at and
        issue its wgmma batch into ``acc``. The tile's ``first`` k tile runs with the caller's
        ACCUMULATE off, which its first wgmma turns on (the caller sets it too: ``set`` makes a new
        value, which a dynamic region carries out only where the caller's body sets it); every
        other k tile then releases the stage of the batch before once that batch has finished.
        Returns the advanced (consumer, released) states: the caller assigns them, which makes a
        dynamic loop carry them.

        The stage index is made warp-uniform and, with the warpgroup index (see the kernel), every
        wgmma descriptor is built in uniform registers -- a ULEA and a UIADD3 per wgmma, as cuBLAS
        steps them -- where they were rebuilt in vector registers every k tile (IMAD / LEA / LOP3)
        and moved over with R2UR. The fence before every batch, as CUTLASS issues it, keeps ptxas
        from injecting one of its own (C7519), which serialized the wgmmas (C7520)."""
        loads.consumer_wait(consumer)
        warpgroup.fence()
        stage = cute.arch.make_warp_uniform(consumer.index)
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, frag_a[(None, None, kb, stage)], frag_b[(None, None, kb, stage)], acc)
            if const_expr(first):
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        consumer.advance()
        if const_expr(not first):
            # The batch before this one has finished reading its stage: release it.
            warpgroup.wait_group(1)
            loads.consumer_release(released)
            released.advance()
        return consumer, released

    @cute.jit
    def gather_partials(self, acc, storage, rank, gtidx):
        """Split-K: the cluster's CTAs past the first send their float32 partial tile into the
        first one's shared memory (``st.async``, four accumulators at a time, counted by its
        barrier), which waits for all of them and adds them to its own accumulators. Slot
        ``((r - 1) * quads + q) * threads + thread`` holds thread's q-th four values from rank r:
        consecutive threads write consecutive 16 bytes."""
        config = self.config
        threads = WARPGROUP * config.mma_warpgroups
        quads = cute.size(acc) // 4
        partials = storage.partials.get_tensor(cute.make_layout(config.partial_bytes // 4))
        barrier = storage.partials_barrier.data_ptr()
        if rank == 0:
            if gtidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(barrier, config.partial_bytes)
            cute.arch.mbarrier_wait(barrier, 0)
            for r in cutlass.range_constexpr(config.split_k - 1):
                for q in cutlass.range_constexpr(quads):
                    base = ((r * quads + q) * threads + gtidx) * 4
                    for j in cutlass.range_constexpr(4):
                        acc[4 * q + j] = acc[4 * q + j] + partials[base + j]
        else:
            four = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            bits = cute.recast_tensor(four, Int32)
            for q in cutlass.range_constexpr(quads):
                for j in cutlass.range_constexpr(4):
                    four[j] = acc[4 * q + j]
                base = cute.assume((((rank - 1) * quads + q) * threads + gtidx) * 4, divby=4)
                cute.arch.store_async_dsmem(partials.iterator + base, (bits[0], bits[1], bits[2], bits[3]),
                                            barrier, 0)

    @cute.jit
    def fix_up(self, acc, scheduler, flags, workspace, rank, gtidx):
        """Stream-K without accumulation, after a segment's mainloop: a *partial* segment (see
        :meth:`StreamKScheduler.fixup_role`) writes its float32 tile to this CTA's workspace slot
        and raises the slot's flag; the tile's owner waits for the flags of the later clusters
        that hold the rest of its tile and adds their partials (same rank in the cluster: the
        same part of the tile). Returns whether this CTA stores the tile (it owns it).

        Slot ``cluster * cluster size + rank`` holds thread t's q-th four accumulators at
        ``(q * threads + t) * 4``: consecutive threads move consecutive 16 bytes. The data moves
        with ``.cg`` (L2, not the SM's L1, where a line could be stale); a flag is stored with
        release semantics once every consumer thread has fenced its stores, and read with acquire
        semantics by one thread before a barrier lets the others read."""
        config = self.config
        threads = WARPGROUP * config.mma_warpgroups
        quads = cute.size(acc) // 4
        cluster_size = config.cluster_m * config.cluster_n
        elements = config.tile_m * config.tile_n
        vector = ir.VectorType.get([4], Float32.mlir_type)
        inner, first, end = scheduler.fixup_role()
        if inner > 0:
            slot = Int32(cute.arch.block_idx()[2]) * cluster_size + rank
            four = cute.make_rmem_tensor(cute.make_layout(4), Float32)
            for q in cutlass.range_constexpr(quads):
                for j in cutlass.range_constexpr(4):
                    four[j] = acc[4 * q + j]
                offset = cute.assume(slot * elements + (q * threads + gtidx) * 4, divby=4)
                cute.arch.store(workspace.iterator + offset, four.load(), cop="cg")
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(barrier_id=1, number_of_threads=threads)
            if gtidx == 0:
                cute.arch.store(flags.iterator + slot, Int32(1), sem="release", scope="gpu")
        else:
            if gtidx == 0:
                for cluster in cutlass.range(first, end, unroll=1):
                    if scheduler.chunk_start(cluster + 1) > scheduler.chunk_start(cluster):  # not empty
                        ready = Int32(0)
                        while ready == 0:
                            ready = cute.arch.load(flags.iterator + (cluster * cluster_size + rank), Int32,
                                                   sem="acquire", scope="gpu")
            cute.arch.barrier(barrier_id=1, number_of_threads=threads)
            for cluster in cutlass.range(first, end, unroll=1):
                if scheduler.chunk_start(cluster + 1) > scheduler.chunk_start(cluster):
                    slot = cluster * cluster_size + rank
                    for q in cutlass.range_constexpr(quads):
                        offset = cute.assume(slot * elements + (q * threads + gtidx) * 4, divby=4)
                        four = cute.TensorSSA(cute.arch.load(workspace.iterator + offset, vector, cop="cg"), (4,),
                                              Float32)
                        for j in cutlass.range_constexpr(4):
                            acc[4 * q + j] = acc[4 * q + j] + four[j]
        return inner == 0

    @cute.jit
    def sum_operand(self, summed, sums, sum_warp):
        """Summing warp ``sum_warp`` (of SUM_WARPS in each CTA): ``sums[e, l] += sum over k of
        summed[e, k, l]``, the operand (E, K, L) read from global memory, E contiguous.

        The work is cut into units of (batch l, a block of 32 * SUM_VECTOR contiguous elements of
        E, a run of rows of K) -- about one per summing warp of the grid -- that the warps take in
        turn; a lane loads SUM_VECTOR contiguous elements of a row at once, adds them in float32,
        and adds its sums into ``sums`` with float32 atomics at the end of a unit. These warps
        idle otherwise (only warp 0 issues TMA) and the GEMM is bound by its tensor cores, not by
        memory, so the extra read of the operand costs the kernel little; reading the pipeline's
        shared-memory stages instead would compete with wgmma for shared-memory bandwidth and hold
        up the stages' release."""
        planes = as_planes(summed)
        first = planes[0]
        extent, rows = first.shape[0], first.shape[1]
        batches = len(planes) if const_expr(len(planes) > 1) else first.shape[2]
        block = 32 * SUM_VECTOR
        blocks = cute.ceil_div(extent, block)
        warps = cute.arch.grid_dim()[0] * cute.arch.grid_dim()[1] * cute.arch.grid_dim()[2] * SUM_WARPS
        runs = cutlass.max(warps // (batches * blocks), 1)  # row runs per (batch, block)
        run_rows = cute.ceil_div(rows, runs)
        bidx = cute.arch.block_idx()
        cta = bidx[0] + cute.arch.grid_dim()[0] * (bidx[1] + cute.arch.grid_dim()[1] * bidx[2])
        lane = cute.arch.lane_idx()
        totals = cute.make_rmem_tensor((SUM_VECTOR,), Float32)
        values = cute.make_rmem_tensor((SUM_VECTOR,), first.element_type)
        for unit in cutlass.range(cta * SUM_WARPS + sum_warp, batches * blocks * runs, warps, unroll=1):
            run = unit % runs
            rest = unit // runs
            column = (rest % blocks) * block + lane * SUM_VECTOR
            batch = rest // blocks
            totals.fill(0.0)
            if column < extent:
                for p in cutlass.range_constexpr(len(planes)):
                    if const_expr(len(planes) == 1) or batch == p:
                        source = planes[p]
                        plane_batch = batch if const_expr(len(planes) == 1) else 0
                        for row in cutlass.range(run * run_rows, cutlass.min(rows, (run + 1) * run_rows), unroll=4):
                            cute.autovec_copy(cute.local_tile(source[(None, row, plane_batch)], (SUM_VECTOR,),
                                                              (column // SUM_VECTOR,)), values)
                            for j in cutlass.range_constexpr(SUM_VECTOR):
                                totals[j] = totals[j] + values[j].to(Float32)
                # Four floats per atomic: every warp of the grid ends its unit at about the same
                # time, and the atomics of a narrow operand (768 columns: 132 warps a column) queue
                # on a few L2 slices -- what the sums cost the kernel, far more than the loads.
                quad = cute.make_rmem_tensor((4,), Float32)
                for q in cutlass.range_constexpr(SUM_VECTOR // 4):
                    for j in cutlass.range_constexpr(4):
                        quad[j] = totals[4 * q + j]
                    offset = cute.crd2idx((column + 4 * q, batch), sums.layout)
                    cute.arch.red(sums.iterator + offset, quad.load(), op="add", dtype="f32", sem="relaxed", scope="gpu")

    def load_partitions(self, tma, tma_tensor, smem, tile_modes, cluster_rank, multicast: int):
        """(smem destinations, (tile, tile_k, tiles, k tiles, L) global sources) of one operand's
        TMA loads -- a tuple of them per plane if split."""

        def partition(atom, tensor):
            g = cute.local_tile(tensor, cute.slice_(self.tile_mnk, tile_modes), (None, None, None))
            return cpasync.tma_partition(atom, cluster_rank, cute.make_layout(multicast),
                                         cute.group_modes(smem, 0, 2), cute.group_modes(g, 0, 2))

        if isinstance(tma, tuple):
            return tuple(partition(atom, tensor) for atom, tensor in zip(tma, tma_tensor))
        return partition(tma, tma_tensor)

    @cute.jit
    def load_tile(self, tma, parts, how: cutlass.Constexpr, row, k, plane, stage, barrier, mask):
        """TMA-load k tile ``k`` of row tile ``row`` of one operand, ``plane``'s, into ``stage``."""
        if const_expr(how == "split"):
            for p in cutlass.range_constexpr(self.planes.count):
                if plane == p:
                    s, g = parts[p]
                    cute.copy(tma[p], g[(None, row, k, 0)], s[(None, stage)], tma_bar_ptr=barrier, mcast_mask=mask)
        else:
            s, g = parts
            batch = 0 if const_expr(how == "shared") else plane
            cute.copy(tma, g[(None, row, k, batch)], s[(None, stage)], tma_bar_ptr=barrier, mcast_mask=mask)

    def row_box_partitions(self, tma, tma_tensor, sa):
        """(smem destinations (box, ROW_BOX boxes of a tile, stages), global sources (box, row boxes,
        k tiles, L)) of A's row-box loads (``row_boxes``)."""
        box = (ROW_BOX, self.config.tile_k)
        g = cute.local_tile(tma_tensor, box, (None, None, None))
        return cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(cute.flat_divide(sa, box), 0, 2),
                                     cute.group_modes(g, 0, 2))

    @cute.jit
    def load_a_rows(self, tma, parts, tma_rows, box_parts, row, k, plane, rows, stage, barrier):
        """TMA-load k tile ``k`` of A's row tile ``row`` into ``stage``, for a 64-row tile
        (``row_boxes``). A tile that crosses M (``rows``) comes in ROW_BOX-row boxes, only those
        that start inside M; the bytes of the rest complete the stage's barrier without a load
        (``mbarrier.complete_tx``), and their rows' outputs are never stored. So at most one
        ROW_BOX-row box crosses M, not a 64-row one: the whole tile's box took a 16-row decode
        step 14 us where 64 rows took 11 (H200, 16 x 4096 x 4096)."""
        batch = 0 if const_expr(self.planes.a == "shared") else plane
        per_tile = self.config.tile_m // ROW_BOX
        inside = rows - row * self.config.tile_m
        if inside >= self.config.tile_m:
            self.load_tile(tma, parts, self.planes.a, row, k, plane, stage, barrier, 0)
        else:
            s, g = box_parts
            for j in cutlass.range_constexpr(per_tile):
                if j * ROW_BOX < inside:
                    cute.copy(tma_rows, g[(None, row * per_tile + j, k, batch)], s[(None, j, 0, stage)],
                              tma_bar_ptr=barrier)
            skipped = per_tile - (inside + ROW_BOX - 1) // ROW_BOX
            box_bytes = ROW_BOX * self.config.tile_k * self.a_dtype.width // 8
            with cute.arch.elect_one():  # once for the warp, as the TMA copies are issued
                nvvm.mbarrier_complete_tx(barrier.llvm_ptr, Int32(skipped * box_bytes).ir_value())

    @cute.jit
    def work_unit(self, tile_idx, k_tiles):
        """(tile row, tile column, batch, first k tile, k tiles) of a scheduler's work: a whole
        tile from the persistent scheduler, a segment from stream-K's."""
        if const_expr(self.stream_k or self.config.split_k > 1):
            return tile_idx
        m, n, batch = tile_idx
        return m, n, batch, 0, k_tiles

    def epi_tiles(self, epi_tile) -> int:
        return (self.config.tile_m // epi_tile[0]) * (self.config.tile_n // epi_tile[1])

    @property
    def c_columns(self) -> int:
        """Columns of c (and of the source, the same shape where there is one) a tile covers:
        tile_n, half that for a gated layer's forward (act(gate) * value), twice for its backward
        (both halves of dz)."""
        tile_n = self.config.tile_n
        return tile_n // 2 if self.halved else 2 * tile_n if self.paired else tile_n

    def out_tiles(self, epi_tile) -> int:
        """Subtiles of c per tile -- and source subtiles a tile reads, where it reads any."""
        return (self.config.tile_m // epi_tile[0]) * (self.c_columns // epi_tile[1])

    @property
    def halved(self) -> bool:
        """A gated layer's forward: c is half a tile wide (act(gate) * value)."""
        return self.epilogue.gated and self.epilogue.grad_of == "none"

    @property
    def paired(self) -> bool:
        """A gated layer's backward: c and the source span a tile's gate and value blocks."""
        return self.epilogue.gated and self.epilogue.grad_of != "none"

    def source_subtile(self, i: int, epi_tile) -> int:
        """Where the tile's ``i``-th source read lies in the (2 x as wide, if paired) tile's subtile
        order: ``i``, or the gate (i even) or value subtile of accumulator subtile i // 2 -- the
        same places in dz as in z."""
        if not self.paired:
            return i
        across = self.config.tile_n // epi_tile[1]
        e, value = divmod(i, 2)
        return e // across * 2 * across + e % across + value * across

    def acc_subtile(self, e: int, epi_tile) -> int:
        """The accumulator subtile that c's subtile ``e`` is stored from: itself, or for a gated
        layer the gate subtile its product went into (:meth:`gate`)."""
        if not self.halved:
            return e
        across = self.config.tile_n // epi_tile[1]
        return e // (across // 2) * across + e % (across // 2)

    @cute.jit
    def epilogue_ring(self, tiled_mma, sc, storage, source_smem, gtidx):
        """This thread's views of the epilogue rings: (stmatrix copy, its smem destinations in the
        store ring ``sc``, the shape of one subtile of its accumulators, ldmatrix copy, its smem
        sources in the source ring, the source ring) -- copies laid out like the accumulators."""
        # The stmatrix atom gives the accumulator-to-subtile layout (any 16-bit type describes it);
        # a 32-bit c is then stored with plain shared-memory stores in that layout.
        c_atom = cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16), tiled_mma)
        copy_r2s = cute.make_tiled_copy_S(sm90.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.c_dtype, Float32), c_atom)
        thr_r2s = copy_r2s.get_slice(gtidx)
        r2s_dst = thr_r2s.partition_D(sc)
        part_shape = thr_r2s.partition_S(sc).shape[:3]
        copy_s2r, s2r_src, ss = None, None, None
        if const_expr(self.epilogue.has_source):
            ss = storage.ss.get_tensor(source_smem.outer, swizzle=source_smem.inner)
            copy_s2r = cute.make_tiled_copy_S(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.c_dtype), c_atom)
            s2r_src = copy_s2r.get_slice(gtidx).partition_S(ss)
        return copy_r2s, r2s_dst, part_shape, copy_s2r, s2r_src, ss

    @cute.jit
    def subtile_views(self, tma_atom, tma_tensor, ring, tile_idx, epi_tile: cutlass.Constexpr,
                      columns: cutlass.Constexpr):
        """(smem buffers of ``ring``, global subtiles of tile ``tile_idx`` of ``tma_tensor``, the
        subtiles' row-major order) partitioned for ``tma_atom``: what a subtile's TMA copy takes.
        ``columns``: the tensor's columns a tile covers (``c_columns`` for c and the source,
        tile_n for z)."""
        m, n, batch = tile_idx
        tile = (self.config.tile_m, columns, self.config.tile_k)
        g_tile = cute.local_tile(tma_tensor, tile, (m, n, None, batch), proj=(1, 1, None))
        g_epi = cute.zipped_divide(g_tile, epi_tile)
        s_tma, g_tma = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(ring, 0, 2), g_epi)
        # (rows, columns) of subtiles; a gated layer's columns are (subtiles a block, 2 halves)
        epi_grid = tuple(cute.size(mode) for mode in g_epi.shape[1])
        return s_tma, g_tma, cute.make_layout(epi_grid, stride=(epi_grid[1], 1))

    def group_state(self, state, group):
        """``state`` of a group's own ring (SOURCE_STAGES long) as a position in the shared
        source pipeline, whose stages are the groups' rings one after the other."""
        return pipeline.PipelineState(SOURCE_STAGES * self.config.epilogue_groups, state.count,
                                      state.index + group * SOURCE_STAGES, state.phase)

    @cute.jit
    def load_source(self, sources, group, source_loaded, ss, tma_s, tma_tensor_s, tile_idx,
                    epi_tile: cutlass.Constexpr, e: cutlass.Constexpr, store_warp):
        """The group's sending warp TMA-loads source subtile ``e`` of tile ``tile_idx`` into the
        next buffer of its source ring; every thread of the group advances its producer state,
        which it returns."""
        s_tma, g_tma, epi_order = self.subtile_views(tma_s, tma_tensor_s, ss, tile_idx, epi_tile, self.c_columns)
        if store_warp:
            state = self.group_state(source_loaded, group)
            sources.producer_acquire(state)
            cute.copy(tma_s, g_tma[(None, epi_order.get_hier_coord(self.source_subtile(e, epi_tile)))],
                      s_tma[(None, state.index)],
                      tma_bar_ptr=sources.producer_get_barrier(state))
            sources.producer_commit(state)
        source_loaded.advance()
        return source_loaded

    @cute.jit
    def epilogue_tile(self, acc, tile_coords_c, tile_idx, ring, sources, group, source_loaded, source_read,
                      tma_c, tma_tensor_c, tma_z, tma_tensor_z, tma_s, tma_tensor_s, bias, row_sums, fix_rows, c_shape,
                      epi_tile: cutlass.Constexpr, stores, store_warp, inside, first_store, gtidx):
        """Bias, [pre-activation store], activation, source and the store of one finished tile
        [and of its hidden activation, with ``grad_of``: ``tma_z`` is then the hidden output's].

        ``first_store``: stores this group made before, so the ring buffer of each subtile is
        (first_store + e) mod EPI_STAGES within the group's ring. ``inside``: whether the tile
        lies in the output at all (a cluster's padding tile runs every step but the TMA stores).
        Returns the source ring's states (loaded, read), advanced past this tile.
        """
        epilogue = self.epilogue
        if const_expr(epilogue.has_bias):
            # Columns past the bias are past c too, where the TMA stores clip them: clamping the
            # index instead of branching leaves straight-line loads, and the compiler loads each
            # of the thread's distinct columns once (a branch per accumulator kept all 128).
            start = tile_idx[1] * self.tile_mnk[1]
            last = cute.size(bias, mode=[0]) - 1
            if const_expr(self.planes.count is not None):
                bias = bias[(None, tile_idx[2])]  # the tile's plane: one bias column
            if const_expr(self.bias_words):
                # A thread's accumulators come in pairs of adjacent columns, the first even. The
                # word is written through the pair's 32-bit view (a one-word register tensor viewed
                # as two 16-bit halves reads its low half twice).
                pair = cute.make_rmem_tensor((2,), self.bias_dtype)
                word = cute.recast_tensor(pair, Int32)
                for j in cutlass.range(cute.size(acc) // 2, unroll_full=True):
                    at = cutlass.min((start + tile_coords_c[2 * j][1]) // 2, last)
                    word[0] = bias[at]
                    acc[2 * j] = acc[2 * j] + pair[0].to(Float32)
                    acc[2 * j + 1] = acc[2 * j + 1] + pair[1].to(Float32)
            else:
                for i in cutlass.range(cute.size(acc), unroll_full=True):
                    col = cutlass.min(start + tile_coords_c[i][1], last)
                    acc[i] = acc[i] + bias[col].to(Float32)
        if const_expr(epilogue.exp_row_sums):
            self.exp_row_sums(acc, tile_coords_c, tile_idx, row_sums, fix_rows, c_shape, inside, gtidx)
        if const_expr(epilogue.store_preact):
            self.store_tile(acc, False, ring, sources, group, source_loaded, source_read, tma_z, tma_tensor_z,
                            tma_s, tma_tensor_s, tile_idx, epi_tile, stores, store_warp, inside, first_store, False, None)
            first_store += self.epi_tiles(epi_tile)
        if const_expr(self.halved):
            self.gate(acc, ring, epi_tile)
        elif const_expr(epilogue.activation != "none"):
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                acc[i] = apply_activation(acc[i], epilogue.activation)
        hidden = (tma_z, tma_tensor_z) if const_expr(epilogue.grad_of != "none") else None
        self.store_tile(acc, epilogue.has_source, ring, sources, group, source_loaded, source_read, tma_c,
                        tma_tensor_c, tma_s, tma_tensor_s, tile_idx, epi_tile, stores, store_warp, inside, first_store,
                        True, hidden)
        return source_loaded, source_read

    @cute.jit
    def exp_row_sums(self, acc, tile_coords_c, tile_idx, row_sums, fix_rows, c_shape, inside, gtidx):
        """``acc = exp(min(acc, EXP_CLAMP))``, and each row's sums of it over the tile's ``ROW_SUM_BLOCK``-column
        blocks into ``row_sums`` (columns past N left out). In the wgmma accumulator layout a
        thread holds, per 64-row slice of the tile (mode 1), two rows -- value mode (2 columns,
        2 rows 8 apart, tile_n / 8 groups of 8 columns) -- and the 4 lanes of a quad hold the
        same rows' other columns: each thread sums its 16 values of a row's block, two butterfly
        shuffles add the quad's, and the quad's first lane stores. ``fix_rows`` (exp_fix_rows):
        each row's shift comes off first, and each block's max and label entry are reduced and
        stored alike."""
        values = acc.shape[0]
        if const_expr(cute.rank(values) != 3 or values[0] != 2 or values[1] != 2 or cute.size(acc, mode=[2]) != 1):
            raise ValueError(f"exp_row_sums expects the wgmma accumulator layout ((2, 2, N / 8), M, 1); got {acc.shape}")
        # only a tile reaching past the columns that count tests each column (a select per value
        # the other tiles skip)
        limit = c_shape[1] if const_expr(not self.epilogue.exp_columns) else Int32(self.epilogue.exp_columns)
        if tile_idx[1] * self.config.tile_n + self.config.tile_n <= limit:
            self.exp_block_sums(acc, tile_coords_c, tile_idx, row_sums, fix_rows, c_shape, limit, inside, gtidx,
                                False)
        else:
            self.exp_block_sums(acc, tile_coords_c, tile_idx, row_sums, fix_rows, c_shape, limit, inside, gtidx,
                                True)

    @cute.jit
    def exp_block_sums(self, acc, tile_coords_c, tile_idx, row_sums, fix_rows, c_shape, limit, inside, gtidx,
                       masked: cutlass.Constexpr):
        """:meth:`exp_row_sums` on one tile, testing each column against ``limit`` (N, or
        ``Epilogue.exp_columns``) if ``masked``; past exp_columns c is 0 too."""
        config = self.config
        groups_per_block = ROW_SUM_BLOCK // 8
        m0, n0 = tile_idx[0] * config.tile_m, tile_idx[1] * config.tile_n
        block0 = tile_idx[1] * (config.tile_n // ROW_SUM_BLOCK)
        low = Float32(-math.inf)
        for mm in cutlass.range_constexpr(cute.size(acc, mode=[1])):
            for r in cutlass.range_constexpr(2):
                row = m0 + tile_coords_c[((0, r, 0), mm, 0)][0]
                shift, label = Float32(0.0), Int32(0)
                if const_expr(fix_rows is not None):
                    at_row = (cutlass.min(row, c_shape[0] - 1), 0, 0)  # a row past M reads the last one's
                    shift = fix_rows[2][at_row]
                    label = fix_rows[1][at_row] - n0  # the label's column in this tile
                for blk in cutlass.range_constexpr(config.tile_n // ROW_SUM_BLOCK):
                    total, top, at_label = Float32(0.0), low, low
                    for g in cutlass.range_constexpr(groups_per_block):
                        for c2 in cutlass.range_constexpr(2):
                            at = ((c2, r, blk * groups_per_block + g), mm, 0)
                            z = acc[at]
                            if const_expr(fix_rows is not None):
                                z = z - shift
                                column = tile_coords_c[at][1]
                                at_label = cutlass.select_(column == label, z, at_label)
                                if const_expr(masked):
                                    top = cute.arch.fmax(top, cutlass.select_(n0 + column < limit, z, low))
                                else:
                                    top = cute.arch.fmax(top, z)
                            e = cute.math.exp2(cute.arch.fmin(z, Float32(EXP_CLAMP)) * LOG2E, fastmath=True)
                            if const_expr(masked):
                                e = cutlass.select_(n0 + tile_coords_c[at][1] < limit, e, Float32(0.0))
                            acc[at] = e
                            total = total + e
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                    total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                    if const_expr(fix_rows is not None):
                        for offset in cutlass.range_constexpr(1, 3):
                            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=offset))
                            at_label = cute.arch.fmax(at_label, cute.arch.shuffle_sync_bfly(at_label, offset=offset))
                    # a last tile may reach past N by whole blocks, which row_sums does not have
                    block_inside = (block0 + blk) * ROW_SUM_BLOCK < c_shape[1]
                    if inside and block_inside and gtidx % 4 == 0 and row < c_shape[0]:
                        at_block = (row, block0 + blk, tile_idx[2])
                        row_sums[at_block] = total
                        if const_expr(fix_rows is not None):
                            fix_rows[3][at_block] = top
                            fix_rows[4][at_block] = at_label

    @cute.jit
    def gate(self, acc, ring, epi_tile: cutlass.Constexpr):
        """A gated layer's act(gate) * value, into the gate's subtiles of ``acc``: a tile's value
        columns are its gate columns' plus tile_n / 2 (``gated_view``), so every thread holds both
        of each pair, at the same place in subtiles half a row of subtiles apart."""
        acc_view = ring[0].retile(acc)
        count = cute.size(cute.make_layout(ring[2]))
        across = self.config.tile_n // epi_tile[1]
        for e in cutlass.range_constexpr(self.out_tiles(epi_tile)):
            g = self.acc_subtile(e, epi_tile)
            for v in cutlass.range_constexpr(count):
                acc_view[g * count + v] = (apply_activation(acc_view[g * count + v], self.epilogue.activation)
                                           * acc_view[(g + across // 2) * count + v])

    @cute.jit
    def store_tile(self, acc, with_source: cutlass.Constexpr, ring, sources, group, source_loaded, source_read,
                   tma_out, tma_tensor_out, tma_s, tma_tensor_s, tile_idx, epi_tile: cutlass.Constexpr, stores,
                   store_warp, inside, first_store, c_tile: cutlass.Constexpr, hidden):
        """Write the fp32 accumulators ``acc`` (combined with the source tile if ``with_source``:
        + residual, or x act'(preact)) to ``tma_tensor_out``'s tile in its dtype: registers ->
        smem (stmatrix) -> global (TMA store), one epilogue subtile at a time through the group's
        ring of ``EPI_STAGES`` buffers. TMA clips what lies past the tensor. ``c_tile``: the output
        is c (``c_columns`` a tile; a gated layer's forward stores it from the gate subtiles,
        :meth:`gate`), else the stored preact z (tile_n). A gated layer's backward (:attr:`paired`)
        reads the gate and the value subtile of z for each accumulator subtile and stores dz's
        two. ``hidden`` (``grad_of``): the hidden output's (TMA atom, tensor), whose subtile --
        act(preact), or act(gate) * value -- follows each of c's (a tile_n-wide tile); else None.
        """
        config, epilogue = self.config, self.epilogue
        copy_r2s, _, part_shape, copy_s2r, s2r_src, ss, sc = ring
        acc_view = copy_r2s.retile(acc)
        part_layout = cute.make_layout(part_shape)
        part = cute.make_rmem_tensor(part_layout, Float32)
        part_out = cute.make_rmem_tensor(part_layout, self.c_dtype)
        source_part = None
        if const_expr(with_source):
            source_part = cute.make_rmem_tensor(part_layout, self.c_dtype)
        source_view = copy_s2r.retile(source_part) if const_expr(with_source) else None
        reading = (sources, group, source_loaded, source_read, ss, tma_s, tma_tensor_s, tile_idx, epi_tile,
                   store_warp, copy_s2r, s2r_src, source_view)

        if const_expr(isinstance(tma_out, tuple)):  # split outputs: each plane's views, at L = 0
            views = [self.subtile_views(atom, tensor, sc, (*tile_idx[:2], 0), epi_tile, config.tile_n)
                     for atom, tensor in zip(tma_out, tma_tensor_out)]
        else:
            views = self.subtile_views(tma_out, tma_tensor_out, sc, tile_idx, epi_tile,
                                       self.c_columns if const_expr(c_tile) else config.tile_n)
        sending = (ring, views, tma_out, tile_idx, group, stores, store_warp, inside)
        hidden_sending = None
        if const_expr(hidden is not None):
            hidden_views = self.subtile_views(*hidden, sc, tile_idx, epi_tile, config.tile_n)
            hidden_sending = (ring, hidden_views, hidden[0], tile_idx, group, stores, store_warp, inside)
        if const_expr(self.paired):
            # dz's gate subtile = dh * value * act'(gate), its value subtile = dh * act(gate);
            # hidden's = act(gate) * value (a gated backward always stores it)
            gate = cute.make_rmem_tensor(part_layout, Float32)
            for e in cutlass.range_constexpr(self.epi_tiles(epi_tile)):
                self.read_source(2 * e, *reading)
                for v in cutlass.range_constexpr(cute.size(part)):
                    gate[v] = source_part[v].to(Float32)
                self.read_source(2 * e + 1, *reading)
                for v in cutlass.range_constexpr(cute.size(part)):
                    activated, slope = activation_and_grad(gate[v], epilogue.grad_of)
                    part[v] = acc_view[e * cute.size(part) + v] * source_part[v].to(Float32) * slope
                    gate[v] = activated
                self.send_subtile(part, part_out, self.source_subtile(2 * e, epi_tile), first_store + 3 * e,
                                  *sending)
                for v in cutlass.range_constexpr(cute.size(part)):
                    part[v] = acc_view[e * cute.size(part) + v] * gate[v]
                self.send_subtile(part, part_out, self.source_subtile(2 * e + 1, epi_tile),
                                  first_store + 3 * e + 1, *sending)
                for v in cutlass.range_constexpr(cute.size(part)):
                    part[v] = gate[v] * source_part[v].to(Float32)
                self.send_subtile(part, part_out, e, first_store + 3 * e + 2, *hidden_sending)
        else:
            sends = 2 if const_expr(hidden is not None) else 1
            subtiles = self.out_tiles(epi_tile) if const_expr(c_tile) else self.epi_tiles(epi_tile)
            for e in cutlass.range_constexpr(subtiles):
                a = self.acc_subtile(e, epi_tile) if const_expr(c_tile) else e
                for v in cutlass.range_constexpr(cute.size(part)):
                    part[v] = acc_view[a * cute.size(part) + v]
                if const_expr(with_source):
                    self.read_source(e, *reading)
                    for v in cutlass.range_constexpr(cute.size(part)):
                        src = source_part[v].to(Float32)
                        if const_expr(epilogue.grad_of != "none"):
                            activated, slope = activation_and_grad(src, epilogue.grad_of)
                            part[v] = part[v] * slope
                            if const_expr(hidden is not None):
                                source_part[v] = activated.to(self.c_dtype)  # kept in c's dtype until sent
                        else:
                            part[v] = part[v] + src
                self.send_subtile(part, part_out, e, first_store + sends * e, *sending)
                if const_expr(hidden is not None):
                    for v in cutlass.range_constexpr(cute.size(part)):
                        part[v] = source_part[v].to(Float32)
                    self.send_subtile(part, part_out, e, first_store + sends * e + 1, *hidden_sending)

    @cute.jit
    def read_source(self, i: cutlass.Constexpr, sources, group, source_loaded, source_read, ss, tma_s, tma_tensor_s,
                    tile_idx, epi_tile: cutlass.Constexpr, store_warp, copy_s2r, s2r_src, source_view):
        """The tile's ``i``-th source subtile from the group's source ring into ``source_view``
        (the thread's registers), then the load of the one ``SOURCE_STAGES`` later, if any."""
        state = self.group_state(source_read, group)
        sources.consumer_wait(state)
        cute.copy(copy_s2r, s2r_src[(None, None, None, state.index)], source_view)
        sources.consumer_release(state)
        source_read.advance()
        if const_expr(i + SOURCE_STAGES < self.out_tiles(epi_tile)):
            self.load_source(sources, group, source_loaded, ss, tma_s, tma_tensor_s, tile_idx, epi_tile,
                             i + SOURCE_STAGES, store_warp)

    @cute.jit
    def send_subtile(self, part, part_out, index: cutlass.Constexpr, store, ring, views, tma_out,
                     tile_idx, group, stores, store_warp, inside):
        """One subtile ``part`` (fp32) to the output's subtile ``index`` (in ``views``' order), in
        its dtype, through buffer ``store`` mod ``EPI_STAGES`` of the group's ring."""
        copy_r2s, r2s_dst = ring[0], ring[1]
        mma_threads = WARPGROUP * self.config.mma_warpgroups
        part_out.store(part.load().to(self.c_dtype))
        buffer = group * EPI_STAGES + store % EPI_STAGES
        cute.copy(copy_r2s, part_out, r2s_dst[(None, None, None, buffer)])
        # Make the smem writes visible to the TMA (async proxy), then let one warp send them.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1 + group, number_of_threads=mma_threads)
        if store_warp:
            if inside:
                if const_expr(isinstance(tma_out, tuple)):
                    for p in cutlass.range_constexpr(len(tma_out)):
                        if tile_idx[2] == p:
                            s_tma, g_tma, epi_order = views[p]
                            cute.copy(tma_out[p], s_tma[(None, buffer)], g_tma[(None, epi_order.get_hier_coord(index))])
                else:
                    s_tma, g_tma, epi_order = views
                    cute.copy(tma_out, s_tma[(None, buffer)], g_tma[(None, epi_order.get_hier_coord(index))])
            stores.producer_commit()
            stores.producer_acquire()
        cute.arch.barrier(barrier_id=1 + group, number_of_threads=mma_threads)
