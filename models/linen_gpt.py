"""GPT (decoder-only transformer) in Flax linen, built from cutelayers layers -- or, with
``stock=True``, from linen's own layers with the same parameter tree.

The forward pass is the one :mod:`models.common` describes (the residual add fused into the norms).

Parameters (float32), ``params`` collection: ``wte.embedding``, ``wpe.embedding``,
``blocks_{i}.{ln1,ln2}.{scale,bias}``, ``blocks_{i}.{qkv,attn_out}.{kernel,bias}``,
``blocks_{i}.mlp.{Dense_0,Dense_1}.{kernel,bias}``, ``ln_f.{scale,bias}``, ``head.kernel`` (none
when tied) -- the names linen's ``Embed`` / ``LayerNorm`` / ``RMSNorm`` / ``Dense`` use, in both
twins (the stock twin's MLP is a compact module calling ``nn.Dense`` twice); no ``wpe`` with
rotary positions, no biases without ``config.bias`` or in an RMSNorm.
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
    block_remat_policy,
    causal_attention,
    cross_entropy,
    head_logits,
    positions,
    qkv_split,
    stock_mlp_hidden,
)
from models.configs import GPTConfig, fc1_features


class _StockResidualNorm:
    """A stock linen norm with the call of cutelayers' (``residual=``), unfused."""

    @nn.compact
    def __call__(self, x, residual=None):
        if residual is None:
            return super().__call__(x)
        summed = residual + x
        return super().__call__(summed), summed


class _StockLayerNorm(_StockResidualNorm, nn.LayerNorm):
    pass


class _StockRMSNorm(_StockResidualNorm, nn.RMSNorm):
    pass


class _StockMLP(nn.Module):
    """Two linen Dense layers (``Dense_0``, ``Dense_1``: a compact module's names) with the
    attributes and call of cutelayers' MLP (as the GPT uses it): ``fc2(act(fc1(x)))``, unfused
    (:func:`models.common.stock_mlp_hidden`)."""

    hidden_features: int
    features: int
    activation: str
    use_bias: bool
    dtype: Any
    kernel_init: Any
    out_kernel_init: Any

    @nn.compact
    def __call__(self, x):
        dense = lambda features, init: nn.Dense(features, use_bias=self.use_bias, dtype=self.dtype, kernel_init=init)
        z = dense(fc1_features(self.activation, self.hidden_features), self.kernel_init)(x)
        return dense(self.features, self.out_kernel_init)(stock_mlp_hidden(z, self.activation))


class _StockHead(nn.Dense):
    """linen's Dense as an LM head with the call of cutelayers' LMHead: ``head(h, targets)`` ->
    mean cross-entropy (optax, on materialised float32 logits)."""

    @nn.compact
    def __call__(self, h, targets):
        return cross_entropy(super().__call__(h), targets)


def _layers(stock: bool):
    """(Dense, MLP, LM head, token Embed) classes of the stock twin or of the cutelayers model."""
    if stock:
        return nn.Dense, _StockMLP, _StockHead, nn.Embed
    return cl_linen.Dense, cl_linen.MLP, cl_linen.LMHead, cl_linen.Embed


def _norm(config: GPTConfig, stock: bool, name: str):
    """A norm of the config's kind (LayerNorm, RMSNorm), stock or cutelayers'."""
    options = {"epsilon": config.norm_eps, "dtype": config.compute_dtype, "name": name}
    if config.norm == "rms":
        return (_StockRMSNorm if stock else cl_linen.RMSNorm)(**options)
    return (_StockLayerNorm if stock else cl_linen.LayerNorm)(use_bias=config.bias, **options)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual.
    ``block(x, pending) -> (x, pending)``: the residual stream and the output not yet added to it
    (module docstring)."""

    config: GPTConfig
    stock: bool = False

    @nn.compact
    def __call__(self, x, pending=None):
        cfg = self.config
        Dense, MLP, _, _ = _layers(self.stock)
        d, dt = cfg.d_model, cfg.compute_dtype
        init, proj_init = nn.initializers.normal(cfg.init_std), nn.initializers.normal(cfg.proj_init_std)
        h, x = add_norm(_norm(cfg, self.stock, "ln1"), x, pending)
        qkv = Dense(cfg.qkv_features, use_bias=cfg.bias, dtype=dt, kernel_init=init, name="qkv")(
            h, **qkv_split(cfg.splits_qkv and not self.stock))
        a = causal_attention(qkv, cfg)
        pending = Dense(d, use_bias=cfg.bias, dtype=dt, kernel_init=proj_init, name="attn_out")(a)
        h, x = _norm(cfg, self.stock, "ln2")(pending, residual=x)
        mlp = MLP(cfg.d_mlp, d, activation=cfg.activation, use_bias=cfg.bias, dtype=dt, kernel_init=init,
                  out_kernel_init=proj_init, name="mlp")
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
        _, _, Head, Embed = _layers(self.stock)
        dt, init = cfg.compute_dtype, nn.initializers.normal(cfg.init_std)
        wte = Embed(cfg.vocab_size, cfg.d_model, dtype=dt, embedding_init=init, name="wte")
        x = wte(inputs)
        at = positions(inputs, cfg)
        if not cfg.rope:
            x = x + nn.Embed(cfg.seq_len, cfg.d_model, dtype=dt, embedding_init=init, name="wpe")(at)
        pending = None
        policy = block_remat_policy(cfg, self.stock)
        block = Block if policy is None else nn.remat(Block, policy=policy)
        for i in range(cfg.n_layers):
            x, pending = block(cfg, self.stock, name=f"blocks_{i}")(x, pending)
        h, _ = add_norm(_norm(cfg, self.stock, "ln_f"), x, pending)
        if targets is None:
            return head_logits(h, wte.embedding.T if cfg.tie_embeddings else self.variables["params"]["head"]["kernel"])
        if not cfg.tie_embeddings:
            return Head(cfg.vocab_size, use_bias=False, dtype=dt, kernel_init=init, name="head")(h, targets)
        if self.stock:
            return cross_entropy(wte.attend(h), targets)
        return Head(cfg.vocab_size, use_bias=False, dtype=dt, tie_embedding=True, name="head")(
            h, targets, embedding=wte.embedding)


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
