"""The commits after a speculative verify: each linear layer keeps the state and conv window
after its last accepted token (``pallas_kernels.commit_states``, the one commit for any pool);
a tree verify also moves the accepted path's keys and values (``kv_cache.commit_tree_kv``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hybrid_jax.backend.linear import VerifyStack
from hybrid_jax.kv_cache import KVCache, commit_tree_kv
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.state_pool import StatePool
from pallas_kernels import commit_states

__all__ = ["commit_tree_verified", "commit_verified"]


def commit_verified(
    pool: StatePool,
    verify: tuple[VerifyStack, ...],
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> StatePool:
    """Writes, for every linear layer, the conv window and state after draft token
    ``accepted_steps[n]`` (0-based) into slot ``state_indices[n]``; rows with a negative
    ``accepted_steps`` keep their slot as it was. One commit per stack covers all its layers:
    the rows of layer l are ``l * S + state_indices`` of the flat pool."""
    covered = sorted(layer for stack in verify for layer in stack.layers)
    if covered != list(range(pool.num_layers)):
        raise ValueError(
            f"the verify states cover linear layers {covered} of a pool of {pool.num_layers}; "
            f"pass the verify states of the step that ran on this pool"
        )
    conv = pool.conv.reshape(-1, *pool.conv.shape[2:])
    ssm = pool.ssm.reshape(-1, *pool.ssm.shape[2:])
    for stack in verify:
        layers = jnp.asarray(stack.layers, jnp.int32)[:, None]
        rows = (layers * pool.num_slots + state_indices[None, :]).reshape(-1)
        steps = jnp.tile(accepted_steps, len(stack.layers))
        windows = stack.windows.reshape(-1, *stack.windows.shape[2:])
        conv = commit_states(conv, windows, rows, steps)
        ssm = commit_states(ssm, stack.ssm.reshape(-1, *stack.ssm.shape[2:]), rows, steps)
    return dataclasses.replace(
        pool, conv=conv.reshape(pool.conv.shape), ssm=ssm.reshape(pool.ssm.shape)
    )


def commit_tree_verified(
    pool: StatePool,
    kv: KVCache,
    verify: tuple[VerifyStack, ...],
    meta: ForwardMetadata,
    accepted_nodes: jax.Array,
) -> tuple[StatePool, KVCache]:
    """The commit of a tree verify step (``meta.tree``): every linear layer keeps the state
    and window after node ``accepted_nodes[n]`` (which already folded its root path in), and
    the full-attention cache moves that path's entries to contiguous positions
    (``kv_cache.commit_tree_kv``). Rows with a negative ``accepted_nodes`` keep both."""
    pool = commit_verified(pool, verify, meta.state_indices, accepted_nodes)
    prefix = meta.context_lens - meta.seq_lens
    kv = commit_tree_kv(kv, meta.pages.table, prefix, meta.parents, accepted_nodes)
    return pool, kv
