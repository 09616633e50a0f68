"""Rematerialization (``jax.checkpoint``) with the kernels' GEMMs counted as the dots they are.

Every op works under ``jax.checkpoint`` / ``flax.linen.remat`` / ``flax.nnx.remat`` /
``equinox.filter_checkpoint`` with any policy, with the gradients of the same op without it. But
JAX's policies judge the equations of a traced function by their primitive, and the dot-saving
ones (``dots_saveable``, ``dots_with_no_batch_dims_saveable``, ``offload_dot_with_no_batch_dims``)
save only ``lax.dot_general``'s results: a cutelayers GEMM is a kernel call, so under those
policies as given it is recomputed in the backward, where a stock ``Dense`` / ``Linear``'s matmul
is kept -- one more forward GEMM per layer than the stock model pays for the same policy.

:func:`remat_policy` wraps a policy so that each kernel call whose kernel is a GEMM is judged as
the ``dot_general`` it computes ((M, K) @ (K, N), no batch dimensions, float32 accumulation):
what the policy would keep of a stock layer's matmul, it keeps of ours (the kernel's results: the
fused layer's output and, with an activation, its pre-activation). Every other equation --
the row kernels (norms, softmax) among them, which the dot policies recompute as they recompute
XLA's elementwise fusions -- goes to the policy as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import jaxprs_in_params

from cutelayers.ops._batching import fold_batch_p
from cutelayers.ops.linear import GemmFamily
from cutelayers.runtime.primitive import kernel_call_p

# dot_general's parameters for (M, K) @ (K, N): contract lhs 1 with rhs 0, no batch dimensions
_MATMUL = {"dimension_numbers": (((1,), (0,)), ((), ())), "precision": None,
           "preferred_element_type": jnp.dtype(jnp.float32), "out_sharding": None}


def _dot_queries(prim, avals, params) -> list[tuple]:
    """(primitive, avals, params) of each dot an equation runs, as the policy is asked about a
    ``dot_general``: a GEMM kernel call's, or those of the GEMM kernels and XLA dots inside a
    folded call (what the ops bind: :func:`cutelayers.ops._batching.fold_batch`; on the
    reference path its dots are XLA's)."""
    if prim is fold_batch_p:
        return [query for eqn in _equations(params["call"].jaxpr)
                if (query := _as_dot(eqn.primitive, [v.aval for v in eqn.invars], eqn.params))]
    query = _as_dot(prim, avals, params)
    return [query] if query else []


def _as_dot(prim, avals, params) -> tuple | None:
    if prim is jax.lax.dot_general_p:
        return prim, avals, params
    if prim is kernel_call_p and isinstance(params["family"], GemmFamily):
        m, n, k = params["family"].gemm_shape(avals)
        operand = lambda *shape: jax.ShapeDtypeStruct(shape, avals[0].dtype)
        return jax.lax.dot_general_p, (operand(m, k), operand(k, n)), _MATMUL
    return None


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from _equations(sub)


@dataclasses.dataclass(frozen=True)
class _GemmsAsDots:
    """A checkpoint policy: ``policy``, asked about the dots an equation runs where it runs any
    (:func:`_dot_queries`). Frozen, so that equal policies hash equal (JAX keys its caches on
    the policy)."""

    policy: Callable

    def __call__(self, prim, *avals, **params):
        if not (dots := _dot_queries(prim, avals, params)):
            return self.policy(prim, *avals, **params)
        verdicts = [self.policy(dot, *dot_avals, **dot_params) for dot, dot_avals, dot_params in dots]
        # one verdict for the equation's results: the policy's own where they agree (True, or
        # an offload), else recompute
        return verdicts[0] if all(v == verdicts[0] for v in verdicts) else False


def remat_policy(policy: Callable) -> Callable:
    """``policy`` (a ``jax.checkpoint`` policy: ``jax.checkpoint_policies.*`` or your own) with
    cutelayers' GEMM kernels judged as the ``lax.dot_general`` each computes (module docstring).

    >>> policy = cutelayers.remat_policy(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    >>> block = flax.nnx.remat(block_fn, policy=policy)   # or jax.checkpoint, linen.remat, ...

    Under it a model of cutelayers layers keeps its GEMMs' results as the stock model keeps its
    matmuls' under ``policy``; policies that never save a dot (``nothing_saveable``, the name
    policies) decide as before.
    """
    if not callable(policy):
        raise TypeError(f"remat_policy: 'policy' must be a jax.checkpoint policy (a callable taking "
                        f"(primitive, *avals, **params)); got {type(policy).__name__} {policy!r}")
    return policy if isinstance(policy, _GemmsAsDots) else _GemmsAsDots(policy)


__all__ = ["remat_policy"]
