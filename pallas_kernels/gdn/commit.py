"""commit_states: after speculative verification, keep the state after the last accepted token."""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels.gdn import reference
from pallas_kernels.gdn._checks import check_commit

__all__ = ["commit_states"]

_OP = "commit_states"
# A scatter of whole slots into the donated pool is already in place under jit.
_NO_KERNEL = "no Pallas kernel for commit_states (XLA's scatter into the donated pool is in place)"


def commit_states(
    ssm_pool: jax.Array,
    intermediates: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    impl: str = "auto",
) -> jax.Array:
    """Writes ``pool[state_indices[n]] = intermediates[n, accepted_steps[n]]``.

    ``accepted_steps[n]`` indexes the D verified tokens of row n (``0..D-1``): the state after
    token ``accepted_steps[n]``, i.e. the number of accepted draft tokens when token 0 is the
    root (the bonus token is not folded in). A negative value leaves the slot as it is, and so
    does a padded row (slot 0): the pad slot is never written. Example with D=3:
    ``accepted_steps = [2, 0, -1]`` writes the state after token 2 of row 0, after token 0 of
    row 1, and leaves row 2's slot alone. Slots of rows with ``accepted_steps[n] >= 0`` must
    be distinct (the caller's invariant, not checked); values ``>= D`` are not allowed.
    Tree drafts: ``accepted_steps[n]`` is the last accepted node's index in the row; its
    intermediate already holds the state after its root path, so nothing else changes.

    Args:
      ssm_pool: float32 ``[S, HV, K, V]``; donate it under jit for an in-place update.
      intermediates: float32 ``[N, D, HV, K, V]`` from ``verify_gated_delta_rule``.
      state_indices: int32 ``[N]`` slots.
      accepted_steps: int32 ``[N]`` token index to keep, or negative to keep nothing.
      impl: ``"auto" | "reference"``; there is no kernel (``"pallas"`` raises).

    Returns:
      the new ssm pool ``[S, HV, K, V]``.
    """
    check_commit(_OP, ssm_pool, intermediates, state_indices, accepted_steps)
    resolve_impl(_OP, impl, _NO_KERNEL)
    return reference.commit_states(ssm_pool, intermediates, state_indices, accepted_steps)
