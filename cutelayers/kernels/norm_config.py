"""What the norm kernels' callers need without CuTe: the kernels' values per thread (their
heuristic configs, :func:`.reduction_config.row_geometry`) and the backward's persistent grid,
which fixes the shape of its dscale / dbias partials (:mod:`.norm`)."""

from __future__ import annotations

from cutelayers.kernels.reduction_config import RowConfig

# fp32 values a thread holds per row step: the forward keeps x; the backward keeps x, dy and the
# dscale/dbias accumulators, so it gets fewer.
FORWARD_VALUES_PER_THREAD = 32
BACKWARD_VALUES_PER_THREAD = 16
# The persistent backward grid: Hopper parts have 132 SMs (H100 SXM, H200); fewer SMs only means
# a tail wave. Fixed so that the partials' shape is known without a device.
HOPPER_SMS = 132
# Resident threads per SM the backward grid aims for: the register-resident backward uses ~124
# registers a thread (ptxas, bf16 x 768 with residual), so 512 of 128-thread CTAs fit an SM's 64K;
# a 1024-thread target launched a second wave of CTAs and twice the dscale / dbias partials.
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


def partial_rows(config: RowConfig, grid: int) -> int:
    """Rows P of the backward's dscale/dbias partials: one per (CTA, row slot) of ``grid`` CTAs."""
    return grid * config.rows_per_cta
