"""Model configurations shared by the three GPT implementations (nnx, linen, equinox).

``GPTConfig`` is the only thing the framework files share besides :mod:`models.common`; the
presets:

* ``tiny``   -- CPU: seconds per hundred steps; the default of ``python -m training.train``.
* ``small``  -- one Hopper GPU: ~25M parameters, bfloat16 compute, sequence 512.
* ``deep24`` -- 24 identical blocks of a small width, bfloat16: the compile-once demonstration
  (every distinct kernel compiles once however deep the model; ``tests/test_models.py``).
* ``gpt2``   -- GPT-2 small's shape (12 blocks, d 768, 12 heads, sequence 1024; 163M parameters with the
  untied head), vocabulary padded to 50304 (a multiple of 128), bfloat16: the benchmark model. The
  shipped corpus is bytes, so training it uses the first 256 ids of that vocabulary.
* ``wide``   -- GPT blocks at Llama 3.2 1B's width, depth and vocabulary (16 blocks, d 2048, 16 heads of
  128, sequence 2048, vocabulary 128256; 1.33B parameters with the untied head), bfloat16: the
  Llama-width shapes of the kernel benchmarks (the MLP 2048 -> 8192 -> 2048, the LM head's
  128256 columns) in a model. GPT's LayerNorm, GELU and biases, not Llama's RMSNorm and SwiGLU.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer: token + learned position embeddings, ``n_layers`` pre-norm
    blocks (LayerNorm -> causal self-attention -> residual; LayerNorm -> MLP with GELU ->
    residual), a final LayerNorm and an untied LM head trained with cross-entropy.

    ``dtype`` is the compute dtype (activations and the matmul operands); parameters are always
    float32. The CuTe GEMM kernels take bfloat16 / float16 operands, so GPU configs use bfloat16;
    float32 runs the same decomposition as XLA GEMMs (and is what the CPU config uses).
    """

    vocab_size: int = 256
    seq_len: int = 64  # maximum sequence length: rows of the position table
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # cutelayers' qkv layer returns q, k and v as three arrays (``parts=3``): no slice of a fused
    # result, no concatenation of dq, dk, dv. False keeps the one (..., 3 d) array the stock twin
    # has: what tensor parallelism takes, whose column shards of [q | k | v] are not whole heads.
    split_qkv: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer; got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be a multiple of "
                             f"n_heads={self.n_heads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"GPTConfig.dtype must be 'float32', 'bfloat16' or 'float16'; "
                             f"got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_mlp(self) -> int:
        return self.mlp_ratio * self.d_model

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def proj_init_std(self) -> float:
        """GPT-2's scaled init for the two projections that write into the residual stream."""
        return self.init_std / (2 * self.n_layers) ** 0.5

    def num_params(self) -> int:
        d, v, t, f = self.d_model, self.vocab_size, self.seq_len, self.d_mlp
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return v * d + t * d + self.n_layers * block + 2 * d + d * v


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(seq_len=512, n_layers=8, d_model=512, n_heads=8, dtype="bfloat16"),
    "deep24": GPTConfig(seq_len=128, n_layers=24, d_model=128, n_heads=4, dtype="bfloat16"),
    "gpt2": GPTConfig(vocab_size=50304, seq_len=1024, n_layers=12, d_model=768, n_heads=12, dtype="bfloat16"),
    "wide": GPTConfig(vocab_size=128256, seq_len=2048, n_layers=16, d_model=2048, n_heads=16, dtype="bfloat16"),
}


def get_config(name: str, **overrides) -> GPTConfig:
    """The preset ``name`` (``tiny``, ``small``, ``deep24``, ``gpt2``, ``wide``) with optional field overrides."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose from {', '.join(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides)
