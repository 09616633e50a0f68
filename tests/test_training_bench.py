"""python -m training.bench on CPU with the tiny config: every case runs (in its own process), the
table compares with the stock twin, the per-part breakdown covers the step, the report is
appended to the output file; with ``--mesh``, every case over each mesh of the fake CPU devices
(see conftest: four), the table's mesh columns, and the errors for meshes that cannot run."""

import contextlib
import dataclasses
import functools
import io
import json
import re
import subprocess

import jax
import numpy as np
import pytest
from conftest import UNWRITABLE, unwritable_path
from jax.sharding import NamedSharding, PartitionSpec

from cutelayers.bench import timing
from training import bench
from training.data import TextData


def in_this_process(flag, job, timeout):
    """What ``bench.in_subprocess(flag, job, timeout)`` returns, the command run in this process:
    ``bench.main([flag, JOB])``, its JSON line read back."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert bench.main([flag, json.dumps(job)]) == 0
    return json.loads(printed.getvalue().splitlines()[-1])


def test_a_case_process_imports_this_process_packages(tmp_path, monkeypatch):
    """A case's process imports the cutelayers, models and training this process did, though its
    working directory and the front of PYTHONPATH hold other trees: ``.ci/gpu-ab`` runs the
    baseline's ``python -m training.bench`` from the baseline tree, and a child importing its
    working directory's packages timed one tree on both sides of the A/B."""
    for package in ("cutelayers", "models", "training"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('the decoy {package}')\n")
    monkeypatch.setattr(bench, "REPO", tmp_path)  # the child's working directory
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert bench.in_subprocess("--one-check", [bench.ONE_DEVICE], 300) == []


def test_a_part_times_the_forward_outputs_and_a_cotangent_read_from_memory():
    """The breakdown's programs (``vjp_program``) return the forward's outputs and the gradients for
    a random cotangent passed in as an operand: with a constant one XLA folds dy into its fusions
    and drops the unreturned forward, which timed the stock parts on less work than the step's."""
    kw, kx = jax.random.split(jax.random.key(0))
    w = jax.random.normal(kw, (16, 24), jax.numpy.float32)
    x = jax.random.normal(kx, (8, 16), jax.numpy.float32)
    f = lambda w, x: (jax.numpy.tanh(x @ w), x * 2.0)  # two outputs, two cotangents
    program, (args, cotangent) = bench.vjp_program(f, w, x)
    assert [c.shape for c in cotangent] == [(8, 24), (8, 16)]
    assert all(0.5 < float(np.std(c)) < 2.0 for c in cotangent)  # random normal, not ones
    y, grads = program(args, cotangent)
    np.testing.assert_allclose(y[0], f(w, x)[0], rtol=1e-6)
    expected = jax.vjp(f, w, x)[1](cotangent)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # every operand (w, x and both cotangents) reaches the compiled program, and every output leaves it
    hlo = program.lower(args, cotangent).compile().as_text()
    entry = hlo[hlo.index("ENTRY"):]
    assert len(re.findall(r"parameter\(\d+\)", entry)) == 4
    assert len(jax.tree.leaves(program.eval_shape(args, cotangent))) == 4


def test_bench_tiny_cases_table_and_breakdown(tmp_path, capsys, monkeypatch):
    """The cases run in their own processes (``--one-case``); the per-part breakdown, which times
    eighteen small programs, runs its ``--one-breakdown`` command in this process with two calls
    per timing instead of 7 x 20 (the CPU's times are not what the table's layout depends on)."""
    output = tmp_path / "bench.md"
    output.write_text("# earlier results\n")
    run_case, flags = bench.in_subprocess, []

    def breakdown_here(flag, job, timeout):
        flags.append(flag)
        return (in_this_process if flag == "--one-breakdown" else run_case)(flag, job, timeout)

    monkeypatch.setattr(bench, "in_subprocess", breakdown_here)
    monkeypatch.setattr(bench, "time_fn", functools.partial(timing.time_fn, iters=2, repeats=1))
    argv = ["--config", "tiny", "--model", "nnx", "--variant", "cutelayers", "stock", "--steps", "2",
            "--warmup-steps", "1", "--breakdown", "--kernels", "3", "--output", str(output)]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    text = output.read_text()
    assert text.startswith("# earlier results\n")  # appended, not overwritten
    assert "Command: `python -m training.bench --config tiny --model nnx" in text and "jax " in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[3].strip() for row in rows] == ["cutelayers", "stock"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "xla" and cells[4] == "16 x 64"  # CPU: XLA attention; tiny's batch
        assert float(cells[6]) > 0 and float(cells[7]) > 0 and int(cells[9].replace(",", "")) > 0
        assert int(cells[12].replace(",", "")) > 0  # compiled memory (the CPU keeps no peak statistics)
    assert rows[1].split("|")[11].strip() == "1.00x"  # stock vs itself
    # on the CPU the cutelayers rows are the jnp reference path: the report says so under the table
    assert "Note: the cutelayers rows above ran no CuTe kernel" in text
    parts = re.findall(r"^\| (GEMM \w+ \(\d+x\d+\)|MLP \(\d+x\d+x\d+\)|LayerNorm|attention|LM head \+ loss|"
                       r"optimizer \(AdamW\)|other \(step - parts\)) \| ([\d.-]+) \| ([\d.-]+) \|",
                       text, re.MULTILINE)
    assert len(parts) == 8
    assert all(float(ours) > 0 and float(stock) > 0 for name, ours, stock in parts if not name.startswith("other"))
    assert text.strip().endswith(printed.strip().splitlines()[-2].strip())  # printed what it appended
    # --kernels: a section per case; the CPU records no device kernels, and says so
    assert text.count("Kernels per step, tiny nnx ") == 2 and "no device kernels recorded" in text
    assert flags == ["--one-case", "--one-case", "--one-breakdown"]


def test_a_remat_case(monkeypatch):
    """--remat: the case's model is built with it (GPTConfig.remat), and the table's config cell
    names it."""
    built, init = [], bench.common.init
    monkeypatch.setattr(bench.common, "init", lambda framework, config, *a, **k: built.append(config.remat)
                        or init(framework, config, *a, **k))
    job = lambda remat: dataclasses.asdict(bench.Case("tiny", "nnx", "cutelayers", 2, 0, 1, remat=remat))
    rows = [in_this_process("--one-case", job(remat), None) for remat in ("none", "dots")]
    assert built == ["none", "dots"] and [r["remat"] for r in rows] == ["none", "dots"]
    cells = [line.split("|")[1].strip() for line in bench.results_table(rows).splitlines()[2:]]
    assert cells == ["tiny", "tiny (remat dots)"]


def test_a_vocabulary_case(monkeypatch, capsys):
    """--vocab-size: the case's model has that vocabulary (its random tokens drawn from it: the
    untrained loss is about log V), the per-part breakdown's head too, and the config cell names
    it; a vocabulary the byte corpus does not fit is a usage error before any case runs."""
    built, init = [], bench.common.init
    monkeypatch.setattr(bench.common, "init", lambda framework, config, *a, **k: built.append(config.vocab_size)
                        or init(framework, config, *a, **k))
    job = dataclasses.asdict(bench.Case("tiny", "nnx", "cutelayers", 2, 0, 1, vocab_size=1001))
    row = in_this_process("--one-case", job, None)
    assert built == [1001] and row["vocab_size"] == 1001
    assert abs(row["loss"] - np.log(1001)) < 0.5, row["loss"]
    assert bench.results_table([row]).splitlines()[2].split("|")[1].strip() == "tiny (vocabulary 1001)"
    assert bench.config_label({**row, "remat": "dots"}) == "tiny (remat dots, vocabulary 1001)"
    parts = []
    monkeypatch.setattr(bench, "part_seconds", lambda config, *a, **k: parts.append(config.vocab_size) or {})
    in_this_process("--one-breakdown", {"config_name": "tiny", "batch_size": 2, "step_ms": {}, "vocab_size": 1001},
                    None)
    assert parts == [1001, 1001]  # ours and stock
    with pytest.raises(SystemExit) as e:
        bench.main(["--config", "tiny", "--tokens", "corpus", "--vocab-size", "100"])
    assert e.value.code == 2
    assert "argument --vocab-size: --tokens corpus draws byte ids up to 255; got 100, allowed >= 256" in capsys.readouterr().err


def test_the_clock_settles_on_training_steps_before_the_loop_is_timed(monkeypatch):
    """measure() runs steps (each waited for, the state carried on: its buffers are donated)
    until the clock has settled (timing.settle_clock, which on a GPU runs them for
    SETTLE_SECONDS) before it times the loop."""
    runs = []

    def settle(one_step, seconds=None):
        for _ in range(3):
            one_step()
            runs.append(1)

    monkeypatch.setattr(bench, "settle_clock", settle)
    row = bench.measure(bench.Case("tiny", "nnx", "cutelayers", 2, 1, 2))
    assert len(runs) == 3 and row["loop_ms"] > 0 and np.isfinite(row["loss"])


@pytest.mark.parametrize("name, family", [
    ("kernel_cutlass_kernel_cutelayerskernelsgemmHopperGemmKernel_object_at__TiledMMA", "cutelayers (CuTe)"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "cuDNN attention"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "cuBLAS GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "cuBLAS GEMM"),
    ("loop_add_multiply_fusion_3", "XLA fusions and other"),
    ("input_reduce_fusion", "XLA fusions and other"),
    ("MemcpyD2D", "copies"),
])
def test_kernel_families(name, family):
    assert bench.kernel_family(name) == family


def test_kernel_profile_gives_the_idle_time_between_kernels(monkeypatch):
    """A synthetic trace of two steps: time per step by kernel and family, the device's busy time,
    and its idle gaps by the families either side -- a gap counts from the latest end so far (a
    kernel inside another leaves none), and the table shows each pair's gaps."""
    gemm = "kernel_cutlass_kernel_cutelayerskernelsgemmHopperGemmKernel"
    us = 1e-6
    spans = []
    for t0 in (0.0, 100 * us):  # (name, start, seconds)
        spans += [("loop_add_fusion", t0, 2 * us), (gemm, t0 + 5 * us, 10 * us),  # 3 us before the GEMM
                  ("input_reduce_fusion", t0 + 6 * us, 1 * us),  # on another stream, inside the GEMM
                  ("nvjet_sm90_tst", t0 + 16 * us, 4 * us)]  # 1 us after the GEMM, which ended last
    monkeypatch.setattr(bench, "traced_kernel_spans", lambda run: spans)
    profile = bench.kernel_profile(None, None, None, steps=2, top=2)
    assert [name for name, _, _ in profile["kernels"]] == [gemm, "nvjet_sm90_tst"]
    assert profile["kernels"][0][1:] == pytest.approx((1.0, 0.010))
    assert profile["busy_ms"] == pytest.approx(0.017)
    assert profile["families"] == pytest.approx({"cutelayers (CuTe)": 0.010, "cuBLAS GEMM": 0.004,
                                                 "XLA fusions and other": 0.003})
    # per step: 3 us before the GEMM, 1 us after it; between the steps 80 us, cuBLAS -> XLA (once in two steps)
    idle = {(before, after): (gaps, ms) for before, after, gaps, ms in profile["idle"]}
    expected = {("XLA fusions and other", "cutelayers (CuTe)"): (1.0, 0.003),
                ("cutelayers (CuTe)", "cuBLAS GEMM"): (1.0, 0.001),
                ("cuBLAS GEMM", "XLA fusions and other"): (0.5, 0.040)}
    assert idle.keys() == expected.keys()
    assert all(idle[pair] == pytest.approx(expected[pair]) for pair in expected)
    assert profile["idle"][0][:2] == ("cuBLAS GEMM", "XLA fusions and other")  # most idle first
    table = bench.kernel_table({"config": "tiny", "model": "nnx", "variant": "cutelayers", "loop_ms": 0.1,
                                "kernels": profile})
    assert "| XLA fusions and other | cutelayers (CuTe) | 1 | 0.003 | 3.0 |" in table


def test_corpus_batches_are_the_training_runs_windows():
    config = bench.bench_config("gpt2")  # vocabulary 50304, of which the corpus uses bytes
    sharding = NamedSharding(jax.make_mesh((1,), ("data",)), PartitionSpec())
    uniform = bench.step_batches(config, 4, sharding)
    corpus = bench.step_batches(config, 4, sharding, tokens="corpus")
    want = TextData.load().train_batch(1, 4, config.seq_len, seed=0)
    for got, expected in zip(corpus[1], want):
        np.testing.assert_array_equal(np.asarray(got), expected)
    inputs, targets = (np.asarray(a) for a in corpus[0])
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])  # targets: the next token
    assert inputs.max() < 256 and len(np.unique(np.asarray(uniform[0][0]))) > 256


def table(text: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the first markdown table in ``text``, cells stripped."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]
    return split(lines[0]), [split(line) for line in lines[2:]]


def test_bench_over_meshes(tmp_path, monkeypatch):
    """data=1, data=2 and fsdp=2 on the fake CPU devices: each case trains on its mesh's devices
    (the same losses as one device), the table has the mesh columns, tokens/s vs 1 device, and
    fsdp holds about half the parameter + optimizer bytes per device (vectors stay whole). The
    device check and the cases run their commands in this process (which has the same four
    devices): the tiny test above runs cases in their own processes."""
    rows = []
    monkeypatch.setattr(bench, "in_subprocess", lambda *a: rows.append(in_this_process(*a)) or rows[-1])
    output = tmp_path / "mesh.md"
    argv = ["--config", "tiny", "--model", "nnx", "--variant", "cutelayers", "--mesh", "data=1", "data=2",
            "fsdp=2", "--steps", "2", "--warmup-steps", "1", "--output", str(output)]
    assert bench.main(argv) == 0
    text = output.read_text()
    assert "## Training step over device meshes" in text and "4 x cpu (cpu)" in text
    header, cells = table(text)
    assert header == ["config", "model", "variant", "mesh", "attention", "batch x seq", "compile s", "loop ms",
                      "step ms", "loop/step", "tokens/s", "vs stock", "vs 1 device", "peak MiB/device",
                      "compiled MiB/device", "vs stock", "state MiB/device", "vs 1 device"]
    col = {name: header.index(name) for name in header}
    speed_vs_one, state_vs_one = col["vs 1 device"], len(header) - 1
    by_mesh = {row[col["mesh"]]: row for row in cells}
    assert list(by_mesh) == ["data=1", "data=2", "fsdp=2"]
    for row in cells:
        assert row[col["batch x seq"]] == "16 x 64"  # the global batch, whatever the mesh
        assert float(row[col["tokens/s"]].replace(",", "")) > 0 and float(row[speed_vs_one].rstrip("x")) > 0
        assert row[col["peak MiB/device"]] == "-" and float(row[col["compiled MiB/device"]]) > 0  # CPU: no stats
    assert by_mesh["data=1"][speed_vs_one] == "1.00x" and by_mesh["data=1"][state_vs_one] == "1.00x"
    assert by_mesh["data=2"][state_vs_one] == "1.00x"  # data parallel: the state replicated
    assert 0.49 <= float(by_mesh["fsdp=2"][state_vs_one].rstrip("x")) <= 0.53

    cases = [r for r in rows if isinstance(r, dict)]  # the case rows (the device check returned [])
    assert [(r["mesh"], r["devices"]) for r in cases] == [("data=1", 1), ("data=2", 2), ("fsdp=2", 2)]
    one, data, fsdp = cases
    assert 0.49 <= fsdp["state_bytes"] / one["state_bytes"] <= 0.53 and data["state_bytes"] == one["state_bytes"]
    for other in (data, fsdp):  # the same batches and initial state: the same training step
        np.testing.assert_allclose(other["loss"], one["loss"], rtol=1e-4)


@pytest.mark.parametrize("argv,message", [
    (["--mesh", "data=8"], ("argument --mesh: --mesh data=8: needs 8 devices; only 4 cpu device(s) visible. Use a "
                            "mesh of 4 or fewer")),
    (["--mesh", "data=1", "data=3"], ("argument --mesh: the tiny config's default --batch-size 16 is not a multiple "
                                      "of 3, the batch shards of --mesh data=3")),
    (["--batch-size", "6", "--mesh", "data=2", "fsdp=4"], ("argument --mesh: --batch-size 6 is not a multiple of 4, "
                                                           "the batch shards of --mesh fsdp=4")),
    (["--mesh", "tensor=3"], "argument --mesh: tensor=3 must divide the tiny config's n_heads=4, d_mlp=256"),
    (["--mesh", "data=2", "data=2,tensor=1"], "argument --mesh: data=2 given twice"),
    (["--mesh", "data=2,model=2"], "argument --mesh: expected AXIS=N[,AXIS=N...] with AXIS one of data, fsdp, tensor"),
])
def test_bad_meshes_are_clear_errors_before_any_case(argv, message, tmp_path, monkeypatch, capsys):
    output = tmp_path / "mesh.md"
    cases = []
    run_case = bench.in_subprocess
    monkeypatch.setattr(bench, "in_subprocess", lambda flag, *a: cases.append(flag) or run_case(flag, *a))
    with pytest.raises(SystemExit) as e:
        bench.main(["--config", "tiny", "--model", "nnx", "--variant", "cutelayers", "--output", str(output), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert "--one-case" not in cases and not output.exists()


def test_a_case_that_times_out_is_named_and_the_others_kept(tmp_path, monkeypatch, capsys):
    """A case past --case-timeout is stopped and named under the table; the rows measured before
    and after it stay (a subprocess.TimeoutExpired traceback lost them all). Each case says when it
    starts and what it measured, as it happens (the cases take minutes). The stock case's process
    "times out"; the other runs in this process."""

    def run(command, *, timeout, **kwargs):
        flag, job = command[-2:]
        if json.loads(job)["variant"] == "stock":
            raise subprocess.TimeoutExpired(command, timeout)
        row = in_this_process(flag, json.loads(job), timeout)
        return subprocess.CompletedProcess(command, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", run)
    output = tmp_path / "bench.md"
    argv = ["--config", "tiny", "--model", "nnx", "--variant", "stock", "cutelayers", "--steps", "1",
            "--warmup-steps", "0", "--case-timeout", "7", "--output", str(output)]
    assert bench.main(argv) == 0
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# tiny")]
    assert progress[:3] == ["# tiny nnx stock: running (at most 7 s)",
                            "# tiny nnx stock: timed out: ran past --case-timeout 7 s and was stopped",
                            "# tiny nnx cutelayers: running (at most 7 s)"]
    assert re.fullmatch(r"# tiny nnx cutelayers: [\d,]+ tokens/s in \d+ s", progress[3]) and len(progress) == 4
    text = output.read_text()
    _, rows = table(text)
    assert [row[2] for row in rows] == ["cutelayers"]
    assert "Timed out (--case-timeout 7 s), not in the table: tiny nnx stock." in text


@pytest.mark.parametrize("name", UNWRITABLE)
def test_an_output_that_cannot_be_written_is_refused_before_any_case(name, tmp_path, monkeypatch, capsys):
    """--output was opened after every case had run: its error (a traceback) lost them all."""
    output = unwritable_path(name, tmp_path, "bench.md")
    message = {"a directory": f"{output} is a directory; give a file's path",
               "under a file": f"{output.parent} is a file, not a directory",
               "/proc": "cannot create files in /proc"}[name]
    cases = []
    monkeypatch.setattr(bench, "in_subprocess", lambda flag, *a: cases.append(flag))
    with pytest.raises(SystemExit) as e:
        bench.main(["--config", "tiny", "--model", "nnx", "--variant", "cutelayers", "--output", str(output)])
    assert e.value.code == 2 and f"argument --output: {message}" in capsys.readouterr().err
    assert cases == []


def test_help_states_each_default_once():
    text = bench.build_parser().format_help()
    assert "(default: None)" not in text
    assert "(default: the config's training default)" in " ".join(text.split())
