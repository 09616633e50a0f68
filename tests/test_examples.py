"""The examples under examples/: each runs as a script and reports success, and the gradient
checker and the classifier fail when what they check is wrong."""

import importlib.util
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

import cutelayers as cl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
DTYPES = ("bfloat16", "float16", "float32")


def run_example(name: str, *args: str) -> str:
    """stdout of ``python examples/<name> args``; fails the test on a non-zero exit."""
    # the checkout first on the path, as for this process, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def load_example(name: str):
    """The example as a module, to call its main() in this process."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), os.path.join(EXAMPLES, name))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def seed_args(rng) -> tuple[str, str]:
    return "--seed", str(int(rng.integers(2**31)))


# --- gradient_check.py -----------------------------------------------------------------------------

def table_rows(stdout: str) -> list[list[str]]:
    """The table's rows split at runs of 2+ spaces: [op, variant, dtype, shape, grads, max, tol, ok]."""
    ops = tuple(cl.ops.__all__)
    return [re.split(r"\s{2,}", line) for line in stdout.splitlines() if line.startswith(ops)]


def test_gradient_check_covers_every_op_and_dtype(rng):
    stdout = run_example("gradient_check.py", "--quick", *seed_args(rng))
    rows = table_rows(stdout)
    assert {(row[0], row[2]) for row in rows} == {(op, dtype) for op in cl.ops.__all__ for dtype in DTYPES}
    assert all(row[-1] == "ok" for row in rows), stdout
    assert f"{len(rows)} of {len(rows)} rows within tolerance" in stdout


# op -> (the reference to replace, a wrong version made from the original, the variant whose rows
# must fail, the gradient that must be out of tolerance there)
WRONG_REFERENCES = {
    "softmax": ("ref_softmax", lambda original: lambda x: original(1.1 * x), "-", "dx"),
    "logsumexp": ("ref_logsumexp", lambda original: lambda x: original(x) * jnp.nan, "-", "dx"),  # NaN fails
    "softmax_cross_entropy": (  # label smoothing dropped: only the variant that uses it fails
        "ref_cross_entropy",
        lambda original: lambda logits, labels, ignore_index=None, label_smoothing=0.0, z_loss=0.0:
            original(logits, labels, ignore_index, 0.0, z_loss),
        "ignore_index, label_smoothing, z_loss", "dlogits"),
    "layer_norm": (  # the bias enters 10% too weakly: only dbias is wrong
        "ref_layer_norm", lambda original: lambda x, scale, bias: original(x, scale, 0.9 * bias),
        "scale, bias; x of mean 3", "dbias"),
}


@pytest.mark.parametrize("op", sorted(WRONG_REFERENCES))
def test_gradient_check_fails_on_a_wrong_reference(op, rng, monkeypatch, capsys):
    gradient_check = load_example("gradient_check.py")
    name, make_wrong, failing_variant, wrong_gradient = WRONG_REFERENCES[op]
    monkeypatch.setattr(gradient_check, name, make_wrong(getattr(gradient_check, name)))
    assert gradient_check.main(["--quick", "--op", op, *seed_args(rng)]) == 1
    rows = table_rows(capsys.readouterr().out)
    assert {row[2] for row in rows} == set(DTYPES)
    for row in rows:
        errors = {k: float(v) for k, v in (item.split("=") for item in row[4].split())}
        failing = row[1] == failing_variant
        # "not <=": NaN counts as out of tolerance
        out_of_tolerance = {k for k, e in errors.items() if not e <= float(row[6])}
        assert out_of_tolerance == ({wrong_gradient} if failing else set()), row
        assert row[-1] == ("FAIL" if failing else "ok"), row


# --- drop_in_swap.py and classifier.py ---------------------------------------------------------------

def test_drop_in_swap_matches_the_stock_models(rng):
    stdout = run_example("drop_in_swap.py", *seed_args(rng))
    tolerance = float(re.search(r"tolerance (\S+)", stdout).group(1))
    for framework in ("nnx", "equinox", "linen"):
        line = next(line for line in stdout.splitlines() if line.startswith(framework))
        error, before = map(float, re.search(r"restoring: (\S+)\s+\(before: (\S+)\)", line).groups())
        assert error <= tolerance < before and line.endswith("ok"), line


def test_classifier_learns_the_planted_tokens(rng):
    stdout = run_example("classifier.py", *seed_args(rng))
    match = re.search(r"loss fell from (\S+) to (\S+); held-out accuracy (\S+)", stdout)
    first, last, accuracy = map(float, match.groups())
    assert last < 0.5 * first and accuracy > 0.9, stdout


def test_classifier_reports_a_loss_that_did_not_fall(rng, capsys):
    # one step: the last loss is the first, so the check in the script must fail
    assert load_example("classifier.py").main(["--steps", "1", *seed_args(rng)]) == 1
    assert "FAIL" in capsys.readouterr().out
