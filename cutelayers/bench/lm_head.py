"""LM-head benchmark: ``python -m cutelayers.bench lm_head [--tokens --hidden --vocab --dtype
--param-dtype --chunk-size ...]``.

Loss and gradients (h and kernel) of a language-model head, two ways, in the same run:

* ``fused``: :func:`cutelayers.ops.linear_cross_entropy`, chunked over tokens, never holding the
  (T, V) logits;
* ``xla``: the usual unfused head, ``(h @ kernel)`` in h's dtype, cast to float32 logits,
  ``optax.softmax_cross_entropy_with_integer_labels``, mean.

The kernel is in h's dtype, or in ``param_dtype`` (float32: mixed precision, as a Flax head with
``param_dtype=float32`` holds it): the XLA head then casts it to h's dtype for its GEMM, as Flax's
``promote_dtype`` does, and the fused one takes it as it is.

Per head: median time of the jitted value_and_grad, and XLA's compile-time memory analysis
(``temp_size_in_bytes``: scratch buffers; arguments and outputs separately), with ratios to the
XLA head. The memory part needs no GPU: :func:`head_memory` lowers for the default device (on CPU
the ops' jnp reference, which chunks the same way).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cutelayers as cl
from cutelayers.bench.timing import time_fn

F32 = jnp.float32
GB = 1e9
HEADS = ("fused", "xla")


def xla_head_loss(h, kernel, labels):
    """The unfused head: all (T, V) logits at once, computed in h's dtype."""
    logits = (h @ kernel.astype(h.dtype)).astype(F32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def loss_and_grads(head: str, chunk_size: int | None = None):
    """Jitted ``(h, kernel, labels) -> (loss, (dh, dkernel))`` of one of :data:`HEADS`."""
    loss = partial(cl.ops.linear_cross_entropy, chunk_size=chunk_size) if head == "fused" else xla_head_loss
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def head_specs(t: int, h: int, v: int, dtype, param_dtype=None) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of (h (T, H), kernel (H, V) in ``param_dtype`` (default: ``dtype``), labels (T,)):
    lowering needs no arrays."""
    return (jax.ShapeDtypeStruct((t, h), dtype), jax.ShapeDtypeStruct((h, v), param_dtype or dtype),
            jax.ShapeDtypeStruct((t,), jnp.int32))


def compile_head(head: str, args, chunk_size: int | None = None):
    """One head's value_and_grad compiled for ``args`` (arrays or ShapeDtypeStructs), lowered
    under the current cutelayers backend for the default device."""
    return loss_and_grads(head, chunk_size).lower(*args).compile()


def memory_stats(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled function: temp (scratch), arguments, outputs bytes."""
    stats = compiled.memory_analysis()
    return {"temp": stats.temp_size_in_bytes, "arguments": stats.argument_size_in_bytes,
                "outputs": stats.output_size_in_bytes}


def head_memory(t: int, h: int, v: int, dtype, chunk_size: int | None = None,
                param_dtype=None) -> dict[str, dict[str, int]]:
    """``{head: memory_stats}`` of each head's value_and_grad, compiled from shapes alone."""
    specs = head_specs(t, h, v, jnp.dtype(dtype), param_dtype)
    return {head: memory_stats(compile_head(head, specs, chunk_size)) for head in HEADS}


def head_operands(t: int, h: int, v: int, dtype, seed: int = 0, param_dtype=None):
    """Random h, kernel (scaled so the logits are O(1); in ``param_dtype``, default ``dtype``) and
    labels."""
    kh, kk, kl = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(kh, (t, h), F32).astype(dtype)
    kernel = (jax.random.normal(kk, (h, v), F32) / np.sqrt(h)).astype(param_dtype or dtype)
    return hidden, kernel, jax.random.randint(kl, (t,), 0, v, jnp.int32)


def bench_lm_head(t: int, h: int, v: int, dtype, chunk_sizes=(None,), param_dtype=None) -> list[dict]:
    """One row per head -- the fused head at each of ``chunk_sizes`` (None: the op's default),
    then XLA's: loss, ms per forward+backward, temp GB and arguments+outputs GB, and the ratios of
    time and temp memory to the XLA head's, the kernel in ``param_dtype`` (default: ``dtype``).
    Runs the kernels (backend "cute")."""
    operands = head_operands(t, h, v, dtype, param_dtype=param_dtype)
    heads = [("fused", chunk) for chunk in chunk_sizes] + [("xla", None)]
    with cl.use_backend("cute"):  # chosen at lowering: the executables keep it
        compiled = [compile_head(head, operands, chunk) for head, chunk in heads]
    memory = [memory_stats(fn) for fn in compiled]
    losses = [float(fn(*operands)[0]) for fn in compiled]
    times = [time_fn(fn, *operands) for fn in compiled]
    xla_time, xla_temp = times[-1], max(memory[-1]["temp"], 1)
    rows = []
    for (head, chunk), mem, loss, seconds in zip(heads, memory, losses, times):
        rows.append({"head": head, "chunk": "default" if chunk is None and head == "fused" else chunk or "-",
                         "t": t, "h": h, "v": v, "dtype": jnp.dtype(dtype).name,
                         "params": jnp.dtype(param_dtype or dtype).name, "loss": f"{loss:.4f}",
                         "ms": f"{seconds * 1e3:.2f}", "temp_gb": f"{mem['temp'] / GB:.3f}",
                         "args_out_gb": f"{(mem['arguments'] + mem['outputs']) / GB:.3f}",
                         "time_vs_xla": f"{seconds / xla_time:.2f}", "temp_vs_xla": f"{mem['temp'] / xla_temp:.3f}"})
    return rows
