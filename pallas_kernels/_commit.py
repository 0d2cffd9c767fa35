"""Slot writes shared by the ops' references: masked scatters into a pool and the commit that
ends speculative verification. Shape-agnostic: a pool is ``[S, ...]``, per-row values are
``[N, ...]`` and per-token values ``[N, D, ...]`` with the same trailing dims."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["commit_steps", "write_where"]


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
    ``idx[n] != 0`` (the pad slot is never written)."""
    pool, per_step, state_indices, accepted_steps = (
        jnp.asarray(x) for x in (pool, per_step, state_indices, accepted_steps)
    )
    n_rows, n_steps = per_step.shape[:2]
    step = jnp.clip(accepted_steps, 0, n_steps - 1)
    chosen = per_step[jnp.arange(n_rows), step]
    keep = (accepted_steps >= 0) & (state_indices != 0)
    return write_where(pool, state_indices, chosen, keep)
