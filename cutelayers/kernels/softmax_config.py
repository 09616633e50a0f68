"""What the softmax-family kernels' callers need without CuTe: the kernels' values per thread,
which select their heuristic configs and config spaces (:func:`.reduction_config.row_geometry`,
:func:`.reduction_config.row_geometry_space`)."""

# fp32 values per thread per step: one row operand (the forwards; the cross-entropy backward, which
# reads the logits), two in the softmax backward (y and dy).
FORWARD_VALUES_PER_THREAD = 32
BACKWARD_VALUES_PER_THREAD = 16
