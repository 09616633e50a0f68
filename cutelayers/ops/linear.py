"""Fused dense layer: ``fused_linear(x, kernel, bias, activation=..., residual=...)``.

    y = act(x @ kernel + bias) + residual

Forward: one CuTe GEMM (:mod:`cutelayers.kernels.gemm`) with bias, activation and residual in its
epilogue. Under differentiation (the custom_vjp forward) the same kernel also stores the
pre-activation ``z = x @ kernel + bias`` when the activation is not ``none``; the plain forward
never writes it.

Backward, from the saved (x, kernel, z):

* ``dz = dy * act'(z)``: one elementwise jnp pass;
* ``dx = dz @ kernelᵀ``: the GEMM kernel reading the (K, N) kernel as stored (K-major B operand);
* ``dkernel = xᵀ @ dz``: the GEMM kernel on transposed *views* of x and dz (M-major A and B
  operands through the primitive's ``modes``), contracting over the rows; no transpose is
  materialised;
* ``dbias = sum(dz)`` over rows: from the same dkernel launch, whose idle producer warps sum dz
  while its tensor cores run (no pass over dz of its own); ``dresidual = dy``.

When the kernels run: bfloat16 / float16 operands with K and N multiples of 8 (TMA needs 16-byte
row strides). Otherwise -- float32, or K / N not multiples of 8 -- the op runs its jnp reference,
the same decomposition with XLA GEMMs, and logs once why. ``precision`` (as in ``jax.lax.dot``)
applies to those XLA GEMMs; the kernels multiply bfloat16 / float16 exactly and accumulate in
float32, at least as precise as any ``precision`` asks.

Decode rows (at most 64) into few output tiles: each tile's contraction is split over a cluster
of two to four CTAs, the fused epilogue unchanged
(:func:`cutelayers.kernels.gemm_config.decode_split_config`); where even that would leave most SMs
idle over a long contraction (:func:`cutelayers.kernels.gemm_config.decode_stream_k_pays`), the
forward's GEMM is stream-K over the whole GPU into float32 zeros, and bias, activation and
residual are one XLA pass over that (rows, N) sum.

Mixed precision: the parameters (kernel, bias) may be float32 while x is bfloat16 / float16, as a
Flax module with ``param_dtype=float32, dtype=bfloat16`` holds them. The op casts them to x's dtype
for its GEMMs (what the module's ``promote_dtype`` would do) and returns their gradients in float32:
dbias and a stream-K dkernel as the kernel's float32 sums are (no 16-bit rounding, no cast pass),
any other dkernel as its kernel's 16-bit result converted, which XLA fuses into the gradient's
readers (the optimizer then reads 2 bytes a weight; a float32 store would cost more bytes). Below
``MIXED_PRECISION_KERNEL_ROWS`` rows (decode) the weights' bytes are the cost, and XLA, which fuses
the cast into its own GEMM, is faster: there the ``auto`` backend runs the jnp path (logged once,
:func:`choose_kernels`, which every GEMM op's kernel-or-reference choice goes through).

vmap (:mod:`cutelayers.ops._batching`): batch dims of x / residual fold into rows (one launch)
while kernel / bias are shared; per-example kernel or bias falls back to ``jax.lax.map`` (one
launch per example). The fold happens before differentiation (the rule is around the custom_vjp),
so ``grad(vmap(...))`` -- the usual Equinox style -- runs the backward once on all rows: dkernel is
one (K, N) GEMM, as for a call on the whole batch. ``vmap(grad(...))`` asks for per-example
gradients and gets them: dkernel (B, K, N) in one batched launch (the batch is the kernel's L mode).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from cutelayers import backend as _backend
from cutelayers.kernels.gemm_config import (
    CONFIGS,
    EXP_CLAMP,
    EXTRA_CONFIGS,
    OPERAND_SUMS,
    PERSISTENT_SMS,
    ROW_SUM_BLOCK,
    SPLIT_K_CONFIGS,
    GemmConfig,
    config_class,
    decode_split_config,
    decode_stream_k_pays,
    row_bucket,
    stream_k_config,
    stream_k_pays,
    weight_grad_stream_k,
)
from cutelayers.kernels.hopper import concrete_dim
from cutelayers.ops._batching import fold_batch
from cutelayers.ops._rowwise import check_float_array
from cutelayers.ops._zeros import zeros_after
from cutelayers.runtime.family import Halves, ShardingRule, TunableFamily
from cutelayers.runtime.sharding import (
    explicit_sharding,
    kernel_avals,
    kernel_call,
    run_kernel,
    sum_partials,
    typed_like,
    vary_like,
)
from cutelayers.tuning import resolve

# Activation names and their fp32 jnp definitions (the kernel epilogue implements the same
# formulas). "gelu" is jax.nn.gelu's default tanh approximation.
ACTIVATION_FUNCTIONS = {
    "none": lambda z: z,
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "leaky_relu": jax.nn.leaky_relu,
    "hardswish": jax.nn.hard_swish,
}

# Gated activations (an MLP's SwiGLU / GeGLU) -> the gate's activation: a (K, 2H) kernel holds the
# gate and value halves side by side, and the layer's output (..., H) is act(gate) * value.
GATED_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
# The gated kernel's tiles hold a block of this many columns of each half (tile_n / 2 of its
# 128-column tiles): the hidden width must be a multiple for the kernel to run.
GATED_BLOCK = 64
# The GEMM kernels' operand dtypes; layers in these may keep float32 parameters (cast for the
# GEMMs, float32 gradients).
MIXED_PRECISION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def is_gated(activation) -> bool:
    """Whether ``activation`` names a gated layer (:data:`GATED_ACTIVATIONS`)."""
    return isinstance(activation, str) and activation in GATED_ACTIVATIONS


def gated_hidden(z, activation: str):
    """A gated layer's output from its pre-activation z (..., 2H): act(gate) * value, in z's dtype."""
    gate, value = jnp.split(z, 2, axis=-1)
    return ACTIVATION_FUNCTIONS[GATED_ACTIVATIONS[activation]](gate) * value


def kernel_activation(activation: str) -> tuple[str, bool]:
    """(the kernel epilogue's activation, gated) of an op's activation name: a gated one's gate."""
    return (GATED_ACTIVATIONS[activation], True) if is_gated(activation) else (activation, False)


def layer_activation(activation: str, gated: bool) -> str:
    """The op's activation name of a kernel family's ``activation``: itself, or if ``gated`` the
    gated activation whose gate it is."""
    return next(name for name, gate in GATED_ACTIVATIONS.items() if gate == activation) if gated else activation


def activation_fn(activation: str):
    """z (..., N) -> the layer's output before a residual: an elementwise activation, or a gated
    one's act(gate) * value (..., N / 2)."""
    if is_gated(activation):
        return functools.partial(gated_hidden, activation=activation)
    return ACTIVATION_FUNCTIONS[activation]


# jax.nn / jnp function objects recognised as a fusable activation.
_KNOWN_FUNCTIONS = (
    (jax.nn.relu, "relu"),
    (jax.nn.gelu, "gelu"),
    (jax.nn.silu, "silu"),
    (jax.nn.swish, "silu"),
    (jax.nn.sigmoid, "sigmoid"),
    (jnp.tanh, "tanh"),
    (jax.nn.tanh, "tanh"),
    (jax.nn.leaky_relu, "leaky_relu"),
    (jax.nn.hard_swish, "hardswish"),
    (jax.nn.hard_silu, "hardswish"),
)

ALIGN_ELEMENTS = 8  # K and N multiples of 8: 16-byte row strides for TMA


def allowed_activations(gated: bool) -> str:
    """What an op's ``activation`` argument may be, for its error messages: None, a fused name
    (with ``gated``, the gated ones too) or a callable."""
    names = (*ACTIVATION_FUNCTIONS, *GATED_ACTIVATIONS) if gated else tuple(ACTIVATION_FUNCTIONS)
    return f"None, one of {', '.join(repr(a) for a in names if a != 'none')}, or a callable"


def check_activation_name(op: str, activation, gated: bool = False) -> None:
    """Refuse an ``activation`` string that names no fused activation (nor, where the op takes
    them -- ``gated`` --, a gated one); other values pass."""
    if isinstance(activation, str) and activation not in ACTIVATION_FUNCTIONS and not (gated and is_gated(activation)):
        raise ValueError(f"{op}: argument 'activation' must be {allowed_activations(gated)}; "
                         f"got the unknown activation {activation!r}")


def resolve_activation(activation) -> tuple[str, object]:
    """(fused activation name, unfused callable or None) for ``fused_linear``'s argument.

    A name or a recognised jax.nn function fuses into the kernel; any other callable runs after
    the kernel (the kernel then computes x @ kernel + bias only).
    """
    if activation is None:
        return "none", None
    if isinstance(activation, str):
        check_activation_name("fused_linear", activation)
        return activation, None
    if (isinstance(activation, functools.partial) and activation.func is jax.nn.gelu and not activation.args
            and set(activation.keywords) <= {"approximate"}):
        return ("gelu" if activation.keywords.get("approximate", True) else "gelu_exact"), None
    for fn, name in _KNOWN_FUNCTIONS:
        if activation is fn:
            return name, None
    if callable(activation):
        return "none", activation
    raise TypeError(f"fused_linear: 'activation' must be None, a name or a callable; got {activation!r}")


# --- kernel families ------------------------------------------------------------------------------
#
# Every GEMM operand reaches the kernel as a rank-3 (L, rows, features) array; ``modes`` present
# it in the kernel's (M|N, K, L) order without copying. Forward and dx use L = 1 (a static dim);
# dkernel uses L for the vmap batch. ``config``: the kernel's GemmConfig, chosen for the operands by
# :func:`cutelayers.tuning.resolve` (tuned table, else ``config_class``); the heuristic depends on
# the concrete row count, which the compile key leaves out, so a family carries its config.

_ROWS = (1, 2, 0)  # (1, M, F) -> (M, F, 1): rows M, features F contiguous
_WEIGHT_AS_N_K = (2, 1, 0)  # (1, K, N) -> (N, K, 1): kernel as the forward's B, N contiguous
_TRANSPOSED = (2, 1, 0)  # (L, M, F) -> (F, M, L): the rows become the contraction
# A kernel stored (N, K) -- Equinox's / PyTorch's Linear weight, ``kernel_layout="nk"`` -- is the
# same GEMM operand with the other mode contiguous: the forward's B K-major, dx's B N-major.
KERNEL_LAYOUTS = ("kn", "nk")


def as_kn(kernel, kernel_nk: bool):
    """A kernel stored (K, N), or (N, K) if ``kernel_nk``, as (K, N): what the jnp references take."""
    return kernel.T if kernel_nk else kernel


class GemmFamily(TunableFamily):
    """The GEMM families' shared implementation of the family interface
    (:mod:`cutelayers.runtime.family`). Each family gives its operands' kinds (which decide mode
    orders and symbolic dims), their sharding factors (how the GEMM runs on a mesh), the layer's
    (K, N), the GEMM's (M, N, K) and its epilogue."""

    @abc.abstractmethod
    def kinds(self) -> tuple[str, ...]:
        """Kind of every operand and result: rows / weight / vector / batched / batched_out."""

    @abc.abstractmethod
    def factors(self) -> tuple[tuple, tuple]:
        """Sharding factor per dim of every operand and of every result (einsum-like)."""

    @abc.abstractmethod
    def layer_dims(self, avals) -> tuple[int, int]:
        """The layer's (K, N) as these operands hold them."""

    # --- configs: every entry of the kernel's CONFIGS is valid for every shape (TMA clips tails)

    contracts_rows = False  # dkernel: the symbolic rows are the GEMM's contraction
    kernel_nk = False  # forward / dx: the kernel operand is (1, N, K) (``kernel_layout="nk"``)

    def kernel_kn(self, aval) -> tuple[int, int]:
        """(K, N) of the (1, K, N) -- or (1, N, K) -- kernel operand ``aval``."""
        return aval.shape[2:0:-1] if self.kernel_nk else aval.shape[1:]

    def kernel_factor(self) -> tuple:
        return (None, "n", "k") if self.kernel_nk else (None, "k", "n")

    @abc.abstractmethod
    def gemm_shape(self, avals) -> tuple[int, int, int]:
        """(M, N, K) of the GEMM on these operands: output (M, N), contraction K."""

    def default_config(self, avals):
        m, n, k = self.gemm_shape(avals)
        if self.stream_k:
            return stream_k_config(m)
        classed = CONFIGS[config_class(m, n, k)]
        split = decode_split_config(m, n, k) if self.takes_split_k else None
        # the decode split, else the shape class's; a gated layer's tiles may take neither: then
        # one with the class's tile rows, else the first its space has
        for config in (split, classed):
            if config is not None and self.takes(config, avals):
                return config
        space = self.config_space(avals)
        return next((c for c in space if c.tile_m == classed.tile_m), space[0])

    def config_space(self, avals) -> tuple:
        space = tuple(CONFIGS.values()) + EXTRA_CONFIGS + (SPLIT_K_CONFIGS if self.takes_split_k else ())
        # stream-K's segments end where its chunks do, not with a warpgroup's tile: cooperative only
        if self.stream_k:
            space = tuple(c for c in space if not c.pingpong)
        return tuple(c for c in space if self.takes(c, avals))

    gated = False  # a gated layer's forward or backward (LinearForward, LinearInputGrad)

    def gated_block(self, config) -> int:
        """Columns of each half (gate, value) one tile of a gated layer holds."""
        return config.tile_n

    def gated_width(self, avals) -> int:
        """A gated layer's H: the width of each half."""
        return self.gemm_shape(avals)[1]

    def takes(self, config, avals) -> bool:
        """Whether the kernel runs ``config`` on these operands: any, but a gated layer's tiles
        must hold whole ``GATED_BLOCK``-column blocks of each half, which H is a multiple of."""
        if not self.gated:
            return True
        block = self.gated_block(config)
        return block % GATED_BLOCK == 0 and self.gated_width(avals) % block == 0

    fused_planes = False  # the kernel's batch mode holds a fused layer's planes (ops.split_linear)

    @property
    def takes_split_k(self) -> bool:
        """Whether the kernel may cut a tile's contraction over a cluster (``GemmConfig.split_k``):
        not with stream-K, accumulation, operand sums or a fused layer's planes."""
        return not (self.stream_k or self.accumulate or self.operand_sums or self.fused_planes)

    def tuning_key(self, avals):
        """dtype, and the GEMM's static sizes with the bucket of a symbolic M (and whether it
        accumulates / runs stream-K / stores float32 / reads a source tile: another kernel, tuned
        on its own -- a source ring takes the shared memory of a mainloop stage or two)."""
        m, n, k = self.gemm_shape(avals)
        dims = (("m", m), ("n", n)) if self.contracts_rows else (("m", row_bucket(m)), ("k", k), ("n", n))
        dims += (("accumulate", True),) * self.accumulate + (("stream_k", True),) * self.stream_k
        dims += (("f32_out", True),) * self.f32_out + (("source", True),) * self.reads_source
        dims += (("gated", True),) * self.gated
        return jnp.dtype(avals[0].dtype).name, dims

    def config_from_fields(self, fields: dict):
        return GemmConfig(**fields)

    halves: str | None = None
    """A factor whose every dim holds a gated layer's gate and value halves (its dx and weight
    gradient over the 2 H columns: :class:`~cutelayers.runtime.family.Halves`), or None. The
    same kernel either way: not part of :meth:`identity`."""

    def identity(self):
        return dataclasses.replace(self, halves=None) if self.halves else self

    def sharding_rule(self, avals) -> ShardingRule:
        operands, results = self.factors()
        if self.halves:
            operands, results = (tuple(tuple(Halves(f) if f == self.halves else f for f in dims) for dims in group)
                                 for group in (operands, results))
        if self.fixup:  # each device's scratch is its own, whole
            operands, results = operands + ((None,),), results + ((None, None), (None,))
        rule = ShardingRule(operands, results)
        return dataclasses.replace(rule, per_shard=functools.partial(self.per_shard, rule))

    def per_shard(self, rule, ctx, *operands):
        """One device's part: the GEMM on its shards; results that lack a sharded factor of the
        operands (the contraction) are partial sums, psum'd -- except a second result over the
        factor it is whole over (:meth:`second_result_whole_over`)."""
        independent = self.second_result_whole_over()
        if independent is not None:
            first, second, *rest = rule.results
            rule = dataclasses.replace(rule, results=(first, second + (independent,), *rest))
        results = self.run_local(*operands)
        if self.fixup:  # the workspace and flags are scratch, not partial sums
            return sum_partials(rule, ctx, results[:-2]) + results[-2:]
        return sum_partials(rule, ctx, results)

    def second_result_whole_over(self) -> str | None:
        """A sharding factor the second result does not involve, over which each device computes
        it whole, not as a partial sum: a weight gradient's operand sums (of dz over the rows) over
        the other operand's features, the input gradient's hidden activation over the
        contraction; None if none."""
        return None

    def run_local(self, *operands):
        """This GEMM on one device's operands; the jnp reference where sharding left K or N per
        device no multiple of 8 (TMA alignment)."""
        use_kernels, why = kernels_apply(operands[0].dtype, *self.layer_dims(operands))
        if use_kernels and self.gated and (why := gated_width_fault(self.gated_width(operands))):  # a share of each half
            use_kernels = False
        if not use_kernels:
            _backend.fall_back(f"{self.name} on a shard", why)
            return tuple(self.reference(*operands))
        return run_kernel(self, *operands)

    def dynamic_dims_at(self, position, aval):
        kind = self.kinds()[position]
        if kind == "scratch":
            return (False,) * len(aval.shape)
        return {
            "rows": (False, True, False),  # (1, M, F): M symbolic
            "weight": (False,) * len(aval.shape),
            "vector": (False,),
            "batched": (True, True, False),  # (L, M, F)
            "batched_out": (True, False, False),  # (L, K, N)
            "batched_vector": (True, False),  # (L, N): per batch index, one value per column
        }[kind]

    accumulate = False  # result added into a float32 operand (LinearWeightGrad; LinearInputGrad's stream-K)
    stream_k = False  # stream-K schedule (the weight gradients, LinearInputGrad)
    operand_sums = None  # "a" / "b": that operand's sums over the contraction too (a bias gradient)
    f32_out = False  # a float32 result of 16-bit operands without accumulating (LinearWeightGrad)

    # Stream-K without an accumulator: the partial tiles meet in a float32 workspace, a scratch
    # result (``GemmConfig.stream_k_workspace``), each announced by an Int32 flag of a zeros
    # operand after the others (:func:`stream_k_flags`), which the kernel writes: the last result,
    # in its place (where the operand is not a temporary, XLA copies it first, so every launch
    # starts from zeros). The tile's owning segment adds the partials and stores the result once,
    # in its dtype (``HopperGemmKernel.fix_up``).

    @property
    def fixup(self) -> bool:
        """Whether stream-K's partial tiles meet in a workspace (not added into an accumulator)."""
        return self.stream_k and not self.accumulate

    def scratch_avals(self) -> tuple:
        """The scratch results of :attr:`fixup` (none without it): the workspace, the flags."""
        if not self.fixup:
            return ()
        return (jax.ShapeDtypeStruct(self.chosen_config().stream_k_workspace, jnp.float32),
                jax.ShapeDtypeStruct((PERSISTENT_SMS,), jnp.int32))

    def scratch_reference(self) -> tuple:
        """What the jnp reference gives for the scratch results: zeros."""
        return tuple(jnp.zeros(a.shape, a.dtype) for a in self.scratch_avals())

    def flags_alias(self, operands: int, results: int) -> dict[int, int]:
        """{the flags operand: the flags result} of a family of ``operands`` operands and
        ``results`` results, each list ending with them ({} without :attr:`fixup`)."""
        return {operands - 1: results - 1} if self.fixup else {}

    def modes_at(self, position):
        return None if self.kinds()[position] == "scratch" else self.gemm_modes(position)

    def gemm_modes(self, position) -> tuple[int, ...] | None:
        """The mode order of a GEMM operand or result (see :meth:`modes_at`; scratch as stored)."""
        return None

    @property
    def reads_source(self) -> bool:
        """Whether the epilogue reads an (M, N) source tile: a residual, or a pre-activation."""
        return False

    def launcher(self, avals, out_avals):
        from cutelayers.kernels.gemm import HopperGemmKernel

        return HopperGemmKernel(self.chosen_config(), self.epilogue(), self.accumulate, self.stream_k,
                                self.planes(), self.operand_sums)

    def epilogue(self):
        from cutelayers.kernels.gemm import Epilogue

        return Epilogue()

    def planes(self):
        """How the kernel's batch mode reaches the operands (:class:`cutelayers.kernels.gemm.Planes`):
        one L for all (default), or a fused layer's planes (:mod:`cutelayers.ops.split_linear`)."""
        from cutelayers.kernels.gemm import Planes

        return Planes()


class ForwardGemm(GemmFamily):
    """A family whose GEMM is the forward's: x (1, M, K) @ kernel (1, K, N) -- (1, N, K) if
    ``kernel_nk`` --, its first two operands; other operands and results are rows (1, M, F) or
    vectors."""

    def gemm_modes(self, position):
        weight = _ROWS if self.kernel_nk else _WEIGHT_AS_N_K
        return {"rows": _ROWS, "weight": weight, "vector": None}[self.kinds()[position]]

    def layer_dims(self, avals):
        return self.kernel_kn(avals[1])

    def gemm_shape(self, avals):
        return avals[0].shape[1], self.kernel_kn(avals[1])[1], avals[0].shape[2]  # x (1, M, K)


@dataclasses.dataclass(frozen=True)
class LinearForward(ForwardGemm):
    """Kernel family: y (1, M, N) [, z (1, M, N)] from x (1, M, K), kernel (1, K, N)
    [, bias (N,)] [, residual (1, M, N)]; all one dtype (bfloat16 / float16).

    ``gated``: the kernel's N columns are a gated layer's gate and value halves (N = 2H, H a
    multiple of ``GATED_BLOCK``), ``activation`` the gate's, and y (1, M, H) = act(gate) * value;
    z is (1, M, 2H). No residual; the columns are not sharded (each device would hold a gate
    without its value)."""

    activation: str
    has_bias: bool
    has_residual: bool
    store_preact: bool
    config: GemmConfig | None = None
    kernel_nk: bool = False
    gated: bool = False
    # y = exp(x @ kernel) and its row sums over every ROW_SUM_BLOCK columns, a float32
    # (1, M, ceil(N / ROW_SUM_BLOCK)) second result (no bias, activation, residual or stored
    # preact): the LM head's unnormalized softmax (:func:`exp_logits`)
    exp_row_sums: bool = False
    # with exp_row_sums: the columns that count, if fewer than N (``Epilogue.exp_columns``; 0: all)
    exp_columns: int = 0

    name = "linear_fwd"

    @property
    def arg_names(self):
        return ("x", "kernel") + ("bias",) * self.has_bias + ("residual",) * self.has_residual

    def kinds(self):
        return (("rows", "weight") + ("vector",) * self.has_bias + ("rows",) * self.has_residual
                + ("rows",) * (1 + self.store_preact + self.exp_row_sums))

    def factors(self):
        # K sharded: row-parallel (partial sums); N sharded: column-parallel. A gated layer's N
        # (2H) as halves (a device's share of gates and of values: its columns of the output),
        # its contraction whole: the activation pairs gates with values of whole sums.
        if self.gated:
            halves = Halves("n")
            weight = (None, halves, None) if self.kernel_nk else (None, None, halves)
            operands = ((None, "rows", None), weight) + ((halves,),) * self.has_bias
            return operands, ((None, "rows", "n"),) + ((None, "rows", halves),) * self.store_preact
        rows_n = (None, "rows", "n")
        operands = (((None, "rows", "k"), self.kernel_factor()) + (("n",),) * self.has_bias
                    + (rows_n,) * self.has_residual)
        # the row sums carry no "n": over split columns each device's are partial, psum'd
        # (:meth:`exp_row_sums_per_shard`)
        return operands, (rows_n,) * (1 + self.store_preact) + ((None, "rows", None),) * self.exp_row_sums

    def gated_block(self, config) -> int:
        return config.tile_n // 2  # the tile's columns are both halves' blocks

    def gated_width(self, avals) -> int:
        return self.gemm_shape(avals)[1] // 2

    def per_shard(self, rule, ctx, x, w, *rest):
        if self.exp_row_sums:
            return self.exp_row_sums_per_shard(ctx, x, w, *rest)
        fused = self.activation != "none" or self.has_bias or self.has_residual
        if not (fused and ctx.sharded("k")):
            return super().per_shard(rule, ctx, x, w, *rest)
        rest = list(rest)
        bias = rest.pop(0) if self.has_bias else None
        residual = rest.pop(0)[0] if self.has_residual else None
        y, z = apply_epilogue(self.row_parallel_product(ctx, x, w), bias, residual, self.activation, x.dtype)
        return (y[None],) + ((z[None],) if self.store_preact else ())

    def row_parallel_product(self, ctx, x, w):
        """x @ kernel (M, N) in float32 over a split contraction: every device holds a partial
        product, from the kernel without its epilogue, and the psum adds them; the epilogue then
        applies once, to the sum (XLA fuses it after the psum)."""
        (partial,) = LinearForward("none", False, False, False, self.config, self.kernel_nk).run_local(x, w)
        return ctx.psum(partial, {"k"})[0]

    def exp_row_sums_per_shard(self, ctx, x, w, *rest):
        """One device's exp GEMM. Over a split contraction the exponential waits for the psum
        (the reference epilogue after a plain GEMM), and so it does over split columns of which
        only the first ``exp_columns`` count (:func:`exp_reference_on_device`). Over split columns
        the row sums' blocks combine over the column devices (:func:`combine_column_blocks`)."""
        if exp_reference_on_device(ctx, self.exp_columns):
            product = exp_product_over_split_contraction(ctx, x, w, self.kernel_nk)
            e, sums = exp_row_sums_reference(product, x.dtype, local_columns(ctx, self.exp_columns, self.kernel_kn(w)[1]))
        else:
            e, sums = self.run_local(x, w, *rest)
        return e, combine_column_blocks(ctx, sums, self.kernel_kn(w)[1], "sum")

    @property
    def reads_source(self):
        return self.has_residual

    @property
    def takes_split_k(self) -> bool:
        return super().takes_split_k and not self.exp_row_sums  # row sums of whole tiles

    def tuning_key(self, avals):
        dtype, dims = super().tuning_key(avals)
        return dtype, dims + (("exp_row_sums", True),) * self.exp_row_sums

    def epilogue(self):
        from cutelayers.kernels.gemm import Epilogue

        return Epilogue(self.activation, self.has_bias, self.has_residual, self.store_preact, gated=self.gated,
                        exp_row_sums=self.exp_row_sums, exp_columns=self.exp_columns)

    def out_avals(self, avals):
        x, w = avals[0], avals[1]
        n = self.kernel_kn(w)[1]
        y = jax.ShapeDtypeStruct((1, x.shape[1], n // 2 if self.gated else n), x.dtype)
        sums = jax.ShapeDtypeStruct((1, x.shape[1], -(-n // ROW_SUM_BLOCK)), jnp.float32)
        return (y,) + (jax.ShapeDtypeStruct((1, x.shape[1], n), x.dtype),) * self.store_preact + (sums,) * self.exp_row_sums

    def reference(self, x, w, *rest):
        if self.exp_row_sums:
            return exp_row_sums_reference(_matmul(x[0], as_kn(w[0], self.kernel_nk)), x.dtype, self.exp_columns)
        rest = list(rest)
        bias = rest.pop(0) if self.has_bias else None
        residual = rest.pop(0)[0] if self.has_residual else None
        y, z = forward_reference(x[0], as_kn(w[0], self.kernel_nk), bias, residual,
                                 layer_activation(self.activation, self.gated))
        return (y[None],) + ((z[None],) if self.store_preact else ())


def exp_product_over_split_contraction(ctx, x, w, kernel_nk: bool):
    """x @ kernel (M, N) in float32 for an exp epilogue over a split contraction: each device's
    partial product by XLA in float32 and their psum. Not the plain kernel's (x's dtype): logits
    rounded to bf16 before the exponential are off by up to |z| 2^-9 nats, a factor of 1.3 at
    z = 150 (a row the passes over flagged rows shift)."""
    return ctx.psum(_matmul(x[0], as_kn(w[0], kernel_nk)), {"k"})


def exp_reference_on_device(ctx, exp_columns: int) -> bool:
    """Whether a device's exp GEMM (or its pass over flagged rows) runs as XLA's product and the
    reference epilogue: over a split contraction, whose exponential waits for the psum; and over
    split columns of which only the first ``exp_columns`` count (a padded vocabulary), which
    leaves each device its own count of them -- the kernel takes it at compile time."""
    return ctx.sharded("k") or bool(exp_columns and ctx.sharded("n"))


def column_offset(ctx, n_local: int):
    """This device's first column among all of a vocabulary split over the "n" devices (0 without
    a split)."""
    return jax.lax.axis_index(ctx.axes["n"]) * n_local if ctx.sharded("n") else 0


def local_columns(ctx, exp_columns: int, n_local: int):
    """How many of this device's ``n_local`` columns are among the first ``exp_columns`` of all
    (0: every column counts, as without them)."""
    if not (exp_columns and ctx.sharded("n")):
        return exp_columns
    return jnp.clip(exp_columns - column_offset(ctx, n_local), 0, n_local)


def combine_column_blocks(ctx, blocks, n_local: int, how: str):
    """A (1, M, blocks) float32 result of an exp GEMM over this device's ``n_local`` columns of a
    vocabulary split over the "n" devices, combined over them (as is without a split): a device's
    blocks need not be whole ROW_SUM_BLOCKs of the full N, so its total over them (``how``: "sum"
    or "max") goes into the first block, the other blocks hold the identity (0, -inf), and the
    psum / pmax over the column devices combines the first blocks. Only the blocks' total is
    then defined, which is what the LM head reads."""
    if not ctx.sharded("n"):
        return blocks
    axes = ctx.axes["n"]
    width = -(-n_local * math.prod(jax.lax.axis_size(axis) for axis in axes) // ROW_SUM_BLOCK)
    reduce, identity = {"sum": (jnp.sum, 0.0), "max": (jnp.max, -jnp.inf)}[how]
    first = jnp.pad(reduce(blocks, axis=-1, keepdims=True), ((0, 0), (0, 0), (0, width - 1)),
                    constant_values=identity)
    return ctx.psum(first, {"n"}) if how == "sum" else jax.lax.pmax(first, axes)


@dataclasses.dataclass(frozen=True)
class ExpLogitsFix(ForwardGemm):
    """Kernel family: the LM head's exp GEMM again over the rows out of the exponential's range
    (:func:`exp_logits_fix`). Operands x (1, M, K), kernel (1, K, N) -- (1, N, K) if
    ``kernel_nk`` --, e (1, M, N) a first pass's exp, rewritten in place; flags and labels
    (1, M, 1) int32, shift (1, M, 1) float32. Only the tiles holding a flagged row run
    (``Epilogue.exp_fix_rows``): their rows of e become exp(min(z - shift, EXP_CLAMP)), z = x @
    kernel, and the three (1, M, ceil(N / ROW_SUM_BLOCK)) float32 results -- the row sums of
    that, the blocks' max of z - shift, and their entries at the label's column (-inf in the
    other blocks) -- are defined on those rows only. ``exp_columns``: as
    :attr:`LinearForward.exp_columns`."""

    config: GemmConfig | None = None
    kernel_nk: bool = False
    exp_columns: int = 0

    name = "linear_exp_fix"
    arg_names = ("x", "kernel", "e", "flags", "labels", "shift")

    def kinds(self):
        return ("rows", "weight") + ("rows",) * 8

    def factors(self):
        rows_n, row = (None, "rows", "n"), (None, "rows", None)
        return ((None, "rows", "k"), self.kernel_factor(), rows_n, row, row, row), (rows_n, row, row, row)

    @property
    def takes_split_k(self) -> bool:
        return False  # row sums of whole tiles

    def tuning_key(self, avals):
        dtype, dims = super().tuning_key(avals)
        return dtype, dims + (("exp_fix_rows", True),)

    def epilogue(self):
        from cutelayers.kernels.gemm import Epilogue

        return Epilogue(exp_row_sums=True, exp_fix_rows=True, exp_columns=self.exp_columns)

    def operand_output_aliases(self):
        return {2: 0}

    def kept_outputs(self, n_outputs):
        return (1, 2, 3)

    def out_avals(self, avals):
        x, w, e = avals[:3]
        blocks = jax.ShapeDtypeStruct((1, x.shape[1], -(-self.kernel_kn(w)[1] // ROW_SUM_BLOCK)), jnp.float32)
        return (jax.ShapeDtypeStruct(e.shape, e.dtype), blocks, blocks, blocks)

    def reference(self, x, w, e, flags, labels, shift):
        return self.reference_epilogue(_matmul(x[0], as_kn(w[0], self.kernel_nk)), e, flags, labels, shift,
                                       self.exp_columns)

    def per_shard(self, rule, ctx, x, w, e, flags, labels, shift):
        """One device's pass. Over a split contraction the reference epilogue after the psum'd
        product; over split columns each device's labels count from its first column, and the
        blocks combine over the column devices (:func:`combine_column_blocks`)."""
        n_local = self.kernel_kn(w)[1]
        labels = labels - column_offset(ctx, n_local)
        if exp_reference_on_device(ctx, self.exp_columns):
            product = exp_product_over_split_contraction(ctx, x, w, self.kernel_nk)
            e, *blocks = self.reference_epilogue(product, e, flags, labels, shift,
                                                 local_columns(ctx, self.exp_columns, n_local))
        else:
            e, *blocks = self.run_local(x, w, e, flags, labels, shift)
        sums, top, at_label = (combine_column_blocks(ctx, b, n_local, how)
                               for b, how in zip(blocks, ("sum", "max", "max")))
        return e, sums, top, at_label

    @staticmethod
    def reference_epilogue(product, e, flags, labels, shift, columns: int = 0):
        """The results from the float32 product (M, N) and the operands after x and kernel, every
        flagged row's -- and only those: the kernel's tiles hold others too, whose e they
        recompute with their own shift. ``columns``: as ``Epilogue.exp_columns``."""
        z = first_columns(product - shift[0], columns)  # the others neither max nor match a label
        new, sums = exp_row_sums_reference(z, e.dtype)
        at_label = jnp.where(jnp.arange(z.shape[1])[None] == labels[0], z, -jnp.inf)
        e = jnp.where(flags[0] != 0, new[0], e[0])
        return e[None], sums, row_blocks(z, -jnp.inf).max(-1)[None], row_blocks(at_label, -jnp.inf).max(-1)[None]


@dataclasses.dataclass(frozen=True)
class LinearInputGrad(GemmFamily):
    """Kernel family: dx (1, M, K) = dz (1, M, N) @ kernelᵀ, kernel (1, K, N) read as stored.

    With ``grad_of`` an activation, also a pre-activation (1, M, K) operand and
    dx = (dz @ kernelᵀ) * act'(preact): the backward of an activation that came before this layer
    (an MLP's hidden activation), applied in the GEMM's epilogue -- which also writes a second
    result, that activation's output act(preact) (1, M, K) (a gated one's act(gate) * value), for
    the layer's weight gradient: the forward need not keep it.

    ``stream_k`` -- few rows against a long contraction, such as an LM head chunk's dh (4096 x 768
    contracting the vocabulary: 96 tiles on 132 SMs) -- splits the (tile, k tile) steps evenly over
    the GPU; the partial tiles are added into a float32 (1, M, K) operand of zeros, and dx is that
    buffer (float32).
    """

    grad_of: str = "none"
    config: GemmConfig | None = None
    kernel_nk: bool = False
    stream_k: bool = False
    gated: bool = False
    halves: str | None = None  # "n": the contraction is a gated layer's halves (GemmFamily.halves)

    name = "linear_dx"

    def __post_init__(self):
        if self.stream_k and self.through_activation:
            raise ValueError("LinearInputGrad: stream-K adds partial products; it takes no activation gradient")
        if self.gated and not self.through_activation:
            raise ValueError("LinearInputGrad: gated takes the gate's activation as grad_of")

    @property
    def through_activation(self) -> bool:
        """Whether dx goes through ``grad_of``'s derivative: a pre-activation operand, and the
        activation's output as a second result."""
        return self.grad_of != "none"

    @property
    def accumulate(self):
        return self.stream_k

    @property
    def arg_names(self):
        return ("dz", "kernel") + ("preact",) * self.through_activation + ("zeros",) * self.stream_k

    def kinds(self):
        second = self.through_activation
        return ("rows", "weight") + ("rows",) * second + ("rows",) * self.stream_k + ("rows",) * (1 + second)

    def operand_output_aliases(self):
        return {2: 0} if self.stream_k else None

    def kept_outputs(self, n_outputs):
        return () if self.stream_k else tuple(range(n_outputs))

    def gemm_modes(self, position):
        if self.kernel_nk and self.kinds()[position] == "weight":
            return _TRANSPOSED  # (1, N, K) -> (K, N, 1): the same B, its N (the layer's K) contiguous
        return _ROWS  # the kernel's (K, N) rows are the GEMM's N, its contiguous N the contraction

    def factors(self):
        # N is the contraction: with a column-parallel kernel each device's dx is a partial sum.
        # The activation derivative scales each partial alike, so it applies before the psum. A
        # gated layer's pre-activation and dx hold both halves of its hidden width K.
        k = Halves("k") if self.gated else "k"
        second = self.through_activation
        operands = ((None, "rows", "n"), self.kernel_factor()) + ((None, "rows", k),) * second
        return operands + ((None, "rows", k),) * self.stream_k, ((None, "rows", k),) + ((None, "rows", "k"),) * second

    def second_result_whole_over(self):
        return "n" if self.through_activation else None  # act(preact) does not involve the contraction

    def layer_dims(self, avals):
        return self.kernel_kn(avals[1])

    def gemm_shape(self, avals):
        return avals[0].shape[1], *self.kernel_kn(avals[1])  # dz (1, M, N)

    @property
    def reads_source(self):
        return self.through_activation

    def epilogue(self):
        from cutelayers.kernels.gemm import Epilogue

        return Epilogue(grad_of=self.grad_of, gated=self.gated)

    def out_avals(self, avals):
        dz, w = avals[:2]
        k = self.kernel_kn(w)[0]
        dx = jax.ShapeDtypeStruct((1, dz.shape[1], 2 * k if self.gated else k),  # a gated layer's: both halves
                                  jnp.float32 if self.stream_k else dz.dtype)
        return (dx,) + (jax.ShapeDtypeStruct((1, dz.shape[1], k), dz.dtype),) * self.through_activation

    def reference(self, dz, w, *rest):
        product = _matmul(dz[0], as_kn(w[0], self.kernel_nk).T)
        if self.stream_k:
            return ((rest[0][0] + product)[None],)
        if not rest:
            return (product.astype(dz.dtype)[None],)
        dx, hidden = hidden_grad_reference(rest[0][0], product, layer_activation(self.grad_of, self.gated), dz.dtype)
        return dx[None], hidden[None]


@dataclasses.dataclass(frozen=True)
class LinearWeightGrad(GemmFamily):
    """Kernel family: dkernel (L, K, N) = x (L, M, K)ᵀ @ dz (L, M, N) per batch index l.

    With ``accumulate``: a float32 (L, K, N) accumulator operand too, which the product is added
    into by the TMA unit (the result, float32, is that buffer): the LM head adds each token chunk's
    dkernel into its running sum, which its first chunk starts as a float32 result (``f32_out``:
    dkernel in float32, not x's dtype). ``stream_k`` -- for a (K, N) output with too few tiles to
    fill the GPU -- splits the (tile, k tile) steps evenly over the GPU: its partial tiles are added
    into the accumulator, or without one meet in a workspace (flags operand, scratch result:
    :attr:`GemmFamily.fixup`).

    ``operand_sums`` "a" / "b": also x's (L, K) or dz's (L, N) sums over the rows, float32 -- a
    bias gradient, summed by the kernel from the tiles it loads anyway (no pass over dz of its
    own). They are added into a float32 zeros operand, which comes before the accumulator.
    """

    config: GemmConfig | None = None
    accumulate: bool = False
    stream_k: bool = False
    operand_sums: str | None = None
    f32_out: bool = False
    halves: str | None = None  # "k" / "n": x's / dz's columns are a gated layer's halves (GemmFamily.halves)
    contracts_rows = True

    name = "linear_dkernel"

    def __post_init__(self):
        if self.operand_sums not in OPERAND_SUMS:
            raise ValueError(f"LinearWeightGrad: operand_sums must be one of {OPERAND_SUMS}; got {self.operand_sums!r}")

    @property
    def with_sums(self) -> bool:
        return self.operand_sums is not None

    def second_result_whole_over(self):
        return {None: None, "a": "n", "b": "k"}[self.operand_sums]

    @property
    def arg_names(self):
        return ("x", "dz") + ("sums",) * self.with_sums + ("accumulator",) * self.accumulate + ("flags",) * self.fixup

    def kinds(self):
        sums = ("batched_vector",) * self.with_sums
        return (("batched", "batched") + sums + ("batched_out",) * self.accumulate + ("scratch",) * self.fixup
                + ("batched_out",) + sums + ("scratch",) * (2 * self.fixup))

    def gemm_modes(self, position):
        if position < 2:
            return _TRANSPOSED
        return (1, 0) if self.kinds()[position] == "batched_vector" else _ROWS  # (L, N) -> (N, L)

    def factors(self):
        # The rows are the contraction: with row-sharded x and dz (data parallel) each device's
        # dkernel is a partial sum, psum'd -- the data-parallel gradient all-reduce (per_shard
        # keeps an accumulator out of it but once); so are the sums.
        out = ("batch", "k", "n")
        sums = (("batch", "k" if self.operand_sums == "a" else "n"),) * self.with_sums
        return (("batch", "rows", "k"), ("batch", "rows", "n")) + sums + (out,) * self.accumulate, (out,) + sums

    def per_shard(self, rule, ctx, x, dz, *rest):
        if self.accumulate and ctx.sharded("rows"):
            # the devices that share the rows psum their results: the running sum enters that sum
            # on the first of them, the others add their product into zeros
            first = jax.lax.axis_index(ctx.axes["rows"]) == 0
            rest = (*rest[:-1], jnp.where(first, rest[-1], 0.0))
        return super().per_shard(rule, ctx, x, dz, *rest)

    def operand_output_aliases(self):
        aliases = ({2: 1} if self.with_sums else {}) | ({2 + self.with_sums: 0} if self.accumulate else {})
        aliases |= self.flags_alias(3 + self.with_sums, 3 + self.with_sums)
        return aliases or None

    def kept_outputs(self, n_outputs):
        return () if self.accumulate else (0,) + (n_outputs - 2,) * self.fixup

    def layer_dims(self, avals):
        return avals[0].shape[2], avals[1].shape[2]

    def gemm_shape(self, avals):
        return avals[0].shape[2], avals[1].shape[2], avals[0].shape[1]  # x (L, M, K), dz (L, M, N)

    def out_avals(self, avals):
        x, dz = avals[:2]
        dtype = jnp.float32 if self.accumulate or self.f32_out else x.dtype
        dkernel = jax.ShapeDtypeStruct((x.shape[0], x.shape[2], dz.shape[2]), dtype)
        sums = (jax.ShapeDtypeStruct(avals[2].shape, jnp.float32),) if self.with_sums else ()
        return (dkernel,) + sums + self.scratch_avals()

    def reference(self, x, dz, *rest):
        if self.accumulate:
            dkernel = rest[-1] + _weight_grad_einsum(x, dz, dtype=jnp.float32)
        else:
            dkernel = _weight_grad_einsum(x, dz, dtype=jnp.float32 if self.f32_out else None)
        summed = x if self.operand_sums == "a" else dz
        sums = (rest[0] + jnp.sum(summed.astype(jnp.float32), axis=1),) if self.with_sums else ()
        return (dkernel,) + sums + self.scratch_reference()


# --- jnp reference: the kernels' decomposition -----------------------------------------------------

def _matmul(a, b, precision=None):
    return jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32)


def _weight_grad_einsum(x, dz, precision=None, dtype=None):
    """dkernel (L, K, N) = x (L, ..., K)ᵀ @ dz (L, ..., N) over every row, accumulated in fp32, in
    ``dtype`` (default x's)."""
    return jnp.einsum("l...k,l...n->lkn", x, dz, precision=precision, preferred_element_type=jnp.float32,
                      out_sharding=_summed_rows_sharding(x, dz)).astype(dtype or x.dtype)


def column_sum(d, dtype):
    """Sum of d (..., N) over every row, accumulated in float32, in ``dtype``: a bias gradient."""
    return jnp.sum(d.reshape(-1, d.shape[-1]).astype(jnp.float32), axis=0).astype(dtype)


def _summed_rows_sharding(x, dz):
    """The (L, K, N) sharding of the sum over rows when the operands' types shard the rows
    (``Explicit`` mesh axes, data parallel): einsum refuses to guess it. None otherwise."""
    def spec(a):
        return tuple(jax.typeof(a).sharding.spec) + (None,) * (a.ndim - len(jax.typeof(a).sharding.spec))

    (l, *rows_x, k), (_, *rows_dz, n) = spec(x), spec(dz)
    if all(axes is None for axes in (*rows_x, *rows_dz)):
        return None
    return NamedSharding(jax.typeof(x).sharding.mesh, PartitionSpec(l, k, n))


def forward_reference(x, kernel, bias, residual, activation: str, precision=None):
    """(y, z) for x (..., K), kernel (K, N), bias (N,) | None, residual (..., N) | None.

    z = x @ kernel + bias accumulated in fp32; y = act(z) + residual computed in fp32; both
    returned in x's dtype (z is what the backward saves).
    """
    return apply_epilogue(_matmul(x, kernel, precision), bias, residual, activation, x.dtype)


def apply_epilogue(product, bias, residual, activation: str, dtype):
    """(y, z) in ``dtype`` from the fp32 product x @ kernel: z = product + bias,
    y = act(z) + residual, computed in fp32."""
    z = product.astype(jnp.float32)
    if bias is not None:
        z = z + bias.astype(jnp.float32).reshape((1,) * (z.ndim - 1) + bias.shape)  # explicit broadcast
    y = activation_fn(activation)(z)
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(dtype), z.astype(dtype)


def exp_row_sums_reference(product, dtype, columns: int = 0):
    """(exp(min(z, EXP_CLAMP))[None] in ``dtype``, its float32 sums over every ROW_SUM_BLOCK
    columns [None]) for the product z (M, N) = x @ kernel: what an ``exp_row_sums`` GEMM returns;
    0 past the first ``columns`` if given (``Epilogue.exp_columns``)."""
    e = jnp.exp(jnp.minimum(first_columns(product.astype(jnp.float32), columns), EXP_CLAMP))
    return e.astype(dtype)[None], row_blocks(e, 0.0).sum(-1)[None]


def first_columns(z, columns):
    """The (M, N) float32 logits ``z`` with -inf past the first ``columns`` -- an int (0: all, ``z``
    as it is) or, on one device of a vocabulary split, a traced count (:func:`local_columns`):
    what a reference exp epilogue leaves out (exp gives 0 there)."""
    if isinstance(columns, int) and columns == 0:
        return z
    return jnp.where(jnp.arange(z.shape[1])[None] < columns, z, -jnp.inf)


def row_blocks(a, fill: float):
    """(M, N) as (M, ceil(N / ROW_SUM_BLOCK), ROW_SUM_BLOCK), the last block filled out with
    ``fill``: the blocks an exp GEMM reduces per row."""
    m, n = a.shape
    blocks = -(-n // ROW_SUM_BLOCK)
    return jnp.pad(a, ((0, 0), (0, blocks * ROW_SUM_BLOCK - n)), constant_values=fill).reshape(m, blocks, ROW_SUM_BLOCK)


def exp_logits(x, kernel, kernel_nk: bool = False, columns: int = 0):
    """(exp(min(x @ kernel, EXP_CLAMP)), its float32 row sums over every ROW_SUM_BLOCK columns)
    for x (..., K), kernel (K, N) -- (N, K) if ``kernel_nk``: a vocabulary-major table, read as
    stored --, both x's dtype: one GEMM on x's rows whose epilogue takes the exponential and sums
    it (``Epilogue.exp_row_sums``; the LM head's logits take no bias). The values are finite; a
    row with logits past EXP_CLAMP, or all far below 0 (sums underflowing), is wrong or imprecise:
    the caller checks the sums (:mod:`cutelayers.ops.lm_head`). Under a sharded N (a vocabulary
    split) only the sums' total over the blocks is defined (``LinearForward.exp_row_sums_per_shard``).
    ``columns`` (0: all N): the first columns alone count, the rest of the result is 0 -- a
    vocabulary padded for TMA (split over devices, each one's columns run as XLA's product and
    the reference epilogue: :func:`exp_reference_on_device`). vmappable: batch dims fold into the
    rows."""
    return _exp_logits_fn(kernel_nk, columns)(x, kernel)


@functools.cache
def _exp_logits_fn(kernel_nk: bool, columns: int):
    def exp_rows(x, kernel):
        operands = [kernel_rows(x), kernel[None]]
        family = LinearForward("none", False, False, False, kernel_nk=kernel_nk, exp_row_sums=True,
                               exp_columns=columns)
        results = call_gemm(family, operands, (True, False), x.shape[:-1])
        return tuple(from_rows(r, x.shape[:-1]) for r in results)

    return fold_batch(exp_rows, shared=(1,))


def exp_logits_fix(x, kernel, e, flags, labels, shift, kernel_nk: bool = False, columns: int = 0):
    """:func:`exp_logits` again on the rows ``flags`` marks -- those whose exponentials left
    bf16's range, at the LM head -- with a per-row ``shift``, writing their rows of ``e`` (the
    first pass's, consumed: rewritten in place) as exp(min(x @ kernel - shift, EXP_CLAMP)).
    One GEMM launch whose persistent CTAs run only the tiles that hold a flagged row: when none
    is, it costs a launch and a read of the flags, and the program has no data-dependent control
    flow (which would make the host wait for the device).

    x (..., K), kernel (K, N) -- (N, K) if ``kernel_nk`` --, e (..., N) x's dtype; flags, labels
    (...) integers (a label outside [0, N) matches no column); shift (...) float32. Returns (e,
    sums, block max, label entries): the last three (..., ceil(N / ROW_SUM_BLOCK)) float32, per
    flagged row and ROW_SUM_BLOCK columns the sum of the new e (before its rounding), the max of
    x @ kernel - shift, and its entry at the label's column (-inf in the other blocks); on other
    rows undefined. Under a sharded N only the blocks' total (sum, max) is defined
    (:func:`combine_column_blocks`). ``columns``: as :func:`exp_logits`'. vmappable: batch dims
    fold into the rows."""
    return _exp_logits_fix_fn(kernel_nk, columns)(x, kernel, e, flags, labels, shift)


@functools.cache
def _exp_logits_fix_fn(kernel_nk: bool, columns: int):
    def fix_rows(x, kernel, e, flags, labels, shift):
        lead = x.shape[:-1]

        def per_row(a, dtype):
            return kernel_rows(a.astype(dtype)[..., None])

        operands = [kernel_rows(x), kernel[None], kernel_rows(e), per_row(flags, jnp.int32),
                    per_row(labels, jnp.int32), per_row(shift, jnp.float32)]
        family = ExpLogitsFix(kernel_nk=kernel_nk, exp_columns=columns)
        results = call_gemm(family, operands, (True, False, True, True, True, True), lead)
        return tuple(from_rows(r, lead) for r in results)

    return fold_batch(fix_rows, shared=(1,))


ROWS_AT = 1
"""Where a GEMM kernel's row operands (1, rows, F) hold their rows."""


def kernel_rows(a):
    """A row-wise (..., F) operand of a GEMM kernel call: (1, rows, F) where its rows are one
    leading dim or none, else (1, ..., F), its rows given unflattened at :data:`ROWS_AT`
    (:func:`~cutelayers.runtime.sharding.kernel_call`'s ``rows_at``: each device flattens its own
    part of a sharded sequence)."""
    return a[None] if a.ndim > 2 else a.reshape(1, -1, a.shape[-1])


def rows_at(*row_wise: bool) -> tuple:
    """``kernel_call``'s ``rows_at`` for GEMM operands, those ``row_wise`` from :func:`kernel_rows`."""
    return tuple(ROWS_AT if r else None for r in row_wise)


def call_gemm(family, operands, row_wise, lead) -> tuple:
    """``family``, its config chosen for ``operands`` as the kernel reads them, called on them: the
    ``row_wise`` ones from :func:`kernel_rows`, x's ``lead`` the rows; the results' rows as given
    (:func:`from_rows` reads them either way)."""
    at = rows_at(*row_wise)
    return kernel_call(resolve(family, kernel_avals(operands, lead, at)), *operands, lead=lead, rows_at=at)


def from_rows(a, lead):
    """A kernel's (1, rows, F) result -- or (1, *lead, F), its rows given -- as (*lead, F)."""
    return a[0].reshape(*lead, a.shape[-1])


def preact_grad(z, dy, activation: str):
    """dz = dy * act'(z) in fp32, z and dy (..., N) in any float dtype (a gated activation's dy
    (..., N / 2))."""
    dy = dy.astype(jnp.float32)
    if activation == "none":
        return dy
    _, vjp = jax.vjp(activation_fn(activation), z.astype(jnp.float32))
    return vjp(dy)[0]


def hidden_grad_reference(z, product, activation: str, dtype):
    """(product * act'(z), act(z)) in ``dtype``, computed in fp32: what the input gradient's
    ``grad_of`` epilogue writes (a gated ``activation``: z (..., 2H), product and act(z) (..., H))."""
    hidden = activation_fn(activation)(z.astype(jnp.float32))
    return preact_grad(z, product, activation).astype(dtype), hidden.astype(dtype)


# --- kernel calls on (rows, features) arrays -------------------------------------------------------

def _forward_rows(x, kernel, bias, residual, activation, store_preact, use_kernels, precision, kernel_nk):
    """y [, z] for x (..., K): one kernel launch on x's rows -- for decode rows over a long
    contraction, stream-K and an XLA epilogue (module docstring) -- or the jnp reference. A gated
    ``activation`` (no residual) gives y (..., N / 2)."""
    lead, n = x.shape[:-1], kernel.shape[0 if kernel_nk else 1]
    act, gated = kernel_activation(activation)
    if not use_kernels:
        y, z = forward_reference(x, as_kn(kernel, kernel_nk), bias, residual, activation, precision)
        return (y, z) if store_preact else (y,)
    rows = kernel_rows(x)
    m = math.prod(lead)
    widths = (n // 2 if gated else n, n)[:1 + store_preact]
    if m == 0:
        return tuple(jnp.zeros((*lead, w), x.dtype) for w in widths)
    if decode_stream_k_pays(m, n, x.shape[-1]):
        # Decode rows over a long contraction: x @ kernel by stream-K, which is the input
        # gradient's GEMM reading the kernel in the other layout (dz @ kernelᵀ with kernelᵀ as
        # stored), into float32 zeros; the epilogue is one XLA pass over the (rows, N) sum.
        operands = (rows, kernel[None], _row_zeros(rows, n))
        (product,) = call_gemm(LinearInputGrad(kernel_nk=not kernel_nk, stream_k=True), operands,
                               (True, False, True), lead)
        product = from_rows(product, lead)
        y, z = apply_epilogue(product, bias, None if residual is None else residual.reshape(product.shape),
                              activation, x.dtype)
        return (y, z)[:len(widths)]
    operands = [rows, kernel[None]]
    if bias is not None:
        operands.append(bias)
    if residual is not None:
        operands.append(kernel_rows(residual))
    family = LinearForward(act, bias is not None, residual is not None, store_preact, kernel_nk=kernel_nk,
                           gated=gated)
    outs = call_gemm(family, operands, (True, False) + (False,) * (bias is not None) + (True,) * (residual is not None),
                     lead)
    return tuple(from_rows(o, lead) for o in outs)


def _input_grad_rows(dz, kernel, preact, grad_of, use_kernels, precision, kernel_nk, halves=False):
    """dx (..., K) = dz (..., N) @ kernelᵀ, kernel (K, N), or (N, K) if ``kernel_nk``. With
    ``preact`` (..., K) (``grad_of`` an activation) the pair (dx * act'(preact), act(preact)):
    the activation's gradient and its output, both from one GEMM epilogue. A gated ``grad_of``:
    preact and dx (..., 2K) -- the gradient of both halves from the product (..., K) -- and the
    output act(gate) * value (..., K). ``halves``: N is a gated layer's gate and value halves."""
    lead, k = dz.shape[:-1], kernel.shape[1 if kernel_nk else 0]
    act, gated = kernel_activation(grad_of)
    widths = (2 * k if gated else k, k)[:1 + (preact is not None)]
    if not use_kernels:
        product = _matmul(dz, as_kn(kernel, kernel_nk).T, precision)
        if preact is None:
            return product.astype(dz.dtype)
        return hidden_grad_reference(preact, product, grad_of, dz.dtype)
    rows = kernel_rows(dz)
    m, n = math.prod(lead), dz.shape[-1]
    if m == 0:
        outs = tuple(jnp.zeros((*lead, w), dz.dtype) for w in widths)
    else:
        # Too few output tiles to fill the GPU over a long contraction: stream-K, into zeros.
        stream_k = preact is None and stream_k_pays(m, k, n)
        operands = ((rows, kernel[None]) + (() if preact is None else (kernel_rows(preact),))
                    + ((_row_zeros(rows, k),) if stream_k else ()))
        family = LinearInputGrad(act, kernel_nk=kernel_nk, stream_k=stream_k, gated=gated,
                                 halves="n" if halves else None)
        outs = tuple(from_rows(o.astype(dz.dtype), lead)
                     for o in call_gemm(family, operands, (True, False, True, True)[:len(operands)], lead))
    return outs if preact is not None else outs[0]


def stream_k_flags(anchor):
    """The zeros flags operand of a stream-K kernel without an accumulator (see
    :attr:`GemmFamily.fixup`): an Int32 per CTA of any persistent grid, filled once ``anchor``
    exists."""
    return zeros_after(anchor, (PERSISTENT_SMS,), jnp.int32)


def weight_grad_schedule(anchor, m: int, n: int, rows: int, batch: int, out_shape) -> tuple[bool, bool, tuple]:
    """How a weight gradient of an (m, n) output per batch, contracting ``rows``, runs when it adds
    into no running sum: ``(stream_k, into_zeros, operands)``, the operands following the kernel's
    others. Whole tiles where they fill the GPU (no operands); else stream-K, its partial tiles
    meeting in a workspace (the flags operand, :func:`stream_k_flags`), or -- where the tiles are
    so few that each is cut over many clusters -- added into float32 zeros of ``out_shape`` (the
    result then is that float32 sum). Made after ``anchor``."""
    schedule = weight_grad_stream_k(m, n, rows, batch)
    if schedule == "zeros":
        return True, True, (zeros_after(anchor, out_shape),)
    return schedule is not None, False, (stream_k_flags(anchor),) if schedule else ()


def _row_zeros(rows, k):
    """float32 zeros (1, ..., k) for rows (1, ..., N) (:func:`kernel_rows`), sharded like them over
    ``Explicit`` mesh axes."""
    explicit = explicit_sharding(rows, lambda spec: PartitionSpec(*spec[:-1], None))
    return zeros_after(rows, (*rows.shape[:-1], k), out_sharding=explicit)


def _weight_grad_batched(x, dz, accumulator, use_kernels, precision, sums=None, f32_out=False,
                         result_dtype=None, halves=None):
    """dkernel (L, K, N) from x (L, ..., K), dz (L, ..., N): one launch, L the kernel's batch, in
    ``result_dtype`` (default: x's dtype, float32 with ``f32_out``).
    ``f32_out``: the kernel stores float32 (a running sum's start, read next by a kernel). A float32
    ``result_dtype`` alone (a float32 parameter's gradient, read next by XLA's optimizer) takes the
    float32 sum where stream-K makes one anyway, and otherwise the kernel's 16-bit result,
    converted: XLA fuses that convert into the gradient's readers, which then read 2 bytes a
    weight, where a float32 store would cost 2 more to write and 2 more to each reader.
    With a float32 (L, K, N) ``accumulator`` (else None): ``accumulator + dkernel`` in float32,
    the kernel adding into it as it stores (no pass of its own). With ``sums`` "a" / "b": the pair
    (dkernel, the float32 sums of x (L, K) / dz (L, N) over the rows), summed by the same kernel.
    ``halves`` "k" / "n": x's / dz's columns are a gated layer's halves (:attr:`GemmFamily.halves`)."""
    lead = x.shape[1:-1]
    if len(lead) < 2:  # else their rows stay unflattened (rows_at)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        dz = dz.reshape(dz.shape[0], -1, dz.shape[-1])
    summed = x if sums == "a" else dz
    out_dtype = result_dtype or (jnp.float32 if f32_out else x.dtype)
    batch, k, rows, n = x.shape[0], x.shape[-1], math.prod(lead), dz.shape[-1]
    if not use_kernels or rows == 0:
        if accumulator is None:
            dw = _weight_grad_einsum(x, dz, precision, dtype=out_dtype)
        else:
            dw = accumulator + _weight_grad_einsum(x, dz, precision, dtype=jnp.float32)
        row_dims = tuple(range(1, x.ndim - 1))
        return dw if sums is None else (dw, jnp.sum(summed.astype(jnp.float32), axis=row_dims))
    sums_in = () if sums is None else (zeros_after(summed, (batch, summed.shape[-1])),)
    running = accumulator is not None
    if running:  # stream-K's partial tiles, if any, are added into the running sum too
        stream_k, accumulate, tail = stream_k_pays(k, n, rows, batch), True, (accumulator,)
    else:
        stream_k, accumulate, tail = weight_grad_schedule(dz, k, n, rows, batch, (batch, k, n))
    operands = (x, dz, *sums_in, *tail)
    family = LinearWeightGrad(accumulate=accumulate, stream_k=stream_k, operand_sums=sums,
                              f32_out=f32_out and not accumulate, halves=halves)
    out = call_gemm(family, operands, (True, True), lead)
    dw = out[0] if running else out[0].astype(out_dtype)
    return dw if sums is None else (dw, out[1])


@functools.cache
def input_grad_fn(use_kernels: bool, precision=None, grad_of: str = "none", kernel_nk: bool = False,
                  halves: bool = False):
    """``dx = input_grad(dz, kernel)``: dz (..., N) @ kernel (K, N)ᵀ -> (..., K) in dz's dtype
    (kernel (N, K) if ``kernel_nk``), vmappable (batch dims of dz fold into rows). Shared with
    :mod:`cutelayers.ops.lm_head`.

    With ``grad_of`` an activation: ``input_grad(dz, kernel, preact)`` multiplies the product by
    act'(preact) in the GEMM's epilogue and returns the pair (that, act(preact)) -- the
    activation's output, written by the same epilogue (:mod:`cutelayers.ops.mlp`'s hidden
    layer). ``halves``: N holds a gated layer's gate and value halves (its dx)."""

    def input_grad(dz, kernel, *preact):
        return _input_grad_rows(dz, kernel, *preact or (None,), grad_of, use_kernels, precision, kernel_nk, halves)

    return fold_batch(input_grad, shared=(1,))


@functools.cache
def weight_grad_fn(use_kernels: bool, precision=None, sums: str | None = None, f32_out: bool = False,
                   result_dtype=None, halves: str | None = None):
    """``weight_grad(x, dz [, accumulator])``: dkernel (L, K, N) of batch-leading (L, ..., K) x and
    (L, ..., N) dz in ``result_dtype`` (default: x's dtype, float32 with ``f32_out``: the kernel
    stores float32; see :func:`_weight_grad_batched`), or ``accumulator + dkernel`` for a
    float32 (L, K, N) accumulator; vmappable: a vmap adds its batch to L (the kernel's batch
    mode), so per-example dkernel is still one launch. Shared with :mod:`cutelayers.ops.lm_head`.

    ``sums`` "a" / "b": the pair (dkernel, float32 sums of x (L, K) / dz (L, N) over the rows) --
    a bias gradient from the same kernel (see :class:`LinearWeightGrad`). ``halves``: see
    :func:`_weight_grad_batched`."""

    def weight_grad(x, dz, *accumulator):
        return _weight_grad_batched(x, dz, *accumulator or (None,), use_kernels, precision, sums, f32_out,
                                    result_dtype, halves)

    def batched(*operands):
        # Each example's dkernel sums over its own rows: the batch joins L, not the rows.
        out = vmappable(*(a.reshape(-1, *a.shape[2:]) for a in operands))
        return jax.tree.map(lambda o: o.reshape(operands[0].shape[0], -1, *o.shape[1:]), out)

    vmappable = fold_batch(weight_grad, batched=batched)
    return vmappable


@functools.cache
def forward_fn(activation: str, store_preact: bool, use_kernels: bool, precision=None, kernel_nk: bool = False):
    """``(y,)`` or ``(y, z) = forward(x, kernel, bias, residual)``: one fused GEMM on x's rows
    (bias / residual may be None; kernel (K, N), or (N, K) if ``kernel_nk``), vmappable (batch
    dims of x and residual fold into rows)."""

    def fn(x, kernel, bias, residual):
        return _forward_rows(x, kernel, bias, residual, activation, store_preact, use_kernels, precision, kernel_nk)

    return fold_batch(fn, shared=(1, 2))


@functools.cache
def _linear_fn(activation: str, has_residual: bool, use_kernels: bool, precision, kernel_nk: bool,
               f32_params: bool):
    """The differentiable op for one static configuration; args (x, kernel, bias, residual), the
    parameters in x's dtype or, with ``f32_params``, float32 (:func:`compute_params`)."""
    plain = forward_fn(activation, False, use_kernels, precision, kernel_nk)
    saving = forward_fn(activation, True, use_kernels, precision, kernel_nk)
    input_grad = input_grad_fn(use_kernels, precision, kernel_nk=kernel_nk)
    needs_preact = activation != "none"

    @jax.custom_vjp
    def linear(x, kernel, bias, residual):
        return plain(x, *compute_params(x, kernel, bias), residual)[0]

    def fwd(x, kernel, bias, residual):
        kernel, bias = compute_params(x, kernel, bias)  # saved as cast: dx reads it
        if needs_preact:
            y, z = saving(x, kernel, bias, residual)
        else:
            (y,), z = plain(x, kernel, bias, residual), None
        return y, (x, kernel, z, bias)

    def bwd(res, dy):
        x, kernel, z, bias = res
        dz = preact_grad(z, dy, activation).astype(x.dtype)
        dx = input_grad(dz, kernel)
        dkernel, dbias = weight_and_bias_grads(x, dz, kernel_nk, bias is not None, use_kernels, precision,
                                               f32_params)
        return dx, *typed_like((kernel, bias), (dkernel, dbias)), dy if has_residual else None

    linear.defvjp(fwd, bwd)
    return fold_batch(linear, shared=(1, 2), per_example=linear)


def weight_and_bias_grads(x, dz, kernel_nk: bool, has_bias: bool, use_kernels: bool, precision,
                          f32_params: bool, halves: bool = False):
    """(dkernel, dbias) of x (..., K) and dz (..., N): dkernel as the kernel is stored, xᵀ @ dz
    (K, N), or dzᵀ @ x (N, K) for ``kernel_nk`` -- the same GEMM with its operands swapped, so no
    transpose; dbias (None without a bias) the column sums of dz, from the same GEMM (dz is its
    B, or its A when swapped). Both in x's dtype, or float32 for ``f32_params`` (dbias and a
    stream-K float32 sum as they are; see :func:`_weight_grad_batched`). ``halves``: dz's columns
    are a gated layer's gate and value halves."""
    a, b = (dz, x) if kernel_nk else (x, dz)
    dtype = jnp.float32 if f32_params else x.dtype
    split = ("k" if kernel_nk else "n") if halves else None  # dz's factor in the GEMM
    if not has_bias:
        return weight_grad_fn(use_kernels, precision, result_dtype=dtype, halves=split)(a[None], b[None])[0], None
    dkernel, sums = weight_grad_fn(use_kernels, precision, "a" if kernel_nk else "b",
                                   result_dtype=dtype, halves=split)(a[None], b[None])
    return dkernel[0], sums[0].astype(dtype)


# --- the op ------------------------------------------------------------------------------------------

def check_same_dtype(op, name, a, x_name, x):
    if a.dtype != x.dtype:
        raise TypeError(
            f"{op}: argument {name!r} has dtype {jnp.dtype(a.dtype).name} but {x_name!r} has "
            f"{jnp.dtype(x.dtype).name}; they must match (cast before calling)"
        )


def check_param_dtypes(op: str, x_name: str, x, **params) -> bool:
    """Check that the parameters (name -> array | None) share one dtype: x's, or float32 where x
    is bfloat16 / float16 (mixed precision: :func:`compute_params`). Returns whether they are
    float32 parameters of a 16-bit x."""
    given = {name: jnp.dtype(p.dtype) for name, p in params.items() if p is not None}
    dtypes = set(given.values())
    if len(dtypes) > 1:
        listed = ", ".join(f"{name!r} {dtype.name}" for name, dtype in given.items())
        raise TypeError(f"{op}: the parameters must share one dtype ({x_name}'s, or float32 for a bfloat16 / "
                        f"float16 {x_name}); got {listed}")
    if not dtypes or dtypes == {jnp.dtype(x.dtype)}:
        return False
    (dtype,) = dtypes
    if dtype == jnp.float32 and x.dtype in MIXED_PRECISION_DTYPES:
        return True
    name = next(iter(given))
    raise TypeError(
        f"{op}: argument {name!r} has dtype {dtype.name} but {x_name!r} has {jnp.dtype(x.dtype).name}; "
        f"the parameters must be in {x_name}'s dtype, or float32 for a bfloat16 / float16 {x_name} "
        "(cast before calling)")


def compute_params(x, *params):
    """The parameters in x's dtype, as the GEMMs take them (None stays None): float32 parameters of
    a 16-bit x are cast here, inside the ops' custom_vjp, so their gradients come back float32 from
    the weight-gradient GEMM's accumulators rather than through a 16-bit result and a cast."""
    return tuple(None if p is None else p.astype(x.dtype) for p in params)


def check_linear_operands(op: str, x_name: str, x, kernel, bias, *, kernel_transposed: bool = False,
                          names: tuple[str, str] = ("kernel", "bias")):
    """Validate x (..., K), kernel (K, N) -- (N, K) if ``kernel_transposed`` --, bias (N,) | None,
    the parameters in x's dtype or float32; returns them as arrays and whether the parameters are
    float32 ones of a 16-bit x (:func:`check_param_dtypes`). ``names``: the op's names for the
    kernel and the bias, in its errors. Shared by the linear ops, :func:`cutelayers.ops.mlp`'s
    first layer and :func:`cutelayers.ops.linear_cross_entropy`."""
    kernel_name, bias_name = names
    x = check_float_array(op, x_name, x)
    kernel = check_float_array(op, kernel_name, kernel)
    layout = "(N, K)" if kernel_transposed else "(K, N)"
    if kernel.ndim != 2:
        raise ValueError(f"{op}: argument {kernel_name!r} must have rank 2 {layout}; got shape {tuple(kernel.shape)}")
    n, k = kernel.shape if kernel_transposed else kernel.shape[::-1]
    if x.shape[-1] != k:
        raise ValueError(f"{op}: argument {x_name!r} has {x.shape[-1]} features (shape {tuple(x.shape)}) "
                         f"but {kernel_name!r} expects K={k} (shape {tuple(kernel.shape)})")
    if bias is not None:
        bias = check_float_array(op, bias_name, bias)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"{op}: argument {bias_name!r} must have shape ({n},); got {tuple(bias.shape)}")
    return x, kernel, bias, check_param_dtypes(op, x_name, x, **{kernel_name: kernel, bias_name: bias})


def check_residual(op: str, residual, x, n: int):
    """Validate a residual (..., N) matching x's leading shape and dtype (None passes)."""
    if residual is None:
        return None
    residual = check_float_array(op, "residual", residual)
    if tuple(residual.shape) != (*x.shape[:-1], n):
        raise ValueError(f"{op}: argument 'residual' must have shape {(*x.shape[:-1], n)}; "
                         f"got {tuple(residual.shape)}")
    check_same_dtype(op, "residual", residual, "x", x)
    return residual


def hashable_precision(precision):
    """``precision`` as a hashable static key (a list pair becomes a tuple); JAX validates it."""
    return tuple(precision) if isinstance(precision, list) else precision


def kernels_apply(x_dtype, k: int, n: int) -> tuple[bool, str]:
    """Whether the CuTe kernels handle these dtypes / sizes, and if not, why."""
    if jnp.dtype(x_dtype) not in MIXED_PRECISION_DTYPES:
        return False, f"dtype {jnp.dtype(x_dtype).name} runs as XLA GEMMs; kernels take bfloat16/float16"
    if k % ALIGN_ELEMENTS or n % ALIGN_ELEMENTS:
        return False, f"K={k}, N={n}: kernels need K and N multiples of {ALIGN_ELEMENTS}"
    return True, ""


# Fewer rows than this make a GEMM with float32 parameters weight-bound: XLA fuses their cast into
# its own GEMM (4 bytes a weight), where the kernels read the 16-bit copy a cast pass wrote (8).
# H100, K = 4096 (docs/benchmarks.md, thirtieth session): ours 0.50-0.75x XLA's forward at 16-512
# rows, 1.00x at 1024.
MIXED_PRECISION_KERNEL_ROWS = 1024


def choose_kernels(op: str, usable: bool, why: str, x, f32_params: bool) -> bool:
    """The GEMM ops' kernel-or-reference decision: ``usable, why`` from :func:`kernels_apply`, then
    float32 parameters of fewer than ``MIXED_PRECISION_KERNEL_ROWS`` rows of x (..., K) go to XLA
    under ``auto``; both through :func:`cutelayers.backend.fall_back`. Returns whether the
    kernels run."""
    if not usable:
        return not _backend.fall_back(op, why)
    rows = concrete_dim(math.prod(x.shape[:-1]))  # None (not known to be few) where symbolic
    if f32_params and rows is not None and rows < MIXED_PRECISION_KERNEL_ROWS:
        return not _backend.fall_back(
            op, f"float32 parameters at fewer than {MIXED_PRECISION_KERNEL_ROWS} rows: XLA fuses their cast into "
            "its GEMM, where the kernels would cast them in a pass of their own", kernels_can_run=True)
    return True


def gated_width_fault(h: int) -> str:
    """Why the gated kernel cannot take halves of H columns each ("" if it can): its tiles hold
    whole ``GATED_BLOCK``-column blocks of each half."""
    return f"the hidden width {h} is not a multiple of {GATED_BLOCK}" if h % GATED_BLOCK else ""


def gated_kernels_apply(x_dtype, k: int, h: int) -> tuple[bool, str]:
    """:func:`kernels_apply` for a gated layer K -> (gate, value) of H each
    (:func:`gated_width_fault`)."""
    usable, why = kernels_apply(x_dtype, k, h)
    if usable and (fault := gated_width_fault(h)):
        return False, fault
    return usable, why


def check_kernel_layout(op: str, kernel_layout) -> bool:
    """Whether ``kernel_layout`` (one of KERNEL_LAYOUTS) stores kernels (N, K)."""
    if kernel_layout not in KERNEL_LAYOUTS:
        raise ValueError(f"{op}: argument 'kernel_layout' must be one of {', '.join(map(repr, KERNEL_LAYOUTS))}; "
                         f"got {kernel_layout!r}")
    return kernel_layout == "nk"


def fused_linear(x, kernel, bias=None, *, activation=None, residual=None, precision=None,
                 kernel_layout: str = "kn") -> jax.Array:
    """``act(x @ kernel + bias) + residual`` in one fused GEMM, differentiable and vmappable.

    Args:
      x: (..., K), any leading shape (flattened to rows), dtype bfloat16, float16 or float32.
      kernel: (K, N) as in ``flax.linen.Dense``, x's dtype -- or float32 for a bfloat16 / float16
        x (mixed precision, module docstring: cast for the GEMMs, gradient in float32).
      bias: (N,) in the kernel's dtype, or None.
      activation: None; one of 'relu', 'gelu' (tanh approximation, jax.nn.gelu's default),
        'gelu_exact', 'silu', 'sigmoid', 'tanh', 'leaky_relu' (slope 0.01), 'hardswish'; or the
        matching function (jax.nn.relu, jax.nn.gelu, jax.nn.silu / swish, jax.nn.sigmoid,
        jnp.tanh, jax.nn.leaky_relu, jax.nn.hard_swish). Any other callable is applied to
        ``x @ kernel + bias`` after the kernel, unfused, before the residual is added.
      residual: (..., N) matching x's leading shape, x's dtype, or None.
      precision: as ``jax.lax.dot``'s, for the XLA GEMMs of the jnp path (float32, unaligned
        sizes), forward and backward; the kernels are exact in their products (see above).
      kernel_layout: "kn" for a (K, N) kernel, or "nk" for an (N, K) one (``equinox.nn.Linear``'s
        weight): the GEMMs read it as stored and its gradient comes back (N, K), no transpose.

    Returns:
      (..., N) in x's dtype; accumulation and the epilogue run in float32.

    bfloat16 / float16 with K and N multiples of 8 run the CuTe kernels on Hopper; float32 and
    other sizes run the same decomposition as XLA GEMMs (logged once).
    """
    op = "fused_linear"
    kernel_nk = check_kernel_layout(op, kernel_layout)
    x, kernel, bias, f32_params = check_linear_operands(op, "x", x, kernel, bias, kernel_transposed=kernel_nk)
    k, n = kernel.shape[::-1] if kernel_nk else kernel.shape
    residual = check_residual(op, residual, x, n)
    fused, unfused = resolve_activation(activation)
    precision = hashable_precision(precision)

    use_kernels = choose_kernels(op, *kernels_apply(x.dtype, k, n), x, f32_params)
    kernel, bias = vary_like(x, kernel, bias)  # shared by every shard inside shard_map
    if unfused is None:
        return _linear_fn(fused, residual is not None, use_kernels, precision, kernel_nk, f32_params)(
            x, kernel, bias, residual)
    z = _linear_fn("none", False, use_kernels, precision, kernel_nk, f32_params)(x, kernel, bias, None)
    y = unfused(z)
    return y if residual is None else (y + residual).astype(x.dtype)
