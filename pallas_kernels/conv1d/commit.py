"""commit_windows: after speculative verification, keep the window after the last accepted token."""

from __future__ import annotations

import jax

from pallas_kernels._commit import commit
from pallas_kernels.conv1d._checks import check_commit

__all__ = ["commit_windows"]

_OP = "commit_windows"


def commit_windows(
    conv_pool: jax.Array,
    windows: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    impl: str = "auto",
) -> jax.Array:
    """Writes ``pool[state_indices[n]] = windows[n, accepted_steps[n]]`` where
    ``accepted_steps[n] >= 0``; the pad slot 0 is never written (the rule of
    ``pallas_kernels._commit.commit_steps``, with its example).

    Args:
      conv_pool: ``[S, C, W-1]``; donate it under jit for an in-place update.
      windows: ``[N, D, C, W-1]`` from ``causal_conv1d_verify``, the pool's dtype.
      state_indices: int32 ``[N]`` slots.
      accepted_steps: int32 ``[N]`` token index to keep, or negative to keep nothing.
      impl: ``"auto" | "reference"``; there is no kernel (``"pallas"`` raises).

    Returns:
      the new pool, ``conv_pool``'s shape.
    """
    check_commit(_OP, conv_pool, windows, state_indices, accepted_steps)
    return commit(_OP, conv_pool, windows, state_indices, accepted_steps, impl)
