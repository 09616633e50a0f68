"""Gradient check: every op of ``cutelayers.ops`` against ``jax.grad`` of a plain jnp formula.

    python examples/gradient_check.py [--seed S] [--quick] [--op NAME ...]

For each op, variant and dtype (bfloat16, float16, float32) the script draws fresh random inputs,
differentiates ``sum(op(inputs) * w)`` (w a random cotangent) with respect to every float input,
and does the same for the formula written below, evaluated in float32 on the same input values.
Each gradient's error is ‖ours − reference‖ / ‖reference‖; a row passes when the largest of them
is within the dtype's tolerance (NaN fails). Exit status 1 if any row fails, or if an op that
``cutelayers.ops`` exports has no case here.

On a Hopper GPU the ops run their CuTe kernels; elsewhere their jnp reference path. The formulas
here are the script's own either way. All float32 matmuls run at full float32 precision
(``jax.default_matmul_precision``), so the float32 rows check float32 math, not TF32.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import sys
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import cutelayers as cl

F32 = jnp.float32
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Normwise relative error allowed per dtype: the gradients come out rounded to the inputs' dtype
# and the output's cotangent to the output's, so bfloat16 (8 significant bits) and float16 (11)
# typically show 2-3e-3 and 2-4e-4; these bounds leave a margin of about 5x for the kernels.
TOLERANCE = {"bfloat16": 1.5e-2, "float16": 2e-3, "float32": 2e-5}
IGNORE = -100  # ignore_index of the cross-entropy cases


# --- the reference formulas (inputs already float32) ----------------------------------------------

def ref_reduce_sum(x):
    return jnp.sum(x, axis=-1)


def ref_reduce_mean(x):
    return jnp.sum(x, axis=-1) / x.shape[-1]


def ref_reduce_max(x):
    return jnp.max(x, axis=-1)  # jax.grad splits the cotangent between ties, as the op promises


def ref_layer_norm(x, scale, bias, eps=1e-6):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * jnp.broadcast_to(scale, x.shape) + jnp.broadcast_to(bias, x.shape)


def ref_rms_norm(x, scale, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * jnp.broadcast_to(scale, x.shape)


def ref_add_norm(norm):
    """The reference of a fused residual add + norm: (norm(x + residual), x + residual) side by
    side, so the gradient flows through both results."""
    def ref(x, residual, **params):
        summed = x + residual
        return jnp.concatenate([norm(summed, **params), summed], axis=-1)
    return ref


def both_results(add_norm):
    """``add_norm``'s (normed, summed) side by side, as :func:`ref_add_norm` gives them."""
    return lambda **inputs: jnp.concatenate(add_norm(**inputs), axis=-1)


def ref_logsumexp(x):
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))  # any shift is exact
    return (m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))[..., 0]


def ref_log_softmax(x):
    return x - ref_logsumexp(x)[..., None]


def ref_softmax(x):
    return jnp.exp(ref_log_softmax(x))


def ref_cross_entropy(logits, labels, ignore_index=None, label_smoothing=0.0, z_loss=0.0):
    """Per-row loss against smoothed one-hot targets (as optax.smooth_labels), plus z-loss."""
    v = logits.shape[-1]
    ignored = labels == ignore_index if ignore_index is not None else jnp.zeros(labels.shape, bool)
    onehot = jax.nn.one_hot(jnp.where(ignored, 0, labels), v)
    targets = (1.0 - label_smoothing) * onehot + label_smoothing / v
    loss = -jnp.sum(targets * ref_log_softmax(logits), axis=-1) + z_loss * ref_logsumexp(logits) ** 2
    return jnp.where(ignored, 0.0, loss)


def ref_linear(x, kernel, bias=None, residual=None, activation=None):
    y = x @ kernel
    y = y if bias is None else y + jnp.broadcast_to(bias, y.shape)
    y = y if activation is None else activation(y)
    return y if residual is None else y + residual


def ref_mlp(x, w1, b1, w2, b2, residual, activation):
    return ref_linear(activation(ref_linear(x, w1, b1)), w2, b2, residual)


def ref_linear_cross_entropy(h, kernel, bias, labels, ignore_index):
    losses = ref_cross_entropy(ref_linear(h, kernel, bias), labels, ignore_index)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(labels != ignore_index), 1)


def ref_masked_mean_pool(x, mask):
    keep = mask.astype(F32)
    return jnp.sum(x * keep[..., None], axis=-2) / jnp.maximum(jnp.sum(keep, axis=-1), 1.0)[..., None]


def ref_embed(table, ids):
    return jnp.take(table, ids, axis=0)


# --- the cases -------------------------------------------------------------------------------------

@dataclasses.dataclass
class Case:
    op: str  # the name in cutelayers.ops
    variant: str
    ours: Callable  # keyword arguments named as in ``inputs`` -> output
    reference: Callable  # the same, given the inputs in float32
    inputs: dict  # argument name -> array; each gets a gradient


def cases(rng: np.random.Generator, dtype, quick: bool):
    """Every case for one dtype, on fresh random inputs. GEMM sizes are multiples of 8 (the
    kernels' alignment); row lengths are odd (partial tiles)."""
    lead, n = ((3, 5), 257) if quick else ((4, 37), 1000)
    tokens, hidden, out, vocab = (24, 32, 48, 200) if quick else (96, 64, 96, 1000)

    def normal(*shape, scale=1.0, loc=0.0):
        return jnp.asarray(rng.standard_normal(shape) * scale + loc, dtype)

    def labels(shape, v):
        """Class labels, about a quarter of them IGNORE."""
        return jnp.asarray(np.where(rng.random(shape) < 0.25, IGNORE, rng.integers(0, v, shape)), jnp.int32)

    for op, ref in ((cl.ops.reduce_sum, ref_reduce_sum), (cl.ops.reduce_mean, ref_reduce_mean),
                    (cl.ops.reduce_max, ref_reduce_max), (cl.ops.softmax, ref_softmax),
                    (cl.ops.log_softmax, ref_log_softmax), (cl.ops.logsumexp, ref_logsumexp)):
        yield Case(op.__name__, "", op, ref, {"x": normal(*lead, n)})
    yield Case("layer_norm", "scale, bias; x of mean 3", cl.ops.layer_norm, ref_layer_norm,
               {"x": normal(*lead, n, scale=2.0, loc=3.0), "scale": normal(n), "bias": normal(n)})
    yield Case("rms_norm", "scale", cl.ops.rms_norm, ref_rms_norm,
               {"x": normal(*lead, n), "scale": normal(n)})
    yield Case("add_layer_norm", "scale, bias; normed and summed", both_results(cl.ops.add_layer_norm),
               ref_add_norm(ref_layer_norm), {"x": normal(*lead, n), "residual": normal(*lead, n, scale=2.0, loc=3.0),
                                              "scale": normal(n), "bias": normal(n)})
    yield Case("add_rms_norm", "scale; normed and summed", both_results(cl.ops.add_rms_norm),
               ref_add_norm(ref_rms_norm), {"x": normal(*lead, n), "residual": normal(*lead, n), "scale": normal(n)})

    plain = jnp.asarray(rng.integers(0, n, lead), jnp.int32)
    yield Case("softmax_cross_entropy", "", partial(cl.ops.softmax_cross_entropy, labels=plain),
               partial(ref_cross_entropy, labels=plain), {"logits": normal(*lead, n, scale=3.0)})
    options = {"labels": labels(lead, n), "ignore_index": IGNORE, "label_smoothing": 0.1, "z_loss": 1e-2}
    yield Case("softmax_cross_entropy", "ignore_index, label_smoothing, z_loss",
               partial(cl.ops.softmax_cross_entropy, **options), partial(ref_cross_entropy, **options),
               {"logits": normal(*lead, n, scale=3.0)})

    for activation, function, extras in (("gelu", jax.nn.gelu, ("bias",)),
                                         ("relu", jax.nn.relu, ("bias", "residual")),
                                         ("silu", jax.nn.silu, ("residual",))):
        inputs = {"x": normal(2, tokens // 2, hidden), "kernel": normal(hidden, out, scale=hidden**-0.5),
                  "bias": normal(out), "residual": normal(2, tokens // 2, out)}
        yield Case("fused_linear", ", ".join((activation, *extras)),
                   partial(cl.ops.fused_linear, activation=activation),
                   partial(ref_linear, activation=function),
                   {k: v for k, v in inputs.items() if k in ("x", "kernel", *extras)})

    def split_parts(**inputs):  # the three parts side by side: one output to weigh
        return jnp.concatenate(cl.ops.split_linear(**inputs, parts=3), axis=-1)

    yield Case("split_linear", "bias, parts=3", split_parts, ref_linear,
               {"x": normal(2, tokens // 2, hidden), "kernel": normal(hidden, 3 * out, scale=hidden**-0.5),
                "bias": normal(3 * out)})

    yield Case("mlp", "gelu, biases, residual", partial(cl.ops.mlp, activation="gelu"),
               partial(ref_mlp, activation=jax.nn.gelu),
               {"x": normal(2, tokens // 2, hidden), "w1": normal(hidden, out, scale=hidden**-0.5), "b1": normal(out),
                "w2": normal(out, hidden, scale=out**-0.5), "b2": normal(hidden),
                "residual": normal(2, tokens // 2, hidden)})

    options = {"labels": labels((tokens,), vocab), "ignore_index": IGNORE}
    yield Case("linear_cross_entropy", f"bias, ignore_index, chunk_size={tokens // 5}",
               partial(cl.ops.linear_cross_entropy, chunk_size=tokens // 5, **options),
               partial(ref_linear_cross_entropy, **options),
               {"h": normal(tokens, hidden), "kernel": normal(hidden, vocab, scale=hidden**-0.5),
                "bias": normal(vocab)})

    mask = rng.random((*lead, 19)) < 0.6
    mask[0, 0] = False  # a row that keeps nothing: output 0, gradient 0
    mask = jnp.asarray(mask)
    yield Case("masked_mean_pool", "one empty row", partial(cl.ops.masked_mean_pool, mask=mask),
               partial(ref_masked_mean_pool, mask=mask), {"x": normal(*lead, 19, 24)})

    ids = np.where(rng.random(lead) < 0.5, 3, rng.integers(-vocab, vocab, lead))  # id 3: half the tokens
    yield Case("embed", "repeated and negative ids", partial(cl.ops.embed, ids=jnp.asarray(ids, jnp.int32)),
               partial(ref_embed, ids=jnp.asarray(ids, jnp.int32)), {"table": normal(vocab, hidden)})


# --- the check -------------------------------------------------------------------------------------

def gradients(fn, inputs: dict, cotangent) -> dict:
    """d/d inputs of sum(fn(**inputs) * cotangent), the output taken in float32."""
    def weighted(inputs):
        return jnp.sum(fn(**inputs).astype(F32) * cotangent)
    return jax.jit(jax.grad(weighted))(inputs)


def relative_error(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), np.finfo(np.float32).tiny))


def check(case: Case, rng: np.random.Generator) -> dict:
    """One table row: each gradient's relative error, the largest, the tolerance, pass/fail."""
    first = next(iter(case.inputs.values()))
    dtype = jnp.dtype(first.dtype).name
    out = jax.eval_shape(lambda inputs: case.ours(**inputs), case.inputs)
    cotangent = jnp.asarray(rng.standard_normal(out.shape), F32)
    ours = gradients(case.ours, case.inputs, cotangent)
    ref = gradients(case.reference, {k: v.astype(F32) for k, v in case.inputs.items()}, cotangent)
    errors = {f"d{k}": relative_error(jnp.asarray(ours[k], F32), ref[k]) for k in case.inputs}
    worst = float(np.max(list(errors.values())))  # NaN if any is (Python's max would skip it)
    ok = worst <= TOLERANCE[dtype]  # NaN compares False: fails
    return {"op": case.op, "variant": case.variant, "dtype": dtype, "shape": str(first.shape),
            "grads": " ".join(f"{k}={e:.1e}" for k, e in errors.items()), "max": worst, "tol": TOLERANCE[dtype],
            "ok": "ok" if ok else "FAIL"}


def print_table(rows: list[dict]) -> None:
    columns = ("op", "variant", "dtype", "shape", "grads", "max", "tol", "ok")
    text = [[f"{r[c]:.1e}" if c in ("max", "tol") else str(r[c]) or "-" for c in columns] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(columns)]
    for line in (columns, ["-" * w for w in widths], *text):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="numpy seed of the inputs (default: fresh)")
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--op", nargs="+", choices=cl.ops.__all__, default=cl.ops.__all__, metavar="OP",
                        help=f"check only these ops (default: all of {', '.join(cl.ops.__all__)})")
    args = parser.parse_args(argv)
    seed = secrets.randbits(32) if args.seed is None else args.seed
    rng = np.random.default_rng(seed)
    print(f"seed {seed}; JAX platform {jax.default_backend()}; cutelayers backend {cl.current_backend()}")

    with jax.default_matmul_precision("float32"):
        rows = [check(case, rng) for dtype in DTYPES for case in cases(rng, dtype, args.quick)
                if case.op in args.op]
    print_table(rows)
    failed = [r for r in rows if r["ok"] != "ok"]
    missing = sorted(set(args.op) - {r["op"] for r in rows})
    if missing:
        print(f"no gradient case for: {', '.join(missing)}")
    print(f"{len(rows) - len(failed)} of {len(rows)} rows within tolerance")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
