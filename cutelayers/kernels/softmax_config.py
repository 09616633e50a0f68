"""What the softmax-family kernels' callers need without CuTe: the kernels' values per thread,
which select their heuristic configs and config spaces (:func:`.reduction_config.row_geometry`,
:func:`.reduction_config.row_geometry_space`), when a streamed row is staged in shared memory, and
over how many CTAs (a cluster) a long row is cut so that its shares are."""

import dataclasses

from cutelayers.kernels.reduction_config import RowGeometry

# fp32 values per thread per step: one row operand (the forwards; the cross-entropy backward, which
# reads the logits), two in the softmax backward (y and dy).
FORWARD_VALUES_PER_THREAD = 32
BACKWARD_VALUES_PER_THREAD = 16
# The fused cross-entropy forward + gradient holds one row operand, but two passes' worth of state
# (the online lse and the label's logit): fewer values keep it within 64 registers, so that two
# 512-thread CTAs share an SM.
WITH_GRAD_VALUES_PER_THREAD = 16

# Shared memory a CTA may give a staged row: two CTAs per SM (228 KiB on Hopper, 1 KiB of it
# reserved per CTA), less the reduction buffers. A bf16 row of 50304 (GPT-2) takes 98 KiB.
STAGED_ROW_BYTES = 112 * 1024
# Where even a full cluster's shares exceed that (a bf16 softmax backward's y and dy at 262144:
# 128 KiB a CTA), one CTA per SM may stage up to this much.
STAGED_ROW_BYTES_ALONE = 200 * 1024
# CTAs a row may be cut over: Hopper's largest (non-portable) cluster, which CuTe DSL allows on
# every kernel. A bf16 softmax backward at 262144 stages 64 KiB a CTA over 16 (128 KiB over 8).
MAX_CLUSTER = 16
# A streamed softmax forward row runs 256-thread CTAs: more CTAs per SM hide the cut rows'
# exchanges (H200 autotune against 512: 50304 559 -> 528 us, 131072 540 -> 521, 262144 625 -> 552).
STREAMED_FORWARD_THREADS = 256


def share_bytes(geometry: RowGeometry, elem_bytes: int, operands: int = 1) -> int:
    """Shared memory one CTA needs to stage its share of ``operands`` row operands."""
    return operands * geometry.row.rows_per_cta * geometry.share_width * elem_bytes


def staged(geometry: RowGeometry, elem_bytes: int, operands: int = 1) -> bool:
    """Whether a two-pass kernel keeps a streamed row (one read in several steps) in shared memory
    for its second pass, instead of reading it from global memory again (then mostly from L2)."""
    limit = STAGED_ROW_BYTES if geometry.cluster == 1 else STAGED_ROW_BYTES_ALONE
    return not geometry.resident and share_bytes(geometry, elem_bytes, operands) <= limit


def split_rows(geometry: RowGeometry, elem_bytes: int, operands: int) -> RowGeometry:
    """``geometry`` with a streamed row of one-row CTAs cut over the fewest CTAs (a power of two,
    at most ``MAX_CLUSTER``, each with a step) whose shares of ``operands`` row operands stage in
    ``STAGED_ROW_BYTES``, or failing that in ``STAGED_ROW_BYTES_ALONE`` over the most CTAs; the row
    is read from global memory once instead of twice. Other geometries are returned as they are."""
    if geometry.resident or geometry.row.rows_per_cta != 1 or staged(geometry, elem_bytes, operands):
        return geometry
    steps = geometry.num_steps
    splits = [c for c in (2, 4, 8, 16) if c <= MAX_CLUSTER and (c - 1) * -(-steps // c) < steps]
    for cluster in splits:
        cut = dataclasses.replace(geometry, cluster=cluster)
        if share_bytes(cut, elem_bytes, operands) <= STAGED_ROW_BYTES:
            return cut
    if splits:
        cut = dataclasses.replace(geometry, cluster=splits[-1])
        if staged(cut, elem_bytes, operands):
            return cut
    return geometry
