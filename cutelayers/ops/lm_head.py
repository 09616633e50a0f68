"""Language-model head and loss without the logits: ``linear_cross_entropy(h, kernel, labels)``.

    loss[t] = logsumexp(z[t]) - z[t, labels[t]],    z = h @ kernel + bias

Composed from existing kernels -- the GEMMs of :mod:`cutelayers.ops.linear` and the cross-entropy
kernels of :mod:`cutelayers.ops.softmax` -- over chunks of tokens with ``jax.lax.scan``, so at most
one chunk's logits (chunk × V) exist at a time, never the (tokens, V) array.

The chunks are strided: the tokens, viewed as (rows, chunks) -- a free reshape -- go to chunk
``token % chunks``; the loops read chunk ``c`` of h as column ``c`` of that view and write dh's in
place the same way. Under ``jax.jit`` with row-sharded tokens (a batch-axis ``NamedSharding``)
the sharding then lands on the rows, within every chunk, and each device runs every chunk on its
own tokens; contiguous chunks would put it on the scanned axis, and XLA would gather the tokens to
loop over them. That needs the rows to split evenly over the devices: the chunk count must divide
each device's token count (:func:`chunk_layout` picks such counts where it can; chunks smaller
than the device count never can). A chunk then spans the devices, each computing rows / devices
of it. Reading column ``c`` copies one chunk, as slicing a contiguous chunk does: neither h nor dh
is transposed. Where the chunk count divides the last leading axis (the sequence) the rows keep
the leading axes: (batch, sequence) tokens are viewed as (batch, sequence / chunks, chunks), so a
sequence axis sharded too stays sharded (each kernel call sees the rows as those axes:
:class:`cutelayers.runtime.sharding.Views`); flattened, no sharding of the rows could express it.

* ``reduction="none"``: forward, per chunk, ``z = h_c @ kernel + bias`` (the fused GEMM), then
  the cross-entropy forward kernel gives the per-token ``lse`` and loss. Saved for the backward: h,
  labels, kernel, bias and lse (tokens,) in float32 -- no logits. Backward, per chunk: recompute
  ``z`` (one more GEMM: the price of not storing the logits); the cross-entropy backward kernel
  gives ``dz`` from (z, labels, lse, dloss); ``dh_c = dz @ kernelᵀ`` (kernel read as stored);
  ``dkernel += h_cᵀ @ dz`` and ``dbias += sum(dz)``, accumulated in float32 in the scan's carry
  (the dkernel GEMM adds its product into the carry as it stores: no pass over (H, V) of its own).
* ``"mean"`` / ``"sum"``: the loss is a weighted total, so every token's cotangent is the same
  scalar ``g`` (times 1 / count for the mean) -- known up to that factor in the forward. When
  differentiated, the forward therefore computes the gradients of the weighted sum while it has
  each chunk's logits, with dloss = 1 per token (1 / count for the mean), 0 per padded row, and the
  backward only scales them by ``g`` -- a pass XLA drops when ``g`` is the constant 1 of a
  differentiated loss: three GEMMs per chunk instead of four (6·T·H·V FLOPs, as the unfused head,
  instead of 8). Between the logits GEMM and the dh / dkernel GEMMs one fused cross-entropy kernel gives
  lse, the loss and dz in one pass over the logits (a streamed row is kept in shared memory for
  its second pass: :class:`cutelayers.ops.softmax.CrossEntropyWithGrad`), dz over the logits'
  buffer. Saved: dh (tokens, H) in h's dtype, dkernel and dbias in float32. Without
  differentiation only the forward GEMM and the cross-entropy forward kernel run.
* The **exp path** -- bfloat16, a kernel (either layout) without bias or soft cap; every
  reduction -- has no cross-entropy pass: the logits GEMM's epilogue stores ``P = exp(z)`` (bf16,
  whose exponent range is float32's: no shift is needed for logits within about +-60) and its
  float32 row sums S (:func:`cutelayers.ops.linear.exp_logits`). Then lse = log S, the label's
  logit is log P[y], and ``dz = s (P - c onehot)`` with ``s = w (1 + 2 z_loss lse) / S`` and
  ``c = S / (1 + 2 z_loss lse)``: one in-place scatter-add of ``-c`` into each row's label entry,
  dh = s * (P @ kernelᵀ), dkernel += (s * h)ᵀ @ P -- the same two GEMMs, each logit exp'd once
  (a (V, H) table: the logits GEMM reads it as stored, as the dh GEMM does). Label smoothing a
  over V classes subtracts a times the row's mean logit, ``h . k / V`` with ``k`` the kernel's
  column sums (a pass over the kernel), from the loss, and puts ``-(1 - a) S / (1 + 2
  z_loss lse)`` into the label's entry; its gradient's uniform part ``u = -w a / V`` in every
  class is rank-one: ``dh += u k`` in the pass that scales dh, and ``dkernel += sum_t u_t h_t``
  in every column, summed over the chunks and added once (a pass over the float32 dkernel). A
  vocabulary padded for the kernels (:func:`_pad_vocabulary`) stays on it: its GEMMs count only
  the vocabulary's columns (``exp_columns``), the padding's P is 0 and its kernel columns are
  zero.
  A row whose S leaves [e^-60, e^60] or whose label's P underflows (logits past the epilogue's
  clamp at 80, or a label beyond ~69 nats) is flagged, and two more launches of the exp GEMM,
  each running only the tiles that hold a flagged row (:func:`cutelayers.ops.linear.exp_logits_fix`),
  give it exactly: the first its max logit and its label's logit from the float32 accumulators,
  the second ``P = exp(z - max)`` and S in place, so lse = max + log S with S in [1, V]. When no
  row is flagged they cost two near-empty launches a chunk; nothing depends on the data's values
  on the host (a loop over the flagged rows made the host wait for the device every call:
  docs/lm_head_notes.md). Per-token losses (``"none"``) and a forward without differentiation
  take lse and the loss from the same chunks; the backward of ``"none"`` is the weighted total's
  exp-path gradients with the cotangents as the weights.

Memory: O(chunk × V) for the logits plus the float32 (H, V) gradient accumulator (for float32
parameters the gradient itself, returned as it is). The chunk is at
most 4096 tokens and 2 GiB of float32-equivalent logits unless ``chunk_size`` says otherwise (a
bf16 chunk and its gradient are half that: 2 GiB at V = 131072); the tokens are split into
equal chunks, a number that divides the tokens where one is near (see :func:`chunk_layout`), else
padding fewer rows than there are chunks.

Kernels run where :func:`cutelayers.ops.fused_linear`'s do (bfloat16 / float16, H and V multiples
of 8); elsewhere the same decomposition runs as XLA GEMMs.

vmap: h / labels batch dims fold into the kernels' rows (:mod:`cutelayers.ops._batching`, around
the kernel calls); unlike ``fused_linear`` (whose batching folds before differentiation), ``grad``
of a vmapped call computes a per-example dkernel (B, H, V) before summing -- call the op on the
whole batch (any leading shape works) rather than under ``jax.vmap`` when training.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cutelayers import backend as _backend
from cutelayers.kernels.hopper import concrete_dim
from cutelayers.ops._rowwise import check_int
from cutelayers.ops.linear import (
    ALIGN_ELEMENTS,
    check_linear_operands,
    compute_params,
    exp_logits,
    exp_logits_fix,
    forward_fn,
    fused_linear,
    input_grad_fn,
    kernels_apply,
    weight_grad_fn,
)
from cutelayers.ops.softmax import (
    check_labels,
    check_loss_options,
    cross_entropy_kernels,
)
from cutelayers.runtime.sharding import explicit_sharding, typed_like, vary_like

F32 = jnp.float32
# The default chunk: CHUNK_ROWS tokens, fewer where their float32-equivalent logits would pass
# LOGITS_CHUNK_BYTES. Each chunk reads and writes the float32 (H, V) dkernel sum once, 8·H·V
# bytes against its 6·rows·H·V FLOPs: ~300 / rows of the GEMM time on an H100, so 4096 rows keep
# it under 8 % (the H100 sweep in docs/benchmarks.md: 1024 → 4096 rows took the GPT-2 head from
# 11.3 to 8.6 ms and the Llama-size one from 50 to 43 ms).
CHUNK_ROWS = 4096
LOGITS_CHUNK_BYTES = 2 * 2**30
REDUCTIONS = ("mean", "sum", "none")
# The exp path (module docstring) holds a row whose sum of exp(logits) lies in
# [e^-EXP_RANGE, e^EXP_RANGE] and whose label's exp(logit) is at least LABEL_EXP_MIN (a bf16
# normal: its log is the label's logit to 2^-9) in its first pass; any other row takes the
# second, shifted by its max logit.
EXP_RANGE = 60.0
LABEL_EXP_MIN = 1e-30
KERNEL_LAYOUTS = ("hv", "vh")
# The kernels take a vocabulary padded to a multiple of PADDED_VOCAB_MULTIPLE (:func:`_pad_vocabulary`):
# TMA needs 16-byte rows (V a multiple of 8), and rows of 16-bit logits and kernel columns that span
# whole 128-byte lines run the logits GEMM faster -- at 16384 x 768 the head took 0.58-0.76 ms (9-11 %)
# less a call at V = 50264 / 50280 padded to 50304 than unpadded (H100, docs/benchmarks.md,
# seventieth session).
PADDED_VOCAB_MULTIPLE = 64


class ExpChunk(NamedTuple):
    """One chunk on the exp path (:func:`_chunked_fns`): P = exp(logits - shift) (*rows, V) in
    bf16, each row's label (0 where it is not one of the vocabulary), S, lse = shift + log S and
    the loss (float32, rows), which rows count (``counted``: not ignored, their label in the
    vocabulary) and which have a label outside it (``unknown``)."""

    p: jax.Array
    y_safe: jax.Array
    s: jax.Array
    lse: jax.Array
    loss: jax.Array
    counted: jax.Array
    unknown: jax.Array


def chunk_layout(lead: tuple[int, ...], vocab: int, chunk_size: int | None) -> tuple[int, int]:
    """(number of chunks, rows per chunk) covering tokens of shape ``lead`` with equal chunks of
    at most ``chunk_size`` rows (default: ``CHUNK_ROWS``, fewer above ``LOGITS_CHUNK_BYTES`` of
    float32 logits).

    Row-sharded tokens stay on their devices when the chunk count divides every device's token
    count (module docstring); padding breaks that. So the count is the first, from the fewest
    chunks up to twice that, which divides the tokens of one leading index (``lead[1:]``: then
    any even sharding of the leading axis, e.g. the batch, qualifies); else the first which
    divides all the tokens; else (e.g. a prime token count) the fewest chunks, padded. A symbolic
    token count (``jax.export``'s shape polymorphism) is one chunk: no count can be chosen for it,
    so that program holds all the tokens' logits at once.
    """
    tokens, per_leading_index = math.prod(lead), math.prod(lead[1:])
    if concrete_dim(tokens) is None:
        return 1, tokens
    max_rows = chunk_size if chunk_size is not None else max(1, min(CHUNK_ROWS, LOGITS_CHUNK_BYTES // (4 * vocab)))
    fewest = -(-tokens // max_rows)
    near = range(fewest, min(2 * fewest, tokens) + 1)
    dividing = itertools.chain((n for n in near if per_leading_index % n == 0),
                               (n for n in near if tokens % n == 0))
    n_chunks = next(dividing, fewest)
    return n_chunks, -(-tokens // n_chunks)


def strided_rows(lead: tuple[int, ...], n_chunks: int, rows: int) -> tuple[int, ...]:
    """The rows' shape of the strided layout (module docstring) of tokens of shape ``lead`` in
    ``n_chunks`` chunks of ``rows``: the leading axes, the last divided by the chunk count, where
    it divides that axis; else ``(rows,)`` (one flat axis, padded)."""
    if len(lead) > 1 and concrete_dim(lead[-1]) is not None and lead[-1] % n_chunks == 0:
        return (*lead[:-1], lead[-1] // n_chunks)
    return (rows,)


def _chunk(a, c, row_rank: int):
    """Chunk ``c`` of a token-major (*rows, chunks, ...) array with ``row_rank`` row axes: (*rows, ...)."""
    return jax.lax.dynamic_index_in_dim(a, c, axis=row_rank, keepdims=False)


def _chunk_major(a):
    """The scan's (chunks, *rows) stack of a per-row result as the strided (*rows, chunks)."""
    return jnp.moveaxis(a, 0, -1)


def _at_labels(y):
    """The index of each row's entry ``y`` in a (*rows, V) array (gather or in-place update)."""
    # jnp.indices(sparse=True), but for a symbolic row count too (jax.export)
    return (*(jax.lax.broadcasted_iota(jnp.int32, tuple(n if i == d else 1 for i, n in enumerate(y.shape)), d)
              for d in range(y.ndim)), y)


def _zeros_of_type(a, dtype=None):
    """Zeros with ``a``'s type: its shape, its sharding over ``Explicit`` mesh axes (which
    ``jnp.zeros_like`` drops unless a mesh is set with ``jax.set_mesh``; jax's scan makes its
    outputs the same way) and, inside ``jax.shard_map``, the manual axes it varies over."""
    with jax.sharding.use_abstract_mesh(jax.typeof(a).sharding.mesh):
        return jnp.zeros_like(a, dtype)


def _takes_exp_path(use_kernels: bool, options: tuple[float, float, float], has_bias: bool, dtype) -> bool:
    """Whether a call runs the exp path (module docstring): the kernels, no soft cap, no bias, and
    bfloat16 (float16's exponents stop at e^11)."""
    return use_kernels and options[2] == 0.0 and not has_bias and dtype == jnp.bfloat16


@functools.cache
def _chunked_fns(ignore_index, options: tuple[float, float, float], vocab_major: bool, use_kernels: bool,
                 f32_params: bool, exp_columns: int = 0, row_rank: int = 1):
    """``(losses, weighted_total)`` over h (*R, C, H), labels (*R, C) in the strided layout (chunk
    ``c`` is column ``c``; R the ``row_rank`` row axes of :func:`strided_rows`), kernel (H, V) --
    (V, H) if ``vocab_major`` --, bias (V,) | None, in h's
    dtype or, with ``f32_params``, float32 (cast for the GEMMs; their gradients are the float32
    sums themselves, no cast); the cross-entropy ``options`` (smoothing, z_loss, soft_cap) of
    :func:`check_loss_options`; ``exp_columns`` (0: all V) the vocabulary's columns of a kernel
    padded for the exp path (:func:`_pad_vocabulary`), which counts no others:

    * ``losses(h, labels, kernel, bias)``: (per-token losses (*R, C), lse (C, *R)) float32; the
      backward recomputes each chunk's logits;
    * ``weighted_total(h, labels, kernel, bias, weights)``: (``sum(weights * losses)``, lse)
      for constant (*R, C) float32 weights; its forward computes the gradients too (module
      docstring). The lse output has no gradient (its cotangent is dropped).
    """
    # a chunk's logits die in the cross-entropy gradient kernels: dz takes their buffer
    ce_forward, ce_backward, ce_with_grad = cross_entropy_kernels(ignore_index, *options, in_place=True)
    smoothing, z_loss = options[:2]
    plain_gemm, input_grad = forward_fn("none", False, use_kernels), input_grad_fn(use_kernels)
    weight_grad = weight_grad_fn(use_kernels, f32_out=True)
    # A (V, H) kernel (a tied embedding table) swaps the roles of the forward and dx GEMMs and
    # of dkernel's operands; every GEMM reads the table as stored.
    row_axes = tuple(range(row_rank))
    chunk = functools.partial(_chunk, row_rank=row_rank)

    def n_chunks(h) -> int:
        return h.shape[row_rank]

    def chunk_logits(h, kernel, bias, c):
        if vocab_major:  # never with a bias (linear_cross_entropy)
            return input_grad(chunk(h, c), kernel)  # h_c @ tableᵀ
        return fused_linear(chunk(h, c), kernel, bias)  # the bias in the GEMM's epilogue

    def chunk_input_grad(dz, kernel):
        return plain_gemm(dz, kernel, None, None)[0] if vocab_major else input_grad(dz, kernel)

    def add_kernel_grad(dkernel, h_c, dz):
        """dkernel + the chunk's gradient in float32, added by the GEMM as it stores; the chunk's
        gradient alone for ``dkernel`` None (the first chunk: no zeros to add into)."""
        operands = (dz, h_c) if vocab_major else (h_c, dz)
        running = () if dkernel is None else (dkernel[None],)
        return weight_grad(*(a[None] for a in operands), *running)[0]

    def add_chunk_grads(grads, h, kernel, bias, c, dz, h_c=None, row_scale=None, uniform=None):
        """Adds chunk ``c``'s gradients, given its logits' gradient ``dz``, to (dh, dkernel, dbias):
        for ``grads`` None (the first chunk) they start them. ``h_c``: the chunk's rows of h, if
        not read from h here. ``row_scale`` (*R,) float32: the gradient is diag(row_scale) dz (the
        exp path's P), so dh_c is scaled after its GEMM and h_c before dkernel's; a row of scale 0
        adds nothing (its dz may not be finite). ``uniform``: (u (*R,), the kernel's column sums
        (H,)), both float32, for a gradient that also holds u_t in every column of row t (label
        smoothing on the exp path): dh_t gains u_t times the column sums here; the kernel's
        gradient gains sum_t u_t h_t in every column, which the caller adds once."""
        dh, dkernel, dbias = grads or (_zeros_of_type(h), None, None)
        h_c = chunk(h, c) if h_c is None else h_c
        dh_c = chunk_input_grad(dz, kernel)
        if row_scale is not None:
            kept = (row_scale != 0.0)[..., None]
            dh_c = jnp.where(kept, dh_c.astype(F32) * row_scale[..., None], 0.0)
            if uniform is not None:
                dh_c += uniform[0][..., None] * uniform[1]
            dh_c = dh_c.astype(h.dtype)
            h_c = (h_c.astype(F32) * row_scale[..., None]).astype(h.dtype)
        # dh_c written in place into its column: stacking (C, R, H) would need a transpose
        dh = jax.lax.dynamic_update_index_in_dim(dh, dh_c, c, axis=row_rank)
        dkernel = add_kernel_grad(dkernel, h_c, dz)
        if bias is not None:
            chunk_dbias = jnp.sum(dz.astype(F32), axis=row_axes)
            dbias = chunk_dbias if dbias is None else dbias + chunk_dbias
        return dh, dkernel, dbias

    def scan_chunks(step, xs):
        """``jax.lax.scan(step, ...)`` over the chunks, whose gradients ``step`` adds up: the
        first runs before the loop with a None carry, so its gradients start the sums (no zeros
        to add into, no pass over the (H, V) float32 dkernel to make them)."""
        first = jax.tree.map(lambda a: a[0], xs)
        carry, y = step(None, first)
        carry, ys = jax.lax.scan(step, carry, jax.tree.map(lambda a: a[1:], xs))
        return carry, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), y, ys)

    def cotangents(grads, params, scale=None):
        """(dh, dlabels, dkernel, dbias) in the primals' dtypes (the parameters': h's, or float32)
        and, over Explicit axes, the parameters' shardings (``params``: kernel, bias), times
        ``scale`` (in float32)."""
        dh, dkernel, dbias = grads
        param_dtype = F32 if f32_params else dh.dtype
        if scale is not None:
            dh = (dh.astype(F32) * scale).astype(dh.dtype)
            dkernel = dkernel * scale
            dbias = None if dbias is None else dbias * scale
        dparams = (dkernel.astype(param_dtype), None if dbias is None else dbias.astype(param_dtype))
        return dh, None, *typed_like(params, dparams)

    def takes_exp_path(h, bias) -> bool:
        return _takes_exp_path(use_kernels, options, bias is not None, h.dtype)

    def forward(h, labels, kernel, bias):
        if takes_exp_path(h, bias):
            return exp_forward(h, labels, kernel)

        def step(_, c):
            return None, ce_forward(chunk_logits(h, kernel, bias, c), chunk(labels, c))

        _, (lse, loss) = jax.lax.scan(step, None, jnp.arange(n_chunks(h)))
        return lse, _chunk_major(loss)  # lse stays chunk-major (C, *R): the backward scans over it

    @jax.custom_vjp
    def losses(h, labels, kernel, bias):
        lse, loss = forward(h, labels, *compute_params(h, kernel, bias))
        return loss, lse

    def losses_fwd(h, labels, kernel, bias):
        lse, loss = forward(h, labels, *compute_params(h, kernel, bias))
        # the parameters as given (alive anyway): cast again in the backward, not kept cast
        return (loss, lse), (h, labels, kernel, bias, lse)

    def losses_bwd(res, cotangents_out):
        h, labels, kernel, bias, lse = res
        kernel, bias = compute_params(h, kernel, bias)
        dloss = cotangents_out[0].astype(F32)  # lse's is dropped (the op stops its gradient)
        if takes_exp_path(h, bias):  # the weighted total's gradients, the cotangents its weights
            return cotangents(exp_total_fwd(h, labels, kernel, dloss)[1], (kernel, bias))

        def step(grads, xs):
            c, lse_c = xs
            dz = ce_backward(chunk_logits(h, kernel, bias, c), chunk(labels, c), lse_c, chunk(dloss, c))
            return add_chunk_grads(grads, h, kernel, bias, c, dz), ()

        grads, _ = scan_chunks(step, (jnp.arange(n_chunks(h)), lse))
        return cotangents(grads, (kernel, bias))

    losses.defvjp(losses_fwd, losses_bwd)

    @jax.custom_vjp
    def weighted_total(h, labels, kernel, bias, weights):
        lse, loss = forward(h, labels, *compute_params(h, kernel, bias))
        return jnp.sum(loss * weights), lse

    def total_fwd(h, labels, kernel, bias, weights):
        params = (kernel, bias)  # as passed: the backward reads their types alone (the cotangents')
        kernel, bias = compute_params(h, kernel, bias)
        if takes_exp_path(h, bias):
            out, grads = exp_total_fwd(h, labels, kernel, weights)
            return out, (grads, params)

        def step(carry, c):
            grads, total = carry or (None, None)
            w_c = chunk(weights, c)
            # lse, loss and dz in one pass over the chunk's logits: the weights are the dloss
            lse_c, loss_c, dz = ce_with_grad(chunk_logits(h, kernel, bias, c), chunk(labels, c), w_c)
            grads = add_chunk_grads(grads, h, kernel, bias, c, dz)
            chunk_total = jnp.sum(loss_c * w_c)  # varies as the weights do inside shard_map
            return (grads, chunk_total if total is None else total + chunk_total), lse_c

        (grads, total), lse = scan_chunks(step, jnp.arange(n_chunks(h)))
        return (total, lse), (grads, params)

    def column_sums(kernel):
        """The kernel's columns (a (V, H) table's rows) summed, (H,) float32, for label smoothing:
        h_t . sums is the sum of row t's logits, and the smoothing's rank-one terms (module
        docstring) read it; a padded vocabulary's columns are zero. None without smoothing."""
        return jnp.sum(kernel.astype(F32), axis=0 if vocab_major else 1) if smoothing else None

    def classes(kernel) -> int:
        return exp_columns or kernel.shape[0 if vocab_major else 1]

    def exp_chunk(h_c, y_c, kernel, sums_of_columns=None) -> ExpChunk:
        """One chunk's exp GEMM (P and its row sums S), its two passes over the rows out of the
        exponential's range, and what the exp path reads of them (module docstring);
        ``sums_of_columns``: :func:`column_sums` of the kernel, with label smoothing."""
        valid = jnp.ones(y_c.shape, bool) if ignore_index is None else y_c != ignore_index
        p, sums = exp_logits(h_c, kernel, kernel_nk=vocab_major, columns=exp_columns)
        s = jnp.sum(sums, axis=-1)
        # a label outside the vocabulary makes its token's loss and gradients NaN
        known = valid & (y_c >= 0) & (y_c < p.shape[-1])
        y_safe = jnp.where(known, y_c, 0)
        # The label's P read before anything else: past the barrier no fusion reads P as the exp
        # GEMM wrote it, so the second pass and the scatter-add into the label entries
        # (exp_total_fwd) update P in place. Without it XLA may fuse this gather into a consumer
        # after an update and keep a copy of P: a second chunk of scratch (tests/test_heads_bench.py).
        p_y = p.at[_at_labels(y_safe)].get(out_sharding=explicit_sharding(y_safe)).astype(F32)
        p, p_y = jax.lax.optimization_barrier((p, p_y))
        out = ~((s >= math.exp(-EXP_RANGE)) & (s <= math.exp(EXP_RANGE)) & (~known | (p_y >= LABEL_EXP_MIN)))
        # The rows out of range, again: a pass that finds each one's max logit and its label's
        # logit (exact, from the float32 accumulators), then one with the max as the shift, so
        # that the max maps to 1 and S to [1, V]; the other rows' P stays as it was.
        y_fix = jnp.where(known, y_c, -1)
        p, _, top, at_label = exp_logits_fix(h_c, kernel, p, out, y_fix, jnp.zeros_like(s), kernel_nk=vocab_major,
                                             columns=exp_columns)
        shift = jnp.where(out, jnp.max(top, axis=-1), 0.0)
        p, sums, _, _ = exp_logits_fix(h_c, kernel, p, out, y_fix, shift, kernel_nk=vocab_major, columns=exp_columns)
        s = jnp.where(out, jnp.sum(sums, axis=-1), s)
        lse = shift + jnp.log(s)
        z_y = jnp.where(out, jnp.max(at_label, axis=-1), jnp.log(jnp.where(out, 1.0, p_y)))
        counted, unknown = valid & known, valid & ~known
        loss = lse - (1.0 - smoothing) * z_y + z_loss * lse**2
        if smoothing:  # minus a times the mean logit, h_t . (column sums) / V: no pass over P
            loss -= smoothing / classes(kernel) * jnp.sum(h_c.astype(F32) * sums_of_columns, axis=-1)
        loss = jnp.where(unknown, jnp.nan, jnp.where(counted, loss, 0.0))
        return ExpChunk(p, y_safe, s, lse, loss, counted, unknown)

    def exp_forward(h, labels, kernel):
        """forward's exp path: per chunk the exp GEMM's row sums give lse and the loss."""
        sums_of_columns = column_sums(kernel)

        def step(_, c):
            part = exp_chunk(chunk(h, c), chunk(labels, c), kernel, sums_of_columns)
            return None, (part.lse, part.loss)

        _, (lse, loss) = jax.lax.scan(step, None, jnp.arange(n_chunks(h)))
        return lse, _chunk_major(loss)

    def exp_total_fwd(h, labels, kernel, weights):
        """total_fwd's exp path (module docstring): per chunk one GEMM gives P = exp(z - shift)
        and its row sums S; dz = s (P - c onehot) + u with s = w (1 + 2 z_loss lse) / S, c = (1 -
        a) S / (1 + 2 z_loss lse) and, with label smoothing a, u = -w a / V in every column, so
        the label's entry of P takes -c in place and the dh / dkernel GEMMs read P (dh scaled
        after, h scaled before); u's rank-one terms are added beside them."""
        sums_of_columns = column_sums(kernel)

        def step(carry, c):
            grads, total, smoothed = carry or (None, None, None)
            h_c, y_c = chunk(h, c), chunk(labels, c)
            if grads is not None:  # this chunk's P only once the last one's GEMMs have read theirs
                h_c, grads = jax.lax.optimization_barrier((h_c, grads))
            part = exp_chunk(h_c, y_c, kernel, sums_of_columns)
            factor = 1.0 + 2.0 * z_loss * part.lse
            w_c = jnp.where(part.counted, chunk(weights, c), 0.0)
            # a label outside the vocabulary: NaN gradients, as its loss
            scale = jnp.where(part.unknown, jnp.nan, w_c * factor / part.s)
            label_entry = jnp.where(part.counted, -(1.0 - smoothing) * part.s / factor, 0.0)
            p = part.p.at[_at_labels(part.y_safe)].add(label_entry.astype(part.p.dtype),
                                                       out_sharding=explicit_sharding(part.p))
            uniform = None
            if smoothing:
                u = -smoothing / classes(kernel) * w_c
                uniform = (u, sums_of_columns)
                chunk_smoothed = jnp.sum(u[..., None] * h_c.astype(F32), axis=row_axes)
                smoothed = chunk_smoothed if smoothed is None else smoothed + chunk_smoothed
            grads = add_chunk_grads(grads, h, kernel, None, c, p, h_c=h_c, row_scale=scale, uniform=uniform)
            chunk_total = jnp.sum(part.loss * chunk(weights, c))
            return (grads, chunk_total if total is None else total + chunk_total, smoothed), part.lse

        ((dh, dkernel, _), total, smoothed), lse = scan_chunks(step, jnp.arange(n_chunks(h)))
        if smoothing:  # sum_t u_t h_t in every column (a (V, H) table's every row), once for all chunks
            dkernel = dkernel + (smoothed[None, :] if vocab_major else smoothed[:, None])
        return (total, lse), (dh, dkernel, None)

    def total_bwd(res, cotangents_out):
        grads, params = res
        return *cotangents(grads, params, scale=cotangents_out[0]), None

    weighted_total.defvjp(total_fwd, total_bwd)
    return losses, weighted_total


def _pad_vocabulary(kernel, bias, labels, ignore_index, vocab_major: bool, vocab_pad: int, mask_by_bias: bool):
    """A vocabulary V not a multiple of :data:`PADDED_VOCAB_MULTIPLE` -- GPT-2's 50257 --
    padded for the kernels: ``vocab_pad`` zero columns of the kernel (zero rows of a (V, H)
    table), left out of the loss by the exp path's GEMMs (``exp_columns``: their P is 0, nothing
    sums them) or, ``mask_by_bias``, by a bias of -inf there -- exp(-inf) adds nothing to a row's
    sums and its gradient is 0 -- so the padded head's loss and gradients are the head's, and
    autodiff slices the padding off the kernel's and the bias's gradients. (A (V, H) table with a
    bias is read transposed: one copy, beside the one its padding makes.) Labels in
    [V, V + vocab_pad) stay outside the vocabulary: NaN losses, as any such label. Not for label
    smoothing off the exp path (a mean over the classes would count the -inf) or soft-capping
    (tanh caps -inf): those run unpadded, on XLA's GEMMs where V is not a multiple of 8. Returns
    (kernel, bias, labels)."""
    vocab = kernel.shape[0] if vocab_major else kernel.shape[1]
    kernel = jnp.pad(kernel, ((0, vocab_pad), (0, 0)) if vocab_major else ((0, 0), (0, vocab_pad)))
    if mask_by_bias:
        dtype = kernel.dtype if bias is None else bias.dtype
        bias = jnp.concatenate([jnp.zeros((vocab,), dtype) if bias is None else bias,
                                jnp.full((vocab_pad,), -jnp.inf, dtype)])
    outside = (labels >= vocab) & (labels < vocab + vocab_pad)
    if ignore_index is not None:
        outside &= labels != ignore_index
    labels = jnp.where(outside, -1 if ignore_index != -1 else vocab + vocab_pad, labels)
    return kernel, bias, labels


def linear_cross_entropy(h, kernel, labels, *, bias=None, ignore_index: int | None = None,
                         reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_soft_cap: float | None = None, kernel_layout: str = "hv",
                         return_lse: bool = False, chunk_size: int | None = None):
    """Cross-entropy of ``h @ kernel + bias`` against integer labels, never materialising the
    (tokens, V) logits; differentiable (h, kernel, bias) and vmappable.

    Args:
      h: (..., H) hidden states, any leading shape (the tokens), bfloat16, float16 or float32.
      kernel: (H, V) in h's dtype (``flax.linen.Dense`` layout), or (V, H) with
        ``kernel_layout="vh"``; or float32 for a bfloat16 / float16 h (mixed precision: cast for the
        GEMMs, and its gradient is the float32 sum over the chunks itself, no cast pass).
      labels: (...) integers in [0, V), h's leading shape. Tokens equal to ``ignore_index`` give
        loss 0 and no gradient; any other label outside [0, V) raises when the labels are
        concrete and gives a NaN loss (and gradient) for that token under jit.
      bias: (V,) in the kernel's dtype, or None.
      ignore_index: label value of tokens to ignore (e.g. -100 or a padding id), or None.
      reduction: "mean" over the tokens that are not ignored (0 when all are), "sum", or "none".
      label_smoothing: a in [0, 1): targets (1 - a) onehot + a / V, as ``optax.smooth_labels``.
      z_loss: coefficient of the auxiliary loss z * lse^2 added per token (PaLM's z-loss).
      logit_soft_cap: None, or c > 0: the loss is of the capped logits c * tanh(logits / c)
        (Gemma 2), capped inside the cross-entropy kernels.
      kernel_layout: "hv" for an (H, V) kernel, or "vh" for a (V, H) one such as a tied
        embedding table (``nnx.Embed.embedding``), which every GEMM reads as stored (no transpose
        copy) -- unless there is a bias: that rides the logits GEMM's epilogue with an (H, V)
        kernel only, so the table is then transposed once per call (cheaper than a bias pass
        over every chunk's logits).
      return_lse: also return the per-token logsumexp of the (capped) logits, float32 with h's
        leading shape, for monitoring; it carries no gradient (``z_loss`` is the differentiable
        way to penalise it).
      chunk_size: tokens per chunk (an int >= 1); default: 4096, fewer where that many tokens'
        float32 logits pass 2 GiB. Larger chunks mean fewer, larger GEMMs and fewer passes over
        the float32 dkernel sum; smaller ones less memory. Under
        ``jax.jit`` with the tokens row-sharded over D devices a chunk spans them, chunk_size / D
        rows on each; with the leading (batch) axis sharded, a chunk_size that is a multiple of D
        and divides the tokens of one batch row keeps every device's tokens on it (see the
        module docstring).

    Returns:
      float32: a scalar for "mean" / "sum", else (...) per-token losses; with ``return_lse`` a
      pair (loss, lse). The logits are computed in h's dtype with float32 accumulation, the loss
      statistics in float32.
    """
    op = "linear_cross_entropy"
    if kernel_layout not in KERNEL_LAYOUTS:
        raise ValueError(f"{op}: kernel_layout must be one of {', '.join(map(repr, KERNEL_LAYOUTS))}; "
                         f"got {kernel_layout!r}")
    vocab_major = kernel_layout == "vh"
    h, kernel, bias, f32_params = check_linear_operands(op, "h", h, kernel, bias, kernel_transposed=vocab_major)
    hidden, vocab = kernel.shape[::-1] if vocab_major else kernel.shape
    lead = h.shape[:-1]
    labels, ignore_index = check_labels(op, labels, ignore_index, lead, vocab, "h's shape without the feature axis")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {', '.join(map(repr, REDUCTIONS))}; got {reduction!r}")
    options = check_loss_options(op, label_smoothing, z_loss, logit_soft_cap)
    if chunk_size is not None:
        chunk_size = check_int(op, "chunk_size", chunk_size)
        if chunk_size < 1:
            raise ValueError(f"{op}: chunk_size must be >= 1; got {chunk_size}")

    tokens = labels.size
    if tokens == 0:
        loss = jnp.zeros(lead if reduction == "none" else (), F32)
        return (loss, jnp.zeros(lead, F32)) if return_lse else loss
    smoothing, _, soft_cap = options
    # The padding is left out by the exp path's GEMMs, else by a -inf bias, which a smoothing sum
    # over the classes or a soft cap would count (_pad_vocabulary)
    exp_eligible = _takes_exp_path(True, options, bias is not None, h.dtype)  # where the kernels run
    paddable = exp_eligible or (smoothing == 0.0 and soft_cap == 0.0)
    vocab_pad = -vocab % PADDED_VOCAB_MULTIPLE if paddable else 0
    use_kernels, why = kernels_apply(h.dtype, hidden, vocab + vocab_pad)
    if not use_kernels:
        if vocab % ALIGN_ELEMENTS and not vocab_pad:
            why += (" (an odd vocabulary is padded for them only without soft-capping, and with label smoothing "
                    "only on the exp path: bfloat16, no bias)")
        _backend.fall_back(op, why)
    exp_columns = 0
    if use_kernels and vocab_pad:
        exp_columns = vocab if exp_eligible else 0
        kernel, bias, labels = _pad_vocabulary(kernel, bias, labels, ignore_index, vocab_major, vocab_pad,
                                               mask_by_bias=not exp_eligible)
        vocab += vocab_pad
    n_chunks, rows = chunk_layout(lead, vocab, chunk_size)
    pad = n_chunks * rows - tokens
    row_shape = strided_rows(lead, n_chunks, rows)

    def strided(a):
        """(*lead, ...) as the strided layout (*row_shape, n_chunks, ...) (module docstring: token
        t is row t // n_chunks of chunk t % n_chunks). Padded tokens are zeros: zero inputs, an
        in-range label; their per-token losses are dropped (zero cotangents) and their weight in a
        total is 0, so they contribute nothing to the gradients."""
        features = a.shape[len(lead):]
        if len(row_shape) == 1:  # through the flat tokens: jax's Explicit types take a merge, then a split
            a = jnp.pad(a.reshape(tokens, *features), ((0, pad),) + ((0, 0),) * len(features))
        return a.reshape(*row_shape, n_chunks, *features)

    h_strided, labels_strided = strided(h), strided(labels)
    if vocab_major and bias is not None:
        kernel, vocab_major = kernel.T, False  # see kernel_layout above
    kernel, bias = vary_like(h, kernel, bias)  # shared by every shard inside shard_map
    per_token, weighted_total = _chunked_fns(ignore_index, options, vocab_major, use_kernels, f32_params, exp_columns,
                                             len(row_shape))

    def per_token_order(a):  # (*R, C) strided -> the tokens' leading shape
        if len(row_shape) > 1:  # (*lead[:-1], S / C, C): no padding, the sequence's parts merged
            return a.reshape(lead)
        return a.reshape(-1)[:tokens].reshape(lead)

    if reduction == "none":
        loss, lse = per_token(h_strided, labels_strided, kernel, bias)
        loss = per_token_order(loss)
    else:
        # weight 1 per token (1 / the counted tokens for a mean), 0 per padded row; laid out (and
        # sharded) as the labels are. The mean's scale rides the weights, not the result: the
        # backward then scales the gradients by the loss's own cotangent alone, which XLA drops
        # where it is the constant 1 of a differentiated loss (no pass over dkernel).
        weight = 1.0
        if reduction == "mean":
            counted = tokens if ignore_index is None else jnp.sum(labels != ignore_index)
            weight = 1.0 / jnp.maximum(counted, 1).astype(F32)
        weights = strided(_zeros_of_type(labels, F32) + weight)
        loss, lse = weighted_total(h_strided, labels_strided, kernel, bias, weights)
    if not return_lse:
        return loss
    return loss, jax.lax.stop_gradient(per_token_order(_chunk_major(lse)))  # lse is chunk-major (C, *R)
