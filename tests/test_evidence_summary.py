"""``.ci/evidence_summary.py``, the GPU round's summary: test outcomes read from pytest's log."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("evidence_summary", Path(__file__).parents[1] / ".ci" / "evidence_summary.py")
summary = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(summary)

CONFIG = "GemmConfig(tile_m=64, tile_n=64, split_k={})"


def test_node_ids_with_spaces_in_their_parameters_stay_apart(tmp_path):
    ids = [f"tests/test_linear.py::test_split_k_gpu[decode-{CONFIG.format(s)}]" for s in (2, 3, 4)]
    log = [f"[gw{i}] [ {i}%] PASSED {node} " for i, node in enumerate(ids[:2])]
    log += [f"[gw2] [ 9%] FAILED {ids[2]}", "tests/test_norm.py::test_rows_gpu[768] SKIPPED (no GPU)",
            f"FAILED {ids[0]} - AssertionError: a summary line, not an outcome"]
    outcomes = summary.test_outcomes("\n".join(log))
    assert outcomes == {ids[0]: "PASSED", ids[1]: "PASSED", ids[2]: "FAILED",
                        "tests/test_norm.py::test_rows_gpu[768]": "SKIPPED"}

    (tmp_path / "tests.log").write_text("\n".join(log))
    (tmp_path / "tests-collected.txt").write_text("\n".join([*ids, "tests/test_norm.py::test_rows_gpu[768]",
                                                             "tests/test_norm.py::test_rows_gpu[1024]"]))
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:6] for line in summary.tests_table(tmp_path)
            if line.startswith("| tests/")}
    # collected, passed, failed, skipped, not run
    assert rows == {"tests/test_linear.py": ["3", "2", "1", "0", "0"], "tests/test_norm.py": ["2", "0", "0", "1", "1"]}
