"""Flax modules backed by cutelayers ops: :mod:`cutelayers.flax.linen` and :mod:`cutelayers.flax.nnx`.

Each module is a drop-in replacement for Flax's own (same constructor arguments, defaults,
parameter names, shapes, initializers and dtype rules), so checkpoints load unchanged.
"""
