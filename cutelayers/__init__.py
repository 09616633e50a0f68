"""cutelayers: neural-network layers for JAX whose hot paths run CuTe DSL kernels on Hopper GPUs.

Public surface:

* :mod:`cutelayers.ops` -- differentiable ops (``reduce_sum``, ``reduce_mean``, ``reduce_max``, ...);
* :func:`use_backend`, :func:`current_backend` -- choose kernels or the jnp reference;
* :func:`cache_info`, :func:`clear_cache` -- the compile-once cache and its statistics.
"""

from cutelayers import ops
from cutelayers.backend import BACKENDS, current_backend, use_backend
from cutelayers.runtime.cache import KernelStats, cache_info, clear_cache

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "KernelStats",
    "cache_info",
    "clear_cache",
    "current_backend",
    "ops",
    "use_backend",
]
