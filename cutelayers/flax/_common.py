"""Argument checks shared by the Flax modules: what the kernels can and cannot honour."""

from __future__ import annotations

from typing import Any, Iterable


def _axes(rank: int, axes) -> tuple[int, ...]:
    if not isinstance(axes, Iterable):
        axes = (axes,)
    return tuple(sorted({a % rank if rank else a for a in axes}))


def check_supported(module: str, x, *, reduction_axes: Any, feature_axes: Any, axis_name: Any,
                    axis_index_groups: Any, mask: Any) -> None:
    """Raise for the options of Flax's norm layers that the last-axis kernels cannot honour."""
    rank = len(x.shape)
    last = (rank - 1,)
    if rank == 0:
        raise ValueError(f"{module}: input must have rank >= 1; got a scalar")
    for name, axes in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        if _axes(rank, axes) != last:
            raise NotImplementedError(
                f"{module}: {name}={axes!r} is not supported: cutelayers normalizes over the last "
                f"axis only ({name}=-1). Move the axes last (or use flax's own module)."
            )
    if axis_name is not None or axis_index_groups is not None:
        raise NotImplementedError(
            f"{module}: axis_name/axis_index_groups (statistics across devices) are not supported; "
            "the statistics are per row. Use flax's own module for cross-device statistics."
        )
    if mask is not None:
        raise NotImplementedError(f"{module}: mask is not supported; use flax's own module for masked statistics.")


def check_dense_supported(module: str, **options: Any) -> None:
    """Raise for the options of Flax's Dense / Linear that the fused GEMM cannot honour.

    ``options`` maps each such option's name to the caller's value, or to None where the caller
    left Flax's default (or chose a value the GEMM honours anyway).
    """
    for name, value in options.items():
        if value is not None:
            raise NotImplementedError(
                f"{module}: {name}={value!r} is not supported: cutelayers computes the product with its "
                f"own fused GEMM kernel. Use flax's own module for a custom {name}."
            )
