"""Small transformers built from cutelayers layers (Flax nnx, Flax linen, Equinox).

Empty for now: the models land with the layer issues (norms, fused linear, heads).
"""
