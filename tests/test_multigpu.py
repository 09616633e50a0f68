"""Every op on several devices against one device, values and gradients, on each platform: the
fake CPU devices (see conftest: four; every kernel call runs its jnp reference, partitioned by
the same sharding rules that run the kernels on GPUs) and, on a host with two or more Hopper
GPUs, two GPUs, where the CuTe kernels run on every device's shard (the ``gpu`` and ``multigpu``
markers: skipped with fewer GPUs). One test body per check, parametrized over the platform, so
CI runs the plumbing on CPU and a 2-GPU host runs the kernels:

* every op of ``tests/test_sharding.py``'s cases (norms, softmax family, cross-entropy,
  fused_linear, mlp, the LM head, reductions) under plain ``jax.jit`` with row-sharded
  ``NamedSharding`` inputs (``Auto`` mesh axes, and ``Explicit`` ones on jax >= 0.11): results
  and gradients match one device, stay sharded, and the compiled program gathers no activations
  (on GPUs: it calls the CuTe kernels);
* the same ops per shard inside ``jax.shard_map``;
* column- and row-parallel ``fused_linear``, and the Megatron MLP (``mlp`` with its hidden
  layer split: fc1 column-parallel, fc2 row-parallel: one all-reduce of the output rows);
* a short ``training.train --mesh data=2`` run on the platform's devices.

On GPUs the operands are bfloat16 (the kernels' dtype) where a case runs kernels; on CPU each
case's own dtype.
"""

from __future__ import annotations

import dataclasses
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HOPPER_GPUS
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import assert_close, assert_trees_match, random
from test_sharding import (
    AXIS_TYPES,
    BATCH,
    CASES,
    PARALLEL,
    REPLICATED,
    ROWS,
    SEQ,
    SEQUENCE_CASES,
    _linear,
    _x,
    assert_no_activation_collectives,
    assert_step_matches,
    collectives,
    loss_and_grads,
    parameter_elements,
    put,
    random_cotangent,
)

import cutelayers as cl
from training.train import parse_args, train

KERNEL_CALL = 'custom_call_target="cutelayers_'


@dataclasses.dataclass(frozen=True)
class Platform:
    name: str  # "cpu" or "gpu"
    devices: list

    def mesh(self, shape, names, axis_type="Auto"):
        kind = getattr(jax.sharding.AxisType, axis_type)
        return jax.make_mesh(shape, names, devices=self.devices[:math.prod(shape)],
                             axis_types=(kind,) * len(shape))

    def dtype(self, case_dtype, kernels: bool = True):
        """GPUs take bfloat16 where the kernels run; CPU the case's dtype."""
        return jnp.bfloat16 if self.name == "gpu" and kernels else case_dtype

    def one_device(self, args):
        return jax.device_put(args, self.devices[0])


@pytest.fixture(params=["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.multigpu])])
def platform(request) -> Platform:
    if request.param == "gpu":
        return Platform("gpu", HOPPER_GPUS[:2])
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return Platform("cpu", devices[:4])


STEP = jax.jit(loss_and_grads, static_argnums=(0, 2))


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_jit_matches_one_device(case, axis_type, platform, rng):
    mesh = platform.mesh((len(platform.devices),), ("data",), axis_type)
    dtype = platform.dtype(case.dtype, case.kernels)
    args = platform.one_device(case.make_args(rng, dtype))
    cotangent = random_cotangent(rng, case, args)
    ref_out, ref = jax.jit(case.fn)(*args), STEP(case.fn, args, case.wrt, cotangent)

    sharded = put(mesh, args, case.specs())
    out = jax.jit(case.fn)(*sharded)
    compiled = STEP.lower(case.fn, sharded, case.wrt, cotangent).compile()
    got = compiled(sharded, cotangent)  # static args baked in
    assert_trees_match(out, ref_out, tol_dtype=dtype)
    assert_step_matches(got, ref, dtype)
    # results and row-wise gradients stay sharded over the rows: nothing was gathered to return them
    assert out.sharding.spec[:1] == ("data",)
    for i, g in zip(case.wrt, got[1]):
        assert (g.sharding.spec[:1] == ("data",)) == case.row_wise[i], (i, g.sharding)
    hlo = compiled.as_text()
    if axis_type == "Auto":  # the partitioned program: per-device kernels, parameter-sized all-reduces
        assert_no_activation_collectives(hlo, parameter_elements(case, args))
    assert (KERNEL_CALL in hlo) == (platform.name == "gpu" and case.kernels)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("case", SEQUENCE_CASES, ids=lambda c: c.name)
def test_sequence_sharded_jit_matches_one_device(case, axis_type, platform, rng):
    """The sequence axis sharded as well as the batch (a (data, seq) mesh; on two GPUs (1, 2)):
    the ops flatten (batch, sequence) into rows, which no sharding of the rows can express, so
    the kernel calls see the two dims as they were (runtime/sharding.py's ``Views``). Each
    device runs the kernels on its (batch part x sequence part) rows: results and gradients match
    one device, stay sharded over both axes, and no activation is gathered. Over ``Explicit``
    axes, where jax types every reshape's sharding, the row ops give the kernel calls their rows
    unflattened (``rows_at``): each device flattens its own."""
    mesh = platform.mesh((len(platform.devices) // 2, 2), ("data", "seq"), axis_type)
    dtype = platform.dtype(case.dtype)
    args = platform.one_device(case.make_args(rng, dtype))
    specs = case.specs(P("data", "seq"))
    cotangent = random_cotangent(rng, case, args)
    ref_out, ref = jax.jit(case.fn)(*args), STEP(case.fn, args, case.wrt, cotangent)

    sharded = put(mesh, args, specs)
    out = jax.jit(case.fn)(*sharded)
    compiled = STEP.lower(case.fn, sharded, case.wrt, cotangent).compile()
    got = compiled(sharded, cotangent)
    assert_trees_match(out, ref_out, tol_dtype=dtype)
    assert_step_matches(got, ref, dtype)
    both = NamedSharding(mesh, P("data", "seq"))
    assert out.sharding.is_equivalent_to(both, out.ndim), out.sharding
    for i, g in zip(case.wrt, got[1]):
        if case.row_wise[i]:
            assert g.sharding.is_equivalent_to(both, g.ndim), (i, g.sharding)
    hlo = compiled.as_text()
    assert_no_activation_collectives(hlo, parameter_elements(case, args))
    assert (KERNEL_CALL in hlo) == (platform.name == "gpu")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_shard_map_matches_one_device(case, platform, rng):
    mesh = platform.mesh((len(platform.devices),), ("data",))
    dtype = platform.dtype(case.dtype, case.kernels)
    args = platform.one_device(case.make_args(rng, dtype))
    cotangent = random_cotangent(rng, case, args)
    ref = STEP(case.fn, args, case.wrt, cotangent)
    per_shard = jax.shard_map(case.fn, mesh=mesh, in_specs=case.specs(), out_specs=ROWS)
    assert_step_matches(STEP(per_shard, put(mesh, args, case.specs()), case.wrt, cotangent), ref, dtype)


@pytest.mark.parametrize("case", [c for c in SEQUENCE_CASES if c.name in (
    "layer_norm", "softmax_cross_entropy", "fused_linear", "mlp_swiglu", "linear_cross_entropy")],
    ids=lambda c: c.name)
def test_vmap_over_explicitly_sharded_dims_matches_one_device(case, platform, rng):
    """The Equinox style over a (data, seq) mesh of Explicit axes: the op vmapped over the batch
    (sharded over data) and the sequence (over seq), applied per token. Inside the vmaps a token's
    value is sharded over neither, so each kernel call maps only over the axes left; the batching
    rule folds both dims back into its rows."""
    mesh = platform.mesh((len(platform.devices) // 2, 2), ("data", "seq"), "Explicit")
    dtype = platform.dtype(case.dtype)
    args = platform.one_device(case.make_args(rng, dtype))
    axes = tuple(0 if r else None for r in case.row_wise)
    per_token = jax.vmap(jax.vmap(case.fn, in_axes=axes), in_axes=axes)
    cotangent = random_cotangent(rng, case, args)
    ref = STEP(case.fn, args, case.wrt, cotangent)
    sharded = put(mesh, args, case.specs(P("data", "seq")))
    got = STEP(per_token, sharded, case.wrt, cotangent)
    assert_step_matches(got, ref, dtype)
    both = NamedSharding(mesh, P("data", "seq"))
    for i, g in zip(case.wrt, got[1]):
        if case.row_wise[i]:
            assert g.sharding.is_equivalent_to(both, g.ndim), (i, g.sharding)


def parallel_mesh(platform, axis_type="Auto"):
    """("data", "model") with two devices on the model axis."""
    return platform.mesh((len(platform.devices) // 2, 2), ("data", "model"), axis_type)


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_linear_matches_one_device(layout, axis_type, platform, rng):
    """Column-parallel: the kernel sharded over N, y comes out sharded over N, dx is summed over
    the model axis. Row-parallel: the kernel sharded over K, the partial products are summed and
    the bias, activation and residual apply once, after the sum."""
    mesh = parallel_mesh(platform, axis_type)
    dtype = platform.dtype(jnp.float16)
    args = platform.one_device((_x(rng, dtype, 64), random(rng, (64, 128), dtype) / 8, random(rng, (128,), dtype),
                                _x(rng, dtype, 128)))
    cotangent = np.asarray(rng.standard_normal((BATCH, SEQ, 128)), np.float32)  # host: jit places it
    ref_out, ref = jax.jit(_linear)(*args), STEP(_linear, args, (0, 1, 2, 3), cotangent)

    sharded = put(mesh, args, PARALLEL[layout])
    out, got = jax.jit(_linear)(*sharded), STEP(_linear, sharded, (0, 1, 2, 3), cotangent)
    assert_trees_match(out, ref_out, tol_dtype=dtype)
    assert_step_matches(got, ref, dtype)
    expected_out = ("data", None, "model") if layout == "column" else ("data", None, None)
    # equivalent, not equal: on two GPUs the mesh is (data=1, model=2), and under Auto axes the
    # partitioner drops a size-1 axis from the result's spec (as it does for a plain x @ w)
    assert out.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, P(*expected_out)), 3), out.sharding
    # the kernel's gradient comes out sharded like the kernel (summed over the data axis)
    assert got[1][1].sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, PARALLEL[layout][1]), 2)


def _mlp(x, w1, b1, w2, b2, residual):
    return cl.ops.mlp(x, w1, b1, w2, b2, residual=residual)


def test_megatron_mlp_matches_one_device(platform, rng):
    """fc1 column-parallel (w1, b1 split over the hidden width), fc2 row-parallel (w2 split over
    its input): the hidden activations stay split, and the forward's only activation collective
    is the all-reduce of fc2's (rows, 64) partial products -- none of the (rows, 256) hidden."""
    mesh = parallel_mesh(platform)
    dtype = platform.dtype(jnp.float16)
    args = platform.one_device((_x(rng, dtype, 64), random(rng, (64, 256), dtype) / 8, random(rng, (256,), dtype),
                                random(rng, (256, 64), dtype) / 16, random(rng, (64,), dtype), _x(rng, dtype, 64)))
    specs = (ROWS, P(None, "model"), P("model"), P("model", None), REPLICATED, ROWS)
    wrt = tuple(range(6))
    cotangent = np.asarray(rng.standard_normal((BATCH, SEQ, 64)), np.float32)  # host: jit places it
    ref = STEP(_mlp, args, wrt, cotangent)
    sharded = put(mesh, args, specs)
    compiled = STEP.lower(_mlp, sharded, wrt, cotangent).compile()
    assert_step_matches(compiled(sharded, cotangent), ref, dtype)
    found = collectives(compiled.as_text())
    rows = BATCH * SEQ // mesh.shape["data"]
    assert {kind for kind, _ in found} <= {"all-reduce"}, found
    assert rows * 256 not in {n for _, sizes in found for n in sizes}, found
    assert any(rows * 64 in sizes for _, sizes in found), found


@pytest.mark.parametrize("axis_type", AXIS_TYPES)
@pytest.mark.parametrize("rows_spec", [ROWS, P(None, "data")], ids=["batch", "sequence"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_megatron_gated_mlp_matches_one_device(layout, rows_spec, axis_type, platform, rng):
    """A SwiGLU block split Megatron-style, w1 (its gate and value halves side by side) and b1
    in contiguous blocks of their 2 H columns -- one device's gates, another's values --, w2
    over its input: each device computes its part of both halves (XLA moves w1's columns
    there once a step, an all-to-all of the weight), so the hidden activations stay split, and
    the only collective of the (rows, .) activations is the all-reduce of fc2's (rows, 64)
    partial products -- none of the (rows, 128) hidden, nor of its (rows, 256) pre-activation.
    With the rows split along the sequence instead of the batch, the same: the kernels see both
    views at once, the rows' (batch, sequence) and the halves' (2, H). Over Explicit axes, whose
    types have no sharding of the 2 H dim for a device's [gates | values], the call is refused
    with an error that names the argument (README, Multi-GPU)."""
    mesh = parallel_mesh(platform, axis_type)
    dtype = platform.dtype(jnp.float16)
    w1, w2 = random(rng, (64, 256), dtype) / 8, random(rng, (128, 64), dtype) / 12
    specs = (rows_spec, P(None, "model"), P("model"), P("model", None), REPLICATED, rows_spec)
    if layout == "nk":
        w1, w2 = w1.T, w2.T
        specs = (rows_spec, P("model", None), P("model"), P(None, "model"), REPLICATED, rows_spec)
    args = platform.one_device((_x(rng, dtype, 64), w1, random(rng, (256,), dtype), w2, random(rng, (64,), dtype),
                                _x(rng, dtype, 64)))

    def block(x, w1, b1, w2, b2, residual):
        return cl.ops.mlp(x, w1, b1, w2, b2, activation="swiglu", residual=residual, kernel_layout=layout)

    cotangent = np.asarray(rng.standard_normal((BATCH, SEQ, 64)), np.float32)
    sharded = put(mesh, args, specs)
    if axis_type == "Explicit":  # no sharding of w1's 2 H columns is each device's [gates | values]
        with pytest.raises(ValueError, match="argument 'kernel' holds a gated layer's gate and value halves"):
            STEP.lower(block, sharded, tuple(range(6)), cotangent)
        return
    ref = STEP(block, args, tuple(range(6)), cotangent)
    compiled = STEP.lower(block, sharded, tuple(range(6)), cotangent).compile()
    assert_step_matches(compiled(sharded, cotangent), ref, dtype)
    found = collectives(compiled.as_text())
    rows = BATCH * SEQ // mesh.shape["data"]
    moved = {n for kind, sizes in found if kind != "all-reduce" for n in sizes}  # gathers, all-to-alls ...
    summed = {n for kind, sizes in found if kind == "all-reduce" for n in sizes}
    assert not {rows * 64, rows * 128, rows * 256} & moved, found  # no activation's share moves
    assert not {rows * 128, rows * 256} & summed and rows * 64 in summed, found
    if platform.name == "gpu":
        assert KERNEL_CALL in compiled.as_text()


def test_mlp_with_its_output_split_matches_one_device(platform, rng):
    """fc2 column-parallel (w2, b2 split over the output width), fc1 replicated: the dh GEMM's
    contraction (that width) is split, so each device's dz1 is a partial sum, all-reduced -- and
    the hidden layer h = act(z1) its epilogue writes beside dz1 is whole on every device, not a
    partial sum (counted once in dw2)."""
    mesh = parallel_mesh(platform)
    dtype = platform.dtype(jnp.float16)
    args = platform.one_device((_x(rng, dtype, 64), random(rng, (64, 128), dtype) / 8, random(rng, (128,), dtype),
                                random(rng, (128, 64), dtype) / 12, random(rng, (64,), dtype), _x(rng, dtype, 64)))
    specs = (ROWS, REPLICATED, REPLICATED, P(None, "model"), P("model"), ROWS)
    cotangent = np.asarray(rng.standard_normal((BATCH, SEQ, 64)), np.float32)
    ref = STEP(_mlp, args, tuple(range(6)), cotangent)
    sharded = put(mesh, args, specs)
    assert_step_matches(STEP(_mlp, sharded, tuple(range(6)), cotangent), ref, dtype)


def test_training_over_a_data_mesh_of_two(platform):
    """``python -m training.train --mesh data=2`` for a few steps on the platform's devices (the
    command trains on JAX's default platform): it trains, the state sits on both devices, and on
    GPUs the compiled step calls the CuTe kernels."""
    if jax.default_backend() != platform.name:
        pytest.skip(f"training.train runs on JAX's default platform, {jax.default_backend()}")
    argv = ["--mesh", "data=2", "--steps", "8", "--batch-size", "8", "--seq-len", "32", "--eval-every", "0",
            "--eval-batches", "1", "--warmup", "2", "--lr", "1e-2", "--log-every", "4"]
    result = train(parse_args(argv), out=io.StringIO())
    assert result.steps_run == 8 and np.isfinite(result.end_loss) and result.end_loss < result.start_loss - 0.5
    assert all(len(p.sharding.device_set) == 2 for p in jax.tree.leaves(result.params))
    assert (result.kernel_calls > 0) == (platform.name == "gpu"), result.path


@pytest.mark.parametrize("framework", ["nnx", "linen", "equinox"])
def test_model_step_over_an_explicit_data_mesh_matches_one_device(framework, platform, rng):
    """A GPT's loss and gradients over a data mesh of Explicit axes (jax.make_mesh's default),
    the batch sharded and the parameters replicated, are one device's: every layer, the
    embedding's gather and table gradient (Equinox's per-example vmap) and the LM head included.
    (The stock twins' embedding gathers do not trace there on jax 0.10.)"""
    from models.common import init
    from models.configs import get_config

    config = get_config("tiny", dtype="bfloat16") if platform.name == "gpu" else get_config("tiny")
    model = init(framework, config, jax.random.key(0))
    mesh = platform.mesh((len(platform.devices),), ("data",), "Explicit")
    tokens = platform.one_device(jnp.asarray(rng.integers(0, config.vocab_size, (8, config.seq_len)), jnp.int32))
    step = jax.jit(jax.value_and_grad(model.loss))
    ref = step(platform.one_device(model.params), tokens, tokens)
    sharded = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        got = step(jax.device_put(model.params, NamedSharding(mesh, P())), sharded, sharded)
    dtype = jnp.dtype(config.dtype)
    assert_close(got[0], ref[0], dtype)
    assert_trees_match(got[1], ref[1], tol_dtype=dtype)
