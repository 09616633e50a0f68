"""What the softmax-family kernels' callers need without CuTe: the kernels' values per thread,
which select their heuristic configs and config spaces (:func:`.reduction_config.row_geometry`,
:func:`.reduction_config.row_geometry_space`), the CTA width of a streamed forward row, and the cut
of a few long rows (:func:`few_rows_cut`). (When a streamed row is staged, and over how many CTAs
it is cut: :func:`.reduction_config.split_rows`.)"""

from __future__ import annotations

import dataclasses

from cutelayers.kernels.hopper import HOPPER_SMS
from cutelayers.kernels.reduction_config import (
    FEW_ROWS,
    MAX_CLUSTER,
    RowConfig,
    cut_budget,
    geometry_for,
)

# fp32 values per thread per step: one row operand (the forwards; the cross-entropy backward, which
# reads the logits), two in the softmax backward (y and dy).
FORWARD_VALUES_PER_THREAD = 32
BACKWARD_VALUES_PER_THREAD = 16
# The fused cross-entropy forward + gradient holds one row operand, but two passes' worth of state
# (the online lse and the label's logit): fewer values keep it within 64 registers, so that two
# 512-thread CTAs share an SM.
WITH_GRAD_VALUES_PER_THREAD = 16

# A streamed softmax forward row runs 256-thread CTAs: more CTAs per SM hide the cut rows'
# exchanges (H200 autotune against 512: 50304 559 -> 528 us, 131072 540 -> 521, 262144 625 -> 552).
STREAMED_FORWARD_THREADS = 256

# A decode batch's rows (at most reduction_config.FEW_ROWS) of a long vocabulary: a kernel that
# gives a row one CTA, or the few a long row's staging needs, keeps few SMs busy -- the one-pass
# cross-entropy's 8 rows of 131072 ran fwd+bwd in 19.7 us against XLA's 11.5, the softmax forward's
# 8 rows of 32768 in 5.2 us (H100: docs/benchmarks.md, sixty-third and sixty-fourth sessions). Such
# rows are cut over CTAs -- a cluster where the kernel exchanges row statistics, a plain grid where
# it has none to exchange (the cross-entropy's backward) -- the same cut for every such count, so a
# decode batch's size does not change the kernel (:func:`few_rows_cut`). Swept at 8 rows of 32768,
# 131072 and 262144 over 2-16 CTAs a row (H100, sixty-fourth session), each kernel ran fastest
# with the most CTAs tried -- shares down to half a step -- but for clusters of more than
# FEW_ROWS_CLUSTER_THREADS threads: 16 CTAs of 512 threads ran 10-30 % slower than 8 (the
# cross-entropy forward at 262144: 5.0 against 3.9 us), 16 of 256 threads 5-9 % faster.
FEW_ROWS_CLUSTER_THREADS = 4096
# Past a decode batch, rows of a CTA each leave SMs idle until they fill two CTAs an SM: up to
# CUT_ROWS of them are cut over the power of two of CTAs at most FILL_CTAS / rows (4 at 65-66 rows,
# 2 at 67-132), capped as a decode batch's cut is. H100, bf16 (docs/benchmarks.md, sixty-fifth
# session), us before -> after: 66 rows, the cross-entropy fwd+bwd 12.2 -> 11.2 (32768), 19.5 ->
# 15.2 (50257), 25.5 -> 23.8 (131072), the softmax forward 6.4 -> 5.1 (32768), 45.3 -> 11.7
# (50257); 132 rows, the softmax forward 9.0 -> 8.0 (32768), 51.2 -> 22.6 (50257). A row that a
# kernel stages over CTAs anyway is not cut finer (the softmax backward's: 13.1 -> 13.5 at 66 x 50257).
FILL_CTAS = 2 * HOPPER_SMS
CUT_ROWS = FILL_CTAS // 2


def few_rows_cut(config: RowConfig, n: int, elem_bits: int, rows: int, operands: int = 1,
                 cluster: bool = True) -> RowConfig:
    """``config`` with the share budget that cuts ``rows`` rows of ``n`` elements (``elem_bits``
    the widest row operand's; a share's budget counts ``operands`` of them) over CTAs -- a power of
    two of them, at most twice the row's steps (shares of half a step at least), at most
    ``MAX_CLUSTER``, where the CTAs form a ``cluster`` of at most ``FEW_ROWS_CLUSTER_THREADS``
    threads in all, and past a decode batch (``rows`` more than ``FEW_ROWS``) at most
    ``FILL_CTAS / rows``; ``config`` as it is for a register-resident row, or where that leaves one
    CTA a row."""
    geometry = geometry_for(config, n, elem_bits)
    if geometry.resident:
        return config
    most = min(MAX_CLUSTER, FEW_ROWS_CLUSTER_THREADS // config.num_threads) if cluster else MAX_CLUSTER
    if rows > FEW_ROWS:
        most = min(most, FILL_CTAS // rows)
    ctas = min(1 << (most.bit_length() - 1) if most else 1, 1 << geometry.num_steps.bit_length())
    if ctas < 2:
        return config
    return dataclasses.replace(config, share_budget=cut_budget(config, n, elem_bits, ctas, operands))
