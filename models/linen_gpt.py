"""GPT (decoder-only transformer) in Flax linen, built from cutelayers layers -- or, with
``stock=True``, from linen's own layers with the same parameter tree.

    x = wte(tokens) + wpe(positions)
    per block:  x = attn_out(attention(qkv(ln1(x))), residual=x)      # fused residual add
                x = mlp(ln2(x), residual=x)           # Dense(gelu(Dense(.))) + x: one ops.mlp
    loss = head(ln_f(x), targets)                # LMHead: linear + cross-entropy, no logits

Parameters (float32), ``params`` collection: ``wte.embedding``, ``wpe.embedding``,
``blocks_{i}.{ln1,ln2}.{scale,bias}``, ``blocks_{i}.{qkv,attn_out}.{kernel,bias}``,
``blocks_{i}.mlp.{Dense_0,Dense_1}.{kernel,bias}``, ``ln_f.{scale,bias}``, ``head.kernel`` -- the
names linen's ``Embed`` / ``LayerNorm`` / ``Dense`` use, in both twins (the stock twin's MLP is a
compact module calling ``nn.Dense`` twice).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from cutelayers.flax import linen as cl_linen
from models.common import Functional, causal_attention, cross_entropy, head_logits, positions
from models.configs import GPTConfig


class _StockDense(nn.Dense):
    """linen's Dense with the call of cutelayers' Dense (``residual=``), unfused."""

    @nn.compact
    def __call__(self, inputs, residual=None):
        y = super().__call__(inputs)
        return y if residual is None else residual + y


class _StockMLP(nn.Module):
    """Two linen Dense layers (``Dense_0``, ``Dense_1``: a compact module's names) with the
    attributes and call of cutelayers' MLP (as the GPT uses it): ``fc2(gelu(fc1(x))) + residual``,
    unfused."""

    hidden_features: int
    features: int
    dtype: Any
    kernel_init: Any
    out_kernel_init: Any

    @nn.compact
    def __call__(self, x, residual):
        h = jax.nn.gelu(nn.Dense(self.hidden_features, dtype=self.dtype, kernel_init=self.kernel_init)(x))
        return residual + nn.Dense(self.features, dtype=self.dtype, kernel_init=self.out_kernel_init)(h)


class _StockHead(nn.Dense):
    """linen's Dense as an LM head with the call of cutelayers' LMHead: ``head(h, targets)`` ->
    mean cross-entropy (optax, on materialised float32 logits)."""

    @nn.compact
    def __call__(self, h, targets):
        return cross_entropy(super().__call__(h), targets)


def _layers(stock: bool):
    """(LayerNorm, Dense, MLP, LM head, token Embed) classes of the stock twin or of the cutelayers
    model."""
    if stock:
        return nn.LayerNorm, _StockDense, _StockMLP, _StockHead, nn.Embed
    return cl_linen.LayerNorm, cl_linen.Dense, cl_linen.MLP, cl_linen.LMHead, cl_linen.Embed


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    config: GPTConfig
    stock: bool = False

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        LayerNorm, Dense, MLP, _, _ = _layers(self.stock)
        d, dt = cfg.d_model, cfg.compute_dtype
        init, proj_init = nn.initializers.normal(cfg.init_std), nn.initializers.normal(cfg.proj_init_std)
        h = LayerNorm(epsilon=cfg.norm_eps, dtype=dt, name="ln1")(x)
        a = causal_attention(Dense(3 * d, dtype=dt, kernel_init=init, name="qkv")(h), cfg.n_heads)
        x = Dense(d, dtype=dt, kernel_init=proj_init, name="attn_out")(a, residual=x)
        h = LayerNorm(epsilon=cfg.norm_eps, dtype=dt, name="ln2")(x)
        mlp = MLP(cfg.d_mlp, d, dtype=dt, kernel_init=init, out_kernel_init=proj_init, name="mlp")
        return mlp(h, residual=x)


class GPT(nn.Module):
    """``GPT(config, stock=False)``; ``model.apply({"params": p}, inputs, targets)`` -> mean loss;
    without ``targets``, float32 logits (batch, seq, vocab).

    ``inputs`` / ``targets``: (batch, seq) integer token ids, seq <= config.seq_len.
    """

    config: GPTConfig
    stock: bool = False

    @nn.compact
    def __call__(self, inputs, targets=None):
        cfg = self.config
        LayerNorm, _, _, Head, Embed = _layers(self.stock)
        dt, init = cfg.compute_dtype, nn.initializers.normal(cfg.init_std)
        x = Embed(cfg.vocab_size, cfg.d_model, dtype=dt, embedding_init=init, name="wte")(inputs)
        x = x + nn.Embed(cfg.seq_len, cfg.d_model, dtype=dt, embedding_init=init, name="wpe")(
            positions(inputs, cfg))
        for i in range(cfg.n_layers):
            x = Block(cfg, self.stock, name=f"blocks_{i}")(x)
        h = LayerNorm(epsilon=cfg.norm_eps, dtype=dt, name="ln_f")(x)
        if targets is None:
            return head_logits(h, self.variables["params"]["head"]["kernel"])
        return Head(cfg.vocab_size, use_bias=False, dtype=dt, kernel_init=init, name="head")(h, targets)


def init(config: GPTConfig, key: jax.Array, *, stock: bool = False, abstract: bool = False) -> Functional:
    """Build the model; returns its functional view (params: the ``params`` collection).
    ``abstract``: shapes only (``jax.ShapeDtypeStruct`` leaves), nothing computed."""
    model = GPT(config, stock=stock)
    dummy = jax.ShapeDtypeStruct((1, min(8, config.seq_len)), jnp.int32)
    init_params = lambda k: model.lazy_init(k, dummy, dummy)["params"]  # noqa: E731  (no forward pass)
    params = jax.eval_shape(init_params, key) if abstract else jax.jit(init_params)(key)

    def loss(params, inputs, targets):
        return model.apply({"params": params}, inputs, targets)

    def logits(params, inputs):
        return model.apply({"params": params}, inputs)

    return Functional(params=params, loss=loss, logits=logits, model=model, config=config, stock=stock)


__all__ = ["GPT", "Block", "init"]
