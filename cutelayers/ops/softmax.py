"""Softmax family over the last axis: ``softmax``, ``log_softmax``, ``logsumexp`` and
``softmax_cross_entropy`` -- CuTe kernels forward and backward, jnp references that follow the
same decomposition (the same residuals), custom_vjp; vmap folds into rows
(:mod:`cutelayers.ops._batching`).

Decomposition (all statistics fp32):

* softmax:      y = exp(x - lse);              dx = y * (dy - sum(dy * y))
* log_softmax:  y = x - lse;                   dx = dy - exp(y) * sum(dy)
* logsumexp:    lse = max + log(sum(exp(x - max)));   dx = dlse * exp(x - lse)
* cross-entropy with integer labels, smoothing a, z-loss z, V classes:
  loss = lse - (1 - a) x[label] - (a / V) sum(x) + z lse^2;
  dx = dloss * (exp(x - lse) (1 + 2 z lse) - (1 - a) onehot(label) - a / V).
  Rows whose label is ``ignore_index`` give loss 0 and gradient 0; any other label outside
  [0, V) gives a NaN loss and NaN gradient for that row (checked eagerly when labels are concrete).
  Where dloss is known before the logits die (an LM head's weighted total), one kernel gives lse,
  the loss and dx in one pass over the logits (:class:`CrossEntropyWithGrad`).

Vocabulary parallel: under ``jax.jit`` the cross-entropy (and logsumexp) kernels take logits
sharded along the class axis as well as the rows (an LM head whose kernel is sharded over the
vocabulary). Each device computes its slice's lse with the kernel; the lse is combined across the
devices (a max and a sum of (rows,) floats), the label's logit and the smoothing sum are summed
from the device that holds them, and each device computes the gradient of its slice of the logits
(as jnp: the kernel expects a whole row). Softmax and log_softmax still need the class axis whole.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cutelayers.kernels import softmax_config
from cutelayers.kernels.hopper import concrete_dim
from cutelayers.kernels.reduction_config import FEW_ROWS, RowConfig
from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import (
    INT32_MAX,
    INT32_MIN,
    RowKernelFamily,
    as_int32,
    call_on_rows,
    check_float_array,
    check_int,
    check_number,
)
from cutelayers.runtime.sharding import ShardContext, ShardingRule, run_kernel
from cutelayers.tuning import resolve

F32 = jnp.float32


# --- kernel families -----------------------------------------------------------------------------
#
# ``config``: the kernel's RowConfig, chosen by the op for its operands (see RowKernelFamily).


class FewRowsCut:
    """A softmax-family kernel family whose long rows, a decode batch's or too few to fill the GPU
    (at most :data:`.softmax_config.CUT_ROWS`), are cut over CTAs
    (:func:`.softmax_config.few_rows_cut`; the config then carries the cut as its share budget, so
    it compiles apart from many rows' kernel)."""

    cut_rows_exchange: bool = True
    """Whether a cut row's CTAs exchange row statistics (as a cluster); else a plain grid."""

    def default_config(self, avals):
        return self._few_rows_cut(super().default_config(avals), avals)

    def config_space(self, avals) -> tuple:
        # each config also cut so (the default's among them) -- not through default_config, which
        # may look its streamed config up in this space
        space = super().config_space(avals)
        return tuple(dict.fromkeys(space + tuple(self._few_rows_cut(c, avals) for c in space)))

    def shift(self, avals) -> bool:
        # a decode batch's cut rows are not shifted: at 8 rows they ran up to 30 % slower so, while
        # 70 and 132 rows ran up to 40 % faster (docs/benchmarks.md, sixty-ninth session)
        rows = self._few_rows(avals)
        return super().shift(avals) and (rows is None or rows > FEW_ROWS)

    @staticmethod
    def _few_rows(avals) -> int | None:
        """The rows' count where it is concrete and at most :data:`.softmax_config.CUT_ROWS`, else None."""
        rows = concrete_dim(avals[0].shape[0])
        return rows if rows is not None and rows <= softmax_config.CUT_ROWS else None

    def _few_rows_cut(self, config: RowConfig, avals) -> RowConfig:
        rows = self._few_rows(avals)
        if rows is None:
            return config
        # past a decode batch, only rows the kernel gives a CTA each: a staged row cut finer was no
        # faster (docs/benchmarks.md, sixty-fifth session)
        if rows > FEW_ROWS and self.cut(config, avals).cluster > 1:
            return config
        return softmax_config.few_rows_cut(config, self.row_length(avals), self.elem_bits(avals), rows,
                                           max(self.staged_operands, 1), cluster=self.cut_rows_exchange)


@dataclasses.dataclass(frozen=True)
class SoftmaxForward(FewRowsCut, RowKernelFamily):
    """y = softmax(x) or log_softmax(x) per row; y in x's dtype."""

    log: bool
    config: RowConfig | None = None
    values_per_thread = softmax_config.FORWARD_VALUES_PER_THREAD
    shifts_rows = True
    staged_operands = 1
    streamed_threads = softmax_config.STREAMED_FORWARD_THREADS
    arg_names = ("x",)

    @property
    def name(self):
        return "log_softmax_fwd" if self.log else "softmax_fwd"

    def out_avals(self, avals):
        (x,) = avals
        return (jax.ShapeDtypeStruct(x.shape, x.dtype),)

    def reference(self, x):
        lse = _lse(x)
        x32 = x.astype(F32)
        y = x32 - lse[:, None] if self.log else jnp.exp(x32 - lse[:, None])
        return (y.astype(x.dtype),)

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.softmax import SoftmaxForwardKernel

        return SoftmaxForwardKernel(self.geometry(avals), log=self.log)


@dataclasses.dataclass(frozen=True)
class SoftmaxBackward(FewRowsCut, RowKernelFamily):
    """dx from (y, dy): see the module docstring."""

    log: bool
    config: RowConfig | None = None
    values_per_thread = softmax_config.BACKWARD_VALUES_PER_THREAD
    shifts_rows = True
    staged_operands = 2
    arg_names = ("y", "dy")

    @property
    def name(self):
        return "log_softmax_bwd" if self.log else "softmax_bwd"

    def out_avals(self, avals):
        return (jax.ShapeDtypeStruct(avals[1].shape, avals[1].dtype),)

    def reference(self, y, dy):
        y32, g = y.astype(F32), dy.astype(F32)
        if self.log:
            dx = g - jnp.exp(y32) * jnp.sum(g, -1, keepdims=True)
        else:
            dx = y32 * (g - jnp.sum(g * y32, -1, keepdims=True))
        return (dx.astype(dy.dtype),)

    def row_dtypes(self, avals):
        return (avals[0].dtype, avals[1].dtype)

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.softmax import SoftmaxBackwardKernel

        return SoftmaxBackwardKernel(self.geometry(avals), log=self.log)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossOptions:
    """The cross-entropy families' loss options (keywords): rows whose label is ``ignore_index``
    give 0; label smoothing a, z-loss coefficient z and logit soft-cap c > 0 (0: off), as
    :func:`softmax_cross_entropy` documents them."""

    ignore_index: int | None = None
    smoothing: float = 0.0
    z_loss: float = 0.0
    soft_cap: float = 0.0


def loss_options(family: LossOptions) -> dict:
    """``family``'s loss options, as keywords for another cross-entropy family."""
    return {f.name: getattr(family, f.name) for f in dataclasses.fields(LossOptions)}


@dataclasses.dataclass(frozen=True)
class CrossEntropyForward(LossOptions, FewRowsCut, RowKernelFamily):
    """Per-row lse (fp32), and with labels the per-row loss (fp32): one streaming read of x.
    ``soft_cap`` > 0: of the capped logits soft_cap * tanh(x / soft_cap)."""

    with_labels: bool
    config: RowConfig | None = None
    values_per_thread = softmax_config.FORWARD_VALUES_PER_THREAD
    shifts_rows = True

    @property
    def name(self):
        return "cross_entropy_fwd" if self.with_labels else "logsumexp"

    @property
    def arg_names(self):
        return ("logits", "labels") if self.with_labels else ("x",)

    def out_avals(self, avals):
        m = avals[0].shape[:1]
        lse = jax.ShapeDtypeStruct(m, F32)
        return (lse, jax.ShapeDtypeStruct(m, F32)) if self.with_labels else (lse,)

    def reference(self, x, labels=None):
        lse = _lse(_capped(x, self.soft_cap)[0])
        if not self.with_labels:
            return (lse,)
        return lse, _ce_loss(x, labels, lse, self)

    def sharding_rule(self, avals) -> ShardingRule:
        # rows and classes may be sharded: per_shard combines a row's statistics over its classes
        operands = (("rows", "classes"),) + ((("rows",),) if self.with_labels else ())
        return ShardingRule(operands, (("rows",),) * (1 + self.with_labels), per_shard=self.per_shard)

    def per_shard(self, ctx: ShardContext, x, *labels):
        if not ctx.sharded("classes"):
            return run_kernel(self, x, *labels)
        lse_family = resolve(dataclasses.replace(self, with_labels=False, config=None), (x,))
        (local_lse,) = run_kernel(lse_family, x)
        classes = _ClassShard.of(ctx, x)
        lse = classes.combine_lse(local_lse)
        return (lse,) if not self.with_labels else (lse, _ce_loss(x, labels[0], lse, self, classes))

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.softmax import CrossEntropyForwardKernel

        return CrossEntropyForwardKernel(self.geometry(avals), self.with_labels, **loss_options(self))


@dataclasses.dataclass(frozen=True)
class CrossEntropyBackward(LossOptions, FewRowsCut, RowKernelFamily):
    """dlogits from (logits, labels, lse, dloss) in one pass (no reduction).

    ``in_place``: dlogits is written over the logits (each thread reads its values before it
    writes them) -- for logits that die here, like an LM head's chunk: one (rows, V) buffer
    fewer. Where the logits live on (a jit argument), XLA copies them first, so it is off by
    default.
    """

    config: RowConfig | None = None
    in_place: bool = False
    values_per_thread = softmax_config.FORWARD_VALUES_PER_THREAD
    shifts_rows = True
    cut_rows_exchange = False
    arg_names = ("logits", "labels", "lse", "dloss")

    @property
    def name(self):
        return "cross_entropy_bwd"

    def identity(self):
        return dataclasses.replace(self, in_place=False)  # the same kernel either way

    def operand_output_aliases(self):
        return {0: 0} if self.in_place else None

    def out_avals(self, avals):
        return (jax.ShapeDtypeStruct(avals[0].shape, avals[0].dtype),)

    def reference(self, x, labels, lse, dloss):
        return (_ce_grad(x, labels, lse, dloss, self).astype(x.dtype),)

    def sharding_rule(self, avals) -> ShardingRule:
        rows = ("rows",)
        return ShardingRule((("rows", "classes"), rows, rows, rows), (("rows", "classes"),),
                            per_shard=self.per_shard)

    def per_shard(self, ctx: ShardContext, x, labels, lse, dloss):
        if not ctx.sharded("classes"):
            return run_kernel(self, x, labels, lse, dloss)
        return (_ce_grad(x, labels, lse, dloss, self, _ClassShard.of(ctx, x)).astype(x.dtype),)

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.softmax import CrossEntropyBackwardKernel

        return CrossEntropyBackwardKernel(self.geometry(avals), **loss_options(self))


@dataclasses.dataclass(frozen=True)
class CrossEntropyWithGrad(LossOptions, RowKernelFamily):
    """(dlogits, lse, loss) from (logits, labels, dloss) in one pass over the logits: the forward
    and the backward of the cross-entropy for a dloss known before the logits die (an LM head
    whose loss is a weighted total: :mod:`cutelayers.ops.lm_head`). dlogits is always written over
    the logits (the kernel reads each value before it overwrites it); where the logits live on,
    XLA copies them first."""

    config: RowConfig | None = None
    values_per_thread = softmax_config.WITH_GRAD_VALUES_PER_THREAD
    shifts_rows = True
    staged_operands = 1  # a streamed row of logits, kept for pass 2 (cut over a cluster where long)
    arg_names = ("logits", "labels", "dloss")

    @property
    def name(self):
        return "cross_entropy_with_grad"

    def operand_output_aliases(self):
        return {0: 0}

    def kept_outputs(self, n_outputs):
        return (1, 2)  # dlogits is the logits' buffer

    def out_avals(self, avals):
        x = avals[0]
        per_row = jax.ShapeDtypeStruct(x.shape[:1], F32)
        return jax.ShapeDtypeStruct(x.shape, x.dtype), per_row, per_row

    def reference(self, x, labels, dloss):
        lse = _lse(_capped(x, self.soft_cap)[0])
        return _ce_grad(x, labels, lse, dloss, self).astype(x.dtype), lse, _ce_loss(x, labels, lse, self)

    def sharding_rule(self, avals) -> ShardingRule:
        rows = ("rows",)
        return ShardingRule((("rows", "classes"), rows, rows), (("rows", "classes"), rows, rows),
                            per_shard=self.per_shard)

    def per_shard(self, ctx: ShardContext, x, labels, dloss):
        if not ctx.sharded("classes"):
            return run_kernel(self, x, labels, dloss)
        # a row's statistics span the devices: the forward's class-sharded path, then the
        # gradient of each device's slice (as CrossEntropyBackward does)
        forward = CrossEntropyForward(True, **loss_options(self))
        lse, loss = forward.per_shard(ctx, x, labels)
        return _ce_grad(x, labels, lse, dloss, self, _ClassShard.of(ctx, x)).astype(x.dtype), lse, loss

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.softmax import CrossEntropyWithGradKernel

        return CrossEntropyWithGradKernel(self.geometry(avals), **loss_options(self))


# --- jnp references (the same decomposition as the kernels) -------------------------------------


def _capped(x, cap):
    """(cap * tanh(x / cap), tanh(x / cap)) in float32 for cap > 0, else (x, None): logit
    soft-capping."""
    if cap <= 0.0:
        return x, None
    t = jnp.tanh(x.astype(F32) / cap)
    return cap * t, t


def _lse(x):
    x32 = x.astype(F32)
    m = jnp.max(x32, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # all -inf rows: lse = -inf, not NaN
    return m + jnp.log(jnp.sum(jnp.exp(x32 - m[:, None]), axis=-1))


@dataclasses.dataclass(frozen=True)
class _ClassShard:
    """The classes one device's logits hold: ``offset`` .. ``offset`` + its width, of ``total``;
    ``ctx`` sums over the devices that share a row (None: the row is whole here)."""

    offset: jax.Array | int = 0
    total: int | None = None
    ctx: ShardContext | None = None

    @classmethod
    def of(cls, ctx: ShardContext, x) -> _ClassShard:
        """This device's slice of the classes of logits ``x`` (rows, classes / devices)."""
        axes = ctx.axes["classes"]
        devices = jax.lax.psum(1, axes)
        return cls(jax.lax.axis_index(axes) * x.shape[-1], x.shape[-1] * devices, ctx)

    def width(self, x) -> int:
        return x.shape[-1] if self.total is None else self.total

    def sum(self, value):
        return value if self.ctx is None else self.ctx.psum(value, {"classes"})

    def combine_lse(self, local_lse):
        """The rows' lse over all classes, from each device's lse over its slice."""
        m = jax.lax.pmax(local_lse, self.ctx.axes["classes"])
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        return m + jnp.log(self.sum(jnp.exp(local_lse - m)))


WHOLE = _ClassShard()


def _label_masks(labels, v, cfg):
    ignored = labels == cfg.ignore_index if cfg.ignore_index is not None else jnp.zeros(labels.shape, bool)
    valid = (labels >= 0) & (labels < v)
    return ignored, valid


def _ce_loss(x, labels, lse, cfg, classes: _ClassShard = WHOLE):
    """Per-row loss from the raw logits x (capped here, as in :func:`_ce_grad`) and their lse."""
    v, here = classes.width(x), x.shape[-1]
    x32 = _capped(x, cfg.soft_cap)[0].astype(F32)
    ignored, valid = _label_masks(labels, v, cfg)
    local = labels - classes.offset
    picked = jnp.take_along_axis(x32, jnp.clip(local, 0, here - 1)[:, None], axis=-1)[:, 0]
    if classes.ctx is not None:  # the label's logit is on one of the devices
        picked = classes.sum(jnp.where((local >= 0) & (local < here), picked, 0.0))
    smoothing = (cfg.smoothing / v) * classes.sum(jnp.sum(x32, -1)) if cfg.smoothing else 0.0
    loss = lse - (1.0 - cfg.smoothing) * picked - smoothing + cfg.z_loss * lse**2
    return jnp.where(ignored, 0.0, jnp.where(valid, loss, jnp.nan))


def _ce_grad(x, labels, lse, dloss, cfg, classes: _ClassShard = WHOLE):
    v = classes.width(x)
    ignored, valid = _label_masks(labels, v, cfg)
    x, t = _capped(x, cfg.soft_cap)
    p = jnp.exp(x.astype(F32) - lse[:, None])
    onehot = (jnp.arange(x.shape[-1]) + classes.offset)[None, :] == labels[:, None]
    d = p * (1.0 + 2.0 * cfg.z_loss * lse[:, None]) - (1.0 - cfg.smoothing) * onehot.astype(F32) - cfg.smoothing / v
    d = d * dloss[:, None] if t is None else d * dloss[:, None] * (1.0 - t * t)
    return jnp.where(ignored[:, None], 0.0, jnp.where(valid[:, None], d, jnp.nan))


# --- ops -----------------------------------------------------------------------------------------


@functools.cache
def _softmax_fn(log: bool):
    forward = fold_batch(lambda x: call_on_rows(SoftmaxForward(log), x)[0])
    backward = fold_batch(lambda y, g: call_on_rows(SoftmaxBackward(log), y, g)[0])

    @jax.custom_vjp
    def op(x):
        return forward(x)

    def fwd(x):
        y = forward(x)
        return y, y

    def bwd(y, g):
        return (backward(y, g.astype(y.dtype)),)

    op.defvjp(fwd, bwd)
    return op


def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis.

    Args:
      x: (..., N), N >= 1, bfloat16, float16 or float32.

    Returns:
      (..., N) in x's dtype; statistics in float32 (as ``jax.nn.softmax`` on x).
    """
    return _softmax_fn(False)(check_float_array("softmax", "x", x))


def log_softmax(x: jax.Array) -> jax.Array:
    """Log-softmax over the last axis; shapes and dtypes as :func:`softmax`."""
    return _softmax_fn(True)(check_float_array("log_softmax", "x", x))


@functools.cache
def _logsumexp_fn():
    family = CrossEntropyForward(with_labels=False)
    forward = fold_batch(lambda x: call_on_rows(family, x)[0])

    @jax.custom_vjp
    def op(x):
        return forward(x).astype(x.dtype)

    def fwd(x):
        lse = forward(x)
        return lse.astype(x.dtype), (x, lse)

    def bwd(res, g):
        x, lse = res
        # one elementwise pass that XLA fuses into its consumer
        return ((g.astype(F32)[..., None] * jnp.exp(x.astype(F32) - lse[..., None])).astype(x.dtype),)

    op.defvjp(fwd, bwd)
    return op


def logsumexp(x: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis, computed stably in float32 in one pass over x.

    Args:
      x: (..., N), N >= 1, bfloat16, float16 or float32.

    Returns:
      (...,) in x's dtype (as ``jax.nn.logsumexp``); rows of all -inf give -inf.
    """
    return _logsumexp_fn()(check_float_array("logsumexp", "x", x))


@functools.cache
def cross_entropy_kernels(ignore_index, smoothing=0.0, z_loss=0.0, soft_cap=0.0, in_place=False):
    """The cross-entropy kernel calls, vmappable, without a custom_vjp (shared with
    :mod:`cutelayers.ops.lm_head`, which differentiates them itself):

    * ``forward(logits (..., V), labels (...)) -> (lse, loss)``, both (...) float32 (lse of the
      capped logits when ``soft_cap`` > 0);
    * ``backward(logits, labels, lse, dloss (...) float32) -> dlogits`` in logits' dtype, over
      the logits' buffer with ``in_place`` (see :class:`CrossEntropyBackward`);
    * ``forward_with_grad(logits, labels, dloss) -> (lse, loss, dlogits)``: both in one pass over
      the logits, dlogits always over their buffer (:class:`CrossEntropyWithGrad`).
    """
    cfg = {"ignore_index": ignore_index, "smoothing": smoothing, "z_loss": z_loss, "soft_cap": soft_cap}
    forward = fold_batch(lambda x, labels: call_on_rows(CrossEntropyForward(True, **cfg), x, labels))
    backward = fold_batch(lambda x, labels, lse, g: call_on_rows(
        CrossEntropyBackward(**cfg, in_place=in_place), x, labels, lse, g)[0])

    def with_grad(x, labels, g):
        dx, lse, loss = call_on_rows(CrossEntropyWithGrad(**cfg), x, labels, g)
        return lse, loss, dx

    return forward, backward, fold_batch(with_grad)


@functools.cache
def _cross_entropy_fn(ignore_index, smoothing, z_loss, soft_cap):
    forward, backward, _ = cross_entropy_kernels(ignore_index, smoothing, z_loss, soft_cap)

    @jax.custom_vjp
    def op(logits, labels):
        return forward(logits, labels)[1]

    def fwd(logits, labels):
        lse, loss = forward(logits, labels)
        return loss, (logits, labels, lse)

    def bwd(res, g):
        logits, labels, lse = res
        return backward(logits, labels, lse, g.astype(F32)), None

    op.defvjp(fwd, bwd)
    return op


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array, *, ignore_index: int | None = None,
                          label_smoothing: float = 0.0, z_loss: float = 0.0,
                          logit_soft_cap: float | None = None) -> jax.Array:
    """Cross-entropy of integer labels, per row, over the last axis of ``logits``.

    Args:
      logits: (..., V), V >= 1, bfloat16, float16 or float32.
      labels: (...,) integers in [0, V); rows equal to ``ignore_index`` give loss 0 and gradient 0.
      ignore_index: label value of rows to ignore (e.g. -100 or a padding id), or None.
      label_smoothing: a in [0, 1): targets (1 - a) onehot + a / V, as ``optax.smooth_labels``.
      z_loss: coefficient of the auxiliary z-loss z * logsumexp(logits)^2 added per row.
      logit_soft_cap: None, or c > 0: the loss is of c * tanh(logits / c) (Gemma-style soft
        capping), computed in the kernel on the fly.

    Returns:
      (...,) float32 losses. Gradients flow to ``logits`` only (labels are integers).
    """
    op = "softmax_cross_entropy"
    logits = check_float_array(op, "logits", logits)
    labels, ignore_index = check_labels(op, labels, ignore_index, logits.shape[:-1], logits.shape[-1],
                                        "logits' shape without the class axis")
    options = check_loss_options(op, label_smoothing, z_loss, logit_soft_cap)
    return _cross_entropy_fn(ignore_index, *options)(logits, labels)


def check_loss_options(op: str, label_smoothing, z_loss, logit_soft_cap) -> tuple[float, float, float]:
    """Validate the cross-entropy options; returns (smoothing, z_loss, soft_cap) as floats, the
    cap 0.0 when off (the kernels' static key)."""
    smoothing, z = check_number(op, "label_smoothing", label_smoothing), check_number(op, "z_loss", z_loss)
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1); got {label_smoothing}")
    if not z >= 0.0:
        raise ValueError(f"{op}: z_loss must be >= 0; got {z_loss}")
    cap = 0.0 if logit_soft_cap is None else check_number(op, "logit_soft_cap", logit_soft_cap)
    if logit_soft_cap is not None and not cap > 0.0:
        raise ValueError(f"{op}: logit_soft_cap must be None or a finite number > 0; got {logit_soft_cap}")
    return smoothing, z, cap


def check_labels(op: str, labels, ignore_index, shape: tuple, v: int, shape_source: str):
    """Validate integer class labels of ``shape`` for ``v`` classes; returns (labels as int32,
    ignore_index as int | None).

    Concrete labels are checked eagerly: a value outside [0, v) other than ``ignore_index``
    raises. Traced labels cannot be checked; such rows give NaN losses and gradients.
    ``shape_source`` says where ``shape`` comes from, for the error message.
    """
    if not hasattr(labels, "dtype") or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"{op}: argument 'labels' must be an integer array; got "
                        f"{getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{op}: argument 'labels' has shape {tuple(labels.shape)}; expected "
                         f"{tuple(shape)} ({shape_source})")
    if ignore_index is not None:
        ignore_index = check_int(op, "ignore_index", ignore_index)
        if not INT32_MIN <= ignore_index <= INT32_MAX:
            raise ValueError(f"{op}: argument 'ignore_index' must fit int32 (the kernels' labels); "
                             f"got {ignore_index}")
    if not isinstance(labels, jax.core.Tracer):
        lab = np.asarray(labels)
        bad = (lab < 0) | (lab >= v)
        if ignore_index is not None:
            bad &= lab != ignore_index
        if bad.any():
            raise ValueError(f"{op}: argument 'labels' holds {int(bad.sum())} value(s) outside [0, {v}) "
                             f"(e.g. {int(lab[bad].ravel()[0])}) that are not ignore_index={ignore_index}")
    return as_int32(labels), ignore_index  # a traced out-of-range label stays out of range: a NaN row
