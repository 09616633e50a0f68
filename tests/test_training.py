"""The training job (training/): data, a few steps per framework, checkpoints and resume, the
command line and the metrics file. All on CPU with the tiny config and short sequences."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import cutelayers as cl
from models import common
from models.configs import get_config
from numerics import assert_close
from training import data as data_mod
from training.checkpoint import Checkpointer
from training import sample
from training.train import DevicePrefetcher, build_parser, main, parse_args, train

REPO = Path(__file__).resolve().parents[1]
FAST = ["--batch-size", "8", "--seq-len", "32", "--eval-batches", "2", "--warmup", "5", "--lr", "1e-2"]


@pytest.fixture(autouse=True)
def fresh_cache():
    cl.clear_cache()  # cache_info() then describes this test's run only
    yield


def run(argv):
    """train() on parsed argv; returns (Result, printed text)."""
    out = io.StringIO()
    result = train(parse_args(argv), out=out)
    return result, out.getvalue()


def assert_same_params(a, b):
    assert common.tree_signature(a) == common.tree_signature(b)
    for (path, u), v in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=jax.tree_util.keystr(path))


# --- data ----------------------------------------------------------------------------------------

def test_corpus_and_batches():
    text = data_mod.CORPUS_PATH.read_text()
    assert 40_000 < len(text.encode()) <= 200_000 and "Alice" in text
    assert data_mod.decode(data_mod.encode("Down the Rabbit-Hole")) == "Down the Rabbit-Hole"
    d = data_mod.TextData.load()
    assert len(d.eval) >= 2048 and len(d.train) + len(d.eval) == len(data_mod.load_corpus())
    x, y = d.train_batch(7, 4, 32, seed=3)
    assert x.shape == y.shape == (4, 32) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    x2, _ = d.train_batch(7, 4, 32, seed=3)
    np.testing.assert_array_equal(x, x2)  # a pure function of (seed, step)
    assert not np.array_equal(x, d.train_batch(8, 4, 32, seed=3)[0])
    evals = d.eval_batches(4, 32, max_batches=3)
    assert len(evals) == 3 and all(b[0].shape == (4, 32) for b in evals)
    with pytest.raises(ValueError, match="too long"):
        d.check_seq_len(10**6)


# --- a few steps per framework -------------------------------------------------------------------

@pytest.mark.parametrize("framework", common.FRAMEWORKS)
def test_a_few_steps_reduce_the_loss(framework, tmp_path):
    metrics, png = tmp_path / "m.jsonl", tmp_path / "loss.png"
    result, text = run(["--model", framework, "--steps", "25", "--log-every", "5", "--eval-every", "0",
                        "--metrics-file", str(metrics), "--plot", str(png), *FAST])
    assert result.steps_run == 25 and result.final_step == 25
    assert result.start_loss > 5.0 and result.end_loss < result.start_loss - 1.0, text
    assert result.eval_losses[-1][1] < result.eval_losses[0][1] - 1.0, text
    # on CPU the reference path runs, and the report says so
    assert result.backend == "auto" and result.kernel_calls == 0
    assert "jnp reference" in text and "cutelayers.cache_info(): {}" in text and "tokens/s" in text
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [5, 10, 15, 20, 25]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [0, 25]
    keys = {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"}
    assert all(keys <= set(r) for r in rows if r["split"] == "train")
    try:  # the loss curve is written, or skipped with a message without matplotlib
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in text and not png.exists()
    else:
        assert png.exists() and png.stat().st_size > 0


# --- data parallel ---------------------------------------------------------------------------------

def test_data_parallel_matches_one_device():
    """--devices 2 on two of the fake CPU devices (see conftest): the same seed and batches give
    the same losses and parameters as --devices 1, up to float32 summation order."""
    base = ["--steps", "8", "--log-every", "1", "--eval-every", "4", *FAST]
    one, _ = run([*base, "--devices", "1"])
    two, text = run([*base, "--devices", "2"])
    assert "data-parallel over 2 cpu devices: 4 sequences per device per step" in text
    assert [s for s, _ in two.eval_losses] == [s for s, _ in one.eval_losses] == [0, 4, 8]
    for got, ref in [(two.start_loss, one.start_loss), (two.end_loss, one.end_loss),
                     *zip([v for _, v in two.eval_losses], [v for _, v in one.eval_losses])]:
        assert_close(got, ref, "float32", scale=2)
    assert two.end_loss < two.start_loss  # it trained
    leaves = jax.tree.leaves(two.params)
    assert all(len(p.sharding.device_set) == 2 and p.sharding.is_fully_replicated for p in leaves)
    for got, ref in zip(leaves, jax.tree.leaves(one.params)):
        # Adam divides by sqrt(v): summation-order noise in tiny gradients shows more in parameters
        assert_close(got, np.asarray(ref), "float32", scale=50)


def test_more_devices_than_visible_is_a_clear_error(capsys):
    assert main(["--devices", "64", "--steps", "8", *FAST, "--batch-size", "64"]) == 2
    assert f"--devices 64: only {len(jax.devices())} cpu device(s) visible" in capsys.readouterr().err


# --- checkpoints -----------------------------------------------------------------------------------

def test_checkpoint_round_trip_and_exact_resume(tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    base = ["--model", "nnx", "--steps", "12", "--eval-every", "4", "--log-every", "4",
            "--checkpoint-dir", str(ckpt), "--metrics-file", str(metrics), *FAST]
    full, _ = run(base)  # checkpoints at steps 8 and 12 are kept
    assert Checkpointer(ckpt).latest_step() == 12
    # restore -> exactly the final parameters
    like = common.init("nnx", get_config("tiny"), jax.random.key(1), abstract=True)
    state, meta = Checkpointer(ckpt).restore({"params": like.params, "opt_state": full.opt_state,
                                              "step": np.zeros((), np.int32)})
    assert int(state["step"]) == 12 and meta["model"] == "nnx" and meta["stock"] is False
    assert_same_params(state["params"], full.params)
    # drop the last checkpoint, resume from step 8: steps 9..12 again, bit for bit
    shutil.rmtree(ckpt / "12")
    resumed, text = run([*base, "--resume"])
    assert "resumed from" in text and "at step 8" in text
    assert resumed.steps_run == 4 and resumed.final_step == 12
    assert_same_params(resumed.params, full.params)
    # the metrics file was appended to, and every line is JSON
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [4, 8, 12, 12]
    # nothing left to do
    again, text = run([*base, "--resume"])
    assert again.steps_run == 0 and "nothing to do" in text


def test_stock_checkpoint_continues_in_the_cutelayers_model(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = ["--model", "equinox", "--eval-every", "0", "--log-every", "2", "--checkpoint-dir", str(ckpt),
            *FAST]
    stock, _ = run([*base, "--steps", "8", "--stock"])
    ours, text = run([*base, "--steps", "10", "--resume"])
    assert "at step 8 (written by the stock model)" in text
    assert ours.steps_run == 2
    # the restored state carries on where the stock model stopped (no jump back to ~5.5)
    assert ours.start_loss < stock.eval_losses[0][1] - 1.0
    assert_close(ours.eval_losses[0][1], stock.eval_losses[-1][1], "float32", scale=10)


# --- command line ----------------------------------------------------------------------------------

def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, "-m", "training.train", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in proc.stdout
        assert action.help, action.option_strings


@pytest.mark.parametrize("argv,message", [
    (["--model", "torch"], "argument --model: invalid choice: 'torch'"),
    (["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    (["--backend", "triton"], "argument --backend: invalid choice"),
    (["--steps", "0"], "argument --steps: must be >= 1; got 0"),
    (["--steps", "ten"], "argument --steps: must be an integer; got 'ten'"),
    (["--lr", "-1"], "argument --lr: must be a positive finite number"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["--seq-len", "65"], "argument --seq-len: 65 exceeds the tiny config's position table"),
    (["--steps", "10", "--warmup", "10"], "argument --warmup: 10 warmup steps must be fewer than --steps=10"),
    (["--resume"], "argument --resume: needs --checkpoint-dir"),
    (["--reschedule"], "argument --reschedule: needs --resume"),
    (["--plot", "curve.jpg"], "argument --plot: expected a .png file name"),
    (["--weight-decay", "-0.1"], "argument --weight-decay: must be a finite number >= 0"),
    (["--devices", "0"], "argument --devices: must be >= 1; got 0"),
    (["--batch-size", "6", "--devices", "4"],
     "argument --devices: --batch-size 6 is not a multiple of --devices 4"),
])
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_default_warmup_longer_than_the_run_is_clamped_with_a_note():
    args = parse_args(["--steps", "50"])  # tiny's default warmup is 50
    assert args.warmup == 5
    assert args.notes == [("note: the tiny config's default warmup of 50 steps is not shorter than --steps 50; "
                           "using --warmup 5 (a tenth of the run; pass --warmup to choose)")]
    assert parse_args(["--steps", "51"]).warmup == 50 and parse_args(["--steps", "51"]).notes == []


def test_cute_backend_without_a_gpu_is_a_clear_error(capsys):
    assert main(["--backend", "cute", "--steps", "8", *FAST]) == 2
    assert "--backend cute needs a Hopper GPU" in capsys.readouterr().err


# --- the learning-rate schedule on resume -------------------------------------------------------------

def test_resume_keeps_the_schedule_unless_rescheduled(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = ["--model", "linen", "--eval-every", "0", "--log-every", "2", "--checkpoint-dir", str(ckpt), *FAST]
    first, _ = run([*base, "--steps", "8"])
    assert (first.schedule.lr, first.schedule.warmup, first.schedule.steps) == (1e-2, 5, 8)
    kept, text = run([*base, "--steps", "12", "--resume"])
    assert kept.schedule == first.schedule
    assert ("--resume: keeping the run's learning-rate schedule (lr 0.01, warmup 5, cosine decay to 0.001 at "
            "step 8); steps 9..12 run at its final 0.001") in text
    assert Checkpointer(ckpt).read_meta()["schedule"]["steps"] == 8  # what the continued run saved
    shutil.rmtree(ckpt / "12")
    new, text = run([*base, "--steps", "12", "--resume", "--reschedule", "--lr", "5e-3"])
    assert (new.schedule.lr, new.schedule.steps) == (5e-3, 12)
    assert "--reschedule: learning-rate schedule lr 0.005, warmup 5, cosine decay to 0.0005 at step 12" in text


# --- what the loop shows ---------------------------------------------------------------------------

class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_plain_lines_elsewhere():
    argv = ["--steps", "6", "--log-every", "2", "--eval-every", "0", *FAST]
    tty = Terminal()
    train(parse_args(argv), out=tty)
    bar = tty.getvalue()
    assert "\r" in bar and "step 6/6 [" in bar and "ETA" in bar and "tokens/s" in bar
    assert "| loss " in bar and "step      2 | loss" not in bar  # the bar instead of the lines
    _, plain = run(argv)
    assert "\r" not in plain and "ETA" not in plain
    assert [line.split("|")[0].strip() for line in plain.splitlines() if "| loss" in line] == [
        "step      2", "step      4", "step      6"]


@pytest.mark.parametrize("checkpoint", [False, True])
def test_path_notes_are_one_line_of_the_same_format(checkpoint, tmp_path):
    """The library's reasons for the reference path are one line, the same with --checkpoint-dir
    (Orbax's logging on the root logger does not reformat them)."""
    argv = ["--steps", "6", "--eval-every", "0", *FAST] + (["--checkpoint-dir", str(tmp_path)] if checkpoint else [])
    proc = subprocess.run([sys.executable, "-m", "training.train", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stdout.splitlines() if "reference path" in line]
    assert len(notes) == 1 and notes[0].startswith("notes: cutelayers: running the reference path"), proc.stdout
    assert "reference path" not in proc.stderr, proc.stderr


def test_prefetcher_keeps_order_and_raises_the_producers_error():
    device = jax.devices("cpu")[0]
    fetched = DevicePrefetcher(lambda step: np.full((2,), step), range(3, 9), device)
    assert [int(b[0]) for b in fetched] == [3, 4, 5, 6, 7, 8]
    fetched.close()

    def make(step):
        if step == 2:
            raise ValueError("no batch 2")
        return np.zeros(1)

    failing = DevicePrefetcher(make, range(5), device)
    with pytest.raises(ValueError, match="no batch 2"):
        list(failing)
    failing.close()


# --- sampling ------------------------------------------------------------------------------------

def test_sample_continues_the_prompt(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    trained, _ = run(["--model", "equinox", "--steps", "40", "--eval-every", "0", "--checkpoint-dir", str(ckpt),
                      *FAST])
    assert trained.end_loss < 3.5
    argv = ["--checkpoint-dir", str(ckpt), "--prompt", "Alice was ", "--tokens", "40", "--temperature", "0"]
    assert sample.main(argv) == 0
    greedy = capsys.readouterr().out.rstrip("\n")
    assert greedy.startswith("Alice was ") and len(greedy.encode()) >= len("Alice was ") + 20
    assert sample.main(argv) == 0 and capsys.readouterr().out.rstrip("\n") == greedy  # deterministic
    # trained on English: mostly letters and spaces, not uniform noise over 256 bytes
    generated = greedy[len("Alice was "):]
    assert sum(c.isalpha() or c == " " for c in generated) > 0.8 * len(generated), generated
    assert sample.main(["--checkpoint-dir", str(tmp_path / "none")]) == 2
    assert "--checkpoint-dir: no checkpoint in" in capsys.readouterr().err
