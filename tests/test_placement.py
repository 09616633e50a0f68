"""Placement checks with four fake CPU devices (see conftest): single-device arrays anywhere are
fine; eager calls on arrays sharded over several devices are refused by name (they run under
jax.jit, see tests/test_sharding.py); shard_map runs the op per shard; kernels lowered where no
sharding rule applies are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from numerics import random
from test_linear import lower_cuda

import cutelayers as cl
from cutelayers import tuning
from cutelayers.ops.reduce import RowReduce
from cutelayers.runtime.primitive import kernel_call_p


@pytest.fixture
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    return jax.make_mesh((4,), ("data",), devices=devices[:4], axis_types=(jax.sharding.AxisType.Auto,))


def test_single_device_array_on_any_device_is_fine(rng):
    x = random(rng, (8, 32), jnp.float32)
    for device in jax.devices("cpu")[:4]:
        out = cl.ops.reduce_sum(jax.device_put(x, device))
        np.testing.assert_allclose(out, x.sum(-1), rtol=1e-5)


def test_eager_call_on_a_sharded_array_is_refused_with_the_fix(mesh, rng):
    x = jax.device_put(random(rng, (8, 32), jnp.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"argument 'x' is sharded over 4 devices.*Call reduce_max under "
                                         r"jax.jit .*or inside jax.shard_map"):
        cl.ops.reduce_max(x)
    # the fix works: under jit the same array runs per device
    np.testing.assert_allclose(jax.jit(cl.ops.reduce_max)(x), np.asarray(x).max(-1), rtol=1e-6)


def test_shard_map_runs_per_shard(mesh, rng):
    x = random(rng, (8, 6, 32), jnp.float32)
    f = jax.jit(jax.shard_map(lambda x: cl.ops.reduce_mean(x), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(f(x), x.mean(-1), rtol=1e-5)
    g = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(x.mean(-1) ** 2))(x), rtol=1e-5)


@pytest.mark.cute
def test_cuda_lowering_under_shard_map_emits_the_kernel(mesh):
    f = jax.shard_map(lambda x: cl.ops.reduce_sum(x), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    hlo = lower_cuda(f, jax.ShapeDtypeStruct((16, 64), jnp.float32))
    assert "custom_call @cutelayers_reduce_sum" in hlo and "CustomSPMDPartitioning" not in hlo


def test_cuda_lowering_of_sharded_jit_defers_the_kernel_to_the_partitioner(mesh):
    """Outside shard_map the kernel call is a custom-partitioning call carrying the Shardy rule;
    the kernel itself is emitted per device when XLA partitions (tests/test_sharding.py)."""
    aval = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    hlo = lower_cuda(cl.ops.reduce_sum, aval)
    (call,) = [line for line in hlo.splitlines() if "custom_call @CustomSPMDPartitioning" in line]
    assert "sdy.sharding_rule" in call and "custom_call @cutelayers_" not in hlo


@pytest.mark.cute
def test_shard_map_that_leaves_an_axis_automatic_is_refused(rng):
    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f = jax.shard_map(lambda x: cl.ops.reduce_sum(x), mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                      axis_names={"data"})
    with pytest.raises(ValueError, match=r"leaves mesh axes \['model'\] automatic.*Add those axes"):
        lower_cuda(f, jax.ShapeDtypeStruct((16, 64), jnp.float32))


@pytest.mark.cute
def test_raw_primitive_in_sharded_jit_is_refused(mesh):
    aval = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    family = tuning.resolve(RowReduce("sum"), (aval,))
    with pytest.raises(ValueError, match=r"bound directly in a computation partitioned over 4 devices"):
        lower_cuda(lambda x: kernel_call_p.bind(x, family=family), aval)
