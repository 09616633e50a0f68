"""A projection whose output is used in equal parts: ``q, k, v = split_linear(x, kernel, bias, parts=3)``.

    (y_0, ..., y_{P-1}) = split(x @ kernel + bias, P, axis=-1)

Attention's q, k and v come out of one projection but go into attention as three arrays. Computed
as one (..., P * d) array they cost a slice in the forward and a concatenation of dq, dk, dv in
the backward: each a full pass over the activations (at GPT-2 size 1.2 ms of a 32 ms step). Here
the GEMM kernel runs the P column blocks of the kernel as *planes*
(:class:`cutelayers.kernels.gemm.Planes`) and no activation-sized array is ever cut or joined:

* forward: y_l = x @ kernel_l + bias_l -- one launch writing the P outputs;
* dx = sum over l of dy_l @ kernel_lᵀ -- one launch whose mainloop runs through every plane's
  contraction into one accumulator;
* dkernel_l = xᵀ @ dy_l -- one launch writing the gradient as the kernel is stored (stream-K
  when the planes' tiles would leave SMs idle);
* dbias_l = the column sums of dy_l, from the same dkernel launch (its idle producer warps).

kernel_l is the column block kernel[:, l * d:(l + 1) * d] (rows for an (N, K) kernel), read in
place through a strided view. The kernels run where :func:`cutelayers.ops.fused_linear`'s do
(bfloat16 / float16, K and d multiples of 8); elsewhere the jnp reference: the same products as
XLA GEMMs, split / concatenated. vmap folds batch dims into rows as ``fused_linear`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import check_int
from cutelayers.ops._zeros import zeros_after
from cutelayers.ops.linear import (
    _ROWS,
    _TRANSPOSED,
    GemmFamily,
    _matmul,
    _weight_grad_einsum,
    as_kn,
    call_gemm,
    check_kernel_layout,
    check_linear_operands,
    choose_kernels,
    column_sum,
    compute_params,
    forward_reference,
    from_rows,
    fused_linear,
    hashable_precision,
    kernel_rows,
    kernels_apply,
    weight_grad_schedule,
)
from cutelayers.runtime.sharding import typed_like, vary_like

# The kernel operand as planes: (K, N) -> (K, P, d), or (N, K) -> (P, d, K) (``kernel_layout="nk"``)
_PLANES_AS_N_K = {False: (2, 0, 1), True: (1, 2, 0)}  # -> (d, K, P): the forward's B, planes in L
_PLANES_AS_K_N = {False: (0, 2, 1), True: (2, 1, 0)}  # -> (K, d, P): dx's B; dkernel's (K, d, P) C
_PLANES_AS_N_K_OUT = (1, 2, 0)  # (P, d, K) -> (d, K, P): an (N, K) kernel's gradient as dkernelᵀ


def as_planes(kernel, parts: int, kernel_nk: bool):
    """The (K, N) -- or (N, K) -- kernel as (K, P, d) -- or (P, d, K) -- (a reshape, no copy)."""
    if kernel_nk:
        return kernel.reshape(parts, -1, kernel.shape[1])
    return kernel.reshape(kernel.shape[0], parts, -1)


def _kernel_factor(kernel_nk: bool) -> tuple:
    return (None, "n", "k") if kernel_nk else ("k", None, "n")


def _kernel_kd(aval, kernel_nk: bool) -> tuple[int, int]:
    """(K, d) of the planar kernel operand."""
    return (aval.shape[2], aval.shape[1]) if kernel_nk else (aval.shape[0], aval.shape[2])


def _split_tuning_key(family, avals):
    dtype, dims = GemmFamily.tuning_key(family, avals)
    return dtype, dims + (("planes", family.parts),)


@dataclasses.dataclass(frozen=True)
class SplitForward(GemmFamily):
    """Kernel family: P outputs y_l (1, M, d) from x (1, M, K), the kernel as planes (K, P, d) --
    (P, d, K) if ``kernel_nk`` -- [, bias (P, d)]; one dtype (bfloat16 / float16)."""

    parts: int
    has_bias: bool
    config: object = None
    kernel_nk: bool = False

    name = "split_linear_fwd"

    @property
    def arg_names(self):
        return ("x", "kernel") + ("bias",) * self.has_bias

    def kinds(self):
        return ("rows", "weight") + ("weight",) * self.has_bias + ("rows",) * self.parts

    def gemm_modes(self, position):
        if position == 1:
            return _PLANES_AS_N_K[self.kernel_nk]
        return (1, 0) if self.kinds()[position] == "weight" else _ROWS  # bias (P, d) -> (d, P)

    def factors(self):
        operands = ((None, "rows", "k"), _kernel_factor(self.kernel_nk)) + ((None, "n"),) * self.has_bias
        return operands, ((None, "rows", "n"),) * self.parts

    def layer_dims(self, avals):
        return _kernel_kd(avals[1], self.kernel_nk)

    def gemm_shape(self, avals):
        k, d = self.layer_dims(avals)
        return avals[0].shape[1], self.parts * d, k

    tuning_key = _split_tuning_key

    def per_shard(self, rule, ctx, x, kernel, *bias):
        if not (bias and ctx.sharded("k")):
            return super().per_shard(rule, ctx, x, kernel, *bias)
        # Row-parallel: the bias joins the summed partial products once, after the psum.
        partial = SplitForward(self.parts, False, self.config, self.kernel_nk).run_local(x, kernel)
        return tuple((ctx.psum(y, {"k"}).astype(jnp.float32) + b.astype(jnp.float32)[None, None]).astype(x.dtype)
                     for y, b in zip(partial, bias[0]))

    def epilogue(self):
        from cutelayers.kernels.gemm import Epilogue

        return Epilogue(has_bias=self.has_bias)

    fused_planes = True

    def planes(self):
        from cutelayers.kernels.gemm import Planes

        return Planes(self.parts, a="shared", b="batched", c="split")

    def out_avals(self, avals):
        x = avals[0]
        d = self.layer_dims(avals)[1]
        return (jax.ShapeDtypeStruct((1, x.shape[1], d), x.dtype),) * self.parts

    def reference(self, x, kernel, *bias):
        y = forward_reference(x[0], _kernel_kn(kernel, self.kernel_nk), bias[0].reshape(-1) if bias else None,
                              None, "none")[0]
        return tuple(part[None] for part in jnp.split(y, self.parts, axis=-1))


@dataclasses.dataclass(frozen=True)
class SplitInputGrad(GemmFamily):
    """Kernel family: dx (1, M, K) = sum over l of dy_l (1, M, d) @ kernel_lᵀ, the kernel as
    planes (K, P, d) -- (P, d, K) if ``kernel_nk``."""

    parts: int
    config: object = None
    kernel_nk: bool = False

    name = "split_linear_dx"

    @property
    def arg_names(self):
        return tuple(f"dy{i}" for i in range(self.parts)) + ("kernel",)

    def kinds(self):
        return ("rows",) * self.parts + ("weight", "rows")

    def gemm_modes(self, position):
        return _PLANES_AS_K_N[self.kernel_nk] if position == self.parts else _ROWS

    def factors(self):
        # every plane's d is the contraction: a column-parallel kernel leaves partial sums
        return ((None, "rows", "n"),) * self.parts + (_kernel_factor(self.kernel_nk),), ((None, "rows", "k"),)

    def layer_dims(self, avals):
        return _kernel_kd(avals[self.parts], self.kernel_nk)

    def gemm_shape(self, avals):
        k, d = self.layer_dims(avals)
        return avals[0].shape[1], k, self.parts * d

    tuning_key = _split_tuning_key

    fused_planes = True

    def planes(self):
        from cutelayers.kernels.gemm import Planes

        return Planes(self.parts, a="split", b="batched", c="shared")

    def out_avals(self, avals):
        dy = avals[0]
        return (jax.ShapeDtypeStruct((1, dy.shape[1], self.layer_dims(avals)[0]), dy.dtype),)

    def reference(self, *operands):
        *dys, kernel = operands
        product = _matmul(jnp.concatenate([dy[0] for dy in dys], axis=-1), _kernel_kn(kernel, self.kernel_nk).T)
        return (product.astype(dys[0].dtype)[None],)


@dataclasses.dataclass(frozen=True)
class SplitWeightGrad(GemmFamily):
    """Kernel family: dkernel as stored -- (K, P, d), or (P, d, K) if ``kernel_nk`` -- from x
    (1, M, K) and the P dy_l (1, M, d), operands in GEMM order: (x, dy...) or (dy..., x) for
    ``kernel_nk`` (whose gradient is dyᵀ @ x). ``stream_k``: its partial tiles meet in a
    workspace (flags operand, scratch result: :attr:`GemmFamily.fixup`), or with ``accumulate``
    are added into a float32 operand of zeros (the result, float32, is that buffer).
    ``with_sums``: also every dy_l's sums over the rows (P, d), float32 -- the bias gradient --
    added by the kernel into a float32 zeros operand before the stream-K one."""

    parts: int
    config: object = None
    kernel_nk: bool = False
    stream_k: bool = False
    with_sums: bool = False
    accumulate: bool = False
    contracts_rows = True

    name = "split_linear_dkernel"

    @property
    def operand_sums(self):
        """The kernel's summed operand: the dys, B of xᵀ @ dy (A of dyᵀ @ x)."""
        return ("a" if self.kernel_nk else "b") if self.with_sums else None

    def second_result_whole_over(self):
        return "k" if self.with_sums else None  # the dys' sums do not involve x's features

    @property
    def arg_names(self):
        dys = tuple(f"dy{i}" for i in range(self.parts))
        return ((dys + ("x",) if self.kernel_nk else ("x",) + dys) + ("sums",) * self.with_sums
                + ("zeros",) * self.accumulate + ("flags",) * self.fixup)

    def kinds(self):
        sums = ("batched_vector",) * self.with_sums
        return (("rows",) * (1 + self.parts) + sums + ("weight",) * self.accumulate + ("scratch",) * self.fixup
                + ("weight",) + sums + ("scratch",) * (2 * self.fixup))

    def gemm_modes(self, position):
        if position <= self.parts:
            return _TRANSPOSED  # (1, M, F) -> (F, M, 1): the rows are the contraction
        if self.kinds()[position] == "batched_vector":
            return (1, 0)  # (P, d) -> (d, P): a plane's sums at its batch index
        return _PLANES_AS_N_K_OUT if self.kernel_nk else _PLANES_AS_K_N[False]

    def factors(self):
        x, dy = (None, "rows", "k"), (None, "rows", "n")
        operands = (dy,) * self.parts + (x,) if self.kernel_nk else (x,) + (dy,) * self.parts
        out = _kernel_factor(self.kernel_nk)
        sums = ((None, "n"),) * self.with_sums
        return operands + sums + (out,) * self.accumulate, (out,) + sums

    def operand_output_aliases(self):
        aliases = ({1 + self.parts: 1} if self.with_sums else {}) | (
            {1 + self.parts + self.with_sums: 0} if self.accumulate else {})
        aliases |= self.flags_alias(2 + self.parts + self.with_sums, 3 + self.with_sums)
        return aliases or None

    def kept_outputs(self, n_outputs):
        return () if self.accumulate else (0,) + (n_outputs - 2,) * self.fixup

    def layer_dims(self, avals):
        x, dy = (avals[self.parts], avals[0]) if self.kernel_nk else (avals[0], avals[1])
        return x.shape[2], dy.shape[2]

    def gemm_shape(self, avals):
        k, d = self.layer_dims(avals)
        return (d, k, avals[0].shape[1]) if self.kernel_nk else (k, d, avals[0].shape[1])

    tuning_key = _split_tuning_key

    fused_planes = True

    def planes(self):
        from cutelayers.kernels.gemm import Planes

        if self.kernel_nk:
            return Planes(self.parts, a="split", b="shared", c="batched")
        return Planes(self.parts, a="shared", b="split", c="batched")

    def out_avals(self, avals):
        k, d = self.layer_dims(avals)
        shape = (self.parts, d, k) if self.kernel_nk else (k, self.parts, d)
        dkernel = jax.ShapeDtypeStruct(shape, jnp.float32 if self.accumulate else avals[0].dtype)
        return ((dkernel,) + (jax.ShapeDtypeStruct((self.parts, d), jnp.float32),) * self.with_sums
                + self.scratch_avals())

    def reference(self, *operands):
        operands = list(operands[:len(operands) - self.fixup])  # the flags: the kernel's alone
        zeros = operands.pop() if self.accumulate else None
        sums = operands.pop() if self.with_sums else None
        dys, x = (operands[:-1], operands[-1]) if self.kernel_nk else (operands[1:], operands[0])
        dkernel = _weight_grad_kn(x[0], [dy[0] for dy in dys], None, jnp.float32)
        dkernel = as_planes(dkernel.T if self.kernel_nk else dkernel, self.parts, self.kernel_nk)
        out = (zeros + dkernel if self.accumulate else dkernel.astype(x.dtype),)
        if self.with_sums:
            out += (sums + jnp.stack([jnp.sum(dy[0].astype(jnp.float32), axis=0) for dy in dys]),)
        return out + self.scratch_reference()


# --- jnp reference ---------------------------------------------------------------------------------

def _kernel_kn(planar, kernel_nk: bool):
    """The planar kernel operand as the (K, N) matrix it stands for."""
    if kernel_nk:
        return planar.reshape(-1, planar.shape[2]).T
    return planar.reshape(planar.shape[0], -1)


def _weight_grad_kn(x, dys, precision, dtype):
    """xᵀ @ [dy_0 ... dy_{P-1}] (K, N) over all rows, accumulated in float32, in ``dtype``
    (:mod:`cutelayers.ops.linear`'s weight gradient on the parts side by side)."""
    dy = jnp.concatenate(dys, axis=-1)
    return _weight_grad_einsum(x[None], dy[None], precision, dtype)[0]


# --- kernel calls on (rows, features) arrays -------------------------------------------------------

def _forward_rows(x, kernel, bias, parts, use_kernels, precision, kernel_nk):
    lead, n = x.shape[:-1], kernel.shape[0 if kernel_nk else 1]
    if not use_kernels:
        y = forward_reference(x, as_kn(kernel, kernel_nk), bias, None, "none", precision)[0]
        return tuple(jnp.split(y, parts, axis=-1))
    if math.prod(lead) == 0:
        return (jnp.zeros((*lead, n // parts), x.dtype),) * parts
    operands = [kernel_rows(x), as_planes(kernel, parts, kernel_nk)]
    if bias is not None:
        operands.append(bias.reshape(parts, -1))
    family = SplitForward(parts, bias is not None, kernel_nk=kernel_nk)
    return tuple(from_rows(y, lead) for y in call_gemm(family, operands, (True,), lead))


def _input_grad_rows(dys, kernel, parts, use_kernels, precision, kernel_nk):
    lead, k = dys[0].shape[:-1], kernel.shape[1 if kernel_nk else 0]
    if not use_kernels:
        dy = jnp.concatenate(dys, axis=-1)
        return _matmul(dy, as_kn(kernel, kernel_nk).T, precision).astype(dy.dtype)
    if math.prod(lead) == 0:
        return jnp.zeros((*lead, k), dys[0].dtype)
    operands = (*(kernel_rows(dy) for dy in dys), as_planes(kernel, parts, kernel_nk))
    (dx,) = call_gemm(SplitInputGrad(parts, kernel_nk=kernel_nk), operands, (True,) * parts, lead)
    return from_rows(dx, lead)


def _weight_grad_rows(x, dys, kernel_shape, bias_dtype, parts, use_kernels, precision, kernel_nk, f32_grad):
    """(dkernel in the kernel's layout and x's dtype -- float32 for ``f32_grad``: a stream-K float32
    sum as it is, else the kernel's result converted, as :mod:`cutelayers.ops.linear`'s weight
    gradient does --, summed over every row of x (..., K) and dys; dbias (N,) in ``bias_dtype``,
    the dys' column sums side by side -- None for a None dtype)."""
    out_dtype = jnp.float32 if f32_grad else x.dtype
    if not use_kernels or x.size == 0:
        dkernel = _weight_grad_kn(x, dys, precision, out_dtype)
        dbias = None if bias_dtype is None else jnp.concatenate([column_sum(dy, bias_dtype) for dy in dys])
        return dkernel.T if kernel_nk else dkernel, dbias
    lead = x.shape[:-1]
    rows = kernel_rows(x)
    dy_rows = tuple(kernel_rows(dy) for dy in dys)
    m, k, d = math.prod(lead), x.shape[-1], dys[0].shape[-1]
    out_mn = (d, k) if kernel_nk else (k, d)
    stream_k, into_zeros, tail = weight_grad_schedule(dy_rows[0], *out_mn, m, parts,
                                                      (parts, d, k) if kernel_nk else (k, parts, d))
    with_sums = bias_dtype is not None
    operands = (*dy_rows, rows) if kernel_nk else (rows, *dy_rows)
    if with_sums:
        operands += (zeros_after(dy_rows[0], (parts, d)),)
    operands += tail
    family = SplitWeightGrad(parts, kernel_nk=kernel_nk, stream_k=stream_k, with_sums=with_sums,
                             accumulate=into_zeros)
    dkernel, *sums = call_gemm(family, operands, (True,) * (parts + 1), lead)
    dbias = sums[0].reshape(-1).astype(bias_dtype) if with_sums else None
    return dkernel.astype(out_dtype).reshape(kernel_shape), dbias


@functools.cache
def _split_fn(parts: int, use_kernels: bool, precision, kernel_nk: bool, f32_params: bool):
    """The differentiable op for one static configuration; args (x, kernel, bias), the parameters
    in x's dtype or, with ``f32_params``, float32 (:func:`cutelayers.ops.linear.compute_params`)."""

    def forward(x, kernel, bias):
        return _forward_rows(x, kernel, bias, parts, use_kernels, precision, kernel_nk)

    def input_grad(dys, kernel):
        return _input_grad_rows(dys, kernel, parts, use_kernels, precision, kernel_nk)

    def weight_grad(x, dys, kernel_shape, bias_dtype):
        return _weight_grad_rows(x, dys, kernel_shape, bias_dtype, parts, use_kernels, precision, kernel_nk,
                                 f32_params)

    forward = fold_batch(forward, shared=(1, 2))
    input_grad = fold_batch(input_grad, shared=(1,))

    @jax.custom_vjp
    def split(x, kernel, bias):
        return forward(x, *compute_params(x, kernel, bias))

    def fwd(x, kernel, bias):
        kernel, bias = compute_params(x, kernel, bias)  # saved as cast: dx reads it
        return forward(x, kernel, bias), (x, kernel, bias)

    def bwd(res, dys):
        x, kernel, bias = res
        dys = tuple(dy.astype(x.dtype) for dy in dys)
        dx = input_grad(dys, kernel)
        # per-example kernels (vmap of grad) come here batched: each example its own sum over rows
        bias_dtype = None if bias is None else (jnp.float32 if f32_params else x.dtype)
        dkernel, dbias = _per_example_weight_grad(weight_grad, x, dys, kernel.shape, bias_dtype)
        return dx, *typed_like((kernel, bias), (dkernel, dbias))

    split.defvjp(fwd, bwd)
    return fold_batch(split, shared=(1, 2), per_example=split)


def _per_example_weight_grad(weight_grad, x, dys, kernel_shape, bias_dtype):
    """``weight_grad`` (dkernel, dbias) for this call's rows (dbias in ``bias_dtype``, None for
    None); under ``vmap(grad(...))`` a ``jax.lax.map`` over the examples (one launch each), since
    the rows of different examples must not be summed."""

    def grads(x, dys):
        return weight_grad(x, dys, kernel_shape, bias_dtype)

    fn = fold_batch(grads, batched=lambda x, dys: jax.lax.map(lambda e: grads(*e), (x, dys)))
    return fn(x, dys)


# --- the op ------------------------------------------------------------------------------------------

def split_linear(x, kernel, bias=None, *, parts: int, precision=None, kernel_layout: str = "kn") -> tuple:
    """``x @ kernel + bias`` as ``parts`` equal column blocks, each its own array, differentiable
    and vmappable -- attention's ``q, k, v = split_linear(h, w_qkv, b_qkv, parts=3)`` without the
    slice of a (..., 3 * d) result or the concatenation of dq, dk, dv.

    Args:
      x: (..., K), any leading shape (flattened to rows), dtype bfloat16, float16 or float32.
      kernel: (K, N) as in ``flax.linen.Dense`` (or (N, K) with ``kernel_layout="nk"``), x's
        dtype or float32 for a bfloat16 / float16 x (mixed precision, as for ``fused_linear``);
        N a multiple of ``parts``.
      bias: (N,) in the kernel's dtype, or None.
      parts: how many equal blocks N is cut into (a positive int); 1 is ``fused_linear``.
      precision: as ``jax.lax.dot``'s, for the XLA GEMMs of the jnp path (float32, unaligned
        sizes); the kernels' bfloat16 / float16 products are exact.
      kernel_layout: "kn" or "nk", as for :func:`cutelayers.ops.fused_linear`.

    Returns:
      A tuple of ``parts`` arrays (..., N // parts) in x's dtype: jnp.split(x @ kernel + bias,
      parts, axis=-1), accumulated in float32.
    """
    op = "split_linear"
    kernel_nk = check_kernel_layout(op, kernel_layout)
    x, kernel, bias, f32_params = check_linear_operands(op, "x", x, kernel, bias, kernel_transposed=kernel_nk)
    k, n = kernel.shape[::-1] if kernel_nk else kernel.shape
    parts = check_int(op, "parts", parts)
    if parts < 1:
        raise ValueError(f"{op}: argument 'parts' must be a positive int; got {parts}")
    if n % parts:
        raise ValueError(f"{op}: 'kernel' has N={n} output features, which {parts} parts cannot share "
                         f"equally (N must be a multiple of 'parts')")
    if parts == 1:
        return (fused_linear(x, kernel, bias, precision=precision, kernel_layout=kernel_layout),)
    precision = hashable_precision(precision)
    use_kernels = choose_kernels(op, *kernels_apply(x.dtype, k, n // parts), x, f32_params)
    kernel, bias = vary_like(x, kernel, bias)
    return _split_fn(parts, use_kernels, precision, kernel_nk, f32_params)(x, kernel, bias)
