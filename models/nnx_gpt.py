"""GPT (decoder-only transformer) in Flax NNX, built from cutelayers layers -- or, with
``stock=True``, from NNX's own layers with the same parameter tree.

The forward pass is the one :mod:`models.common` describes (the residual add fused into the norms).

Parameters (float32): ``wte.embedding``, ``wpe.embedding``, ``blocks[i].{ln1,ln2}.{scale,bias}``,
``blocks[i].{qkv,attn_out}.{kernel,bias}``, ``blocks[i].mlp.{fc1,fc2}.{kernel,bias}``,
``ln_f.{scale,bias}``, ``head.kernel`` (none when tied) -- the names NNX's ``Embed`` /
``LayerNorm`` / ``RMSNorm`` / ``Linear`` use, in both twins (the stock twin's MLP is two
``nnx.Linear`` attributes ``fc1``, ``fc2``); no ``wpe`` with rotary positions, no biases without
``config.bias`` or in an RMSNorm.
"""

from __future__ import annotations

import jax
from flax import nnx

from cutelayers.flax import nnx as cl_nnx
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
    """A stock NNX norm with the call of cutelayers' (``residual=``), unfused."""

    def __call__(self, x, residual=None):
        if residual is None:
            return super().__call__(x)
        summed = residual + x
        return super().__call__(summed), summed


class _StockLayerNorm(_StockResidualNorm, nnx.LayerNorm):
    pass


class _StockRMSNorm(_StockResidualNorm, nnx.RMSNorm):
    pass


class _StockMLP(nnx.Module):
    """Two NNX Linears, ``fc1`` and ``fc2``, with the constructor and call of cutelayers' MLP (as
    the GPT uses it): ``fc2(act(fc1(x)))``, unfused (:func:`models.common.stock_mlp_hidden`)."""

    def __init__(self, in_features, hidden_features, out_features, *, activation, use_bias, dtype, kernel_init,
                 out_kernel_init, rngs):
        shared = {"use_bias": use_bias, "dtype": dtype, "rngs": rngs}
        self.fc1 = nnx.Linear(in_features, fc1_features(activation, hidden_features), kernel_init=kernel_init,
                              **shared)
        self.fc2 = nnx.Linear(hidden_features, out_features, kernel_init=out_kernel_init, **shared)
        self.activation = activation

    def __call__(self, x):
        return self.fc2(stock_mlp_hidden(self.fc1(x), self.activation))


class _StockHead(nnx.Linear):
    """NNX's Linear as an LM head with the call of cutelayers' LMHead: ``head(h, targets)`` -> mean
    cross-entropy (optax, on materialised float32 logits)."""

    def __call__(self, h, targets):
        return cross_entropy(super().__call__(h), targets)


def _layers(stock: bool):
    """(Linear, MLP, LM head, token Embed) classes of the stock twin or of the cutelayers model."""
    if stock:
        return nnx.Linear, _StockMLP, _StockHead, nnx.Embed
    return cl_nnx.Linear, cl_nnx.MLP, cl_nnx.LMHead, cl_nnx.Embed


def _norm(config: GPTConfig, stock: bool, rngs: nnx.Rngs):
    """A norm of the config's kind (LayerNorm, RMSNorm) over d_model, stock or cutelayers'."""
    options = {"epsilon": config.norm_eps, "dtype": config.compute_dtype, "rngs": rngs}
    if config.norm == "rms":
        return (_StockRMSNorm if stock else cl_nnx.RMSNorm)(config.d_model, **options)
    return (_StockLayerNorm if stock else cl_nnx.LayerNorm)(config.d_model, use_bias=config.bias, **options)


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual.
    ``block(x, pending) -> (x, pending)``: the residual stream and the output not yet added to it
    (module docstring)."""

    def __init__(self, config: GPTConfig, *, stock: bool, rngs: nnx.Rngs):
        Linear, MLP, _, _ = _layers(stock)
        d, dt = config.d_model, config.compute_dtype
        init = nnx.initializers.normal(config.init_std)
        proj_init = nnx.initializers.normal(config.proj_init_std)
        linear = {"use_bias": config.bias, "dtype": dt, "rngs": rngs}
        self.config = config
        self.split_qkv = config.splits_qkv and not stock
        self.ln1 = _norm(config, stock, rngs)
        self.qkv = Linear(d, config.qkv_features, kernel_init=init, **linear)
        self.attn_out = Linear(d, d, kernel_init=proj_init, **linear)
        self.ln2 = _norm(config, stock, rngs)
        self.mlp = MLP(d, config.d_mlp, d, activation=config.activation, kernel_init=init, out_kernel_init=proj_init,
                       **linear)

    def __call__(self, x, pending=None):
        h, x = add_norm(self.ln1, x, pending)
        qkv = self.qkv(h, **qkv_split(self.split_qkv))
        h, x = self.ln2(self.attn_out(causal_attention(qkv, self.config)), residual=x)
        return x, self.mlp(h)


class GPT(nnx.Module):
    """``GPT(config, stock=False, rngs=...)``; ``model(inputs, targets)`` -> mean loss (float32).

    ``inputs`` / ``targets``: (batch, seq) integer token ids, seq <= config.seq_len.
    """

    def __init__(self, config: GPTConfig, *, stock: bool = False, rngs: nnx.Rngs):
        _, _, Head, Embed = _layers(stock)
        dt, init = config.compute_dtype, nnx.initializers.normal(config.init_std)
        self.config = config
        self.remat_policy = block_remat_policy(config, stock)
        self.wte = Embed(config.vocab_size, config.d_model, dtype=dt, embedding_init=init, rngs=rngs)
        if not config.rope:
            self.wpe = nnx.Embed(config.seq_len, config.d_model, dtype=dt, embedding_init=init, rngs=rngs)
        self.blocks = nnx.List([Block(config, stock=stock, rngs=rngs) for _ in range(config.n_layers)])
        self.ln_f = _norm(config, stock, rngs)
        if not config.tie_embeddings:
            self.head = Head(config.d_model, config.vocab_size, use_bias=False, dtype=dt, kernel_init=init,
                             rngs=rngs)
        else:  # ours: an LMHead without a kernel, given wte's table; the stock twin: Embed.attend
            self.head = None if stock else Head(config.d_model, config.vocab_size, use_bias=False, dtype=dt,
                                                tie_embedding=True, rngs=rngs)

    def hidden(self, inputs):
        """The final hidden states (batch, seq, d_model): the head's input."""
        x, pending = self.wte(inputs), None
        at = positions(inputs, self.config)
        if not self.config.rope:
            x = x + self.wpe(at)
        run = lambda block, x, pending: block(x, pending)
        if self.remat_policy is not None:
            run = nnx.remat(run, policy=self.remat_policy)
        for block in self.blocks:
            x, pending = run(block, x, pending)
        return add_norm(self.ln_f, x, pending)[0]

    def __call__(self, inputs, targets):
        h = self.hidden(inputs)
        if not self.config.tie_embeddings:
            return self.head(h, targets)
        if self.head is None:
            return cross_entropy(self.wte.attend(h), targets)
        return self.head(h, targets, embedding=self.wte.embedding[...])

    def logits(self, inputs):
        kernel = self.wte.embedding[...].T if self.config.tie_embeddings else self.head.kernel[...]
        return head_logits(self.hidden(inputs), kernel)


def init(config: GPTConfig, key: jax.Array, *, stock: bool = False, abstract: bool = False) -> Functional:
    """Build the model; returns its functional view (params: the ``nnx.State`` of its Params).
    ``abstract``: shapes only (``jax.ShapeDtypeStruct`` leaves), nothing computed."""
    make = lambda: GPT(config, stock=stock, rngs=nnx.Rngs(params=key))
    model = nnx.eval_shape(make) if abstract else make()
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, inputs, targets):
        return nnx.merge(graphdef, params)(inputs, targets)

    def logits(params, inputs):
        return nnx.merge(graphdef, params).logits(inputs)

    return Functional(params=params, loss=loss, logits=logits, model=model, config=config, stock=stock)


__all__ = ["GPT", "Block", "init"]
