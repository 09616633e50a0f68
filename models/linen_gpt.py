"""GPT (decoder-only transformer) in Flax linen, built from cutelayers layers -- or, with
``stock=True``, from linen's own layers with the same parameter tree.

The forward pass is the one :mod:`models.common` describes (the residual add fused into the norms).

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
from models.common import (
    Functional,
    add_norm,
    causal_attention,
    cross_entropy,
    head_logits,
    positions,
    qkv_split,
)
from models.configs import GPTConfig


class _StockLayerNorm(nn.LayerNorm):
    """linen's LayerNorm with the call of cutelayers' (``residual=``), unfused."""

    @nn.compact
    def __call__(self, x, residual=None):
        if residual is None:
            return super().__call__(x)
        summed = residual + x
        return super().__call__(summed), summed


class _StockMLP(nn.Module):
    """Two linen Dense layers (``Dense_0``, ``Dense_1``: a compact module's names) with the
    attributes and call of cutelayers' MLP (as the GPT uses it): ``fc2(gelu(fc1(x)))``, unfused."""

    hidden_features: int
    features: int
    dtype: Any
    kernel_init: Any
    out_kernel_init: Any

    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(nn.Dense(self.hidden_features, dtype=self.dtype, kernel_init=self.kernel_init)(x))
        return nn.Dense(self.features, dtype=self.dtype, kernel_init=self.out_kernel_init)(h)


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
        return _StockLayerNorm, nn.Dense, _StockMLP, _StockHead, nn.Embed
    return cl_linen.LayerNorm, cl_linen.Dense, cl_linen.MLP, cl_linen.LMHead, cl_linen.Embed


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual.
    ``block(x, pending) -> (x, pending)``: the residual stream and the output not yet added to it
    (module docstring)."""

    config: GPTConfig
    stock: bool = False

    @nn.compact
    def __call__(self, x, pending=None):
        cfg = self.config
        LayerNorm, Dense, MLP, _, _ = _layers(self.stock)
        d, dt = cfg.d_model, cfg.compute_dtype
        init, proj_init = nn.initializers.normal(cfg.init_std), nn.initializers.normal(cfg.proj_init_std)
        h, x = add_norm(LayerNorm(epsilon=cfg.norm_eps, dtype=dt, name="ln1"), x, pending)
        qkv = Dense(3 * d, dtype=dt, kernel_init=init, name="qkv")(h, **qkv_split(cfg.split_qkv and not self.stock))
        a = causal_attention(qkv, cfg.n_heads)
        pending = Dense(d, dtype=dt, kernel_init=proj_init, name="attn_out")(a)
        h, x = LayerNorm(epsilon=cfg.norm_eps, dtype=dt, name="ln2")(pending, residual=x)
        mlp = MLP(cfg.d_mlp, d, dtype=dt, kernel_init=init, out_kernel_init=proj_init, name="mlp")
        return x, mlp(h)


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
        pending = None
        for i in range(cfg.n_layers):
            x, pending = Block(cfg, self.stock, name=f"blocks_{i}")(x, pending)
        h, _ = add_norm(LayerNorm(epsilon=cfg.norm_eps, dtype=dt, name="ln_f"), x, pending)
        if targets is None:
            return head_logits(h, self.variables["params"]["head"]["kernel"])
        return Head(cfg.vocab_size, use_bias=False, dtype=dt, kernel_init=init, name="head")(h, targets)


def init(config: GPTConfig, key: jax.Array, *, stock: bool = False, abstract: bool = False) -> Functional:
    """Build the model; returns its functional view (params: the ``params`` collection).
    ``abstract``: shapes only (``jax.ShapeDtypeStruct`` leaves), nothing computed."""
    model = GPT(config, stock=stock)
    dummy = jax.ShapeDtypeStruct((1, min(8, config.seq_len)), jnp.int32)
    init_params = lambda k: model.lazy_init(k, dummy, dummy)["params"]
    params = jax.eval_shape(init_params, key) if abstract else jax.jit(init_params)(key)

    def loss(params, inputs, targets):
        return model.apply({"params": params}, inputs, targets)

    def logits(params, inputs):
        return model.apply({"params": params}, inputs)

    return Functional(params=params, loss=loss, logits=logits, model=model, config=config, stock=stock)


__all__ = ["GPT", "Block", "init"]
