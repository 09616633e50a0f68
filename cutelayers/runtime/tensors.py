"""Dtype maps and the fake tensors that CuTe kernels are compiled against.

Every buffer XLA hands a custom call is at least 16-byte aligned, so kernels may assume 16-byte
aligned base pointers (128-bit vector loads); row strides are static, so whether a row start stays
aligned is known at compile time from the feature size.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from cutelayers.kernels.hopper import concrete_dim

BUFFER_ALIGN_BYTES = 16

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def cutlass_dtype(dtype):
    """The CuTe DSL numeric type for a JAX/numpy dtype."""
    import cutlass

    table = {
        "bfloat16": cutlass.BFloat16,
        "float16": cutlass.Float16,
        "float32": cutlass.Float32,
        "int32": cutlass.Int32,
        "int64": cutlass.Int64,
        "uint8": cutlass.Uint8,
        "int8": cutlass.Int8,
        "bool": cutlass.Boolean,
    }
    name = jnp.dtype(dtype).name
    if name not in table:
        raise TypeError(f"dtype {name} has no CuTe DSL equivalent; allowed: {sorted(table)}")
    return table[name]


def _size_key(size):
    """A dynamic dim's key among equal dims: its size, or itself where it is symbolic (under
    jax.export's shape polymorphism, which has no number for it)."""
    number = concrete_dim(size)
    return size if number is None else number


def fake_tensor(dtype, shape: Sequence[int], dynamic: Sequence[bool], symbols: dict):
    """A fake tensor for ``cute.compile`` describing a row-major buffer of ``shape``.

    Dims flagged in ``dynamic`` become symbolic (``cute.sym_int``). ``symbols`` maps a concrete
    size to its SymInt, so dynamic dims that are equal now share one symbol (the compile key
    records that equality pattern).
    """
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    dims = tuple(
        symbols.setdefault(_size_key(size), cute.sym_int()) if dyn else int(size) for size, dyn in zip(shape, dynamic)
    )
    order = tuple(reversed(range(len(dims))))  # last dim fastest: row-major
    return make_fake_compact_tensor(cutlass_dtype(dtype), dims, stride_order=order, assumed_align=BUFFER_ALIGN_BYTES)
