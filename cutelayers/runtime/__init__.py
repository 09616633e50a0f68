"""The CuTe <-> JAX bridge: the kernel-call primitive, its compile cache and placement checks."""
