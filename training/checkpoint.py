"""Checkpoints with Orbax: the training state (params, optimizer state, step) plus JSON metadata.

One code path for all three frameworks: an ``nnx.State``, a linen params dict and the array
leaves of an Equinox model are all pytrees with key paths, which is what Orbax saves. Restoring
takes a *template* state (``like``) and fills it by key path, so a checkpoint written by a model's
stock twin restores into the cutelayers model (and back): their parameter paths are the same.
"""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

# How Orbax's restore says that the saved tree and the template differ in structure
STRUCTURE_MISMATCH = "tree structures do not match"
# The file Orbax writes into each step's checkpoint directory
STEP_MARKER = "_CHECKPOINT_METADATA"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot serve: a file in its place, a checkpoint of another
    model's tree structure, or one whose files do not read as one (a save cut short, a damaged
    file)."""


def step_directory_error(directory: str | Path) -> str | None:
    """Why ``directory`` cannot be a run's checkpoint directory because it is one checkpoint (one
    step) of a run, or None. Used as a run's directory, it would be read as holding no checkpoint
    and be written into."""
    directory = Path(directory).resolve()
    if not (directory / STEP_MARKER).is_file():
        return None
    return (f"{directory} is one checkpoint (step {directory.name}) of the run in {directory.parent}; "
            f"give the run's directory: --checkpoint-dir {directory.parent}")


class Checkpointer:
    """Save / restore ``{"params", "opt_state", "step"}`` pytrees under ``directory``.

    Keeps the ``max_to_keep`` newest checkpoints. Saves are asynchronous; :meth:`close` (or
    :meth:`wait`) blocks until they are on disk.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        self.directory = Path(directory).resolve()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is a file, not a directory")
        if error := step_directory_error(self.directory):
            raise CheckpointError(error)
        self._manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict]:
        """(state, meta) of checkpoint ``step`` (default: the latest), in ``like``'s structure."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        with self._reading(step):
            restored = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return restored.state, dict(restored.meta)

    def read_meta(self, step: int | None = None) -> dict:
        """The JSON metadata of checkpoint ``step`` (default: the latest), without the arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        with self._reading(step):
            return dict(self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Orbax's and TensorStore's errors as one :class:`CheckpointError`: a checkpoint of another
        tree structure than ``like`` (another model or config: the files are fine), or files that
        are not a whole checkpoint (missing items, truncated arrays, metadata that is not JSON)."""
        try:
            yield
        except (ValueError, KeyError, OSError, RuntimeError) as error:
            lines = str(error).strip().splitlines()
            if isinstance(error, ValueError) and STRUCTURE_MISMATCH in str(error):
                # Orbax's diff: the differing key path as indented "key:" lines, then "- Source: ..."
                keys = [line.strip().rstrip(":") for line in itertools.takewhile(
                    lambda line: "- Source:" not in line, lines[1:])]
                where = f" (first difference at {'.'.join(keys)})" if keys else ""
                raise CheckpointError(
                    f"checkpoint {step} in {self.directory} does not fit this model: the structures of its "
                    f"state and of the model's differ{where}. It was written by a different model or config "
                    "(its files are not damaged): resume it with the model and config that wrote it, or "
                    "use another directory") from error
            first = lines[0][:200] if lines else ""
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} cannot be read ({type(error).__name__}: {first}); "
                f"a save cut short or a damaged file: remove {self.directory / str(step)} to use the one "
                "before it") from error

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
