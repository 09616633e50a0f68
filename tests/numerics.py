"""Dtype-aware comparison helpers shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np

# Relative-error tolerances (‖out − ref‖ / ‖ref‖) for a result stored in the given dtype: one table,
# the autotuner checks its candidates with it too.
from cutelayers.bench.autotune import REL_TOL


def rel_error(out, ref, scale_ref=None) -> float:
    """‖out − ref‖ / ‖scale_ref‖ (default ‖ref‖): pass the magnitude of the terms a result is
    computed from when it can cancel to near zero (a loss of a confident prediction)."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out) == np.isfinite(ref)), "non-finite values differ"
    denom = np.linalg.norm(np.asarray(ref if scale_ref is None else scale_ref, np.float64).ravel())
    return float(np.linalg.norm((out - ref).ravel()) / (denom if denom > 0 else 1.0))


def assert_close(out, ref, dtype, scale: float = 1.0, scale_ref=None):
    err = rel_error(out, ref, scale_ref)
    tol = REL_TOL[jnp.dtype(dtype).name] * scale
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g} ({jnp.dtype(dtype).name})"


def assert_same_where_special(out, ref, dtype, what, scale: float = 3.0):
    """NaN and +-inf where ``ref`` has them (``what`` names the result in a failure), and close to
    it elsewhere (:func:`assert_close` with ``scale``)."""
    out, ref = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (out, ref))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref), err_msg=f"{what}: NaNs")
    infinite = np.isinf(ref)
    np.testing.assert_array_equal(out[infinite], ref[infinite], err_msg=f"{what}: infinities")
    finite = np.isfinite(ref)
    assert np.isfinite(out[finite]).all(), what
    assert_close(out[finite], ref[finite], dtype, scale=scale)


def least_precise(*dtypes):
    """The dtype among ``dtypes`` with the loosest tolerance: a gradient that flows through a value
    stored in a lower precision (a module's output) is only as accurate as that value."""
    return max((jnp.dtype(d) for d in dtypes), key=lambda d: REL_TOL[d.name])


def dtype_cover(shapes, half=(jnp.bfloat16, jnp.float16)):
    """(dtype, shape) pairs for a check of an op's reference lowering, whose shape handling and
    float32 arithmetic do not depend on the input dtype (it only rounds the inputs and the
    result): every shape in float32, the tightest tolerance, and the half-precision dtypes taking
    the shapes in turn. Each dtype and each shape runs; their full product adds compiles only."""
    return [(jnp.float32, shape) for shape in shapes] + [(half[i % len(half)], shape) for i, shape in enumerate(shapes)]


def random(rng, shape, dtype, loc=0.0):
    """Fresh normal inputs (never zeros), rounded to ``dtype``."""
    return jnp.asarray(rng.standard_normal(shape) + loc, dtype)


def same_tree(a, b):
    """Same leaves at the same key paths, with the same shapes and dtypes (the container classes
    may differ: Equinox modules are their own pytree node types)."""
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [jax.tree_util.keystr(p) for p, _ in la] == [jax.tree_util.keystr(p) for p, _ in lb]
    for (_, u), (_, v) in zip(la, lb):
        assert u.shape == v.shape and u.dtype == v.dtype


def assert_matches(out, ref, tol_dtype=None, scale=2.0):
    """``out`` has ``ref``'s shape and dtype and agrees within the tolerance of ``tol_dtype``
    (default: ``ref``'s dtype) times ``scale``."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    assert_close(out, np.asarray(jnp.asarray(ref, jnp.float32)), tol_dtype or ref.dtype, scale=scale)


def assert_trees_match(got, ref, tol_dtype=None, scale=5.0):
    """Pytrees (e.g. gradients) with the same structure, shapes and dtypes and matching leaves,
    each within the tolerance of the least precise of ``tol_dtype`` (the compute dtype, e.g. a
    module's output) and its own dtype (a bfloat16 parameter's gradient is rounded to bfloat16)."""
    same_tree(got, ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert_matches(a, b, least_precise(b.dtype, *([tol_dtype] if tol_dtype else [])), scale)


def perturbed_stock_checkpoint(stock, ours, rng):
    """``(stock, ours)`` after perturbing the stock Equinox module's arrays and loading them into
    ours with Equinox's own serialisation (a stock checkpoint restored into our module)."""
    import io

    import equinox as eqx

    leaves = [a + random(rng, a.shape, jnp.float32).astype(a.dtype) for a in jax.tree.leaves(stock)]
    stock = jax.tree.unflatten(jax.tree.structure(stock), leaves)
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, stock)
    buffer.seek(0)
    return stock, eqx.tree_deserialise_leaves(buffer, ours)
