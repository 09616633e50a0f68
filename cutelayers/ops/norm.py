"""LayerNorm and RMSNorm over the last axis: ``layer_norm``, ``rms_norm``; and fused with the
residual add before them (pre-norm transformers): ``add_layer_norm``, ``add_rms_norm``, which return
``(normed, x + residual)``.

Forward: one CuTe kernel writes y and the fp32 row statistics (mean for LayerNorm, rstd = 1 /
sqrt(var + epsilon)) that the backward reuses. Backward: one CuTe kernel writes dx and, for rows
that fit in registers, per-CTA fp32 partial sums of dscale / dbias, which the op adds up with
``jnp.sum`` (a (P, N) -> (N,) reduction, P a few hundred: small next to x, deterministic). For rows
too long to stay in registers (see :mod:`cutelayers.kernels.norm`) the kernel writes dx only and
dscale / dbias are an XLA reduction that reads x and dy once more.

The fused residual add is an option of the same kernels, not other ones: the forward also reads
the residual and writes summed = x + residual (in the residual's dtype), whose statistics it
takes; the backward reads summed where the plain one reads x, and the gradient of summed, which
it adds to dx (x and the residual share that gradient).

vmap (:mod:`cutelayers.ops._batching`, around the forward and backward kernel calls and around the
differentiable op): a batched x with shared scale / bias folds the batch into rows (one launch).
Per-example scale / bias cannot share one kernel launch; they fall back to ``jax.vmap`` of the jnp
reference, which computes the same decomposition. ``grad(vmap(...))`` (the Equinox style) folds
before differentiating: one backward on all rows, dscale / dbias summed over all of them by the
kernel. ``vmap(grad(...))`` over a shared scale asks for per-example dscale / dbias: the batched
backward runs the dx kernel on folded rows and reduces dscale / dbias per example with XLA.

The reference (``forward_reference`` / ``backward_reference``) is what runs off CUDA and under the
``reference`` backend; it implements the kernels' decomposition (same residuals), so CPU tests of
the op check the backward formulas the kernels implement.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cutelayers.kernels import norm_config
from cutelayers.kernels.hopper import concrete_dim
from cutelayers.kernels.reduction_config import RowConfig, can_prefetch, cut_budget, latency_geometry
from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import (
    RowKernelFamily,
    call_kernel,
    check_dtype,
    check_float_array,
    check_number,
    rows_of,
    symbolic_width,
)
from cutelayers.runtime.family import ShardingRule
from cutelayers.runtime.sharding import kernel_avals, run_kernel, typed_like, vary_like
from cutelayers.tuning import resolve


def _kernel_name(center: bool, has_residual: bool, direction: str) -> str:
    return f"{'add_' * has_residual}{'layer' if center else 'rms'}_norm_{direction}"


def _optional(args, *present: bool) -> tuple:
    """``args`` holding, in order, those of some optional arguments that are ``present`` -> one
    value per flag, None where absent."""
    it = iter(args)
    return tuple(next(it) if p else None for p in present)


@dataclasses.dataclass(frozen=True)
class NormForward(RowKernelFamily):
    """Kernel family: y (M, N), [summed (M, N)], [mean (M, 1)], rstd (M, 1) from x (M, N),
    [residual (M, N)], [scale (N,)], [bias (N,)].

    ``center``: LayerNorm (subtract the mean) rather than RMSNorm. ``out_dtype``: y's dtype name.
    ``has_residual``: the fused residual add -- the row is summed = x + residual (in the
    residual's dtype, see :func:`residual_sum`), written as the second result. ``config``: the
    kernel's :class:`~cutelayers.kernels.reduction_config.RowConfig` (see
    :class:`~cutelayers.runtime.family.TunableFamily`).
    """

    center: bool
    has_scale: bool
    has_bias: bool
    epsilon: float
    out_dtype: str
    has_residual: bool = False
    config: RowConfig | None = None
    few_rows: bool = False  # a few rows' kernel, its parameters loaded first (set by :meth:`with_config`)
    per_row_rank = 2
    values_per_thread = norm_config.FORWARD_VALUES_PER_THREAD
    staged_operands = 1  # a streamed row (x, or summed) kept for the normalize pass
    cuts_row_slots = True
    streamed_threads = norm_config.STREAMED_THREADS

    @property
    def share_budget(self) -> int:
        return norm_config.FORWARD_SHARE_BYTES[self.center]

    @property
    def name(self) -> str:
        return _kernel_name(self.center, self.has_residual, "fwd")

    @property
    def arg_names(self) -> tuple[str, ...]:
        optional = (("residual", self.has_residual), ("scale", self.has_scale), ("bias", self.has_bias))
        return ("x",) + tuple(name for name, present in optional if present)

    def default_config(self, avals):
        # a decode-sized batch: its rows spread over wide CTAs (norm_config.FEW_ROWS_VALUES), the
        # widest cut over a cluster (norm_config.FEW_ROWS_CUT_THREADS)
        few = self._few_rows_geometry(avals)
        if few is None:
            return super().default_config(avals)
        if few.row.threads_per_row <= norm_config.FEW_ROWS_CUT_THREADS:
            return few.row
        n, bits = self.row_length(avals), self.elem_bits(avals)
        return self._cut_config(norm_config.FEW_ROWS_CUT_THREADS, n, bits, norm_config.few_rows_cluster(n, bits))

    def config_space(self, avals) -> tuple:
        # each register-resident config also with the other choice than its rule's of when the
        # parameters load (norm_config.ForwardConfig); for a few rows, the row cut over clusters of
        # one-row CTAs of 128 or 256 threads
        space = super().config_space(avals)
        others = tuple(norm_config.forward_config(c, not self._params_first(c, avals))
                       for c in space if self.cut(c, avals).resident)
        cuts = ()
        if self._few_rows_geometry(avals) is not None:
            n, bits = self.row_length(avals), self.elem_bits(avals)
            candidates = (self._cut_config(threads, n, bits, cluster)
                          for threads in (128, norm_config.FEW_ROWS_CUT_THREADS) for cluster in (2, 4, 8, 16))
            cuts = tuple(c for c in candidates if self.cut(c, avals).cluster > 1)
        return space + others + tuple(dict.fromkeys(cuts))

    def _few_rows_geometry(self, avals):
        """:func:`.latency_geometry` for a decode batch whose rows it keeps register resident; else
        None."""
        if not self.decode_batch(avals):
            return None
        return latency_geometry(self.row_length(avals), self.elem_bits(avals), self.register_values(avals),
                                norm_config.FEW_ROWS_VALUES)

    @staticmethod
    def _cut_config(threads: int, n: int, elem_bits: int, cluster: int) -> RowConfig:
        """One-row CTAs of ``threads`` threads, a step of one access a thread, whose share budget
        cuts rows of ``n`` over ``cluster`` CTAs (:func:`.cut_budget`)."""
        config = RowConfig(threads_per_row=threads, num_threads=threads, unroll=1)
        return dataclasses.replace(config, share_budget=cut_budget(config, n, elem_bits, cluster))

    def with_config(self, config, avals):
        # A few register-resident rows, or a few rows cut in one-step shares, load their parameters
        # first (norm_config.params_first): another kernel than many rows', whose compile key (a
        # symbolic row count) is the same.
        family = dataclasses.replace(self, config=config, few_rows=False)
        geometry = family.geometry(avals)
        few = (self.decode_batch(avals) and (geometry.resident or geometry.one_step_shares)
               and not family.loads_params_first(avals))
        return dataclasses.replace(family, few_rows=few)

    def config_from_fields(self, fields: dict):
        if "params_first" in fields:  # a ForwardConfig; a plain RowConfig lets the rule decide
            return norm_config.ForwardConfig(**fields)
        return super().config_from_fields(fields)

    def loads_params_first(self, avals) -> bool:
        """Whether the kernel loads scale and bias with the row, before its reductions
        (:func:`.norm_config.params_first`)."""
        return self._params_first(self.chosen_config(), avals)

    def _params_first(self, config: RowConfig, avals) -> bool:
        params = avals[1 + self.has_residual:]
        param_bytes = sum(jnp.dtype(a.dtype).itemsize for a in params)
        return norm_config.params_first(config, self.cut(config, avals), param_bytes, self.few_rows)

    def out_avals(self, avals):
        m, n = avals[0].shape
        stat = jax.ShapeDtypeStruct((m, 1), jnp.float32)
        summed = (jax.ShapeDtypeStruct((m, n), avals[1].dtype),) if self.has_residual else ()
        y = jax.ShapeDtypeStruct((m, n), jnp.dtype(self.out_dtype))
        return (y, *summed) + (stat,) * self.center + (stat,)

    def reference(self, *args):
        outs = self.outputs_reference(*args)
        rows = 1 + self.has_residual
        return outs[:rows] + tuple(stat[:, None] for stat in outs[rows:])

    def outputs_reference(self, x, *rest):
        """The results of :func:`forward_reference` on x (..., N): y and [summed] (..., N), the
        statistics (...,)."""
        residual, scale, bias = _optional(rest, self.has_residual, self.has_scale, self.has_bias)
        summed = x if residual is None else residual_sum(x, residual)
        y, mean, rstd = forward_reference(summed, scale, bias, center=self.center, epsilon=self.epsilon,
                                          out_dtype=self.out_dtype)
        return (y,) + (summed,) * self.has_residual + (mean,) * self.center + (rstd,)

    def row_dtypes(self, avals):
        # x, residual, scale, bias and y (summed has the residual's dtype)
        return (*(a.dtype for a in avals), self.out_dtype)

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.norm import NormForwardKernel

        return NormForwardKernel(self.geometry(avals), center=self.center, has_residual=self.has_residual,
                                 has_scale=self.has_scale, has_bias=self.has_bias, epsilon=self.epsilon,
                                 params_first=self.loads_params_first(avals))


@dataclasses.dataclass(frozen=True)
class NormBackward(RowKernelFamily):
    """Kernel family: dx (M, N), [partials (P*W*N,)] from x (M, N), dy (M, N), [dsummed (M, N)],
    [mean (M, 1)], rstd (M, 1), [scale (N,)].

    Partials are fp32, P rows of the W wanted sums (dscale, dbias) side by side: one buffer, so
    one reduction over P gives both (:meth:`param_grads`). P comes from the config and
    ``grid``, the CTAs of the persistent grid -- clusters where rows stream (None: a GPU's worth;
    the op sizes it for its rows with :func:`cutelayers.kernels.norm_config.backward_grid`), so it
    is fixed per compile key; any row count runs correctly on any grid. A streamed row keeps its
    CTA's dscale / dbias sums in shared memory (``staged_sums``), where they fit
    (:meth:`holds_sums`), and its shares of x and dy, or fewer of them, in one buffer or two
    (:meth:`staging_configs`).
    ``has_residual``: the backward of the fused residual add -- x is the forward's summed, and
    dsummed (the gradient of summed) is added to dx, which is then the gradient of both x and
    the residual.
    """

    center: bool
    has_scale: bool
    want_dscale: bool
    want_dbias: bool
    has_residual: bool = False
    config: RowConfig | None = None
    grid: int | None = None
    per_row_rank = 2
    # a streamed row's x and dy, kept for the dx pass; its cut is sized for both (a StagingConfig keeps fewer)
    staged_operands = norm_config.STAGED_OPERANDS

    @property
    def streamed_threads(self) -> int:
        return norm_config.STREAMED_BACKWARD_THREADS[self.center]

    def register_values(self, avals) -> int:
        return norm_config.BACKWARD_VALUES_PER_THREAD[self.elem_bits(avals)]

    @property
    def name(self) -> str:
        return _kernel_name(self.center, self.has_residual, "bwd")

    @property
    def staged_sums(self) -> int:
        return self.wanted

    def config_space(self, avals) -> tuple:
        # streamed rows whose CTA cannot hold its shares' dscale / dbias sums: not candidates
        space = super().config_space(avals)
        if self.wanted:
            space = tuple(c for c in space if dataclasses.replace(self, config=c).holds_sums(avals)) or space
        return space + self.staging_configs(space, avals)

    def staging_configs(self, space, avals) -> tuple:
        """The configs of ``space`` staging otherwise: dy alone or neither, or in two buffers
        (:class:`~cutelayers.kernels.norm_config.StagingConfig`), each where its CTA then keeps other
        shares in shared memory than with the config's own
        (:func:`~cutelayers.kernels.norm_config.staged_shares`) -- two buffers only of shares it
        copies asynchronously (:func:`~cutelayers.kernels.reduction.can_prefetch`: copied from
        registers, a second buffer would only cost shared memory)."""
        elem_bytes = self.elem_bits(avals) // 8
        narrowest = min(jnp.dtype(d).itemsize * 8 for d in self.row_dtypes(avals))

        def kept(config):  # the shares it stages, and in how many buffers
            shares = norm_config.staged_shares(self.cut(config, avals), elem_bytes, self.wanted)
            return shares, norm_config.staging_stages(config) if any(shares) else 1

        found = []
        for config in space:
            seen = {kept(config)}
            for other in norm_config.staging_variants(config):
                how = kept(other)
                if how not in seen and (how[1] == 1 or can_prefetch(self.cut(other, avals), narrowest)):
                    found.append(other)
                    seen.add(how)
        return tuple(found)

    def config_from_fields(self, fields: dict):
        # a StagingConfig names its staged operands (and stages); a plain RowConfig (every entry
        # before them) not
        fields = dict(fields)
        operands = fields.pop("staged_operands", self.staged_operands)
        stages = fields.pop("stages", 1)
        if (operands, stages) == (self.staged_operands, 1):
            return super().config_from_fields(fields)
        return norm_config.StagingConfig(**fields, staged_operands=operands, stages=stages)

    def holds_sums(self, avals) -> bool:
        """Whether the kernel sums dscale / dbias for these operands (a streamed row's in the CTA's
        shared memory, which a share too wide for it does not fit)."""
        g = self.geometry(avals)
        return g.resident or norm_config.sums_fit(g, self.wanted)

    def ctas(self, avals, rows: int | None = None) -> int:
        """CTAs -- clusters where rows stream -- of the persistent grid (``grid``, else sized for
        ``rows`` rows, or a GPU's worth: also for a symbolic row count)."""
        if self.grid:
            return self.grid
        g = self.geometry(avals)
        return norm_config.backward_grid(g, concrete_dim(rows), self.elem_bits(avals) // 8, self.wanted)

    @property
    def arg_names(self) -> tuple[str, ...]:
        rows = ("summed", "dy", "dsummed") if self.has_residual else ("x", "dy")
        return rows + ("mean",) * self.center + ("rstd",) + ("scale",) * self.has_scale

    def sharding_rule(self, avals) -> ShardingRule:
        # Rows may be sharded; the partials lack them, so they are summed across devices.
        per_row = ("rows", None)
        operands = (per_row,) * (3 + self.has_residual + self.center) + ((None,),) * self.has_scale
        results = (per_row,) + ((None,),) * bool(self.wanted)
        return ShardingRule(operands, results, per_shard=self.per_shard)

    def per_shard(self, ctx, x, *rest):
        dx, *partials = run_kernel(self, x, *rest)
        if not (partials and ctx.sharded("rows")):  # dx alone is per row: nothing to sum
            return (dx, *partials)
        # Each device sums its P partial rows first, so the psum moves W x N floats, not P x W x N.
        (partial,) = partials
        width = self.wanted * x.shape[1]
        summed = ctx.psum(jnp.sum(partial.reshape(-1, width), axis=0), {"rows"})
        return dx, jnp.zeros(partial.shape, jnp.float32).at[:width].set(summed)

    @property
    def wanted(self) -> int:
        """W: how many of dscale, dbias the partials hold."""
        return self.want_dscale + self.want_dbias

    def param_grads(self, n: int, *partials) -> tuple[jax.Array, ...]:
        """The wanted (dscale, dbias), each (N,) float32, from the kernel's results after dx (its
        partials, if it has any)."""
        if not partials:
            return ()
        summed = jnp.sum(partials[0].reshape(-1, self.wanted * n), axis=0)
        return tuple(summed[i * n:(i + 1) * n] for i in range(self.wanted))

    def out_avals(self, avals):
        x = avals[0]
        dx = jax.ShapeDtypeStruct(x.shape, x.dtype)
        if not self.wanted:
            return (dx,)
        return dx, jax.ShapeDtypeStruct((self.partial_rows(avals) * self.wanted * x.shape[1],), jnp.float32)

    def partial_rows(self, avals) -> int:
        """Rows of W x N partial sums: one per CTA, or per row slot of a streamed row's cluster."""
        if not self.wanted:
            return 0
        return norm_config.partial_rows(self.geometry(avals), self.ctas(avals))

    def reference(self, *args):
        x, dy, dsummed, mean, rstd, scale = _split_backward(args, self.center, self.has_residual,
                                                            self.has_scale)
        mean = None if mean is None else mean[:, 0]
        dx, dscale, dbias = backward_reference(x, dy, mean, rstd[:, 0], scale, dsummed)
        if not self.wanted:
            return (dx,)
        # The whole sum in the first partial row: summing over P gives the same result.
        sums = jnp.concatenate([v for v, want in ((dscale, self.want_dscale), (dbias, self.want_dbias)) if want])
        return dx, jnp.zeros((self.partial_rows(args), sums.size), jnp.float32).at[0].set(sums).reshape(-1)

    def row_dtypes(self, avals):
        # x, dy, dsummed and scale are the row-shaped operands whose loads share one vector width
        # (dx has x's dtype); the (M, 1) statistics are read one value per row.
        rows = 2 + self.has_residual
        return tuple(a.dtype for a in avals[:rows]) + ((avals[-1].dtype,) if self.has_scale else ())

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.norm import NormBackwardKernel

        return NormBackwardKernel(self.geometry(avals), center=self.center, has_residual=self.has_residual,
                                  has_scale=self.has_scale, want_dscale=self.want_dscale,
                                  want_dbias=self.want_dbias, grid=self.ctas(avals))


def _split_backward(args, center: bool, has_residual: bool, has_scale: bool) -> tuple:
    """The backward's operands ``(x, dy, [dsummed], [mean], rstd, [scale])`` -> (x, dy, dsummed,
    mean, rstd, scale), None where absent."""
    return _optional(args, True, True, has_residual, center, True, has_scale)


def _scale_position(center: bool, has_residual: bool, has_scale: bool) -> tuple[int, ...]:
    """Where the backward's operands hold scale, the one shared by every row (none without it)."""
    return (3 + has_residual + center,) if has_scale else ()


# --- jnp reference: the kernels' decomposition --------------------------------------------------

def residual_sum(x, residual):
    """x + residual as the fused kernels form it: added in fp32, rounded to the residual's dtype
    (the residual stream keeps its dtype)."""
    return (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(residual.dtype)


def forward_reference(x, scale, bias, *, center: bool, epsilon: float, out_dtype):
    """y, mean, rstd over the last axis, statistics in fp32 (two-pass variance).

    Shapes: x (..., N), scale/bias (N,) or None -> y (..., N) in ``out_dtype``, mean and rstd
    (...,) fp32 (mean is zeros for RMSNorm).
    """
    x32 = x.astype(jnp.float32)
    if center:
        mean = jnp.mean(x32, axis=-1)
        var = jnp.mean(jnp.square(x32 - mean[..., None]), axis=-1)
    else:
        mean = jnp.zeros(x.shape[:-1], jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1)
    rstd = jax.lax.rsqrt(var + jnp.float32(epsilon))
    y = (x32 - mean[..., None]) * rstd[..., None]
    if scale is not None:
        y = y * _per_feature(scale, y.ndim)
    if bias is not None:
        y = y + _per_feature(bias, y.ndim)
    return y.astype(out_dtype), mean, rstd


def _per_feature(p, ndim: int):
    """A (N,) parameter as fp32 (1, ..., 1, N) of rank ``ndim``: explicit broadcasting, clean
    under ``jax_numpy_rank_promotion="raise"``."""
    return p.astype(jnp.float32).reshape((1,) * (ndim - 1) + p.shape)


def _xhat(x, mean, rstd):
    x32 = x.astype(jnp.float32)
    if mean is not None:
        x32 = x32 - mean[..., None]
    return x32 * rstd[..., None]


def backward_reference(x, dy, mean, rstd, scale, dsummed=None):
    """dx, dscale, dbias of :func:`forward_reference` (``mean=None``: RMSNorm); ``dsummed``, if
    given, is added to dx (the fused residual add's backward, x being the summed input).

    Shapes: x, dy, dsummed (..., N); mean, rstd (...,) fp32; scale (N,) or None -> dx (..., N) in
    x's dtype, dscale and dbias (N,) fp32 summed over all leading axes.
    """
    xhat = _xhat(x, mean, rstd)
    dy32 = dy.astype(jnp.float32)
    g = dy32 * _per_feature(scale, dy32.ndim) if scale is not None else dy32
    n = x.shape[-1]
    inner = xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / n)
    if mean is not None:
        inner = inner + jnp.sum(g, axis=-1, keepdims=True) / n
    dx = (g - inner) * rstd[..., None]
    if dsummed is not None:
        dx = dx + dsummed.astype(jnp.float32)
    lead = tuple(range(x.ndim - 1))
    return dx.astype(x.dtype), jnp.sum(dy32 * xhat, axis=lead), jnp.sum(dy32, axis=lead)


# --- kernel calls on (rows, N) views ------------------------------------------------------------

def _backward_args(args, center: bool, has_residual: bool):
    """(x, dy, [dsummed], [mean], rstd, [scale]) as the kernel's operands, x, dy, dsummed as rows
    of N and the statistics as rows of 1 (:func:`rows_of`), and the call's ``rows_at``."""
    rows = 2 + has_residual
    stats = rows + 1 + center
    operands, given = rows_of(args[0].shape[:-1], *args[:rows], *(a[..., None] for a in args[rows:stats]))
    return operands + list(args[stats:]), given


def _backward_of_args(args, center: bool, has_residual: bool, has_scale: bool):
    """:func:`backward_reference` of the backward's operands ``(x, dy, [dsummed], [mean], rstd,
    [scale])``: (dx, dscale, dbias)."""
    x, dy, dsummed, mean, rstd, scale = _split_backward(args, center, has_residual, has_scale)
    return backward_reference(x, dy, mean, rstd, scale, dsummed)


def _forward_core(center: bool, has_residual: bool, has_scale: bool, has_bias: bool, epsilon: float,
                  out_dtype: str):
    """``(x, [residual], *params) -> (y, [summed], [mean], rstd)``: y and summed (..., N), the
    statistics (...,) fp32; vmappable (module docstring)."""
    family = NormForward(center, has_scale, has_bias, epsilon, out_dtype, has_residual)
    rows = 1 + has_residual  # row-shaped operands, and row-shaped results

    def forward(*args):
        x = args[0]
        operands, given = rows_of(x.shape[:-1], *args[:rows])
        outs = call_kernel(family, *operands, *args[rows:], lead=x.shape[:-1], rows_at=given)
        return (tuple(o.reshape(x.shape) for o in outs[:rows])
                + tuple(o.reshape(x.shape[:-1]) for o in outs[rows:]))

    params = tuple(range(rows, rows + has_scale + has_bias))
    return fold_batch(forward, shared=params, per_example=family.outputs_reference)


def _backward_core(center: bool, has_residual: bool, has_scale: bool, has_bias: bool):
    """``(x, dy, [dsummed], [mean], rstd, [scale]) -> (dx, [dscale], [dbias])`` (fp32 dparams);
    vmappable (module docstring)."""
    dx_only = _dx_core(center, has_residual, has_scale)

    def backward(*args):
        x, dy, dsummed, mean, rstd, scale = _split_backward(args, center, has_residual, has_scale)
        operands, given = _backward_args(args, center, has_residual)
        rows = kernel_avals(operands, x.shape[:-1], given)
        family = NormBackward(center, has_scale, has_scale, has_bias, has_residual)
        if symbolic_width(family, rows):
            dx, dscale, dbias = backward_reference(x, dy, mean, rstd, scale, dsummed)
            return (dx,) + (dscale,) * has_scale + (dbias,) * has_bias
        family = resolve(family, rows)
        # the persistent grid sized for these rows (few rows: few CTAs, few partials to sum)
        family = dataclasses.replace(family, grid=family.ctas(rows, rows[0].shape[0]))
        if not family.holds_sums(rows):
            # A row share too wide for its CTA's shared dscale / dbias sums (float32 rows past
            # 262144): dx from the kernel, dscale / dbias from XLA's column sums.
            dx = dx_only(*args)
            _, dscale, dbias = backward_reference(x, dy, mean, rstd, None)
            return (dx,) + (dscale,) * has_scale + (dbias,) * has_bias
        dx, *partials = call_kernel(family, *operands, lead=x.shape[:-1], rows_at=given)
        return (dx.reshape(x.shape), *family.param_grads(x.shape[-1], *partials))

    def per_example(*args):
        dx, dscale, dbias = _backward_of_args(args, center, has_residual, has_scale)
        return (dx,) + (dscale,) * has_scale + (dbias,) * has_bias

    def batched(*args):
        x, dy, _, mean, rstd, _ = _split_backward(args, center, has_residual, has_scale)
        dx = dx_only(*args)
        # dscale / dbias per example (the batch leads): sums over the rows of each
        xhat = _xhat(x, mean, rstd)
        dy32 = dy.astype(jnp.float32)
        lead = tuple(range(1, x.ndim - 1))
        return (dx,) + (jnp.sum(dy32 * xhat, axis=lead),) * has_scale + (jnp.sum(dy32, axis=lead),) * has_bias

    return fold_batch(backward, shared=_scale_position(center, has_residual, has_scale), per_example=per_example,
                      batched=batched)


def _dx_core(center: bool, has_residual: bool, has_scale: bool):
    """The dx-only backward of the same operands; vmappable (module docstring)."""
    family = NormBackward(center, has_scale, False, False, has_residual)

    def dx(*args):
        operands, given = _backward_args(args, center, has_residual)
        return call_kernel(family, *operands, lead=args[0].shape[:-1], rows_at=given)[0].reshape(args[0].shape)

    def per_example(*args):
        return _backward_of_args(args, center, has_residual, has_scale)[0]

    return fold_batch(dx, shared=_scale_position(center, has_residual, has_scale), per_example=per_example)


@functools.cache
def _norm_fn(center: bool, has_residual: bool, has_scale: bool, has_bias: bool, epsilon: float,
             out_dtype: str, x_dtype: str):
    """The differentiable op on ``(x, [residual], *params)``: y, or (y, summed) with a residual."""
    forward = _forward_core(center, has_residual, has_scale, has_bias, epsilon, out_dtype)
    backward = _backward_core(center, has_residual, has_scale, has_bias)
    rows = 1 + has_residual

    def results(outs):
        return outs[:rows] if has_residual else outs[0]

    @jax.custom_vjp
    def norm(*args):
        return results(forward(*args))

    def fwd(*args):
        outs = forward(*args)
        # The row the statistics are of: x, or summed (which the forward writes anyway).
        source = outs[1] if has_residual else args[0]
        return results(outs), (source, outs[rows:], args[rows:])

    def bwd(res, cotangents):
        source, stats, params = res
        scale, _ = _optional(params, has_scale, has_bias)
        grads = cotangents if has_residual else (cotangents,)  # dy, [dsummed]
        dx, *dparams = backward(source, *grads, *stats, *((scale,) if has_scale else ()))
        # x and the residual get the same gradient, each in its dtype.
        dparams = typed_like(params, tuple(d.astype(p.dtype) for d, p in zip(dparams, params)))
        return (dx.astype(x_dtype),) + (dx,) * has_residual + dparams

    norm.defvjp(fwd, bwd)
    # Folded before differentiation too: grad(vmap(norm)) with a shared scale runs one backward on
    # all rows, its dscale / dbias summed by the kernel's partials (not per example, then summed).
    return fold_batch(norm, shared=tuple(range(rows, rows + has_scale + has_bias)), per_example=norm)


def _check(op: str, x, residual, scale, bias, epsilon, dtype):
    x = check_float_array(op, "x", x)
    if residual is not None:
        residual = check_float_array(op, "residual", residual)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{op}: argument 'residual' has shape {tuple(residual.shape)}; expected "
                             f"{tuple(x.shape)}, the shape of x")
    n = x.shape[-1]
    params = {}
    for name, p in (("scale", scale), ("bias", bias)):
        if p is None:
            continue
        p = check_float_array(op, name, p, min_rank=0)
        if tuple(p.shape) != (n,):
            raise ValueError(f"{op}: argument {name!r} has shape {tuple(p.shape)}; expected ({n},), "
                             "the size of x's last axis")
        params[name] = p
    epsilon = check_number(op, "epsilon", epsilon)
    if not epsilon >= 0.0:
        raise ValueError(f"{op}: argument 'epsilon' must be >= 0; got {epsilon}")
    # Flax's rule (flax.linen.dtypes.canonicalize_dtype): by default, the promoted dtype of the
    # normalized input (x, or the sum, in the residual's dtype) and the parameters
    normalized = x if residual is None else residual
    with jax.numpy_dtype_promotion("standard"):  # a rule, not arithmetic: also under 'strict' (as Equinox's norms)
        promoted = functools.reduce(jnp.promote_types, [p.dtype for p in params.values()], normalized.dtype)
    out_dtype = promoted if dtype is None else check_dtype(op, "dtype", dtype)
    return x, residual, params, epsilon, out_dtype


def _given(op: str, residual):
    """An add op's residual; None would make it the plain norm, whose one result a caller's
    ``normed, summed = ...`` unpacks along its first axis."""
    if residual is None:
        raise TypeError(f"{op}: argument 'residual' is None; expected an array of x's shape "
                        f"({op.removeprefix('add_')} normalizes x alone)")
    return residual


def _norm(op: str, center: bool, x, residual, scale, bias, epsilon, dtype):
    x, residual, params, epsilon, out_dtype = _check(op, x, residual, scale, bias, epsilon, dtype)
    fn = _norm_fn(center, residual is not None, "scale" in params, "bias" in params, epsilon, out_dtype.name,
                  x.dtype.name)
    inputs = (x,) if residual is None else (x, *vary_like(x, residual))
    return fn(*inputs, *vary_like(x, *params.values()))


def layer_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
               epsilon: float = 1e-6, dtype=None) -> jax.Array:
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + epsilon) * scale + bias``.

    Args:
      x: (..., N), N >= 1, bfloat16, float16 or float32.
      scale: (N,) or None (no scaling), any of those dtypes.
      bias: (N,) or None (no shift), any of those dtypes.
      epsilon: added to the variance (a Python float >= 0).
      dtype: the result's dtype; None means the promoted dtype of x, scale and bias (Flax's
        modules' rule: a bfloat16 x with a float32 scale gives float32, a float32 x with a
        bfloat16 scale float32).

    Returns:
      (..., N) in ``dtype``. Mean and variance are computed in float32 (two-pass, so large-mean
      inputs keep their precision); gradients flow to x, scale and bias, in their dtypes.
    """
    return _norm("layer_norm", True, x, None, scale, bias, epsilon, dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None = None, bias: jax.Array | None = None, *,
             epsilon: float = 1e-6, dtype=None) -> jax.Array:
    """RMSNorm over the last axis: ``x / sqrt(mean(x^2) + epsilon) * scale + bias``.

    Args:
      x: (..., N), N >= 1, bfloat16, float16 or float32.
      scale: (N,) or None (no scaling), any of those dtypes.
      bias: (N,) or None (the usual RMSNorm has none; Equinox's has one).
      epsilon: added to the mean square (a Python float >= 0).
      dtype: the result's dtype; None means the promoted dtype of x, scale and bias, as for
        :func:`layer_norm`.

    Returns:
      (..., N) in ``dtype``; statistics in float32; gradients flow to x, scale and bias.
    """
    return _norm("rms_norm", False, x, None, scale, bias, epsilon, dtype)


def add_layer_norm(x: jax.Array, residual: jax.Array, scale: jax.Array | None = None,
                   bias: jax.Array | None = None, *, epsilon: float = 1e-6,
                   dtype=None) -> tuple[jax.Array, jax.Array]:
    """The pre-norm transformer's residual add and LayerNorm in one kernel:
    ``summed = x + residual`` and ``normed = layer_norm(summed, scale, bias)``.

    One read of x and of the residual, one write of each result, forward; the backward is one
    kernel too, whose dx -- the norm's backward plus the gradient of ``summed`` -- is the gradient
    of both x and the residual.

    Args:
      x: (..., N), N >= 1, bfloat16, float16 or float32 (a block's output).
      residual: x's shape, any of those dtypes (the residual stream).
      scale, bias, epsilon: as for :func:`layer_norm`.
      dtype: normed's dtype; None means the promoted dtype of summed (the residual's dtype), scale
        and bias -- what :func:`layer_norm` of summed gives.

    Returns:
      ``(normed, summed)``. summed is x + residual added in float32 and rounded to the residual's
      dtype (the residual stream keeps its dtype); normed is the LayerNorm of summed as returned
      (statistics in float32), exactly as if the add ran first. Gradients flow through both
      results to x and the residual (each in its dtype), scale and bias.
    """
    return _norm("add_layer_norm", True, x, _given("add_layer_norm", residual), scale, bias, epsilon, dtype)


def add_rms_norm(x: jax.Array, residual: jax.Array, scale: jax.Array | None = None,
                 bias: jax.Array | None = None, *, epsilon: float = 1e-6,
                 dtype=None) -> tuple[jax.Array, jax.Array]:
    """The residual add and RMSNorm in one kernel: ``summed = x + residual`` and ``normed =
    rms_norm(summed, scale, bias)``; returns ``(normed, summed)``. Arguments and results as for
    :func:`add_layer_norm` and :func:`rms_norm`."""
    return _norm("add_rms_norm", False, x, _given("add_rms_norm", residual), scale, bias, epsilon, dtype)
