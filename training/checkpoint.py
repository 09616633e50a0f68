"""Checkpoints with Orbax: the training state (params, optimizer state, step) plus JSON metadata.

One code path for all three frameworks: an ``nnx.State``, a linen params dict and the array
leaves of an Equinox model are all pytrees with key paths, which is what Orbax saves. Restoring
takes a *template* state (``like``) and fills it by key path, so a checkpoint written by a model's
stock twin restores into the cutelayers model (and back): their parameter paths are the same.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint directory that cannot serve: a file in its place, or a checkpoint whose files do
    not read as one (a save cut short, a damaged file)."""


class Checkpointer:
    """Save / restore ``{"params", "opt_state", "step"}`` pytrees under ``directory``.

    Keeps the ``max_to_keep`` newest checkpoints. Saves are asynchronous; :meth:`close` (or
    :meth:`wait`) blocks until they are on disk.
    """

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        self.directory = Path(directory).resolve()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is a file, not a directory")
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
        """Orbax's and TensorStore's errors for files that are not a whole checkpoint (missing
        items, truncated arrays, metadata that is not JSON) as one :class:`CheckpointError`."""
        try:
            yield
        except (ValueError, KeyError, OSError, RuntimeError) as error:
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} cannot be read ({type(error).__name__}: {first}); "
                f"a save cut short or a damaged file: remove {self.directory / str(step)} to use the one "
                "before it") from error

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
