"""Bring your own CuTe kernel: a row-wise scale y[r, :] = x[r, :] * s[r], called through
``cutelayers.cute_call``, differentiated with ``custom_op``, vmapped, and checked against jnp.

    python examples/custom_kernel.py

On a Hopper GPU the kernel runs; elsewhere the jnp reference given to ``cute_call`` runs (and with
``CUTE_DSL_ARCH=sm_90a`` the script also lowers the kernel for CUDA to show it compiles). Writing a
kernel needs the CuTe DSL: ``pip install 'cutelayers[cute]'`` (the other examples run without it).
"""

import cutlass
import jax
import jax.numpy as jnp
import numpy as np
from cutlass import cute

import cutelayers as cl

THREADS = 128


@cute.kernel
def row_scale_kernel(x: cute.Tensor, s: cute.Tensor, y: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    factor = s[row].to(cutlass.Float32)
    for col in cutlass.range(tidx, x.shape[1], THREADS):
        y[row, col] = (x[row, col].to(cutlass.Float32) * factor).to(y.element_type)


@cute.jit
def row_scale_launcher(stream, x: cute.Tensor, s: cute.Tensor, y: cute.Tensor):
    """One CTA per row; x, y: (M, N) with M dynamic; s: (M,)."""
    row_scale_kernel(x, s, y).launch(grid=[x.shape[0], 1, 1], block=[THREADS, 1, 1], stream=stream)


def row_scale_reference(x, s):
    return (x.astype(jnp.float32) * s.astype(jnp.float32)[:, None]).astype(x.dtype)


def row_scale_call(x, s):
    """The kernel on 2-D x (M, N) and s (M,), through cute_call."""
    return cl.cute_call(
        row_scale_launcher,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        name="row_scale",
        reference=row_scale_reference,
    )(x, s)


def _rows(f):
    """Let a 2-D kernel call take any leading shape (rows = all leading dims)."""
    def wrapped(x, s):
        out = f(x.reshape(-1, x.shape[-1]), s.reshape(-1))
        return out.reshape(x.shape)
    return wrapped


def forward(x, s):
    return _rows(row_scale_call)(x, s), (x, s)


def backward(residuals, g):
    x, s = residuals
    dx = _rows(row_scale_call)(g, s)  # the same kernel computes dx = g * s
    ds = jnp.sum(g.astype(jnp.float32) * x.astype(jnp.float32), axis=-1).astype(s.dtype)
    return dx, ds


row_scale = cl.custom_op(forward, backward, rowwise=True)


def main():
    key_x, key_s = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (4, 6, 1000), jnp.float32)
    s = jax.random.normal(key_s, (4, 6), jnp.float32)

    y = jax.jit(row_scale)(x, s)
    np.testing.assert_allclose(y, x * s[..., None], rtol=1e-6)

    loss = lambda x, s: jnp.sum(jnp.tanh(row_scale(x, s)))
    ref_loss = lambda x, s: jnp.sum(jnp.tanh(x * s[..., None]))
    for ours, ref in zip(jax.grad(loss, (0, 1))(x, s), jax.grad(ref_loss, (0, 1))(x, s)):
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-6)

    v = jax.vmap(jax.vmap(row_scale))(x[:, :, None], s[:, :, None])  # nested vmap: one launch
    np.testing.assert_allclose(v[:, :, 0], x * s[..., None], rtol=1e-6)

    print(f"row_scale on {jax.devices()[0].platform}: values, grads and nested vmap match jnp")
    print("cache_info:", {k: vars(v) for k, v in cl.cache_info().items()})


if __name__ == "__main__":
    main()
