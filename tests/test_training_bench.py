"""python -m training.bench on CPU with the tiny config: every case runs (in its own process), the
table compares with the stock twin, the per-part breakdown covers the step, the report is
appended to the output file."""

import re

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from training import bench
from training.data import TextData


def test_bench_tiny_cases_table_and_breakdown(tmp_path, capsys):
    output = tmp_path / "bench.md"
    output.write_text("# earlier results\n")
    argv = ["--config", "tiny", "--model", "nnx", "--variant", "cutelayers", "stock", "--steps", "2",
            "--warmup-steps", "1", "--breakdown", "--output", str(output)]
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
    parts = re.findall(r"^\| (GEMM \w+ \(\d+x\d+\)|MLP \(\d+x\d+x\d+\)|LayerNorm|attention|LM head \+ loss|"
                       r"optimizer \(AdamW\)|other \(step - parts\)) \| ([\d.-]+) \| ([\d.-]+) \|",
                       text, re.M)
    assert len(parts) == 8
    assert all(float(ours) > 0 and float(stock) > 0 for name, ours, stock in parts if not name.startswith("other"))
    assert text.strip().endswith(printed.strip().splitlines()[-2].strip())  # printed what it appended


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
