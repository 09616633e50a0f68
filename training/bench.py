"""Model-level benchmark: ``python -m training.bench --config small gpt2``.

For every (config, framework, variant) -- variants ``cutelayers`` (the model on the CuTe kernels),
``stock`` (its twin from the framework's own layers) and ``reference`` (the cutelayers model on
the jnp reference backend) -- one train step (value_and_grad + AdamW, the step
:mod:`training.train` runs) on random tokens of the config's vocabulary (``--tokens corpus``: the
shipped byte-level corpus, as training.train reads it):

* compile seconds of the train step;
* ``loop ms``: steady-state time per step of back-to-back steps (compile, ``--warmup-steps`` and
  then :data:`cutelayers.bench.timing.SETTLE_SECONDS` of steps -- the GPU's clock settling under
  its power cap -- excluded, losses left on the device), and tokens/s from it;
* ``step ms``: one step dispatched and waited for (median of ``--steps`` such calls): the device
  time of a step plus one dispatch; ``loop/step`` near 1 means the loop keeps the device busy;
* peak device memory: ``memory_stats()['peak_bytes_in_use']`` of the device (each case runs in a
  fresh subprocess, so the peak is that case's), and XLA's own account of the compiled step
  (arguments + outputs + temporaries, ``compiled.memory_analysis()``) where the device keeps no
  statistics (CPU).

``--mesh MESH [MESH ...]`` (``AXIS=N[,AXIS=N...]`` as training.train's ``--mesh``, axes data, fsdp,
tensor) runs every case over each mesh, its state and batches placed as training.train places
them (:mod:`training.sharding`). The table then gains a ``mesh`` column; tokens/s stays global (the
whole batch), with its ratio ``vs 1 device`` to the same config / model / variant on ``data=1`` in
the same run (when it is one of the meshes); the memory columns are per device: the peak is the
largest over the mesh's devices, and ``state MiB/device`` is the parameters + optimizer state
held by the mesh's first device (the sum of its shards of every leaf), with its ratio to the
1-device case. A mesh needs that many devices (on CPU,
``XLA_FLAGS=--xla_force_host_platform_device_count=N``), and the batch must divide over its data x
fsdp shards.

``--vocab-size V`` builds every preset with V tokens instead of its own (``--config gpt2
--vocab-size 50257``: GPT-2 at its tokenizer's vocabulary, which the presets pad to 50304); the
table's config cell says so.

``--breakdown`` adds a per-part table, cutelayers vs stock: each part of one step timed alone at the
model's shapes (forward + backward, times its count per step): the two attention GEMMs and the
MLP of a block, the LayerNorms, attention, the LM head + loss, the optimizer update, and the rest
of the step (``other`` = step - parts).

``--kernels N`` traces each case's timed steps with jax.profiler and adds, per case, the device
time per step of each kernel family (the CuTe kernels, cuBLAS, cuDNN attention, XLA's fusions) and
its N costliest GPU kernels: where a step's time goes inside the one compiled program, which the
per-part breakdown (parts compiled alone) cannot show. It also adds the device's idle time between
kernels, by the kernel families on either side of each gap: the launches' share of a step.

The tables are printed and appended to ``--output`` (default docs/benchmarks.md) with the GPU,
versions, date and command. A line says when each case starts and what it measured; a case that
runs past ``--case-timeout`` is stopped and named under the table, the other cases kept. On CPU,
tiny settings (``--config tiny --steps 3``) check it runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import cutelayers as cl
from cutelayers.bench.timing import idle_gaps, kernel_totals, settle_clock, time_fn, traced_kernel_spans
from models import common
from models.configs import CONFIGS, REMATS, GPTConfig, get_config
from training import sharding
from training.data import VOCAB_SIZE as CORPUS_VOCAB_SIZE
from training.data import TextData
from training.train import (
    DEFAULTS,
    Schedule,
    _HelpFormatter,
    _int_at_least,
    compile_train_step,
    make_optimizer,
    path_error,
)

VARIANTS = ("cutelayers", "stock", "reference")
ONE_DEVICE = sharding.describe(sharding.parse_mesh("data=1"))
REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    model: str
    variant: str
    batch_size: int
    warmup_steps: int
    steps: int
    tokens: str = "uniform"
    mesh: str = ONE_DEVICE  # training.sharding.describe() of the case's mesh
    top_kernels: int = 0  # rows of the per-kernel table (0: no profile)
    remat: str = "none"  # GPTConfig.remat: the blocks recomputed in the backward
    vocab_size: int | None = None  # GPTConfig.vocab_size instead of the preset's (--vocab-size)

    @property
    def backend(self) -> str:
        return "reference" if self.variant == "reference" else "auto"


def bench_config(name: str, remat: str = "none", vocab_size: int | None = None) -> GPTConfig:
    """The preset, in bfloat16 on a GPU (as training.train runs it), its blocks recomputed as
    ``remat`` asks (``GPTConfig.remat``), with ``vocab_size`` tokens where given."""
    return get_config(name, **({"dtype": "bfloat16"} if jax.default_backend() == "gpu" else {}), remat=remat,
                      **vocabulary(vocab_size))


def vocabulary(vocab_size: int | None) -> dict:
    """The GPTConfig override of ``--vocab-size`` ({} without one: the preset's)."""
    return {} if vocab_size is None else {"vocab_size": vocab_size}


TOKENS = ("uniform", "corpus")


def step_batches(config: GPTConfig, batch_size: int, placement, count: int = 2, tokens: str = "uniform"):
    """``count`` device batches in ``placement`` (a sharding), targets shifted by one: ``tokens``
    "uniform", random tokens over the whole vocabulary; "corpus", windows of the shipped byte-level
    corpus, as training.train draws them (a few dozen distinct tokens: the embedding gradient's
    scatter-add collides far more)."""
    if tokens == "corpus":
        data = TextData.load()
        return [sharding.place(data.train_batch(i, batch_size, config.seq_len, seed=0), placement)
                for i in range(count)]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(count):
        drawn = rng.integers(0, config.vocab_size, size=(batch_size, config.seq_len + 1), dtype=np.int32)
        batches.append(sharding.place((drawn[:, :-1], drawn[:, 1:]), placement))
    return batches


def memory_in_use(device) -> int | None:
    stats = device.memory_stats()
    return None if stats is None else stats.get("peak_bytes_in_use")


def peak_bytes(devices) -> int | None:
    """The largest ``peak_bytes_in_use`` of ``devices`` (None where none keeps statistics)."""
    peaks = [p for p in map(memory_in_use, devices) if p is not None]
    return max(peaks) if peaks else None


def device_errors(meshes: list[str]) -> list[str]:
    """Why each of ``meshes`` (``--mesh`` values) does not fit this process's devices (empty: all
    fit)."""
    return [e for m in meshes if (e := sharding.device_error(sharding.parse_mesh(m), f"--mesh {m}"))]


def measure(case: Case) -> dict:
    """One case, in this process: compile, warm up, time; the row of the results table."""
    config = bench_config(case.config, case.remat, case.vocab_size)
    if errors := device_errors([case.mesh]):
        raise ValueError(errors[0])
    mesh = sharding.device_mesh(sharding.parse_mesh(case.mesh))
    devices = list(mesh.devices.flat)
    with cl.use_backend(case.backend):
        model = common.init(case.model, config, jax.random.key(0), stock=case.variant == "stock")
        tx = make_optimizer(model.params, Schedule(lr=1e-4, warmup=0, steps=10**6), weight_decay=0.1, grad_clip=1.0)
        params, opt_state = sharding.place_state(mesh, (model.params, tx.init(model.params)))
        state_bytes = sharding.bytes_per_device((params, opt_state), devices[0])
        batches = step_batches(config, case.batch_size, sharding.batch_sharding(mesh), tokens=case.tokens)
        step = compile_train_step(model.loss, tx, params, opt_state, *batches[0])
        analysis = step.run.memory_analysis()
        leaves = tuple(jax.tree.leaves((params, opt_state)))
        del params, opt_state  # donated
        for i in range(case.warmup_steps):
            leaves, loss, _ = step.run(leaves, *batches[i % 2])
        jax.block_until_ready(leaves)

        def one_step():
            nonlocal leaves
            leaves = step.run(leaves, *batches[0])[0]
            jax.block_until_ready(leaves)

        settle_clock(one_step)
        start = time.perf_counter()
        losses = []
        for i in range(case.steps):
            leaves, loss, _ = step.run(leaves, *batches[i % 2])
            losses.append(loss)
        jax.block_until_ready(leaves)
        loop_s = (time.perf_counter() - start) / case.steps
        single = []
        for i in range(case.steps):
            start = time.perf_counter()
            leaves, loss, _ = step.run(leaves, *batches[i % 2])
            jax.block_until_ready(leaves)
            single.append(time.perf_counter() - start)
        final_loss = float(losses[-1])
        kernels = kernel_profile(step, leaves, batches, case.steps, case.top_kernels) if case.top_kernels else None
    compiled_bytes = None if analysis is None else (
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes)
    return dict(**dataclasses.asdict(case), dtype=config.dtype, seq_len=config.seq_len,
                compile_s=step.seconds, kernel_calls=step.kernel_calls,
                attention=common.attention_implementation(config.compute_dtype, config.head_dim),
                loop_ms=loop_s * 1e3, step_ms=statistics.median(single) * 1e3,
                tokens_per_s=case.batch_size * config.seq_len / loop_s,
                devices=len(devices), peak_bytes=peak_bytes(devices), compiled_bytes=compiled_bytes, state_bytes=state_bytes,
                loss=final_loss, kernels=kernels)


# --- per-kernel profile ---------------------------------------------------------------------------

def kernel_family(name: str) -> str:
    """The group a GPU kernel's name puts it in (for the per-kernel table's totals)."""
    low = name.lower()
    if "cutelayers" in low:
        return "cutelayers (CuTe)"
    if "cudnn" in low or "fmha" in low or "flash" in low:
        return "cuDNN attention"
    if any(k in low for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas")):
        return "cuBLAS GEMM"
    if "memcpy" in low or "memset" in low:
        return "copies"
    return "XLA fusions and other"


def kernel_profile(step, leaves, batches, steps: int, top: int) -> dict:
    """Device time per step by GPU kernel: ``steps`` steps traced with jax.profiler
    (:func:`cutelayers.bench.timing.traced_kernel_spans`), summed by name. ``{"kernels": [(name,
    calls/step, ms/step)] x top, "families": {family: ms/step}, "busy_ms": ms/step, "idle":
    [(family before, family after, gaps/step, ms/step)]}`` -- the device's idle time between
    kernels by the families either side of each gap (:func:`cutelayers.bench.timing.idle_gaps`),
    most first; empty lists where the platform records no device kernels (CPU)."""

    def run():
        state = leaves
        for i in range(steps):
            state, _, _ = step.run(state, *batches[i % 2])
        jax.block_until_ready(state)

    spans = traced_kernel_spans(run)
    totals = {name: (calls / steps, seconds * 1e3 / steps)
              for name, (calls, seconds) in kernel_totals(spans).items()}
    families = collections.defaultdict(float)
    for name, (_, ms) in totals.items():
        families[kernel_family(name)] += ms
    ranked = sorted(totals, key=lambda name: totals[name][1], reverse=True)[:top]
    idle = sorted(((before, after, gaps / steps, seconds * 1e3 / steps)
                   for (before, after), (gaps, seconds) in idle_gaps(spans, kernel_family).items()),
                  key=lambda row: -row[3])
    return {"kernels": [(name, *totals[name]) for name in ranked],
            "families": dict(sorted(families.items(), key=lambda kv: -kv[1])),
            "busy_ms": sum(ms for _, ms in totals.values()), "idle": idle}


def kernel_table(row: dict) -> str:
    """The per-kernel section of one case (``--kernels``)."""
    profile = row["kernels"]
    head = f"Kernels per step, {row['config']} {row['model']} {row['variant']}"
    if not profile["kernels"]:
        return f"{head}: no device kernels recorded on this platform."
    lines = [f"{head} (device busy {profile['busy_ms']:.2f} ms of a {row['loop_ms']:.2f} ms step):", "",
             "| family | ms/step |", "|---|---|"]
    lines += [f"| {family} | {ms:.2f} |" for family, ms in profile["families"].items()]
    lines += ["", "| kernel | calls/step | ms/step |", "|---|---|---|"]
    short = lambda name: name.removeprefix("kernel_cutlass_kernel_cutelayerskernels")[:110]
    lines += [f"| `{short(name)}` | {count:g} | {ms:.3f} |" for name, count, ms in profile["kernels"]]
    lines += ["", "The device idle between kernels, by the kernel families either side:", "",
              "| before | after | gaps/step | ms/step | us a gap |", "|---|---|---|---|---|"]
    lines += [f"| {before} | {after} | {gaps:g} | {ms:.3f} | {1e3 * ms / gaps:.1f} |"
              for before, after, gaps, ms in profile["idle"]]
    return "\n".join(lines)


def package_roots_env() -> dict[str, str]:
    """This process's environment with the folders it imported cutelayers, models and training from
    first on ``PYTHONPATH``: a child started with ``python -P`` (no working directory put before
    them) imports those same packages. An A/B of two trees (``.ci/gpu-ab``) runs its baseline from
    another tree; a child importing the working directory's cutelayers would time that tree twice."""
    roots = dict.fromkeys(str(Path(module.__file__).resolve().parents[1]) for module in (cl, common, sharding))
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, *inherited])}


class Timeout(RuntimeError):
    """A benchmark process that ran past ``--case-timeout`` (and was killed)."""


def in_subprocess(flag: str, job: dict, timeout: float):
    """The JSON that ``python -m training.bench FLAG JOB`` prints: every measurement runs in a fresh
    process (of the same packages as this one: :func:`package_roots_env`), so the device's peak
    memory is that job's own and this process never holds the GPU (JAX would reserve most of its
    memory). :class:`Timeout` after ``timeout`` seconds."""
    try:
        proc = subprocess.run([sys.executable, "-P", "-m", "training.bench", flag, json.dumps(job)],
                              env=package_roots_env(), cwd=REPO, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise Timeout(f"timed out: ran past --case-timeout {timeout:g} s and was stopped") from None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    if proc.returncode or not lines:
        raise RuntimeError(f"benchmark {flag} {job} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# --- per-part breakdown ---------------------------------------------------------------------------

def vjp_program(f, *args):
    """``f``'s forward and backward at ``args`` as a train step runs them: (a jitted program,
    its operands). The program returns the forward's outputs, which a train step writes for the next
    layer, and the gradients of every argument. The backward reads its cotangent, random normal,
    from an operand. A constant cotangent would let XLA fold it into its fusions, so the stock
    layers would never read dy, and unreturned forward outputs would be dead code for XLA but not
    for a custom call: either would time the stock parts on less work than the step gives them."""
    out = jax.eval_shape(f, *args)
    leaves, tree = jax.tree.flatten(out)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    cotangent = jax.tree.unflatten(tree, [jax.random.normal(key, o.shape, jnp.float32).astype(o.dtype)
                                          for key, o in zip(keys, leaves)])

    def program(args, cotangent):
        y, backward = jax.vjp(f, *args)
        return y, backward(cotangent)

    return jax.jit(program), (args, cotangent)


def part_seconds(config: GPTConfig, batch_size: int, *, stock: bool) -> dict[str, float]:
    """Seconds per train step spent in each part, each timed alone at the model's shapes (forward +
    backward, times its count per step), built from the linen twins' layers."""
    from models import linen_gpt

    dt, d, n_layers = config.compute_dtype, config.d_model, config.n_layers
    Dense, MLP, Head, _ = linen_gpt._layers(stock)
    rng = np.random.default_rng(0)
    rows = (batch_size, config.seq_len)

    def act(*shape):
        return jnp.asarray(rng.standard_normal(shape), dt)

    def fwd_bwd(module, *inputs, **kwargs):
        """Seconds of the forward and backward of ``module`` (gradients of params and inputs)."""
        params = module.init(jax.random.key(0), *inputs, **kwargs)["params"]
        program, operands = vjp_program(lambda p, *x: module.apply({"params": p}, *x, **kwargs), params, *inputs)
        return time_fn(program, *operands)

    x = act(*rows, d)
    parts = {}
    for name, n_out in (("qkv", config.qkv_features), ("attn_out", d)):
        parts[f"GEMM {name} ({d}x{n_out})"] = n_layers * fwd_bwd(Dense(n_out, use_bias=config.bias, dtype=dt), x)
    mlp = MLP(config.d_mlp, d, activation=config.activation, use_bias=config.bias, dtype=dt,
              kernel_init=jax.nn.initializers.normal(config.init_std),
              out_kernel_init=jax.nn.initializers.normal(config.proj_init_std))
    parts[f"MLP ({d}x{config.d_mlp}x{d})"] = n_layers * fwd_bwd(mlp, x)
    # the first norm alone, the other 2 n_layers with the residual add (models.common.add_norm)
    norm = linen_gpt._norm(config, stock, name=None)
    parts["RMSNorm" if config.norm == "rms" else "LayerNorm"] = (
        fwd_bwd(norm, x) + 2 * n_layers * fwd_bwd(norm, x, residual=act(*rows, d)))
    attention, operands = vjp_program(lambda a: common.causal_attention(a, config), act(*rows, config.qkv_features))
    parts["attention"] = n_layers * time_fn(attention, *operands)
    targets = jnp.asarray(rng.integers(0, config.vocab_size, rows), jnp.int32)
    head = Head(config.vocab_size, use_bias=False, dtype=dt)
    head_params = head.init(jax.random.key(0), x, targets)["params"]
    parts["LM head + loss"] = time_fn(jax.jit(jax.grad(lambda p, h: head.apply({"params": p}, h, targets),
                                                       argnums=(0, 1))), head_params, x)
    model = common.init("linen", config, jax.random.key(0), stock=stock)
    tx = make_optimizer(model.params, Schedule(lr=1e-4, warmup=0, steps=10**6), weight_decay=0.1, grad_clip=1.0)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    parts["optimizer (AdamW)"] = time_fn(update, model.params, tx.init(model.params), model.params)
    return parts


def breakdown_rows(config_name: str, batch_size: int, step_ms: dict[str, float],
                   vocab_size: int | None = None) -> list[dict]:
    """Per-part rows, cutelayers vs stock; ``step_ms``: the full step of each (from the cases;
    "other" is the step minus the parts)."""
    config = bench_config(config_name, vocab_size=vocab_size)
    ours, stock = (part_seconds(config, batch_size, stock=s) for s in (False, True))
    rows = [{"part": name, "ours_ms": ours[name] * 1e3, "stock_ms": stock[name] * 1e3} for name in ours]
    if {"cutelayers", "stock"} <= set(step_ms):
        rows.append({"part": "other (step - parts)", "ours_ms": step_ms["cutelayers"] - sum(ours.values()) * 1e3,
                     "stock_ms": step_ms["stock"] - sum(stock.values()) * 1e3})
    return rows


# --- tables and the report ------------------------------------------------------------------------

def _mib(n: int | None, digits: int = 0) -> str:
    return "-" if n is None else f"{n / 2**20:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _peer(rows: list[dict], row: dict, **differing) -> dict:
    """The row of ``rows`` with ``row``'s config, model, variant and mesh but for ``differing``
    ({} if there is none)."""
    want = {k: differing.get(k, row[k]) for k in ("config", "model", "variant", "mesh")}
    return next((r for r in rows if all(r[k] == v for k, v in want.items())), {})


def _memory(row: dict) -> int | None:
    """The memory the ``vs stock`` column compares: the peak where the device reports it, else the
    compiled step's."""
    return (row["peak_bytes"] or row["compiled_bytes"]) if row else None


def results_table(rows: list[dict], *, meshes: bool = False) -> str:
    """The markdown table of ``rows`` (:func:`measure`'s); ``meshes``: with the mesh columns (the
    mesh, tokens/s and state bytes vs the 1-device case, memory per device)."""
    per = "/device" if meshes else ""
    one = lambda r: _peer(rows, r, mesh=ONE_DEVICE)
    stock = lambda r: _peer(rows, r, variant="stock")
    columns = [
        ("config", config_label),
        ("model", lambda r: r["model"]), ("variant", lambda r: r["variant"]),
        *([("mesh", lambda r: r["mesh"])] if meshes else []),
        ("attention", lambda r: r["attention"]),
        ("batch x seq", lambda r: f"{r['batch_size']} x {r['seq_len']}"),
        ("compile s", lambda r: f"{r['compile_s']:.1f}"),
        ("loop ms", lambda r: f"{r['loop_ms']:.2f}"), ("step ms", lambda r: f"{r['step_ms']:.2f}"),
        ("loop/step", lambda r: f"{r['loop_ms'] / r['step_ms']:.2f}"),
        ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("vs stock", lambda r: _ratio(r["tokens_per_s"], stock(r).get("tokens_per_s"))),
        *([("vs 1 device", lambda r: _ratio(r["tokens_per_s"], one(r).get("tokens_per_s")))] if meshes else []),
        (f"peak MiB{per}", lambda r: _mib(r["peak_bytes"])),
        (f"compiled MiB{per}", lambda r: _mib(r["compiled_bytes"])),
        ("vs stock", lambda r: _ratio(_memory(r), _memory(stock(r)))),
        *([("state MiB/device", lambda r: _mib(r["state_bytes"], 1)),
           ("vs 1 device", lambda r: _ratio(r["state_bytes"], one(r).get("state_bytes")))] if meshes else []),
    ]
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def config_label(row: dict) -> str:
    """A row's config cell: the preset, and what the case changed in it."""
    changes = []
    if row.get("remat", "none") != "none":
        changes.append(f"remat {row['remat']}")
    if row.get("vocab_size") is not None:
        changes.append(f"vocabulary {row['vocab_size']}")
    return row["config"] + (f" ({', '.join(changes)})" if changes else "")


def breakdown_table(config: str, rows: list[dict]) -> str:
    title = (f"Per-part breakdown, {config} (ms per step; each part timed alone, forward + backward, times its "
             "count per step):")
    lines = [title, "", "| part | cutelayers ms | stock ms | stock/ours |", "|---|---|---|---|"]
    for r in rows:
        ratio = r["stock_ms"] / r["ours_ms"] if r["ours_ms"] > 0 else float("nan")
        lines.append(f"| {r['part']} | {r['ours_ms']:.2f} | {r['stock_ms']:.2f} | {ratio:.2f} |")
    return "\n".join(lines)


def environment_line(count: bool = False) -> str:
    """Date, device (``count``: how many of them), versions."""
    devices = jax.devices()
    kind = f"{len(devices)} x {devices[0].device_kind}" if count else devices[0].device_kind
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("jax", "flax", "equinox", "nvidia-cutlass-dsl"))
    return (f"{datetime.date.today().isoformat()} · {kind} ({jax.default_backend()}) · {versions} · "
            f"Python {platform.python_version()}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--config", nargs="+", choices=tuple(CONFIGS), default=["small", "gpt2"], help="model presets")
    p.add_argument("--model", nargs="+", choices=common.FRAMEWORKS, default=list(common.FRAMEWORKS),
                   help="frameworks")
    p.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="cutelayers model, its stock twin, the cutelayers model on the reference backend")
    p.add_argument("--vocab-size", type=_int_at_least(1), default=None,
                   help="every preset with this vocabulary instead of its own (e.g. --config gpt2 "
                        "--vocab-size 50257: GPT-2's tokenizer, unpadded); --tokens corpus needs >= 256")
    p.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help="sequences per step, the whole batch over a mesh (default: the config's training default)")
    p.add_argument("--mesh", nargs="+", type=sharding.parse_mesh, default=None, metavar="AXIS=N[,AXIS=N...]",
                   help="run every case over each of these device meshes, as training.train's --mesh (axes "
                        "data, fsdp, tensor; unnamed axes have size 1): the table adds the mesh, tokens/s and "
                        "parameter + optimizer bytes per device vs the data=1 case, memory per device. Each "
                        "needs that many devices and a batch that divides over data x fsdp. Without it: one "
                        "device, and the table without the mesh columns")
    p.add_argument("--warmup-steps", type=_int_at_least(0), default=3, help="untimed steps after compiling")
    p.add_argument("--steps", type=_int_at_least(1), default=20, help="timed steps (loop and one-at-a-time each)")
    p.add_argument("--remat", choices=REMATS, default="none",
                   help="every case's blocks recomputed in the backward (training.train's --remat; the stock "
                        "twin under the same jax.checkpoint policy)")
    p.add_argument("--tokens", choices=TOKENS, default="uniform",
                   help="batches: random tokens over the vocabulary, or the shipped corpus as training.train reads it")
    p.add_argument("--breakdown", action="store_true",
                   help="add the per-part table (cutelayers vs stock, on one device)")
    p.add_argument("--kernels", type=_int_at_least(0), default=0, metavar="N",
                   help="trace --steps steps of each case with jax.profiler and add its N costliest GPU "
                        "kernels (ms per step), the time per kernel family (CuTe, cuBLAS, cuDNN, XLA "
                        "fusions) and the device's idle time between kernels by the families either side")
    p.add_argument("--case-timeout", type=_int_at_least(1), default=600, help="seconds allowed per case")
    p.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks.md",
                   help="markdown file the tables are appended to")
    p.add_argument("--one-case", help=argparse.SUPPRESS)  # internal: run one case, print its JSON row
    p.add_argument("--one-breakdown", help=argparse.SUPPRESS)  # internal: the per-part rows as JSON
    p.add_argument("--one-check", help=argparse.SUPPRESS)  # internal: device_errors() of meshes, as JSON
    return p


def check_meshes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The ``--mesh`` values (``[data=1]`` without it), after checking each against every config's
    batch size and shapes and (in a subprocess: this process keeps off the GPU) the devices;
    exits with a usage error naming the mesh otherwise."""
    if args.mesh is None:
        return [ONE_DEVICE]
    meshes = [sharding.describe(shape) for shape in args.mesh]
    if len(set(meshes)) < len(meshes):
        twice = next(m for m in meshes if meshes.count(m) > 1)
        parser.error(f"argument --mesh: {twice} given twice (axes not named have size 1)")
    for config in args.config:
        batch_size = args.batch_size or DEFAULTS[config]["batch_size"]
        batch = None if args.batch_size else f"the {config} config's default --batch-size {batch_size}"
        for shape, mesh in zip(args.mesh, meshes):
            if error := (sharding.batch_error(shape, batch_size, f"--mesh {mesh}", batch)
                         or sharding.tensor_error(shape, get_config(config, **vocabulary(args.vocab_size)),
                                                  config)):
                parser.error(f"argument --mesh: {error}")
    several = any(math.prod(shape.values()) > 1 for shape in args.mesh)
    if several:
        try:
            errors = in_subprocess("--one-check", meshes, args.case_timeout)
        except Timeout as e:
            parser.error(f"argument --mesh: checking the devices {e}")
        if errors:
            parser.error(f"argument --mesh: {errors[0]}")
    return meshes


def run_job(label: str, flag: str, job: dict, timeout: float):
    """:func:`in_subprocess`, said as it starts and ends (a case takes minutes); None where it timed
    out."""
    print(f"# {label}: running (at most {timeout:g} s)", flush=True)
    started = time.perf_counter()
    try:
        result = in_subprocess(flag, job, timeout)
    except Timeout as e:
        print(f"# {label}: {e}", flush=True)
        return None
    tokens = f"{result['tokens_per_s']:,.0f} tokens/s in " if isinstance(result, dict) else ""
    print(f"# {label}: {tokens}{time.perf_counter() - started:.0f} s", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.one_case:
        print(json.dumps(measure(Case(**json.loads(args.one_case)))))
        return 0
    if args.one_breakdown:
        print(json.dumps(breakdown_rows(**json.loads(args.one_breakdown))))
        return 0
    if args.one_check:
        print(json.dumps(device_errors(json.loads(args.one_check))))
        return 0
    if args.tokens == "corpus" and args.vocab_size is not None and args.vocab_size < CORPUS_VOCAB_SIZE:
        parser.error(f"argument --vocab-size: --tokens corpus draws byte ids up to {CORPUS_VOCAB_SIZE - 1}; "
                     f"got {args.vocab_size}, allowed >= {CORPUS_VOCAB_SIZE}")
    if error := path_error(args.output):  # before the cases, which take minutes
        parser.error(f"argument --output: {error}")
    meshes = check_meshes(parser, args)
    sections = []
    for config in args.config:
        batch_size = args.batch_size or DEFAULTS[config]["batch_size"]
        rows, timed_out = [], []
        for model in args.model:
            for variant in args.variant:
                for mesh in meshes:
                    case = Case(config, model, variant, batch_size, args.warmup_steps, args.steps, args.tokens, mesh,
                                args.kernels, args.remat, args.vocab_size)
                    label = f"{config} {model} {variant}" + (f" --mesh {mesh}" if args.mesh else "")
                    row = run_job(label, "--one-case", dataclasses.asdict(case), args.case_timeout)
                    if row is None:
                        timed_out.append(label)
                    else:
                        rows.append(row)
        if rows:
            sections.append(results_table(rows, meshes=args.mesh is not None))
        if timed_out:
            sections.append(f"Timed out (--case-timeout {args.case_timeout} s), not in the table: "
                            f"{', '.join(timed_out)}.")
        if any(r["variant"] == "cutelayers" and not r["kernel_calls"] for r in rows):
            sections.append("Note: the cutelayers rows above ran no CuTe kernel (their compiled step has no kernel "
                            "call: the jnp reference path, as off a Hopper GPU), so they time that decomposition "
                            "against stock, not the kernels.")
        sections += [kernel_table(r) for r in rows if r["kernels"] is not None]
        if args.breakdown:
            step_ms = {r["variant"]: r["step_ms"] for r in rows if r["model"] == args.model[0] and r["mesh"] == ONE_DEVICE}
            job = {"config_name": config, "batch_size": batch_size, "step_ms": step_ms, "vocab_size": args.vocab_size}
            label = config_label({"config": config, "vocab_size": args.vocab_size})  # its parts run without remat
            parts = run_job(f"per-part breakdown, {label}", "--one-breakdown", job, args.case_timeout)
            sections.append(f"Per-part breakdown, {label}: timed out (--case-timeout {args.case_timeout} s)."
                            if parts is None else breakdown_table(label, parts))
    command = "python -m training.bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    legend = ("tokens/s from `loop ms` (steady state: compile, warmup, the clock's settling and evaluation excluded); "
              "`step ms`: one step waited for; peak MiB: the device's peak_bytes_in_use in the "
              "case's own process; compiled MiB: arguments + outputs + temporaries of the "
              "compiled step (memory_analysis); memory `vs stock` uses peak where the device "
              "reports it, else compiled.")
    title = "Training step"
    if args.mesh:
        title = "Training step over device meshes"
        legend += (" mesh: training.train's --mesh; tokens/s: the whole batch's; `vs 1 device`: against the "
                   "same config, model and variant on data=1 in this run; peak MiB/device: the largest over "
                   "the mesh's devices; compiled MiB/device: one device's program; state MiB/device: "
                   "parameters + optimizer state on the mesh's first device (its shards of every leaf).")
    report = "\n\n".join([f"## {title}\n\n{environment_line(count=args.mesh is not None)}\n\nCommand: `{command}`",
                           *sections, legend])
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "a") as f:
        f.write("\n" + report + "\n")
    print(f"# appended to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
