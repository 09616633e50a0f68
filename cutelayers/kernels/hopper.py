"""What the kernels' configs know of the Hopper GPUs they are built for (H100 SXM, H200) without a
device: the SM count that sizes persistent grids, and how many clusters of each size are resident
at once, and how a config reads an array dimension that may have no number."""

import operator

# Hopper parts have 132 SMs (H100 SXM, H200); fewer SMs only means a tail wave.
HOPPER_SMS = 132
# Clusters of each size resident at once with one CTA an SM: Hopper's 132 SMs sit in GPCs of
# about 16 to 18 (which ones varies from chip to chip), and a cluster runs within one GPC
# (cuOccupancyMaxActiveClusters on an H100 SXM: 132 / 66 / 39 / 30 / 15 / 7 for 1 / 2 / 3 / 4 / 8 /
# 16 CTAs of 200 KiB, and twice that, but 79 for three and 62 for four, with 100 KiB:
# docs/benchmarks.md, eighteenth and twenty-second sessions). A grid larger than what is resident
# runs its last clusters as a second wave.
RESIDENT_CLUSTERS = {1: HOPPER_SMS, 2: 66, 3: 39, 4: 30, 8: 15, 16: 7}


def concrete_dim(dim) -> int | None:
    """``dim`` as a Python int, or None where it is symbolic (``jax.export``'s shape polymorphism
    gives such a dimension no number, so a config cannot compare it)."""
    try:
        return operator.index(dim)  # Python and NumPy integers
    except TypeError:
        return None
