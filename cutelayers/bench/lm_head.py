"""LM-head benchmark: ``python -m cutelayers.bench lm_head [--tokens --hidden --vocab --dtype
--param-dtype --chunk-size ...]``.

Loss and gradients (h and kernel) of a language-model head, two ways, in the same run:

* ``fused``: :func:`cutelayers.ops.linear_cross_entropy`, chunked over tokens, never holding the
  (T, V) logits;
* ``xla``: the usual unfused head, ``(h @ kernel)`` in h's dtype, cast to float32 logits,
  ``optax.softmax_cross_entropy_with_integer_labels``, mean -- with ``label_smoothing`` a > 0,
  ``optax.softmax_cross_entropy`` against ``optax.smooth_labels`` of the one-hot labels (and the
  fused head's ``label_smoothing=a``).

The kernel is in h's dtype, or in ``param_dtype`` (float32: mixed precision, as a Flax head with
``param_dtype=float32`` holds it): the XLA head then casts it to h's dtype for its GEMM, as Flax's
``promote_dtype`` does, and the fused one takes it as it is. It is (H, V), or with ``kernel_layout``
"vh" a (V, H) table (Equinox's ``Linear`` weight, a tied embedding), which both heads read as
stored (XLA's ``h @ table.T``).

Per head: median time of the jitted value_and_grad -- device time (the kernels' durations) and
wall time per call (calls back to back: it also counts where the device sits idle inside a call,
such as a host sync on a data-dependent loop, or launch gaps) --, and XLA's compile-time memory analysis
(``temp_size_in_bytes``: scratch buffers; arguments and outputs separately), with ratios to the
XLA head. The memory part needs no GPU: :func:`head_memory` lowers for the default device (on CPU
the ops' jnp reference, which chunks the same way). With ``device_peak`` also what the device's
own counter saw: :func:`device_peak_bytes`, each head in a fresh process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

import cutelayers as cl
from cutelayers.bench.timing import time_fn, wall_time

F32 = jnp.float32
GB = 1e9
HEADS = ("fused", "xla")


def xla_head_loss(h, kernel, labels, kernel_layout: str = "hv", label_smoothing: float = 0.0):
    """The unfused head: all (T, V) logits at once, computed in h's dtype."""
    kernel = kernel.astype(h.dtype)
    logits = (h @ (kernel.T if kernel_layout == "vh" else kernel)).astype(F32)
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
        return jnp.mean(optax.softmax_cross_entropy(logits, targets))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def loss_and_grads(head: str, chunk_size: int | None = None, kernel_layout: str = "hv", label_smoothing: float = 0.0):
    """Jitted ``(h, kernel, labels) -> (loss, (dh, dkernel))`` of one of :data:`HEADS`."""
    if head == "fused":
        loss = partial(cl.ops.linear_cross_entropy, chunk_size=chunk_size, kernel_layout=kernel_layout,
                       label_smoothing=label_smoothing)
    else:
        loss = partial(xla_head_loss, kernel_layout=kernel_layout, label_smoothing=label_smoothing)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def kernel_shape(h: int, v: int, kernel_layout: str) -> tuple[int, int]:
    """The kernel's shape: (H, V), or (V, H) for ``kernel_layout`` "vh"."""
    return (v, h) if kernel_layout == "vh" else (h, v)


def head_specs(t: int, h: int, v: int, dtype, param_dtype=None,
               kernel_layout: str = "hv") -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shapes of (h (T, H), kernel (H, V) -- (V, H) for ``kernel_layout`` "vh" -- in
    ``param_dtype`` (default: ``dtype``), labels (T,)): lowering needs no arrays."""
    return (jax.ShapeDtypeStruct((t, h), dtype), jax.ShapeDtypeStruct(kernel_shape(h, v, kernel_layout), param_dtype or dtype),
            jax.ShapeDtypeStruct((t,), jnp.int32))


def compile_head(head: str, args, chunk_size: int | None = None, kernel_layout: str = "hv",
                 label_smoothing: float = 0.0):
    """One head's value_and_grad compiled for ``args`` (arrays or ShapeDtypeStructs), lowered
    under the current cutelayers backend for the default device."""
    return loss_and_grads(head, chunk_size, kernel_layout, label_smoothing).lower(*args).compile()


def memory_stats(compiled) -> dict[str, int]:
    """XLA's memory analysis of a compiled function: temp (scratch), arguments, outputs bytes."""
    stats = compiled.memory_analysis()
    return {"temp": stats.temp_size_in_bytes, "arguments": stats.argument_size_in_bytes,
                "outputs": stats.output_size_in_bytes}


def head_memory(t: int, h: int, v: int, dtype, chunk_size: int | None = None,
                param_dtype=None, kernel_layout: str = "hv") -> dict[str, dict[str, int]]:
    """``{head: memory_stats}`` of each head's value_and_grad, compiled from shapes alone."""
    specs = head_specs(t, h, v, jnp.dtype(dtype), param_dtype, kernel_layout)
    return {head: memory_stats(compile_head(head, specs, chunk_size, kernel_layout)) for head in HEADS}


def head_operands(t: int, h: int, v: int, dtype, seed: int = 0, param_dtype=None, kernel_layout: str = "hv"):
    """Random h, kernel (scaled so the logits are O(1); in ``param_dtype``, default ``dtype``;
    (V, H) for ``kernel_layout`` "vh") and labels."""
    kh, kk, kl = jax.random.split(jax.random.key(seed), 3)
    hidden = jax.random.normal(kh, (t, h), F32).astype(dtype)
    kernel = (jax.random.normal(kk, kernel_shape(h, v, kernel_layout), F32) / np.sqrt(h)).astype(param_dtype or dtype)
    return hidden, kernel, jax.random.randint(kl, (t,), 0, v, jnp.int32)


def device_peak_bytes(head: str, t: int, h: int, v: int, dtype, chunk_size: int | None = None,
                      param_dtype=None, kernel_layout: str = "hv", label_smoothing: float = 0.0,
                      timeout: float = 600.0) -> tuple[int, bool] | None:
    """``(bytes, exact)``: how far one call of a head's value_and_grad raises the device's
    ``peak_bytes_in_use`` above the bytes in use before it (its operands): its temporaries and
    outputs. In a fresh process -- the counter only rises, so every head needs its own --, with the
    operands drawn on the host and XLA's GEMM autotuning off (it allocates on the device), so
    little before the call sets the peak; where something did and the call stayed below it,
    ``exact`` is False and the bytes are an upper bound. None where the device keeps no statistics
    (CPU)."""
    job = {"head": head, "t": t, "h": h, "v": v, "dtype": jnp.dtype(dtype).name, "chunk_size": chunk_size,
           "param_dtype": param_dtype and jnp.dtype(param_dtype).name, "kernel_layout": kernel_layout,
           "label_smoothing": label_smoothing}
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()}
    proc = subprocess.run([sys.executable, "-m", "cutelayers.bench.lm_head", json.dumps(job)], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"device_peak_bytes({head}): the measuring process failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return None if result["peak_rise"] is None else (result["peak_rise"], result["exact"])


def _measure_peak(job: dict) -> dict:
    """:func:`device_peak_bytes`'s measuring process."""
    device = jax.devices()[0]
    if device.memory_stats() is None:
        return {"peak_rise": None}
    t, h, v, layout = job["t"], job["h"], job["v"], job["kernel_layout"]
    dtype, param_dtype = jnp.dtype(job["dtype"]), jnp.dtype(job["param_dtype"] or job["dtype"])
    rng = np.random.default_rng(0)  # drawn and cast on the host: no device temporaries
    hidden = jnp.asarray(rng.standard_normal((t, h), np.float32).astype(dtype))
    kernel = jnp.asarray((rng.standard_normal(kernel_shape(h, v, layout), np.float32) / np.sqrt(h)).astype(param_dtype))
    labels = jnp.asarray(rng.integers(0, v, t, np.int32))
    with cl.use_backend("cute"):
        fn = compile_head(job["head"], (hidden, kernel, labels), job["chunk_size"], layout, job["label_smoothing"])
    jax.block_until_ready((hidden, kernel, labels))
    stats = device.memory_stats()
    before, in_use = stats["peak_bytes_in_use"], stats["bytes_in_use"]
    jax.block_until_ready(fn(hidden, kernel, labels))
    after = device.memory_stats()["peak_bytes_in_use"]
    return {"peak_rise": after - in_use, "exact": after > before}


def bench_lm_head(t: int, h: int, v: int, dtype, chunk_sizes=(None,), param_dtype=None,
                  kernel_layout: str = "hv", device_peak: bool = False, label_smoothing: float = 0.0) -> list[dict]:
    """One row per head -- the fused head at each of ``chunk_sizes`` (None: the op's default),
    then XLA's: loss, ms per forward+backward (device time, and wall time per call), temp GB and arguments+outputs GB, and the ratios of
    both times and of temp memory to the XLA head's, the kernel in ``param_dtype`` (default: ``dtype``),
    (H, V) or, for ``kernel_layout`` "vh", (V, H). Runs the kernels (backend "cute"). With
    ``device_peak``: also each head's temporary memory by the device's counter -- its rise of the
    peak over its operands (:func:`device_peak_bytes`) less its outputs -- and its ratio to the
    XLA head's. Both heads' loss with ``label_smoothing`` (module docstring)."""
    operands = head_operands(t, h, v, dtype, param_dtype=param_dtype, kernel_layout=kernel_layout)
    heads = [("fused", chunk) for chunk in chunk_sizes] + [("xla", None)]
    with cl.use_backend("cute"):  # chosen at lowering: the executables keep it
        compiled = [compile_head(head, operands, chunk, kernel_layout, label_smoothing) for head, chunk in heads]
    memory = [memory_stats(fn) for fn in compiled]
    losses = [float(fn(*operands)[0]) for fn in compiled]
    times = [time_fn(fn, *operands) for fn in compiled]
    walls = [wall_time(fn, *operands) for fn in compiled]
    xla_time, xla_wall, xla_temp = times[-1], walls[-1], max(memory[-1]["temp"], 1)
    rows = []
    for (head, chunk), mem, loss, seconds, wall in zip(heads, memory, losses, times, walls):
        rows.append({"head": head, "chunk": "default" if chunk is None and head == "fused" else chunk or "-",
                         "t": t, "h": h, "v": v, "layout": kernel_layout, "dtype": jnp.dtype(dtype).name,
                         "params": jnp.dtype(param_dtype or dtype).name, "smoothing": label_smoothing,
                         "loss": f"{loss:.4f}",
                         "ms": f"{seconds * 1e3:.2f}", "temp_gb": f"{mem['temp'] / GB:.3f}",
                         "args_out_gb": f"{(mem['arguments'] + mem['outputs']) / GB:.3f}",
                         "time_vs_xla": f"{seconds / xla_time:.2f}", "wall_ms": f"{wall * 1e3:.2f}",
                         "wall_vs_xla": f"{wall / xla_wall:.2f}", "temp_vs_xla": f"{mem['temp'] / xla_temp:.3f}"})
    if device_peak:
        peaks = [device_peak_bytes(head, t, h, v, dtype, chunk, param_dtype, kernel_layout, label_smoothing)
                 for head, chunk in heads]
        temps = [None if peak is None else (peak[0] - mem["outputs"], peak[1]) for peak, mem in zip(peaks, memory)]
        for row, temp in zip(rows, temps):  # "<=": an upper bound (device_peak_bytes)
            row["peak_temp_gb"] = "-" if temp is None else ("" if temp[1] else "<=") + f"{temp[0] / GB:.3f}"
            row["peak_temp_vs_xla"] = "-" if temp is None or temps[-1][0] <= 0 else f"{temp[0] / temps[-1][0]:.3f}"
    return rows


if __name__ == "__main__":  # device_peak_bytes's measuring process: one JSON job in, one JSON line out
    print(json.dumps(_measure_peak(json.loads(sys.argv[1]))))
