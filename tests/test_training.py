"""The training job (training/): data, a few steps per framework, meshes (data, fsdp, tensor
parallel on the fake CPU devices), several processes, checkpoints and resume, the command line
and the metrics file. All on CPU with the tiny config and short sequences."""

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from numerics import assert_close
from test_sharding import collectives

import cutelayers as cl
from models import common
from models.configs import CONFIGS, GPTConfig, get_config
from training import data as data_mod
from training import sample
from training.checkpoint import Checkpointer, CheckpointError
from training.sharding import model_errors
from training.train import (
    DEFAULTS,
    DevicePrefetcher,
    Progress,
    Schedule,
    build_parser,
    main,
    parse_args,
    train,
)

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
    # not a terminal: plain lines every --log-every steps, no progress bar (its test: a terminal)
    assert "\r" not in text and "ETA" not in text
    assert [line.split("|")[0].strip() for line in text.splitlines() if "| loss" in line] == [
        f"step {step:6d}" for step in (5, 10, 15, 20, 25)]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [5, 10, 15, 20, 25]
    assert [r["step"] for r in rows if r["split"] == "eval"] == [0, 25]
    keys = {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"}
    assert all(keys <= set(r) for r in rows if r["split"] == "train")
    # the rate each logged step applied (its update is optax's count step - 1)
    applied = [float(Schedule(1e-2, 5, 25)(step - 1)) for step in (5, 10, 15, 20, 25)]
    assert [r["lr"] for r in rows if r["split"] == "train"] == pytest.approx(applied, rel=1e-6)
    try:  # the loss curve is written, or skipped with a message without matplotlib
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in text and not png.exists()
    else:
        assert png.exists() and png.stat().st_size > 0


# --- meshes: data, fsdp, tensor parallel ------------------------------------------------------------

MESH_STEPS = ["--steps", "6", "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", *FAST]
LINEAR = ("qkv", "attn_out", "mlp_in", "mlp_out", "head")
# the MLP's two layers in the parameter tree: mlp.fc1 / mlp.fc2 (NNX, Equinox), mlp.Dense_0 / _1 (linen)
LAYER_KEYS = {"mlp_in": r"mlp\W+(?:fc1|Dense_0)", "mlp_out": r"mlp\W+(?:fc2|Dense_1)"}
TP = ("tensor", "fsdp")
# The rule table's expectations for the tiny config (d 64, 4 heads, MLP 256, vocab 256), in the
# Flax layout (a linear kernel is (in, out)): (layer, leaf) -> spec, per mesh; leaves not listed
# and meshes without an entry are replicated.
EXPECTED_SPECS = {
    "fsdp=2": {("qkv", "kernel"): (None, "fsdp"), ("mlp_out", "kernel"): ("fsdp", None),
               ("wte", "embedding"): ("fsdp", None), ("wpe", "embedding"): ("fsdp", None)},
    "tensor=2": {("qkv", "kernel"): (None, "tensor"), ("qkv", "bias"): ("tensor",),
                 ("attn_out", "kernel"): ("tensor", None), ("mlp_in", "kernel"): (None, "tensor"),
                 ("mlp_in", "bias"): ("tensor",), ("mlp_out", "kernel"): ("tensor", None),
                 ("head", "kernel"): (None, "tensor"), ("wte", "embedding"): ("tensor", None)},
    "fsdp=2,tensor=2": {("qkv", "kernel"): (None, TP), ("qkv", "bias"): ("tensor",),
                        ("attn_out", "kernel"): (TP, None), ("mlp_out", "kernel"): (TP, None),
                        ("head", "kernel"): (None, TP), ("wte", "embedding"): (TP, None),
                        ("wpe", "embedding"): ("fsdp", None)},
}
UNSHARDED = [("ln1", "bias"), ("ln_f", "bias"), ("attn_out", "bias"), ("mlp_out", "bias")]


@pytest.fixture(scope="module")
def one_device_runs():
    """The 1-device run of each framework, made once: what every mesh must reproduce."""
    return {}


def leaf_at(tree, layer, leaf, framework, prefix=""):
    """The first leaf of ``tree`` at ``...{prefix}...layer.leaf`` (Equinox's names: a linear
    layer's ``weight``, an embedding's ``weight``)."""
    if framework == "equinox":
        leaf = "weight" if leaf in ("kernel", "embedding") else leaf
    pattern = re.compile(rf"{prefix}.*\b{LAYER_KEYS.get(layer, layer)}\W+{leaf}\b")
    return next(v for p, v in jax.tree.leaves_with_path(tree) if pattern.search(jax.tree_util.keystr(p)))


def expected_spec(mesh, layer, leaf, ndim, framework):
    spec = EXPECTED_SPECS.get(mesh, {}).get((layer, leaf), (None,) * ndim)
    return spec[::-1] if framework == "equinox" and layer in LINEAR and ndim == 2 else spec


def padded(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def assert_megatron_collectives(hlo: str):
    """The compiled step of --mesh tensor=2 (batch 8 x 32 tokens, d 64, MLP 256, 2 blocks) has
    the Megatron collectives -- all-reduces of the residual stream (batch, seq, d) after each
    row-parallel layer (forward) and column-parallel layer (backward), of (tokens,) statistics for
    the vocabulary-parallel cross-entropy -- and no all-gather of the MLP's (batch, seq, 4 d)
    activations, nor any reduce-scatter or all-to-all. What it does gather: the fused qkv output,
    whose [q | k | v] columns cut in two halves are not whole heads (see the README)."""
    found = collectives(hlo)
    tokens, d, layers = 8 * 32, 64, 2
    residual = [n for kind, sizes in found if kind == "all-reduce" for n in sizes if n == tokens * d]
    assert len(residual) >= 4 * layers, found
    assert any(kind == "all-reduce" and tokens in sizes for kind, sizes in found), found
    gathered = [n for kind, sizes in found if kind == "all-gather" for n in sizes]
    assert max(gathered) <= tokens * 3 * d and tokens * 4 * d not in gathered, found
    assert {kind for kind, _ in found} <= {"all-reduce", "all-gather"}, found


MESHES = ["--devices 2", "fsdp=2", "tensor=2", "fsdp=2,tensor=2"]
# (mesh, framework): every mesh with NNX; Linen and Equinox (their own parameter names, Equinox's
# (out, in) weights) under tensor=2, whose step's collectives depend on how the model is written,
# and under fsdp=2,tensor=2, where both rules shard their trees. Data parallel replicates the
# parameters and fsdp shards along a parameter's largest axis: neither depends on the framework.
MESH_CASES = [(mesh, "nnx") for mesh in MESHES] + [(mesh, framework) for framework in ("linen", "equinox")
                                                   for mesh in ("tensor=2", "fsdp=2,tensor=2")]


@pytest.mark.parametrize("mesh, framework", MESH_CASES)
def test_mesh_trains_like_one_device(mesh, framework, one_device_runs):
    """Each mesh on the fake CPU devices (see conftest): the same losses and parameters as one
    device, up to float32 summation order; the parameters and their Adam moments are laid out as
    training/sharding.py's table says; fsdp=2 halves each device's parameter bytes; tensor=2's
    step has the collectives of :func:`assert_megatron_collectives`."""
    if framework not in one_device_runs:
        one_device_runs[framework] = run(["--model", framework, *MESH_STEPS])[0]
    one = one_device_runs[framework]
    flags = mesh.split() if mesh.startswith("--") else ["--mesh", mesh]
    got, text = run(["--model", framework, *MESH_STEPS, *flags])
    shape = "data=2" if mesh == "--devices 2" else mesh
    assert f"mesh {shape} over " in text and "sequences per batch shard per step" in text
    assert [s for s, _ in got.train_curve] == [s for s, _ in one.train_curve] == list(range(1, 7))
    for (_, loss), (_, ref) in zip(got.train_curve, one.train_curve):
        assert_close(loss, ref, "float32", scale=2)
    assert got.end_loss < got.start_loss  # it trained
    for p, ref in zip(jax.tree.leaves(got.params), jax.tree.leaves(one.params)):
        # Adam divides by sqrt(v): summation-order noise in tiny gradients shows more in parameters
        assert_close(p, np.asarray(ref), "float32", scale=50)
    for layer, leaf in [*EXPECTED_SPECS.get(mesh, {}), *UNSHARDED]:
        param = leaf_at(got.params, layer, leaf, framework)
        want = padded(expected_spec(mesh, layer, leaf, param.ndim, framework), param.ndim)
        assert padded(param.sharding.spec, param.ndim) == want, (layer, leaf, param.sharding)
        moment = leaf_at(got.opt_state, layer, leaf, framework, prefix="mu")  # Adam's first moment
        assert padded(moment.sharding.spec, moment.ndim) == want, (layer, leaf, moment.sharding)
        assert len(param.sharding.device_set) == (2 if mesh == "--devices 2" else 4 if "," in mesh else 2)
    share = sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(got.params)) / sum(
        p.nbytes for p in jax.tree.leaves(got.params))  # parameter bytes on one device
    assert f"{share:.0%} of the parameters on each device" in text
    if mesh == "fsdp=2":  # only vectors (norm scales, biases: 1.3 % of the bytes) stay whole
        assert 0.5 <= share < 0.52, share
    if mesh == "tensor=2":
        assert_megatron_collectives(got.step_hlo)


def test_gated_mlp_under_tensor_parallel_trains_like_one_device(monkeypatch):
    """A SwiGLU model (the llama preset's MLP, RMSNorm, no biases, at the tiny config's size) under
    --mesh tensor=2, in bfloat16 and 1024 tokens a step, so that its ops take the kernels' path
    (here their reference lowering, partitioned by the kernels' sharding rules): the losses of one
    device, fc1's (in, 2 x 256) kernel split over the tensor axis in contiguous blocks, and no
    collective moves the MLP's hidden activations or their gate and value halves (fc1's weight
    moves instead)."""
    config = get_config("tiny", activation="swiglu", norm="rms", bias=False)
    monkeypatch.setitem(CONFIGS, "tiny_gated", config)
    monkeypatch.setitem(DEFAULTS, "tiny_gated", DEFAULTS["tiny"])
    base = ["--config", "tiny_gated", "--dtype", "bfloat16", *MESH_STEPS, "--batch-size", "32"]
    one, _ = run(base)
    got, text = run([*base, "--mesh", "tensor=2"])
    assert "mesh tensor=2 over " in text
    for (_, loss), (_, ref) in zip(got.train_curve, one.train_curve, strict=True):
        assert_close(loss, ref, "bfloat16", scale=2)
    fc1 = leaf_at(got.params, "mlp_in", "kernel", "nnx")
    assert fc1.shape == (64, 512) and padded(fc1.sharding.spec, 2) == (None, "tensor"), fc1.sharding
    tokens, hidden = 32 * 32, config.d_mlp
    moved = {n for kind, sizes in collectives(got.step_hlo) if kind != "all-reduce" for n in sizes}
    assert not {tokens * hidden // 2, tokens * hidden, 2 * tokens * hidden} & moved, collectives(got.step_hlo)


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
    assert again.compile_seconds == 0.0 and again.path == "nothing compiled"  # no step compiled for nothing
    # a resume that keeps the run's schedule does not note this command's clamped default warmup
    at = base.index("--warmup")
    no_warmup = base[:at] + base[at + 2:]  # without "--warmup N"
    args = parse_args([*no_warmup, "--steps", "11", "--resume"])
    assert args.notes and "default warmup of 50 steps" in args.notes[0]
    out = io.StringIO()
    again = train(args, out=out)
    assert again.steps_run == 0 and "keeping the run's learning-rate schedule" in out.getvalue()
    assert "default warmup" not in out.getvalue()
    # a checkpoint whose recorded config predates fields added since (their defaults: its model)
    # resumes; one of another model does not
    (meta_file,) = [f for f in (ckpt / "12").rglob("*") if f.is_file() and '"model_config"' in f.read_text(errors="ignore")]
    meta = json.loads(meta_file.read_text())
    for field in ("norm", "activation", "bias", "rope", "rope_theta", "tie_embeddings", "n_kv_heads"):
        del meta["model_config"][field]
    meta_file.write_text(json.dumps(meta))
    again, text = run([*base, "--resume"])
    assert again.steps_run == 0 and "nothing to do" in text
    meta["model_config"]["norm"] = "rms"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"for --config tiny with norm 'rms' \(this run: 'layer'\)"):
        run([*base, "--resume"])


def test_checkpoint_directories_that_cannot_serve_are_usage_errors(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    base = ["--steps", "4", "--eval-every", "0", "--log-every", "4", *FAST, "--warmup", "1"]
    run([*base, "--checkpoint-dir", str(ckpt)])
    # a new run into a used directory: Orbax would skip every save at or below its latest step
    with pytest.raises(ValueError, match=r"holds a run's checkpoints \(the latest at step 4\); pass --resume"):
        run([*base, "--steps", "3", "--checkpoint-dir", str(ckpt)])
    # a file where the directory should be (saving into it hung the process at the end of the run)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(SystemExit) as e:
        main([*base, "--checkpoint-dir", str(afile)])
    assert e.value.code == 2
    assert f"error: argument --checkpoint-dir: {afile} is a file, not a directory" in capsys.readouterr().err
    # one step's checkpoint given as the run's directory: it was read as holding none, and written into
    step_dir = f"{ckpt / '4'} is one checkpoint (step 4) of the run in {ckpt}; give the run's directory"
    with pytest.raises(SystemExit) as e:
        main([*base, "--steps", "6", "--checkpoint-dir", str(ckpt / "4"), "--resume"])
    assert e.value.code == 2 and f"error: argument --checkpoint-dir: {step_dir}" in capsys.readouterr().err
    assert sample.main(["--checkpoint-dir", str(ckpt / "4"), "--tokens", "4"]) == 2
    assert f"error: --checkpoint-dir: {step_dir}" in capsys.readouterr().err
    assert sorted(p.name for p in (ckpt / "4").iterdir() if p.name.isdigit()) == []  # nothing written into it
    # a checkpoint whose state item is gone (a save cut short): one line naming it, not a traceback
    shutil.rmtree(ckpt / "4" / "state")
    for command in (lambda: main([*base, "--steps", "6", "--checkpoint-dir", str(ckpt), "--resume"]),
                    lambda: sample.main(["--checkpoint-dir", str(ckpt), "--tokens", "4"])):
        assert command() == 2
        err = capsys.readouterr().err
        assert f"error: --checkpoint-dir: checkpoint 4 in {ckpt} cannot be read (" in err
        assert f"remove {ckpt / '4'} to use the one before it" in err and "Traceback" not in err


@pytest.mark.parametrize("flag, name", [("--metrics-file", "m.jsonl"), ("--plot", "loss.png"),
                                        ("--checkpoint-dir", "ckpt")])
def test_outputs_that_cannot_be_written_are_refused_before_the_run(flag, name, tmp_path, capsys):
    """Every output path is checked when the command is parsed: a traceback at the end of a run (or
    at its start, for the checkpoints) was the message."""
    afile, folder = tmp_path / "afile", tmp_path / name
    afile.write_text("x")
    folder.mkdir()
    wrong_kind = ((afile, f"{afile} is a file, not a directory") if flag == "--checkpoint-dir"
                  else (folder, f"{folder} is a directory; give a file's path"))
    cases = [wrong_kind, (afile / "sub" / name, f"{afile} is a file, not a directory")]
    if Path("/proc/self").is_dir():  # a folder that takes no new files, whatever its permission bits say
        cases.append((Path("/proc") / name, "cannot create files in /proc"))
    for path, message in cases:
        with pytest.raises(SystemExit) as e:
            parse_args([flag, str(path)])
        assert e.value.code == 2 and f"argument {flag}: {message}" in capsys.readouterr().err
    assert getattr(parse_args([flag, str(tmp_path / "new" / name)]), flag[2:].replace("-", "_")).name == name
    assert not (tmp_path / "new").exists()  # checked, not made


def test_tied_checkpoints_move_between_the_equinox_twins(tmp_path):
    """--tie-embeddings: the stock twin's checkpoint resumes in the cutelayers model and back (their
    trees differed at the weightless head, and the error blamed the files)."""
    ckpt = tmp_path / "ckpt"
    base = ["--model", "equinox", "--tie-embeddings", "--eval-every", "0", "--checkpoint-dir", str(ckpt), *FAST,
            "--warmup", "0"]
    run([*base, "--steps", "2", "--stock"])
    ours, text = run([*base, "--steps", "3", "--resume"])
    assert "at step 2 (written by the stock model)" in text and ours.steps_run == 1
    stock, text = run([*base, "--steps", "4", "--resume", "--stock"])
    assert "at step 3 (written by the cutelayers model)" in text and stock.steps_run == 1


def test_a_checkpoint_of_another_structure_is_not_called_damaged(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, {"w": np.ones(3, np.float32), "head": None}, {})
    ckpt.close()
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError) as e:
        ckpt.restore({"w": np.ones(3, np.float32), "head": {"weight": None}})
    ckpt.close()
    message = str(e.value)
    assert (f"checkpoint 1 in {tmp_path} does not fit this model: the structures of its state and of the "
            "model's differ (first difference at head). It was written by a different model or config") in message
    assert "damaged file" not in message and "remove" not in message


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

def test_tied_embeddings_train(tmp_path):
    """--tie-embeddings: the head reads wte's table (no head parameter), and the loss falls."""
    result, text = run(["--steps", "10", "--eval-every", "0", "--tie-embeddings", *FAST])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(result.params)]
    assert not [p for p in paths if "head" in p] and [p for p in paths if "wte" in p], paths
    assert result.end_loss < result.start_loss - 0.5, text


def test_remat_trains_as_without(tmp_path):
    """--remat: the blocks recomputed in the backward, the same run (the same losses and
    parameters, within float32 rounding); a checkpoint resumes under another --remat."""
    base = ["--steps", "6", "--eval-every", "0", "--log-every", "3", *FAST]
    plain, _ = run(base)
    ckpt = tmp_path / "ckpt"
    for remat in ("full", "dots"):
        result, _ = run([*base, "--remat", remat, "--checkpoint-dir", str(ckpt / remat)])
        assert_close(result.end_loss, plain.end_loss, "float32", scale=10)
        for a, b in zip(jax.tree.leaves(result.params), jax.tree.leaves(plain.params)):
            assert_close(a, b, "float32", scale=50)
        assert Checkpointer(ckpt / remat).read_meta()["model_config"]["remat"] == remat
    resumed, text = run([*base[2:], "--steps", "8", "--checkpoint-dir", str(ckpt / "dots"), "--resume"])
    assert resumed.steps_run == 2 and "at step 6" in text
    assert "changes the data" not in text
    # other data settings resume too, and say so
    resumed, text = run([*base[2:], "--steps", "9", "--checkpoint-dir", str(ckpt / "dots"), "--resume",
                         "--seed", "3", "--batch-size", "4"])
    assert resumed.steps_run == 1
    assert ("--resume: this command changes the data from here on: --batch-size 4 (the run's was 8), "
            "--seed 3 (the run's was 0)") in text


def test_tensor_parallel_splits_whole_key_value_heads():
    """A tensor axis must divide the key / value heads of grouped-query attention too."""
    shape = {"data": 1, "fsdp": 1, "tensor": 4}
    assert model_errors(shape, GPTConfig(n_heads=4, n_kv_heads=2)) == ["n_kv_heads=2"]
    assert model_errors(shape, GPTConfig(n_heads=4, n_kv_heads=4)) == []
    assert model_errors(shape, GPTConfig(n_heads=4)) == []


def test_help_documents_every_flag(capsys):
    # in this process: `python -m training.train` itself runs in the process tests below
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: python -m training.train")
    for action in build_parser()._actions:
        for flag in action.option_strings:
            assert flag in printed
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
     "argument --devices: --batch-size 6 is not a multiple of 4, the batch shards of --devices 4"),
    (["--batch-size", "6", "--mesh", "data=2,fsdp=2"],
     "argument --mesh: --batch-size 6 is not a multiple of 4, the batch shards of --mesh data=2,fsdp=2"),
    (["--mesh", "tensor=3"], ("argument --mesh: tensor=3 must divide the tiny config's n_heads=4, d_mlp=256, "
                              "vocab_size=256")),
    (["--mesh", "data=2,model=2"], ("argument --mesh: expected AXIS=N[,AXIS=N...] with AXIS one of data, "
                                    "fsdp, tensor; got 'data=2,model=2'")),
    (["--mesh", "data=two"], "argument --mesh: data: size must be an integer; got 'two'"),
    (["--mesh", "fsdp=0"], "argument --mesh: fsdp: size must be >= 1; got 0"),
    (["--mesh", "data=2,data=2"], "argument --mesh: axis 'data' given twice"),
    (["--num-processes", "2", "--process-id", "0"],
     "argument --num-processes: 2 processes need --coordinator (or $JAX_COORDINATOR_ADDRESS)"),
    (["--num-processes", "2", "--coordinator", "localhost:1234"],
     "argument --num-processes: 2 processes need --process-id (or $JAX_PROCESS_ID)"),
    (["--num-processes", "2", "--coordinator", "localhost:1234", "--process-id", "2"],
     "argument --process-id: 2 is not in 0..1 (--num-processes 2)"),
    (["--num-processes", "2", "--coordinator", "localhost", "--process-id", "1"],
     "argument --coordinator: expected HOST:PORT; got 'localhost'"),
    (["--process-id", "1"], "argument --process-id: 1 needs --num-processes 2 or more (one process: 0)"),
    (["--devices", "2", "--mesh", "data=2"], ("argument --devices: --devices 2 is --mesh data=2; give "
                                              "--devices or --mesh, not both")),
    (["--seed", "-1"], "argument --seed: must be in 0..4294967295 (a 32-bit seed); got -1"),
    (["--seed", str(2**32)], "argument --seed: must be in 0..4294967295 (a 32-bit seed); got 4294967296"),
])
def test_bad_flags_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_process_flags_default_to_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    args = parse_args([])
    assert (args.coordinator, args.num_processes, args.process_id) == ("10.0.0.1:1234", 4, 3)
    assert parse_args(["--process-id", "1"]).process_id == 1  # a flag wins
    monkeypatch.setenv("JAX_NUM_PROCESSES", "many")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "environment variable JAX_NUM_PROCESSES: must be an integer; got 'many'" in capsys.readouterr().err


def test_default_warmup_longer_than_the_run_is_clamped_with_a_note():
    args = parse_args(["--steps", "50"])  # tiny's default warmup is 50
    assert args.warmup == 5
    assert args.notes == [("note: the tiny config's default warmup of 50 steps is not shorter than --steps 50; "
                           "using --warmup 5 (a tenth of the run; pass --warmup to choose)")]
    assert parse_args(["--steps", "51"]).warmup == 50 and parse_args(["--steps", "51"]).notes == []


@pytest.mark.parametrize("flags", [["--devices", "64"], ["--mesh", "data=8,fsdp=8"]])
def test_more_devices_than_visible_is_a_clear_error(flags, capsys):
    assert main([*flags, "--steps", "8", *FAST, "--batch-size", "64"]) == 2
    assert (f"{' '.join(flags)}: needs 64 devices; only {len(jax.devices())} cpu device(s) visible"
            in capsys.readouterr().err)


def test_cute_backend_without_a_gpu_is_a_clear_error(capsys):
    assert main(["--backend", "cute", "--steps", "8", *FAST]) == 2
    assert "--backend cute needs a Hopper GPU" in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU's refusal")
def test_float16_on_the_cpu_is_a_clear_error(capsys):
    """XLA's CPU dot_general takes no float16 x float16 -> float32 (F16_F16_F32): every run crashed."""
    assert main(["--dtype", "float16", "--steps", "8", *FAST]) == 2
    err = capsys.readouterr().err
    assert "error: compute dtype float16 cannot run on the CPU" in err and "--dtype float32 or bfloat16" in err


def test_the_backend_defaults_to_the_librarys_setting():
    """Without --backend, the library's setting ($CUTELAYERS_BACKEND, else auto), which "auto" used
    to override; a flag wins."""
    with cl.use_backend("reference"):
        assert parse_args([]).backend == "reference"
        assert parse_args(["--backend", "auto"]).backend == "auto"
    assert parse_args([]).backend == cl.current_backend()


def test_a_backend_variable_that_names_no_backend_is_a_usage_error():
    """It failed ``import cutelayers`` with a traceback; now the backend's point of use says so."""
    env = {**os.environ, "CUTELAYERS_BACKEND": "nope"}
    proc = subprocess.run([sys.executable, "-m", "training.train", "--steps", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert ("error: argument --backend: not given, so the library's setting applies: CUTELAYERS_BACKEND='nope' "
            "is not a backend; allowed: auto, cute, reference (or unset: auto)") in proc.stderr


# --- several processes ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def launch(argv, n_processes=2, devices_per_process=2):
    """Starts ``python -m training.train argv`` as ``n_processes`` CPU processes on this host, each
    with ``devices_per_process`` devices, connected by jax.distributed (JAX's gloo collectives).
    Returns a function that waits for them and returns their outputs (asserting they succeeded)."""
    # conftest's XLA flags (LLVM -O0 among them) with this process's device count
    xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"{xla_flags} --xla_force_host_platform_device_count={devices_per_process}"}
    common_flags = ["--coordinator", f"localhost:{free_port()}", "--num-processes", str(n_processes)]
    procs = [subprocess.Popen([sys.executable, "-m", "training.train", *argv, *common_flags, "--process-id", str(i)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n_processes)]

    def wait():
        try:
            outputs = [proc.communicate(timeout=240)[0] for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
        for i, (proc, text) in enumerate(zip(procs, outputs)):
            assert proc.returncode == 0, f"process {i} of {n_processes}:\n{text}"
        return outputs

    return wait


def train_losses(metrics: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["split"] == "train"}


@pytest.mark.slow
def test_two_processes_and_one_share_checkpoints(tmp_path):
    """Two CPU processes of two devices each (--mesh data=2,fsdp=2: the parameters sharded over
    both processes) train like one process; the checkpoint they write restores on one process
    (into another mesh) and continues as an uninterrupted run does, and one process's checkpoint
    continues on two. Only process 0 prints and writes metrics."""
    base = ["--steps", "8", "--eval-every", "4", "--log-every", "1", "--eval-batches", "1", *FAST]
    one, _ = run([*base, "--checkpoint-dir", str(tmp_path / "one")])  # the uninterrupted run
    reference = dict(one.train_curve)
    shutil.rmtree(tmp_path / "one" / "8")  # resume from step 4, written by one process
    mesh = ["--mesh", "data=2,fsdp=2"]
    fresh = launch([*base, *mesh, "--checkpoint-dir", str(tmp_path / "two"), "--metrics-file",
                    str(tmp_path / "two.jsonl")])
    continued = launch([*base, *mesh, "--checkpoint-dir", str(tmp_path / "one"), "--resume", "--metrics-file",
                        str(tmp_path / "one.jsonl")])  # at once: two jobs of two processes
    first, second = fresh()
    assert "mesh data=2,fsdp=2 over 4 cpu devices" in first and "loss: start" in first
    assert "loss" not in second  # process 1 prints nothing of its own
    assert "at step 4" in continued()[0]
    assert sorted(train_losses(tmp_path / "one.jsonl")) == [5, 6, 7, 8]
    for metrics in ("two.jsonl", "one.jsonl"):
        for step, loss in train_losses(tmp_path / metrics).items():
            assert_close(loss, reference[step], "float32", scale=2)
    assert Checkpointer(tmp_path / "two").latest_step() == 8

    shutil.rmtree(tmp_path / "two" / "8")  # resume from step 4, written by two processes
    resumed, text = run([*base, "--mesh", "tensor=2", "--checkpoint-dir", str(tmp_path / "two"), "--resume"])
    assert "at step 4" in text and resumed.steps_run == 4
    for step, loss in resumed.train_curve:
        assert_close(loss, reference[step], "float32", scale=2)


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


def test_a_slow_throughput_is_not_shown_as_zero():
    out = io.StringIO()
    progress = Progress(out, 0, 10, 64)
    for tokens_per_s in (37.24, 0.5, 999.7, 12_345.0):
        progress.window(1, 5.0, 1e-3, 1.0, tokens_per_s)
    rates = [line.rsplit("| ", 1)[1] for line in out.getvalue().splitlines()]
    assert rates == ["37.2 tokens/s", "0.5 tokens/s", "1.0k tokens/s", "12.3k tokens/s"]


def test_progress_bar_on_a_terminal_plain_lines_elsewhere():
    """On a terminal the bar; the plain lines that replace it elsewhere (a StringIO, as ``run``
    gives train()) are checked in test_a_few_steps_reduce_the_loss, for every framework."""
    argv = ["--steps", "6", "--log-every", "2", "--eval-every", "0", *FAST]
    tty = Terminal()
    train(parse_args(argv), out=tty)
    bar = tty.getvalue()
    assert "\r" in bar and "step 6/6 [" in bar and "ETA" in bar and "tokens/s" in bar
    assert "| loss " in bar and "step      2 | loss" not in bar  # the bar instead of the lines


@pytest.mark.parametrize("checkpoint", [False, True])
def test_path_notes_are_one_line_of_the_same_format(checkpoint, tmp_path):
    """The library's reasons for the reference path are one line, the same with --checkpoint-dir
    (Orbax's logging on the root logger does not reformat them)."""
    argv = ["--steps", "6", "--eval-every", "0", *FAST] + (["--checkpoint-dir", str(tmp_path)] if checkpoint else [])
    proc = subprocess.run([sys.executable, "-m", "training.train", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stdout.splitlines() if "reference path" in line]
    assert len(notes) == 1 and notes[0].startswith("notes: cutelayers: running the reference path"), proc.stdout
    assert "reference path" not in proc.stderr, proc.stderr


def test_prefetcher_keeps_order_and_raises_the_producers_error():
    device = jax.devices("cpu")[0]

    def place(batch):
        return jax.device_put(batch, device)

    fetched = DevicePrefetcher(lambda step: np.full((2,), step), range(3, 9), place)
    assert [int(b[0]) for b in fetched] == [3, 4, 5, 6, 7, 8]
    fetched.close()

    def make(step):
        if step == 2:
            raise ValueError("no batch 2")
        return np.zeros(1)

    failing = DevicePrefetcher(make, range(5), place)
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
    # --backend cute off a GPU: refused as training.train refuses it (it was a traceback)
    if jax.default_backend() != "gpu":
        assert sample.main([*argv, "--backend", "cute"]) == 2
        assert "error: --backend cute needs a Hopper GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sample.main([*argv, "--seed", "-1"])
    assert "argument --seed: must be in 0..4294967295" in capsys.readouterr().err
    assert sample.main(["--checkpoint-dir", str(tmp_path / "none")]) == 2
    assert f"--checkpoint-dir: {tmp_path / 'none'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()  # not created by the attempt
    (tmp_path / "empty").mkdir()
    assert sample.main(["--checkpoint-dir", str(tmp_path / "empty")]) == 2
    assert "--checkpoint-dir: no checkpoint in" in capsys.readouterr().err
