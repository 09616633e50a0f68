"""Transformer MLP block: ``mlp(x, w1, b1, w2, b2, *, activation="gelu", residual=None)``.

    y = act(x @ w1 + b1) @ w2 + b2 + residual

Two fused GEMMs forward (:mod:`cutelayers.ops.linear`'s kernel): fc1 with bias and activation in
its epilogue (also storing the pre-activation ``z1`` when differentiated), fc2 with bias and
residual in its epilogue.

Backward, from the saved (x, w1, z1, w2) -- not the hidden layer ``h = act(z1)``, the block's
largest saved array beside z1 (an (M, H) one: about a quarter of what a GPT-2 block kept outside
attention):

* ``dz1 = (dy @ w2ᵀ) * act'(z1)``: one GEMM whose epilogue reads ``z1`` and applies the activation
  derivative, so ``act'`` costs no pass of its own (``fused_linear`` alone needs one), and writes
  ``h = act(z1)`` again beside dz1 (a second output of the same epilogue, one more (M, H) store);
* ``dw2 = hᵀ @ dy``, ``dx = dz1 @ w1ᵀ``, ``dw1 = xᵀ @ dz1``: the linear op's GEMM kernels;
* ``db2 = sum(dy)``, ``db1 = sum(dz1)`` over rows (from the dw2 / dw1 launches), ``dresidual = dy``.

Kernels run where :func:`cutelayers.ops.linear.kernels_apply` allows for both layers (bfloat16 /
float16, every width a multiple of 8); otherwise the same decomposition runs as XLA GEMMs, logged
once. vmap folds batch dims of x / residual into rows ahead of differentiation, as for
``fused_linear``.

Gated blocks (``activation="swiglu"`` / ``"geglu"``, Llama's and T5 v1.1's feed-forward): w1 holds
the gate and value halves side by side, (K, 2H), and ``h = act(gate) * value`` with act SiLU / GELU
(tanh). fc1's kernel reads w1 in blocks of ``GATED_BLOCK`` columns of each half, so every tile
holds matching gate and value columns and its epilogue writes h (and, differentiated, z (..., 2H)
for the backward); the hidden width must be a multiple of ``GATED_BLOCK`` (else XLA, logged). In
the backward the dh GEMM's epilogue reads z's gate and value blocks and writes both halves of dz1 =
(dh * value * act'(gate), dh * act(gate)) and h = act(gate) * value: no pass of its own, as for the
plain activations.
"""

from __future__ import annotations

import functools

import jax

from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import check_float_array
from cutelayers.ops.linear import (
    check_activation_name,
    check_kernel_layout,
    check_linear_operands,
    check_param_dtypes,
    check_residual,
    choose_kernels,
    compute_params,
    forward_fn,
    fused_linear,
    gated_kernels_apply,
    hashable_precision,
    input_grad_fn,
    is_gated,
    kernels_apply,
    resolve_activation,
    weight_and_bias_grads,
)
from cutelayers.runtime.sharding import typed_like, vary_like


@functools.cache
def _mlp_fn(activation: str, has_residual: bool, use_kernels: bool, precision, kernel_nk: bool, f32_params: bool):
    """The differentiable block for one static configuration; args (x, w1, b1, w2, b2, residual),
    the parameters in x's dtype or, with ``f32_params``, float32 (cast for the GEMMs; their
    gradients float32 from the weight-gradient GEMMs, :func:`cutelayers.ops.linear.compute_params`)."""
    needs_preact = activation != "none"
    fc1 = forward_fn(activation, False, use_kernels, precision, kernel_nk)
    fc1_saving = forward_fn(activation, needs_preact, use_kernels, precision, kernel_nk)
    fc2 = forward_fn("none", False, use_kernels, precision, kernel_nk)
    gated = is_gated(activation)
    hidden_grad = input_grad_fn(use_kernels, precision, activation, kernel_nk)
    input_grad = input_grad_fn(use_kernels, precision, kernel_nk=kernel_nk)
    # over fc1's kernel, whose columns are a gated layer's gate and value halves
    fc1_input_grad = input_grad_fn(use_kernels, precision, kernel_nk=kernel_nk, halves=gated)

    @jax.custom_vjp
    def mlp(x, w1, b1, w2, b2, residual):
        w1, b1, w2, b2 = compute_params(x, w1, b1, w2, b2)
        (h,) = fc1(x, w1, b1, None)
        return fc2(h, w2, b2, residual)[0]

    def fwd(x, w1, b1, w2, b2, residual):
        w1, b1, w2, b2 = compute_params(x, w1, b1, w2, b2)
        h, *z1 = fc1_saving(x, w1, b1, None)
        (y,) = fc2(h, w2, b2, residual)
        # the backward's dh GEMM writes h again from z1: kept only without an activation (h = z1)
        return y, (x, w1, z1[0] if needs_preact else h, w2, b1, b2)

    def bwd(res, dy):
        x, w1, saved, w2, b1, b2 = res
        dz1, h = hidden_grad(dy, w2, saved) if needs_preact else (input_grad(dy, w2), saved)
        dw2, db2 = weight_and_bias_grads(h, dy, kernel_nk, b2 is not None, use_kernels, precision, f32_params)
        dx = fc1_input_grad(dz1, w1)
        dw1, db1 = weight_and_bias_grads(x, dz1, kernel_nk, b1 is not None, use_kernels, precision, f32_params,
                                         halves=gated)
        return dx, *typed_like((w1, b1, w2, b2), (dw1, db1, dw2, db2)), dy if has_residual else None

    mlp.defvjp(fwd, bwd)
    return fold_batch(mlp, shared=(1, 2, 3, 4), per_example=mlp)


def mlp(x, w1, b1=None, w2=None, b2=None, *, activation="gelu", residual=None, precision=None,
        kernel_layout: str = "kn") -> jax.Array:
    """``act(x @ w1 + b1) @ w2 + b2 + residual``: two fused GEMMs, differentiable and vmappable.

    Args:
      x: (..., K), any leading shape, bfloat16 / float16 / float32.
      w1: (K, H) and w2: (H, N), as the kernels of two stacked ``flax.linen.Dense`` layers.
      b1: (H,) or None; b2: (N,) or None. The parameters in x's dtype, or all float32 for a
        bfloat16 / float16 x (mixed precision, as for ``fused_linear``: cast for the GEMMs, their
        gradients in float32).
      activation: the hidden activation, as ``fused_linear``'s (a name, a recognised jax.nn
        function, or any callable, which then runs unfused between two ``fused_linear`` calls), or
        a gated one, ``"swiglu"`` / ``"geglu"``: then w1 is (K, 2H), its first H columns the gate
        and its last H the value, and the hidden layer is ``silu | gelu(gate) * value`` (module
        docstring).
      residual: (..., N) matching x's leading shape, or None.
      precision: for the XLA GEMMs of the jnp path, as in ``fused_linear``.
      kernel_layout: "kn" as above, or "nk" for w1 (H, K) and w2 (N, H) (``equinox.nn.Linear``'s
        weights), read as stored, their gradients in the same layout.

    Returns:
      (..., N) in x's dtype.
    """
    op = "mlp"
    kernel_nk = check_kernel_layout(op, kernel_layout)
    if w2 is None:
        raise TypeError(f"{op}: argument 'w2' is required (the second layer's kernel)")
    x, w1, b1, _ = check_linear_operands(op, "x", x, w1, b1, kernel_transposed=kernel_nk, names=("w1", "b1"))
    gated = is_gated(activation)
    h_width = w1.shape[0 if kernel_nk else 1]
    if gated:
        if h_width % 2:
            raise ValueError(f"{op}: activation {activation!r} takes w1 with its gate and value halves side by side, "
                             f"an even output width; got w1 {tuple(w1.shape)}")
        h_width //= 2
    w2 = check_float_array(op, "w2", w2)
    if w2.ndim != 2 or w2.shape[1 if kernel_nk else 0] != h_width:
        expected = f"(N, {h_width})" if kernel_nk else f"({h_width}, N)"
        raise ValueError(f"{op}: argument 'w2' must have shape {expected} to follow w1 {tuple(w1.shape)}; "
                         f"got {tuple(w2.shape)}")
    n = w2.shape[0 if kernel_nk else 1]
    if b2 is not None:
        b2 = check_float_array(op, "b2", b2)
        if tuple(b2.shape) != (n,):
            raise ValueError(f"{op}: argument 'b2' must have shape ({n},); got {tuple(b2.shape)}")
    f32_params = check_param_dtypes(op, "x", x, w1=w1, b1=b1, w2=w2, b2=b2)
    residual = check_residual(op, residual, x, n)
    check_activation_name(op, activation, gated=True)
    fused, unfused = (activation, None) if gated else resolve_activation(activation)
    if unfused is not None:
        h = unfused(fused_linear(x, w1, b1, precision=precision, kernel_layout=kernel_layout))
        return fused_linear(h, w2, b2, residual=residual, precision=precision, kernel_layout=kernel_layout)
    precision = hashable_precision(precision)
    usable, why = (gated_kernels_apply if gated else kernels_apply)(x.dtype, x.shape[-1], h_width)
    if usable:
        usable, why = kernels_apply(x.dtype, h_width, n)
    use_kernels = choose_kernels(op, usable, why, x, f32_params)
    w1, b1, w2, b2 = vary_like(x, w1, b1, w2, b2)  # shared by every shard inside shard_map
    fn = _mlp_fn(fused, residual is not None, use_kernels, precision, kernel_nk, f32_params)
    return fn(x, w1, b1, w2, b2, residual)
