"""What the Flax and Equinox modules share (importing neither framework): whether the kernels can
serve a call, the fallback to the stock module's computation, argument checks, and the norm
modules' fused residual add.

Every module is a subclass of the stock one. A call runs the cutelayers op (its CuTe kernels on
Hopper) where the op can serve the arguments; otherwise the module runs the stock module's own
``__call__`` (the same numerics as stock) after :func:`cutelayers.backend.fall_back` has logged
once why (or raised, under backend ``cute``). The ``*_blocker`` functions say why the op cannot
serve a call, or None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp

from cutelayers import backend
from cutelayers.ops._rowwise import check_int, check_number
from cutelayers.ops.linear import (
    ACTIVATION_FUNCTIONS,
    MIXED_PRECISION_DTYPES,
    allowed_activations,
    check_activation_name,
    gated_hidden,
    is_gated,
    resolve_activation,
)
from cutelayers.ops.lm_head import linear_cross_entropy
from cutelayers.ops.norm import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from cutelayers.runtime.tensors import FLOAT_DTYPES

_KERNEL_DTYPES = ", ".join(d.name for d in FLOAT_DTYPES)


def kernels_serve(module: str, why: str | None) -> bool:
    """True where the op serves the call (``why`` is None); otherwise the fallback, routed through
    the backend's one decision, and False: the caller runs the stock computation."""
    if why is None:
        return True
    backend.fall_back(module, why)
    return False


def options_blocker(**options: Any) -> str | None:
    """Why the kernels cannot serve: the first of ``options`` (name -> the caller's value, or None
    where the caller left the default or chose what the op honours anyway) that is set."""
    for name, value in options.items():
        if value is not None:
            shown = f"an array of shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)[:80]
            return f"{name} is {shown}, which only the stock computation implements"
    return None


def epsilon_blocker(epsilon) -> str | None:
    """Why the norm ops cannot take a module's ``epsilon``: they take a concrete finite number
    >= 0 (a static kernel constant); the stock modules also compute with a traced or negative one."""
    try:
        if check_number("norm", "epsilon", epsilon) >= 0.0:
            return None
    except (TypeError, ValueError):
        pass
    return f"epsilon is {epsilon!r}; the kernels take a concrete finite number >= 0"


def empty_blocker(**sizes: int) -> str | None:
    """Why the kernels cannot produce a result with one of the named feature counts 0 (an empty
    last axis; the stock layers return the empty array)."""
    for name, size in sizes.items():
        if size == 0:
            return f"{name} is 0: an empty result, which the stock computation returns"
    return None


def dtype_blocker(**dtypes: Any) -> str | None:
    """Why the kernels cannot take these named dtypes (None: not given): they take bfloat16,
    float16 and float32 only."""
    for name, dtype in dtypes.items():
        if dtype is not None and jnp.dtype(dtype) not in FLOAT_DTYPES:
            return f"{name} has dtype {jnp.dtype(dtype).name}; the kernels take {_KERNEL_DTYPES}"
    return None


def shape_blocker(x) -> str | None:
    """Why the row kernels cannot take ``x``: they need an array of rank >= 1 whose last axis is
    not empty."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return f"x is a {type(x).__name__}, not an array"
    if len(x.shape) == 0:
        return "x is a scalar"
    if x.shape[-1] == 0:
        return f"x has an empty last axis (shape {tuple(x.shape)})"
    return None


def embed_blocker(ids, num_embeddings: int, features: int, **dtypes: Any) -> str | None:
    """Why :func:`cutelayers.ops.embed` cannot serve an embedding call: ``ids`` not an integer
    array (the stock module raises), a one-row table (the stock module broadcasts it), rows of no
    features, or a table / result dtype other than bfloat16, float16 and float32."""
    if not hasattr(ids, "dtype") or not jnp.issubdtype(ids.dtype, jnp.integer):
        return f"the ids are {getattr(ids, 'dtype', type(ids).__name__)}, not integers"
    if num_embeddings == 1:
        return "num_embeddings is 1 (the stock layer broadcasts its one row)"
    return empty_blocker(features=features) or dtype_blocker(**dtypes)


def array_blocker(x, **dtypes: Any) -> str | None:
    """:func:`shape_blocker`, then :func:`dtype_blocker` of x and the other named dtypes."""
    return shape_blocker(x) or dtype_blocker(x=x.dtype, **dtypes)


def norm_blocker(x, reduction_axes: Any, feature_axes: Any, **dtypes: Any) -> str | None:
    """Why the last-axis norm kernels cannot serve a Flax norm call on ``x`` (None: they can)."""
    why = shape_blocker(x)
    if why:
        return why
    rank = len(x.shape)
    for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        given = tuple(axes) if isinstance(axes, Iterable) else (axes,)
        if any(not -rank <= a < rank for a in given):  # the stock computation raises its IndexError
            return f"{name}={axes!r} is out of range for x of rank {rank}"
        if sorted({a % rank for a in given}) != [rank - 1]:
            return f"{name}={axes!r}: the kernels normalize over the last axis only"
    return dtype_blocker(x=x.dtype, **dtypes)


def check_norm_residual(module: str, x, residual) -> None:
    """A norm call's ``residual`` (None passes): an array of a floating (or complex) dtype whose shape
    broadcasts to x's. Checked before either path runs: the sum x + residual is kept in the
    residual's dtype, so an integer residual would truncate the normalized input."""
    if residual is None:
        return
    if not hasattr(residual, "shape") or not hasattr(residual, "dtype"):
        raise TypeError(f"{module}: argument 'residual' must be an array; got {type(residual).__name__}")
    if not jnp.issubdtype(residual.dtype, jnp.inexact):
        raise TypeError(f"{module}: argument 'residual' has dtype {jnp.dtype(residual.dtype).name}; expected a "
                        "floating or complex dtype (the sum x + residual is kept in the residual's dtype)")
    x_shape = tuple(jnp.shape(x))
    try:
        summed = jnp.broadcast_shapes(x_shape, tuple(residual.shape))
    except ValueError:
        summed = None
    if summed != x_shape:
        raise ValueError(f"{module}: argument 'residual' has shape {tuple(residual.shape)}; expected x's shape "
                         f"{x_shape} or one that broadcasts to it")


def residual_blocker(x, residual) -> str | None:
    """Why the fused residual add of a norm cannot take ``residual`` (None: there is none, or it
    can; :func:`check_norm_residual` has passed it): it needs x's shape, bfloat16, float16 or float32."""
    if residual is None:
        return None
    if tuple(residual.shape) != tuple(x.shape):
        return f"residual has shape {tuple(residual.shape)}, not x's {tuple(x.shape)}"
    return dtype_blocker(residual=residual.dtype)


def norm_op(center: bool, residual):
    """``op(x, scale, bias, *, epsilon, dtype)`` for a norm module's call: ``layer_norm`` /
    ``rms_norm``, or with a residual ``add_layer_norm`` / ``add_rms_norm`` of (x, residual), which
    returns (normed, summed)."""
    if residual is None:
        return layer_norm if center else rms_norm
    add = add_layer_norm if center else add_rms_norm
    return lambda x, *params, **kwargs: add(x, residual, *params, **kwargs)


def stock_norm(norm, x, residual):
    """The stock computation of a norm module's call: ``norm(x)``, or with a residual
    ``(norm(summed), summed)`` for summed = x + residual in the residual's dtype, as the fused op
    returns it."""
    if residual is None:
        return norm(x)
    summed = (x + residual).astype(jnp.asarray(residual).dtype)
    return norm(summed), summed


def op_operands(promoted, params):
    """The operands as the ops take them: ``promoted`` is ``promote_dtype``'s result (the inputs
    first, then ``params``, the module's own parameters). Float32 parameters of a 16-bit
    computation stay float32 (mixed precision: the ops cast them for their GEMMs and return float32
    gradients, unrounded where a kernel's result is float32 anyway -- the LM head's sum, the bias
    sums -- with no cast pass there; :mod:`cutelayers.ops.linear`'s docstring); otherwise as
    promoted."""
    x, *cast = promoted
    given = [p for p in params if p is not None]
    if jnp.dtype(x.dtype) in MIXED_PRECISION_DTYPES and given and all(p.dtype == jnp.float32 for p in given):
        return (x, *params)
    return (x, *cast)


def finish_linear(module: str, y, activation, residual):
    """A stock Dense / Linear result ``y`` -> ``activation(y) + residual``, what
    :func:`cutelayers.ops.fused_linear` adds in its epilogue (here in y's dtype, which may be
    complex); a residual of another shape is refused as the op refuses it, not broadcast."""
    if activation is not None:
        fused, unfused = resolve_activation(activation)
        y = (unfused or ACTIVATION_FUNCTIONS[fused])(y)
    if residual is None:
        return y
    if tuple(jnp.shape(residual)) != tuple(y.shape):
        raise ValueError(f"{module}: argument 'residual' has shape {tuple(jnp.shape(residual))}; expected the "
                         f"result's shape {tuple(y.shape)}")
    return y + jnp.asarray(residual).astype(y.dtype)


def finish_mlp(module: str, fc1, fc2, x, activation, residual):
    """The stock two-layer computation ``fc2(activation(fc1(x))) + residual`` of stock Dense /
    Linear layers ``fc1`` and ``fc2`` -- for a gated activation ``fc2(act(gate) * value)``, gate
    and value the halves of fc1's output: what :func:`cutelayers.ops.mlp` computes."""
    z = fc1(x)
    h = gated_hidden(z, activation) if is_gated(activation) else finish_linear(module, z, activation, None)
    return finish_linear(module, fc2(h), None, residual)


def fc1_features(activation, hidden_features: int) -> int:
    """An MLP's first-layer width: the gate and value halves side by side for a gated activation."""
    return 2 * hidden_features if is_gated(activation) else hidden_features


def check_head_dtype(module: str, promoted, **operands) -> None:
    """An LM head's operands must promote to a dtype the loss op computes in (it has no stock
    computation to fall back to): a TypeError naming each operand's dtype otherwise -- under
    jax_enable_x64 a float64 default parameter promotes a float32 ``h``."""
    if jnp.dtype(promoted) in FLOAT_DTYPES:
        return
    shown = ", ".join(f"{name} {jnp.dtype(a.dtype).name}" for name, a in operands.items() if a is not None)
    raise TypeError(f"{module}: the operands ({shown}) promote to {jnp.dtype(promoted).name}; the head computes in "
                    f"{_KERNEL_DTYPES}: give it parameters of one of those (e.g. dtype=jnp.float32 under "
                    "jax_enable_x64)")


def lm_head_loss(head, h, weight, bias, labels, vocab_major: bool):
    """An ``LMHead`` module's loss: :func:`linear_cross_entropy` with the head's options, on an
    (H, V) ``weight`` or, with ``vocab_major``, a (V, H) one (a tied table, Equinox's layout)
    read as stored."""
    return linear_cross_entropy(h, weight, labels, bias=bias, kernel_layout="vh" if vocab_major else "hv",
                                ignore_index=head.ignore_index, reduction=head.reduction,
                                label_smoothing=head.label_smoothing, z_loss=head.z_loss,
                                logit_soft_cap=head.logit_soft_cap, chunk_size=head.chunk_size)


def _positive_int(module: str, name: str, value, allowed: str) -> int:
    """A module's positive integer argument (a Python or NumPy int, no bool): a ValueError naming
    ``allowed`` otherwise, as the modules' other configuration errors."""
    try:
        number = check_int(module, name, value)
    except TypeError:
        number = 0
    if number < 1:
        raise ValueError(f"{module}: argument {name!r} must be {allowed}; got {value!r}")
    return number


def check_parts(module: str, parts, out_features, activation, residual) -> None:
    """A Linear / Dense call's ``parts``: None, or a positive int dividing the output features,
    for a plain projection (no activation, no residual) -- what :func:`cutelayers.ops.split_linear`
    computes."""
    if parts is None:
        return
    parts = _positive_int(module, "parts", parts, "None or a positive int")
    if not isinstance(out_features, int) or out_features % parts:
        raise ValueError(f"{module}: argument 'parts'={parts} must divide the output features "
                         f"({out_features!r}) into equal blocks")
    if activation is not None or residual is not None:
        raise ValueError(f"{module}: argument 'parts' splits a plain projection; this call also has "
                         f"{'an activation' if activation is not None else 'a residual'}, which it does not take")


def split_result(y, parts):
    """A stock Dense / Linear result ``y`` as ``parts`` equal blocks of its last axis (``y`` itself
    when ``parts`` is None): what :func:`cutelayers.ops.split_linear` returns."""
    return y if parts is None else tuple(jnp.split(y, parts, axis=-1))


def residual_like(residual, x):
    """A ``residual`` call argument (None passes) as an array in x's dtype, for the ops' epilogue."""
    return None if residual is None else jnp.asarray(residual).astype(x.dtype)


def check_mlp(module: str, activation, **features) -> None:
    """An MLP's arguments: ``activation`` None, a name the GEMM epilogue fuses or a callable (as
    :func:`cutelayers.ops.mlp` takes), and the named feature counts positive integers."""
    for name, value in features.items():
        _positive_int(module, name, value, "a positive integer")
    if activation is None or callable(activation):
        return
    if not isinstance(activation, str):
        raise TypeError(f"{module}: argument 'activation' must be {allowed_activations(gated=True)}; "
                        f"got {activation!r}")
    check_activation_name(module, activation, gated=True)


def check_tied_embedding(module: str, tie_embedding: bool, embedding, vocab_size: int, hidden: int) -> None:
    """A tied LM head takes the (vocab_size, hidden) embedding table at call time; an untied one
    uses its own kernel and takes none."""
    if tie_embedding and embedding is None:
        raise ValueError(f"{module}: tie_embedding=True needs the embedding table: call "
                         f"head(h, labels, embedding=table) with a table of shape (vocab_size, hidden) = "
                         f"({vocab_size}, {hidden})")
    if not tie_embedding and embedding is not None:
        raise ValueError(f"{module}: got an embedding table but tie_embedding=False, so the head uses its own "
                         "kernel; construct it with tie_embedding=True to tie the weights")
    if embedding is not None and tuple(embedding.shape) != (vocab_size, hidden):
        raise ValueError(f"{module}: embedding has shape {tuple(embedding.shape)}; expected (vocab_size, hidden) "
                         f"= ({vocab_size}, {hidden})")
