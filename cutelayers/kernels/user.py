"""The ``@cute.jit`` shim between XLA's flat buffer list and a user launcher (see cute_call)."""

import cutlass
import cutlass.cute as cute


@cute.jit
def call_user_launcher(stream, *buffers, launcher: cutlass.Constexpr, plan: cutlass.Constexpr):
    """Split XLA's buffers into inputs and the outputs the launcher writes, then call it.

    ``plan`` = (number of inputs, indices of outputs not aliased to an input, constexpr items).
    """
    n_inputs, kept_outputs, constexpr = plan
    outputs = buffers[n_inputs:]
    launcher(stream, *buffers[:n_inputs], *[outputs[i] for i in kept_outputs], **dict(constexpr))
