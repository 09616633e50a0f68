"""Multi-device use on four fake CPU devices (see conftest): the op cases and helpers that
``tests/test_multigpu.py`` runs on every platform (there: every op under ``jax.shard_map`` and
plain ``jax.jit`` against one device, on CPU and on two GPUs), and here what needs the CPU: the
programs lowered for CUDA, partitioned on this host; the LM head's chunking over sharded tokens;
the vocabulary-parallel cross-entropy; and the errors for shardings a kernel cannot honour.

What is checked, and how (no GPU is needed for any test here):

* **Values and gradients.** On CPU every kernel call lowers to its jnp reference, run per device
  by the same sharding rules (custom_partitioning, or shard_map for ``Explicit`` mesh axes) that
  run the CuTe kernels on GPUs. Results and gradients must equal one device's within the
  tolerances of ``tests/numerics.py``.
* **Collectives, CUDA program.** The program lowered for CUDA (CuTe kernels compiled for sm_90a)
  is handed to the CPU compiler, whose partitioner runs the rules and emits the per-device
  program -- CuTe kernel calls included -- before compilation stops at the first kernel call (no
  CPU handler). The optimized HLO it dumps must hold kernel calls on per-device row counts and
  none of the collectives above. What this cannot check: that the CUDA compiler accepts the
  program and the kernels run (``tests/test_multigpu.py``'s ``gpu`` tests do, on a 2-GPU machine).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_close, assert_trees_match, random

import cutelayers as cl

ROWS = P("data")  # batch axis sharded over the mesh's data axis
REPLICATED = P()
BATCH, SEQ = 8, 6  # 48 rows: 12 per device on four devices
FORBIDDEN = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")

AXIS_TYPES = ["Auto", "Explicit"]


def make_mesh(shape, names, axis_type="Auto"):
    devices = jax.devices("cpu")
    if len(devices) < math.prod(shape):
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    kind = getattr(jax.sharding.AxisType, axis_type)
    return jax.make_mesh(shape, names, devices=devices[:math.prod(shape)], axis_types=(kind,) * len(shape))


@dataclasses.dataclass(frozen=True)
class Case:
    """An op, its arguments and which of them are row-wise (sharded over the data axis)."""

    name: str
    fn: Callable
    make_args: Callable  # rng, dtype -> args
    row_wise: tuple[bool, ...]
    wrt: tuple[int, ...]  # differentiable arguments
    dtype: object = jnp.float32
    kernels: bool = True  # whether the op calls CuTe kernels (masked_mean_pool is jnp)
    kernel_rows: int = BATCH * SEQ  # rows each kernel call takes, unsharded (a chunk's, if chunked)

    def specs(self, rows=ROWS):
        """Each argument's spec: ``rows`` for the row-wise ones, replicated for the rest."""
        return tuple(rows if r else REPLICATED for r in self.row_wise)


def _x(rng, dtype, n=64):
    return random(rng, (BATCH, SEQ, n), dtype)


def _labels(rng, n):
    labels = rng.integers(0, n, (BATCH, SEQ))
    labels[0, :2] = -1  # ignored rows
    return jnp.asarray(labels, jnp.int32)


def _lm_head_case(name, chunk_size=None):
    def loss(h, w, b, labels):
        return cl.ops.linear_cross_entropy(h, w, labels, bias=b, ignore_index=-1, reduction="none",
                                           chunk_size=chunk_size)

    return Case(name, loss,
                lambda r, d: (_x(r, d, 32), random(r, (32, 64), d) / 6, random(r, (64,), d), _labels(r, 64)),
                (True, False, False, True), (0, 1, 2), jnp.float16, kernel_rows=chunk_size or BATCH * SEQ)


CASES = [
    Case("reduce_sum", cl.ops.reduce_sum, lambda r, d: (_x(r, d),), (True,), (0,)),
    Case("reduce_mean", cl.ops.reduce_mean, lambda r, d: (_x(r, d),), (True,), (0,)),
    Case("reduce_max", cl.ops.reduce_max, lambda r, d: (_x(r, d),), (True,), (0,)),
    Case("layer_norm", cl.ops.layer_norm,
         lambda r, d: (_x(r, d, 64), random(r, (64,), d), random(r, (64,), d)),
         (True, False, False), (0, 1, 2)),
    Case("rms_norm", cl.ops.rms_norm,
         lambda r, d: (_x(r, d, 64), random(r, (64,), d)), (True, False), (0, 1)),
    # no parameters: the backward returns dx alone (no partial sums to add across devices)
    Case("rms_norm_no_scale", cl.ops.rms_norm, lambda r, d: (_x(r, d, 64),), (True,), (0,)),
    # both results side by side: gradients flow through normed and summed
    Case("add_layer_norm", lambda *a: jnp.concatenate(cl.ops.add_layer_norm(*a), axis=-1),
         lambda r, d: (_x(r, d, 64), _x(r, d, 64), random(r, (64,), d), random(r, (64,), d)),
         (True, True, False, False), (0, 1, 2, 3)),
    Case("add_rms_norm", lambda *a: jnp.concatenate(cl.ops.add_rms_norm(*a), axis=-1),
         lambda r, d: (_x(r, d, 64), _x(r, d, 64), random(r, (64,), d)), (True, True, False), (0, 1, 2)),
    Case("softmax", cl.ops.softmax, lambda r, d: (_x(r, d),), (True,), (0,)),
    Case("log_softmax", cl.ops.log_softmax, lambda r, d: (_x(r, d),), (True,), (0,)),
    Case("logsumexp", cl.ops.logsumexp, lambda r, d: (_x(r, d),), (True,), (0,)),
    Case("softmax_cross_entropy",
         lambda x, labels: cl.ops.softmax_cross_entropy(x, labels, ignore_index=-1, label_smoothing=0.1,
                                                        z_loss=1e-3),
         lambda r, d: (_x(r, d), _labels(r, 64)), (True, True), (0,)),
    # float16 with K, N multiples of 8: the GEMM families (kernel path), not an XLA dot. (K, N) as in
    # test_batching.py, whose lowering compiles the same kernels.
    Case("fused_linear",
         lambda x, w, b, res: cl.ops.fused_linear(x, w, b, activation="gelu", residual=res),
         lambda r, d: (_x(r, d, 64), random(r, (64, 32), d) / 8, random(r, (32,), d), _x(r, d, 32)),
         (True, False, False, True), (0, 1, 2, 3), jnp.float16),
    Case("mlp",
         lambda x, w1, b1, w2, b2, res: cl.ops.mlp(x, w1, b1, w2, b2, residual=res),
         lambda r, d: (_x(r, d, 32), random(r, (32, 64), d) / 6, random(r, (64,), d), random(r, (64, 32), d) / 8,
                       random(r, (32,), d), _x(r, d, 32)),
         (True, False, False, False, False, True), (0, 1, 2, 3, 4, 5), jnp.float16),
    # the three parts side by side, through a nonlinearity (so that dq, dk, dv depend on the
    # sharded rows, not only on the replicated cotangent); the deep24 model's qkv width (its
    # kernels, test_models.py's, compile once for both)
    Case("split_linear", lambda x, w, b: jnp.tanh(jnp.concatenate(cl.ops.split_linear(x, w, b, parts=3), axis=-1)),
         lambda r, d: (_x(r, d, 128), random(r, (128, 384), d) / 12, random(r, (384,), d)),
         (True, False, False), (0, 1, 2), jnp.float16),
    _lm_head_case("linear_cross_entropy"),  # all 48 tokens in one chunk
    # 6 chunks of 8 tokens, 2 from each device: the token axis, sharded, stays within the chunks
    _lm_head_case("linear_cross_entropy_chunked", chunk_size=8),
    Case("masked_mean_pool", cl.ops.masked_mean_pool,
         lambda r, d: (_x(r, d), jnp.asarray(r.integers(0, 2, (BATCH, SEQ)), jnp.int32)), (True, True), (0,),
         kernels=False),
    Case("embed", lambda ids, table: cl.ops.embed(table, ids),
         lambda r, d: (jnp.asarray(r.integers(0, 9, (BATCH, SEQ)), jnp.int32), random(r, (40, 64), d)),
         (True, False), (1,), kernels=False),
]
KERNEL_CASES = [c for c in CASES if c.kernels]
# With the sequence sharded too: the LM head's chunk count must divide each device's part of a
# row's tokens (its rows keep the (batch, sequence / chunks) axes: ops/lm_head.py), so its chunked
# case here is 3 chunks of 16 (a row's 6 tokens as 2 x 3: a sequence device's row each)
# A SwiGLU block too: its gate and value halves are viewed as (2, H) around the kernel calls
# beside the rows' (batch, sequence), which over Explicit axes come to them unflattened.
SEQUENCE_CASES = [c for c in KERNEL_CASES if c.name != "linear_cross_entropy_chunked"] + [
    _lm_head_case("linear_cross_entropy_sequence_chunks", chunk_size=16),
    Case("mlp_swiglu",
         lambda x, w1, b1, w2, b2: cl.ops.mlp(x, w1, b1, w2, b2, activation="swiglu"),
         lambda r, d: (_x(r, d, 32), random(r, (32, 128), d) / 6, random(r, (128,), d), random(r, (64, 32), d) / 8,
                       random(r, (32,), d)),
         (True, False, False, False, False), (0, 1, 2, 3, 4), jnp.float16)]
# The ops that keep a sharded sequence over ``Explicit`` mesh axes (their kernel calls take the
# rows unflattened); the GEMM ops still flatten it at the program's level (README, Multi-GPU)
EXPLICIT_SEQUENCE_OPS = {"reduce_sum", "reduce_mean", "reduce_max", "layer_norm", "rms_norm", "rms_norm_no_scale",
                         "add_layer_norm", "add_rms_norm", "softmax", "log_softmax", "logsumexp",
                         "softmax_cross_entropy"}


def loss_and_grads(fn, args, wrt, cotangent):
    """value_and_grad of sum(fn(*args) * cotangent) (a fresh random cotangent: every output
    element matters): ((loss, sum of the terms' sizes), grads)."""
    def loss(*a):
        terms = fn(*a).astype(jnp.float32) * cotangent
        return jnp.sum(terms), jnp.sum(jnp.abs(terms))

    return jax.value_and_grad(loss, argnums=wrt, has_aux=True)(*args)


def assert_step_matches(got, ref, dtype):
    """Results of :func:`loss_and_grads` agree: the loss, a signed sum that can cancel, relative
    to the size of its terms; the gradients leaf by leaf."""
    ((value, _), grads), ((ref_value, ref_size), ref_grads) = got, ref
    assert_close(value, ref_value, dtype, scale=5.0, scale_ref=ref_size)
    assert_trees_match(grads, ref_grads, tol_dtype=dtype)


def random_cotangent(rng, case, args):
    """A host array: jit puts it where the computation runs, whichever platform that is."""
    out = jax.eval_shape(case.fn, *args)
    return np.asarray(rng.standard_normal(out.shape), np.float32)


def put(mesh, args, specs):
    return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))


def collectives(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(kind, element count of each array it moves) of every collective in HLO text (XLA
    combines several all-reduces into one of a tuple, whose shape may hold /*index=N*/ comments)."""
    found = []
    for m in re.finditer(r"= (\(.*?\)|\S+) ([a-z-]+?)(?:-start)?\(", hlo):
        kind = m.group(2)
        if kind in FORBIDDEN + ("all-reduce",):
            shapes = re.findall(r"\[([\d,]*)\]", m.group(1))
            found.append((kind, tuple(math.prod(int(d) for d in s.split(",") if d) for s in shapes)))
    return found


def assert_no_activation_collectives(hlo: str, parameter_elements: int):
    found = collectives(hlo)
    assert not [c for c in found if c[0] in FORBIDDEN], found
    assert all(n <= parameter_elements for _, sizes in found for n in sizes), found


LOSS_SCALARS = 2  # loss_and_grads' loss and its terms' size, each all-reduced once


def parameter_elements(case, args) -> int:
    """The most elements an all-reduce of the step may move without moving an activation: every
    parameter's gradient and the loss scalars (the GPU's all-reduce combiner packs them into one
    flat buffer)."""
    return sum(a.size for a, r in zip(args, case.row_wise) if not r) + LOSS_SCALARS


# --- the LM head over sharded tokens -------------------------------------------------------------


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_lm_head_chunk_count_divides_a_batch_rows_tokens(axis_type, rng):
    """48 tokens as 3 batch rows of 16 over three devices, chunk_size 10: 8 chunks of 6 tokens
    (8 divides a row's 16 tokens), 2 from each device; 6 chunks of 8 (6 divides only the 48)
    would not split evenly over the devices, and XLA would gather the tokens."""
    mesh = make_mesh((3,), ("data",), axis_type)
    case = _lm_head_case("linear_cross_entropy", chunk_size=10)
    dtype = jnp.float16
    args = (random(rng, (3, 16, 32), dtype), random(rng, (32, 64), dtype) / 6, random(rng, (64,), dtype),
            jnp.asarray(rng.integers(0, 64, (3, 16)), jnp.int32))
    cotangent = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    step = jax.jit(loss_and_grads, static_argnums=(0, 2))
    ref = step(case.fn, args, case.wrt, cotangent)
    sharded = put(mesh, args, case.specs())
    compiled = step.lower(case.fn, sharded, case.wrt, cotangent).compile()
    assert_step_matches(compiled(sharded, cotangent), ref, dtype)  # static args baked in
    assert_no_activation_collectives(compiled.as_text(), parameter_elements(case, args))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "exp_path"])
@pytest.mark.parametrize("mode", ["shard_map", *AXIS_TYPES, "sequence"])
def test_lm_head_total_sharded_matches_one_device(mode, with_bias, rng):
    """A mean / sum LM head computes its gradients in the forward, carrying the total over the
    chunks: per shard in shard_map (a sum, summed over the shards with psum) and under sharded jit
    (a mean; "sequence": the tokens over a (data, seq) mesh, each row's 6 as 2 x 3 chunks), its
    value and gradients are one device's -- with a bias (the cross-entropy pass) and without (the
    exp path, its second passes included: one token's logits out of its range)."""
    reduction = "sum" if mode == "shard_map" else "mean"
    if mode == "sequence":
        mesh, rows = make_mesh((2, 2), ("data", "seq")), P("data", "seq")
    else:
        mesh, rows = make_mesh((4,), ("data",), "Auto" if mode == "shard_map" else mode), ROWS
    dtype = jnp.float16 if with_bias else jnp.bfloat16  # the exp path takes bfloat16
    h, w, b, labels = (_x(rng, dtype, 32), random(rng, (32, 64), dtype) / 6, random(rng, (64,), dtype),
                       _labels(rng, 64))
    if not with_bias:
        h = h.at[1, 3].multiply(2000.0)

    def head(h, w, b, labels):
        return cl.ops.linear_cross_entropy(h, w, labels, bias=b if with_bias else None, ignore_index=-1,
                                           reduction=reduction, chunk_size=16 if mode == "sequence" else 8)

    if mode == "shard_map":
        per_shard = jax.shard_map(lambda *a: jax.lax.psum(head(*a), "data"), mesh=mesh,
                                  in_specs=(ROWS, REPLICATED, REPLICATED, ROWS), out_specs=REPLICATED)
        loss, args = per_shard, (h, w, b, labels)
    else:
        loss, args = head, put(mesh, (h, w, b, labels), (rows, REPLICATED, REPLICATED, rows))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    value, grads = step(*args)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(head, argnums=(0, 1, 2)))(h, w, b, labels)
    assert_close(value, ref_value, dtype, scale=5.0)
    assert_trees_match(grads, ref_grads, tol_dtype=dtype)


# --- the programs lowered for CUDA, partitioned on this host ------------------------------------


def partitioned_cuda_hlo(f, avals, dump_dir) -> str:
    """The per-device program XLA's partitioner makes of ``f`` lowered for CUDA (see the module
    docstring): compiled by the CPU client, which stops at the first CuTe kernel call."""
    lowered = jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",))
    try:
        lowered.compile(compiler_options={"xla_dump_to": str(dump_dir)})
    except jax.errors.JaxRuntimeError as e:
        assert "No FFI handler registered for cutelayers_" in str(e), e
    (dump,) = dump_dir.glob("*after_optimizations.txt")
    return dump.read_text()


def kernel_row_counts(hlo: str) -> set[int]:
    """Every dim of every array a CuTe kernel call reads or writes."""
    lines = [line for line in hlo.splitlines() if 'custom_call_target="cutelayers_' in line]
    assert lines, "no CuTe kernel calls in the partitioned program"
    return {int(d) for line in lines for ds in re.findall(r"\[([\d,]+)\]", line) for d in ds.split(",")}


@pytest.mark.cute
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: c.name)
def test_row_sharded_cuda_program_runs_kernels_per_device(case, rng, tmp_path):
    mesh = make_mesh((4,), ("data",))
    args = case.make_args(rng, jnp.bfloat16)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
                  for a, s in zip(args, case.specs()))
    cotangent = random_cotangent(rng, case, args)
    hlo = partitioned_cuda_hlo(lambda *a: loss_and_grads(case.fn, a, case.wrt, cotangent), avals, tmp_path)
    dims = kernel_row_counts(hlo)
    # every kernel sees its device's share of the rows (of a chunk's, if chunked), never them all
    assert case.kernel_rows // 4 in dims and not {case.kernel_rows, BATCH * SEQ} & dims, dims
    assert_no_activation_collectives(hlo, parameter_elements(case, args))


@pytest.mark.cute
@pytest.mark.parametrize("case", [c for c in SEQUENCE_CASES if c.name in (
    "layer_norm", "softmax_cross_entropy", "mlp", "split_linear", "linear_cross_entropy",
    "linear_cross_entropy_sequence_chunks", "mlp_swiglu")], ids=lambda c: c.name)
def test_sequence_sharded_cuda_program_runs_kernels_per_device(case, rng, tmp_path):
    """The rows sharded over both the batch and the sequence (a (data, seq) mesh): each kernel
    sees its device's (2 x 3)-row share (of a chunk's, if chunked), the per-device program gathers
    nothing."""
    mesh = make_mesh((2, 2), ("data", "seq"))
    args = case.make_args(rng, jnp.bfloat16)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
                  for a, s in zip(args, case.specs(P("data", "seq"))))
    cotangent = random_cotangent(rng, case, args)
    hlo = partitioned_cuda_hlo(lambda *a: loss_and_grads(case.fn, a, case.wrt, cotangent), avals, tmp_path)
    dims = kernel_row_counts(hlo)
    rows = case.kernel_rows  # a chunk's, if chunked
    assert rows // 4 in dims and not {rows, rows // 2} & dims, dims
    assert_no_activation_collectives(hlo, parameter_elements(case, args))


# --- column- and row-parallel fused_linear ------------------------------------------------------

PARALLEL = {
    # name: (x, kernel, bias, residual) specs on a ("data", "model") mesh
    "column": (P("data"), P(None, "model"), P("model"), P("data", None, "model")),
    "row": (P("data", None, "model"), P("model", None), REPLICATED, P("data")),
}


def _linear(x, w, b, res):
    return cl.ops.fused_linear(x, w, b, activation="silu", residual=res)


@pytest.mark.cute
@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_linear_collectives(layout, rng, tmp_path):
    """CUDA-lowered forward, partitioned per device: column-parallel needs no collective at all;
    row-parallel needs exactly one all-reduce, of the (rows per device, N) partial products.
    Neither gathers anything."""
    mesh = make_mesh((2, 2), ("data", "model"))
    shapes = ((BATCH, SEQ, 32), (32, 64), (64,), (BATCH, SEQ, 64))
    avals = tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
                  for s, spec in zip(shapes, PARALLEL[layout]))
    hlo = partitioned_cuda_hlo(_linear, avals, tmp_path)
    dims = kernel_row_counts(hlo)
    rows = BATCH * SEQ // 2
    if layout == "column":
        assert {rows, 32, 64 // 2} <= dims and collectives(hlo) == []
    else:
        assert {rows, 32 // 2, 64} <= dims
        assert collectives(hlo) == [("all-reduce", (rows * 64,))]


# --- vocabulary-parallel cross-entropy ------------------------------------------------------------

CLASS_SHARDED = {
    # name: (fn, make_args, specs on a ("data", "model") mesh, wrt, dtype): the class axis over "model"
    "softmax_cross_entropy": (
        lambda x, labels: cl.ops.softmax_cross_entropy(x, labels, ignore_index=-1, label_smoothing=0.1,
                                                       z_loss=1e-3),
        lambda r, d: (_x(r, d), _labels(r, 64)), (P("data", None, "model"), ROWS), (0,), jnp.float32),
    "softmax_cross_entropy_soft_capped": (
        lambda x, labels: cl.ops.softmax_cross_entropy(x, labels, ignore_index=-1, label_smoothing=0.1,
                                                       logit_soft_cap=3.0),
        lambda r, d: (_x(r, d), _labels(r, 64)), (P("data", None, "model"), ROWS), (0,), jnp.float32),
    "logsumexp": (cl.ops.logsumexp, lambda r, d: (_x(r, d),), (P("data", None, "model"),), (0,), jnp.float32),
    # an LM head whose kernel (and bias) is split over the vocabulary
    "linear_cross_entropy": (
        _lm_head_case("linear_cross_entropy", chunk_size=8).fn,
        lambda r, d: (_x(r, d, 32), random(r, (32, 64), d) / 6, random(r, (64,), d), _labels(r, 64)),
        (ROWS, P(None, "model"), P("model"), ROWS), (0, 1, 2), jnp.float16),
    # the exp path (bfloat16, a mean, no bias): each device's 32 columns are half of one 64-column
    # block of row sums, whose totals the devices add up
    "linear_cross_entropy_exp_path": (
        lambda h, w, labels: cl.ops.linear_cross_entropy(h, w, labels, ignore_index=-1, chunk_size=8),
        lambda r, d: (_x(r, d, 32), random(r, (32, 64), d) / 6, _labels(r, 64)),
        (ROWS, P(None, "model"), ROWS), (0, 1), jnp.bfloat16),
    # with label smoothing: the kernel's column sums (its mean logit's) summed over the devices' columns
    "linear_cross_entropy_exp_path_smoothed": (
        lambda h, w, labels: cl.ops.linear_cross_entropy(h, w, labels, ignore_index=-1, chunk_size=8,
                                                         label_smoothing=0.3),
        lambda r, d: (_x(r, d, 32), random(r, (32, 64), d) / 6 + random(r, (32, 1), d) / 3, _labels(r, 64)),
        (ROWS, P(None, "model"), ROWS), (0, 1), jnp.bfloat16),
    # and with rows out of its range (logits past its clamp, and a row's all far below 0): their
    # second passes find each row's max logit and its label's over the devices' columns
    "linear_cross_entropy_exp_path_out_of_range": (
        lambda h, w, labels: cl.ops.linear_cross_entropy(h, w, labels, ignore_index=-1, chunk_size=8),
        lambda r, d: (_x(r, d, 32).at[1, 2].multiply(300.0).at[5, 0].multiply(300.0).at[6, 3].set(
            -jnp.sum(random(r, (32, 64), d) / 6, axis=1) * 40.0), random(r, (32, 64), d) / 6, _labels(r, 64)),
        (ROWS, P(None, "model"), ROWS), (0, 1), jnp.bfloat16),
}


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("name", CLASS_SHARDED)
def test_class_sharded_cross_entropy_matches_one_device(name, axis_type, rng):
    """Logits sharded along the classes (vocabulary parallel): each device reduces its slice, the
    rows' lse and the label's logit are combined across the "model" axis, values and gradients
    are one device's, and nothing is gathered but (rows,) statistics."""
    fn, make_args, specs, wrt, dtype = CLASS_SHARDED[name]
    mesh = make_mesh((2, 2), ("data", "model"), axis_type)
    args = make_args(rng, dtype)
    cotangent = random_cotangent(rng, Case(name, fn, make_args, (), wrt), args)
    step = jax.jit(loss_and_grads, static_argnums=(0, 2))
    ref = step(fn, args, wrt, cotangent)
    sharded = put(mesh, args, specs)
    compiled = step.lower(fn, sharded, wrt, cotangent).compile()
    assert_step_matches(compiled(sharded, cotangent), ref, dtype)
    found = collectives(compiled.as_text())
    # the exp path's read of each label's P and its scatter-add into them gather their (row,
    # label) index pairs over the rows' devices: two integers per token of a chunk, nothing larger
    gathered = [c for c in found if c[0] in FORBIDDEN]
    if "exp_path" in name:
        gathered = [c for c in gathered if c[0] != "all-gather" or max(c[1]) > BATCH * SEQ]
    assert not gathered, found
    tokens_per_device = BATCH * SEQ // 2
    largest = max([tokens_per_device * 32] + [a.size for a, spec in zip(args, specs) if spec != ROWS])
    assert all(n <= largest for _, sizes in found for n in sizes), found


def test_odd_vocabulary_split_matches_one_device(rng):
    """An odd vocabulary (62 columns, padded to 64 for TMA) split over the "model" axis takes the
    exp path with its padding left out of the sums -- with rows out of its range, whose second
    passes must not take the padding's zero logits as a row's max: its value and gradients are
    one device's. (Each device counts its own share of the vocabulary's columns, through XLA's
    product and the reference epilogue.)"""
    mesh = make_mesh((2, 2), ("data", "model"))
    # row (1, 2)'s logits past the exp epilogue's clamp; row (6, 3)'s all about -100 (w's first
    # row 0.5 everywhere, h's first feature there -200)
    h = _x(rng, jnp.bfloat16, 32).at[1, 2].multiply(300.0).at[6, 3, 0].set(-200.0)
    w = (random(rng, (32, 62), jnp.bfloat16) / 6).at[0].set(0.5)
    args, specs = (h, w, _labels(rng, 62)), (ROWS, P(None, "model"), ROWS)

    def fn(h, w, labels):
        return cl.ops.linear_cross_entropy(h, w, labels, ignore_index=-1, chunk_size=8)

    cotangent = random_cotangent(rng, Case("odd_vocabulary", fn, None, (), (0, 1)), args)
    step = jax.jit(loss_and_grads, static_argnums=(0, 2))
    ref = step(fn, args, (0, 1), cotangent)
    sharded = put(mesh, args, specs)
    assert_step_matches(step(fn, sharded, (0, 1), cotangent), ref, jnp.bfloat16)


@pytest.mark.parametrize("x_spec,w_spec", [(P("data", "model"), P("model", None)),
                                            (P("data", None), P(None, "model"))], ids=["contraction", "columns"])
def test_exp_gemm_passes_sharded_match_one_device(x_spec, w_spec, rng):
    """The LM head's exp GEMM and its two passes over flagged rows with the contraction split
    (the exponential after the psum, taken once: the eleventh-to-forty-first sessions' tree
    psum'd its results again, doubling them) or the columns split (the blocks' totals combined
    over the devices): one device's results -- the row sums' and blocks' totals, and P."""
    from cutelayers.ops.linear import exp_logits, exp_logits_fix

    mesh = make_mesh((2, 2), ("data", "model"))
    x = random(rng, (64, 128), jnp.bfloat16).at[5].multiply(60.0)
    w = jnp.asarray(random(rng, (128, 256), jnp.float32) / 12, jnp.bfloat16)
    flags = jnp.zeros(64, jnp.int32).at[5].set(1)
    labels = jnp.asarray(rng.integers(0, 256, 64), jnp.int32)

    def passes(x, w):
        e, sums = exp_logits(x, w)
        e, _, top, at_label = exp_logits_fix(x, w, e, flags, labels, jnp.zeros(64, jnp.float32))
        shift = jnp.where(flags != 0, jnp.max(top, axis=-1), 0.0)
        e, fixed, _, _ = exp_logits_fix(x, w, e, flags, labels, shift)
        return e, jnp.sum(sums, -1), jnp.sum(fixed, -1)[5], jnp.max(at_label, -1)[5], shift[5]

    want = jax.jit(passes)(x, w)
    got = jax.jit(passes)(jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec)))
    assert_close(got[0], want[0], jnp.bfloat16)
    assert_close(got[1][np.arange(64) != 5], want[1][np.arange(64) != 5], jnp.bfloat16)
    # the flagged row's S, label logit and max logit (about 150): float32 sums in another order
    for g, r in zip(got[2:], want[2:]):
        np.testing.assert_allclose(float(g), float(r), rtol=1e-2)


def test_linear_shard_too_narrow_for_the_kernel_runs_as_xla_gemm(rng, tmp_path):
    """N = 40 suits the kernel (a multiple of 8), but column-parallel over two devices leaves 20
    per device, which does not: each device runs the same product as an XLA GEMM."""
    mesh = make_mesh((2, 2), ("data", "model"))
    args = (_x(rng, jnp.float16, 32), random(rng, (32, 40), jnp.float16) / 6)
    specs = (P("data"), P(None, "model"))
    ref = jax.jit(cl.ops.fused_linear)(*args)
    assert_trees_match(jax.jit(cl.ops.fused_linear)(*put(mesh, args, specs)), ref, tol_dtype=jnp.float16)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=NamedSharding(mesh, s))
                  for a, s in zip(args, specs))
    hlo = partitioned_cuda_hlo(cl.ops.fused_linear, avals, tmp_path)
    assert 'custom_call_target="cutelayers_' not in hlo and collectives(hlo) == []


# --- shardings a kernel cannot honour ----------------------------------------------------------


def test_feature_axis_sharding_is_an_error_that_names_the_argument(rng):
    mesh = make_mesh((4,), ("data",))
    x = jax.device_put(_x(rng, jnp.float32), NamedSharding(mesh, P(None, None, "data")))
    # Auto axes: XLA's partitioner asks the rule at compile time, and reports its error
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"softmax_fwd: argument 'x' is sharded over mesh axes \('data',\) along dim 2 "
                             r"of the kernel's \(8, 6, 64\) view of it, a dim the kernel needs whole.*"
                             r"Shard only its rows"):
        jax.jit(cl.ops.softmax)(x)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
def test_sharded_parameter_is_an_error_that_names_it(axis_type, rng):
    # over an axis the rows do not use (over theirs it is gathered: the fsdp tests below)
    mesh = make_mesh((2, 2), ("data", "model"), axis_type)
    x = jax.device_put(_x(rng, jnp.float32, 96), NamedSharding(mesh, ROWS))
    scale = jax.device_put(random(rng, (96,), jnp.float32), NamedSharding(mesh, P("model")))
    error = ValueError if axis_type == "Explicit" else jax.errors.JaxRuntimeError  # traced vs compiled
    with pytest.raises(error, match=r"rms_norm_fwd: argument 'scale' is sharded over mesh axes \('model',\).*"
                                    r"Every device needs all of it: replicate it"):
        jax.jit(cl.ops.rms_norm)(x, scale)


FSDP_ROWS = P(("data", "fsdp"))  # the batch over both axes, as training.sharding splits it


def _fsdp_mlp(activation):
    def loss(x, w1, w2):
        return cl.ops.mlp(x, w1, None, w2, None, activation=activation).astype(jnp.float32).sum()

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "geglu"])
def test_fsdp_parameters_are_gathered_and_match_one_device(activation, axis_type, rng):
    """Weights sharded over the axes that shard the batch (fsdp) are gathered for the call: a
    gated fc1's gate and value columns (whose halves' factor the rows' axes cannot take too) and,
    where the kernel needs the dim whole, a norm's scale -- both raised at compile time before."""
    mesh = make_mesh((2, 2), ("data", "fsdp"), axis_type)
    width = 2 * 64 if activation.endswith("glu") else 64  # a gated kernel's hidden width: a multiple of 64
    args = (_x(rng, jnp.bfloat16, 64), random(rng, (64, width), jnp.bfloat16) / 8,
            random(rng, (64, 64), jnp.bfloat16) / 6)
    f = jax.jit(_fsdp_mlp(activation))
    assert_trees_match(f(*put(mesh, args, (FSDP_ROWS, P(None, "fsdp"), P("fsdp", None)))), f(*args),
                       tol_dtype=jnp.bfloat16)
    x, scale = _x(rng, jnp.float32, 64), random(rng, (64,), jnp.float32)
    norm = jax.jit(jax.grad(lambda x, s: cl.ops.rms_norm(x, s).sum(), argnums=(0, 1)))
    assert_trees_match(norm(*put(mesh, (x, scale), (FSDP_ROWS, P("fsdp")))), norm(x, scale), tol_dtype=jnp.float32)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("path", ["exp_path", "bias"])
def test_fsdp_head_and_embedding_match_one_device(path, axis_type, rng):
    """An fsdp-sharded LM head kernel (and bias) and embedding table are gathered for the calls;
    their gradients come back in the parameters' shardings -- over Explicit axes the custom_vjp's
    types demand it (a type error before)."""
    mesh = make_mesh((2, 2), ("data", "fsdp"), axis_type)
    dtype = jnp.bfloat16 if path == "exp_path" else jnp.float16
    h, labels = _x(rng, dtype, 32), _labels(rng, 64)
    ids = jnp.asarray(rng.integers(0, 40, (BATCH, SEQ)), jnp.int32)
    args = (h, random(rng, (32, 64), dtype) / 6, random(rng, (64,), dtype), random(rng, (40, 32), dtype), labels, ids)
    bias = path == "bias"

    def loss(h, w, b, table, labels, ids):
        x = h + cl.ops.embed(table, ids)
        return cl.ops.linear_cross_entropy(x, w, labels, bias=b if bias else None, ignore_index=-1)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    specs = (FSDP_ROWS, P("fsdp", None), P("fsdp"), P("fsdp", None), FSDP_ROWS, FSDP_ROWS)
    sharded = put(mesh, args, specs)
    with jax.set_mesh(mesh):
        value, grads = step(*sharded)
    ref_value, ref_grads = step(*args)
    assert_close(value, ref_value, dtype)
    assert_trees_match(grads[:2 + bias] + grads[3:], ref_grads[:2 + bias] + ref_grads[3:], tol_dtype=dtype)
    if axis_type == "Explicit":  # (under Auto axes XLA lays the results out as it likes)
        for g, spec in zip(grads[1:], specs[1:4]):
            assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim), (g.sharding, spec)


@pytest.mark.cute
def test_fsdp_gated_mlp_cuda_program_runs_kernels_per_device(rng, tmp_path):
    mesh = make_mesh((2, 2), ("data", "fsdp"))
    specs = (FSDP_ROWS, P(None, "fsdp"), P("fsdp", None))
    avals = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, s))
                  for shape, s in zip(((BATCH, SEQ, 64), (64, 2 * 64), (64, 64)), specs))
    dims = kernel_row_counts(partitioned_cuda_hlo(_fsdp_mlp("swiglu"), avals, tmp_path))
    assert BATCH * SEQ // 4 in dims and BATCH * SEQ not in dims, dims  # each device its rows


def test_uneven_row_sharding_is_an_error(rng):
    mesh = make_mesh((4,), ("data",))

    def f(x):  # 6 rows over 4 devices: only a constraint inside jit can ask for that
        return cl.ops.softmax(jax.lax.with_sharding_constraint(x, NamedSharding(mesh, ROWS)))

    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"softmax_fwd: argument 'x' \(shape \(6, 64\)\) is sharded over mesh axes "
                             r"\('data',\) \(4 devices\) along dim 0 of size 6, which does not divide "
                             r"evenly"):
        jax.jit(f)(random(rng, (6, 64), jnp.float32))


@pytest.mark.cute
def test_user_kernels_refuse_sharded_operands(rng):
    """cute_call's out_shape is the global result: a user kernel never runs on a shard under
    sharded jit (jax.shard_map is the way to run it per device)."""
    from user_kernels import add

    mesh = make_mesh((4,), ("data",))
    x = jax.device_put(random(rng, (8, 64), jnp.float32), NamedSharding(mesh, ROWS))
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"argument 'input\[0\]' is sharded over mesh axes \('data',\) along dim 0.*"
                             r"Every device needs all of it"):
        jax.jit(add)(x)
    per_device = jax.shard_map(add, mesh=mesh, in_specs=ROWS, out_specs=ROWS)
    assert_trees_match(jax.jit(per_device)(x), x + 1.0)


def test_feature_axis_sharding_in_explicit_mode_fails_while_tracing(rng):
    mesh = make_mesh((2, 2), ("data", "model"), "Explicit")
    x = jax.device_put(_x(rng, jnp.float32), NamedSharding(mesh, P("data", None, "model")))
    with pytest.raises(ValueError, match=r"reduce_sum: argument 'x' is sharded over mesh axes \('model',\) "
                                         r"along dim 2"):
        jax.jit(cl.ops.reduce_sum).trace(x)


def test_rows_view_takes_axis_sizes_from_the_operand_sharding_them():
    """Under Explicit axes a parameter made outside the mesh context (a model's scale from its
    init) has the empty mesh in its type: each device's part of the rows' view comes from x's
    mesh, whichever operand comes last (a KeyError before)."""
    from cutelayers.ops.norm import NormForward
    from cutelayers.runtime.sharding import Views, plan

    mesh = make_mesh((2, 2), ("data", "seq"))
    family = NormForward(center=False, has_scale=True, has_bias=False, epsilon=1e-6, out_dtype="float32")
    avals = (jax.ShapeDtypeStruct((BATCH * SEQ, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.float32))
    shardings = (NamedSharding(mesh, P("data", "seq", None)),
                 NamedSharding(jax.sharding.get_abstract_mesh(), P()))
    p = plan(family, avals, shardings, Views((BATCH, SEQ)))
    assert p.local_lead == (BATCH // 2, SEQ // 2)
    assert p.operand_specs == (P("data", "seq", None), P(None))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_lm_head_explicit_sharded_sequence_matches_one_device(dtype, rng):
    """Under Explicit axes jax types every intermediate's sharding: the head's strided rows keep
    (batch, sequence / chunks), its kernel calls take them unflattened, its label gather and
    in-place update say their sharding, and it matches one device (a ShardingTypeError on jax 0.10
    before)."""
    mesh = make_mesh((2, 2), ("data", "seq"), "Explicit")
    case = _lm_head_case("linear_cross_entropy", chunk_size=16)
    args = case.make_args(rng, dtype)
    cotangent = jnp.asarray(rng.standard_normal((BATCH, SEQ)), jnp.float32)
    ref = jax.jit(loss_and_grads, static_argnums=(0, 2))(case.fn, args, case.wrt, cotangent)
    sharded = put(mesh, args, case.specs(P("data", "seq")))
    with jax.set_mesh(mesh):
        got = jax.jit(loss_and_grads, static_argnums=(0, 2))(case.fn, sharded, case.wrt, cotangent)
    assert_step_matches(got, ref, dtype)
