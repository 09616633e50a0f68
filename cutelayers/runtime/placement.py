"""Placement checks: every kernel launch runs on one device's arrays.

Inside ``jax.shard_map`` each shard is a single-device array, so kernels are fine there. Under
``jax.jit``, arrays sharded over several devices go through the family's sharding rule
(:mod:`cutelayers.runtime.sharding`), which runs the kernel per device or raises an error that
names the argument. Eager calls run no partitioner, so they take single-device arrays only and
refuse sharded ones with a message that says to jit the call. The jnp reference path has no such
limit: XLA partitions it like any jnp code.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from cutelayers.runtime._jax_compat import ShardingContext, SPMDAxisContext, Tracer


def check_arrays(arrays: Mapping[str, object], op: str) -> None:
    """Eager check: concrete arguments must live on one and the same single device.

    Tracers are skipped (under jit the sharding rule decides; the lowering checks the rest).
    """
    device_sets = {}
    for name, x in arrays.items():
        if x is None or isinstance(x, Tracer) or not isinstance(x, jax.Array):
            continue
        devices = x.sharding.device_set
        if len(devices) > 1:
            raise ValueError(
                f"{op}: argument {name!r} is sharded over {len(devices)} devices ({x.sharding}); "
                f"called eagerly, a kernel takes single-device arrays. Call {op} under jax.jit "
                "(arrays sharded over their rows then run per device), or inside jax.shard_map "
                "over your mesh."
            )
        device_sets[name] = next(iter(devices))
    if len(set(device_sets.values())) > 1:
        where = ", ".join(f"{k} on {v}" for k, v in device_sets.items())
        raise ValueError(
            f"{op}: arguments are on different devices ({where}); move them to one device "
            "with jax.device_put first."
        )


def check_lowering_context(ctx, op: str, arg_names) -> None:
    """Lowering-time check for the kernel path: refuse multi-device SPMD where no sharding rule
    runs the kernel per device."""
    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, ShardingContext):
        if axis_context.num_devices > 1:
            raise ValueError(
                f"{op}: the kernel-call primitive for its arguments ({', '.join(arg_names)}) was "
                f"bound directly in a computation partitioned over {axis_context.num_devices} "
                "devices. Call it through cutelayers.runtime.sharding.kernel_call (which applies "
                "the family's sharding rule), or inside jax.shard_map over your mesh."
            )
    elif isinstance(axis_context, SPMDAxisContext):
        mesh = axis_context.mesh
        auto = [a for a in mesh.axis_names if a not in axis_context.manual_axes and mesh.shape[a] > 1]
        if auto:
            raise ValueError(
                f"{op}: called inside jax.shard_map that leaves mesh axes {auto} automatic; the "
                f"kernel's arguments ({', '.join(arg_names)}) must be manual over every mesh "
                "axis of size > 1. Add those axes to shard_map's axis_names."
            )
