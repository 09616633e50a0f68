"""What the softmax-family kernels' callers need without CuTe: the kernels' values per thread,
which select their heuristic configs and config spaces (:func:`.reduction_config.row_geometry`,
:func:`.reduction_config.row_geometry_space`), and when a streamed row is staged in shared memory."""

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


def staged(geometry: RowGeometry, elem_bytes: int) -> bool:
    """Whether a two-pass kernel keeps a streamed row (one read in several steps) in shared memory
    for its second pass, instead of reading it from global memory again (then mostly from L2)."""
    return not geometry.resident and geometry.row.rows_per_cta * geometry.n * elem_bytes <= STAGED_ROW_BYTES
