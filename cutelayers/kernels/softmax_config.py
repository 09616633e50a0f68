"""What the softmax-family kernels' callers need without CuTe: the kernels' values per thread,
which select their heuristic configs and config spaces (:func:`.reduction_config.row_geometry`,
:func:`.reduction_config.row_geometry_space`), and the CTA width of a streamed forward row. (When
a streamed row is staged, and over how many CTAs it is cut: :func:`.reduction_config.split_rows`.)"""

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
