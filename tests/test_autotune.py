"""Autotuning: config spaces (every GEMM config, and a sample of each other space, compiles for
sm_90a on CPU), the tuned-config table (lookup, user over shipped, malformed tables fall back with
a warning, a tuned config is its own compile key), the sweep with an injected runner, and the CLI;
`gpu` runs a real sweep."""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_GPU, UNWRITABLE, built, unwritable_path
from test_linear import lower_cuda

import cutelayers as cl
from cutelayers import tuning
from cutelayers.bench import autotune
from cutelayers.kernels import norm_config, reduction_config, softmax_config
from cutelayers.kernels.gemm_config import (
    CONFIGS,
    EXTRA_CONFIGS,
    PERSISTENT_SMS,
    SMEM_CAPACITY,
    SPLIT_K_CONFIGS,
    STREAM_K_CONFIG,
    config_class,
    decode_split_config,
    row_bucket,
)
from cutelayers.kernels.reduction_config import (
    CTA_THREADS,
    MAX_THREADS_PER_ROW,
    MIN_THREADS_PER_ROW,
    RowConfig,
    cut_budget,
    geometry_for,
    latency_geometry,
    row_config,
    row_config_space,
    row_count_bucket,
    row_geometry,
    row_geometry_space,
)
from cutelayers.ops.linear import LinearForward, LinearInputGrad, LinearWeightGrad
from cutelayers.ops.norm import NormBackward, NormForward
from cutelayers.ops.reduce import RowReduce
from cutelayers.ops.softmax import CrossEntropyBackward, CrossEntropyForward, SoftmaxBackward, SoftmaxForward
from cutelayers.runtime.sharding import kernel_call

S = jax.ShapeDtypeStruct
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FAKE_GPU = "Fake H100 for tests"
REAL_DEVICE_KIND = tuning.device_kind  # before the fixture below stands a fake in for it


@pytest.fixture(autouse=True)
def no_tables(monkeypatch, tmp_path):
    """No user table, an empty shipped table, a fresh compile cache (kernels other tests of the run
    compiled may load from its disk cache); tuned lookups for FAKE_GPU."""
    monkeypatch.setenv("CUTELAYERS_TUNING_FILE", "")
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"format": 1, "entries": []}))
    monkeypatch.setattr(tuning, "SHIPPED_TABLE", shipped)
    monkeypatch.setattr(tuning, "device_kind", lambda: FAKE_GPU)
    cl.clear_cache()
    jax.clear_caches()
    yield
    cl.clear_cache()


def write_table(path: Path, entries, **top) -> Path:
    path.write_text(json.dumps({"format": 1, "entries": entries, **top}))
    return path


def entry(kernel, dtype, dims, config, device=FAKE_GPU):
    return {"device": device, "kernel": kernel, "dtype": dtype, "dims": dims, "config": config}


def use_table(monkeypatch, path):
    monkeypatch.setenv("CUTELAYERS_TUNING_FILE", str(path))
    jax.clear_caches()  # functions traced before keep their config


def targets(hlo: str) -> list[str]:
    return [line.split("@")[1].split("(")[0] for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]


def fields(config) -> dict:
    return dataclasses.asdict(config)


# --- config spaces -------------------------------------------------------------------------------

ROW_NS = [1, 3, 7, 8, 100, 1000, 1024, 4096, 5000, 12000, 32768, 65537, 262144]


@pytest.mark.parametrize("bits", [16, 32])
@pytest.mark.parametrize("values_per_thread", [16, 32])
def test_row_geometry_space_holds_the_heuristic_and_keeps_residency(bits, values_per_thread):
    for n in ROW_NS:
        heuristic = row_geometry(n, bits, values_per_thread)
        space = row_geometry_space(n, bits, values_per_thread)
        assert heuristic in space, n
        assert len(space) == len(set(space))
        for g in space:
            tpr, threads = g.row.threads_per_row, g.row.num_threads
            assert MIN_THREADS_PER_ROW <= tpr <= MAX_THREADS_PER_ROW and tpr & (tpr - 1) == 0
            assert threads in CTA_THREADS and threads % tpr == 0
            assert g.vec * g.row.unroll <= max(values_per_thread, g.vec)  # register budget per step
            assert g.resident == heuristic.resident  # the kernels' code path never changes
        if n in (1000, 1024, 4096):
            assert len(space) > 1, n  # something to tune (rows needing 512 threads have one config)


@pytest.mark.parametrize("bits", [16, 32])
def test_row_reduce_space_holds_the_heuristic(bits):
    for n in ROW_NS:
        space = row_config_space(n, bits)
        assert row_config(n, bits) in space, n
        assert len(space) == len(set(space))
        for c in space:
            assert c.threads_per_row & (c.threads_per_row - 1) == 0 and c.num_threads in CTA_THREADS
            assert c.num_threads % c.threads_per_row == 0


@pytest.mark.cute
def test_gemm_space_is_the_config_table():
    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    family = LinearForward("none", False, False, False)
    avals = (S((1, 100, 256), BF16), S((1, 256, 512), BF16))
    assert family.config_space(avals) == tuple(CONFIGS.values()) + EXTRA_CONFIGS + SPLIT_K_CONFIGS
    for config in family.config_space(avals):
        HopperGemmKernel(config, Epilogue())  # its own checks on tile shapes
        assert config.smem_bytes(2) <= SMEM_CAPACITY


def test_a_decode_forward_over_a_long_contraction_is_tuned_as_the_layers_run_it():
    """Decode rows over a long contraction: the forward is the stream-K kernel the layer runs (the
    input gradient's, reading the weight in the other layout, into float32 zeros), tuned once for
    every epilogue; a short contraction tunes the fused forwards."""
    (fwd, space, default), *rest = autotune.list_candidates("linear", [(16, 16384, 512)], ["bfloat16"])
    family = fwd.family
    assert (family.name, family.stream_k, family.kernel_nk) == ("linear_dx", True, True)
    assert [a.shape for a in fwd.avals] == [(1, 16, 16384), (1, 16384, 512), (1, 16, 512)]
    assert default == CONFIGS["small_m"] and default in space and not any(c.pingpong for c in space)
    assert [c.family.name for c, _, _ in rest] == ["linear_dx", "linear_dx", "linear_dkernel"]
    short = autotune.list_candidates("linear", [(16, 4096, 4096)], ["bfloat16"])
    assert [c.family.name for c, _, _ in short][:2] == ["linear_fwd", "linear_fwd"]


def test_a_gated_mlp_tunes_its_two_gated_kernels():
    """gated_mlp M x K x H: fc1's gated forward (storing z1) and the hidden gradient writing both
    halves, each with tiles of whole 64-column blocks of each half; a hidden width that is not
    whole blocks is refused; a kernel's own name keeps selecting the linear op."""
    (fwd, fwd_space, fwd_default), (grad, grad_space, grad_default) = autotune.list_candidates(
        "gated_mlp", [(16384, 768, 3072)], ["bfloat16"])
    assert (fwd.family.name, fwd.family.gated, fwd.family.store_preact) == ("linear_fwd", True, True)
    assert [a.shape for a in fwd.avals] == [(1, 16384, 768), (1, 768, 6144), (6144,)]
    assert (grad.family.name, grad.family.gated) == ("linear_dx", True)
    assert [a.shape for a in grad.avals] == [(1, 16384, 768), (1, 3072, 768), (1, 16384, 6144)]
    assert fwd_default in fwd_space and {c.tile_n for c in fwd_space} == {128, 256}
    assert grad_default in grad_space and all(3072 % c.tile_n == 0 for c in grad_space)
    with pytest.raises(ValueError, match="hidden width 40 is not a multiple of 64"):
        autotune.cases("gated_mlp", [(64, 64, 40)], ["bfloat16"])
    assert autotune.FAMILY_OPS["linear_fwd"] == "linear"


def test_an_lm_head_chunk_tunes_its_three_kernels():
    """lm_head M x K x V: the exp logits GEMM (two results, its own key), the hidden gradient over
    the vocabulary (stream-K into zeros where the (M, K) output is too small to fill the GPU) and
    the kernel gradient added into the float32 running sum; each as the op runs it."""
    gpt2, llama = (autotune.cases("lm_head", [shape], ["bfloat16"]) for shape in ((4096, 768, 50304), (4096, 4096, 131072)))
    for (exp, dh, dkernel), (m, k, v) in ((gpt2, (4096, 768, 50304)), (llama, (4096, 4096, 131072))):
        assert exp.family.exp_row_sums and dict(exp.key[1])["exp_row_sums"]
        assert [a.shape for a in exp.avals] == [(1, m, k), (1, k, v)]
        assert dh.family.name == "linear_dx" and [a.shape for a in dh.avals][:2] == [(1, m, v), (1, k, v)]
        assert dkernel.family.accumulate and [a.shape for a in dkernel.avals] == [(1, m, k), (1, m, v), (1, k, v)]
        assert dkernel.avals[2].dtype == jnp.float32
    assert gpt2[1].family.stream_k and gpt2[1].avals[2].shape == (1, 4096, 768)  # 96 output tiles
    assert not llama[1].family.stream_k and len(llama[1].avals) == 2
    assert autotune.FAMILY_OPS["linear_fwd"] == "linear"


def test_the_linear_weight_gradient_is_tuned_as_the_layers_run_it():
    """The linear autotune's weight gradient is the kernel a layer with a bias runs: db summed by it,
    and where the (K, N) output is too small to fill the GPU (GPT-2's layers over 16384 rows), on
    the stream-K schedule -- its partial tiles meeting in a workspace (flags in, scratch out, not
    compared with the reference), or for the fewest tiles (the attention output's) added into
    float32 zeros; its space is the cooperative configs (HopperGemmKernel refuses pingpong ones
    for stream-K), its heuristic STREAM_K_CONFIG among them."""
    from cutelayers.kernels.gemm import Epilogue, HopperGemmKernel

    for shape, stream_k in (((16384, 768, 2304), "workspace"), ((16384, 768, 768), "zeros"),
                            ((16384, 4096, 16384), None), ((1000, 768, 768), None)):
        (*_, (case, space, default)) = autotune.list_candidates("linear", [shape], ["bfloat16"])
        family = case.family
        assert (family.name, family.stream_k, family.accumulate, family.operand_sums) == (
            "linear_dkernel", stream_k is not None, stream_k == "zeros", "b"), shape
        assert family.fixup == (stream_k == "workspace")
        assert dict(case.key[1]).get("stream_k", False) == (stream_k is not None)
        last = {"workspace": [(PERSISTENT_SMS,)], "zeros": [(1, shape[1], shape[2])], None: []}[stream_k]
        assert [a.shape for a in case.avals][2:] == [(1, shape[2])] + last
        if stream_k:
            assert default == STREAM_K_CONFIG and default in space
            assert space and not any(c.pingpong for c in space)
            assert set(space) == {c for c in CONFIGS.values() if not c.pingpong} | {
                c for c in EXTRA_CONFIGS if not c.pingpong}
            for config in space:
                HopperGemmKernel(config, Epilogue(), accumulate=family.accumulate, stream_k=True)
        if stream_k == "workspace":
            assert case.observe(("dkernel", "sums", "workspace", "flags")) == ("dkernel", "sums")
        operands = case.make_operands()
        assert all(o.dtype == a.dtype for o, a in zip(operands, case.avals, strict=True))
        assert all(not o.any() for o in operands[2:])  # the sums, the flags, the accumulator start at zero


def families_and_avals():
    """(family, operand avals, the heuristic config computed from the kernels' config modules directly)."""
    norm_fwd, norm_bwd = norm_config.FORWARD_VALUES_PER_THREAD, norm_config.BACKWARD_VALUES_PER_THREAD
    soft_fwd, soft_bwd = softmax_config.FORWARD_VALUES_PER_THREAD, softmax_config.BACKWARD_VALUES_PER_THREAD
    ln = (S((4096, 1000), BF16), S((1000,), F32), S((1000,), BF16))
    few_ln = (S((8, 1000), BF16), S((1000,), F32), S((1000,), BF16))
    wide_few = (S((8, 8192), BF16), S((8192,), F32))
    cut = RowConfig(threads_per_row=norm_config.FEW_ROWS_CUT_THREADS, num_threads=norm_config.FEW_ROWS_CUT_THREADS,
                    unroll=1)
    ln_bwd = (S((64, 4096), BF16), S((64, 4096), BF16), S((64, 1), F32), S((64, 1), F32), S((4096,), BF16))
    rms_bwd = (S((8, 65536), F32), S((8, 65536), F32), S((8, 1), F32), S((65536,), F32))
    streamed_softmax = dataclasses.replace(
        row_geometry(32000, 16, soft_fwd).row, threads_per_row=softmax_config.STREAMED_FORWARD_THREADS,
        num_threads=softmax_config.STREAMED_FORWARD_THREADS)
    many, many_labels, many_rows = S((4096, 32000), BF16), S((4096,), jnp.int32), S((4096,), F32)
    few, few_labels, few_rows = S((8, 131072), BF16), S((8,), jnp.int32), S((8,), F32)
    few_cut = softmax_config.few_rows_cut(row_geometry(131072, 16, soft_fwd).row, 131072, 16, 8)
    assert few_cut.share_budget
    return [
        # The norm forward's vector width is set by its widest row operand (an fp32 scale here).
        (NormForward(True, True, True, 1e-6, "bfloat16"), ln, row_geometry(1000, 32, norm_fwd).row),
        # a decode batch: one row a CTA over wide CTAs; a wide row cut over a cluster of them
        (NormForward(True, True, True, 1e-6, "bfloat16"), few_ln,
         latency_geometry(1000, 32, norm_fwd, norm_config.FEW_ROWS_VALUES).row),
        (NormForward(False, True, False, 1e-6, "bfloat16"), wide_few, dataclasses.replace(
            cut, share_budget=cut_budget(cut, 8192, 32, norm_config.few_rows_cluster(8192, 32)))),
        (NormBackward(True, True, True, True), ln_bwd, row_geometry(4096, 16, norm_bwd[16]).row),
        # a streamed RMSNorm row: the table's unroll over STREAMED_BACKWARD_THREADS[False] threads
        (NormBackward(False, True, False, False), rms_bwd, dataclasses.replace(
            row_geometry(65536, 32, norm_bwd[32]).row, threads_per_row=norm_config.STREAMED_BACKWARD_THREADS[False],
            num_threads=norm_config.STREAMED_BACKWARD_THREADS[False])),
        # a streamed softmax forward row: the table's unroll over STREAMED_FORWARD_THREADS threads
        (SoftmaxForward(False), (many,), streamed_softmax),
        (SoftmaxBackward(True), (S((4096, 32000), F32), many), row_geometry(32000, 32, soft_bwd).row),
        # a decode batch: cut over CTAs, the cut carried as the share budget (the backward's counting y and dy)
        (SoftmaxForward(False), (few,), softmax_config.few_rows_cut(
            dataclasses.replace(streamed_softmax, unroll=row_geometry(131072, 16, soft_fwd).row.unroll), 131072, 16, 8)),
        (SoftmaxBackward(True), (few, few), softmax_config.few_rows_cut(
            row_geometry(131072, 16, soft_bwd).row, 131072, 16, 8, operands=2)),
        (CrossEntropyForward(True), (many, many_labels), row_geometry(32000, 16, soft_fwd).row),
        (CrossEntropyBackward(), (many, many_labels, many_rows, many_rows), row_geometry(32000, 16, soft_fwd).row),
        # a few rows of a long vocabulary: cut over CTAs, the cut carried as the share budget
        (CrossEntropyForward(True), (few, few_labels), few_cut),
        (CrossEntropyBackward(), (few, few_labels, few_rows, few_rows), softmax_config.few_rows_cut(
            row_geometry(131072, 16, soft_fwd).row, 131072, 16, 8, cluster=False)),
        (RowReduce("mean"), (S((64, 777), F16),), row_config(777, 16)),
        (LinearForward("gelu", True, False, False), (S((1, 5000, 256), BF16), S((1, 256, 4096), BF16), S((4096,), BF16)),
         CONFIGS[config_class(5000, 4096, 256)]),
        (LinearInputGrad(), (S((1, 48, 512), BF16), S((1, 256, 512), BF16)), decode_split_config(48, 256, 512)),
        (LinearInputGrad(), (S((1, 48, 64), BF16), S((1, 256, 64), BF16)), CONFIGS[config_class(48, 256, 64)]),
        (LinearWeightGrad(), (S((2, 300, 256), F16), S((2, 300, 512), F16)), CONFIGS[config_class(256, 512, 300)]),
    ]


def test_without_a_table_every_family_gets_the_heuristic(monkeypatch):
    for family, avals, expected in families_and_avals():
        assert family.default_config(avals) == expected, family
        assert tuning.resolve(family, avals).config == expected, family  # FAKE_GPU, empty tables
        assert expected in family.config_space(avals), family
    monkeypatch.setattr(tuning, "device_kind", lambda: None)  # no GPU: no lookup at all
    for family, avals, expected in families_and_avals():
        assert tuning.resolve(family, avals).config == expected


@pytest.mark.cute
def test_an_unchosen_config_is_refused_and_a_chosen_one_kept():
    avals = (S((4, 8), F32),)
    with pytest.raises(ValueError, match=r"reduce_sum: no config chosen; build the family with .*tuning\.resolve"):
        RowReduce("sum").launcher(avals, ())
    configured = RowReduce("sum", row_config_space(8, 32)[-1])
    assert tuning.resolve(configured, avals) is configured


# --- candidates compile for sm_90a (on CPU): every GEMM config, a sample of each other space ----------

def compile_candidates(case, configs):
    """Lower a kernel call of ``case``'s family with each config for CUDA; its FFI targets."""
    found = []
    for config in configs:
        family = dataclasses.replace(case.family, config=config)
        found += targets(lower_cuda(functools.partial(kernel_call, family), *case.avals))
    return found


def sample(configs, default):
    """A few configs that span a space: the first, the last, the middle one and the heuristic's."""
    return list(dict.fromkeys([configs[0], configs[len(configs) // 2], configs[-1], default]))


ROW_SHAPE_FIELDS = ("threads_per_row", "num_threads")


def spanning(configs, default, fields=ROW_SHAPE_FIELDS):
    """The heuristic's config and as few others as cover every value of ``fields`` in the space
    (greedily, the config adding the most values not yet covered first)."""
    def values(config):
        return {(f, getattr(config, f)) for f in fields}

    chosen = [default]
    missing = set().union(*map(values, configs)) - values(default)
    while missing:
        best = max(configs, key=lambda c: len(missing & values(c)))
        chosen.append(best)
        missing -= values(best)
    return chosen


def candidates(configs, default, how):
    """The configs of a space that compile: ``how`` "all", "span" (:func:`spanning`), or None
    (:func:`sample`)."""
    if how == "all":
        return list(configs)
    return spanning(configs, default) if how == "span" else sample(configs, default)


@pytest.mark.cute
@pytest.mark.parametrize("op, shape, dtype, every", [
    # Register-resident rows, backward with partials. A row kernel's configs run one code path
    # (the space keeps residency) with other thread counts: every threads_per_row and every CTA
    # size of both spaces compiles (3 + 3 configs of 9 + 6).
    ("layer_norm", (8, 1000), "bfloat16", {"layer_norm_fwd": "span", "layer_norm_bwd": "span"}),
    # Every GEMM config compiles with both operands K-major (the input gradient) here, and with
    # both M/N-major, adding into an accumulator, in test_linear.py (the weight gradient); the
    # forward (A K-major, B N-major: one operand of each) compiles a sample of the same configs.
    ("linear", (100, 256, 512), "bfloat16", {"linear_dx": "all"}),
    ("softmax", (8, 1000), "float16", {}),
    ("rms_norm", (8, 12000), "float32", {}),  # streamed rows: dscale summed in shared memory
    ("cross_entropy", (8, 20000), "float32", {}),
    ("reduce_max", (8, 1000), "float32", {}),
])
def test_candidates_compile_for_sm90a(op, shape, dtype, every):
    """The configs :func:`candidates` picks for each family (``every``: "all", "span", or a
    sample by default) compile, each into its own kernel."""
    listed = autotune.list_candidates(op, [shape], [dtype])
    assert list(dict.fromkeys(c.family.name for c, _, _ in listed)) == list(autotune.OPS[op].families)
    compiled = 0
    for case, configs, default in listed:
        chosen = candidates(configs, default, every.get(case.family.name))
        if every.get(case.family.name) == "span":
            for field in ROW_SHAPE_FIELDS:
                assert {getattr(c, field) for c in chosen} == {getattr(c, field) for c in configs}
        found = compile_candidates(case, chosen)
        assert len(found) == len(chosen) and len(set(found)) == len(chosen)  # one kernel per config
        compiled += len(chosen)
    assert sum(built(s) for s in cl.cache_info().values()) == compiled


@pytest.mark.cute
def test_share_budgets_cut_streamed_rows_differently_and_compile():
    """The row kernels' spaces offer each one-row config of a streamed row with the other share
    budgets (reduction_config.SHARE_BUDGETS), each a different cut of the row; they compile, each
    into its own kernel (the budget is part of the config, so of the compile key)."""
    listed = autotune.list_candidates("layer_norm", [(8, 65536)], ["bfloat16"])
    chosen = []
    for case, configs, default in listed:
        budgets = [c for c in configs if c.share_budget]
        assert budgets and default.share_budget == 0
        cuts = {dataclasses.replace(case.family, config=c).geometry(case.avals).cluster for c in [default, *budgets]}
        assert len(cuts) > 1  # smaller budgets, more CTAs a row
        chosen.append((case, [default, budgets[0]]))
    found = [t for case, configs in chosen for t in compile_candidates(case, configs)]
    assert len(found) == len(set(found)) == 4


@pytest.mark.cute
def test_the_largest_share_budget_cuts_rows_over_fewer_ctas_and_compiles():
    """The largest budget (one CTA an SM) cuts a bf16 row of 131072 over 2 CTAs where the
    LayerNorm forward's own cuts it over 4; a row a single CTA would hold past two CTAs an SM's
    share is cut as by default (it would not stage), so not offered again (one row a CTA; CTAs of
    several rows stage their rows' shares together)."""
    budget = reduction_config.SHARE_BUDGETS[-1]
    ((case, configs, default),) = autotune.list_candidates("layer_norm_fwd", [(8, 131072)], ["bfloat16"])
    large = [c for c in configs if c.share_budget == budget and c.rows_per_cta == 1]
    assert large
    cluster = lambda c: dataclasses.replace(case.family, config=c).geometry(case.avals).cluster
    assert (cluster(default), cluster(large[0])) == (4, 2)
    assert len(set(compile_candidates(case, [large[0]]))) == 1
    ((_, configs, _),) = autotune.list_candidates("layer_norm_fwd", [(8, 65536)], ["bfloat16"])
    assert not [c for c in configs if c.share_budget == budget and c.rows_per_cta == 1]


def test_every_weight_gradient_candidate_compiles_in_test_linear():
    from test_linear import ACCUMULATE_CONFIGS  # test_accumulating_weight_grad_compiles_for_every_config

    *_, (dkernel, configs, _) = autotune.list_candidates("linear", [(100, 256, 512)], ["bfloat16"])
    assert dkernel.family.name == "linear_dkernel" and set(configs) <= set(ACCUMULATE_CONFIGS)


def test_streamed_norm_backward_tunes_the_kernel_with_its_sums():
    """A streamed row's backward sums dscale in its CTAs' shared memory: the kernel tuned is the one
    with partials, over configs that hold the sums."""
    _, (bwd, space, default) = autotune.list_candidates("rms_norm", [(8, 12000)], ["float32"])
    assert bwd.family.want_dscale and not bwd.family.want_dbias
    assert not geometry_for(default, 12000, 32).resident
    assert space and all(dataclasses.replace(bwd.family, config=c).holds_sums(bwd.avals) for c in space)


# --- the tuned-config table -------------------------------------------------------------------------

LN_AVALS = (S((128, 1024), BF16), S((1024,), BF16), S((1024,), BF16))
LN_FWD = NormForward(True, True, True, 1e-6, "bfloat16")  # cl.ops.layer_norm's forward on LN_AVALS


def other_candidate(family, avals):
    default = family.default_config(avals)
    return next(c for c in family.config_space(avals) if c != default)


@pytest.mark.cute
def test_a_table_entry_changes_the_config_and_the_compiled_kernel(tmp_path, monkeypatch):
    family = LN_FWD
    tuned = other_candidate(family, LN_AVALS)
    heuristic_targets = targets(lower_cuda(cl.ops.layer_norm, *LN_AVALS))

    use_table(monkeypatch, write_table(tmp_path / "user.json",
                                       [entry("layer_norm_fwd", "bfloat16", {"n": 1024}, fields(tuned))]))
    assert tuning.resolve(family, LN_AVALS).config == tuned
    tuned_targets = targets(lower_cuda(cl.ops.layer_norm, *LN_AVALS))
    assert len(heuristic_targets) == len(tuned_targets) == 1 and heuristic_targets != tuned_targets
    assert built(cl.cache_info()["layer_norm_fwd"]) == 2  # one kernel per config

    # Other operands (another N, another dtype, another GPU) keep the heuristic.
    other_n = (S((128, 2048), BF16), S((2048,), BF16), S((2048,), BF16))
    assert tuning.resolve(family, other_n).config == family.default_config(other_n)
    other_dtype = (S((128, 1024), F16), S((1024,), F16), S((1024,), F16))
    assert tuning.resolve(family, other_dtype).config == family.default_config(other_dtype)
    monkeypatch.setattr(tuning, "device_kind", lambda: "Another GPU")
    assert tuning.resolve(family, LN_AVALS).config == family.default_config(LN_AVALS)


@pytest.mark.cute
def test_a_gemm_entry_covers_its_row_bucket(tmp_path, monkeypatch):
    def fwd(x, w):
        return cl.ops.fused_linear(x, w)

    w = S((256, 512), BF16)
    before = targets(lower_cuda(fwd, S((300, 256), BF16), w))
    wide = CONFIGS["wide"]
    assert CONFIGS[config_class(300, 512, 256)] != wide
    use_table(monkeypatch, write_table(tmp_path / "user.json", [
        entry("linear_fwd", "bfloat16", {"m": row_bucket(300), "k": 256, "n": 512}, fields(wide))]))
    after = targets(lower_cuda(fwd, S((300, 256), BF16), w))
    assert before != after
    family = LinearForward("none", False, False, False)
    for rows in (65, 1000, 2047):  # the whole bucket, one kernel
        assert tuning.resolve(family, (S((1, rows, 256), BF16), S((1, 256, 512), BF16))).config == wide
    assert tuning.resolve(family, (S((1, 2048, 256), BF16), S((1, 256, 512), BF16))).config == CONFIGS["default"]
    assert tuning.resolve(family, (S((1, 64, 256), BF16), S((1, 256, 512), BF16))).config == decode_split_config(
        64, 512, 256)


def test_a_row_kernel_entry_of_a_row_range_wins_there(tmp_path, monkeypatch):
    """An entry naming a range of row counts holds there, over one naming none (every row count
    past decode's); outside it, and where the row count is symbolic (shape polymorphism), the
    latter holds -- but not on a decode batch's few rows, which keep their heuristic."""
    family = LN_FWD
    every, ranged = [c for c in family.config_space(LN_AVALS) if c != family.default_config(LN_AVALS)][:2]
    use_table(monkeypatch, write_table(tmp_path / "user.json", [
        entry("layer_norm_fwd", "bfloat16", {"n": 1024}, fields(every)),
        entry("layer_norm_fwd", "bfloat16", {"n": 1024, "rows": "65-32768"}, fields(ranged))]))
    params = LN_AVALS[1:]
    for rows, chosen in ((1, None), (64, None), (65, ranged), (16384, ranged), (32768, ranged),
                         (32769, every), (131072, every)):
        avals = (S((rows, 1024), BF16), *params)
        assert tuning.resolve(family, avals).config == (chosen or family.default_config(avals)), rows
    (rows,) = jax.export.symbolic_shape("m")
    assert family.tuning_keys((S((rows, 1024), BF16), *params)) == (("bfloat16", (("n", 1024),)),)
    assert tuning.resolve(family, (S((rows, 1024), BF16), *params)).config == every
    assert [row_count_bucket(m) for m in (1, 64, 65, 32768, 32769)] == [
        "1-64", "1-64", "65-32768", "65-32768", "32769+"]


def test_user_table_overrides_the_shipped_one(tmp_path, monkeypatch):
    family = SoftmaxForward(False)
    avals_a, avals_b = (S((128, 4096), BF16),), (S((128, 1024), BF16),)
    shipped_a, user_a = [c for c in family.config_space(avals_a) if c != family.default_config(avals_a)][:2]
    shipped_b = other_candidate(family, avals_b)
    write_table(tuning.SHIPPED_TABLE, [entry("softmax_fwd", "bfloat16", {"n": 4096}, fields(shipped_a)),
                                       entry("softmax_fwd", "bfloat16", {"n": 1024}, fields(shipped_b))])
    assert tuning.resolve(family, avals_a).config == shipped_a
    use_table(monkeypatch, write_table(tmp_path / "user.json",
                                       [entry("softmax_fwd", "bfloat16", {"n": 4096}, fields(user_a))]))
    assert tuning.resolve(family, avals_a).config == user_a  # the user's entry wins
    assert tuning.resolve(family, avals_b).config == shipped_b  # the shipped one still serves its key


BAD_TABLES = {
    "not JSON": ("{format: 1", r"not valid JSON"),
    "wrong format": (json.dumps({"format": 99, "entries": []}), r"expected an object with \"format\": 1"),
    "entries not a list": (json.dumps({"format": 1, "entries": {}}), r"expected an object"),
}


@pytest.mark.parametrize("name", BAD_TABLES)
def test_an_unreadable_table_warns_and_the_heuristic_runs(name, tmp_path, monkeypatch):
    text, message = BAD_TABLES[name]
    path = tmp_path / "broken.json"
    path.write_text(text)
    use_table(monkeypatch, path)
    family = SoftmaxForward(False)
    avals = (S((8, 4096), BF16),)
    with pytest.warns(tuning.TuningTableWarning, match=rf"{re.escape(str(path))}.*{message}"):
        assert tuning.resolve(family, avals).config == family.default_config(avals)


@pytest.mark.cute
def test_malformed_entries_warn_with_file_and_key_and_the_heuristic_runs(tmp_path, monkeypatch):
    family = SoftmaxForward(False)
    avals = (S((128, 4096), BF16),)
    good = other_candidate(family, avals)
    default = family.default_config(avals)
    default_kernel = targets(lower_cuda(functools.partial(kernel_call, tuning.resolve(family, avals)), *avals))
    bad_entries = [
        ({"device": FAKE_GPU, "kernel": "softmax_fwd", "dtype": "bfloat16", "dims": {"n": 4096}},
         r"entry 0 ignored: field 'config' must be a JSON object"),
        (entry("softmax_fwd", "bfloat16", {"n": 4096}, {"threads_per_row": "many"}),
         r"entry 0 ignored: config\['threads_per_row'\] must be an integer"),
        (entry("softmax_fwd", "bfloat16", {"n": 4096}, {"threads_per_row": 32, "warps": 4}),
         (r"entry \(device='Fake H100 for tests', kernel='softmax_fwd', dtype='bfloat16', dims=\{'n': 4096\}\) "
          r"names an invalid config")),
        (entry("softmax_fwd", "bfloat16", {"n": 4096}, {**fields(default), "threads_per_row": 3}),
         (r"kernel='softmax_fwd'.*names \{.*'threads_per_row': 3.*not a candidate config.*allowed "
          r"\('threads_per_row', 'num_threads', 'unroll', 'share_budget'\): \(128, 128, 4, 0\)")),
    ]
    for i, (bad, message) in enumerate(bad_entries):
        path = write_table(tmp_path / f"bad{i}.json", [bad])
        use_table(monkeypatch, path)
        with pytest.warns(tuning.TuningTableWarning, match=rf"{re.escape(str(path))}.*{message}"):  # noqa: PT031
            assert tuning.resolve(family, avals).config == default
            # The op falls back the same way: the kernel it builds is the heuristic's.
            assert targets(lower_cuda(cl.ops.softmax, *avals)) == default_kernel
    # A malformed entry does not spoil the good ones next to it.
    path = write_table(tmp_path / "mixed.json", [bad_entries[0][0],
                                                  entry("softmax_fwd", "bfloat16", {"n": 4096}, fields(good))])
    use_table(monkeypatch, path)
    with pytest.warns(tuning.TuningTableWarning, match="entry 0 ignored"):
        assert tuning.resolve(family, avals).config == good


def test_the_shipped_table_loads_cleanly_and_is_packaged(recwarn):
    shipped = Path(tuning.__file__).parent / "tuned_configs.json"
    table = json.loads(shipped.read_text())
    assert table["format"] == tuning.FORMAT and isinstance(table["entries"], list)
    tuning.read_table(shipped)
    assert not [w for w in recwarn if issubclass(w.category, tuning.TuningTableWarning)]
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "tuning/*.json" in pyproject["tool"]["setuptools"]["package-data"]["cutelayers"]


def _shapes_for(entry) -> list[tuple]:
    """Autotuner shapes whose cases include the kernel of a tuned-table ``entry``: ROWSxN for the
    row kernels, MxKxN for the GEMMs (a row count of the entry's bucket; dx's contraction is the
    layer's N, dkernel's output the layer's (K, N))."""
    dims, kernel = entry["dims"], entry["kernel"]
    if not kernel.startswith("linear"):  # a row count of the entry's range, or past decode's
        rows = next(m for m in (65536, 16384, 8) if row_count_bucket(m) == dims.get("rows", "32769+"))
        return [(rows, dims["n"])]
    if kernel == "linear_dkernel":  # rows over which stream-K pays for a stream-K entry, else too few
        return [(16384 if dims.get("stream_k") else 1024, dims["m"], dims["n"])]
    rows = next(m for m in (16, 1000, 4096) if row_bucket(m) == dims["m"])
    return [(rows, dims["n"], dims["k"])] if kernel == "linear_dx" else [(rows, dims["k"], dims["n"])]


def _cases_for(entry) -> list:
    """The autotuner's cases of the entry's kernel at ``_shapes_for`` it (a norm's of x's dtype
    with parameters of the second dtype, where the entry has two) -- and, for an accumulating
    kernel gradient, an LM head chunk's of that (hidden, vocabulary)."""
    dims, dtypes = entry["dims"], entry["dtype"].split("+")
    spec = autotune.OPS[autotune.FAMILY_OPS[entry["kernel"]]]
    if spec.takes_param_dtype and len(dtypes) == 2:
        return autotune.cases(entry["kernel"], _shapes_for(entry), dtypes[:1], dtypes[1])
    found = autotune.cases(entry["kernel"], _shapes_for(entry), dtypes)
    if entry["kernel"] == "linear_dkernel" and dims.get("accumulate"):
        head = autotune.cases("lm_head", [(4096, dims["m"], dims["n"])], dtypes)
        found += [case for case in head if case.family.name == entry["kernel"]]
    return found


def test_every_shipped_entry_names_a_candidate_config(monkeypatch):
    """Each entry of the shipped table is found by its kernel at a shape of its dims and names a
    config of that kernel's space there -- else the runtime warns and runs the heuristic (an entry
    left behind when a space changes)."""
    shipped = Path(tuning.__file__).parent / "tuned_configs.json"
    entries = json.loads(shipped.read_text())["entries"]
    assert entries
    monkeypatch.setattr(tuning, "SHIPPED_TABLE", shipped)  # the real one (no_tables empties it)
    for entry in entries:
        monkeypatch.setattr(tuning, "device_kind", lambda: entry["device"])
        key = tuning.table_key(entry["device"], entry["kernel"], entry["dtype"], entry["dims"])
        found = [case for case in _cases_for(entry)
                 if key in [tuning.table_key(entry["device"], case.family.name, *k)
                            for k in case.family.tuning_keys(case.avals)]]
        assert len(found) == 1, (entry, [c.describe() for c in _cases_for(entry)])
        (case,) = found
        config = case.family.config_from_fields(entry["config"])
        assert config in case.family.config_space(case.avals), entry
        assert tuning.choose_config(case.family, case.avals) == config, entry


def test_write_entries_replaces_same_keys_and_keeps_the_rest(tmp_path):
    path = write_table(tmp_path / "t.json", [entry("softmax_fwd", "bfloat16", {"n": 8}, {"a": 1}),
                                             entry("softmax_fwd", "bfloat16", {"n": 16}, {"a": 2})], about="kept")
    tuning.write_entries(path, [entry("softmax_fwd", "bfloat16", {"n": 16}, {"a": 3})])
    table = json.loads(path.read_text())
    assert table["about"] == "kept"
    assert [e["config"]["a"] for e in table["entries"]] == [1, 3]
    path.write_text("garbage")
    with pytest.raises(ValueError, match=rf"cannot add tuned configs to {path}: it is not a readable table"):
        tuning.write_entries(path, [])
    assert path.read_text() == "garbage"


# --- the sweep, with an injected runner --------------------------------------------------------------

class FakeRunner:
    """Results from the family's reference (off by 50% for ``wrong`` configs, an exception for
    ``failing`` ones); times from ``seconds`` (default 1 ms)."""

    device_kind = FAKE_GPU

    def __init__(self, seconds=None, wrong=(), failing=()):
        self.seconds, self.wrong, self.failing = seconds or {}, set(wrong), set(failing)
        self.timed, self.timed_families = [], []

    def run(self, family, operands):
        if family.config in self.failing:
            raise RuntimeError("launch failed")
        results = tuple(family.reference(*operands))
        return (results[0] * 1.5,) + results[1:] if family.config in self.wrong else results

    def time(self, family, operands):
        self.timed.append(family.config)
        self.timed_families.append(family)
        return self.seconds.get(family.config, 1e-3)


def norm_forward_case():
    (case,) = autotune.cases("layer_norm_fwd", [(16, 1024)], ["bfloat16"])
    return case


def test_sweep_picks_the_fastest_correct_candidate():
    case = norm_forward_case()
    space = case.family.config_space(case.avals)
    default = case.family.default_config(case.avals)
    fast, fastest_but_wrong, broken = [c for c in space if c != default][:3]
    runner = FakeRunner(seconds={fast: 0.5e-3, fastest_but_wrong: 0.1e-3, default: 0.9e-3},
                        wrong={fastest_but_wrong}, failing={broken})
    lines = []
    result = autotune.sweep(case, runner, log=lines.append)
    assert result.winner == fast and result.default == default
    assert fastest_but_wrong not in runner.timed and broken not in runner.timed
    rejected = {t.config: t.rejected for t in result.trials if t.rejected}
    assert rejected[fastest_but_wrong].startswith("relative error") and "launch failed" in rejected[broken]
    assert len(lines) == len(space) and sum("WRONG" in line for line in lines) == 1
    assert sum("FAILED" in line for line in lines) == 1 and sum("(heuristic)" in line for line in lines) == 1


def test_sweep_keeps_the_heuristic_within_min_gain():
    case = norm_forward_case()
    default = case.family.default_config(case.avals)
    slightly_faster = other_candidate(case.family, case.avals)
    runner = FakeRunner(seconds={slightly_faster: 0.99e-3, default: 1e-3})
    assert autotune.sweep(case, runner, log=lambda _: None).winner == default
    assert autotune.sweep(case, runner, min_gain=0.0, log=lambda _: None).winner == slightly_faster


def test_a_decode_sweep_times_the_kernels_the_op_runs(monkeypatch):
    # A few register-resident rows (or rows cut in one-step shares) load their parameters first
    # (NormForward.with_config): another kernel than many rows' with the same config. The sweep
    # times each candidate as the op runs it.
    monkeypatch.setattr(tuning, "device_kind", lambda: FAKE_GPU)
    (case,) = autotune.cases("layer_norm_fwd", [(8, 2048)], ["bfloat16"], "float32")
    runner = FakeRunner()
    autotune.sweep(case, runner, log=lambda _: None)
    timed = {f.config: f for f in runner.timed_families}
    assert set(timed) == set(case.family.config_space(case.avals))
    assert timed[case.family.default_config(case.avals)] == tuning.resolve(case.family, case.avals)
    assert all(f.loads_params_first(case.avals) == (f.geometry(case.avals).resident
                                                     or f.geometry(case.avals).one_step_shares)
               for f in timed.values() if not isinstance(f.config, norm_config.ForwardConfig))
    assert any(f.few_rows for f in timed.values())
    many = (S((128, 2048), BF16), *case.avals[1:])
    assert not tuning.resolve(case.family, many).few_rows


def test_sweep_with_no_correct_candidate_has_no_winner():
    case = norm_forward_case()
    runner = FakeRunner(wrong=case.family.config_space(case.avals))
    assert autotune.sweep(case, runner, log=lambda _: None).winner is None


def test_the_norm_backward_is_checked_on_summed_partials():
    # The kernel spreads dscale/dbias over P partial rows, the reference puts them in the first:
    # compared as the op uses them (summed), both are right.
    (case,) = autotune.cases("layer_norm_bwd", [(16, 1024)], ["bfloat16"])
    result = autotune.sweep(case, FakeRunner(), log=lambda _: None)
    assert not any(t.rejected for t in result.trials)


def test_autotune_writes_winners_that_the_runtime_then_uses(tmp_path, monkeypatch):
    output = tmp_path / "tuned.json"
    family = SoftmaxForward(False)
    avals = (S((64, 2048), F16),)
    tuned = other_candidate(family, avals)
    runner = FakeRunner(seconds={tuned: 1e-4})
    lines = []
    results = autotune.autotune("softmax", [(64, 2048)], ["float16"], output=output, runner=runner, log=lines.append)
    assert [r.case.family.name for r in results] == ["softmax_fwd", "softmax_bwd"]
    table = json.loads(output.read_text())
    fwd = next(e for e in table["entries"] if e["kernel"] == "softmax_fwd")
    assert fwd == {"device": FAKE_GPU, "kernel": "softmax_fwd", "dtype": "float16", "dims": {"n": 2048, "rows": "1-64"},
                   "config": fields(tuned), "time_us": 100.0, "default_time_us": 1000.0}
    summary = lines[-2]
    assert summary.startswith("| kernel |") and "| softmax_fwd | float16 | n=2048 rows=1-64 |" in summary and "| 10.00 |" in summary
    assert "wrote 2 tuned config(s)" in lines[-1]
    use_table(monkeypatch, output)
    assert tuning.resolve(family, avals).config == tuned


@pytest.mark.parametrize("where", UNWRITABLE)
def test_an_output_that_cannot_be_written_is_refused_before_the_sweep(where, tmp_path):
    """The table was written after every candidate had been timed: a directory failed there, and an
    uncreatable folder raised an OSError the command line did not catch."""
    output = unwritable_path(where, tmp_path, "x/t.json" if where == "/proc" else "t.json")
    message = (f"cannot add tuned configs to {output}: it is not a readable table" if where == "a directory"
               else f"cannot write the tuned-config table {output}")
    runner = FakeRunner()
    with pytest.raises(ValueError, match=re.escape(message)):
        autotune.autotune("layer_norm_fwd", [(16, 1024)], ["bfloat16"], output=output, runner=runner, log=lambda _: None)
    assert runner.timed == []


def test_autotune_linear_entries_load_and_the_runtime_uses_each(tmp_path, monkeypatch, recwarn):
    """Every GEMM kernel the linear autotune writes -- the flag-keyed ones (a residual forward, an
    activation-gradient dx: ``source``) included -- reads back without a warning and is chosen."""
    output = tmp_path / "tuned.json"
    todo = autotune.cases("linear", [(300, 256, 512)], ["bfloat16"])
    seconds = {}
    for case in todo:
        seconds.setdefault(other_candidate(case.family, case.avals), 1e-4)
    autotune.autotune("linear", [(300, 256, 512)], ["bfloat16"], output=output,
                      runner=FakeRunner(seconds=seconds), log=lambda line: None)
    entries = json.loads(output.read_text())["entries"]
    assert any(e["dims"].get("source") is True for e in entries)
    use_table(monkeypatch, output)
    assert len(tuning.read_table(output)) == len(entries) == len(todo)
    assert not [w for w in recwarn if issubclass(w.category, tuning.TuningTableWarning)]
    for case, entry in zip(todo, entries, strict=True):
        chosen = tuning.choose_config(case.family, case.avals)
        assert chosen == case.family.config_from_fields(entry["config"])


def test_autotune_argument_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match=r"unknown op or kernel 'layernorm'; allowed ops: layer_norm, rms_norm"):
        autotune.cases("layernorm", [(8, 8)], ["bfloat16"])
    with pytest.raises(ValueError, match=r"shape \(8, 8\) is not MxKxN"):
        autotune.cases("linear", [(8, 8)], ["bfloat16"])
    with pytest.raises(ValueError, match=r"dtype int32 is not one of bfloat16, float16, float32"):
        autotune.cases("softmax", [(8, 8)], ["int32"])
    with pytest.raises(ValueError, match=r"linear: shape 8x8x8, dtype float32: .*kernels take bfloat16/float16"):
        autotune.cases("linear", [(8, 8, 8)], ["float32"])
    with pytest.raises(ValueError, match="no output table"):
        autotune.autotune("softmax", [(8, 8)], ["bfloat16"], runner=FakeRunner())
    with pytest.raises(ValueError, match=r"param_dtype applies to the norm ops \(layer_norm, rms_norm, add_layer_norm, "
                                         r"add_rms_norm\), not softmax"):
        autotune.cases("softmax", [(8, 8)], ["bfloat16"], "float32")
    with pytest.raises(ValueError, match=r"param_dtype int8 is not one of bfloat16, float16, float32"):
        autotune.cases("rms_norm", [(8, 8)], ["bfloat16"], "int8")


def test_norm_parameters_of_their_own_dtype_are_a_case_and_an_entry_of_their_own():
    """--param-dtype float32 tunes a norm as Flax's modules run it (bf16 x, float32 scale and
    bias): both kernels' operands take the parameters' dtype, and the table key names it."""
    plain = autotune.cases("add_layer_norm", [(8, 4096)], ["bfloat16"])
    mixed = autotune.cases("add_layer_norm", [(8, 4096)], ["bfloat16"], "float32")
    for a, b in zip(plain, mixed, strict=True):
        params = [v for v in b.avals if v.shape == (4096,)]
        assert params and {v.dtype for v in params} == {jnp.dtype(jnp.float32)}
        assert {v.dtype for v in b.make_operands() if v.shape == (4096,)} == {jnp.dtype(jnp.float32)}
        assert a.key != b.key and "float32" in b.key[0] and "float32" not in a.key[0]



def test_relative_error_flags_moved_non_finite_values():
    ref = jnp.array([1.0, jnp.inf, 3.0])
    assert autotune.relative_error(ref, ref) == 0.0
    assert autotune.relative_error(jnp.array([1.0, 2.0, 3.0]), ref) == float("inf")
    assert np.isclose(autotune.relative_error(jnp.array([1.0, jnp.inf, 4.0]), ref), 1.0 / np.sqrt(10.0))


# --- command line -------------------------------------------------------------------------------------

def test_cli_dry_run_lists_candidates(capsys):
    assert autotune.main(["--op", "layer_norm", "--shape", "128x1024", "--dtype", "bfloat16", "float32", "--dry-run"]) == 0
    out = capsys.readouterr().out
    family, avals = LN_FWD, LN_AVALS
    assert f"layer_norm_fwd bfloat16 n=1024 rows=65-32768: {len(family.config_space(avals))} candidates" in out
    assert "layer_norm_bwd float32 n=1024 rows=65-32768:" in out
    heuristic = tuning.describe_config(family.default_config(avals))
    assert f"  {heuristic} (heuristic)" in out
    assert out.count("(heuristic)") == 4  # one per (kernel, dtype)


def test_cli_dry_run_takes_the_norm_parameters_dtype(capsys):
    assert autotune.main(["--op", "rms_norm_fwd", "--shape", "64x1024", "--param-dtype", "float32", "--dry-run"]) == 0
    assert "rms_norm_fwd bfloat16+float32 n=1024 rows=1-64:" in capsys.readouterr().out
    assert autotune.main(["--op", "softmax", "--shape", "64x1024", "--param-dtype", "float32", "--dry-run"]) == 2
    assert "param_dtype applies to the norm ops" in capsys.readouterr().err


def test_cli_usage_errors(capsys):
    assert autotune.main(["--op", "gemm", "--shape", "8x8x8", "--dry-run"]) == 2
    assert "unknown op or kernel 'gemm'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        autotune.main(["--op", "softmax", "--shape", "64xN"])
    assert exit_info.value.code == 2
    assert "shape '64xN' is not sizes joined by 'x'" in capsys.readouterr().err
    for gain in ("-1", "1", "nan"):  # a fraction: 1 or more would keep every heuristic
        with pytest.raises(SystemExit) as exit_info:
            autotune.main(["--op", "softmax", "--shape", "64x1024", "--min-gain", gain])
        assert exit_info.value.code == 2
        assert f"argument --min-gain: must be a fraction in [0, 1) (0.02: 2%); got {gain}" in capsys.readouterr().err


@pytest.mark.skipif(HAS_GPU, reason="checks the error raised without a Hopper GPU")
@pytest.mark.parametrize("cross_compiling", [False, True])
def test_cli_without_a_gpu_fails_with_a_clear_message(tmp_path, cross_compiling):
    """Also when this host compiles for a GPU it does not have, whose tuned configs it reads
    (CUTELAYERS_DEVICE_KIND): timing needs the GPU itself."""
    env = {**os.environ, "CUTELAYERS_TUNING_FILE": str(tmp_path / "t.json")}
    if cross_compiling:
        env.update(CUTE_DSL_ARCH="sm_90a", CUTELAYERS_DEVICE_KIND="NVIDIA H100 80GB HBM3")
    proc = subprocess.run([sys.executable, "-m", "cutelayers.bench.autotune", "--op", "softmax", "--shape", "64x1024"],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1], timeout=300, check=False)
    assert proc.returncode == 2
    assert "times kernels on a Hopper GPU (compute capability 9.x)" in proc.stderr
    assert "--dry-run" in proc.stderr and not (tmp_path / "t.json").exists()


@pytest.mark.skipif(HAS_GPU, reason="a visible GPU's own kind wins over CUTELAYERS_DEVICE_KIND")
def test_a_host_without_the_gpu_picks_its_tuned_configs_by_name(monkeypatch):
    """CUTELAYERS_DEVICE_KIND names the GPU whose shipped entries a CPU-only host uses (its kernels
    then compile as that GPU's would); unset, the heuristic."""
    monkeypatch.setattr(tuning, "device_kind", REAL_DEVICE_KIND)
    monkeypatch.setattr(tuning, "SHIPPED_TABLE", Path(tuning.__file__).resolve().parent / "tuned_configs.json")
    h100 = "NVIDIA H100 80GB HBM3"
    entries = json.loads(tuning.SHIPPED_TABLE.read_text())["entries"]
    (entry,) = [e for e in entries if e["device"] == h100 and e["kernel"] == "linear_fwd"
                and e["dims"] == {"m": "2048+", "k": 4096, "n": 4096}]
    family, avals = LinearForward("none", False, False, False), (S((1, 8192, 4096), BF16), S((1, 4096, 4096), BF16))
    tuned = family.config_from_fields(entry["config"])
    assert tuned != family.default_config(avals)  # else the check below could not fail

    monkeypatch.delenv("CUTELAYERS_DEVICE_KIND", raising=False)
    assert tuning.device_kind() is None and tuning.resolve(family, avals).config == family.default_config(avals)
    monkeypatch.setenv("CUTELAYERS_DEVICE_KIND", h100)
    assert tuning.device_kind() == h100 and tuning.resolve(family, avals).config == tuned


# --- on the GPU: a real sweep --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op, shape, dtype", [
    ("layer_norm", (4096, 1000), "bfloat16"),
    ("rms_norm", (512, 12000), "float32"),
    ("cross_entropy", (1024, 5000), "bfloat16"),
    ("reduce_sum", (4096, 100), "float16"),
    ("linear", (300, 256, 512), "bfloat16"),
])
def test_gpu_sweep_every_candidate_is_correct(op, shape, dtype, tmp_path, monkeypatch):
    gpu = jax.devices("cuda")[0].device_kind
    monkeypatch.setattr(tuning, "device_kind", lambda: gpu)
    results = autotune.autotune(op, [shape], [dtype], output=tmp_path / "t.json", log=lambda _: None)
    for r in results:
        assert not [t for t in r.trials if t.rejected], r.case.describe()
        assert r.winner is not None
    use_table(monkeypatch, tmp_path / "t.json")
    for r in results:
        assert tuning.resolve(r.case.family, r.case.avals).config == r.winner
