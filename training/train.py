"""Train a small GPT on the shipped corpus: ``python -m training.train [options]``.

The defaults (``--model nnx --config tiny``: 137k parameters, 1000 steps of 16 x 64 bytes) run on
a CPU, the loss falling from ln(256) ~ 5.55 to ~1.8 (held out ~1.9). On a Hopper GPU the same
command runs the CuTe kernels (in bfloat16 there, see ``--dtype``); ``--config small`` and
``--config gpt2`` are the GPU-sized models.

What it does, in the order :func:`train` runs it: the model and its data (byte-level tokens;
configs with a larger vocabulary use its first 256 ids); AdamW (weight decay on matrices only)
with linear warmup + cosine decay and global-norm gradient clipping; optionally the state of
a checkpoint (``--resume``: the learning-rate schedule is part of the run and is kept unless
``--reschedule``); a jit-compiled train step (compiled ahead of time, so the report can say
whether the CuTe kernels are in it); the loop; a summary.

The loop keeps the device busy: the train state is flattened once and the step takes and
returns its leaves (donated), a background thread puts the next batches on the device ahead of
use, and losses stay on the device until a log interval, fetched after the next step has been
dispatched. On a terminal a progress bar shows loss, tokens/s and ETA; elsewhere (CI, a pipe) a
plain line every ``--log-every`` steps. Evaluation on a fixed held-out set, Orbax checkpoints
(``--checkpoint-dir``), JSON-lines metrics (``--metrics-file``), a loss-curve PNG (``--plot``,
needs the ``plot`` extra: matplotlib). At the end: start / end loss, the backend setting and the
path that actually ran, and ``cutelayers.cache_info()``.

``--mesh data=D,fsdp=F,tensor=T`` trains over a (data, fsdp, tensor) mesh of D x F x T devices
(axes not named have size 1; ``--devices N`` is ``--mesh data=N``): each batch is split over data
and fsdp; fsdp also shards the large parameters and their optimizer state; tensor splits the
attention and MLP layers Megatron-style (qkv and the MLP's fc1 column-parallel, attn_out and fc2
row-parallel) and the token embedding and LM head over the vocabulary, the LM head's
cross-entropy combining its statistics across the vocabulary shards. ``training/sharding.py``
holds the rules, one table for the three frameworks. The jitted step takes and returns the state
in those shardings and XLA partitions it -- the kernels run per device on their shards by their
sharding rules (cutelayers.runtime.sharding), and XLA adds the collectives (the gradient
all-reduce, fsdp's parameter all-gathers, tensor parallel's all-reduces of the residual stream).

Several processes (one per host or GPU): ``--coordinator HOST:PORT --num-processes N
--process-id I`` (else ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES``,
``$JAX_PROCESS_ID``), the same command in every process. :func:`train` first calls
``jax.distributed.initialize``; the mesh then spans all the processes' devices, each process
builds only its devices' rows of every batch, process 0 alone prints, writes metrics and plots,
and every process writes its shards of each (Orbax) checkpoint, which ``--resume`` reads into
the current mesh whatever the number of processes that wrote it. The README's Multi-GPU section
has examples and the collectives each mesh costs.

The backend (``--backend``; default: the library's setting, ``$CUTELAYERS_BACKEND``, else auto) is
applied with ``cutelayers.use_backend`` around tracing *and* running: the setting is part of JAX's
jit key, so everything inside sees one backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import math
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

import cutelayers as cl
from models import common
from models.configs import CONFIGS, REMATS, GPTConfig, get_config
from training import sharding
from training.checkpoint import Checkpointer, CheckpointError, step_directory_error
from training.data import VOCAB_SIZE, TextData

# Per-config training defaults; any flag given on the command line wins.
DEFAULTS = {
    "tiny": {"steps": 1000, "batch_size": 16, "lr": 3e-3, "warmup": 50, "eval_every": 200},
    "small": {"steps": 2000, "batch_size": 32, "lr": 6e-4, "warmup": 200, "eval_every": 250},
    "deep24": {"steps": 1000, "batch_size": 16, "lr": 1e-3, "warmup": 100, "eval_every": 250},
    "gpt2": {"steps": 2000, "batch_size": 16, "lr": 6e-4, "warmup": 100, "eval_every": 250},
    "wide": {"steps": 1000, "batch_size": 4, "lr": 3e-4, "warmup": 100, "eval_every": 250},
    "llama": {"steps": 1000, "batch_size": 4, "lr": 3e-4, "warmup": 100, "eval_every": 250},
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


SEEDS = 2**32  # jax.random.key keeps a seed's low 32 bits: 2**32 would be seed 0 again


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
    if not 0 <= value < SEEDS:
        raise argparse.ArgumentTypeError(f"must be in 0..{SEEDS - 1} (a 32-bit seed); got {value}")
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


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--backend`` (of this command and training.sample); :func:`resolve_backend` fills its
    default."""
    parser.add_argument("--backend", choices=cl.BACKENDS, default=None,
                        help="cutelayers backend: auto = CuTe kernels on Hopper, jnp reference elsewhere; "
                             "cute = kernels or an error; reference = jnp reference everywhere (default: "
                             "the library's setting, $CUTELAYERS_BACKEND, else auto)")


def resolve_backend(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.backend``: the flag, else the library's setting (``$CUTELAYERS_BACKEND``, else auto);
    a usage error where that variable names no backend."""
    if args.backend is None:
        try:
            args.backend = cl.current_backend()
        except ValueError as e:
            parser.error(f"argument --backend: not given, so the library's setting applies: {e}")


def path_error(path: Path, *, directory: bool = False) -> str | None:
    """Why ``path`` -- a file's, or with ``directory`` a directory's -- cannot be written (made,
    with the folders above it), or None. The nearest existing folder takes a temporary file: its
    permission bits do not tell (root; /proc refuses new files whatever they say)."""
    path = path.resolve()
    if path.exists() and path.is_dir() != directory:
        return f"{path} is a file, not a directory" if directory else f"{path} is a directory; give a file's path"
    if path.is_file() and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    folder = path if path.is_dir() else next(p for p in path.parents if p.exists())
    if not folder.is_dir():
        return f"{folder} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"cannot create files in {folder} ({e.strerror or e})"
    return None


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
                        "24 narrow blocks, gpt2 = GPT-2 small's shape, wide = Llama 3.2 1B's width and vocabulary, "
                        "llama = Llama 3.2 1B's block at those shapes (RMSNorm, grouped-query attention, SwiGLU, "
                        "no biases, rotary positions)")
    p.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="total optimizer steps (with --resume: up to this step); default per config")
    add_backend_argument(p)
    p.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help="sequences per step; default per config")
    p.add_argument("--seq-len", type=_int_at_least(1), default=None,
                   help="tokens per sequence, at most the config's seq_len; default: the config's seq_len")
    p.add_argument("--lr", type=_positive_float, default=None,
                   help="peak learning rate (after warmup; cosine decay to 10%% of it); default per config")
    p.add_argument("--warmup", type=_int_at_least(0), default=None,
                   help="linear warmup steps, fewer than --steps; default per config (clamped, with a "
                        "note, to a tenth of a run shorter than it)")
    p.add_argument("--weight-decay", type=_nonneg_float, default=0.1,
                   help="AdamW weight decay, applied to weight matrices and embeddings only")
    p.add_argument("--grad-clip", type=_positive_float, default=1.0,
                   help="clip gradients to this global norm")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="the LM head reads the token embedding table, with no weight of its own "
                        "(GPTConfig.tie_embeddings; every preset has an untied head)")
    p.add_argument("--remat", choices=REMATS, default="none",
                   help="recompute each block in the backward instead of keeping its activations: "
                        "'full' keeps only the blocks' inputs, 'dots' also their matmuls' results "
                        "(GPTConfig.remat; the same parameters and gradients, less memory, more time)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (parameters stay float32); default: bfloat16 on a GPU (the CuTe "
                        "GEMMs take bfloat16/float16), elsewhere the config's (tiny: float32, "
                        "small/deep24: bfloat16)")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the parameter init and of the batches")
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
                        "notice, if there is none); the checkpoint may come from the --stock twin. The run's "
                        "learning-rate schedule (--lr, --warmup, --steps of the run that wrote it) is kept")
    p.add_argument("--reschedule", action="store_true",
                   help="with --resume: replace the checkpoint's learning-rate schedule by this command's "
                        "--lr / --warmup / --steps (the optimizer's step count carries on)")
    p.add_argument("--metrics-file", type=Path, default=None,
                   help="write metrics as JSON lines here (appended to with --resume)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="save a loss-curve PNG here (needs matplotlib: pip install -e '.[plot]'; skipped "
                        "with a message otherwise)")
    p.add_argument("--mesh", type=sharding.parse_mesh, default=None, metavar="AXIS=N[,AXIS=N...]",
                   help="train over a mesh of devices of JAX's default platform, axes data (batches split, "
                        "state replicated), fsdp (batches split, large parameters and their optimizer state "
                        "sharded) and tensor (attention, MLP, embedding and LM head split Megatron-style); "
                        "unnamed axes have size 1. --batch-size must be a multiple of data x fsdp, and tensor "
                        "must divide the config's heads, MLP width and vocabulary (default: data=1, one device)")
    p.add_argument("--devices", type=_int_at_least(1), default=None, metavar="N",
                   help="train data-parallel over N devices: the same as --mesh data=N")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="with several processes: the address of process 0's coordinator service, the same "
                        "for every process (default: $JAX_COORDINATOR_ADDRESS)")
    p.add_argument("--num-processes", type=_int_at_least(1), default=None, metavar="N",
                   help="train as one of N processes (one per host, or per GPU): jax.distributed connects "
                        "them, the mesh spans all their devices, each process builds only its devices' rows "
                        "of every batch, process 0 prints and writes metrics (default: $JAX_NUM_PROCESSES, "
                        "else 1)")
    p.add_argument("--process-id", type=_int_at_least(0), default=None, metavar="I",
                   help="this process's index, 0..N-1 (default: $JAX_PROCESS_ID)")
    p.add_argument("--stock", action="store_true",
                   help="train the twin built from the framework's own layers (same parameter tree) "
                        "instead of the cutelayers layers")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``argv``; fills per-config defaults (``args.notes``: what was adjusted,
    for :func:`train` to print). Exits with status 2 on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.notes = []
    if args.warmup is None and DEFAULTS[args.config]["warmup"] >= (args.steps or DEFAULTS[args.config]["steps"]):
        args.warmup = args.steps // 10
        args.notes.append(f"note: the {args.config} config's default warmup of {DEFAULTS[args.config]['warmup']} "
                          f"steps is not shorter than --steps {args.steps}; using --warmup {args.warmup} "
                          f"(a tenth of the run; pass --warmup to choose)")
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
    if args.reschedule and not args.resume:
        parser.error("argument --reschedule: needs --resume (a new run always uses its own schedule)")
    resolve_backend(parser, args)
    if args.devices is not None:
        if args.mesh is not None:
            parser.error(f"argument --devices: --devices {args.devices} is --mesh data={args.devices}; give "
                         f"--devices or --mesh, not both")
        flag, args.mesh = "--devices", sharding.parse_mesh(f"data={args.devices}")
    else:
        flag, args.mesh = "--mesh", args.mesh or sharding.parse_mesh("data=1")
    args.mesh_flag = f"--devices {args.devices}" if flag == "--devices" else f"--mesh {sharding.describe(args.mesh)}"
    if error := sharding.batch_error(args.mesh, args.batch_size, args.mesh_flag):
        parser.error(f"argument {flag}: {error}")
    if error := sharding.tensor_error(args.mesh, cfg, args.config):
        parser.error(f"argument --mesh: {error}")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        parser.error(f"argument --plot: expected a .png file name; got {str(args.plot)!r}")
    _process_args(parser, args)
    _check_outputs(parser, args)
    return args


def _check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for output paths that cannot be written, now rather than after training: the
    checkpoint directory (every process writes its shards), the metrics file and the plot (process
    0's)."""
    outputs = {"--checkpoint-dir": (args.checkpoint_dir, True)}
    if args.process_id == 0:
        outputs |= {"--metrics-file": (args.metrics_file, False), "--plot": (args.plot, False)}
    for flag, (path, directory) in outputs.items():
        if path is not None and (error := path_error(path, directory=directory)):
            parser.error(f"argument {flag}: {error}")
    if args.checkpoint_dir is not None and (error := step_directory_error(args.checkpoint_dir)):
        parser.error(f"argument --checkpoint-dir: {error}")


PROCESS_ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
               "process_id": "JAX_PROCESS_ID"}


def _process_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills --coordinator / --num-processes / --process-id from the environment where not given
    and checks them: several processes need all three."""
    for key, variable in PROCESS_ENV.items():
        if getattr(args, key) is None and os.environ.get(variable):
            value = os.environ[variable]
            if key != "coordinator":
                try:
                    value = _int_at_least(1 if key == "num_processes" else 0)(value)
                except argparse.ArgumentTypeError as e:
                    parser.error(f"environment variable {variable}: {e}")
            setattr(args, key, value)
    flag = {key: "--" + key.replace("_", "-") for key in PROCESS_ENV}
    if args.num_processes is None:
        args.num_processes = 1
    if args.num_processes == 1:
        if args.process_id not in (None, 0):
            parser.error(f"argument --process-id: {args.process_id} needs --num-processes {args.process_id + 1} "
                         f"or more (one process: 0)")
        args.process_id = 0
        return
    for key in ("coordinator", "process_id"):
        if getattr(args, key) is None:
            parser.error(f"argument --num-processes: {args.num_processes} processes need {flag[key]} (or "
                         f"${PROCESS_ENV[key]})")
    if args.process_id >= args.num_processes:
        parser.error(f"argument --process-id: {args.process_id} is not in 0..{args.num_processes - 1} "
                     f"(--num-processes {args.num_processes})")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"argument --coordinator: expected HOST:PORT; got {args.coordinator!r}")


def start_processes(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` when this is one of several processes, before anything
    touches the devices (once per process). On CPU, JAX's default cross-process collectives
    (gloo over TCP) then serve the mesh."""
    if args.num_processes > 1 and not jax.distributed.is_initialized():
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)


# --- training pieces ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Schedule:
    """A run's learning rate: linear warmup from 0 to ``lr`` over ``warmup`` steps, cosine decay to
    10% of it at step ``steps``, constant after. Saved with every checkpoint: it is part of the run."""

    lr: float
    warmup: int
    steps: int

    def __call__(self, step):
        return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=self.lr, warmup_steps=self.warmup,
                                                  decay_steps=self.steps, end_value=0.1 * self.lr)(step)

    def describe(self) -> str:
        return f"lr {self.lr:g}, warmup {self.warmup}, cosine decay to {0.1 * self.lr:g} at step {self.steps}"


def make_optimizer(params, schedule: Schedule, *, weight_decay: float, grad_clip: float):
    """AdamW (decay on >= 2-D leaves only) after global-norm clipping, at ``schedule``'s rate."""
    decay_mask = jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
    )


def train_state(params, opt_state, step: int) -> dict:
    """What a checkpoint holds (the step a host scalar: the same on every process)."""
    return {"params": params, "opt_state": opt_state, "step": np.asarray(step, np.int32)}


def make_train_step(loss_fn, tx):
    """(params, opt_state, inputs, targets) -> (params, opt_state, loss, grad_norm); not jitted."""

    def train_step(params, opt_state, inputs, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return train_step


@dataclasses.dataclass
class CompiledStep:
    """The train step compiled on the flat train state: ``run(leaves, inputs, targets) -> (leaves,
    loss, grad_norm)``, the leaves donated. The (params, opt_state) pytree is flattened once
    (``unflatten`` rebuilds it for evaluation and checkpoints), so a step's dispatch does no
    Python work per parameter (an ``nnx.State`` would be flattened and rebuilt in Python)."""

    run: Callable
    treedef: Any
    kernel_calls: int
    seconds: float
    hlo_text: str

    def unflatten(self, leaves):
        return jax.tree.unflatten(self.treedef, leaves)


def compile_train_step(loss_fn, tx, params, opt_state, inputs, targets) -> CompiledStep:
    """Lower and compile the step for these arguments' shapes and shardings (ahead of time: the
    compiled program says which path runs). The state comes back in the shardings it came in;
    the loss and gradient norm replicated.

    The CuTe kernels the step needs compile in worker processes while it lowers
    (``cutelayers.parallel_compiles``); all are registered when the block ends, before XLA
    compiles the lowered step."""
    leaves, treedef = jax.tree.flatten((params, opt_state))
    step = make_train_step(loss_fn, tx)

    def flat_step(leaves, inputs, targets):
        params, opt_state, loss, grad_norm = step(*jax.tree.unflatten(treedef, leaves), inputs, targets)
        return tuple(jax.tree.leaves((params, opt_state))), loss, grad_norm

    replicated = NamedSharding(inputs.sharding.mesh, PartitionSpec())
    out_shardings = (tuple(leaf.sharding for leaf in leaves), replicated, replicated)
    t0 = time.perf_counter()
    with cl.parallel_compiles():
        lowered = jax.jit(flat_step, donate_argnums=0, out_shardings=out_shardings).lower(
            tuple(leaves), inputs, targets)
    compiled = lowered.compile()
    text = compiled.as_text()
    return CompiledStep(run=compiled, treedef=treedef, kernel_calls=count_kernel_calls(text),
                        seconds=time.perf_counter() - t0, hlo_text=text)


def count_kernel_calls(hlo_text: str) -> int:
    """CuTe kernel calls (XLA custom calls to cutelayers FFI targets) in compiled HLO text. The
    compiled program, not the lowered one: on several devices XLA's partitioner emits the kernel
    calls, per device, only when it compiles."""
    return sum('custom_call_target="cutelayers_' in line for line in hlo_text.splitlines())


def training_mesh(args: argparse.Namespace) -> jax.sharding.Mesh:
    """The (data, fsdp, tensor) mesh of ``--mesh`` over the first devices of JAX's default
    platform (:func:`training.sharding.device_mesh`); with several processes, over all of theirs."""
    if error := sharding.device_error(args.mesh, args.mesh_flag):
        raise UsageError(error)
    return sharding.device_mesh(args.mesh)


class DevicePrefetcher:
    """Batches ``place(make(step))`` for ``steps`` (``place``: host arrays to device arrays), put on
    the devices ``depth`` steps ahead of use by a background thread, so neither building a batch
    nor its host-to-device copy sits between two train steps. Iterate once; :meth:`close` stops
    the thread (also on an early exit)."""

    def __init__(self, make: Callable[[int], Any], steps: range, place: Callable[[Any], Any], *,
                 depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._steps = steps
        self._thread = threading.Thread(target=self._fill, args=(make, place), daemon=True)
        self._thread.start()

    def _fill(self, make, place):
        for step in self._steps:
            try:
                item = place(make(step))
            except Exception as error:  # noqa: BLE001  (re-raised in the consumer's thread)
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or isinstance(item, Exception):
                return

    def __iter__(self) -> Iterator:
        for _ in self._steps:
            item = self._queue.get()
            if isinstance(item, Exception):
                raise item
            yield item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def rate_text(tokens_per_s: float) -> str:
    """A throughput for the log: thousands to one decimal (12.3k tokens/s); below 1000 three
    significant digits (37.2 tokens/s), where 0.0k read as no progress."""
    if tokens_per_s >= 999.5:  # (3 digits would round it to 1e+03)
        return f"{tokens_per_s / 1e3:.1f}k tokens/s"
    return f"{tokens_per_s:.3g} tokens/s"


class Progress:
    """What the loop shows: on a terminal a progress bar (step, loss, tokens/s, ETA) redrawn at most
    10 times a second, with other lines printed above it; elsewhere a plain line per log interval."""

    def __init__(self, out, first_step: int, last_step: int, tokens_per_step: int):
        self.out, self.first, self.last, self._tokens_per_step = out, first_step, last_step, tokens_per_step
        self.is_tty = bool(getattr(out, "isatty", lambda: False)())
        self._loss = self._tps = None
        self._drawn_at = 0.0

    def print(self, text: str) -> None:
        print(("\r\033[K" if self.is_tty else "") + text, file=self.out, flush=True)

    def step(self, step: int) -> None:
        """Called every step: only a terminal, at most every 0.1 s, gets anything."""
        if self.is_tty and time.perf_counter() - self._drawn_at > 0.1:
            self._draw(step)

    def window(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        self._loss, self._tps = loss, tokens_per_s
        if self.is_tty:
            self._draw(step)
        else:
            self.print(f"step {step:>6} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                       f"{rate_text(tokens_per_s)}")

    def _draw(self, step: int) -> None:
        done = (step - self.first) / max(1, self.last - self.first)
        bar = "#" * int(30 * done) + "-" * (30 - int(30 * done))
        parts = [f"step {step}/{self.last} [{bar}]"]
        if self._loss is not None:
            tokens_left = (self.last - step) * self._tokens_per_step
            eta = tokens_left / self._tps if self._tps else float("nan")
            parts += [f"loss {self._loss:.4f}", rate_text(self._tps),
                      f"ETA {int(eta) // 60}:{int(eta) % 60:02d}" if math.isfinite(eta) else "ETA ?"]
        print("\r\033[K" + " | ".join(parts), end="", file=self.out, flush=True)
        self._drawn_at = time.perf_counter()

    def close(self) -> None:
        if self.is_tty:
            print(file=self.out, flush=True)


class LibraryNotes(logging.Handler):
    """Collects what cutelayers and the models log (which path runs and why, the attention
    implementation) while :func:`train` builds and compiles, so the run prints it as one line of
    its own format, whatever handlers other libraries (Orbax's absl) put on the root logger."""

    LOGGERS = ("cutelayers", "models")

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.messages: list[str] = []
        self._saved: list[tuple[logging.Logger, int, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> Self:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.level, logger.propagate))
            logger.setLevel(logging.INFO)
            logger.propagate = False
            logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for logger, level, propagate in self._saved:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate

    def take(self) -> str | None:
        """The messages so far as one line (None if there were none), and forget them."""
        text, self.messages = " | ".join(self.messages), []
        return f"notes: {text}" if text else None


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
    return json.dumps({k: {"compiles": v.compiles, "memory_hits": v.memory_hits, "disk_hits": v.disk_hits,
                           "compile_seconds": round(v.compile_seconds, 2), "load_seconds": round(v.load_seconds, 2)}
                       for k, v in info.items()})


def _plot(path: Path, train_curve: list[tuple[int, float]], eval_losses: list[tuple[int, float]]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed; skipped {path} (pip install -e '.[plot]')"
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in (("train (every step)", train_curve), ("eval", eval_losses)):
        if points:  # markers: a short run's curve has few points, a one-point line is invisible
            ax.plot(*zip(*points), marker="o", markersize=2 if len(points) > 50 else 4, linewidth=1, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f"loss curve: {path}"


# --- the run, step by step ------------------------------------------------------------------------

def model_config(args: argparse.Namespace) -> GPTConfig:
    """The preset of ``--config`` in the compute dtype of ``--dtype`` (default: bfloat16 on a GPU)."""
    dtype = args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else None)
    # tensor parallel shards the qkv kernel's columns, which the q / k / v planes would cut
    # across devices (see GPTConfig.split_qkv)
    split = {"split_qkv": False} if args.mesh["tensor"] > 1 else {}
    tied = {"tie_embeddings": True} if args.tie_embeddings else {}
    config = get_config(args.config, **({"dtype": dtype} if dtype else {}), **split, **tied, remat=args.remat)
    if config.vocab_size < VOCAB_SIZE:
        raise UsageError(f"--config {args.config}: vocab_size={config.vocab_size} is smaller than the data's "
                         f"byte vocabulary ({VOCAB_SIZE})")
    if error := platform_error(args.backend, config.dtype):
        raise UsageError(error)
    return config


def platform_error(backend: str, dtype: str) -> str | None:
    """Why JAX's default platform cannot run ``backend`` at compute ``dtype`` (this command's and
    training.sample's check, once JAX may start), or None."""
    platform = jax.default_backend()
    if backend == "cute" and platform != "gpu":
        return (f"--backend cute needs a Hopper GPU; JAX's platform here is {platform!r}. Use --backend auto "
                "or reference.")
    if dtype == "float16" and platform == "cpu":
        return ("compute dtype float16 cannot run on the CPU: its matmuls take no float16 operands with float32 "
                "accumulation (XLA: precision F16_F16_F32 is not supported by dot_general on CPU). On a CPU, "
                "train with --dtype float32 or bfloat16; float16 runs on a GPU.")
    return None


def run_meta(args: argparse.Namespace, config: GPTConfig) -> dict:
    """What a checkpoint records about the run besides its arrays."""
    return {"model": args.model, "config": args.config, "model_config": dataclasses.asdict(config),
            "stock": args.stock, "seed": args.seed, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "schedule": dataclasses.asdict(requested_schedule(args))}


def requested_schedule(args: argparse.Namespace) -> Schedule:
    """The learning-rate schedule this command's flags ask for."""
    return Schedule(args.lr, args.warmup, args.steps)


def open_checkpoint(args: argparse.Namespace, meta: dict, say):
    """(Checkpointer or None, metadata of the checkpoint to resume from or None); checks that the
    checkpoint is one of this model and config."""
    if args.checkpoint_dir is None:
        return None, None
    ckpt = Checkpointer(args.checkpoint_dir)
    if not args.resume:
        if (latest := ckpt.latest_step()) is not None:  # Orbax would skip every save at or below it
            raise UsageError(f"--checkpoint-dir: {ckpt.directory} holds a run's checkpoints (the latest at step "
                             f"{latest}); pass --resume to continue that run, or choose another directory")
        return ckpt, None
    if ckpt.latest_step() is None:
        say(f"--resume: no checkpoint in {ckpt.directory} yet; starting from step 0")
        return ckpt, None
    saved = ckpt.read_meta()
    if saved.get("model") != args.model:
        raise UsageError(f"--resume: the checkpoint in {ckpt.directory} is for --model {saved.get('model')}; "
                         f"this run is --model {args.model}")
    # parameters are float32 whatever the compute dtype, and the same whether q, k, v come out
    # apart or not (split_qkv, off under tensor parallel) and whatever the blocks recompute: a
    # checkpoint serves any --dtype / --mesh / --remat. A field the checkpoint's config predates
    # has its default (the model it was written by).
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    runtime_only = ("dtype", "split_qkv", "remat")
    shape_of = lambda c: {k: v for k, v in {**defaults, **(c or {})}.items() if k not in runtime_only}
    theirs, ours = shape_of(saved.get("model_config")), shape_of(meta["model_config"])
    if theirs != ours:
        differs = ", ".join(f"{k} {theirs.get(k)!r} (this run: {ours.get(k)!r})"
                            for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
        raise UsageError(f"--resume: the checkpoint in {ckpt.directory} is for --config {saved.get('config')} "
                         f"with {differs}; this run is --config {args.config}")
    # the data settings may change on resume (the batches from here on follow this command's)
    changed = [f"--{name.replace('_', '-')} {getattr(args, name)} (the run's was {saved[name]})"
               for name in ("batch_size", "seq_len", "seed") if name in saved and saved[name] != getattr(args, name)]
    if changed:
        say(f"--resume: this command changes the data from here on: {', '.join(changed)}")
    return ckpt, saved


def choose_schedule(args: argparse.Namespace, saved: dict | None, say) -> Schedule:
    """This command's schedule for a new run (or with --reschedule); the checkpoint's when resuming.
    Says what it did whenever the two differ."""
    requested = requested_schedule(args)
    if saved is None:
        return requested
    if "schedule" not in saved:
        say(f"--resume: the checkpoint records no learning-rate schedule; using this command's ({requested.describe()})")
        return requested
    kept = Schedule(**saved["schedule"])
    if kept == requested:
        return kept
    if args.reschedule:
        say(f"--reschedule: learning-rate schedule {requested.describe()} (the checkpoint's was {kept.describe()})")
        return requested
    beyond = (f"; steps {kept.steps + 1}..{args.steps} run at its final {0.1 * kept.lr:g}"
              if args.steps > kept.steps else "")
    say(f"--resume: keeping the run's learning-rate schedule ({kept.describe()}){beyond}. --reschedule uses "
        f"this command's ({requested.describe()}) instead")
    return kept


def initial_state(model, tx, mesh, ckpt, saved: dict | None, stock: bool, say):
    """(params, opt_state, step) on ``mesh`` in the shardings of :mod:`training.sharding`: fresh,
    or restored from the latest checkpoint when resuming (each device reads its shards, whatever
    mesh wrote them)."""
    params, opt_state = model.params, tx.init(model.params)
    if saved is None:
        return *sharding.place_state(mesh, (params, opt_state)), 0
    shardings = sharding.state_shardings(mesh, (params, opt_state))
    like = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), (params, opt_state),
                        shardings)
    state, _ = ckpt.restore(train_state(*like, 0))
    step = int(state["step"])
    say(f"resumed from {ckpt.directory} at step {step}"
        + (f" (written by the {'stock' if saved.get('stock') else 'cutelayers'} model)"
           if saved.get("stock") != stock else ""))
    return state["params"], state["opt_state"], step


@dataclasses.dataclass
class _Window:
    """The steps since the last log line: per-step losses still on the device."""

    last_step: int
    losses: list
    grad_norm: jax.Array


@dataclasses.dataclass
class LoopResult:
    leaves: tuple
    train_curve: list[tuple[int, float]]  # (step, loss) of every step
    window_means: list[tuple[float, int]]  # (mean loss, steps) per log interval
    eval_losses: list[tuple[int, float]]
    train_seconds: float  # time in train steps: evaluation and checkpoints excluded


def run_loop(args, step_fn: CompiledStep, leaves, batches, schedule: Schedule, *, first_step: int,
             evaluate, save, record, progress: Progress) -> LoopResult:
    """Steps ``first_step..args.steps``. Nothing here waits for the device except evaluation and
    the metrics of a log interval, fetched after the next step is dispatched."""
    tokens_per_step = args.batch_size * args.seq_len
    out = LoopResult(leaves=leaves, train_curve=[], window_means=[], eval_losses=[], train_seconds=0.0)
    losses: list[jax.Array] = []
    pending: _Window | None = None
    # every step's rate on the host up front: evaluating the optax schedule at the first log line
    # compiled its ops there, inside the timed window
    learning_rates = np.asarray(jax.jit(jax.vmap(schedule))(np.arange(args.steps + 1)))
    mark, excluded = time.perf_counter(), 0.0

    def report(window: _Window):
        nonlocal mark, excluded
        values, grad_norm = jax.device_get((window.losses, window.grad_norm))  # waits for its last step
        now = time.perf_counter()
        seconds, mark, excluded = now - mark - excluded, now, 0.0
        out.train_seconds += seconds
        first = window.last_step - len(values) + 1
        out.train_curve += [(first + i, float(v)) for i, v in enumerate(values)]
        # the rate the window's last step applied: optax counts updates from 0, the steps from 1
        lr = float(learning_rates[window.last_step - 1])
        mean, tps = float(np.mean(values)), len(values) * tokens_per_step / seconds
        out.window_means.append((mean, len(values)))
        record(step=window.last_step, split="train", loss=mean, lr=lr, grad_norm=float(grad_norm),
               tokens_per_s=tps, elapsed_s=out.train_seconds)
        progress.window(window.last_step, mean, lr, float(grad_norm), tps)

    for step, (inputs, targets) in zip(range(first_step, args.steps + 1), batches):
        leaves, loss, grad_norm = step_fn.run(leaves, inputs, targets)
        losses.append(loss)
        if pending is not None:  # the previous interval's metrics, while this step runs
            report(pending)
            pending = None
        if step % args.log_every == 0 or step == args.steps:
            pending, losses = _Window(step, losses, grad_norm), []
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
            if pending is not None:
                report(pending)
                pending = None
            started = time.perf_counter()
            out.eval_losses.append((step, evaluate(step, leaves)))
            save(step, leaves)
            excluded += time.perf_counter() - started
        progress.step(step)
    if pending is not None:
        report(pending)
    out.leaves = leaves
    return out


@dataclasses.dataclass
class Result:
    """What :func:`train` returns (and prints a summary of)."""

    steps_run: int
    final_step: int
    start_loss: float | None
    end_loss: float | None
    eval_losses: list[tuple[int, float]]
    train_curve: list[tuple[int, float]]
    backend: str
    path: str
    kernel_calls: int
    step_hlo: str  # the compiled train step: one device's program, collectives included
    params: Any
    opt_state: Any
    schedule: Schedule
    compile_seconds: float
    seconds: float  # the loop's wall time, evaluation and checkpoints included
    tokens_per_s: float  # over the train steps only


def train(args: argparse.Namespace, *, out=sys.stdout) -> Result:
    """Run the training described by ``args`` (from :func:`parse_args`). With several processes
    (``--num-processes``) every process runs it; only process 0 prints, writes metrics and plots
    (checkpoints: every process writes its shards)."""
    start_processes(args)
    is_main = jax.process_index() == 0
    if not is_main:
        out = io.StringIO()

    def say(*parts):
        print(*parts, file=out, flush=True)

    config = model_config(args)
    data = TextData.load()
    data.check_seq_len(args.seq_len)
    mesh = training_mesh(args)
    batch_sharded = sharding.batch_sharding(mesh)
    rows = sharding.process_rows(batch_sharded, args.batch_size)  # of every batch, this process's

    def place(batch):
        return sharding.global_batch(batch_sharded, batch, args.batch_size)

    meta = run_meta(args, config)

    with cl.use_backend(args.backend), LibraryNotes() as notes:
        backend = cl.current_backend()
        model = common.init(args.model, config, jax.random.key(args.seed), stock=args.stock)
        ckpt, saved = open_checkpoint(args, meta, say)
        schedule = choose_schedule(args, saved, say)
        if schedule == requested_schedule(args):  # the notes adjust this command's
            for note in getattr(args, "notes", ()):  # schedule: moot where a resume keeps the run's
                say(note)
        meta["schedule"] = dataclasses.asdict(schedule)
        tx = make_optimizer(model.params, schedule, weight_decay=args.weight_decay, grad_clip=args.grad_clip)
        params, opt_state, start_step = initial_state(model, tx, mesh, ckpt, saved, args.stock, say)
        say(describe_run(args, config, data, params, backend, schedule))
        if start_step >= args.steps:  # resumed at or past the end: nothing to compile or run
            if ckpt is not None:
                ckpt.close()
            result = Result(
                steps_run=0, final_step=start_step, start_loss=None, end_loss=None, eval_losses=[], train_curve=[],
                backend=backend, path="nothing compiled", kernel_calls=0, step_hlo="", params=params,
                opt_state=opt_state, schedule=schedule, compile_seconds=0.0, seconds=0.0, tokens_per_s=0.0)
            say(summary(result, None, args, start_step, notes.take()))
            return result

        def batch(step):
            return data.train_batch(step, args.batch_size, args.seq_len, args.seed, rows=rows)

        eval_set = [place(b) for b in data.eval_batches(args.batch_size, args.seq_len, args.eval_batches, rows=rows)]

        first = place(batch(start_step + 1))
        step_fn = compile_train_step(model.loss, tx, params, opt_state, *first)
        path = _path_report(step_fn.kernel_calls)
        if args.backend == "cute" and not step_fn.kernel_calls:
            raise UsageError(f"--backend cute, but the train step has no CuTe kernel calls: {path}")
        say(f"compiled the train step in {step_fn.seconds:.1f} s; path: {path}; attention: "
            f"{common.attention_implementation(config.compute_dtype, config.head_dim)}")
        leaves = tuple(jax.tree.leaves((params, opt_state)))
        del params, opt_state  # donated to the first step: only `leaves` may be used from here
        eval_loss = jax.jit(lambda leaves, x, y: model.loss(step_fn.unflatten(leaves)[0], x, y))
        if eval_set:  # compiled now, so that the library's notes on it join the train step's in one line
            eval_loss = eval_loss.lower(leaves, *eval_set[0]).compile()
        for line in filter(None, [notes.take()]):
            say(line)

        metrics = None
        if args.metrics_file is not None and is_main:
            args.metrics_file.parent.mkdir(parents=True, exist_ok=True)
            metrics = open(args.metrics_file, "a" if args.resume else "w")  # noqa: SIM115  (closed below)

        def record(**row):
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()

        progress = Progress(out, start_step, args.steps, args.batch_size * args.seq_len)

        def evaluate(step, leaves):
            loss = float(np.mean(jax.device_get([eval_loss(leaves, x, y) for x, y in eval_set])))
            record(step=step, split="eval", loss=loss)
            progress.print(f"step {step:>6} | eval loss {loss:.4f}")
            return loss

        def save(step, leaves):
            if ckpt is not None:
                ckpt.save(step, train_state(*step_fn.unflatten(leaves), step), meta)

        eval_losses = [(start_step, evaluate(start_step, leaves))]
        steps = range(start_step + 1, args.steps + 1)
        batches = DevicePrefetcher(batch, steps, place)
        t_loop = time.perf_counter()
        try:
            loop = run_loop(args, step_fn, leaves, batches, schedule, first_step=start_step + 1,
                            evaluate=evaluate, save=save, record=record, progress=progress)
        finally:
            batches.close()
            progress.close()
            if ckpt is not None:
                ckpt.close()
            if metrics is not None:
                metrics.close()
        seconds = time.perf_counter() - t_loop
        eval_losses += loop.eval_losses
        params, opt_state = step_fn.unflatten(loop.leaves)
        result = Result(
            steps_run=len(steps), final_step=args.steps,
            start_loss=loop.train_curve[0][1] if loop.train_curve else None,
            end_loss=loop.window_means[-1][0] if loop.window_means else None,
            eval_losses=eval_losses, train_curve=loop.train_curve, backend=backend, path=path,
            kernel_calls=step_fn.kernel_calls, step_hlo=step_fn.hlo_text, params=params, opt_state=opt_state, schedule=schedule,
            compile_seconds=step_fn.seconds, seconds=seconds,
            tokens_per_s=len(steps) * args.batch_size * args.seq_len / loop.train_seconds)
        say(summary(result, loop, args, start_step, notes.take()))
    return result


def describe_run(args, config: GPTConfig, data: TextData, params, backend: str, schedule: Schedule) -> str:
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    layers = "stock framework layers" if args.stock else "cutelayers layers"
    lines = [(f"model: {args.model} GPT, config {args.config} ({n_params:,} parameters, {config.n_layers} blocks, "
              f"d={config.d_model}, vocab {config.vocab_size}, {config.dtype} compute), {layers}"),
             (f"data: {len(data.train):,} train / {len(data.eval):,} eval bytes; batch {args.batch_size} x "
              f"{args.seq_len} tokens; {args.steps} steps, {schedule.describe()}; backend {backend}")]
    n_devices = math.prod(args.mesh.values())
    if n_devices > 1:
        shards = args.mesh["data"] * args.mesh["fsdp"]
        per_device = sharding.bytes_per_device(params)
        total = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in jax.tree.leaves(params))
        lines.append(f"mesh {sharding.describe(args.mesh)} over {n_devices} {jax.default_backend()} devices: "
                     f"{args.batch_size // shards} sequences per batch shard per step; "
                     f"{per_device / total:.0%} of the parameters on each device")
    return "\n".join(lines)


def summary(result: Result, loop: LoopResult | None, args, start_step: int, notes: str | None) -> str:
    lines = []
    if result.steps_run:
        lines.append(f"done: {result.steps_run} steps in {result.seconds:.1f} s ({loop.train_seconds:.1f} s in "
                     f"train steps, {rate_text(result.tokens_per_s)}; evaluation and checkpoints "
                     f"excluded); compile {result.compile_seconds:.1f} s")
        end_loss, window_steps = loop.window_means[-1]
        lines.append(f"loss: start {result.start_loss:.4f} (step {start_step + 1}) -> end {end_loss:.4f} "
                     f"(mean of the last {window_steps} steps)")
        lines.append(f"eval loss: {result.eval_losses[0][1]:.4f} (step {result.eval_losses[0][0]}) -> "
                     f"{result.eval_losses[-1][1]:.4f} (step {result.eval_losses[-1][0]})")
    else:
        lines.append(f"nothing to do: the checkpoint is at step {start_step} >= --steps {args.steps}")
    if notes:
        lines.append(notes)
    lines.append(f"backend: {result.backend} (cutelayers.current_backend()); ran: {result.path}")
    lines.append(f"cutelayers.cache_info(): {_cache_report()}")
    if args.plot is not None and jax.process_index() == 0:
        lines.append(_plot(args.plot, result.train_curve, result.eval_losses))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except UsageError as e:
        print(f"{build_parser().prog}: error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"{build_parser().prog}: error: --checkpoint-dir: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
