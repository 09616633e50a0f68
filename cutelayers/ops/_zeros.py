"""Zeros that kernels add into, filled where they are used."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros_after(anchor, shape, dtype=jnp.float32, *, out_sharding=None) -> jax.Array:
    """Zeros of ``shape`` and ``dtype`` that XLA fills only once ``anchor`` exists.

    Stream-K's reduce-add stores, the bias sums' atomics and the embedding gradient's scatter add
    into zeros. A plain ``jnp.zeros`` is a broadcast with no inputs, which XLA may schedule
    anywhere: in the gpt2 step it filled every layer's weight-gradient zeros in one fusion and the
    embedding gradient's 147 MiB early, so all of them were live through the step's memory peak.
    The zero passes through an optimization barrier with ``anchor`` (an operand of the kernel
    that adds into the result, so it exists by then; the barrier copies nothing), which ties
    the fill to its use.
    """
    zero, _ = jax.lax.optimization_barrier((jnp.zeros((), dtype), anchor))
    return jnp.full(shape, zero, dtype, out_sharding=out_sharding)
