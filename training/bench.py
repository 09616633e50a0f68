"""Model-level benchmark: ``python -m training.bench --config small gpt2``.

For every (config, framework, variant) -- variants ``cutelayers`` (the model on the CuTe kernels),
``stock`` (its twin from the framework's own layers) and ``reference`` (the cutelayers model on
the jnp reference backend) -- one train step (value_and_grad + AdamW, the step
:mod:`training.train` runs) on random tokens of the config's vocabulary (``--tokens corpus``: the
shipped byte-level corpus, as training.train reads it):

* compile seconds of the train step;
* ``loop ms``: steady-state time per step of back-to-back steps (compile and ``--warmup-steps``
  excluded, losses left on the device), and tokens/s from it;
* ``step ms``: one step dispatched and waited for (median of ``--steps`` such calls): the device
  time of a step plus one dispatch; ``loop/step`` near 1 means the loop keeps the device busy;
* peak device memory: ``memory_stats()['peak_bytes_in_use']`` of the device (each case runs in a
  fresh subprocess, so the peak is that case's), and XLA's own account of the compiled step
  (arguments + outputs + temporaries, ``compiled.memory_analysis()``) where the device keeps no
  statistics (CPU).

``--breakdown`` adds a per-part table, cutelayers vs stock: each part of one step timed alone at the
model's shapes (forward + backward, times its count per step): the two attention GEMMs and the
MLP of a block, the LayerNorms, attention, the LM head + loss, the optimizer update, and the rest
of the step (``other`` = step - parts).

The tables are printed and appended to ``--output`` (default docs/benchmarks.md) with the GPU,
versions, date and command. On CPU, tiny settings (``--config tiny --steps 3``) check it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
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
from jax.sharding import NamedSharding, PartitionSpec

import cutelayers as cl
from cutelayers.bench.timing import time_fn
from models import common
from models.configs import CONFIGS, GPTConfig, get_config
from training.data import TextData
from training.train import DEFAULTS, Schedule, _int_at_least, compile_train_step, make_optimizer

VARIANTS = ("cutelayers", "stock", "reference")
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

    @property
    def backend(self) -> str:
        return "reference" if self.variant == "reference" else "auto"


def bench_config(name: str) -> GPTConfig:
    """The preset, in bfloat16 on a GPU (as training.train runs it)."""
    return get_config(name, **({"dtype": "bfloat16"} if jax.default_backend() == "gpu" else {}))


TOKENS = ("uniform", "corpus")


def step_batches(config: GPTConfig, batch_size: int, sharding, count: int = 2, tokens: str = "uniform"):
    """``count`` device batches, targets shifted by one: ``tokens`` "uniform", random tokens over the
    whole vocabulary; "corpus", windows of the shipped byte-level corpus, as training.train draws
    them (a few dozen distinct tokens: the embedding gradient's scatter-add collides far more)."""
    if tokens == "corpus":
        data = TextData.load()
        return [jax.device_put(data.train_batch(i, batch_size, config.seq_len, seed=0), sharding)
                for i in range(count)]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(count):
        drawn = rng.integers(0, config.vocab_size, size=(batch_size, config.seq_len + 1), dtype=np.int32)
        batches.append(jax.device_put((drawn[:, :-1], drawn[:, 1:]), sharding))
    return batches


def memory_in_use(device) -> int | None:
    stats = device.memory_stats()
    return None if stats is None else stats.get("peak_bytes_in_use")


def measure(case: Case) -> dict:
    """One case, in this process: compile, warm up, time; the row of the results table."""
    config = bench_config(case.config)
    device = jax.devices()[0]
    sharding = NamedSharding(jax.make_mesh((1,), ("data",), devices=[device]), PartitionSpec())
    with cl.use_backend(case.backend):
        model = common.init(case.model, config, jax.random.key(0), stock=case.variant == "stock")
        tx = make_optimizer(model.params, Schedule(lr=1e-4, warmup=0, steps=10**6), weight_decay=0.1, grad_clip=1.0)
        params, opt_state = jax.device_put((model.params, tx.init(model.params)), sharding)
        batches = step_batches(config, case.batch_size, sharding, tokens=case.tokens)
        step = compile_train_step(model.loss, tx, params, opt_state, *batches[0])
        analysis = step.run.memory_analysis()
        leaves = tuple(jax.tree.leaves((params, opt_state)))
        del params, opt_state  # donated
        for i in range(case.warmup_steps):
            leaves, loss, _ = step.run(leaves, *batches[i % 2])
        jax.block_until_ready(leaves)
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
    compiled_bytes = None if analysis is None else (
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes)
    return dict(**dataclasses.asdict(case), dtype=config.dtype, seq_len=config.seq_len,
                compile_s=step.seconds, kernel_calls=step.kernel_calls,
                attention=common.attention_implementation(config.compute_dtype, config.head_dim),
                loop_ms=loop_s * 1e3, step_ms=statistics.median(single) * 1e3,
                tokens_per_s=case.batch_size * config.seq_len / loop_s,
                peak_bytes=memory_in_use(device), compiled_bytes=compiled_bytes, loss=final_loss)


def in_subprocess(flag: str, job: dict, timeout: float):
    """The JSON that ``python -m training.bench FLAG JOB`` prints: every measurement runs in a fresh
    process, so the device's peak memory is that job's own and this process never holds the GPU
    (JAX would reserve most of its memory)."""
    proc = subprocess.run([sys.executable, "-m", "training.bench", flag, json.dumps(job)],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    if proc.returncode or not lines:
        raise RuntimeError(f"benchmark {flag} {job} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# --- per-part breakdown ---------------------------------------------------------------------------

def part_seconds(config: GPTConfig, batch_size: int, *, stock: bool) -> dict[str, float]:
    """Seconds per train step spent in each part, each timed alone at the model's shapes (forward +
    backward, times its count per step), built from the linen twins' layers."""
    from models import linen_gpt

    dt, d, n_layers = config.compute_dtype, config.d_model, config.n_layers
    LayerNorm, Dense, MLP, Head = linen_gpt._layers(stock)
    rng = np.random.default_rng(0)
    rows = (batch_size, config.seq_len)

    def act(*shape):
        return jnp.asarray(rng.standard_normal(shape), dt)

    def fwd_bwd(module, *inputs, **kwargs):
        """Seconds of the forward and backward of ``module`` (gradients of params and inputs)."""
        params = module.init(jax.random.key(0), *inputs, **kwargs)["params"]
        f = lambda p, *x: module.apply({"params": p}, *x, **kwargs)
        out = jax.eval_shape(f, params, *inputs)
        cotangent = jnp.ones(out.shape, out.dtype)
        return time_fn(jax.jit(lambda p, *x: jax.vjp(f, p, *x)[1](cotangent)), params, *inputs)

    x = act(*rows, d)
    parts = {}
    for name, n_out, residual in (("qkv", 3 * d, {}), ("attn_out", d, {"residual": x})):
        parts[f"GEMM {name} ({d}x{n_out})"] = n_layers * fwd_bwd(Dense(n_out, dtype=dt), x, **residual)
    mlp = MLP(config.d_mlp, d, dtype=dt, kernel_init=jax.nn.initializers.normal(config.init_std),
              out_kernel_init=jax.nn.initializers.normal(config.proj_init_std))
    parts[f"MLP ({d}x{config.d_mlp}x{d})"] = n_layers * fwd_bwd(mlp, x, residual=x)
    parts["LayerNorm"] = (2 * n_layers + 1) * fwd_bwd(LayerNorm(epsilon=config.norm_eps, dtype=dt), x)
    qkv = act(*rows, 3 * d)
    attention = jax.jit(lambda q: jax.vjp(lambda a: common.causal_attention(a, config.n_heads), q)[1](
        jnp.ones((*rows, d), dt)))
    parts["attention"] = n_layers * time_fn(attention, qkv)
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


def breakdown_rows(config_name: str, batch_size: int, step_ms: dict[str, float]) -> list[dict]:
    """Per-part rows, cutelayers vs stock; ``step_ms``: the full step of each (from the cases;
    "other" is the step minus the parts)."""
    config = bench_config(config_name)
    ours, stock = (part_seconds(config, batch_size, stock=s) for s in (False, True))
    rows = [{"part": name, "ours_ms": ours[name] * 1e3, "stock_ms": stock[name] * 1e3} for name in ours]
    if {"cutelayers", "stock"} <= set(step_ms):
        rows.append({"part": "other (step - parts)", "ours_ms": step_ms["cutelayers"] - sum(ours.values()) * 1e3,
                     "stock_ms": step_ms["stock"] - sum(stock.values()) * 1e3})
    return rows


# --- tables and the report ------------------------------------------------------------------------

def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def results_table(rows: list[dict]) -> str:
    head = ("| config | model | variant | attention | batch x seq | compile s | loop ms | step ms | loop/step "
            "| tokens/s | vs stock | peak MiB | compiled MiB | vs stock |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        stock = next((s for s in rows if s["variant"] == "stock" and (s["config"], s["model"]) == (r["config"], r["model"])),
                     None)
        speed = f"{r['tokens_per_s'] / stock['tokens_per_s']:.2f}x" if stock else "-"
        ours_mem, stock_mem = (x["peak_bytes"] or x["compiled_bytes"] if x else None for x in (r, stock))
        memory = f"{ours_mem / stock_mem:.2f}x" if ours_mem and stock_mem else "-"
        lines.append(f"| {r['config']} | {r['model']} | {r['variant']} | {r['attention']} | {r['batch_size']} x "
                     f"{r['seq_len']} | {r['compile_s']:.1f} | {r['loop_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['loop_ms'] / r['step_ms']:.2f} | {r['tokens_per_s']:,.0f} | {speed} | "
                     f"{_mib(r['peak_bytes'])} | {_mib(r['compiled_bytes'])} | {memory} |")
    return "\n".join(lines)


def breakdown_table(config: str, rows: list[dict]) -> str:
    title = (f"Per-part breakdown, {config} (ms per step; each part timed alone, forward + backward, times its "
             "count per step):")
    lines = [title, "", "| part | cutelayers ms | stock ms | stock/ours |", "|---|---|---|---|"]
    for r in rows:
        ratio = r["stock_ms"] / r["ours_ms"] if r["ours_ms"] > 0 else float("nan")
        lines.append(f"| {r['part']} | {r['ours_ms']:.2f} | {r['stock_ms']:.2f} | {ratio:.2f} |")
    return "\n".join(lines)


def environment_line() -> str:
    device = jax.devices()[0]
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("jax", "flax", "equinox", "nvidia-cutlass-dsl"))
    return (f"{datetime.date.today().isoformat()} · {device.device_kind} ({jax.default_backend()}) · {versions} · "
            f"Python {platform.python_version()}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", nargs="+", choices=tuple(CONFIGS), default=["small", "gpt2"], help="model presets")
    p.add_argument("--model", nargs="+", choices=common.FRAMEWORKS, default=list(common.FRAMEWORKS),
                   help="frameworks")
    p.add_argument("--variant", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   help="cutelayers model, its stock twin, the cutelayers model on the reference backend")
    p.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help="sequences per step (default: the config's training default)")
    p.add_argument("--warmup-steps", type=_int_at_least(0), default=3, help="untimed steps after compiling")
    p.add_argument("--steps", type=_int_at_least(1), default=20, help="timed steps (loop and one-at-a-time each)")
    p.add_argument("--tokens", choices=TOKENS, default="uniform",
                   help="batches: random tokens over the vocabulary, or the shipped corpus as training.train reads it")
    p.add_argument("--breakdown", action="store_true", help="add the per-part table (cutelayers vs stock)")
    p.add_argument("--case-timeout", type=_int_at_least(1), default=600, help="seconds allowed per case")
    p.add_argument("--output", type=Path, default=REPO / "docs" / "benchmarks.md",
                   help="markdown file the tables are appended to")
    p.add_argument("--one-case", help=argparse.SUPPRESS)  # internal: run one case, print its JSON row
    p.add_argument("--one-breakdown", help=argparse.SUPPRESS)  # internal: the per-part rows as JSON
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.one_case:
        print(json.dumps(measure(Case(**json.loads(args.one_case)))))
        return 0
    if args.one_breakdown:
        print(json.dumps(breakdown_rows(**json.loads(args.one_breakdown))))
        return 0
    sections = []
    for config in args.config:
        batch_size = args.batch_size or DEFAULTS[config]["batch_size"]
        rows = []
        for model in args.model:
            for variant in args.variant:
                case = Case(config, model, variant, batch_size, args.warmup_steps, args.steps, args.tokens)
                rows.append(in_subprocess("--one-case", dataclasses.asdict(case), args.case_timeout))
                print(f"# {config} {model} {variant}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
        sections.append(results_table(rows))
        if args.breakdown:
            step_ms = {r["variant"]: r["step_ms"] for r in rows if r["model"] == args.model[0]}
            job = {"config_name": config, "batch_size": batch_size, "step_ms": step_ms}
            sections.append(breakdown_table(config, in_subprocess("--one-breakdown", job, args.case_timeout)))
    command = "python -m training.bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    legend = ("tokens/s from `loop ms` (steady state: compile, warmup and evaluation excluded); "
              "`step ms`: one step waited for; peak MiB: the device's peak_bytes_in_use in the "
              "case's own process; compiled MiB: arguments + outputs + temporaries of the "
              "compiled step (memory_analysis); memory `vs stock` uses peak where the device "
              "reports it, else compiled.")
    report = "\n\n".join([f"## Training step (issue 14)\n\n{environment_line()}\n\nCommand: `{command}`", *sections,
                          legend])
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "a") as f:
        f.write("\n" + report + "\n")
    print(f"# appended to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
