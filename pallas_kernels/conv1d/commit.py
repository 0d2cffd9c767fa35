"""commit_windows: after speculative verification, keep the window after the last accepted token."""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels.conv1d import reference
from pallas_kernels.conv1d._checks import check_commit

__all__ = ["commit_windows"]

_OP = "commit_windows"
# A scatter of whole slots into the donated pool is already in place under jit.
_NO_KERNEL = "no Pallas kernel for commit_windows (XLA's scatter into the donated pool is in place)"


def commit_windows(
    conv_pool: jax.Array,
    windows: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    impl: str = "auto",
) -> jax.Array:
    """Writes ``pool[state_indices[n]] = windows[n, accepted_steps[n]]``.

    ``accepted_steps[n]`` indexes the D verified tokens of row n (``0..D-1``): the window after
    token ``accepted_steps[n]``, i.e. the number of accepted draft tokens when token 0 is the
    root. A negative value leaves the slot as it is, and so does a padded row (slot 0): the
    pad slot is never written. Example with D=3:
    ``accepted_steps = [2, 0, -1]`` writes the window after token 2 of row 0, after token 0 of
    row 1, and leaves row 2's slot alone. Slots of rows with ``accepted_steps[n] >= 0`` must
    be distinct (the caller's invariant, not checked); values ``>= D`` are not allowed.
    Tree drafts: ``accepted_steps[n]`` is the last accepted node's index in the row; its
    window already holds its root path's inputs, so nothing else changes.

    Args:
      conv_pool: ``[S, C, W-1]``; donate it under jit for an in-place update.
      windows: ``[N, D, C, W-1]`` from ``causal_conv1d_verify``, the pool's dtype.
      state_indices: int32 ``[N]`` slots.
      accepted_steps: int32 ``[N]`` token index to keep, or negative to keep nothing.
      impl: ``"auto" | "reference"``; there is no kernel (``"pallas"`` raises).

    Returns:
      the new conv pool ``[S, C, W-1]``.
    """
    check_commit(_OP, conv_pool, windows, state_indices, accepted_steps)
    resolve_impl(_OP, impl, _NO_KERNEL)
    return reference.commit_windows(conv_pool, windows, state_indices, accepted_steps)
