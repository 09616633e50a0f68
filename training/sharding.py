"""How training lays the model, the optimizer state and the batches over a device mesh
(``python -m training.train --mesh data=2,fsdp=2,tensor=2``).

The mesh has three axes, each of size 1 unless ``--mesh`` names it:

* ``data`` -- data parallel: every batch is split over it, the state is replicated;
* ``fsdp`` -- fully sharded data parallel: batches are split over it too, and every large
  parameter (at least :data:`FSDP_MIN_SIZE` elements) and its optimizer state are sharded along
  the parameter's largest axis that the axis size divides; XLA gathers each one where a layer
  needs it whole and reduce-scatters its gradient;
* ``tensor`` -- Megatron-style tensor parallel: the column-parallel layers (qkv, the MLP's first
  layer, the LM head) are sharded along their output axis (biases too), the row-parallel ones
  (attn_out, the MLP's second layer) along their input axis, the token embedding along the vocabulary; norms, the position
  embedding and the residual stream are replicated. A gated MLP's first layer (SwiGLU: its gate
  and value halves side by side) is stored split in contiguous blocks as any other; its op
  computes each device's part of both halves, XLA moving the weight's columns there once a step
  (an all-to-all of the weight, not of activations: ``cutelayers.runtime.family.Halves``).

:func:`spec_for` is the one rule table: a parameter's sharding follows from its key path and
shape, the same for the three frameworks (a linear layer's ``kernel`` is (in, out) in Flax,
its ``weight`` (out, in) in Equinox) and for the optimizer state, whose moments repeat the
parameters' paths under their own prefix. The jitted train step takes and returns the state in
these shardings, and XLA inserts the collectives.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.configs import GPTConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # every batch is split over both
FSDP_MIN_SIZE = 1024  # smaller parameters (norm scales, biases) stay replicated under fsdp

# The layers the rules name, by their key in the parameter tree (the MLP's two layers by
# "mlp.<name>": fc1 / fc2 in NNX and Equinox, Dense_0 / Dense_1 in linen):
# "column" / "row": a linear layer split along its output / input axis under tensor parallel;
# "vocab" / "positions": an embedding table, split along its rows (the vocabulary under tensor
# parallel; under fsdp both tables, so that no sharding reaches the residual stream's features).
LAYERS = {"qkv": "column", "mlp.fc1": "column", "mlp.Dense_0": "column", "head": "column",
          "attn_out": "row", "mlp.fc2": "row", "mlp.Dense_1": "row", "wte": "vocab", "wpe": "positions"}
# Where a linear layer's axes are: Flax's kernel is (in, out), Equinox's weight (out, in).
LINEAR_AXES = {"kernel": {"in": 0, "out": 1}, "weight": {"in": 1, "out": 0}}


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=2"`` -> ``{"data": 2, "fsdp": 1, "tensor": 2}`` (argparse type)."""
    import argparse

    shape = dict.fromkeys(AXES, 1)
    seen = set()
    for item in text.split(","):
        name, sep, size = item.strip().partition("=")
        if not sep or name not in AXES:
            raise argparse.ArgumentTypeError(
                f"expected AXIS=N[,AXIS=N...] with AXIS one of {', '.join(AXES)}; got {text!r}")
        if name in seen:
            raise argparse.ArgumentTypeError(f"axis {name!r} given twice in {text!r}")
        try:
            shape[name] = int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: size must be an integer; got {size!r} in {text!r}") from None
        if shape[name] < 1:
            raise argparse.ArgumentTypeError(f"{name}: size must be >= 1; got {shape[name]} in {text!r}")
        seen.add(name)
    return shape


def describe(shape: dict[str, int]) -> str:
    """The ``--mesh`` value of ``shape``: its axes of size > 1 (``data=1`` if none)."""
    return ",".join(f"{a}={n}" for a, n in shape.items() if n > 1) or "data=1"


def model_errors(shape: dict[str, int], config: GPTConfig) -> list[str]:
    """Why ``config`` cannot be split over ``shape``'s tensor axis (empty if it can): the heads (of
    keys and values too), the MLP width and the vocabulary must divide evenly."""
    t = shape["tensor"]
    dims = {"n_heads": config.n_heads, **({"n_kv_heads": config.n_kv_heads} if config.n_kv_heads else {}),
            "d_mlp": config.d_mlp, "vocab_size": config.vocab_size}
    return [f"{name}={n}" for name, n in dims.items() if n % t]


# The checks a command runs on a mesh before training over it, each the reason (a sentence naming
# the flags) or None: training.train and training.bench word them alike.

def tensor_error(shape: dict[str, int], config: GPTConfig, config_name: str) -> str | None:
    """Why the ``config_name`` preset cannot be split over ``shape``'s tensor axis, or None."""
    if unsplittable := model_errors(shape, config):
        return (f"tensor={shape['tensor']} must divide the {config_name} config's {', '.join(unsplittable)} "
                f"(the heads, MLP width and vocabulary it splits)")
    return None


def batch_error(shape: dict[str, int], batch_size: int, mesh_flag: str, batch: str | None = None) -> str | None:
    """Why batches of ``batch_size`` sequences (``batch``: how the command names that number,
    default ``--batch-size N``) cannot be split over the batch shards (data x fsdp) of
    ``shape`` (``mesh_flag``: the flag that asked for it), or None."""
    shards = shape["data"] * shape["fsdp"]
    if batch_size % shards == 0:
        return None
    return (f"{batch or f'--batch-size {batch_size}'} is not a multiple of {shards}, the batch shards of "
            f"{mesh_flag} (data x fsdp: each takes an equal share of every batch)")


def device_error(shape: dict[str, int], mesh_flag: str) -> str | None:
    """Why :func:`device_mesh` cannot lay ``shape`` over JAX's devices, or None: more devices than
    are visible, or (several processes) not exactly all of them."""
    available, platform = len(jax.devices()), jax.default_backend()
    n = math.prod(shape.values())
    if jax.process_count() > 1 and n != available:
        return (f"{mesh_flag}: {n} devices; the {jax.process_count()} processes have {available} {platform} "
                f"devices together, and a mesh of several processes spans them all (each process takes part "
                f"in every step). Use a mesh of {available} devices.")
    if n > available:
        return (f"{mesh_flag}: needs {n} devices; only {available} {platform} device(s) visible. Use a mesh of "
                f"{available} or fewer (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes "
                f"that many host devices).")
    return None


def device_mesh(shape: dict[str, int]) -> Mesh:
    """:func:`make_mesh` over the first devices of JAX's default platform (with several processes,
    all of theirs); check :func:`device_error` first."""
    return make_mesh(shape, jax.devices()[:math.prod(shape.values())])


def make_mesh(shape: dict[str, int], devices) -> Mesh:
    """A (data, fsdp, tensor) mesh over ``devices`` (their count: the product of the sizes).

    Its axes are Auto: XLA partitions the step and applies the kernels' sharding rules when it
    compiles. (Explicit axes would type every array's sharding, which jax 0.10 refuses for some
    of the models' reshapes.)
    """
    return jax.make_mesh(tuple(shape[a] for a in AXES), AXES, devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def _layer(path) -> tuple[str | None, str | None]:
    """(the layer's role in :data:`LAYERS` or None, the leaf's name) of a key path; the path's
    string keys end ``..., [parent,] layer, leaf`` (NNX adds ``value``; an optimizer moment a
    prefix)."""
    names = [n for n in (getattr(k, "key", getattr(k, "name", None)) for k in path) if isinstance(n, str)]
    names = names[:-1] if names[-1:] == ["value"] else names
    if len(names) < 2:
        return None, None
    role = LAYERS.get(names[-2]) or LAYERS.get(".".join(names[-3:-1]))
    return role, names[-1]


def tensor_axis(role: str | None, leaf: str | None, shape: tuple[int, ...]) -> int | None:
    """The axis ``tensor`` shards (None: replicated over it)."""
    if role == "vocab":
        return 0
    if role not in ("column", "row"):
        return None
    if len(shape) == 1:  # a bias: split with a column-parallel layer's outputs
        return 0 if role == "column" else None
    return LINEAR_AXES[leaf]["in" if role == "row" else "out"] if leaf in LINEAR_AXES else None


def spec_for(path, shape: tuple[int, ...], mesh_shape: dict[str, int]) -> PartitionSpec:
    """The sharding of the state leaf at ``path`` of ``shape``: the rule table (module docstring).

    fsdp takes matrices of at least :data:`FSDP_MIN_SIZE` elements only (vectors stay whole: a
    norm's scale must be), along an embedding table's rows, else along the largest axis whose
    size it divides (of equal ones, tensor's), shared with ``tensor`` if that axis is tensor's.
    """
    role, leaf = _layer(path)
    dims: list[Any] = [None] * len(shape)
    t, f = mesh_shape["tensor"], mesh_shape["fsdp"]
    axis = tensor_axis(role, leaf, shape) if t > 1 and shape else None
    if axis is not None:
        dims[axis] = "tensor"
    if f > 1 and len(shape) >= 2 and math.prod(shape) >= FSDP_MIN_SIZE:
        left = [n // t if d == axis else n for d, n in enumerate(shape)]
        # the largest axis; of equal ones tensor's (a layer's two layouts then shard alike)
        candidates = ([0] if role in ("vocab", "positions")
                      else sorted(range(len(shape)), key=lambda d: (-shape[d], d != axis, d)))
        fits = [d for d in candidates if left[d] % f == 0]
        if fits:
            dims[fits[0]] = ("tensor", "fsdp") if fits[0] == axis else "fsdp"
    return PartitionSpec(*dims)


def state_shardings(mesh: Mesh, tree) -> Any:
    """A NamedSharding per leaf of ``tree`` (parameters, optimizer state: arrays or
    ``jax.ShapeDtypeStruct``), by :func:`spec_for`."""
    shape = dict(mesh.shape)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, spec_for(path, tuple(leaf.shape), shape)), tree)


def place_state(mesh: Mesh, tree):
    """The train state ``tree`` (parameters, optimizer state) placed on ``mesh`` in the shardings
    of :func:`state_shardings`."""
    return place(tree, state_shardings(mesh, tree))


def bytes_per_device(tree, device=None) -> int:
    """Bytes of ``tree``'s arrays held by ``device`` (default: the device of the first leaf's
    first addressable shard): the sum of its shards' sizes."""
    leaves = jax.tree.leaves(tree)
    if device is None:
        device = leaves[0].addressable_shards[0].device
    return sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards if shard.device == device)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(batch, seq) token arrays: the batch split over ``data`` and ``fsdp``."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def place(tree, shardings):
    """``tree``'s arrays (the same values on every process: the same seed) laid out in
    ``shardings``. With several processes each puts its own devices' shards from its copy
    (``jax.device_put`` takes only host arrays there, and compares them across the processes)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def process_rows(sharding: NamedSharding, n: int) -> slice:
    """The rows of an (n, ...) array in ``sharding`` that this process's devices hold: the rows of
    every batch it builds (all of them on one process)."""
    held = set()
    for index in sharding.addressable_devices_indices_map((n,)).values():
        held.update(range(*index[0].indices(n)))
    rows = slice(min(held), max(held) + 1)
    if len(held) != rows.stop - rows.start:  # make_mesh orders devices by process: not expected
        raise ValueError(f"this process's devices hold rows {sorted(held)} of {n}, not one block")
    return rows


def global_batch(sharding: NamedSharding, local, n: int) -> tuple[jax.Array, ...]:
    """Global (n, ...) arrays in ``sharding`` of the host arrays ``local`` holding this process's
    rows (:func:`process_rows`) of each."""
    return tuple(jax.make_array_from_process_local_data(sharding, a, (n, *a.shape[1:])) for a in local)
