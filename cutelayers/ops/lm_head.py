"""Language-model head and loss without the logits: ``linear_cross_entropy(h, kernel, labels)``.

    loss[t] = logsumexp(z[t]) - z[t, labels[t]],    z = h @ kernel + bias

Composed from existing kernels -- the GEMMs of :mod:`cutelayers.ops.linear` and the cross-entropy
kernels of :mod:`cutelayers.ops.softmax` -- over chunks of tokens with ``jax.lax.scan``, so at most
one chunk's logits (chunk × V) exist at a time, never the (tokens, V) array:

* forward, per chunk: ``z = h_c @ kernel + bias`` (the fused GEMM), then the cross-entropy forward
  kernel gives the per-token ``lse`` and loss. Saved for the backward: h, labels, kernel, bias and
  lse (tokens,) in float32 -- no logits.
* backward, per chunk: recompute ``z`` (one more GEMM: the price of not storing the logits); the
  cross-entropy backward kernel gives ``dz`` from (z, labels, lse, dloss); ``dh_c = dz @ kernelᵀ``
  (kernel read as stored); ``dkernel += h_cᵀ @ dz`` and ``dbias += sum(dz)``, accumulated in
  float32 in the scan's carry.

Memory: O(chunk × V) for the logits plus the float32 (H, V) gradient accumulator. The chunk is at
most ~256 MiB of float32 logits unless ``chunk_size`` says otherwise; the tokens are split into
equal chunks, padding fewer rows than there are chunks.

Kernels run where :func:`cutelayers.ops.fused_linear`'s do (bfloat16 / float16, H and V multiples
of 8); elsewhere the same decomposition runs as XLA GEMMs.

vmap: h / labels batch dims fold into the kernels' rows; as for ``fused_linear``, a vmapped
*gradient* computes a per-example dkernel (B, H, V) before summing -- call the op on the whole
batch (any leading shape works) rather than under ``jax.vmap`` when training.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from cutelayers import backend as _backend
from cutelayers.ops.linear import (check_linear_operands, fused_linear, input_grad_fn, kernels_apply,
                                   weight_grad_fn)
from cutelayers.ops.softmax import check_labels, cross_entropy_kernels
from cutelayers.runtime.sharding import vary_like

F32 = jnp.float32
LOGITS_CHUNK_BYTES = 256 * 2**20  # default bound on one chunk's float32 logits
REDUCTIONS = ("mean", "sum", "none")


def chunk_layout(tokens: int, vocab: int, chunk_size: int | None) -> tuple[int, int]:
    """(number of chunks, rows per chunk) covering ``tokens`` rows with equal chunks of at most
    ``chunk_size`` rows (default: ~256 MiB of float32 logits)."""
    max_rows = chunk_size if chunk_size is not None else max(1, LOGITS_CHUNK_BYTES // (4 * vocab))
    n_chunks = -(-tokens // max_rows)
    return n_chunks, -(-tokens // n_chunks)


@functools.cache
def _chunked_loss_fn(ignore_index, use_kernels: bool):
    """Per-token losses (n, C) float32 of chunked h (n, C, H), labels (n, C), kernel (H, V),
    bias (V,) | None, with the chunked backward described in the module docstring."""
    ce_forward, ce_backward = cross_entropy_kernels(ignore_index)
    input_grad, weight_grad = input_grad_fn(use_kernels), weight_grad_fn(use_kernels)

    def forward(h, labels, kernel, bias):
        def step(_, chunk):
            h_c, labels_c = chunk
            return None, ce_forward(fused_linear(h_c, kernel, bias), labels_c)

        _, (lse, loss) = jax.lax.scan(step, None, (h, labels))
        return lse, loss

    @jax.custom_vjp
    def chunked_loss(h, labels, kernel, bias):
        return forward(h, labels, kernel, bias)[1]

    def fwd(h, labels, kernel, bias):
        lse, loss = forward(h, labels, kernel, bias)
        return loss, (h, labels, kernel, bias, lse)

    def bwd(res, dloss):
        h, labels, kernel, bias, lse = res

        def step(carry, chunk):
            dkernel, dbias = carry
            h_c, labels_c, lse_c, dloss_c = chunk
            dz = ce_backward(fused_linear(h_c, kernel, bias), labels_c, lse_c, dloss_c)
            dkernel = dkernel + weight_grad(h_c[None], dz[None])[0].astype(F32)
            if dbias is not None:
                dbias = dbias + jnp.sum(dz.astype(F32), axis=0)
            return (dkernel, dbias), input_grad(dz, kernel)

        # zeros_like: the accumulators take the parameters' type (varying inside shard_map)
        init = (jnp.zeros_like(kernel, F32), None if bias is None else jnp.zeros_like(bias, F32))
        (dkernel, dbias), dh = jax.lax.scan(step, init, (h, labels, lse, dloss.astype(F32)))
        dbias = None if bias is None else dbias.astype(bias.dtype)
        return dh, None, dkernel.astype(kernel.dtype), dbias

    chunked_loss.defvjp(fwd, bwd)
    return chunked_loss


def linear_cross_entropy(h, kernel, labels, *, bias=None, ignore_index: int | None = None,
                         reduction: str = "mean", chunk_size: int | None = None) -> jax.Array:
    """Cross-entropy of ``h @ kernel + bias`` against integer labels, never materialising the
    (tokens, V) logits; differentiable (h, kernel, bias) and vmappable.

    Args:
      h: (..., H) hidden states, any leading shape (the tokens), bfloat16, float16 or float32.
      kernel: (H, V) in h's dtype (``flax.linen.Dense`` layout; for a tied (V, H) embedding
        table pass its transpose).
      labels: (...) integers in [0, V), h's leading shape. Tokens equal to ``ignore_index`` give
        loss 0 and no gradient; any other label outside [0, V) raises when the labels are
        concrete and gives a NaN loss (and gradient) for that token under jit.
      bias: (V,) in h's dtype, or None.
      ignore_index: label value of tokens to ignore (e.g. -100 or a padding id), or None.
      reduction: "mean" over the tokens that are not ignored (0 when all are), "sum", or "none".
      chunk_size: tokens per chunk (an int >= 1); default: as many as fit ~256 MiB of float32
        logits. Larger chunks mean fewer, larger GEMMs; smaller ones less memory.

    Returns:
      float32: a scalar for "mean" / "sum", else (...) per-token losses. The logits are computed
      in h's dtype with float32 accumulation, the loss statistics in float32.
    """
    op = "linear_cross_entropy"
    h, kernel, bias = check_linear_operands(op, "h", h, kernel, bias)
    lead, (hidden, vocab) = h.shape[:-1], kernel.shape
    labels, ignore_index = check_labels(op, labels, ignore_index, lead, vocab, "h's shape without the feature axis")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}; got {reduction!r}")
    if chunk_size is not None:
        try:
            chunk_size = operator.index(chunk_size)
        except TypeError:
            raise TypeError(f"{op}: chunk_size must be an int or None; got {chunk_size!r}") from None
        if chunk_size < 1:
            raise ValueError(f"{op}: chunk_size must be >= 1; got {chunk_size}")

    tokens = labels.size
    if tokens == 0:
        losses = jnp.zeros(lead, F32)
    else:
        use_kernels, why = kernels_apply(h.dtype, hidden, vocab)
        if not use_kernels:
            _backend.log_once("reference", f"{op}: {why}")
        n_chunks, rows = chunk_layout(tokens, vocab, chunk_size)
        pad = n_chunks * rows - tokens
        # padded tokens: zero inputs, an in-range label; their losses are dropped, so they get
        # zero cotangents and contribute nothing to the gradients
        h_chunks = jnp.pad(h.reshape(tokens, hidden), ((0, pad), (0, 0))).reshape(n_chunks, rows, hidden)
        label_chunks = jnp.pad(labels.reshape(tokens), (0, pad)).reshape(n_chunks, rows)
        kernel, bias = vary_like(h, kernel, bias)  # shared by every shard inside shard_map
        losses = _chunked_loss_fn(ignore_index, use_kernels)(h_chunks, label_chunks, kernel, bias)
        losses = losses.reshape(-1)[:tokens].reshape(lead)

    if reduction == "none":
        return losses
    total = jnp.sum(losses)
    if reduction == "sum":
        return total
    counted = tokens if ignore_index is None else jnp.sum(labels != ignore_index)
    return total / jnp.maximum(counted, 1).astype(F32)
