"""CuTe DSL kernels. Nothing here imports JAX: a kernel sees (rows, features) tensors only."""
