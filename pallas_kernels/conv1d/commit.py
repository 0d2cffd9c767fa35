"""commit_windows: after speculative verification, keep the window after the last accepted token."""

from __future__ import annotations

import jax

from pallas_kernels.commit import commit
from pallas_kernels.conv1d._checks import check_commit

__all__ = ["commit_windows"]

_OP = "commit_windows"


def commit_windows(conv_pool: jax.Array, windows: jax.Array, state_indices: jax.Array,
                   accepted_steps: jax.Array, *, impl: str = "auto") -> jax.Array:  # fmt: skip
    """``pallas_kernels.commit_states`` on a conv pool, its arguments checked against the conv
    layout: conv_pool ``[S, C, W-1]``, windows ``[N, D, C, W-1]`` of its dtype from
    ``causal_conv1d_verify``."""
    check_commit(_OP, conv_pool, windows, state_indices, accepted_steps)
    return commit(_OP, conv_pool, windows, state_indices, accepted_steps, impl)
