"""User kernels for tests/test_cute_call.py: CuTe DSL code, imported by its fixture once the `cute`
marker has let a test run (the test module itself imports no CuTe)."""

import cutlass
import jax
from cutlass import cute

import cutelayers as cl


@cute.kernel
def add_kernel(x: cute.Tensor, y: cute.Tensor, amount: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < x.shape[0]:
        y[i] = x[i] + amount


@cute.jit
def add_launcher(stream, x: cute.Tensor, y: cute.Tensor, *, amount: cutlass.Constexpr = 1.0):
    add_kernel(x, y, amount).launch(grid=[cute.ceil_div(x.shape[0], 128), 1, 1], block=[128, 1, 1], stream=stream)


@cute.jit
def add_in_place_launcher(stream, x: cute.Tensor, *, amount: cutlass.Constexpr = 1.0):
    add_kernel(x, x, amount).launch(grid=[cute.ceil_div(x.shape[0], 128), 1, 1], block=[128, 1, 1], stream=stream)


def add(x, amount=1.0, **kw):
    return cl.cute_call(add_launcher, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="add",
                        reference=lambda x, amount: x + amount, amount=amount, **kw)(x)


@cute.kernel
def copy_rows_kernel(src: cute.Tensor, dst: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    for col in cutlass.range(tidx, src.shape[1], 128):
        dst[row, col] = src[row, col]


@cute.jit
def copy_rows_launcher(stream, src: cute.Tensor, dst: cute.Tensor):
    """dst[r, c] = src[r, c]: with input_modes=(1, 0), src is x seen as x.T (no copy)."""
    copy_rows_kernel(src, dst).launch(grid=[dst.shape[0], 1, 1], block=[128, 1, 1], stream=stream)


def transpose_call(x):
    return cl.cute_call(copy_rows_launcher, out_shape=jax.ShapeDtypeStruct(x.shape[::-1], x.dtype),
                        input_modes=[(1, 0)], dynamic_dims=[(0,), (1,)], name="transpose_view",
                        reference=lambda x: x.T)(x)


@cute.jit
def add_launcher_positional(stream, x: cute.Tensor, y: cute.Tensor, amount: cutlass.Constexpr = 1.0):
    """add_launcher with its constant a plain parameter (passed by keyword all the same)."""
    add_kernel(x, y, amount).launch(grid=[cute.ceil_div(x.shape[0], 128), 1, 1], block=[128, 1, 1], stream=stream)
