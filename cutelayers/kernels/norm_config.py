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
THREADS_PER_SM = 1024  # resident threads per SM the backward grid aims for


def backward_grid(config: RowConfig) -> int:
    """CTAs of the persistent backward grid (register-resident rows only)."""
    return HOPPER_SMS * max(THREADS_PER_SM // config.num_threads, 1)


def partial_rows(config: RowConfig) -> int:
    """Rows P of the backward's dscale/dbias partials: one per (CTA, row slot)."""
    return backward_grid(config) * config.rows_per_cta
