"""commit_states: after speculative verification, keep the state after the last accepted token."""

from __future__ import annotations

import jax

from pallas_kernels.commit import commit
from pallas_kernels.gdn._checks import check_commit

__all__ = ["commit_states"]

_OP = "commit_states"


def commit_states(ssm_pool: jax.Array, intermediates: jax.Array, state_indices: jax.Array,
                  accepted_steps: jax.Array, *, impl: str = "auto") -> jax.Array:  # fmt: skip
    """``pallas_kernels.commit_states`` on a GDN pool, its arguments checked against the GDN
    layout: ssm_pool float32 ``[S, HV, K, V]``, intermediates ``[N, D, HV, K, V]`` from
    ``verify_gated_delta_rule``."""
    check_commit(_OP, ssm_pool, intermediates, state_indices, accepted_steps)
    return commit(_OP, ssm_pool, intermediates, state_indices, accepted_steps, impl)
