"""Every JAX internal cutelayers uses (``jax._src``), in one place.

Each name says why the public API (``jax``, ``jax.extend``) does not suffice. Where a legacy
module (``jax.core``, ``jax.interpreters``) re-exports a name, that is no better: JAX lists those
modules as internal APIs it is deprecating (its docs/api_compatibility.md, "Legacy internal APIs").

Versions: checked on jax 0.10.2 (this package's tests); 0.11.2 is exercised by the GPU image's test
runs. Every name below also exists, with the signature used here, in the jax 0.11.0 source.
"""

# Defines the cutelayers_backend config option. jax.config only updates existing options; nothing
# public defines one that is part of the jit cache key (include_in_jit_key) and the trace context.
from jax._src.config import enum_state

# Tracer: isinstance checks for "is this value traced?" (a jax.Array check is true for tracers
# too). No public alias outside the legacy jax.core.
# get_axis_env: its explicit_mesh_axis_names, the mesh axes a jax.vmap over an Explicit-sharded dim
# takes out of those jax.shard_map may map over (shard_map's own check reads it). No public alias;
# jax.sharding.get_abstract_mesh() still lists those axes.
from jax._src.core import Tracer, get_axis_env

# The eager impl of a primitive that has only lowerings: compile the one primitive with XLA and
# cache the executable. jax.extend.core offers Primitive, not this impl.
from jax._src.dispatch import apply_primitive

# The tracer of staging (jit, make_jaxpr), told apart from eager, JVP and vmap tracers to decide
# when sharding rules apply. No public alias outside the legacy jax.interpreters.partial_eval.
from jax._src.interpreters.partial_eval import DynamicJaxprTracer

# The types of a lowering context's ``module_context.axis_context``: partitioned over devices
# (ShardingContext) or inside shard_map (SPMDAxisContext). No public alias outside the legacy
# jax.interpreters.mlir; jax.extend.mlir has none.
from jax._src.sharding_impls import ShardingContext, SPMDAxisContext

__all__ = ["DynamicJaxprTracer", "SPMDAxisContext", "ShardingContext", "Tracer", "apply_primitive", "enum_state",
           "get_axis_env"]
