"""What the three GPT implementations share: the attention core, the functional view the training
loop uses, and moving parameters between a model and its stock twin.

Each framework file (``nnx_gpt``, ``linen_gpt``, ``equinox_gpt``) builds its model from its own
framework's modules and exposes ``init(config, key, *, stock=False) -> Functional``:

* ``params`` -- the parameters, a pytree of float32 arrays (an ``nnx.State``, a linen params dict,
  or the array leaves of the Equinox model);
* ``loss(params, inputs, targets)`` -- mean next-token cross-entropy, a pure function (jit it);
* ``logits(params, inputs)`` -- float32 next-token logits (batch, seq, vocab), for sampling;
* ``model`` -- the framework object itself.

The forward pass of all three (the ``mlp`` line is one cutelayers ``MLP``: fc2(gelu(fc1(.))), or
with SwiGLU fc2(silu(gate) * value); ``norm`` a LayerNorm or an RMSNorm; ``wpe`` only without
rotary positions, which ``attention`` then applies to q and k -- :class:`GPTConfig`'s options):

    x, pending = wte(tokens) + wpe(positions), None
    per block:  h, x = ln1(pending, residual=x)        # x += pending; h = norm(x): one kernel
                pending = attn_out(attention(qkv(h)))
                h, x = ln2(pending, residual=x)
                pending = mlp(h)
    loss = head(ln_f(pending, residual=x)[0], targets)   # LMHead: linear + cross-entropy, no logits
                                                         # (tied: wte's table as its weight)

(:func:`add_norm`: the first ln1 has nothing pending.)

``stock=True`` builds the twin from the framework's own layers (Dense / Linear / LayerNorm /
RMSNorm; two Dense / Linear layers where ours has cutelayers' ``MLP``; a Dense / Linear head --
tied, the embedding's table -- with ``optax`` cross-entropy where ours has cutelayers' ``LMHead``)
with the same parameter tree: the same key paths, shapes and dtypes, so a checkpoint of one loads
into the other (:func:`transfer_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import cutelayers
from models.configs import GPTConfig

FRAMEWORKS = ("nnx", "linen", "equinox")
logger = logging.getLogger("models")


@dataclasses.dataclass(frozen=True)
class Functional:
    """A model as (parameters, pure loss function); see the module docstring."""

    params: Any
    loss: Callable[[Any, jax.Array, jax.Array], jax.Array]
    logits: Callable[[Any, jax.Array], jax.Array]
    model: Any
    config: GPTConfig
    stock: bool


def load(framework: str):
    """The module implementing ``framework`` ('nnx', 'linen' or 'equinox')."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    return importlib.import_module(f"models.{framework}_gpt")


def init(framework: str, config: GPTConfig, key: jax.Array, *, stock: bool = False,
         abstract: bool = False) -> Functional:
    """Build the GPT of ``framework`` (cutelayers layers, or the stock twin) and its parameters
    (``abstract``: their shapes and dtypes only, as ``jax.ShapeDtypeStruct``; nothing computed)."""
    return load(framework).init(config, key, stock=stock, abstract=abstract)


ATTENTION_DTYPES = ("bfloat16", "float16")  # what cuDNN's fused attention takes


def attention_implementation(dtype, head_dim: int) -> str:
    """``"cudnn"`` or ``"xla"``: which ``jax.nn.dot_product_attention`` implementation the GPTs (both
    twins) use for attention of ``dtype`` and ``head_dim``, decided once per (dtype, head dim) and
    logged once.

    cuDNN's fused (flash) attention serves where JAX's default device is an NVIDIA GPU of compute
    capability >= 8.0, the dtype is bfloat16 / float16 and the head dim is a multiple of 8 of at
    most 128 (256 on Hopper and later) -- the conditions ``jax.nn.dot_product_attention`` checks
    before it refuses. Everywhere else (float32, odd head dims, CPU -- also when lowering for CUDA
    on a CPU-only host, where JAX cannot build the cuDNN call) XLA's attention runs.
    """
    return _attention_choice(jnp.dtype(dtype).name, int(head_dim), _cuda_compute_capability())


def _cuda_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of JAX's default device if it is a CUDA GPU, else None."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return None
    major, minor = (int(part) for part in str(capability).split(".")[:2])
    return major, minor


@functools.cache  # one decision (and one log line) per distinct input
def _attention_choice(dtype: str, head_dim: int, capability: tuple[int, int] | None) -> str:
    max_head_dim = 256 if capability is not None and capability >= (9, 0) else 128
    if capability is None or capability < (8, 0):
        why = f"no CUDA GPU of compute capability >= 8.0 (default device: {jax.devices()[0].device_kind})"
    elif dtype not in ATTENTION_DTYPES:
        why = f"dtype {dtype}; cuDNN attention takes {' or '.join(ATTENTION_DTYPES)}"
    elif head_dim % 8 or head_dim > max_head_dim:
        why = f"head dim {head_dim}; cuDNN attention takes multiples of 8 up to {max_head_dim}"
    else:
        logger.info("attention: cuDNN fused attention (%s, head dim %d)", dtype, head_dim)
        return "cudnn"
    logger.info("attention: XLA (%s)", why)
    return "xla"


def qkv_split(split: bool) -> dict:
    """The qkv projection's call keywords: one (..., T, qkv_features) array (the stock layers, or
    ``GPTConfig.splits_qkv`` off), or, with ``split``, q, k and v as three arrays (``parts=3``:
    :func:`cutelayers.ops.split_linear`, which never slices a fused result or concatenates dq,
    dk, dv)."""
    return {"parts": 3} if split else {}


def causal_attention(qkv, config: GPTConfig) -> jax.Array:
    """Causal self-attention core of ``config``'s heads (``n_heads`` of queries, ``kv_heads`` of
    keys and values: grouped-query attention where fewer).

    ``qkv``: (..., T, qkv_features) -- queries, keys and values side by side, as one fused
    projection writes them -- or the tuple (q, k, v) of (..., T, d) arrays (:func:`qkv_split`).
    With rotary positions (``config.rope``), q and k first take positions 0..T-1
    (:func:`rotary`). Returns (..., T, d) in their dtype, computed by cuDNN's fused attention or
    XLA's (:func:`attention_implementation`).
    """
    n_heads, kv_heads, dh = config.n_heads, config.kv_heads, config.head_dim
    *lead, t, _ = (qkv[0] if isinstance(qkv, tuple) else qkv).shape
    heads = lambda a: a.reshape(*lead, t, a.shape[-1] // dh, dh)  # (..., T, heads, Dh)
    if isinstance(qkv, tuple):
        q, k, v = map(heads, qkv)
    elif kv_heads == n_heads:  # as (..., T, 3, H, Dh): the layout a tensor-parallel step gathers whole
        q, k, v = (a.squeeze(-3) for a in jnp.split(qkv.reshape(*lead, t, 3, n_heads, dh), 3, axis=-3))
    else:
        q, k, v = map(heads, jnp.split(qkv, [n_heads * dh, (n_heads + kv_heads) * dh], axis=-1))
    if config.rope:
        q, k = rotary(q, config.rope_theta), rotary(k, config.rope_theta)
    if len(lead) > 1:  # dot_product_attention takes (B, T, H, Dh) or (T, H, Dh)
        q, k, v = (a.reshape(-1, *a.shape[-3:]) for a in (q, k, v))
    implementation = attention_implementation(q.dtype, dh)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    return out.reshape(*lead, t, n_heads * dh)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of queries or keys ``x`` (..., T, H, Dh) at positions t = 0..T-1:
    each head's halves (x1, x2) turned by the angles t * theta^(-2i / Dh), i < Dh / 2 -- (x1 cos -
    x2 sin, x2 cos + x1 sin), Llama's form -- in float32, returned in x's dtype."""
    t, dh = x.shape[-3], x.shape[-1]
    inverse_frequencies = theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inverse_frequencies[None, :]
    angles = angles.reshape((1,) * (x.ndim - 3) + (t, 1, dh // 2))  # over (..., T, H, Dh / 2)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def stock_mlp_hidden(z: jax.Array, activation: str) -> jax.Array:
    """The stock twins' MLP activation of fc1's output ``z``: ``"gelu"`` (jax.nn.gelu's tanh form),
    or ``"swiglu"``, silu(gate) * value of z's halves -- what cutelayers' ``MLP`` fuses."""
    if activation == "swiglu":
        gate, value = jnp.split(z, 2, axis=-1)
        return jax.nn.silu(gate) * value
    return jax.nn.gelu(z)


def add_norm(norm: Callable, x: jax.Array, pending: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """A pre-norm block's residual step: ``(norm(x + pending), x + pending)`` -- or ``(norm(x),
    x)`` when nothing is pending. The GPTs carry each sublayer's output as ``pending`` and let the
    next norm add it to the residual stream ``x``: cutelayers' norms take it as ``residual=`` and
    fuse the add into their kernels (:func:`cutelayers.ops.add_layer_norm`; the backward adds the
    residual stream's gradient in the same kernel), the stock twins add it first."""
    if pending is None:
        return norm(x), x
    return norm(pending, residual=x)


def block_remat_policy(config: GPTConfig, stock: bool) -> Callable | None:
    """The ``jax.checkpoint`` policy each block runs under (``config.remat``), or None: blocks not
    rematerialized. ``"full"`` keeps nothing inside a block (``nothing_saveable``: the backward
    recomputes the whole block from its inputs); ``"dots"`` keeps the matmuls' results
    (``dots_with_no_batch_dims_saveable``), given to the cutelayers model through
    :func:`cutelayers.remat_policy` so that its GEMM kernels are kept as the stock twin's dots
    are (as given, the policy would keep none of them)."""
    if config.remat == "none":
        return None
    if config.remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return dots if stock else cutelayers.remat_policy(dots)


def positions(inputs: jax.Array, config: GPTConfig) -> jax.Array:
    """Position ids 0..seq_len-1 of ``inputs`` (..., seq_len), shaped (1, ..., seq_len) to add to
    its embeddings without rank promotion, after checking the sequence fits ``config.seq_len``
    (the position table's rows; with rotary positions, the longest sequence trained on)."""
    seq_len = inputs.shape[-1]
    if seq_len > config.seq_len:
        raise ValueError(f"sequence length {seq_len} exceeds the model's maximum "
                         f"(config.seq_len={config.seq_len})")
    return jnp.arange(seq_len).reshape((1,) * (inputs.ndim - 1) + (seq_len,))


def tree_signature(params) -> list[tuple[str, tuple[int, ...], str]]:
    """(key path, shape, dtype) of every leaf: what must agree for a checkpoint to move."""
    return [(jax.tree_util.keystr(p), tuple(v.shape), jnp.dtype(v.dtype).name)
            for p, v in jax.tree.leaves_with_path(params)]


def transfer_params(src, like):
    """``src``'s arrays in ``like``'s pytree structure (e.g. stock Equinox parameters into the
    cutelayers model, whose module classes differ). Raises if paths, shapes or dtypes differ."""
    a, b = tree_signature(src), tree_signature(like)
    if a != b:
        diff = next(((x, y) for x, y in zip(a, b) if x != y), (len(a), len(b)))
        raise ValueError(f"parameter trees differ (first difference: {diff[0]} vs {diff[1]})")
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(src))


def head_logits(h: jax.Array, kernel: jax.Array) -> jax.Array:
    """float32 logits of the final hidden states ``h`` (..., d) and the head's (d, vocab) kernel:
    what both twins' heads compute before their loss (sampling needs them, training does not)."""
    return h.astype(jnp.float32) @ kernel.astype(jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """The stock twins' loss: mean ``optax.softmax_cross_entropy_with_integer_labels`` of float32
    logits (the cutelayers models use ``LMHead``: linear + cross-entropy without the logits)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()
