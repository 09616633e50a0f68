"""Train a small GPT on the shipped corpus: ``python -m training.train [options]``.

The defaults (``--model nnx --config tiny``: 137k parameters, 1000 steps of 16 x 64 bytes) train
in under a minute on a 2-core CPU, the loss falling from ln(256) ~ 5.55 to ~1.8 (held out ~1.9).
On a Hopper GPU the same command runs the CuTe kernels (in bfloat16 there, see ``--dtype``);
``--config small`` is the GPU-sized model.

What it does: AdamW (weight decay on matrices only) with linear warmup + cosine decay and
global-norm gradient clipping; a jit-compiled train step (compiled ahead of time, so the report
can say whether the CuTe kernels are in it); eval loss on a fixed held-out set; Orbax checkpoints
(``--checkpoint-dir``, ``--resume``); a progress line every ``--log-every`` steps with loss and
tokens/s; JSON-lines metrics (``--metrics-file``); a loss-curve PNG (``--plot``, needs
matplotlib). At the end: start / end loss, the backend setting and the path that actually ran,
and ``cutelayers.cache_info()``.

``--devices N`` trains data-parallel: each batch is sharded over a 1-D mesh of N devices, the
parameters and optimizer state are replicated, and XLA partitions the jitted step -- the kernels
run per device on their share of the rows by their sharding rules (cutelayers.runtime.sharding),
and the weight gradients are summed across devices.

The backend (``--backend``) is applied with ``cutelayers.use_backend`` around tracing *and*
running: the setting is part of JAX's jit key, so everything inside sees one backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import cutelayers as cl
from models import common
from models.configs import CONFIGS, get_config
from training.data import VOCAB_SIZE, TextData

# Per-config training defaults; any flag given on the command line wins.
DEFAULTS = {
    "tiny": dict(steps=1000, batch_size=16, lr=3e-3, warmup=50, eval_every=200),
    "small": dict(steps=2000, batch_size=32, lr=6e-4, warmup=200, eval_every=250),
    "deep24": dict(steps=1000, batch_size=16, lr=1e-3, warmup=100, eval_every=250),
}


class UsageError(ValueError):
    """A bad combination of options or an environment that cannot honour them."""


# --- command line -------------------------------------------------------------------------------

def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}; got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number; got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0; got {text}")
    return value


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows "(default: X)" where there is a fixed default (not for None / store_true flags)."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        fixed = not (action.default is None or action.default is False or action.default == argparse.SUPPRESS)
        if fixed and "%(default)" not in help_text:
            help_text += " (default: %(default)s)"
        return help_text


def build_parser() -> argparse.ArgumentParser:
    per_config = "\n".join(
        f"  {name:<7} " + ", ".join(f"--{key.replace('_', '-')} {value:g}" for key, value in d.items())
        for name, d in DEFAULTS.items())
    p = argparse.ArgumentParser(
        prog="python -m training.train",
        description="Train a small GPT (byte-level, the shipped public-domain corpus) built from "
                    "cutelayers layers, in Flax NNX, Flax linen or Equinox.",
        epilog=f"defaults per --config (a flag given on the command line wins):\n{per_config}",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", choices=common.FRAMEWORKS, default="nnx",
                   help="which framework's implementation to train (models/<model>_gpt.py)")
    p.add_argument("--config", choices=tuple(CONFIGS), default="tiny",
                   help="model size (models/configs.py): tiny for CPU, small for one GPU, deep24 = "
                        "24 narrow blocks")
    p.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="total optimizer steps (with --resume: up to this step); default per config")
    p.add_argument("--backend", choices=cl.BACKENDS, default="auto",
                   help="cutelayers backend: auto = CuTe kernels on Hopper, jnp reference elsewhere; "
                        "cute = kernels or an error; reference = jnp reference everywhere")
    p.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help="sequences per step; default per config")
    p.add_argument("--seq-len", type=_int_at_least(1), default=None,
                   help="tokens per sequence, at most the config's seq_len; default: the config's seq_len")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate (after warmup; cosine decay to 10%% of it); default per config")
    p.add_argument("--warmup", type=_int_at_least(0), default=None,
                   help="linear warmup steps, fewer than --steps; default per config")
    p.add_argument("--weight-decay", type=_nonneg_float, default=0.1,
                   help="AdamW weight decay, applied to weight matrices and embeddings only")
    p.add_argument("--grad-clip", type=_positive_float, default=1.0,
                   help="clip gradients to this global norm")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (parameters stay float32); default: bfloat16 on a GPU (the CuTe "
                        "GEMMs take bfloat16/float16), elsewhere the config's (tiny: float32, "
                        "small/deep24: bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the parameter init and of the batches")
    p.add_argument("--eval-every", type=_int_at_least(0), default=None,
                   help="evaluate every N steps (and at the start and the end); 0: start and end only; "
                        "default per config")
    p.add_argument("--eval-batches", type=_int_at_least(1), default=8,
                   help="held-out batches per evaluation (a fixed set)")
    p.add_argument("--log-every", type=_int_at_least(1), default=50,
                   help="print a progress line every N steps")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="save Orbax checkpoints here (at every evaluation and at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir (starts fresh, with a "
                        "notice, if there is none); the checkpoint may come from the --stock twin")
    p.add_argument("--metrics-file", type=Path, default=None,
                   help="write metrics as JSON lines here (appended to with --resume)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="save a loss-curve PNG here (needs matplotlib; skipped with a message otherwise)")
    p.add_argument("--devices", type=_int_at_least(1), default=1,
                   help="train data-parallel over this many devices of JAX's default platform: each batch "
                        "is sharded over them (--batch-size must be a multiple), parameters and optimizer "
                        "state are replicated")
    p.add_argument("--stock", action="store_true",
                   help="train the twin built from the framework's own layers (same parameter tree) "
                        "instead of the cutelayers layers")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``argv``; fills per-config defaults. Exits with status 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.config].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    cfg = get_config(args.config)
    if args.seq_len is None:
        args.seq_len = cfg.seq_len
    if args.seq_len > cfg.seq_len:
        parser.error(f"argument --seq-len: {args.seq_len} exceeds the {args.config} config's position table "
                     f"(seq_len={cfg.seq_len})")
    if args.warmup >= args.steps:
        parser.error(f"argument --warmup: {args.warmup} warmup steps must be fewer than --steps={args.steps}")
    if args.resume and args.checkpoint_dir is None:
        parser.error("argument --resume: needs --checkpoint-dir")
    if args.batch_size % args.devices:
        parser.error(f"argument --devices: --batch-size {args.batch_size} is not a multiple of --devices "
                     f"{args.devices} (every device takes an equal share of each batch)")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        parser.error(f"argument --plot: expected a .png file name; got {str(args.plot)!r}")
    return args


# --- training pieces ------------------------------------------------------------------------------

def make_optimizer(params, *, lr: float, warmup: int, steps: int, weight_decay: float, grad_clip: float):
    """AdamW (decay on >= 2-D leaves only) after global-norm clipping; warmup + cosine schedule."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=0.1 * lr)
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
    tx = optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )
    return tx, schedule


def train_state(params, opt_state, step: int) -> dict:
    """What a checkpoint holds."""
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)}


def make_train_step(loss_fn, tx):
    """(params, opt_state, inputs, targets) -> (params, opt_state, loss, grad_norm); not jitted."""

    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return train_step


def count_kernel_calls(hlo_text: str) -> int:
    """CuTe kernel calls (XLA custom calls to cutelayers FFI targets) in compiled HLO text. The
    compiled program, not the lowered one: on several devices XLA's partitioner emits the kernel
    calls, per device, only when it compiles."""
    return sum('custom_call_target="cutelayers_' in line for line in hlo_text.splitlines())


def data_parallel_mesh(n_devices: int) -> jax.sharding.Mesh:
    """A 1-D mesh ("data",) over the first ``n_devices`` devices of JAX's default platform.

    Its axis is Auto: XLA partitions the step and applies the kernels' sharding rules when it
    compiles. (Explicit axes would type every array's sharding, which jax 0.10 refuses for some
    of the models' reshapes.)
    """
    available = jax.devices()
    if n_devices > len(available):
        raise UsageError(
            f"--devices {n_devices}: only {len(available)} {jax.default_backend()} device(s) visible. Use "
            f"--devices {len(available)} or fewer (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={n_devices} makes that many host devices).")
    return jax.make_mesh((n_devices,), ("data",), devices=available[:n_devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _path_report(n_calls: int) -> str:
    platform = jax.default_backend()
    if n_calls:
        return f"CuTe kernels ({n_calls} kernel calls in the compiled train step; platform {platform})"
    why = ("CuTe kernels run only on CUDA" if platform != "gpu"
           else "the backend or the GPU/dtypes select the reference")
    return f"jnp reference (no CuTe kernel calls in the compiled train step; platform {platform}: {why})"


def _cache_report() -> str:
    info = cl.cache_info()
    if not info:
        return "{} (nothing compiled)"
    return json.dumps({k: dict(compiles=v.compiles, memory_hits=v.memory_hits, disk_hits=v.disk_hits,
                               compile_seconds=round(v.compile_seconds, 2), load_seconds=round(v.load_seconds, 2))
                       for k, v in info.items()})


def _plot(path: Path, history: list[dict]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed; skipped {path} (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(6, 4))
    for split in ("train", "eval"):
        pts = [(h["step"], h["loss"]) for h in history if h["split"] == split]
        if pts:
            ax.plot(*zip(*pts), marker="o" if split == "eval" else None, label=split)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"loss curve: {path}"


@dataclasses.dataclass
class Result:
    """What :func:`train` returns (and prints a summary of)."""

    steps_run: int
    final_step: int
    start_loss: float | None
    end_loss: float | None
    eval_losses: list[tuple[int, float]]
    backend: str
    path: str
    kernel_calls: int
    params: Any
    opt_state: Any
    seconds: float
    tokens_per_s: float


def train(args: argparse.Namespace, *, out=sys.stdout) -> Result:
    """Run the training described by ``args`` (from :func:`parse_args`)."""

    def say(*parts):
        print(*parts, file=out, flush=True)

    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else None)
    config = get_config(args.config, **({"dtype": dtype} if dtype else {}))
    if config.vocab_size != VOCAB_SIZE:
        raise UsageError(f"config vocab_size={config.vocab_size} but the data is bytes (vocab {VOCAB_SIZE})")
    if args.backend == "cute" and jax.default_backend() != "gpu":
        raise UsageError(f"--backend cute needs a Hopper GPU; JAX's platform here is "
                         f"{jax.default_backend()!r}. Use --backend auto (the default) or reference.")
    data = TextData.load()
    data.check_seq_len(args.seq_len)
    mesh = data_parallel_mesh(args.devices)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharded = NamedSharding(mesh, PartitionSpec("data"))
    eval_set = jax.device_put(data.eval_batches(args.batch_size, args.seq_len, args.eval_batches),
                              batch_sharded)

    with cl.use_backend(args.backend):
        backend = cl.current_backend()
        model = common.init(args.model, config, jax.random.key(args.seed), stock=args.stock)
        tx, schedule = make_optimizer(model.params, lr=args.lr, warmup=args.warmup, steps=args.steps,
                                      weight_decay=args.weight_decay, grad_clip=args.grad_clip)
        params, opt_state, start_step = model.params, tx.init(model.params), 0
        meta = dict(model=args.model, config=args.config, model_config=dataclasses.asdict(config),
                    stock=args.stock, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len)

        ckpt = None
        if args.checkpoint_dir is not None:
            from training.checkpoint import Checkpointer

            ckpt = Checkpointer(args.checkpoint_dir)
            if args.resume and ckpt.latest_step() is not None:
                saved = ckpt.read_meta()
                if saved.get("model") != args.model:
                    raise UsageError(f"--resume: the checkpoint in {ckpt.directory} is for --model "
                                     f"{saved.get('model')}; this run is --model {args.model}")
                # parameters are float32 whatever the compute dtype: a checkpoint serves any --dtype
                shape_of = lambda c: {k: v for k, v in (c or {}).items() if k != "dtype"}  # noqa: E731
                if shape_of(saved.get("model_config")) != shape_of(meta["model_config"]):
                    raise UsageError(
                        f"--resume: the checkpoint in {ckpt.directory} is for --config {saved.get('config')} "
                        f"{shape_of(saved.get('model_config'))}; this run is --config {args.config} "
                        f"{shape_of(meta['model_config'])}")
                state, _ = ckpt.restore(train_state(params, opt_state, 0))
                params, opt_state, start_step = state["params"], state["opt_state"], int(state["step"])
                say(f"resumed from {ckpt.directory} at step {start_step}"
                    + (f" (written by the {'stock' if saved.get('stock') else 'cutelayers'} model)"
                       if saved.get("stock") != args.stock else ""))
            elif args.resume:
                say(f"--resume: no checkpoint in {ckpt.directory} yet; starting from step 0")

        params, opt_state = jax.device_put((params, opt_state), replicated)
        n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
        layers = "stock framework layers" if args.stock else "cutelayers layers"
        say(f"model: {args.model} GPT, config {args.config} ({n_params:,} parameters, {config.n_layers} "
            f"blocks, d={config.d_model}, {config.dtype} compute), {layers}")
        say(f"data: {len(data.train):,} train / {len(data.eval):,} eval bytes; batch {args.batch_size} x "
            f"{args.seq_len} tokens; {args.steps} steps, lr {args.lr:g}, warmup {args.warmup}; "
            f"backend {backend}")
        if args.devices > 1:
            say(f"data-parallel over {args.devices} {jax.default_backend()} devices: "
                f"{args.batch_size // args.devices} sequences per device per step")

        def batch(step):
            return jax.device_put(data.train_batch(step, args.batch_size, args.seq_len, args.seed),
                                  batch_sharded)

        # Compile the step ahead of time: the compiled program says which path runs.
        t0 = time.perf_counter()
        inputs, targets = batch(start_step)
        step_fn = jax.jit(make_train_step(model.loss, tx), donate_argnums=(0, 1),
                          out_shardings=replicated).lower(params, opt_state, inputs, targets).compile()
        kernel_calls = count_kernel_calls(step_fn.as_text())
        eval_fn = jax.jit(model.loss)
        path = _path_report(kernel_calls)
        if args.backend == "cute" and not kernel_calls:
            raise UsageError(f"--backend cute, but the train step has no CuTe kernel calls: {path}")
        say(f"compiled the train step in {time.perf_counter() - t0:.1f} s; path: {path}")

        metrics = None
        if args.metrics_file is not None:
            args.metrics_file.parent.mkdir(parents=True, exist_ok=True)
            metrics = open(args.metrics_file, "a" if args.resume else "w")
        history: list[dict] = []

        def record(**row):
            history.append(row)
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()

        def evaluate(step):
            loss = float(np.mean([float(eval_fn(params, x, y)) for x, y in eval_set]))
            record(step=step, split="eval", loss=loss)
            say(f"step {step:>6} | eval loss {loss:.4f}")
            return loss

        def save(step):
            if ckpt is not None:
                ckpt.save(step, train_state(params, opt_state, step), meta)

        eval_losses = []
        if start_step < args.steps:
            eval_losses.append((start_step, evaluate(start_step)))
        train_losses: list[tuple[float, int]] = []  # (mean loss, steps) per progress line
        window: list[jax.Array] = []
        start_loss = None
        tokens_per_step = args.batch_size * args.seq_len
        t_train = t_window = time.perf_counter()
        steps_in_window = 0
        for step in range(start_step + 1, args.steps + 1):
            params, opt_state, loss, grad_norm = step_fn(params, opt_state, inputs, targets)
            if step < args.steps:  # the next batch, prepared while the step runs
                inputs, targets = batch(step)
            window.append(loss)
            steps_in_window += 1
            if start_loss is None:
                start_loss = float(loss)
            if step % args.log_every == 0 or step == args.steps:
                losses = [float(v) for v in window]  # waits for the step
                now = time.perf_counter()
                tps = steps_in_window * tokens_per_step / (now - t_window)
                mean = float(np.mean(losses))
                train_losses.append((mean, steps_in_window))
                lr = float(schedule(step))
                record(step=step, split="train", loss=mean, lr=lr, grad_norm=float(grad_norm),
                       tokens_per_s=tps, elapsed_s=now - t_train)
                say(f"step {step:>6} | loss {mean:.4f} | lr {lr:.2e} | grad norm {float(grad_norm):.3f} | "
                    f"{tps / 1e3:.1f}k tokens/s")
                window, steps_in_window, t_window = [], 0, now
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                eval_losses.append((step, evaluate(step)))
                save(step)
        seconds = time.perf_counter() - t_train
        steps_run = max(0, args.steps - start_step)
        if ckpt is not None:
            ckpt.close()
        if metrics is not None:
            metrics.close()

        summary = [f"done: {steps_run} steps in {seconds:.1f} s"
                   + (f", {steps_run * tokens_per_step / seconds / 1e3:.1f}k tokens/s" if steps_run else "")]
        if steps_run:
            end_loss, window_steps = train_losses[-1]
            summary.append(f"loss: start {start_loss:.4f} (step {start_step + 1}) -> end {end_loss:.4f} "
                           f"(mean of the last {window_steps} steps)")
            summary.append(f"eval loss: {eval_losses[0][1]:.4f} (step {eval_losses[0][0]}) -> "
                           f"{eval_losses[-1][1]:.4f} (step {eval_losses[-1][0]})")
        else:
            summary.append(f"nothing to do: the checkpoint is at step {start_step} >= --steps {args.steps}")
        summary.append(f"backend: {backend} (cutelayers.current_backend()); ran: {path}")
        summary.append(f"cutelayers.cache_info(): {_cache_report()}")
        if args.plot is not None:
            summary.append(_plot(args.plot, history))
        say("\n".join(summary))

    return Result(steps_run=steps_run, final_step=args.steps if steps_run else start_step,
                  start_loss=start_loss, end_loss=train_losses[-1][0] if train_losses else None,
                  eval_losses=eval_losses, backend=backend, path=path, kernel_calls=kernel_calls,
                  params=params, opt_state=opt_state, seconds=seconds,
                  tokens_per_s=steps_run * tokens_per_step / seconds if steps_run else 0.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except UsageError as e:
        print(f"{build_parser().prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
