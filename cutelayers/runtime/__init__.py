"""The CuTe <-> JAX bridge: the kernel-call primitive, the launch shim, sharding rules, the compile
caches and placement checks."""
