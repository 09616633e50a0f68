"""What the norm kernels' callers need without CuTe: the kernels' values per thread (their
heuristic configs, :func:`.reduction_config.row_geometry`) and the backward's persistent grid,
which fixes the shape of its dscale / dbias partials (:mod:`.norm`)."""

from __future__ import annotations

from cutelayers.kernels.reduction_config import RowConfig

# fp32 values a thread holds per row step: the forward keeps x; the backward keeps x, dy and the
# dscale/dbias accumulators, so it gets fewer -- 24 for 16-bit rows, 16 for 32-bit ones (whose
# fragments take twice the registers). 24 lets N = 768 bf16 run one warp a row (32 threads x 3 x 8
# values: no shared-memory reduction, no barrier): add_layer_norm's backward 34.7 -> 32.4 us, the
# plain one 30.8 -> 28.9, at 16384 rows on an H200 (docs/benchmarks.md, thirteenth session).
FORWARD_VALUES_PER_THREAD = 32
BACKWARD_VALUES_PER_THREAD = {16: 24, 32: 16}  # by the row operands' widest element, in bits
# A streamed row (staged in shared memory, cut over a cluster when long) runs 256-thread CTAs:
# with 512, LayerNorm's forward (its per-step moments take registers) ran one CTA an SM and lost
# to the unstaged kernel (H200, 2048 x 65536 bf16: 181 -> 189 us), and the backward's 6 steps of
# 12288 columns at 65536 could only be cut in two, 147 KiB a CTA.
STREAMED_THREADS = 256
# The persistent backward grid: Hopper parts have 132 SMs (H100 SXM, H200); fewer SMs only means
# a tail wave. Fixed so that the partials' shape is known without a device.
HOPPER_SMS = 132
# Resident threads per SM the backward grid aims for: a 128-thread CTA of the register-resident
# backward used ~124 registers a thread (bf16 x 768 with residual, 64 threads a row), so 512 fit an
# SM's 64K; a 1024-thread target launched a second wave of CTAs and twice the dscale / dbias
# partials. One warp a row (N = 768 bf16 since the 24-value budget) takes ~210 registers: two CTAs
# an SM, the grid in two waves -- still the fastest of the configs measured there.
THREADS_PER_SM = 512


def backward_grid(config: RowConfig, rows: int | None = None) -> int:
    """CTAs of the persistent backward grid (register-resident rows only): enough to fill the
    GPU, or, for ``rows`` rows that need fewer, the power of two that covers their row groups --
    every CTA writes a row of partials, so a decode-sized batch should not launch a GPU's worth."""
    full = HOPPER_SMS * max(THREADS_PER_SM // config.num_threads, 1)
    if rows is None:
        return full
    groups = max(1, -(-rows // config.rows_per_cta))
    return min(full, 1 << (groups - 1).bit_length())

