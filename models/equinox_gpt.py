"""GPT (decoder-only transformer) in Equinox, built from cutelayers layers -- or, with
``stock=True``, from Equinox's own layers with the same parameter tree.

The forward pass is the one :mod:`models.common` describes (the residual add fused into the norms).

Leaves (float32): ``wte.weight``, ``wpe.weight``, ``blocks[i].{ln1,ln2}.{weight,bias}``,
``blocks[i].{qkv,attn_out}.{weight,bias}``, ``blocks[i].mlp.{fc1,fc2}.{weight,bias}`` (weights
(out, in) as in ``eqx.nn.Linear``), ``ln_f.{weight,bias}``, ``head.weight`` (vocab, d_model; None
when tied, the head reading ``wte.weight``) -- in both twins (the stock twin's MLP has two ``eqx.nn.Linear`` fields ``fc1``,
``fc2``); ``wpe`` None with rotary positions, biases None without ``config.bias`` or in an RMSNorm.

Two choices:

* Batching. ``model(inputs, targets)`` takes (seq,) or (batch, seq) tokens and calls every
  per-example layer (the library's ``Linear``, ``MLP`` and ``LayerNorm``, as a user would) under
  one ``jax.vmap`` over all rows: the ops fold the vmap into rows, so each linear layer (and each
  of the MLP's two) is one GEMM forward and one GEMM for the weight gradient, and each norm one
  kernel launch. The LM head takes the whole batch (one loss).
* Mixed precision. Equinox layers compute in the promoted dtype of input and parameters, so
  :func:`init`'s loss casts the float32 parameters to the compute dtype before the forward pass
  (the usual Equinox recipe); gradients flow back to the float32 parameters through the cast.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from cutelayers import equinox as cl_eqx
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


def _residual_call(norm, x, residual):
    """A stock Equinox norm's call with cutelayers' ``residual=``, unfused."""
    if residual is None:
        return norm(x)
    summed = residual + x
    return norm(summed), summed


class _StockLayerNorm(eqx.nn.LayerNorm):
    """Equinox's LayerNorm with the call of cutelayers' (``residual=``), unfused."""

    def __call__(self, x, *, residual=None, key=None):
        return _residual_call(super().__call__, x, residual)


class _StockRMSNorm(eqx.nn.RMSNorm):
    """Equinox's RMSNorm with the call of cutelayers' (``residual=``), unfused."""

    def __call__(self, x, *, residual=None, key=None):
        return _residual_call(super().__call__, x, residual)


class _StockMLP(eqx.Module):
    """Two Equinox Linears, ``fc1`` and ``fc2``, with the constructor and call of cutelayers' MLP
    (as the GPT uses it): ``fc2(act(fc1(x)))``, unfused (:func:`models.common.stock_mlp_hidden`)."""

    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    activation: str = eqx.field(static=True)

    def __init__(self, in_features, hidden_features, out_features, use_bias=True, *, activation, key):
        k1, k2 = jax.random.split(key)
        self.fc1 = eqx.nn.Linear(in_features, fc1_features(activation, hidden_features), use_bias, key=k1)
        self.fc2 = eqx.nn.Linear(hidden_features, out_features, use_bias, key=k2)
        self.activation = activation

    def __call__(self, x, *, key=None):
        return self.fc2(stock_mlp_hidden(self.fc1(x), self.activation))


class _StockHead(eqx.nn.Linear):
    """Equinox's Linear as an LM head with the call of cutelayers' LMHead: ``head(h, targets)`` ->
    mean cross-entropy (optax, on materialised float32 logits)."""

    def __call__(self, h, targets, *, key=None):
        return cross_entropy(_on_rows(super().__call__, h), targets)


class _StockTiedHead(eqx.Module):
    """The stock twin's tied LM head: ``head(h, targets, embedding=table)`` -> mean cross-entropy of
    ``h @ table.T`` (optax, on materialised float32 logits). Its ``weight`` and ``bias`` are None,
    as in cutelayers' tied LMHead: the twins' parameter trees then match node for node (Orbax
    compares the None nodes too), so a checkpoint moves between them."""

    weight: None = None
    bias: None = None

    def __call__(self, h, targets, *, embedding, key=None):
        return cross_entropy(h @ embedding.T, targets)


def _layers(stock: bool):
    """(Linear, MLP, LM head, token Embedding) classes of the stock twin or of the cutelayers
    model."""
    if stock:
        return eqx.nn.Linear, _StockMLP, _StockHead, eqx.nn.Embedding
    return cl_eqx.Linear, cl_eqx.MLP, cl_eqx.LMHead, cl_eqx.Embedding


def _norm(config: GPTConfig, stock: bool):
    """A norm of the config's kind (LayerNorm, RMSNorm) over d_model, stock or cutelayers'."""
    if config.norm == "rms":
        Norm = _StockRMSNorm if stock else cl_eqx.RMSNorm
    else:
        Norm = _StockLayerNorm if stock else cl_eqx.LayerNorm
    return Norm(config.d_model, eps=config.norm_eps, use_bias=config.norm_bias)


def _gpt2_init(layer, std, key):
    """``layer`` (a Linear) with GPT-2's init: weight ~ N(0, std^2), bias zero."""
    weight = std * jax.random.normal(key, layer.weight.shape, layer.weight.dtype)
    layer = eqx.tree_at(lambda l: l.weight, layer, weight)
    if layer.bias is not None:
        layer = eqx.tree_at(lambda l: l.bias, layer, jnp.zeros_like(layer.bias))
    return layer


def _linear(Linear, n_in, n_out, std, key, **kwargs):
    """A Linear with GPT-2's init (:func:`_gpt2_init`)."""
    init_key, key = jax.random.split(key)
    return _gpt2_init(Linear(n_in, n_out, key=init_key, **kwargs), std, key)


def _mlp(MLP, config: GPTConfig, key):
    """The config's MLP d -> d_mlp -> d with GPT-2's init: init_std for fc1, the scaled
    proj_init_std for fc2 (it writes into the residual stream)."""
    init_key, k1, k2 = jax.random.split(key, 3)
    d, std, proj_std = config.d_model, config.init_std, config.proj_init_std
    mlp = MLP(d, config.d_mlp, d, config.bias, activation=config.activation, key=init_key)
    return eqx.tree_at(lambda m: (m.fc1, m.fc2), mlp,
                       (_gpt2_init(mlp.fc1, std, k1), _gpt2_init(mlp.fc2, proj_std, k2)))


def _on_rows(layer, x, residual=None):
    """Apply a per-example layer (a linear layer, an MLP; a norm, with an optional ``residual``:
    then two results) to every row of x (..., features) with one vmap."""
    rows = lambda a: a.reshape(-1, a.shape[-1])
    if residual is None:
        y = jax.vmap(layer)(rows(x))
    else:
        y = jax.vmap(lambda a, r: layer(a, residual=r))(rows(x), rows(residual))
    return jax.tree.map(lambda a: a.reshape(*x.shape[:-1], a.shape[-1]), y)


class Block(eqx.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual.
    ``block(x, pending) -> (x, pending)``: the residual stream and the output not yet added to it
    (module docstring)."""

    ln1: eqx.Module
    qkv: eqx.Module
    attn_out: eqx.Module
    ln2: eqx.Module
    mlp: eqx.Module
    config: GPTConfig = eqx.field(static=True)
    split_qkv: bool = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, stock: bool, key: jax.Array):
        Linear, MLP, _, _ = _layers(stock)
        d, std, proj_std = config.d_model, config.init_std, config.proj_init_std
        k = jax.random.split(key, 3)
        self.config = config
        self.split_qkv = config.splits_qkv and not stock
        self.ln1 = _norm(config, stock)
        self.qkv = _linear(Linear, d, config.qkv_features, std, k[0], use_bias=config.bias)
        self.attn_out = _linear(Linear, d, d, proj_std, k[1], use_bias=config.bias)
        self.ln2 = _norm(config, stock)
        self.mlp = _mlp(MLP, config, k[2])

    def __call__(self, x, pending=None):
        h, x = add_norm(functools.partial(_on_rows, self.ln1), x, pending)
        qkv = _on_rows(functools.partial(self.qkv, **qkv_split(self.split_qkv)), h)
        pending = _on_rows(self.attn_out, causal_attention(qkv, self.config))
        h, x = _on_rows(self.ln2, pending, residual=x)
        return x, _on_rows(self.mlp, h)


class GPT(eqx.Module):
    """``GPT(config, stock=False, key=...)``; ``model(inputs, targets)`` -> mean loss (float32).

    ``inputs`` / ``targets``: (seq,) or (batch, seq) integer token ids, seq <= config.seq_len.
    """

    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding | None
    blocks: list
    ln_f: eqx.Module
    head: eqx.Module
    config: GPTConfig = eqx.field(static=True)
    stock: bool = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, stock: bool = False, key: jax.Array):
        _, _, Head, Embedding = _layers(stock)
        d, std = config.d_model, config.init_std
        k_wte, k_wpe, k_head, *k_blocks = jax.random.split(key, 3 + config.n_layers)
        self.config, self.stock = config, stock
        self.wte = Embedding(weight=std * jax.random.normal(k_wte, (config.vocab_size, d)))
        self.wpe = None if config.rope else eqx.nn.Embedding(
            weight=std * jax.random.normal(k_wpe, (config.seq_len, d)))
        self.blocks = [Block(config, stock=stock, key=k) for k in k_blocks]
        self.ln_f = _norm(config, stock)
        if not config.tie_embeddings:
            self.head = _linear(Head, d, config.vocab_size, std, k_head, use_bias=False)
        elif stock:
            self.head = _StockTiedHead()
        else:  # an LMHead without a weight, given wte's table at each call
            self.head = Head(d, config.vocab_size, use_bias=False, tie_embedding=True, key=k_head)

    def hidden(self, inputs):
        """The final hidden states (..., seq, d_model): the head's input."""
        tokens = jax.vmap(self.wte)(inputs.reshape(-1)).reshape(*inputs.shape, -1)  # one lookup of all ids
        at = positions(inputs, self.config)
        x, pending = (tokens if self.wpe is None else tokens + self.wpe.weight[at]), None
        policy = block_remat_policy(self.config, self.stock)
        run = lambda block, x, pending: block(x, pending)
        if policy is not None:
            run = eqx.filter_checkpoint(run, policy=policy)
        for block in self.blocks:
            x, pending = run(block, x, pending)
        return add_norm(functools.partial(_on_rows, self.ln_f), x, pending)[0]

    def __call__(self, inputs, targets):
        h = self.hidden(inputs)
        if not self.config.tie_embeddings:
            return self.head(h, targets)
        return self.head(h, targets, embedding=self.wte.weight)

    def logits(self, inputs):
        table = self.wte.weight if self.config.tie_embeddings else self.head.weight
        return head_logits(self.hidden(inputs), table.T)


def _is_float_leaf(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(x.dtype, jnp.inexact)


def init(config: GPTConfig, key: jax.Array, *, stock: bool = False, abstract: bool = False) -> Functional:
    """Build the model; returns its functional view (params: the model's float arrays, the rest
    of the model -- None there -- static). ``abstract``: shapes only (``jax.ShapeDtypeStruct``
    leaves), nothing computed."""
    model = (eqx.filter_eval_shape if abstract else lambda f, *a, **k: f(*a, **k))(
        GPT, config, stock=stock, key=key)
    params, static = eqx.partition(model, _is_float_leaf)
    dtype = config.compute_dtype

    def compute_model(params):
        params = jax.tree.map(lambda p: p.astype(dtype), params)  # mixed precision: see module docstring
        return eqx.combine(params, static)

    def loss(params, inputs, targets):
        return compute_model(params)(inputs, targets)

    def logits(params, inputs):
        return compute_model(params).logits(inputs)

    return Functional(params=params, loss=loss, logits=logits, model=model, config=config, stock=stock)


__all__ = ["GPT", "Block", "init"]
