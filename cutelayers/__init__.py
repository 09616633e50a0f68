"""cutelayers: neural-network layers for JAX whose hot paths run CuTe DSL kernels on Hopper GPUs.

Public surface:

* :mod:`cutelayers.ops` -- differentiable ops (``reduce_sum``, ``reduce_mean``, ``reduce_max``, ...);
* :func:`use_backend`, :func:`current_backend` -- choose kernels or the jnp reference;
* :func:`cache_info`, :func:`clear_cache` -- the compile-once cache and its statistics;
* :func:`parallel_compiles` -- compile the kernels a lowering needs in worker processes, meanwhile;
* :func:`remat_policy` -- a ``jax.checkpoint`` policy that counts the GEMM kernels as dots;
* :func:`cute_call`, :func:`custom_op`, :func:`rowwise_vmap` -- bring your own CuTe kernel;
* :mod:`cutelayers.aot` -- export a function with its compiled kernels, load it elsewhere.
"""

from cutelayers import aot, ops
from cutelayers.backend import BACKENDS, current_backend, use_backend
from cutelayers.cute_call import custom_op, cute_call, rowwise_vmap
from cutelayers.ops.remat import remat_policy
from cutelayers.runtime.cache import KernelStats, cache_info, clear_cache
from cutelayers.runtime.parallel_compile import parallel_compiles

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "KernelStats",
    "aot",
    "cache_info",
    "clear_cache",
    "current_backend",
    "custom_op",
    "cute_call",
    "ops",
    "parallel_compiles",
    "remat_policy",
    "rowwise_vmap",
    "use_backend",
]
