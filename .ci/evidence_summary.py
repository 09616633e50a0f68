"""The summary `.ci/gpu-evidence` prints last: python .ci/evidence_summary.py OUT_DIR.

Reads what the stages left in OUT_DIR (any may be missing: a stage that was cut short still gets
its line):

* steps.tsv            -- one line per step: name, exit status, seconds, its log's last telling line;
* tests.log            -- pytest -v output (xdist lines "[gw3] [ 12%] PASSED tests/f.py::t");
* tests-collected.txt  -- pytest --collect-only -q: what should have run, per file;
* test-timings.jsonl   -- per test: seconds, CuTe compiles and seconds, lowering, XLA compile
                          (tests/conftest.py, CUTELAYERS_TEST_TIMINGS);
* bench.log            -- every benchmark family's output, each after a "### bench FAMILY" line;
* autotune.log         -- the sweeps' progress and tables (heuristic vs tuned time per kernel).
"""

from __future__ import annotations

import collections
import json
import math
import re
import sys
from pathlib import Path

OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
# a node id: its parameters may hold spaces (a GemmConfig repr), so they run to the "]" that ends
# the id (followed by a space or the line's end)
NODE = re.compile(r"(tests/[\w./-]+\.py)::(\w+(?:\[.*?\](?=\s|$))?)")
RATIO_HEADER = re.compile(r"XLA/ours|speedup|vs[ _]xla", re.IGNORECASE)


def test_outcomes(log: str) -> dict[str, str]:
    """nodeid -> outcome; a failure or error in any phase wins over a pass."""
    outcomes: dict[str, str] = {}
    for line in log.splitlines():
        outcome, node = OUTCOME.search(line), NODE.search(line)
        if outcome and node and not line.startswith(("FAILED ", "ERROR ")):  # -r summary repeats them
            nodeid = f"{node[1]}::{node[2]}"
            if outcomes.get(nodeid) not in ("FAILED", "ERROR"):
                outcomes[nodeid] = outcome[1]
    return outcomes


def tests_table(out: Path) -> list[str]:
    log_path = out / "tests.log"
    if not log_path.exists():
        return []
    log = log_path.read_text(errors="replace")
    outcomes = test_outcomes(log)
    collected = collections.Counter()
    if (out / "tests-collected.txt").exists():
        for line in (out / "tests-collected.txt").read_text().splitlines():
            if node := NODE.match(line):
                collected[node[1]] += 1
    records = []
    if (out / "test-timings.jsonl").exists():
        for line in (out / "test-timings.jsonl").read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a killed worker
                pass
    timing = collections.defaultdict(collections.Counter)
    for record in records:
        timing[record["test"].split("::")[0]].update({k: v for k, v in record.items() if k != "test"})
    per_file = collections.defaultdict(collections.Counter)
    for nodeid, outcome in outcomes.items():
        per_file[nodeid.split("::")[0]][outcome] += 1
    header = ("| test file | collected | passed | failed | skipped | not run | test s | CuTe compile s (kernels) "
              "| XLA compile s | trace+lower s | run and other s |")
    lines = [header, "|" + "---|" * 11]
    total = collections.Counter()
    for file in sorted(set(per_file) | set(collected)):
        c, t = per_file[file], timing[file]
        failed = c["FAILED"] + c["ERROR"] + c["XPASS"]
        row = {"collected": collected[file], "passed": c["PASSED"], "failed": failed, "skipped": c["SKIPPED"] + c["XFAIL"],
                   "not_run": max(collected[file] - sum(c.values()), 0), "seconds": t["seconds"],
                   "cute": t["cute_compile_s"], "kernels": t["cute_compiles"], "xla": t["xla_compile_s"], "lower": t["lowering_s"]}
        total.update(row)
        lines.append(_test_row(file, row))
    lines.append(_test_row("**total**", total))
    crashes = log.count("node down")
    tail = [line for line in log.splitlines() if re.match(r"=+ .* in [\d.]+s( \(.*\))? =+$", line)]
    lines.append("")
    lines.append("Seconds are summed over the tests (the workers run side by side; the step table has the wall time).")
    lines.append(f"pytest: {tail[-1].strip('= ') if tail else 'no final line (cut short)'}; "
                 f"workers lost: {crashes} (a crash, or a test past --timeout: its worker is ended and replaced)")
    lines += ["", "| slowest tests | s | CuTe compile s (kernels) | XLA compile s | trace+lower s |", "|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: -r["seconds"])[:10]:
        lines.append(f"| {r['test']} | {r['seconds']:.1f} | {r['cute_compile_s']:.1f} ({r['cute_compiles']}) | "
                     f"{r['xla_compile_s']:.1f} | {r['lowering_s']:.1f} |")
    return lines


def _test_row(name: str, r) -> str:
    rest = r["seconds"] - r["cute"] - r["xla"] - r["lower"]
    return (f"| {name} | {r['collected']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['not_run']} | "
            f"{r['seconds']:.0f} | {r['cute']:.0f} ({r['kernels']}) | {r['xla']:.0f} | {r['lower']:.0f} | {rest:.0f} |")


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of every markdown table in ``text``."""
    tables, header, rows = [], None, []
    for line in text.splitlines() + [""]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            if header:
                tables.append((header, rows))
            header, rows = None, []
        elif header is None:
            header = cells
        elif not set(line) <= set("|-: "):
            rows.append(cells)
    return tables


def headline(text: str) -> str:
    """Each ratio-to-XLA column of the family's tables, per (op, pass) where the table has those
    columns: range and geometric mean over the rows (rows of the XLA baseline itself left out)."""
    parts = []
    for header, rows in markdown_tables(text):
        keys = [header.index(k) for k in ("op", "pass") if k in header]
        for i, name in enumerate(header):
            if not RATIO_HEADER.search(name):
                continue
            groups = collections.defaultdict(list)
            for row in rows:
                if len(row) == len(header) and row[0].lower() != "xla":
                    try:
                        groups[" ".join(row[k] for k in keys)].append(float(row[i]))
                    except ValueError:
                        pass
            for group, values in groups.items():
                label = f"{group} {name}".strip()
                if len(values) == 1:
                    parts.append(f"{label} {values[0]:.2f}")
                elif all(v > 0 for v in values):
                    gmean = math.exp(sum(map(math.log, values)) / len(values))
                    parts.append(f"{label} {min(values):.2f}-{max(values):.2f} (geomean {gmean:.2f}, {len(values)} shapes)")
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "no output")
    return "; ".join(parts) or f"no ratio to XLA; last line: {last[:100]}"


def bench_table(out: Path) -> list[str]:
    path = out / "bench.log"
    if not path.exists():
        return []
    sections = re.split(r"^### bench (\S+)\n", path.read_text(errors="replace"), flags=re.MULTILINE)
    lines = ["| benchmark | headline vs XLA |", "|---|---|"]
    for family, text in zip(sections[1::2], sections[2::2]):
        lines.append(f"| {family} | {headline(text)} |")
    return lines


def autotune_table(out: Path) -> list[str]:
    path = out / "autotune.log"
    if not path.exists():
        return []
    rows = [(h, r) for h, rs in markdown_tables(path.read_text(errors="replace")) for r in rs if h[0] == "kernel"]
    if not rows:
        return ["autotune: no sweep finished (see autotune.log)"]
    header = rows[0][0]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for _, r in rows]


def steps_table(out: Path) -> list[str]:
    path = out / "steps.tsv"
    if not path.exists():
        return []
    lines = ["| step | exit | seconds | last line |", "|---|---|---|---|"]
    for line in path.read_text().splitlines():
        name, status, seconds, last = line.split("\t")
        status += {"124": " (time limit)", "137": " (killed)", "skipped": " (no time left)"}.get(status, "")
        lines.append(f"| {name} | {status} | {seconds} | {last} |")
    return lines


def main(out: str) -> int:
    path = Path(out)
    for block in (steps_table(path), tests_table(path), bench_table(path), autotune_table(path)):
        if block:
            print("\n".join(block) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
