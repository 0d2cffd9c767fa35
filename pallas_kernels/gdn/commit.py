"""commit_states: after speculative verification, keep the state after the last accepted token."""

from __future__ import annotations

import jax

from pallas_kernels._commit import commit
from pallas_kernels.gdn._checks import check_commit

__all__ = ["commit_states"]

_OP = "commit_states"


def commit_states(
    ssm_pool: jax.Array,
    intermediates: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    impl: str = "auto",
) -> jax.Array:
    """Writes ``pool[state_indices[n]] = intermediates[n, accepted_steps[n]]`` where
    ``accepted_steps[n] >= 0``; the pad slot 0 is never written (the rule of
    ``pallas_kernels._commit.commit_steps``, with its example).

    Args:
      ssm_pool: float32 ``[S, HV, K, V]``; donate it under jit for an in-place update.
      intermediates: float32 ``[N, D, HV, K, V]`` from ``verify_gated_delta_rule``.
      state_indices: int32 ``[N]`` slots.
      accepted_steps: int32 ``[N]`` token index to keep, or negative to keep nothing.
      impl: ``"auto" | "reference"``; there is no kernel (``"pallas"`` raises).

    Returns:
      the new pool, ``ssm_pool``'s shape.
    """
    check_commit(_OP, ssm_pool, intermediates, state_indices, accepted_steps)
    return commit(_OP, ssm_pool, intermediates, state_indices, accepted_steps, impl)
