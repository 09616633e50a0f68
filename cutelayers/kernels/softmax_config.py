"""What the softmax-family kernels' callers need without CuTe: the kernels' values per thread,
which select their heuristic configs and config spaces (:func:`.reduction_config.row_geometry`,
:func:`.reduction_config.row_geometry_space`), the CTA width of a streamed forward row, and the cut
of a few long rows (:func:`few_rows_cut`). (When a streamed row is staged, and over how many CTAs
it is cut: :func:`.reduction_config.split_rows`.)"""

from __future__ import annotations

import dataclasses

from cutelayers.kernels.reduction_config import (
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

# A decode batch's rows (at most reduction_config.FEW_ROWS) of a long vocabulary: the one-pass
# cross-entropy kernels gave a row one CTA, so 8 rows of 131072 kept 8 SMs busy (H100, fwd+bwd 19.7
# us against XLA's 11.5: docs/benchmarks.md, sixty-third session). Such rows are cut over CTAs --
# the forward's a cluster exchanging their logsumexps, the backward's a plain grid -- a step of the
# row a CTA, at most MAX_CLUSTER of them (:func:`few_rows_cut`; the same cut for every such count,
# so a decode batch's size does not change the kernel).


def few_rows_cut(config: RowConfig, n: int, elem_bits: int) -> RowConfig:
    """``config`` with the share budget that cuts a decode batch's rows of ``n`` elements
    (``elem_bits`` the widest row operand's) over a CTA a step of the row -- the largest power of
    two of CTAs, at most ``MAX_CLUSTER``, each with a whole step; ``config`` as it is for a
    register-resident row."""
    geometry = geometry_for(config, n, elem_bits)
    if geometry.resident:
        return config
    ctas = min(MAX_CLUSTER, 1 << (geometry.num_steps.bit_length() - 1))
    return dataclasses.replace(config, share_budget=cut_budget(config, n, elem_bits, ctas))
