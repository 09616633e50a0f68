"""The ``@cute.jit`` shim between XLA's flat buffer list and a kernel launcher.

Kernels are compiled against the buffers as XLA stores them (row-major, their own shapes), which
is what the TVM-FFI call checks at run time. The shim then gives the launcher what it asked for:
each buffer in its mode order (a permuted view, no copy), only the outputs it writes itself, and
its compile-time keywords.
"""

import cutlass
from cutlass import cute


@cute.jit
def call_launcher(stream, *buffers, launcher: cutlass.Constexpr, plan: cutlass.Constexpr):
    """``plan`` = (mode order or None per buffer, number of inputs, indices of the outputs passed
    to the launcher, constexpr items)."""
    modes, n_inputs, kept_outputs, constexpr = plan
    views = [
        buffer if order is None else cute.make_tensor(buffer.iterator, cute.select(buffer.layout, mode=list(order)))
        for buffer, order in zip(buffers, modes)
    ]
    outputs = views[n_inputs:]
    launcher(stream, *views[:n_inputs], *[outputs[i] for i in kept_outputs], **dict(constexpr))
