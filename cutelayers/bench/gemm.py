"""GEMM benchmark: ``python -m cutelayers.bench gemm [--shapes MxKxN ... --epilogue E] [--dtype bfloat16]
[--param-dtype float32] [--parts] [--kernels]``.

Each case is a layer as a transformer uses it -- M x K x N and an epilogue (``plain``: x @ w;
``bias``; ``bias+gelu``; ``bias+residual``; ``bias+qkv``: three equal parts, ``split_linear``) -- timed as ``fused_linear`` forward (2MNK flops) and
forward + backward (6MNK: y, dx, dkernel) next to XLA's jnp version of the same layer and its
VJP, in the same process. TFLOP/s and the fraction of the H100's dense bf16 peak (989 TFLOP/s)
are the floor: a GEMM cannot beat FLOPs / peak. ``--parts`` then times each layer's backward GEMMs
alone; ``--kernels`` lists each layer's forward + backward kernel by kernel, ours and XLA's.
``--param-dtype float32`` gives the layers and blocks float32 parameters (mixed precision, as the
GPT models hold them): XLA's versions cast them to the compute dtype, as Flax's ``promote_dtype``
does, and ours take them as they are (float32 gradients: see ``cutelayers.ops.fused_linear``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench.timing import call_kernels, time_fn
from cutelayers.ops.linear import (
    ACTIVATION_FUNCTIONS,
    fused_linear,
    gated_hidden,
    input_grad_fn,
    is_gated,
    weight_grad_fn,
)
from cutelayers.ops.split_linear import split_linear

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 / fp16
# "bias+qkv": the result as three equal parts (split_linear; XLA: one GEMM, then jnp.split)
EPILOGUES = ("plain", "bias", "bias+gelu", "bias+residual", "bias+qkv")


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    m: int
    k: int
    n: int
    epilogue: str = "plain"


# GPT-2 size (16384 tokens, width 768), Llama-like widths, the large squares, and decode.
LAYERS = (
    Layer("gpt2 qkv", 16384, 768, 2304, "bias"),
    Layer("gpt2 qkv", 16384, 768, 2304, "bias+qkv"),
    Layer("gpt2 attn out", 16384, 768, 768, "bias+residual"),
    Layer("gpt2 fc1", 16384, 768, 3072, "bias+gelu"),
    Layer("gpt2 fc2", 16384, 3072, 768, "bias+residual"),
    Layer("gpt2 lm head chunk", 4096, 768, 50304),  # one 4096-token chunk of linear_cross_entropy
    Layer("square", 8192, 4096, 4096),
    Layer("wide N", 8192, 4096, 16384),
    Layer("wide K", 8192, 16384, 4096),
    Layer("square gelu", 8192, 4096, 4096, "bias+gelu"),
    Layer("up gelu", 8192, 4096, 16384, "bias+gelu"),
    Layer("down gelu", 8192, 16384, 4096, "bias+gelu"),
    Layer("decode", 16, 4096, 4096),
)


def _layer_fns(epilogue: str):
    """(ours, xla) for one epilogue: functions of (x, w, b, r)."""
    activation = "gelu" if epilogue.endswith("gelu") else None
    has_bias, has_residual = epilogue != "plain", epilogue.endswith("residual")
    act = ACTIVATION_FUNCTIONS[activation or "none"]
    if epilogue == "bias+qkv":
        return (lambda x, w, b, r: split_linear(x, w, b, parts=3),
                lambda x, w, b, r: tuple(jnp.split(x @ w.astype(x.dtype) + b.astype(x.dtype)[None, :], 3, axis=-1)))

    def ours(x, w, b, r):
        return fused_linear(x, w, b if has_bias else None, activation=activation,
                            residual=r if has_residual else None)

    def xla(x, w, b, r):
        w, b = w.astype(x.dtype), b.astype(x.dtype)  # float32 parameters: Flax's promote_dtype
        y = x @ w
        y = act(y + b[None, :]) if has_bias else y
        return y + r if has_residual else y

    return ours, xla


@dataclasses.dataclass(frozen=True)
class Block:
    """An MLP block: x (m, k) -> act(x @ w1 + b1) (m, h) -> @ w2 + b2 + residual (m, k)."""

    name: str
    m: int
    k: int
    h: int
    activation: str = "gelu"


BLOCKS = (Block("gpt2 mlp", 16384, 768, 3072), Block("gpt2 mlp", 16384, 768, 3072, "swiglu"),
          Block("llama-width mlp", 8192, 4096, 16384), Block("llama-width mlp", 8192, 4096, 16384, "swiglu"))


def _time_pair(ours, xla, args):
    """(seconds ours, seconds xla): ours traced and compiled under the CuTe backend."""
    with cl.use_backend("cute"):
        t_ours = time_fn(jax.jit(ours), *args)
    return t_ours, time_fn(jax.jit(xla), *args)


def _vjp_of(f):
    def train(*args):  # the output too: a loss needs it, so the forward stays live
        y, pull = jax.vjp(f, *args[:-1])
        return y, pull(args[-1])

    return train


def _result(name, shape, epilogue, dtype, flops, ours, xla, args, dy):
    """One row: forward and forward + backward of ``ours`` and ``xla`` on ``args`` (cotangent dy)."""
    fwd, fwd_xla = _time_pair(ours, xla, args)
    train, train_xla = _time_pair(_vjp_of(ours), _vjp_of(xla), (*args, dy))
    return {
        "layer": name, "shape": shape, "epilogue": epilogue, "dtype": jnp.dtype(dtype).name,
        "fwd_ms": fwd * 1e3, "xla_fwd_ms": fwd_xla * 1e3, "fwd_tflops": flops / fwd / 1e12,
        "xla_fwd_tflops": flops / fwd_xla / 1e12, "fwd_vs_xla": fwd_xla / fwd,
        "train_ms": train * 1e3, "xla_train_ms": train_xla * 1e3, "train_tflops": 3 * flops / train / 1e12,
        "xla_train_tflops": 3 * flops / train_xla / 1e12, "train_vs_xla": train_xla / train,
    }


def bench_mlp(blocks=BLOCKS, dtype=jnp.bfloat16, param_dtype=None) -> list[dict]:
    """Time cutelayers.ops.mlp against XLA's jnp block (same formula) for every block, the
    parameters in ``param_dtype`` (default: ``dtype``). A gated block's w1 is (k, 2h): gate and
    value halves (``cutelayers.ops.mlp``)."""
    results = []
    for block in blocks:
        m, k, h = block.m, block.k, block.h
        gated = is_gated(block.activation)
        w1_width = 2 * h if gated else h
        keys = jax.random.split(jax.random.key(1), 7)
        def normal(key, shape, scale=1.0, as_dtype=dtype):
            return (scale * jax.random.normal(key, shape, jnp.float32)).astype(as_dtype)

        params = param_dtype or dtype
        args = (normal(keys[0], (m, k)), normal(keys[1], (k, w1_width), k**-0.5, params),
                normal(keys[2], (w1_width,), as_dtype=params), normal(keys[3], (h, k), h**-0.5, params),
                normal(keys[4], (k,), as_dtype=params), normal(keys[5], (m, k)))
        hidden = (functools.partial(gated_hidden, activation=block.activation) if gated
                  else ACTIVATION_FUNCTIONS[block.activation])

        def ours(x, w1, b1, w2, b2, r, activation=block.activation):
            return cl.ops.mlp(x, w1, b1, w2, b2, activation=activation, residual=r)

        def xla(x, w1, b1, w2, b2, r, hidden=hidden):
            w1, b1, w2, b2 = (p.astype(x.dtype) for p in (w1, b1, w2, b2))  # Flax's promote_dtype
            return hidden(x @ w1 + b1[None, :]) @ w2 + b2[None, :] + r

        results.append(_result(block.name, f"{m} x {k} -> {h} -> {k}", f"{block.activation} mlp", dtype,
                               (6.0 if gated else 4.0) * m * k * h, ours, xla, args, normal(keys[6], (m, k))))
    return results


def bench_gemm(layers=LAYERS, dtype=jnp.bfloat16, param_dtype=None) -> list[dict]:
    """Time fused_linear against XLA for every layer, the parameters in ``param_dtype`` (default:
    ``dtype``); one dict per layer."""
    results = []
    for layer in layers:
        m, k, n = layer.m, layer.k, layer.n
        args, dy = _layer_args(layer, dtype, param_dtype)
        ours, xla = _layer_fns(layer.epilogue)
        results.append(_result(layer.name, f"{m} x {k} x {n}", layer.epilogue, dtype, 2.0 * m * n * k, ours, xla,
                               args, dy))
    return results


def _layer_operands(layer: Layer, dtype, param_dtype=None):
    """Random normal x (M, K), w (K, N) scaled by K^-1/2, dy (M, N), bias (N,), residual (M, N);
    w and bias in ``param_dtype`` (default: ``dtype``)."""
    m, k, n = layer.m, layer.k, layer.n
    params = param_dtype or dtype
    keys = jax.random.split(jax.random.key(0), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32)
    return (normal(keys[0], (m, k)).astype(dtype), (normal(keys[1], (k, n)) / k**0.5).astype(params),
            normal(keys[2], (m, n)).astype(dtype), normal(keys[3], (n,)).astype(params),
            normal(keys[4], (m, n)).astype(dtype))


def _layer_args(layer: Layer, dtype, param_dtype=None):
    """The layer functions' (x, w, b, r) and the cotangent of their output: dy, or its three
    (M, N / 3) parts for ``bias+qkv``."""
    x, w, dy, b, r = _layer_operands(layer, dtype, param_dtype)
    if layer.epilogue == "bias+qkv":
        dy = tuple(jnp.split(dy, 3, axis=-1))
    return (x, w, b, r), dy


def bench_parts(layers=LAYERS, dtype=jnp.bfloat16) -> list[dict]:
    """Each layer's backward GEMMs alone, next to XLA's: dx = dz @ wᵀ (M x N x K) and
    dkernel = xᵀ @ dz (K x M x N), 2MNK flops each -- which of the three GEMMs a fwd+bwd gap is in."""
    input_grad, weight_grad = input_grad_fn(True), weight_grad_fn(True)
    parts = {
        "dx": (lambda x, w, dz: input_grad(dz, w), lambda x, w, dz: dz @ w.T),
        "dkernel": (lambda x, w, dz: weight_grad(x[None], dz[None])[0],
                    lambda x, w, dz: jnp.einsum("mk,mn->kn", x, dz, preferred_element_type=jnp.float32).astype(x.dtype)),
    }
    results = []
    for layer in layers:
        m, k, n = layer.m, layer.k, layer.n
        x, w, dz = _layer_operands(layer, dtype)[:3]
        flops = 2.0 * m * n * k
        for part, (ours, xla) in parts.items():
            t, t_xla = _time_pair(ours, xla, (x, w, dz))
            results.append({"layer": layer.name, "part": part, "ms": t * 1e3, "xla_ms": t_xla * 1e3,
                                "tflops": flops / t / 1e12, "xla_tflops": flops / t_xla / 1e12, "vs_xla": t_xla / t})
    return results


def bench_kernels(layers=LAYERS, dtype=jnp.bfloat16, param_dtype=None) -> list[dict]:
    """Each layer's forward + backward (the vjp the fwd+bwd column times) kernel by kernel, ours
    and XLA's, in launch order: where a layer's fwd+bwd gap is (a GEMM, a cast, a reduction)."""
    rows = []
    for layer in layers:
        args, dy = _layer_args(layer, dtype, param_dtype)
        for impl, fn in zip(("ours", "XLA"), _layer_fns(layer.epilogue)):
            with cl.use_backend("cute") if impl == "ours" else contextlib.nullcontext():
                kernels = call_kernels(jax.jit(_vjp_of(fn)), *args, dy)
            rows += [{"layer": f"{layer.name} ({layer.epilogue})", "impl": impl, "kernel": _short_name(name),
                          "us": t * 1e6} for name, t in kernels]
    return rows


def _short_name(name: str, width: int = 64) -> str:
    """A kernel's name without the CuTe DSL's common prefix, cut to ``width`` characters."""
    return name.removeprefix("kernel_cutlass_kernel_cutelayerskernels")[:width]


def print_kernels(rows: list[dict]) -> None:
    print("| layer | impl | kernel | us |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['impl']} | {r['kernel']} | {r['us']:.1f} |")
    totals = {}
    for r in rows:
        totals[r["layer"], r["impl"]] = totals.get((r["layer"], r["impl"]), 0.0) + r["us"]
    for (layer, impl), us in totals.items():
        print(f"| {layer} | {impl} | total | {us:.1f} |")


def print_parts(results: list[dict]) -> None:
    print(f"| layer | GEMM | ms | XLA ms | TFLOP/s (% of {PEAK_TFLOPS:.0f}) | XLA TFLOP/s | XLA/ours |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layer']} | {r['part']} | {r['ms']:.3f} | {r['xla_ms']:.3f} | {r['tflops']:.0f} "
              f"({100 * r['tflops'] / PEAK_TFLOPS:.0f}%) | {r['xla_tflops']:.0f} | {r['vs_xla']:.2f} |")


def print_table(results: list[dict]) -> None:
    print(f"| layer | shape | epilogue | fwd ms | XLA fwd ms | fwd TFLOP/s (% of {PEAK_TFLOPS:.0f}) | "
          "XLA fwd TFLOP/s | fwd XLA/ours | fwd+bwd ms | XLA fwd+bwd ms | fwd+bwd TFLOP/s (% peak) | "
          "fwd+bwd XLA/ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['layer']} | {r['shape']} | {r['epilogue']} | {r['fwd_ms']:.3f} | "
              f"{r['xla_fwd_ms']:.3f} | {r['fwd_tflops']:.0f} ({100 * r['fwd_tflops'] / PEAK_TFLOPS:.0f}%) | "
              f"{r['xla_fwd_tflops']:.0f} | {r['fwd_vs_xla']:.2f} | {r['train_ms']:.3f} | {r['xla_train_ms']:.3f} | "
              f"{r['train_tflops']:.0f} ({100 * r['train_tflops'] / PEAK_TFLOPS:.0f}%) | {r['train_vs_xla']:.2f} |")


def parse_shape(text: str) -> tuple[int, int, int]:
    """'MxKxN' -> (M, K, N)."""
    m, k, n = (int(v) for v in text.lower().split("x"))
    return m, k, n


def layers_from_args(shapes, epilogue: str) -> tuple[Layer, ...]:
    """The benchmark's layers: ``LAYERS``, or the given shapes with one epilogue."""
    if not shapes:
        return LAYERS
    if epilogue not in EPILOGUES:
        raise ValueError(f"--epilogue must be one of {EPILOGUES}; got {epilogue!r}")
    return tuple(Layer(f"{m}x{k}x{n}", m, k, n, epilogue) for m, k, n in shapes)
