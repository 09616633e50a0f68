"""Autotuning: sweep each kernel family's configs on the GPU and store the winners.

    python -m cutelayers.bench.autotune --op layer_norm --shape 32768x4096 --dtype bfloat16
    python -m cutelayers.bench.autotune --op linear --shape 8192x4096x4096 4096x1024x4096 --output table.json
    python -m cutelayers.bench.autotune --op cross_entropy --shape 8192x32768 --dry-run   # no GPU needed
    python -m cutelayers.bench.autotune --op lm_head --shape 4096x4096x131072   # one chunk of a head
    python -m cutelayers.bench.autotune --op layer_norm --shape 512x262144 --param-dtype float32

An op names the kernel families it runs (``layer_norm``: ``layer_norm_fwd`` and ``layer_norm_bwd``;
``linear``: ``linear_fwd``, ``linear_dx``, ``linear_dkernel``; ``gated_mlp``: a SwiGLU / GeGLU block's
gated fc1 forward and hidden gradient, their own entries); a family's own name tunes only that
family (in the first op that runs it). The norm ops take ``--param-dtype``: scale and bias in
another dtype than x (float32, as Flax's modules train with), a table entry of its own. Shapes
are ``ROWSxN`` for the row ops, ``MxKxN`` for ``linear``, ``MxKxH`` (rows, model width, hidden
width) for ``gated_mlp`` and ``MxKxV`` (chunk rows, hidden width, vocabulary) for ``lm_head``,
whose kernels -- the logits GEMM with its exp epilogue, the hidden and kernel gradients of a chunk
-- have entries of their own. For every (family, shape, dtype), each candidate config of the
family's space
(:meth:`cutelayers.runtime.family.TunableFamily.config_space`) is compiled (all of a run's
candidates at once, in worker processes: :func:`cutelayers.parallel_compiles`) and run on random
operands, its results checked against the family's jnp reference (relative error within the
tolerance of the least precise dtype involved, ``REL_TOL`` x ``CHECK_SCALE``; a broken config is off
by O(1)), then timed with :func:`cutelayers.bench.timing.time_fn`. The fastest correct config wins
-- unless it beats the heuristic's by less than ``min_gain`` (2%: noise), in which case the
heuristic's is kept. A progress line per candidate, then a table of heuristic vs tuned time per
shape.

Winners go into a tuned-config table (see :mod:`cutelayers.tuning`): by default the user's, which
the runtime reads, so functions traced afterwards run the tuned kernels. Entries are keyed by the
GPU (``device_kind``), the family, dtype and static dims; a linear entry covers a range of row
counts (:func:`cutelayers.kernels.gemm_config.row_bucket`), a row-op entry a range too
(:func:`cutelayers.kernels.reduction_config.row_count_bucket`): tune at the row counts the kernels
will run (a training step's tokens), not only at large arrays.

The sweep logic (:func:`sweep`) takes a runner -- ``run(family, operands)`` and ``time(family,
operands)`` -- so it is testable without a GPU; :class:`DeviceRunner` is the real one.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from cutelayers import tuning
from cutelayers.backend import use_backend
from cutelayers.bench.timing import time_fn
from cutelayers.kernels.gemm_config import (
    PERSISTENT_SMS,
    decode_stream_k_pays,
    stream_k_pays,
    weight_grad_stream_k,
)
from cutelayers.ops.linear import (
    LinearForward,
    LinearInputGrad,
    LinearWeightGrad,
    gated_kernels_apply,
    kernels_apply,
)
from cutelayers.ops.norm import NormBackward, NormForward, forward_reference
from cutelayers.ops.reduce import RowReduce
from cutelayers.ops.softmax import (
    CrossEntropyBackward,
    CrossEntropyForward,
    CrossEntropyWithGrad,
    SoftmaxBackward,
    SoftmaxForward,
)
from cutelayers.runtime.family import TunableFamily
from cutelayers.runtime.parallel_compile import parallel_compiles
from cutelayers.runtime.primitive import kernels_supported, target_arch
from cutelayers.runtime.sharding import kernel_call
from cutelayers.runtime.tensors import FLOAT_DTYPES

F32 = jnp.float32
# Relative-error tolerances (‖out − ref‖ / ‖ref‖) of a result in each dtype (the tests use it too).
REL_TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}
CHECK_SCALE = 10.0  # rounding and summation order stay far below this; a broken config does not
MIN_GAIN = 0.02
EPSILON = 1e-6  # the norms' default


# --- what a sweep tunes --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One kernel family at one shape and dtype.

    ``family`` has no config yet; ``avals`` are its operands as the kernel sees them;
    ``make_operands()`` builds random operands of those avals (on the default device);
    ``observe(results)`` gives what is compared with the reference (the norm backward's per-CTA
    partials are compared summed, as the op uses them).
    """

    op: str
    family: TunableFamily
    avals: tuple[jax.ShapeDtypeStruct, ...]
    make_operands: Callable[[], tuple]
    observe: Callable[[tuple], tuple] = tuple

    @property
    def key(self) -> tuple[str, tuning.Dims]:
        return self.family.tuning_key(self.avals)

    @property
    def dims_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.key[1])

    def describe(self) -> str:
        return f"{self.family.name} {self.key[0]} {self.dims_text}"

    def tolerance(self) -> float:
        floats = [jnp.dtype(a.dtype).name for a in self.avals if jnp.dtype(a.dtype) in FLOAT_DTYPES]
        return max(REL_TOL[d] for d in floats) * CHECK_SCALE


def _normal(key, shape, dtype, scale=1.0, loc=0.0):
    return (loc + scale * jax.random.normal(key, shape, F32)).astype(dtype)


def _keys(count: int):
    return jax.random.split(jax.random.key(0), count)


def _norm_cases(op: str, center: bool, shape, dtype, residual: bool = False, param_dtype=None) -> list[Case]:
    """The norm's forward and backward families; with ``residual``, the fused residual add's
    (``add_layer_norm`` / ``add_rms_norm``: x + residual in, dsummed added to dx). Scale and bias
    in ``param_dtype`` (default: x's)."""
    m, n = shape
    S = jax.ShapeDtypeStruct
    pdt = jnp.dtype(param_dtype or dtype)
    x, vec, stat = S((m, n), dtype), S((n,), pdt), S((m, 1), F32)
    k = _keys(6)
    rows = 1 + residual  # x [, residual] in; dy [, dsummed] back

    def forward_operands():
        params = (_normal(k[1], (n,), pdt, 0.1, 1.0),) + ((_normal(k[2], (n,), pdt, 0.1),) if center else ())
        return (*(_normal(key, (m, n), dtype) for key in (k[0], k[4])[:rows]), *params)

    def backward_operands():
        forward = forward_operands()
        x, scale = forward[0], forward[rows]
        _, mean, rstd = forward_reference(x, scale, None, center=center, epsilon=EPSILON, out_dtype=dtype)
        stats = ((mean[:, None],) if center else ()) + (rstd[:, None],)
        return (x, *(_normal(key, (m, n), dtype) for key in (k[3], k[5])[:rows]), *stats, scale)

    def summed_partials(results):
        dx, *partials = results
        return (dx, *backward.param_grads(n, *partials))

    backward_avals = (x,) * (1 + rows) + (stat,) * center + (stat, vec)
    backward = NormBackward(center, True, True, center, residual)
    if not tuning.resolve(backward, backward_avals).holds_sums(backward_avals):
        backward = NormBackward(center, True, False, False, residual)  # as the op: too wide for its sums, dx only
    return [
        Case(op, NormForward(center, True, center, EPSILON, dtype.name, residual), (x,) * rows + (vec,) * (1 + center),
             forward_operands),
        Case(op, backward, backward_avals, backward_operands, summed_partials),
    ]


def _softmax_cases(op: str, log: bool, shape, dtype) -> list[Case]:
    x = jax.ShapeDtypeStruct(shape, dtype)
    k = _keys(2)
    forward = SoftmaxForward(log)

    def backward_operands():
        (y,) = forward.reference(_normal(k[0], shape, dtype, 2.0))
        return y, _normal(k[1], shape, dtype)

    return [Case(op, forward, (x,), lambda: (_normal(k[0], shape, dtype, 2.0),)),
            Case(op, SoftmaxBackward(log), (x, x), backward_operands)]


def _logsumexp_cases(op: str, shape, dtype) -> list[Case]:
    k = _keys(1)
    return [Case(op, CrossEntropyForward(False), (jax.ShapeDtypeStruct(shape, dtype),),
                 lambda: (_normal(k[0], shape, dtype, 2.0),))]


def _cross_entropy_cases(op: str, shape, dtype) -> list[Case]:
    m, n = shape
    S = jax.ShapeDtypeStruct
    logits, labels, per_row = S(shape, dtype), S((m,), jnp.int32), S((m,), F32)
    k = _keys(3)
    forward = CrossEntropyForward(True)

    def forward_operands():
        return _normal(k[0], shape, dtype, 2.0), jax.random.randint(k[1], (m,), 0, n, jnp.int32)

    def backward_operands():
        x, y = forward_operands()
        lse, _ = forward.reference(x, y)
        return x, y, lse, _normal(k[2], (m,), F32)

    def with_grad_operands():
        x, y = forward_operands()
        return x, y, _normal(k[2], (m,), F32)

    # the loss and its gradient in one pass, as an LM head's chunk runs it (the gradient written
    # over the logits: the timed call copies them first, the same for every candidate)
    return [Case(op, forward, (logits, labels), forward_operands),
            Case(op, CrossEntropyBackward(), (logits, labels, per_row, per_row), backward_operands),
            Case(op, CrossEntropyWithGrad(), (logits, labels, per_row), with_grad_operands)]


def _reduce_cases(op: str, kind: str, shape, dtype) -> list[Case]:
    k = _keys(1)
    return [Case(op, RowReduce(kind), (jax.ShapeDtypeStruct(shape, dtype),), lambda: (_normal(k[0], shape, dtype),))]


def _gemm_case_maker(op: str, m: int, k_dim: int, n: int, dtype) -> Callable[..., Case]:
    """``case(family, *operand names)``: a Case of a GEMM family on random operands of an
    M x K x N GEMM (x (1, M, K), w (1, K, N), dz (1, M, N), ...), drawn by name; a shape or dtype
    the kernels do not take is refused here."""
    usable, why = kernels_apply(dtype, k_dim, n)
    if not usable:
        raise ValueError(f"autotune {op}: shape {m}x{k_dim}x{n}, dtype {dtype.name}: {why}")
    S = jax.ShapeDtypeStruct
    x, w, b, dz = S((1, m, k_dim), dtype), S((1, k_dim, n), dtype), S((n,), dtype), S((1, m, n), dtype)
    k = _keys(5)
    # operand -> (key, aval, scale): the weight scaled by 1/sqrt(K) keeps the outputs of order 1;
    # the residual is an (M, N) tile like dz, the pre-activation an (M, K) one like x; the weight
    # gradient's float32 bias-gradient sums, stream-K's flags, zeros and accumulator start as zeros
    # (scale 0)
    draws = {"x": (k[0], x, 1.0), "w": (k[1], w, k_dim**-0.5), "b": (k[2], b, 1.0), "dz": (k[3], dz, 1.0),
             "residual": (k[4], dz, 1.0), "preact": (k[4], x, 1.0),
             "sums": (k[0], S((1, n), F32), 0.0), "accumulator": (k[0], S((1, k_dim, n), F32), 0.0),
             "zeros": (k[0], S((1, m, n), F32), 0.0), "dx_zeros": (k[0], S((1, m, k_dim), F32), 0.0),
             "flags": (k[0], S((PERSISTENT_SMS,), jnp.int32), 0.0)}

    def case(family, *names):
        avals = tuple(draws[name][1] for name in names)
        # stream-K's workspace and flags (the last two results, when its partial tiles meet in the
        # workspace) are scratch
        observe = (lambda results: tuple(results)[:-2]) if family.fixup else tuple
        return Case(op, family, avals, lambda: tuple(_normal(key, aval.shape, aval.dtype, scale)
                                                     for key, aval, scale in (draws[name] for name in names)), observe)

    return case


def _linear_cases(op: str, shape, dtype) -> list[Case]:
    m, k_dim, n = shape
    case = _gemm_case_maker(op, m, k_dim, n, dtype)

    # Without a source tile the forward is tuned with the benchmark's epilogue (bias + gelu), whose
    # entry serves every such epilogue (their cost is small next to the mainloop). An epilogue that
    # reads a source tile -- a residual, the pre-activation of an activation gradient -- is another
    # kernel with its own key (its ring takes shared memory from the mainloop): tuned on its own.
    # Decode rows over a long contraction run their forward as stream-K (the input gradient's kernel
    # reading the weight in the other layout, every epilogue in XLA): that kernel, once.
    forwards = [case(LinearInputGrad(kernel_nk=True, stream_k=True), "x", "w", "zeros")] if decode_stream_k_pays(
        m, n, k_dim) else [case(LinearForward("gelu", True, False, False), "x", "w", "b"),
                           case(LinearForward("none", True, True, False), "x", "w", "b", "residual")]
    return forwards + [
        case(LinearInputGrad(), "dz", "w"),
        case(LinearInputGrad("gelu"), "dz", "w", "preact"),
        # the weight gradient as a layer with a bias runs it: db from the same kernel, and where the
        # (K, N) output is too small to fill the GPU, on the stream-K schedule (its partial tiles in
        # a workspace, or for the fewest tiles added into float32 zeros)
        _weight_grad_case(case, weight_grad_stream_k(k_dim, n, m)),
    ]


def _weight_grad_case(case, schedule: str | None) -> Case:
    """The layer's weight gradient with a bias, as its op runs it on ``schedule``
    (:func:`weight_grad_stream_k`)."""
    if schedule is None:
        return case(LinearWeightGrad(operand_sums="b"), "x", "dz", "sums")
    if schedule == "workspace":
        return case(LinearWeightGrad(stream_k=True, operand_sums="b"), "x", "dz", "sums", "flags")
    return case(LinearWeightGrad(accumulate=True, stream_k=True, operand_sums="b"), "x", "dz", "sums", "accumulator")


def _lm_head_cases(op: str, shape, dtype) -> list[Case]:
    """An LM head chunk of shape M x K x V (chunk rows, hidden width, vocabulary; an (H, V)
    kernel) as :func:`cutelayers.ops.linear_cross_entropy` runs it: the logits GEMM with the exp
    epilogue (:func:`cutelayers.ops.linear.exp_logits`), the hidden gradient over the vocabulary
    (stream-K where it pays, into zeros) and the kernel gradient added into the float32 running
    sum -- each its own entry."""
    m, k_dim, n = shape
    case = _gemm_case_maker(op, m, k_dim, n, dtype)
    dh_stream_k = stream_k_pays(m, k_dim, n)
    dkernel_stream_k = stream_k_pays(k_dim, n, m)
    return [
        case(LinearForward("none", False, False, False, exp_row_sums=True), "x", "w"),
        case(LinearInputGrad(stream_k=dh_stream_k), "dz", "w", *("dx_zeros",) * dh_stream_k),
        case(LinearWeightGrad(accumulate=True, stream_k=dkernel_stream_k), "x", "dz", "accumulator"),
    ]


def _gated_mlp_cases(op: str, shape, dtype) -> list[Case]:
    """A gated MLP block of shape M x K x H (rows, model width, hidden width): its two gated
    kernels, fc1's forward (x @ w1 (K, 2H) + b1, gated, storing z1) and the hidden gradient
    (dy @ w2ᵀ with w2 (H, K), both halves' act' from z1, and h again). Their entries serve silu
    and gelu gates alike; fc2 and the other gradients are the linear op's (``linear`` at M x H x
    K)."""
    m, k_dim, h = shape
    usable, why = gated_kernels_apply(dtype, k_dim, h)
    if not usable:
        raise ValueError(f"autotune {op}: shape {m}x{k_dim}x{h}, dtype {dtype.name}: {why}")
    S = jax.ShapeDtypeStruct
    x, w1, b1 = S((1, m, k_dim), dtype), S((1, k_dim, 2 * h), dtype), S((2 * h,), dtype)
    w2, z1 = S((1, h, k_dim), dtype), S((1, m, 2 * h), dtype)
    k = _keys(5)
    forward = Case(op, LinearForward("silu", True, False, True, gated=True), (x, w1, b1), lambda: (
        _normal(k[0], x.shape, dtype), _normal(k[1], w1.shape, dtype, k_dim**-0.5), _normal(k[2], b1.shape, dtype)))
    hidden_grad = Case(op, LinearInputGrad("silu", gated=True), (x, w2, z1), lambda: (
        _normal(k[3], x.shape, dtype), _normal(k[4], w2.shape, dtype, k_dim**-0.5), _normal(k[0], z1.shape, dtype)))
    return [forward, hidden_grad]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    build: Callable[..., list[Case]]  # (op, shape, dtype[, param_dtype]) -> cases
    shape_form: str  # "ROWSxN", "MxKxN", "MxKxH" or "MxKxV"
    families: tuple[str, ...]  # names of the families the cases tune
    takes_param_dtype: bool = False  # the norms: scale and bias in a dtype of their own


OPS = {
    "layer_norm": OpSpec(functools.partial(_norm_cases, center=True), "ROWSxN", ("layer_norm_fwd", "layer_norm_bwd"),
                         takes_param_dtype=True),
    "rms_norm": OpSpec(functools.partial(_norm_cases, center=False), "ROWSxN", ("rms_norm_fwd", "rms_norm_bwd"),
                       takes_param_dtype=True),
    "add_layer_norm": OpSpec(functools.partial(_norm_cases, center=True, residual=True), "ROWSxN",
                             ("add_layer_norm_fwd", "add_layer_norm_bwd"), takes_param_dtype=True),
    "add_rms_norm": OpSpec(functools.partial(_norm_cases, center=False, residual=True), "ROWSxN",
                           ("add_rms_norm_fwd", "add_rms_norm_bwd"), takes_param_dtype=True),
    "softmax": OpSpec(functools.partial(_softmax_cases, log=False), "ROWSxN", ("softmax_fwd", "softmax_bwd")),
    "log_softmax": OpSpec(functools.partial(_softmax_cases, log=True), "ROWSxN",
                          ("log_softmax_fwd", "log_softmax_bwd")),
    "logsumexp": OpSpec(_logsumexp_cases, "ROWSxN", ("logsumexp",)),
    "cross_entropy": OpSpec(_cross_entropy_cases, "ROWSxN",
                            ("cross_entropy_fwd", "cross_entropy_bwd", "cross_entropy_with_grad")),
    "reduce_sum": OpSpec(functools.partial(_reduce_cases, kind="sum"), "ROWSxN", ("reduce_sum",)),
    "reduce_mean": OpSpec(functools.partial(_reduce_cases, kind="mean"), "ROWSxN", ("reduce_mean",)),
    "reduce_max": OpSpec(functools.partial(_reduce_cases, kind="max"), "ROWSxN", ("reduce_max",)),
    "linear": OpSpec(_linear_cases, "MxKxN", ("linear_fwd", "linear_dx", "linear_dkernel")),
    "gated_mlp": OpSpec(_gated_mlp_cases, "MxKxH", ("linear_fwd", "linear_dx")),
    "lm_head": OpSpec(_lm_head_cases, "MxKxV", ("linear_fwd", "linear_dx", "linear_dkernel")),
}
# a kernel's name selects the first op that tunes it (gated_mlp's kernels by their op's name)
FAMILY_OPS = {family: op for op, spec in reversed(OPS.items()) for family in spec.families}


def cases(name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence, param_dtype=None) -> list[Case]:
    """The cases of op or kernel family ``name`` for every shape and dtype (a norm's scale and bias
    in ``param_dtype``, default x's)."""
    if name in OPS:
        op, only = name, None
    elif name in FAMILY_OPS:
        op, only = FAMILY_OPS[name], name
    else:
        raise ValueError(f"autotune: unknown op or kernel {name!r}; allowed ops: {', '.join(OPS)}; "
                         f"kernels: {', '.join(FAMILY_OPS)}")
    spec = OPS[op]
    extra = {}
    if param_dtype is not None:
        if not spec.takes_param_dtype:
            raise ValueError(f"autotune {name}: param_dtype applies to the norm ops "
                             f"({', '.join(o for o, s in OPS.items() if s.takes_param_dtype)}), not {op}")
        extra = {"param_dtype": _float_dtype(name, "param_dtype", param_dtype)}
    rank = spec.shape_form.count("x") + 1
    found = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) != rank or not all(isinstance(d, int) and d >= 1 for d in shape):
            raise ValueError(f"autotune {name}: shape {shape} is not {spec.shape_form} with positive sizes")
        for dtype in dtypes:
            dtype = _float_dtype(name, "dtype", dtype)
            found += [c for c in spec.build(op, shape=shape, dtype=dtype, **extra) if only in (None, c.family.name)]
    return found


def _float_dtype(name: str, what: str, dtype):
    """``dtype`` as a jnp dtype, if it is one the kernels take (else a ValueError naming ``what``)."""
    dtype = jnp.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"autotune {name}: {what} {dtype.name} is not one of {', '.join(d.name for d in FLOAT_DTYPES)}")
    return dtype


def list_candidates(name: str, shapes, dtypes, param_dtype=None) -> list[tuple[Case, tuple, Any]]:
    """(case, candidate configs, heuristic config) for every case: what a sweep would try."""
    return [(c, c.family.config_space(c.avals), c.family.default_config(c.avals))
            for c in cases(name, shapes, dtypes, param_dtype)]


# --- running candidates --------------------------------------------------------------------------

class Runner(Protocol):
    device_kind: str

    def run(self, family, operands) -> tuple:
        """Compile and run ``family`` (config chosen) once on ``operands``; its results."""

    def time(self, family, operands) -> float:
        """Seconds per call of ``family`` on ``operands``."""


class NoGpuError(RuntimeError):
    pass


class DeviceRunner:
    """Runs candidates on this machine's Hopper GPU, through the kernel-call primitive."""

    def __init__(self):
        # the GPU the table is keyed by (the first) must be the one kernels are built for and run on
        self.device_kind = tuning.visible_gpu_kind()
        arch, where = target_arch()
        if self.device_kind is None or not kernels_supported(arch):
            raise NoGpuError(
                "autotuning times kernels on a Hopper GPU (compute capability 9.x); found: "
                f"{where if self.device_kind else 'no CUDA device'}. Run it on a Hopper host, or "
                "use --dry-run to list the candidate configs.")
        self._functions: dict = {}

    def _function(self, family):
        """One jitted call per candidate, shared by its run and its timing."""
        if family not in self._functions:
            self._functions[family] = jax.jit(functools.partial(kernel_call, family))
        return self._functions[family]

    def prepare(self, todo: Sequence[Case]) -> None:
        """Lower every candidate of ``todo`` inside :func:`cutelayers.parallel_compiles`: their
        kernels build in worker processes at once, before the sweeps run them one by one."""
        with use_backend("cute"), parallel_compiles():
            for case in todo:
                for config in case.family.config_space(case.avals):
                    self._function(case.family.with_config(config, case.avals)).lower(*case.avals)

    def run(self, family, operands):
        with use_backend("cute"):
            return jax.block_until_ready(self._function(family)(*operands))

    def time(self, family, operands):
        with use_backend("cute"):
            return time_fn(self._function(family), *operands)


# --- the sweep -----------------------------------------------------------------------------------

def relative_error(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ over the finite entries, in fp32 on the arrays' device; inf where the
    shapes or the positions of non-finite values differ."""
    out, ref = jnp.asarray(out, F32), jnp.asarray(ref, F32)
    if out.shape != ref.shape or not bool(jnp.all(jnp.isfinite(out) == jnp.isfinite(ref))):
        return float("inf")
    finite = jnp.isfinite(ref)
    diff = jnp.linalg.norm(jnp.where(finite, out - ref, 0.0).ravel())
    scale = jnp.linalg.norm(jnp.where(finite, ref, 0.0).ravel())
    return float(diff / jnp.maximum(scale, jnp.finfo(F32).tiny))


@dataclasses.dataclass(frozen=True)
class Trial:
    """One candidate: its time, or why it was rejected."""

    config: Any
    seconds: float | None = None
    error: float | None = None  # relative error against the reference
    rejected: str | None = None


@dataclasses.dataclass(frozen=True)
class SweepResult:
    case: Case
    default: Any  # the heuristic's config
    trials: tuple[Trial, ...]
    winner: Any | None  # None: no candidate was correct

    def seconds(self, config) -> float | None:
        return next((t.seconds for t in self.trials if t.config == config), None)


def sweep(case: Case, runner: Runner, *, min_gain: float = MIN_GAIN, log: Callable[[str], None] = print) -> SweepResult:
    """Try every candidate config of ``case``: run, check against the reference, time; pick the
    winner (the fastest correct config, or the heuristic's when that is within ``min_gain``)."""
    family = case.family
    candidates = family.config_space(case.avals)
    default = family.default_config(case.avals)
    operands = case.make_operands()
    tolerance = case.tolerance()
    # any config's reference: it is the op's math, the same for every candidate once observed
    expected = case.observe(dataclasses.replace(family, config=default).reference(*operands))
    trials = []
    for i, config in enumerate(candidates, 1):
        configured = family.with_config(config, case.avals)
        label = f"[{case.describe()}] {i}/{len(candidates)} {tuning.describe_config(config)}"
        label += " (heuristic)" if config == default else ""
        try:
            results = case.observe(runner.run(configured, operands))
        except Exception as e:  # noqa: BLE001 -- a candidate that fails to compile or launch is reported, not fatal
            trials.append(Trial(config, rejected=f"failed: {type(e).__name__}: {e}"))
            log(f"{label}: FAILED ({type(e).__name__}: {e})")
            continue
        error = max(relative_error(r, e) for r, e in zip(results, expected, strict=True))
        if not error <= tolerance:
            trials.append(Trial(config, error=error, rejected=f"relative error {error:.2e} > {tolerance:.1e}"))
            log(f"{label}: WRONG (relative error {error:.2e} > {tolerance:.1e})")
            continue
        seconds = runner.time(configured, operands)
        trials.append(Trial(config, seconds=seconds, error=error))
        log(f"{label}: {seconds * 1e6:.1f} us (relative error {error:.1e})")
    result = SweepResult(case, default, tuple(trials), winner=None)
    timed = [t for t in trials if t.seconds is not None]
    if not timed:
        return result
    best = min(timed, key=lambda t: t.seconds)
    default_seconds = result.seconds(default)
    keep_default = default_seconds is not None and best.seconds > default_seconds * (1.0 - min_gain)
    return dataclasses.replace(result, winner=default if keep_default else best.config)


def table_entry(result: SweepResult, device: str) -> dict:
    """The tuned-table entry of a sweep's winner."""
    dtype, dims = result.case.key
    entry = {"device": device, "kernel": result.case.family.name, "dtype": dtype, "dims": dict(dims),
             "config": tuning.config_fields(result.winner),
             "time_us": round(result.seconds(result.winner) * 1e6, 2)}
    default_seconds = result.seconds(result.default)
    if default_seconds is not None:
        entry["default_time_us"] = round(default_seconds * 1e6, 2)
    return entry


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def format_table(results: Sequence[SweepResult]) -> str:
    """Markdown table: heuristic vs tuned config and time per case."""
    lines = ["| kernel | dtype | dims | heuristic config | heuristic us | tuned config | tuned us | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        t_default = r.seconds(r.default)
        t_best = r.seconds(r.winner) if r.winner is not None else None
        speedup = f"{t_default / t_best:.2f}" if t_default and t_best else "-"
        tuned = "none correct" if r.winner is None else tuning.describe_config(r.winner)
        lines.append(f"| {r.case.family.name} | {r.case.key[0]} | {r.case.dims_text} | "
                     f"{tuning.describe_config(r.default)} | {_us(t_default)} | {tuned} | {_us(t_best)} | {speedup} |")
    return "\n".join(lines)


def autotune(name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence = ("bfloat16",), *,
             output: str | Path | None = None, runner: Runner | None = None, min_gain: float = MIN_GAIN,
             log: Callable[[str], None] = print, param_dtype=None) -> list[SweepResult]:
    """Sweep the configs of op or kernel family ``name`` for every shape and dtype (a norm's scale
    and bias in ``param_dtype``, default x's) on the GPU and
    add the winners to the tuned-config table ``output`` (default: the user's table,
    :func:`cutelayers.tuning.user_table_path`). Returns one :class:`SweepResult` per case.

    ``runner`` defaults to :class:`DeviceRunner`, which raises :class:`NoGpuError` without a
    Hopper GPU. A table that cannot be written is a ValueError before the sweep. See the module
    docstring for the rules.
    """
    todo = cases(name, shapes, dtypes, param_dtype)  # argument errors before anything runs
    path = Path(output) if output is not None else tuning.user_table_path()
    if path is None:
        raise ValueError("autotune: no output table: pass output= (--output), or unset the empty "
                         "CUTELAYERS_TUNING_FILE")
    if runner is None:
        runner = DeviceRunner()
    # before the sweep, which takes minutes: adding nothing creates the table, or rewrites it
    # unchanged, and fails where the sweep's winners could not be written
    _write_table(path, [])
    if isinstance(runner, DeviceRunner):
        runner.prepare(todo)
    results = [sweep(c, runner, min_gain=min_gain, log=log) for c in todo]
    log(format_table(results))
    entries = [table_entry(r, runner.device_kind) for r in results if r.winner is not None]
    if entries:
        _write_table(path, entries)
    log(f"wrote {len(entries)} tuned config(s) for {runner.device_kind!r} to {path}")
    return results


def _write_table(path: Path, entries: list[dict]) -> None:
    """:func:`cutelayers.tuning.write_entries`, its OSError (a folder that cannot be made or written
    in) a ValueError naming the table."""
    try:
        tuning.write_entries(path, entries)
    except OSError as e:
        raise ValueError(f"autotune: cannot write the tuned-config table {path}: {e}") from None


# --- command line --------------------------------------------------------------------------------

def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not sizes joined by 'x' (e.g. 32768x4096)") from None


def _min_gain(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in [0, 1) (0.02: 2%); got {text}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cutelayers.bench.autotune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True, metavar="NAME",
                        help=f"an op ({', '.join(OPS)}) or one of its kernels ({', '.join(FAMILY_OPS)})")
    parser.add_argument("--shape", type=_parse_shape, nargs="+", required=True,
                        help="ROWSxN for the row ops, MxKxN for linear, MxKxH (model and hidden widths) for gated_mlp, "
                             "MxKxV (chunk rows, hidden width, vocabulary) for lm_head")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=[d.name for d in FLOAT_DTYPES])
    parser.add_argument("--param-dtype", choices=[d.name for d in FLOAT_DTYPES],
                        help="the norm ops' scale and bias dtype (default: x's; float32 is what Flax's modules train with)")
    parser.add_argument("--output", type=Path, help="tuned-config table to add the winners to "
                        "(default: $CUTELAYERS_TUNING_FILE or ~/.cache/cutelayers/tuned_configs.json)")
    parser.add_argument("--min-gain", type=_min_gain, default=MIN_GAIN,
                        help=f"keep the heuristic config unless a candidate is this much faster (default {MIN_GAIN})")
    parser.add_argument("--dry-run", action="store_true", help="list the candidate configs per shape; no GPU needed")
    args = parser.parse_args(argv)
    try:
        if args.dry_run:
            for case, candidates, default in list_candidates(args.op, args.shape, args.dtype, args.param_dtype):
                print(f"{case.describe()}: {len(candidates)} candidates")
                for config in candidates:
                    print(f"  {tuning.describe_config(config)}{' (heuristic)' if config == default else ''}")
            return 0
        autotune(args.op, args.shape, args.dtype, output=args.output, min_gain=args.min_gain,
                 param_dtype=args.param_dtype)
    except (ValueError, NoGpuError) as e:
        print(f"cutelayers.bench.autotune: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
