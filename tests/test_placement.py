"""Placement checks with four fake CPU devices (see conftest): single-device arrays anywhere are
fine, arrays sharded over several devices outside shard_map are refused by name, and shard_map
runs the op per shard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import cutelayers as cl
from numerics import random


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


def test_sharded_array_outside_shard_map_is_refused(mesh, rng):
    x = jax.device_put(random(rng, (8, 32), jnp.float32), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"argument 'x' is sharded over 4 devices.*jax.shard_map"):
        cl.ops.reduce_max(x)


def test_shard_map_runs_per_shard(mesh, rng):
    x = random(rng, (8, 6, 32), jnp.float32)
    f = jax.jit(jax.shard_map(lambda x: cl.ops.reduce_mean(x), mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    np.testing.assert_allclose(f(x), x.mean(-1), rtol=1e-5)
    g = jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(x.mean(-1) ** 2))(x), rtol=1e-5)


def test_cuda_lowering_under_shard_map_emits_the_kernel(mesh):
    f = jax.shard_map(lambda x: cl.ops.reduce_sum(x), mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    hlo = jax.jit(f).trace(jax.ShapeDtypeStruct((16, 64), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @cutelayers_reduce_sum" in hlo


def test_cuda_lowering_of_sharded_jit_outside_shard_map_is_refused(mesh):
    sharding = NamedSharding(mesh, P("data"))
    aval = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=sharding)
    with pytest.raises(ValueError, match=r"partitioned over 4 devices outside jax.shard_map"):
        jax.jit(cl.ops.reduce_sum).trace(aval).lower(lowering_platforms=("cuda",))
