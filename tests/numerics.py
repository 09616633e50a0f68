"""Dtype-aware comparison helpers shared by the tests."""

import jax.numpy as jnp
import numpy as np

# Relative-error tolerances (‖out − ref‖ / ‖ref‖) for a result stored in the given dtype.
REL_TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}


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


def random(rng, shape, dtype, loc=0.0):
    """Fresh normal inputs (never zeros), rounded to ``dtype``."""
    return jnp.asarray(rng.standard_normal(shape) + loc, dtype)
