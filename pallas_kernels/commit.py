"""The commit that ends speculative verification, for any pool, and the masked slot writes the
ops' references share. Shape-agnostic: a pool is ``[S, ...]``, per-row values are ``[N, ...]``
and per-token values ``[N, D, ...]`` with the pool's trailing dims."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._checks import check_vector, fail, shape
from pallas_kernels._common import resolve_impl

__all__ = ["commit_states", "commit_steps", "write_where"]

_OP = "commit_states"

# A scatter of whole slots into the donated pool is already in place under jit.
_NO_KERNEL = "no Pallas kernel for the commit (XLA's scatter into the donated pool is in place)"


def write_where(pool: jax.Array, slots: jax.Array, values: jax.Array, keep: jax.Array) -> jax.Array:
    """``pool[slots[i]] = values[i]`` where ``keep[i]`` (scalars or ``[N]``); other rows are
    sent out of range and dropped, so they cannot touch any slot."""
    target = jnp.where(keep, slots, pool.shape[0])
    return pool.at[target].set(values.astype(pool.dtype), mode="drop")


def commit_steps(
    pool: jax.Array,
    per_step: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> jax.Array:
    """``pool[idx[n]] = per_step[n, accepted_steps[n]]`` where ``accepted_steps[n] >= 0`` and
    ``idx[n] != 0`` (the pad slot is never written).

    ``accepted_steps[n]`` indexes the D verified tokens of row n (``0..D-1``): the state after
    token ``accepted_steps[n]``, i.e. the number of accepted draft tokens when token 0 is the
    root (the bonus token is not folded in). A negative value leaves the slot as it is, and so
    does a padded row (slot 0). Example with D=3: ``accepted_steps = [2, 0, -1]`` writes the
    state after token 2 of row 0, after token 0 of row 1, and leaves row 2's slot alone. Slots
    of rows with ``accepted_steps[n] >= 0`` must be distinct (the caller's invariant, not
    checked); values ``>= D`` are not allowed. Tree drafts: ``accepted_steps[n]`` is the last
    accepted node's index in the row, whose per-step value already holds its root path.
    """
    pool, per_step, state_indices, accepted_steps = (
        jnp.asarray(x) for x in (pool, per_step, state_indices, accepted_steps)
    )
    n_rows, n_steps = per_step.shape[:2]
    step = jnp.clip(accepted_steps, 0, n_steps - 1)
    chosen = per_step[jnp.arange(n_rows), step]
    keep = (accepted_steps >= 0) & (state_indices != 0)
    return write_where(pool, state_indices, chosen, keep)


def commit_states(
    pool: jax.Array,
    per_step: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    impl: str = "auto",
) -> jax.Array:
    """Writes ``pool[state_indices[n]] = per_step[n, accepted_steps[n]]`` where
    ``accepted_steps[n] >= 0``; the pad slot 0 is never written (``commit_steps`` gives the
    rule, with an example). Any pool: GDN and Mamba2 states, conv windows.

    Args:
      pool: ``[S, ...]``; donate it under jit for an in-place update.
      per_step: ``[N, D, ...]`` (the pool's trailing dims and dtype) from a verify op: the
        state or window after each of a row's D tokens.
      state_indices: int32 ``[N]`` slots.
      accepted_steps: int32 ``[N]`` token index to keep, or negative to keep nothing.
      impl: ``"auto" | "reference"``; there is no kernel (``"pallas"`` raises).

    Returns:
      the new pool, ``pool``'s shape.
    """
    if per_step.ndim < 2 or per_step.shape[1] < 1 or shape(per_step)[2:] != shape(pool)[1:]:
        fail(_OP, f"per_step.shape={shape(per_step)} must be [N, D, *pool.shape[1:]] with D >= 1 "
                  f"(pool.shape={shape(pool)})")  # fmt: skip
    if per_step.dtype != pool.dtype:
        fail(_OP, f"per_step.dtype={per_step.dtype} must equal pool.dtype={pool.dtype}")
    check_vector(_OP, "state_indices", state_indices, per_step.shape[0], jnp.int32)
    check_vector(_OP, "accepted_steps", accepted_steps, per_step.shape[0], jnp.int32)
    return commit(_OP, pool, per_step, state_indices, accepted_steps, impl)


def commit(
    op: str,
    pool: jax.Array,
    per_step: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    impl: str,
) -> jax.Array:
    """A commit's body once ``op``'s checks passed: ``commit_steps``, the only implementation
    (``impl="pallas"`` raises, saying why)."""
    resolve_impl(op, impl, _NO_KERNEL)
    return commit_steps(pool, per_step, state_indices, accepted_steps)
