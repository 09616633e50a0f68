"""Backend choice: which implementation a kernel call lowers to.

The choice is made when lowering, per platform:

* lowering for CUDA emits the CuTe kernel (``cute``) or the jnp reference (``reference``);
* lowering for any other platform always emits the jnp reference.

``auto`` (the default) picks kernels on CUDA GPUs of compute capability 9.x and the reference
elsewhere, and logs once which one runs and why. ``cute`` insists on kernels and raises where they
cannot run. ``reference`` always lowers the jnp reference.

Every fallback from the kernels to the reference -- the CuTe DSL not installed (the ``cute`` extra),
no Hopper GPU, a platform other than CUDA, an op's dtype or size the kernels do not take, a module
argument only the stock module implements -- goes through :func:`fall_back`: one log line under
``auto``, an error under ``cute``. Where the kernels can run but XLA is measured faster (float32
parameters at decode rows: :func:`cutelayers.ops.linear.choose_kernels`), :func:`fall_back` picks
the reference under ``auto`` (one log line) and leaves ``cute`` with the kernels it asks for.

Set it with the ``CUTELAYERS_BACKEND`` environment variable (unset or empty: ``auto``; another
value is a ``ValueError`` where the backend is read, :func:`current_backend`) or, for a region of
code, with :func:`use_backend`. The setting is part of JAX's jit cache key, so a function jitted
under one backend is re-traced, not silently reused, under another.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

from cutelayers.runtime._jax_compat import enum_state

BACKENDS = ("auto", "cute", "reference")

logger = logging.getLogger("cutelayers")

ENV_VARIABLE = "CUTELAYERS_BACKEND"
# The option named cutelayers_backend takes its default from $CUTELAYERS_BACKEND (JAX reads it) and
# JAX refuses, at import, a value not among its enum values. So the value set, whatever it is, is
# one of them, and current_backend() -- the point of use -- says what is wrong with it; empty is
# unset (auto).
_env = os.environ.get(ENV_VARIABLE, "")

# A JAX config state rather than a plain context variable: JAX then keys its jit and trace caches
# on it, so switching backends can never reuse an executable lowered for the other one.
_backend_state = enum_state(
    name="cutelayers_backend",
    enum_values=list(dict.fromkeys([*BACKENDS, _env])),
    default="auto",
    help="cutelayers backend: auto, cute or reference.",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def current_backend() -> str:
    """The backend in force here: ``"auto"``, ``"cute"`` or ``"reference"``. Raises ValueError
    where that is the setting of ``$CUTELAYERS_BACKEND`` and names none of them."""
    value = _backend_state.value
    if value in BACKENDS:
        return value
    if value == "":
        return "auto"
    raise ValueError(f"{ENV_VARIABLE}={value!r} is not a backend; allowed: {', '.join(BACKENDS)} (or unset: auto)")


def use_backend(name: str) -> Iterator[None]:
    """Context manager that sets the backend for code traced inside it.

    >>> with cutelayers.use_backend("reference"):
    ...     y = jax.jit(f)(x)
    """
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    return _backend_state(name)


_logged: set[str] = set()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time it occurs in this process."""
    if message not in _logged:
        _logged.add(message)
        logger.warning("cutelayers: %s", message)


def log_once(backend: str, why: str) -> None:
    """Log which implementation runs and why, once per distinct (backend, reason)."""
    warn_once(f"running the {backend} path ({why})")


def fall_back(op: str, why: str, *, kernels_can_run: bool = False) -> bool:
    """The one place a call leaves the CuTe kernels for the reference: ``op`` runs the reference
    because ``why``. Logs that once under ``auto`` (and ``reference``). Under ``cute``, an explicit
    request for kernels: raises ``RuntimeError`` where they cannot run; where they can but XLA is
    measured faster (``kernels_can_run``), the kernels run as asked. Returns whether the reference
    runs."""
    if current_backend() == "cute":
        if kernels_can_run:
            return False
        raise RuntimeError(f"{op}: backend 'cute' asks for the CuTe kernels, but {why}. Use backend 'auto' "
                           "(falls back to the reference and logs why) or 'reference'.")
    log_once("reference", f"{op}: {why}")
    return True
