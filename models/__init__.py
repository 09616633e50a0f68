"""Small GPT-style transformers built from cutelayers layers, one per framework.

* :mod:`models.nnx_gpt` (Flax NNX), :mod:`models.linen_gpt` (Flax linen),
  :mod:`models.equinox_gpt` (Equinox): the same architecture; ``stock=True`` builds the twin from
  the framework's own layers with the same parameter tree (checkpoints move between them).
* :mod:`models.configs`: ``GPTConfig`` and the presets ``tiny`` (CPU), ``small`` (one GPU),
  ``deep24`` (24 blocks: the compile-once demonstration), ``gpt2`` (GPT-2 small's shape), ``wide``
  (Llama 3.2 1B's width, depth and vocabulary), ``llama`` (those shapes with Llama's RMSNorm,
  grouped-query attention, SwiGLU, no biases and rotary positions).
* :mod:`models.common`: the attention core, the functional view ``init(framework, config, key)
  -> Functional(params, loss, ...)`` that :mod:`training.train` uses, and parameter transfer.
"""

from models.common import FRAMEWORKS, Functional, init, transfer_params
from models.configs import CONFIGS, GPTConfig, get_config

__all__ = ["CONFIGS", "FRAMEWORKS", "Functional", "GPTConfig", "get_config", "init", "transfer_params"]
