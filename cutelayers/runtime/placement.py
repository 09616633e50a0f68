"""Placement checks: every kernel call runs on one device's arrays.

Inside ``jax.shard_map`` each shard is a single-device array, so kernels are fine there. Outside it,
a kernel call in a computation partitioned over several devices would make XLA gather every
operand onto each device (or compute the wrong thing), so it is refused with a message that says
what to do instead. The jnp reference path has no such limit: XLA partitions it like any jnp code.
"""

from __future__ import annotations

from typing import Mapping

import jax
from jax._src import core as _core
from jax._src import sharding_impls


def check_arrays(arrays: Mapping[str, object], op: str) -> None:
    """Eager check: concrete arguments must live on one and the same single device.

    Tracers are skipped (their placement is checked when the call is lowered).
    """
    device_sets = {}
    for name, x in arrays.items():
        if x is None or isinstance(x, _core.Tracer) or not isinstance(x, jax.Array):
            continue
        devices = x.sharding.device_set
        if len(devices) > 1:
            raise ValueError(
                f"{op}: argument {name!r} is sharded over {len(devices)} devices "
                f"({x.sharding}); a kernel call takes single-device arrays. Call {op} inside "
                "jax.shard_map over your mesh so that each device runs it on its own shard."
            )
        device_sets[name] = next(iter(devices))
    if len(set(device_sets.values())) > 1:
        where = ", ".join(f"{k} on {v}" for k, v in device_sets.items())
        raise ValueError(
            f"{op}: arguments are on different devices ({where}); move them to one device "
            "with jax.device_put first."
        )


def check_lowering_context(ctx, op: str, arg_names) -> None:
    """Lowering-time check for the kernel path: refuse multi-device SPMD outside shard_map."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext):
        if axis_context.num_devices > 1:
            raise ValueError(
                f"{op}: its arguments ({', '.join(arg_names)}) are in a computation partitioned "
                f"over {axis_context.num_devices} devices outside jax.shard_map. The kernel runs "
                "on single-device shards: wrap the call in jax.shard_map over your mesh (or use "
                "the 'reference' backend, which XLA partitions itself)."
            )
    elif isinstance(axis_context, sharding_impls.SPMDAxisContext):
        mesh = axis_context.mesh
        auto = [a for a in mesh.axis_names if a not in axis_context.manual_axes and mesh.shape[a] > 1]
        if auto:
            raise ValueError(
                f"{op}: called inside jax.shard_map that leaves mesh axes {auto} automatic; the "
                f"kernel's arguments ({', '.join(arg_names)}) must be manual over every mesh "
                "axis of size > 1. Add those axes to shard_map's axis_names."
            )
