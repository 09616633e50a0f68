"""The benchmark command line, ``python -m cutelayers.bench FAMILY``: its families and their flags,
and the message given without a GPU (the families' measurements need one)."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_GPU

from cutelayers.bench.__main__ import main

FAMILIES = ("reduce", "norms", "softmax", "gemm", "lm_head", "embed", "compile")


def test_help_lists_every_family():
    proc = subprocess.run([sys.executable, "-m", "cutelayers.bench", "--help"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m cutelayers.bench")
    assert "{" + ",".join(FAMILIES) + "}" in proc.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the message given without a GPU")
@pytest.mark.parametrize("argv", [
    ["reduce", "--rows", "64", "--n", "128", "--dtype", "float32"],
    ["norms", "--n", "128", "--dtype", "float16", "--ops", "layer_norm", "add_rms_norm", "--passes", "fwd",
     "--param-dtype", "float32"],
    ["softmax", "--n", "128"],
    ["gemm", "--shapes", "64x128x256", "--epilogue", "bias", "--dtype", "float16", "--parts"],
    ["gemm", "--shapes", "64x128x256", "--param-dtype", "float32"],
    ["lm_head", "--tokens", "64", "--hidden", "64", "--vocab", "256", "--dtype", "float32", "--chunk-size", "32"],
    ["lm_head", "--tokens", "64", "--hidden", "64", "--vocab", "256", "--param-dtype", "float32"],
    ["lm_head", "--tokens", "64", "--hidden", "64", "--vocab", "256", "--kernel-layout", "vh", "--device-peak"],
    ["lm_head", "--tokens", "64", "--hidden", "64", "--vocab", "250", "--label-smoothing", "0.1"],
], ids=["reduce", "norms", "softmax", "gemm", "gemm-float32-params", "lm_head", "lm_head-float32-params",
        "lm_head-vh-device-peak", "lm_head-smoothed"])
def test_gpu_families_need_a_gpu(argv, capsys):
    assert main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_norms_returns_the_residual_adds_shared_gradient_once():
    # x and the residual of add_rms_norm get one gradient; the fwd+bwd program returns it once
    # (twice, the kernels' side paid a copy of it in the timed program), the rest unchanged.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cutelayers.bench.norms import _fwd_bwd, _plain_add

    kx, kr, kd = jax.random.split(jax.random.key(3), 3)
    x, residual, dy = (jax.random.normal(k, (5, 24), jnp.float32) for k in (kx, kr, kd))
    scale = jnp.linspace(0.5, 1.5, 24)
    (y, summed), grads = _fwd_bwd(_plain_add(False), shared_grad=True)(dy, x, residual, scale)
    want, vjp = jax.vjp(_plain_add(False), x, residual, scale)
    np.testing.assert_array_equal(y, want[0])
    np.testing.assert_array_equal(summed, want[1])
    dx, dresidual, dscale = vjp((dy, dy))
    np.testing.assert_array_equal(dx, dresidual)
    assert len(grads) == 2
    np.testing.assert_allclose(grads[0], dx, rtol=1e-6)
    np.testing.assert_allclose(grads[1], dscale, rtol=1e-6)
    assert len(_fwd_bwd(_plain_add(False))(dy, x, residual, scale)[1]) == 3


def test_bench_norms_step_pass_orders_the_backward_after_the_forward():
    # The "step" pass: dy goes through an optimization_barrier with y (XLA cannot fuse the
    # backward's reads of x into the forward's pass, as it can when dy is given up front); its
    # values are the plain fwd+bwd's, for the plain norm and for the residual add's two results.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cutelayers.bench.norms import _fwd_bwd, _plain, _plain_add

    kx, kr, kd = jax.random.split(jax.random.key(5), 3)
    x, residual, dy = (jax.random.normal(k, (7, 40), jnp.float32) for k in (kx, kr, kd))
    scale, bias = jnp.linspace(0.5, 1.5, 40), jnp.linspace(-0.2, 0.2, 40)
    for f, args, shared in ((_plain(True), (x, scale, bias), False), (_plain_add(False), (x, residual, scale), True)):
        step = jax.jit(_fwd_bwd(f, shared_grad=shared, step=True))
        assert "optimization_barrier" in step.lower(dy, *args).as_text()
        assert "optimization_barrier" not in jax.jit(_fwd_bwd(f, shared_grad=shared)).lower(dy, *args).as_text()
        got, want = step(dy, *args), _fwd_bwd(f, shared_grad=shared)(dy, *args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_bench_norms_rejects_unknown_ops_and_passes():
    from cutelayers.bench.norms import bench_norms

    with pytest.raises(ValueError, match=r"ops \('layernorm',\): choose one or more of"):
        bench_norms([128], ops=("layernorm",))
    with pytest.raises(ValueError, match=r"passes \(\): choose one or more of \('fwd', 'fwd\+bwd', 'step'\)"):
        bench_norms([128], passes=())


def test_time_fn_rotates_small_operands_over_copies(monkeypatch):
    """Operands under ROTATION_BYTES are timed over copies (a call does not find the last call's
    operands in L2), non-array arguments passed as they are; larger ones are not copied."""
    import jax.numpy as jnp

    from cutelayers.bench import timing

    monkeypatch.setattr(timing, "ROTATION_BYTES", 4096 * 4)
    for size, sets in ((1000, 5), (4096, 1), (16, timing.MAX_ROTATION)):
        x = jnp.arange(size, dtype=jnp.float32)
        buffers, scales = set(), set()

        def fn(a, scale):
            buffers.add(a.unsafe_buffer_pointer())
            scales.add(scale)
            assert (a == x).all()
            return a

        assert timing.time_fn(fn, x, 3, iters=2 * sets, repeats=1) > 0
        assert len(buffers) == sets and scales == {3}


def test_settle_clock_runs_calls_for_its_seconds_on_a_gpu_only(monkeypatch):
    """On a GPU the measurement helpers first run the calls for a while (the clock settling under
    the power cap); elsewhere nothing runs. The time_fn path calls it before it traces."""
    import time

    import jax

    from cutelayers.bench import timing

    ran = []
    timing.settle_clock(lambda: ran.append(1), 0.05)
    assert jax.default_backend() != "gpu" and ran == []

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    start = time.perf_counter()
    timing.settle_clock(lambda: (ran.append(1), time.sleep(0.005)), 0.05)
    assert time.perf_counter() - start >= 0.05 and 1 <= len(ran) <= 11
    ran.clear()
    timing.settle_clock(lambda: ran.append(1), 0.0)
    assert ran == []

    settled = []
    monkeypatch.setattr(timing, "settle_clock", lambda calls, seconds=0.5: settled.append(seconds))
    assert timing.time_fn(lambda x: x + 1, jax.numpy.ones(4), iters=2, settle_seconds=0.25) > 0
    assert timing.wall_time(lambda x: x + 1, jax.numpy.ones(4), iters=2, repeats=1) > 0
    assert settled == [0.25, timing.SETTLE_SECONDS]


def test_wall_time_counts_where_a_call_waits_on_the_host():
    """A call that stops for the host (here a callback that sleeps 20 ms; on a GPU, the LM head's
    data-dependent loop) takes at least that long in wall time, which the device time of its
    kernels would leave out."""
    import time

    import jax
    import jax.numpy as jnp

    from cutelayers.bench.timing import wall_time

    def nap(x):
        time.sleep(0.02)
        return x

    fn = jax.jit(lambda x: jax.pure_callback(nap, jax.ShapeDtypeStruct(x.shape, x.dtype), x) + 1.0)
    assert 0.02 <= wall_time(fn, jnp.ones(8), iters=2, repeats=3) < 1.0


def test_call_kernels_gives_each_kernel_its_median(monkeypatch, capsys):
    """One call's kernels in launch order, each the median over the traced calls; nothing where
    the calls launched different kernel counts; the GEMM table of them sums each side."""
    import jax.numpy as jnp

    from cutelayers.bench import gemm, timing

    traced = [("gemm", 3e-6), ("cast", 1e-6), ("gemm", 5e-6), ("cast", 2e-6), ("gemm", 4e-6), ("cast", 9e-6)]
    monkeypatch.setattr(timing, "traced_kernels", lambda run: (run(), traced)[1])
    assert timing.call_kernels(lambda a: a + 1, jnp.ones(4), iters=3) == [("gemm", 4e-6), ("cast", 2e-6)]
    assert timing.call_kernels(lambda a: a + 1, jnp.ones(4), iters=4) == []
    gemm.print_kernels([{"layer": "l", "impl": "ours", "kernel": "gemm", "us": 4.0},
                        {"layer": "l", "impl": "ours", "kernel": "cast", "us": 2.0},
                        {"layer": "l", "impl": "XLA", "kernel": "cublas", "us": 5.5}])
    out = capsys.readouterr().out
    assert "| l | ours | total | 6.0 |" in out and "| l | XLA | total | 5.5 |" in out


def _row(op, pass_, n, us):
    return {"op": op, "rows": 64, "n": n, "dtype": "bfloat16", "us": us, "gbs": 1.0, "pct": 50.0,
            "xla_us": 2 * us, "speedup": 2.0, "floor_us": us / 2, "pass": pass_}


def test_a_saved_table_is_the_baseline_of_the_next(tmp_path, capsys):
    """Rows saved with --json come back keyed by op, pass, shape, dtype and the parameters' dtype
    (x's for a row that does not name it: tables saved before norms had --param-dtype); the table
    then shows each row's baseline time over ours, "-" where the baseline lacks the row."""
    from cutelayers.bench.timing import load_baseline, print_table, save_rows

    path = tmp_path / "old.json"
    save_rows(path, [_row("rms_norm", "fwd", 4096, 30.0), _row("rms_norm", "fwd+bwd", 4096, 90.0)])
    described, times = load_baseline(path)
    assert str(path) in described and times == {("rms_norm", "fwd", 64, 4096, "bfloat16", "bfloat16"): 30.0,
                                                 ("rms_norm", "fwd+bwd", 64, 4096, "bfloat16", "bfloat16"): 90.0}
    print_table([_row("rms_norm", "fwd", 4096, 20.0), _row("rms_norm", "fwd+bwd", 8192, 60.0),
                 {**_row("rms_norm", "fwd", 4096, 20.0), "params": "bfloat16"},
                 {**_row("rms_norm", "fwd", 4096, 20.0), "params": "float32"}], times)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| XLA/floor | XLA/ours | baseline/ours |") and lines[1].count("---|") == 12
    # XLA at 4x the floor: a kernel at the floor would be 4x XLA; 30 us before, 20 now
    assert lines[2].endswith("| 4.00 | 2.00 | 1.50 |")
    assert lines[3].endswith("| 2.00 | - |")  # N = 8192: not in the baseline
    assert lines[4].endswith("| 2.00 | 1.50 |")  # bf16 parameters named: the same row
    assert lines[5].endswith("| 2.00 | - |")  # float32 parameters: another row
    print_table([_row("rms_norm", "fwd", 4096, 20.0)])
    assert capsys.readouterr().out.splitlines()[0].endswith("| XLA/ours |")


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the baseline"),
    ("not json", "is not JSON"),
    ('{"format": 2, "rows": []}', "is not a table written by --json"),
    ('[1, 2]', "is not a table written by --json"),
    ('{"format": 1, "rows": [{"op": "x"}]}', "has a row without op, rows, n, dtype and us"),
])
def test_a_bad_baseline_is_refused_before_anything_runs(content, message, tmp_path, capsys):
    path = tmp_path / "baseline.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["norms", "--n", "128", "--baseline", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --baseline" in err and message in err and str(path) in err


def test_json_needs_an_existing_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["softmax", "--json", str(tmp_path / "missing" / "rows.json")])
    assert "argument --json" in capsys.readouterr().err


def test_the_demo_takes_help_without_running(capsys):
    from cutelayers.__main__ import main as demo

    with pytest.raises(SystemExit) as done:
        demo(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m cutelayers" in out and "platform:" not in out  # nothing ran
    with pytest.raises(SystemExit) as done:
        demo(["--bogus"])
    assert done.value.code == 2


def test_the_demo_names_a_backend_variable_that_names_no_backend(monkeypatch):
    monkeypatch.setenv("CUTELAYERS_BACKEND", "nope")
    done = subprocess.run([sys.executable, "-m", "cutelayers"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "CUTELAYERS_BACKEND='nope' is not a backend; allowed: auto, cute, reference" in done.stderr
    assert "platform:" not in done.stdout  # nothing ran


@pytest.mark.parametrize("argv,message", [
    (["compile", "--n", "0"], ("argument --n: must be a positive multiple of 8 (fused_linear's CuTe GEMM takes K "
                               "and N multiples of 8); got 0")),
    (["compile", "--n", "-4"], "argument --n: must be a positive multiple of 8"),
    (["compile", "--k", "3", "--n", "12"], "argument --k: must be a positive multiple of 8"),
    (["compile", "--k", "ten"], "argument --k: must be an integer; got 'ten'"),
    (["reduce", "--rows", "0"], "argument --rows: must be a positive integer; got 0"),
    (["embed", "--block-tokens", "-1"], "argument --block-tokens: must be a positive integer; got -1"),
    (["lm_head", "--label-smoothing", "1"], "argument --label-smoothing: label_smoothing must be in [0, 1); got 1.0"),
    (["lm_head", "--label-smoothing", "a"], "argument --label-smoothing: must be a number; got 'a'"),
    ([], "the following arguments are required: {reduce,norms,softmax,gemm,lm_head,embed,compile}"),
])
def test_sizes_and_the_suite_are_checked_as_usage_errors(argv, message, capsys):
    """Sizes the kernels cannot take were tracebacks from inside the compile; a missing suite was
    named by the parser's dest ("suite"), which the usage never shows."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
