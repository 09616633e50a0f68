"""Test setup: four fake CPU devices, CuTe compiles for sm_90a, a `gpu` marker, fresh randomness."""

import os
import secrets

# Before JAX is imported anywhere: fake devices for placement/sharding tests, and a target arch so
# CuTe kernels compile on machines without a GPU.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# Compile counts in tests must not depend on what an earlier run left on disk: the disk cache is
# off unless a test turns it on (tests/test_disk_cache.py, with its own directory).
os.environ["CUTELAYERS_CACHE_DIR"] = ""

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _has_hopper() -> bool:
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return False
    return any(str(getattr(d, "compute_capability", "0")).startswith("9") for d in gpus)


HAS_GPU = _has_hopper()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs CuTe kernels on a Hopper GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability 9.x (none visible)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A numpy Generator with a fresh seed per test; the seed is printed on failure and
    ``CUTELAYERS_TEST_SEED=<seed>`` replays it."""
    seed = int(os.environ.get("CUTELAYERS_TEST_SEED") or secrets.randbits(32))
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def cpu():
    return jax.devices("cpu")[0]
