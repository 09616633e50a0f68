"""softmax, log_softmax, logsumexp, softmax_cross_entropy: values and grads vs float64 references,
ignore_index / label smoothing / z-loss, vmap/jit/grad compositions, errors; `gpu` runs kernels."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from numerics import assert_close, assert_same_where_special, dtype_cover, random

import cutelayers as cl

DTYPES = [jnp.bfloat16, jnp.float16, jnp.float32]


def np_lse(x):
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def np_ce(x, labels, ignore_index=None, smoothing=0.0, z=0.0):
    """float64 reference: per-row loss and dlogits for dloss = 1."""
    v = x.shape[-1]
    lse = np_lse(x)
    # (rows, V) only: np.eye(V)[labels] builds V x V float64 (128 GiB at V = 131072), and writing its
    # diagonal touches every huge page numpy asks for, so all of it becomes resident: it killed workers.
    onehot = np.clip(labels, 0, v - 1)[..., None] == np.arange(v)
    target = (1 - smoothing) * onehot + smoothing / v
    loss = lse - (target * x).sum(-1) + z * lse**2
    p = np.exp(x - lse[..., None])
    grad = p * (1 + 2 * z * lse[..., None]) - target
    if ignore_index is not None:
        ign = labels == ignore_index
        loss = np.where(ign, 0.0, loss)
        grad = np.where(ign[..., None], 0.0, grad)
    return loss, grad


def check_softmax(rng, shape, dtype, log):
    x = random(rng, shape, dtype) * 3
    x64 = np.asarray(x, np.float64)
    op = cl.ops.log_softmax if log else cl.ops.softmax
    y = op(x)
    assert y.dtype == x.dtype
    ref = x64 - np_lse(x64)[..., None] if log else np.exp(x64 - np_lse(x64)[..., None])
    assert_close(y, ref, dtype, scale=2.0)
    # gradient of sum(w * y): softmax: y*(w - sum(w*y)); log_softmax: w - p*sum(w)
    w = random(rng, shape, jnp.float32)
    g = jax.grad(lambda x: jnp.sum(w * op(x).astype(jnp.float32)))(x)
    w64, p = np.asarray(w, np.float64), np.exp(x64 - np_lse(x64)[..., None])
    g_ref = w64 - p * w64.sum(-1, keepdims=True) if log else p * (w64 - (w64 * p).sum(-1, keepdims=True))
    # the gradient is a difference of terms; measure its error against their size
    terms = np.abs(w64) + p * np.abs(w64.sum(-1, keepdims=True)) if log else p * (np.abs(w64) + np.abs((w64 * p).sum(-1, keepdims=True)))
    assert_close(g, g_ref, dtype, scale=3.0, scale_ref=terms)


def edge_labels(labels, v):
    """``labels`` with the first and last columns in rows 3 and 4 where there are more than 4 (a
    shifted row's first and last steps are its partial ones: RowGeometry.shifted)."""
    if labels.size > 4:
        labels.flat[3], labels.flat[4] = 0, v - 1
    return labels


def check_ce(rng, rows, v, dtype, **cfg):
    x = random(rng, (*rows, v), dtype) * 2
    labels = edge_labels(rng.integers(0, v, rows).astype(np.int32), v)
    if cfg.get("ignore_index") is not None and labels.size > 1:
        labels.flat[0] = cfg["ignore_index"]
    labels = jnp.asarray(labels)
    kw = {"ignore_index": cfg.get("ignore_index"), "label_smoothing": cfg.get("smoothing", 0.0), "z_loss": cfg.get("z", 0.0)}
    loss = cl.ops.softmax_cross_entropy(x, labels, **kw)
    dloss = random(rng, rows, jnp.float32)
    g = jax.grad(lambda x: jnp.sum(dloss * cl.ops.softmax_cross_entropy(x, labels, **kw)))(x)
    loss_ref, g_ref = np_ce(np.asarray(x, np.float64), np.asarray(labels), **cfg)
    assert loss.dtype == jnp.float32
    # fp32 statistics; a confident row's loss cancels to ~0, so measure against lse's magnitude
    x64 = np.asarray(x, np.float64)
    lse_ref = np_lse(x64)
    assert_close(loss, loss_ref, jnp.float32, scale=10.0, scale_ref=np.abs(loss_ref) + np.abs(lse_ref))
    # dlogits = dloss * (p - target) cancels where a row is confident (p ~ target): measure it
    # against the size of those terms, as the loss above
    d = np.asarray(dloss, np.float64)[..., None]
    v_labels = np.clip(np.asarray(labels), 0, v - 1)[..., None] == np.arange(v)
    terms = np.abs(d) * (np.exp(x64 - lse_ref[..., None]) + v_labels)
    assert_close(g, g_ref * d, dtype, scale=2.0, scale_ref=terms)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype,shape", dtype_cover([(1,), (2,), (7, 1000), (2, 3, 333)]))
def test_softmax_reference(log, dtype, shape, rng):
    check_softmax(rng, shape, dtype, log)


def check_logsumexp(rng, shape, dtype):
    x = random(rng, shape, dtype) * 4
    out = cl.ops.logsumexp(x)
    assert out.dtype == x.dtype
    x64 = np.asarray(x, np.float64)
    assert_close(out, np_lse(x64), dtype)
    # dx = exp(x - lse) from the float32 lse the forward saved (rounded only to x's dtype at the end)
    g = jax.grad(lambda x: jnp.sum(cl.ops.logsumexp(x).astype(jnp.float32)))(x)
    assert g.dtype == x.dtype
    assert_close(g, np.exp(x64 - np_lse(x64)[..., None]), dtype)


@pytest.mark.parametrize("dtype,shape", dtype_cover([(1,), (7, 1000), (3, 5, 17)]))
def test_logsumexp_reference(dtype, shape, rng):
    check_logsumexp(rng, shape, dtype)


def test_logsumexp_all_minus_inf_row():
    x = jnp.array([[-jnp.inf, -jnp.inf], [0.0, 0.0]])
    out = cl.ops.logsumexp(x)
    assert out[0] == -jnp.inf and np.isclose(out[1], np.log(2))


@pytest.mark.parametrize("cfg", [{}, {"ignore_index": 0}, {"smoothing": 0.1}, {"z": 1e-3},
                                 {"ignore_index": -100, "smoothing": 0.2, "z": 1e-2}])
@pytest.mark.parametrize("dtype,shape", dtype_cover([((1,), 2), ((7,), 1000), ((2, 3), 32000)]))
def test_cross_entropy_reference(cfg, dtype, shape, rng):
    rows, v = shape
    check_ce(rng, rows, v, dtype, **cfg)


def test_cross_entropy_matches_optax(rng):
    x = random(rng, (4, 6, 50), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 50, (4, 6)))
    np.testing.assert_allclose(cl.ops.softmax_cross_entropy(x, labels),
                               optax.softmax_cross_entropy_with_integer_labels(x, labels), rtol=1e-5, atol=1e-6)


def test_compositions(rng):
    x = random(rng, (2, 3, 4, 64), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 64, (2, 3, 4)), jnp.int32)

    def ce_sum(x):
        return jnp.sum(jax.vmap(jax.vmap(cl.ops.softmax_cross_entropy))(x, labels))

    def ref_sum(x):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, labels))

    np.testing.assert_allclose(jax.jit(jax.grad(ce_sum))(x), jax.grad(ref_sum)(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda x, l: jnp.sum(cl.ops.softmax_cross_entropy(x, l))))(x, labels),
                               jax.vmap(jax.grad(lambda x, l: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(x, l))))(x, labels),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.vmap(cl.ops.softmax, in_axes=2, out_axes=2)(x), jax.nn.softmax(x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(cl.ops.log_softmax)(x) ** 2)))(x),
                               jax.grad(lambda x: jnp.sum(jax.nn.log_softmax(x) ** 2))(x), rtol=1e-5, atol=1e-4)


def test_cross_entropy_errors():
    x = jnp.ones((4, 10))
    with pytest.raises(TypeError, match="'labels' must be an integer array"):
        cl.ops.softmax_cross_entropy(x, jnp.ones((4,)))
    with pytest.raises(ValueError, match=r"'labels' has shape \(3,\); expected \(4,\)"):
        cl.ops.softmax_cross_entropy(x, jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"'labels' holds 1 value\(s\) outside \[0, 10\) \(e.g. 10\)"):
        cl.ops.softmax_cross_entropy(x, jnp.array([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        cl.ops.softmax_cross_entropy(x, jnp.zeros((4,), jnp.int32), label_smoothing=1.0)
    with pytest.raises(TypeError, match="'logits' has dtype int32"):
        cl.ops.softmax_cross_entropy(jnp.ones((4, 10), jnp.int32), jnp.zeros((4,), jnp.int32))
    # ignore_index may lie outside [0, V); other out-of-range labels under jit give NaN rows
    out = cl.ops.softmax_cross_entropy(x, jnp.array([0, -100, 1, 2]), ignore_index=-100)
    assert out[1] == 0.0
    out = jax.jit(cl.ops.softmax_cross_entropy)(x, jnp.array([0, 11, 1, 2]))
    assert np.isnan(out[1]) and np.isfinite(out[0])
    labels = jnp.array([0, 1, 2, 3])
    with pytest.raises(TypeError, match="'ignore_index' must be an int .*; got 1.5"):
        cl.ops.softmax_cross_entropy(x, labels, ignore_index=1.5)  # int() would ignore label 1
    with pytest.raises(TypeError, match="'ignore_index' must be an int .*; got 'pad'"):
        cl.ops.softmax_cross_entropy(x, labels, ignore_index="pad")
    with pytest.raises(ValueError, match="'ignore_index' must fit int32 .*; got 4294967296"):
        cl.ops.softmax_cross_entropy(x, labels, ignore_index=2**32)
    with pytest.raises(TypeError, match="'ignore_index' must be an int \\(concrete, not traced\\)"):
        jax.jit(lambda i: cl.ops.softmax_cross_entropy(x, labels, ignore_index=i))(-100)
    with pytest.raises(TypeError, match="'label_smoothing' must be a number; got '0.1'"):
        cl.ops.softmax_cross_entropy(x, labels, label_smoothing="0.1")
    out = cl.ops.softmax_cross_entropy(x, labels, ignore_index=np.int64(1))  # a NumPy integer is an int
    assert out[1] == 0.0 and out[0] > 0.0


def test_64_bit_labels_past_int32_give_nan_rows_under_jit(tmp_path):
    # with jax_enable_x64, an int64 label of 2^32 + 1 cast to the kernels' int32 would wrap onto
    # class 1 and give a finite loss; the op bounds it first, so the row is NaN as documented
    program = """
import jax, jax.numpy as jnp, numpy as np
import cutelayers as cl
x = jnp.zeros((3, 5), jnp.float32)
labels = jnp.array([0, 2**32 + 1, 2], jnp.int64)
assert labels.dtype == jnp.int64
for loss in (jax.jit(cl.ops.softmax_cross_entropy)(x, labels),
             jax.jit(lambda h, l: cl.ops.linear_cross_entropy(h, jnp.eye(5, dtype=jnp.float32), l, reduction="none"))(x, labels)):
    assert np.isnan(loss[1]) and np.isfinite(loss[0]) and np.isfinite(loss[2]), loss
print("ok")
"""
    env = {**os.environ, "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.cute
def test_cuda_lowering_compiles_every_kernel():
    cl.clear_cache()
    jax.clear_caches()
    for v, dtype in [(1000, jnp.bfloat16), (4096, jnp.float32), (131072, jnp.bfloat16), (7, jnp.float16)]:
        x = jax.ShapeDtypeStruct((8, v), dtype)
        lab = jax.ShapeDtypeStruct((8,), jnp.int32)
        fns = [
            jax.grad(lambda x: jnp.sum(cl.ops.softmax(x).astype(jnp.float32) ** 2)),
            jax.grad(lambda x: jnp.sum(cl.ops.log_softmax(x).astype(jnp.float32) ** 2)),
            lambda x: cl.ops.logsumexp(x),
        ]
        for f in fns:
            jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))
        ce = jax.grad(lambda x, l: jnp.sum(cl.ops.softmax_cross_entropy(x, l, ignore_index=-1, label_smoothing=0.1, z_loss=1e-4)))
        hlo = jax.jit(ce).trace(x, lab).lower(lowering_platforms=("cuda",)).as_text()
        assert "cutelayers_cross_entropy_fwd" in hlo and "cutelayers_cross_entropy_bwd" in hlo
        # the op's logits are the caller's (here a jit argument): dlogits gets its own buffer
        (bwd_call,) = [line for line in hlo.splitlines() if "@cutelayers_cross_entropy_bwd" in line]
        assert "output_operand_aliases" not in bwd_call
    names = set(cl.cache_info())
    assert {"softmax_fwd", "softmax_bwd", "log_softmax_fwd", "log_softmax_bwd", "logsumexp",
            "cross_entropy_fwd", "cross_entropy_bwd"} <= names


# (N, dtype, staged row operands: 1 forward, 2 backward) -> CTAs a row is cut over (a cluster)
SPLIT_ROWS = {
    (4096, jnp.bfloat16, 1): 1,  # in registers
    (32768, jnp.bfloat16, 1): 1,  # 64 KiB: one CTA stages it
    (32768, jnp.bfloat16, 2): 2,  # y and dy: 128 KiB
    (50304, jnp.bfloat16, 2): 2,  # 25152 columns a CTA: 98 KiB
    (131072, jnp.bfloat16, 1): 4,
    (262144, jnp.bfloat16, 2): 16,  # 64 KiB a CTA (128 over 8)
    (262144, jnp.float32, 2): 16,  # 128 KiB a CTA, one CTA an SM
    (1 << 20, jnp.bfloat16, 1): 16,  # 128 KiB a CTA, one CTA an SM
    (1 << 20, jnp.bfloat16, 2): 1,  # 256 KiB a CTA even over 16: re-read from global memory
}


def test_long_rows_are_cut_over_a_cluster_whose_shares_stage():
    from cutelayers.kernels.reduction_config import (
        MAX_CLUSTER,
        STAGED_ROW_BYTES,
        STAGED_ROW_BYTES_ALONE,
        row_geometry,
        share_bytes,
        split_rows,
        staged,
    )
    from cutelayers.kernels.softmax_config import BACKWARD_VALUES_PER_THREAD, FORWARD_VALUES_PER_THREAD

    for (n, dtype, operands), cluster in SPLIT_ROWS.items():
        itemsize = jnp.dtype(dtype).itemsize
        values = FORWARD_VALUES_PER_THREAD if operands == 1 else BACKWARD_VALUES_PER_THREAD
        g = split_rows(row_geometry(n, 8 * itemsize, values), itemsize, operands)
        assert g.cluster == cluster, (n, dtype, operands)
        assert g.cluster <= MAX_CLUSTER and 0 < g.last_share_width <= g.share_width  # every CTA a column
        if g.cluster > 1:
            assert staged(g, itemsize, operands) and g.row.rows_per_cta == 1
            limit = STAGED_ROW_BYTES if g.cluster < MAX_CLUSTER else STAGED_ROW_BYTES_ALONE
            assert share_bytes(g, itemsize, operands) <= limit
            # the CTAs' shares cover the row, evenly, and their steps cover the shares
            assert (g.cluster - 1) * g.share_width + g.last_share_width == n
            assert g.share_width - g.last_share_width < g.cluster * g.share_quantum
            assert g.steps_per_cta * g.tile_n >= g.share_width and g.last_steps * g.tile_n >= g.last_share_width
    g = row_geometry(24, 16, FORWARD_VALUES_PER_THREAD)
    with pytest.raises(ValueError, match="leaves a CTA none"):
        dataclasses.replace(g, cluster=4)  # shares of 8 columns: the last CTA none


def test_a_few_long_rows_are_cut_over_ctas():
    # One CTA a row kept 8 SMs busy for 8 rows of 131072 (softmax_config.few_rows_cut): a few rows
    # (a concrete count, whatever it is) are cut over as many CTAs as a step's halves, at most 16,
    # a cluster of at most 4096 threads; many rows and a symbolic count are cut as before (the
    # cross-entropy's not at all, the softmax kernels' to stage them), register-resident rows never.
    from cutelayers.ops.softmax import (
        CrossEntropyBackward,
        CrossEntropyForward,
        SoftmaxBackward,
        SoftmaxForward,
    )
    from cutelayers.tuning import resolve

    def geometry(family, rows, v):
        x, per_row = jax.ShapeDtypeStruct((rows, v), jnp.bfloat16), jax.ShapeDtypeStruct((rows,), jnp.float32)
        labels = jax.ShapeDtypeStruct((rows,), jnp.int32)
        avals = {CrossEntropyForward: (x, labels), CrossEntropyBackward: (x, labels, per_row, per_row),
                 SoftmaxForward: (x,), SoftmaxBackward: (x, x)}[type(family)]
        return resolve(family, avals).geometry(avals)

    symbolic = jax.export.symbolic_shape("m")[0]
    # (CTAs a row, share width, steps a CTA) at 8 rows of 131072: the softmax forward's 16 of its
    # 256-thread CTAs, the backward's and the cross-entropy forward's 8 of 512 threads (a cluster
    # of 4096 threads at most), the cross-entropy backward's plain grid 16; and the CTAs a row at
    # 32768, where each kernel's row has 4 steps (8192 columns), or 2 (16384): twice that many
    cuts = {SoftmaxForward(False): ((16, 8192, 1), 8), SoftmaxBackward(True): ((8, 16384, 2), 8),
            CrossEntropyForward(True): ((8, 16384, 1), 4), CrossEntropyBackward(): ((16, 8192, 1), 4)}
    for family, (want, at_32768) in cuts.items():
        cut = geometry(family, 8, 131072)
        assert (cut.cluster, cut.share_width, cut.steps_per_cta) == want, (family, cut)
        assert geometry(family, 1, 262144).cluster == geometry(family, 64, 131072).cluster == want[0], family
        assert geometry(family, 8, 32768).cluster == at_32768, family
        assert geometry(family, 8, 4096).cluster == 1  # register-resident
    for family, staged in ((SoftmaxForward(False), 4), (SoftmaxBackward(True), 8)):
        for rows in (4096, 65, symbolic):  # staged in shares of 64 KiB (x; y and dy)
            assert geometry(family, rows, 131072).cluster == staged, rows
    # past a decode batch, rows of a CTA each are cut until they fill FILL_CTAS: the power of two of
    # CTAs at most FILL_CTAS / rows (4 at 65-66 rows, 2 at 67-132), and only where that is more than
    # the softmax kernels' staging cut (theirs at 131072 as above)
    for family in (CrossEntropyForward(True), CrossEntropyBackward()):
        for rows, ctas in ((65, 4), (66, 4), (67, 2), (132, 2), (133, 1), (4096, 1), (symbolic, 1)):
            assert geometry(family, rows, 131072).cluster == ctas, rows
    assert geometry(SoftmaxForward(False), 100, 32768).cluster == 2


@pytest.mark.cute
@pytest.mark.parametrize("kernel", ["softmax_fwd", "softmax_bwd", "cross_entropy_fwd", "cross_entropy_bwd",
                                    "cross_entropy_with_grad"])
def test_odd_rows_move_in_16_byte_accesses(tmp_path, kernel):
    # At 50257 bf16 a row start is 2-byte aligned, and accesses that keep every row start aligned
    # are scalar: 78 % of copy bandwidth for the softmax forward, 50 % for the cross-entropy,
    # against 99 % and 65 % at 50304 (H100: docs/benchmarks.md, sixty-sixth session). A row
    # is walked shifted (RowGeometry.shifted), by one CTA or cut over a cluster (the softmax
    # backward's, over two): every row's load -- a global one or a cp.async into shared memory --
    # is 16 bytes; only the partial steps' accesses at the row's ends are stored element by
    # element (and the label's logit loaded alone).
    import re

    from conftest import ROW_KERNEL_PTX_PROGRAM, kept_ptx

    from cutelayers.bench import autotune

    ((case, _, default),) = autotune.list_candidates(kernel, [(16384, 50257)], ["bfloat16"])
    geometry = dataclasses.replace(case.family, config=default).geometry(case.avals)
    assert geometry.shifted and geometry.vec == 8 and geometry.span == 50264
    ptx = kept_ptx(tmp_path, ROW_KERNEL_PTX_PROGRAM, kernel, "50257").read_text()
    wide_loads = re.findall(r"ld\.global\S*\.v4\.b32|cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], 16", ptx)
    assert wide_loads
    assert len(re.findall(r"ld\.global\S*\.b16", ptx)) <= int(kernel.startswith("cross_entropy_") and "bwd" not in kernel)
    if kernel != "cross_entropy_fwd":
        assert re.search(r"st\.global\S*\.v4\.b32", ptx)


def test_shifted_rows_geometry():
    """Odd N shifts a row walked in several steps (a step's accesses full vectors, its window up to
    vec - 1 columns before the row), by one CTA or cut over a cluster -- also a few rows' cut over
    CTAs past a decode batch --, but not a decode batch's rows (cut over CTAs the same way for
    every such count), nor rows of one step, nor rows that share a CTA, nor aligned ones, nor
    another kernel family's."""
    from cutelayers.kernels.reduction_config import FEW_ROWS, row_geometry
    from cutelayers.kernels.softmax_config import CUT_ROWS
    from cutelayers.ops._rowwise import SHIFTED_MIN_STEPS
    from cutelayers.ops.softmax import (
        CrossEntropyBackward,
        CrossEntropyWithGrad,
        SoftmaxBackward,
        SoftmaxForward,
    )
    from cutelayers.tuning import resolve

    def geometry(family, rows, n, dtype=jnp.bfloat16):
        x, per_row = jax.ShapeDtypeStruct((rows, n), dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)
        avals = {SoftmaxBackward: (x, x), CrossEntropyWithGrad: (x, per_row.update(dtype=jnp.int32), per_row),
                 CrossEntropyBackward: (x, per_row.update(dtype=jnp.int32), per_row, per_row)}.get(type(family), (x,))
        return resolve(family, avals).geometry(avals)

    # (family, N, dtype, vec, CTAs a row)
    shifted = [(SoftmaxForward(False), 50257, jnp.bfloat16, 8, 1), (CrossEntropyWithGrad(), 50257, jnp.bfloat16, 8, 1),
               (CrossEntropyBackward(), 50257, jnp.float32, 4, 1), (CrossEntropyBackward(), 131071, jnp.float16, 8, 1),
               (SoftmaxBackward(True), 50257, jnp.bfloat16, 8, 2),  # y and dy staged over 2 CTAs
               (SoftmaxForward(False), 131071, jnp.bfloat16, 8, 4)]  # staged over 4
    for family, n, dtype, vec, cluster in shifted:
        g = geometry(family, 4096, n, dtype)
        assert g.shifted and g.span == n + vec - 1 and g.edge_steps == (True, True), (family, n)
        assert (g.vec, g.cluster, g.row.rows_per_cta) == (vec, cluster, 1) and g.num_steps >= SHIFTED_MIN_STEPS
    for family, rows in [(CrossEntropyBackward(), FEW_ROWS + 1), (SoftmaxForward(False), CUT_ROWS)]:
        g = geometry(family, rows, 50257)  # a few rows past a decode batch, cut over CTAs
        assert g.shifted and g.vec == 8 and g.cluster > 1 and g.num_steps >= SHIFTED_MIN_STEPS, (family, rows)
    unshifted = [(CrossEntropyBackward(), 8, 50257), (SoftmaxForward(False), FEW_ROWS, 50257),  # a decode batch's rows, cut
                 (SoftmaxForward(False), 4096, 4097),  # one step
                 (SoftmaxForward(False), 4096, 50304),  # aligned
                 (SoftmaxForward(False), 4096, 1001)]  # several rows a CTA
    for family, rows, n in unshifted:
        g = geometry(family, rows, n)
        assert not g.shifted and g.vec == (8 if n == 50304 else 1), (family, rows, n)
    assert not row_geometry(50257, 16, 32).shifted  # a kernel family that does not shift rows (the norms)


@pytest.mark.cute
def test_softmax_kernels_lower_with_rows_cut_over_clusters():
    """Cut rows compile for sm_90a: an even cut (131072), an uneven one with scalar accesses
    staged from registers (50257: shares of 25136 and 25121 columns), both directions."""
    from cutelayers.ops.softmax import SoftmaxBackward, SoftmaxForward
    from cutelayers.tuning import resolve

    for v, clusters in {131072: (4, 8), 50257: (1, 2)}.items():
        x = jax.ShapeDtypeStruct((1024, v), jnp.bfloat16)  # many rows (a decode batch's are cut finer)
        forward, backward = resolve(SoftmaxForward(False), (x,)), resolve(SoftmaxBackward(False), (x, x))
        assert (forward.geometry((x,)).cluster, backward.geometry((x, x)).cluster) == clusters
        for op in (cl.ops.softmax, cl.ops.log_softmax):
            f = jax.grad(lambda x, op=op: jnp.sum(op(x).astype(jnp.float32) ** 2))
            hlo = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
            assert hlo.count("stablehlo.custom_call @cutelayers_") == 2


# --- the fused cross-entropy forward + gradient (the LM head's) -----------------------------------

WITH_GRAD_CFGS = [{}, {"ignore_index": 0, "smoothing": 0.1, "z_loss": 1e-3, "soft_cap": 3.0}]


def check_with_grad(rng, rows, v, dtype, cfg, out_of_range=False):
    """``forward_with_grad`` of :func:`cross_entropy_kernels` against the two-kernel path (forward,
    then backward with the same dloss) and the family's float32 reference; with ``out_of_range`` a
    label outside [0, V) that is not ignore_index gives that row a NaN loss and gradient."""
    from cutelayers.ops.softmax import CrossEntropyWithGrad, cross_entropy_kernels

    forward, backward, with_grad = cross_entropy_kernels(cfg.get("ignore_index"), cfg.get("smoothing", 0.0),
                                                         cfg.get("z_loss", 0.0), cfg.get("soft_cap", 0.0))
    x = random(rng, (*rows, v), dtype) * 2
    labels = edge_labels(rng.integers(0, v, rows).astype(np.int32), v)
    if cfg.get("ignore_index") is not None and labels.size > 1:
        labels.flat[1] = cfg["ignore_index"]
    if out_of_range and labels.size > 2:
        labels.flat[2] = -7 if cfg else v + 3
    labels = jnp.asarray(labels)
    dloss = random(rng, rows, jnp.float32)
    lse, loss, dx = jax.jit(with_grad)(x, labels, dloss)
    assert (lse.dtype, loss.dtype, dx.dtype) == (jnp.float32, jnp.float32, x.dtype)
    assert lse.shape == loss.shape == rows and dx.shape == x.shape
    lse2, loss2 = jax.jit(forward)(x, labels)
    dx2 = jax.jit(backward)(x, labels, lse2, dloss)
    family = CrossEntropyWithGrad(**cfg)
    flat = (x.reshape(-1, v), labels.reshape(-1), dloss.reshape(-1))
    dx_ref, lse_ref, loss_ref = (np.asarray(a, np.float64) for a in jax.jit(
        lambda x, l, d: family.reference(x.astype(jnp.float32), l, d))(*flat))
    ok = np.isfinite(loss_ref)  # the out-of-range label's row is NaN: checked below
    magnitude = np.abs(lse_ref[ok]) + np.abs(loss_ref[ok])  # a confident row's loss cancels to ~0
    for out in (lse, lse2):
        assert_close(out.reshape(-1), lse_ref, jnp.float32, scale=10.0, scale_ref=np.abs(lse_ref) + 1.0)
    for out in (loss, loss2):
        assert_close(out.reshape(-1)[ok], loss_ref[ok], jnp.float32, scale=10.0, scale_ref=magnitude)
    # dx = dloss (p - target): measured against the size of those terms where p ~ target
    terms = np.abs(np.asarray(dloss, np.float64)).reshape(-1, 1)[ok] * (
        np.exp(np.asarray(flat[0], np.float64)[ok] - lse_ref[ok, None]) + 1.0)
    for out in (dx, dx2):
        assert_close(out.reshape(-1, v)[ok], dx_ref[ok], dtype, scale=2.0, scale_ref=terms)
    if out_of_range and labels.size > 2:
        assert not ok[2] and np.isnan(loss.reshape(-1)[2]) and np.all(np.isnan(dx.reshape(-1, v)[2]))
    if cfg.get("ignore_index") is not None and labels.size > 1:
        assert loss.reshape(-1)[1] == 0.0 and not np.any(dx.reshape(-1, v)[1])


def check_far_below_zero(rng, v, dtype):
    """Rows of logits under -88, where exp of a negated shift overflows float32: N(-120, 4) (no
    lower, so that float32's spacing there keeps x - lse within the float32 tolerance); the
    leading half held at the dtype's lowest value (left padding masked so); all but the last column
    so. A thread whose first values are all that low once folded 0 * exp(inf) = NaN into its sum
    (softmax.rescaled). logsumexp, softmax, and the cross-entropy (label: the last column) through
    the forward and backward kernels and the fused one, each row against float64."""
    from cutelayers.ops.softmax import cross_entropy_kernels

    x = np.asarray(random(rng, (3, v), dtype) * 2, np.float64)
    x[0] -= 120.0
    x[1, : v // 2] = x[2, :-1] = float(jnp.finfo(dtype).min)
    x = jnp.asarray(x, dtype)
    x64 = np.asarray(x, np.float64)
    lse_ref = np_lse(x64)
    p_ref = np.exp(x64 - lse_ref[:, None])
    onehot = np.arange(v) == v - 1
    loss_ref = lse_ref - x64[:, -1]
    labels = jnp.full((3,), v - 1, jnp.int32)
    grad = jax.grad(lambda x: jnp.sum(cl.ops.softmax_cross_entropy(x, labels)))(x)
    _, fused_loss, fused_grad = jax.jit(cross_entropy_kernels(None)[2])(x, labels, jnp.ones((3,), jnp.float32))
    outputs = (cl.ops.logsumexp(x), cl.ops.softmax(x), cl.ops.softmax_cross_entropy(x, labels), grad, fused_loss,
               fused_grad)
    for r in range(3):
        lse, p, loss, g, loss2, g2 = (np.asarray(jnp.asarray(out[r], jnp.float32)) for out in outputs)
        assert_close(lse, lse_ref[r], dtype)
        assert_close(p, p_ref[r], dtype, scale=2.0)
        for out in (loss, loss2):
            assert_close(out, loss_ref[r], jnp.float32, scale=10.0, scale_ref=abs(loss_ref[r]) + abs(lse_ref[r]))
        for out in (g, g2):
            assert_close(out, p_ref[r] - onehot, dtype, scale=2.0, scale_ref=p_ref[r] + onehot)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_far_below_zero_reference(dtype, rng):
    check_far_below_zero(rng, 7, dtype)


def masked_rows(rng, rows, v, dtype):
    """Rows masked with -inf, as attention scores and padded vocabularies are, in threes: half the
    columns masked at random; all but the last; all of them (softmax NaN, logsumexp -inf, as
    jax.nn's). The last column is the label (a kept one but in the third row)."""
    x = np.asarray(random(rng, (rows, v), jnp.float32) * 2)
    keep = rng.random((rows, v)) < 0.5
    keep[1::3] = keep[2::3] = False
    keep[:, -1] = True
    keep[2::3, -1] = False
    return jnp.asarray(np.where(keep, x, -np.inf), dtype), jnp.full((rows,), v - 1, jnp.int32)


def masked_outputs(x, labels):
    """softmax, log_softmax, logsumexp, the cross-entropy and the gradients of each family's
    kernels (softmax's, log_softmax's, the cross-entropy's backward and its fused kernel)."""
    from cutelayers.ops.softmax import cross_entropy_kernels

    w = jnp.linspace(-1.0, 1.0, x.shape[-1], dtype=jnp.float32)  # a cotangent with no zeros at -inf
    grads = [jax.grad(lambda x, op=op: jnp.sum(w * op(x).astype(jnp.float32)))(x)
             for op in (cl.ops.softmax, cl.ops.log_softmax)]
    ce_grad = jax.grad(lambda x: jnp.sum(cl.ops.softmax_cross_entropy(x, labels)))(x)
    _, fused_loss, fused_grad = jax.jit(cross_entropy_kernels(None)[2])(x, labels, jnp.ones(labels.shape, jnp.float32))
    return {"softmax": cl.ops.softmax(x), "log_softmax": cl.ops.log_softmax(x), "logsumexp": cl.ops.logsumexp(x),
            "loss": cl.ops.softmax_cross_entropy(x, labels), "softmax grad": grads[0], "log_softmax grad": grads[1],
            "loss grad": ce_grad, "fused loss": fused_loss, "fused grad": fused_grad}


def test_rows_masked_with_minus_inf_reference(rng):
    """The ops' jnp path gives jax.nn's and optax's NaNs, infinities and values on masked rows."""
    x, labels = masked_rows(rng, 6, 7, jnp.float32)
    ours = masked_outputs(x, labels)
    stock = {"softmax": jax.nn.softmax(x), "log_softmax": jax.nn.log_softmax(x),
             "logsumexp": jax.nn.logsumexp(x, axis=-1),
             "loss": optax.softmax_cross_entropy_with_integer_labels(x, labels)}
    for name, ref in stock.items():
        assert_same_where_special(ours[name], ref, jnp.float32, name)
    assert np.isnan(np.asarray(ours["softmax"])[2::3]).all() and (np.asarray(ours["logsumexp"])[2::3] == -np.inf).all()


@pytest.mark.gpu
@pytest.mark.parametrize("v,rows", [(1000, 6), (1000, 66), (32000, 66), (50257, 6), (131072, 6), (131072, 66)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_masked_with_minus_inf_gpu(dtype, v, rows, rng):
    """The kernels -- register-resident rows, staged ones, rows cut over a cluster (6 rows: a
    decode batch's cut; 66: the staged one) -- give the jnp path's NaNs, infinities and values on
    rows masked with -inf."""
    x, labels = masked_rows(rng, rows, v, dtype)
    with cl.use_backend("reference"):
        expected = masked_outputs(x, labels)
    with cl.use_backend("cute"):
        got = masked_outputs(x, labels)
    for name, ref in expected.items():
        assert_same_where_special(got[name], ref, dtype, name)


@pytest.mark.parametrize("cfg", WITH_GRAD_CFGS, ids=["plain", "all-options"])
def test_cross_entropy_with_grad_reference(cfg, rng):
    """The fused family's jnp path (off CUDA) matches the forward + backward pair, vmapped too."""
    check_with_grad(rng, (2, 5), 33, jnp.float32, cfg, out_of_range=True)


def test_cross_entropy_with_grad_vmap(rng):
    from cutelayers.ops.softmax import cross_entropy_kernels

    forward, backward, with_grad = cross_entropy_kernels(-1, 0.1, 1e-3, 0.0)
    x = random(rng, (3, 4, 17), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 17, (3, 4)), jnp.int32)
    dloss = random(rng, (3, 4), jnp.float32)
    lse, loss, dx = jax.vmap(with_grad, in_axes=(1, 1, 1), out_axes=1)(x, labels, dloss)
    lse2, loss2 = forward(x, labels)
    np.testing.assert_allclose(lse, lse2, rtol=1e-6)
    np.testing.assert_allclose(loss, loss2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, backward(x, labels, lse2, dloss), rtol=1e-6, atol=1e-7)


# (V, dtype) -> how the fused kernel holds the row for its second pass
WITH_GRAD_SHAPES = {
    (4096, jnp.bfloat16): "registers",
    (1000, jnp.float16): "registers",  # ragged: 1000 = 125 vectors of 8
    (50304, jnp.bfloat16): "shared",  # GPT-2's padded vocabulary: 98 KiB, two CTAs per SM
    (50257, jnp.bfloat16): "shared",  # odd: scalar accesses, a ragged last step
    (131072, jnp.bfloat16): "cluster of 4",  # 256 KiB: 64 KiB a CTA
    (128256, jnp.bfloat16): "cluster of 4",  # Llama-3's vocabulary: shares of 32064, each last step ragged
    (151936, jnp.bfloat16): "cluster of 4",  # shares of 38016, the last CTA's 37888
    (50304, jnp.float32): "cluster of 2",  # 98 KiB a CTA
}


@pytest.mark.cute
def test_cross_entropy_with_grad_lowering():
    """The fused kernel compiles for sm_90a with each way of holding the row: one custom call,
    dlogits aliased to the logits, and two 512-thread CTAs' worth of shared memory for a staged
    row or share of a row cut over a cluster."""
    from cutelayers.kernels.reduction_config import STAGED_ROW_BYTES, share_bytes, staged
    from cutelayers.ops.softmax import CrossEntropyWithGrad, cross_entropy_kernels
    from cutelayers.tuning import resolve

    with_grad = cross_entropy_kernels(-100, 0.1, 1e-4, 0.0)[2]
    capped = cross_entropy_kernels(None, 0.0, 0.0, 30.0)[2]
    for (v, dtype), where in WITH_GRAD_SHAPES.items():
        itemsize = jnp.dtype(dtype).itemsize
        avals = (jax.ShapeDtypeStruct((8, v), dtype), jax.ShapeDtypeStruct((8,), jnp.int32),
                 jax.ShapeDtypeStruct((8,), jnp.float32))
        g = resolve(CrossEntropyWithGrad(), avals).geometry(avals)
        holds = ("registers" if g.resident else f"cluster of {g.cluster}" if g.cluster > 1
                 else "shared" if staged(g, itemsize) else "global")
        assert holds == where, (v, dtype)
        if not g.resident:
            assert staged(g, itemsize)
            assert g.row.num_threads == 512 and share_bytes(g, itemsize) <= STAGED_ROW_BYTES
        fn = capped if v == 50304 and dtype == jnp.bfloat16 else with_grad  # soft-capping once
        hlo = jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
        (call,) = [line for line in hlo.splitlines() if "stablehlo.custom_call @cutelayers_" in line]
        assert "@cutelayers_cross_entropy_with_grad" in call and "output_operand_aliases" in call
    assert "cross_entropy_with_grad" in cl.cache_info()


# --- GPU -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 4096, 32000, 50257, 131072, 262144])
def test_softmax_gpu(log, dtype, n, rng):
    # 3 rows: a decode batch, whose long rows are cut a step a CTA; 65: many, whose streamed rows
    # are staged (in shares of a cluster where they are long)
    with cl.use_backend("cute"):
        for rows in (3, 65) if n >= 32000 else (3,):
            check_softmax(rng, (rows, n), dtype, log)


# Vocabulary sizes and the row shapes run at each: one case per (cfg, dtype, V), so a case's kernels
# compile once for all its row counts (symbolic).
CE_GPU_ROWS = {2: [(1,)], 1000: [(7,), (4096,)], 32000: [(2, 3)], 50257: [(7,)], 131072: [(3,)]}


@pytest.mark.gpu
@pytest.mark.parametrize("v", CE_GPU_ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [{}, {"ignore_index": -100, "smoothing": 0.1, "z": 1e-3}])
def test_cross_entropy_gpu(cfg, dtype, v, rng):
    with cl.use_backend("cute"):
        for rows in CE_GPU_ROWS[v]:
            check_ce(rng, rows, v, dtype, **cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("v", CE_GPU_ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp_gpu(dtype, v, rng):
    with cl.use_backend("cute"):
        for rows in CE_GPU_ROWS[v]:
            check_logsumexp(rng, (*rows, v), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [7, 1000, 4096, 50257, 131072])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rows_far_below_zero_gpu(dtype, v, rng):
    """Registers (one warp a row and several), shared-memory staging and rows cut over a cluster."""
    with cl.use_backend("cute"):
        check_far_below_zero(rng, v, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [4097, 12345, 50257, 131071])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shifted_rows_gpu(dtype, v, rng):
    """Rows whose starts N leaves misaligned (RowGeometry.shifted where a row is walked in several
    steps: by a CTA or cut over a cluster, staged rows, streamed ones; scalar accesses elsewhere):
    every kernel of the family on 9 rows -- every row offset within a vector -- labels at the
    rows' first and last columns, and on 3, 70 and 140 rows (the softmax kernels cut up to
    softmax_config.CUT_ROWS, 132, over CTAs; a decode batch's, up to 64, unshifted)."""
    with cl.use_backend("cute"):
        for rows in (3, 9, 70, 140):
            check_softmax(rng, (rows, v), dtype, log=False)
        for rows in (9, 140):
            check_softmax(rng, (rows, v), dtype, log=True)
        check_logsumexp(rng, (9, v), dtype)
        check_ce(rng, (9,), v, dtype, ignore_index=-100, smoothing=0.1, z=1e-3)
        for rows in (3, 70, 140):
            check_ce(rng, (rows,), v, dtype)
        for cfg in WITH_GRAD_CFGS:
            check_with_grad(rng, (9,), v, dtype, cfg, out_of_range=True)


@pytest.mark.gpu
@pytest.mark.parametrize("v", [1000, 4096, 50257, 50304, 128256, 131072, 151936])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", WITH_GRAD_CFGS, ids=["plain", "all-options"])
def test_cross_entropy_with_grad_gpu(cfg, dtype, v, rng):
    """The fused kernel (registers, shared-memory staging, rows cut over a cluster -- the label in
    any CTA's share --; ragged and odd V) against the
    float32 reference and the two-kernel path: lse, loss, dlogits; ignore_index, an out-of-range
    label's NaN row, smoothing, z-loss, soft-capping."""
    with cl.use_backend("cute"):
        check_with_grad(rng, (7,), v, dtype, cfg, out_of_range=True)
        if v == 1000:  # many CTAs, several rows per CTA
            check_with_grad(rng, (3, 1365), v, dtype, cfg)
