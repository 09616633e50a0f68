"""The LM-head benchmark's memory analysis (on CPU: the ops' reference path, chunked the same way)
and its rows on a GPU; its subcommand is tested with the others in test_bench.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cutelayers.bench.lm_head import (
    bench_lm_head,
    compile_head,
    device_peak_bytes,
    head_memory,
    head_operands,
)

F32 = jnp.float32


def test_chunked_head_needs_a_fraction_of_the_unfused_temp_memory():
    t, h, v = 2048, 256, 32768
    logits_bytes = t * v * 4
    memory = head_memory(t, h, v, F32, chunk_size=256)
    assert memory["xla"]["temp"] >= logits_bytes  # the unfused head holds the float32 logits
    # one chunk's logits (256 x V) and the float32 dkernel accumulator (H x V), 1/8 of XLA's here
    assert memory["fused"]["temp"] < logits_bytes / 2
    assert memory["fused"]["temp"] < memory["xla"]["temp"] / 6
    # same operands and results: only the scratch memory differs
    assert memory["fused"]["arguments"] == memory["xla"]["arguments"]
    assert memory["fused"]["outputs"] == memory["xla"]["outputs"]


def test_vocab_major_table_head_memory():
    # a (V, H) table: the same chunked scratch, and XLA's head reads it as stored too
    t, h, v = 2048, 256, 32768
    memory = head_memory(t, h, v, F32, chunk_size=256, kernel_layout="vh")
    assert memory["fused"]["temp"] < memory["xla"]["temp"] / 6
    assert memory["fused"]["arguments"] == memory["xla"]["arguments"] == (t * h + v * h + t) * 4


def test_chunked_head_temp_memory_does_not_grow_with_tokens():
    small, large = (head_memory(t, 128, 8192, F32, chunk_size=128) for t in (1024, 4096))
    assert large["xla"]["temp"] >= 3 * small["xla"]["temp"]
    assert large["fused"]["temp"] <= 1.25 * small["fused"]["temp"]


def test_float32_params_head_keeps_no_float32_gradient_scratch():
    # mixed precision: the fused head's float32 dkernel sum is the gradient (an output), so its
    # scratch holds the kernel's bfloat16 copy (2 bytes a weight) where the same head with
    # bfloat16 parameters holds the float32 sum (4 bytes a weight); XLA's buffer assignment moves
    # the rest by a few percent, hence the margin of one byte a weight. Small chunks: the peak is
    # then where the (H, V) buffers compared are live, not in a chunk's float32 logits (here the
    # reference lowering's, of the exp GEMM and its passes over rows out of range)
    t, h, v = 1024, 512, 16384
    mixed = head_memory(t, h, v, jnp.bfloat16, chunk_size=64, param_dtype=F32)
    plain = head_memory(t, h, v, jnp.bfloat16, chunk_size=64)
    assert mixed["fused"]["outputs"] == mixed["xla"]["outputs"] >= h * v * 4
    assert mixed["fused"]["temp"] <= plain["fused"]["temp"] - h * v


def test_label_smoothing_reaches_both_heads():
    # --label-smoothing: the fused head (here the exp path's reference lowering, at a vocabulary
    # padded for it) and XLA's (optax against smoothed one-hot targets) give the same loss and
    # kernel gradient, and the smoothing moves that gradient by about a of itself
    operands = head_operands(256, 64, 1000, jnp.bfloat16, param_dtype=F32)
    grads = {}
    for head in ("fused", "xla"):
        for a in (0.0, 0.2):
            loss, (_, dkernel) = compile_head(head, operands, 64, "hv", a)(*operands)
            grads[head, a] = (float(loss), np.asarray(dkernel))
    for a in (0.0, 0.2):
        assert grads["fused", a][0] == pytest.approx(grads["xla", a][0], rel=1e-2)
        np.testing.assert_allclose(grads["fused", a][1], grads["xla", a][1], atol=2e-2 * np.abs(grads["xla", a][1]).max())
    moved = np.linalg.norm(grads["xla", 0.2][1] - grads["xla", 0.0][1]) / np.linalg.norm(grads["xla", 0.0][1])
    assert 0.1 < moved < 0.4, moved


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's case: a device without statistics")
def test_device_peak_is_none_without_device_statistics():
    # the measuring process runs (a fresh python -m cutelayers.bench.lm_head) and says so
    assert device_peak_bytes("fused", 64, 32, 200, jnp.bfloat16) is None


@pytest.mark.gpu
def test_lm_head_device_peak():
    # each head's temporary memory by the device's counter (its peak's rise less its outputs), each
    # in a fresh process: the fused head's chunked scratch -- the kernel's bf16 copy, a chunk of
    # logits -- well under XLA's (T, V) float32 logits, and near the compiled program's account
    t, h, v = 4096, 256, 32768
    rows = bench_lm_head(t, h, v, jnp.bfloat16, chunk_sizes=(512,), param_dtype=jnp.float32, device_peak=True)
    fused, xla = (float(row["peak_temp_gb"].lstrip("<=")) * 1e9 for row in rows)
    assert xla >= t * v * 4 and h * v * 2 <= fused < xla / 4, rows
    assert abs(fused - float(rows[0]["temp_gb"]) * 1e9) <= 0.5 * fused, rows


@pytest.mark.gpu
@pytest.mark.parametrize("kernel_layout", ["hv", "vh"])
def test_exp_path_scratch_is_one_chunk_of_p(kernel_layout):
    # The exp path's scratch by the compiled program's account: the kernel's bfloat16 copy and one
    # chunk's P (its exp GEMM's output, which the label's update writes in place), and little else.
    # Fails on a program that keeps a second P: the thirty-second session's merge of the exp step
    # into add_chunk_grads (dh's mask read from the scale, not `good`) made XLA copy P before that
    # update -- 0.52 -> 0.92 GB at GPT-2 size, 1.63 -> 2.64 GB at 16384 x 2048 x 128256 (H100).
    t, h, v, chunk = 4096, 256, 32768, 1024
    memory = head_memory(t, h, v, jnp.bfloat16, chunk_size=chunk, param_dtype=F32, kernel_layout=kernel_layout)
    copy, p = h * v * 2, chunk * v * 2
    assert p <= memory["fused"]["temp"] <= copy + 1.25 * p, memory["fused"]


@pytest.mark.gpu
def test_lm_head_benchmark_rows():
    rows = bench_lm_head(512, 256, 4096, jnp.bfloat16, chunk_sizes=(None, 128))
    assert [(row["head"], row["chunk"]) for row in rows] == [("fused", "default"), ("fused", 128), ("xla", "-")]
    *fused, xla = (float(row["loss"]) for row in rows)
    assert all(abs(loss - xla) <= 1e-2 * abs(xla) for loss in fused)
    assert all(float(row["temp_vs_xla"]) < 1.0 for row in rows[:2]) and rows[2]["time_vs_xla"] == "1.00"
    assert rows[2]["wall_vs_xla"] == "1.00" and all(float(row["wall_ms"]) > 0 for row in rows)
    fused, xla = bench_lm_head(512, 256, 4096, jnp.bfloat16, kernel_layout="vh")
    assert fused["layout"] == xla["layout"] == "vh"
    assert abs(float(fused["loss"]) - float(xla["loss"])) <= 1e-2 * abs(float(xla["loss"]))
