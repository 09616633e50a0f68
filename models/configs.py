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
* ``llama``  -- Llama 3.2 1B's block at the wide preset's width, depth and vocabulary: RMSNorm,
  grouped-query attention (32 query heads of 64, 8 of keys and values), a SwiGLU MLP (hidden
  8192: fc1 writes the gate and value halves, 2 x 8192), no biases, rotary positions in place of
  the position table; an untied head (1.50B parameters; Llama 3.2 1B ties it: ``tie_embeddings``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

NORMS = ("layer", "rms")
ACTIVATIONS = ("gelu", "swiglu")
REMATS = ("none", "full", "dots")


def fc1_features(activation: str, hidden: int) -> int:
    """An MLP's first-layer width: SwiGLU's gate and value halves side by side, else ``hidden``."""
    return 2 * hidden if activation == "swiglu" else hidden


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """A decoder-only transformer: token + learned position embeddings, ``n_layers`` pre-norm
    blocks (LayerNorm -> causal self-attention -> residual; LayerNorm -> MLP with GELU ->
    residual), a final LayerNorm and an untied LM head trained with cross-entropy -- GPT-2's
    design; ``norm``, ``n_kv_heads``, ``activation``, ``bias`` and ``rope`` select Llama's parts
    instead, and ``tie_embeddings`` a head that reads the token embedding table.

    ``remat`` recomputes each block in the backward instead of keeping its activations (both
    twins under the same ``jax.checkpoint`` policy: :func:`models.common.block_remat_policy`).

    ``dtype`` is the compute dtype (activations and the matmul operands); parameters are always
    float32. The CuTe GEMM kernels take bfloat16 / float16 operands, so GPU configs use bfloat16;
    float32 runs the same decomposition as XLA GEMMs (and is what the CPU config uses).
    """

    vocab_size: int = 256
    seq_len: int = 64  # maximum sequence length: rows of the position table
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    # heads of keys and values, each shared by n_heads / n_kv_heads query heads (grouped-query
    # attention, as Llama's); None: n_heads (multi-head attention)
    n_kv_heads: int | None = None
    mlp_ratio: int = 4
    dtype: str = "float32"
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # cutelayers' qkv layer returns q, k and v as three arrays (``parts=3``): no slice of a fused
    # result, no concatenation of dq, dk, dv. False keeps the one (..., 3 d) array the stock twin
    # has: what tensor parallelism takes, whose column shards of [q | k | v] are not whole heads.
    # Three equal parts only: with fewer key / value heads the array stays whole (splits_qkv).
    split_qkv: bool = True
    # the block's parts: "layer" (LayerNorm) or "rms" (RMSNorm, a scale and no bias); the MLP's
    # "gelu" (jax.nn.gelu's tanh form) or "swiglu" (silu(gate) * value, fc1 writing both halves);
    # biases in the linear layers and LayerNorms; rotary positions on q and k (theta
    # ``rope_theta``, the halves of each head rotated as in Llama) instead of a position table
    norm: str = "layer"
    activation: str = "gelu"
    bias: bool = True
    rope: bool = False
    rope_theta: float = 500000.0
    # the LM head reads the token embedding table (vocab, d_model) as its weight, no head
    # parameter of its own (GPT-2's and Llama 3.2 1B's choice; the presets keep an untied head)
    tie_embeddings: bool = False
    # each block recomputed in the backward (jax.checkpoint) instead of keeping its activations:
    # "none"; "full" keeps the block's inputs only (nothing_saveable); "dots" also its matmuls'
    # results (dots_with_no_batch_dims_saveable; cutelayers' GEMM kernels count as dots:
    # models.common.block_remat_policy)
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layers", "d_model", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer; got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig: d_model={self.d_model} must be a multiple of "
                             f"n_heads={self.n_heads}")
        if self.n_kv_heads is not None and not (
                isinstance(self.n_kv_heads, int) and self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0):
            raise ValueError(f"GPTConfig.n_kv_heads must be None or a positive integer dividing n_heads="
                             f"{self.n_heads}; got {self.n_kv_heads!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"GPTConfig.dtype must be 'float32', 'bfloat16' or 'float16'; "
                             f"got {self.dtype!r}")
        for name, allowed in (("norm", NORMS), ("activation", ACTIVATIONS), ("remat", REMATS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {', '.join(map(repr, allowed))}; "
                                 f"got {getattr(self, name)!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ValueError(f"GPTConfig.rope_theta must be a positive number; got {self.rope_theta!r}")
        if self.rope and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rope=True rotates pairs of a head's features: head_dim="
                             f"{self.head_dim} (d_model / n_heads) must be even")

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

    @property
    def kv_heads(self) -> int:
        """Heads of keys and values: ``n_kv_heads``, or ``n_heads`` if None."""
        return self.n_kv_heads or self.n_heads

    @property
    def qkv_features(self) -> int:
        """The qkv projection's width: queries (d_model), then keys and values (kv_heads heads each)."""
        return self.d_model + 2 * self.kv_heads * self.head_dim

    @property
    def splits_qkv(self) -> bool:
        """Whether cutelayers' qkv layer returns q, k and v apart (``split_qkv``): three equal parts,
        so only without grouped keys and values."""
        return self.split_qkv and self.kv_heads == self.n_heads

    @property
    def norm_bias(self) -> bool:
        """Whether the norms have a bias: LayerNorms with ``bias`` (RMSNorm has none)."""
        return self.bias and self.norm == "layer"

    @property
    def fc1_features(self) -> int:
        """The MLP's first-layer width (:func:`fc1_features`)."""
        return fc1_features(self.activation, self.d_mlp)

    def num_params(self) -> int:
        d, v, f, f1 = self.d_model, self.vocab_size, self.d_mlp, self.fc1_features
        b = int(self.bias)
        norm = d + d * int(self.norm_bias)
        qkv = self.qkv_features
        block = 2 * norm + (d * qkv + qkv * b) + (d * d + d * b) + (d * f1 + f1 * b) + (f * d + d * b)
        positions = 0 if self.rope else self.seq_len * d
        head = 0 if self.tie_embeddings else d * v
        return v * d + positions + self.n_layers * block + norm + head


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "small": GPTConfig(seq_len=512, n_layers=8, d_model=512, n_heads=8, dtype="bfloat16"),
    "deep24": GPTConfig(seq_len=128, n_layers=24, d_model=128, n_heads=4, dtype="bfloat16"),
    "gpt2": GPTConfig(vocab_size=50304, seq_len=1024, n_layers=12, d_model=768, n_heads=12, dtype="bfloat16"),
    "wide": GPTConfig(vocab_size=128256, seq_len=2048, n_layers=16, d_model=2048, n_heads=16, dtype="bfloat16"),
    "llama": GPTConfig(vocab_size=128256, seq_len=2048, n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8,
                       dtype="bfloat16", norm="rms", activation="swiglu", bias=False, rope=True),
}


def get_config(name: str, **overrides) -> GPTConfig:
    """The preset ``name`` (``tiny``, ``small``, ``deep24``, ``gpt2``, ``wide``, ``llama``) with
    optional field overrides."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose from {', '.join(CONFIGS)}")
    return dataclasses.replace(CONFIGS[name], **overrides)
