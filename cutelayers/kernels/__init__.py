"""CuTe DSL kernels. Nothing here imports JAX: a kernel sees (rows, features) tensors only. The
``*_config`` modules import no CuTe either: they hold what ops read while tracing (configs, config
spaces), also where the CuTe DSL is not installed."""
