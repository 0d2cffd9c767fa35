"""The commits after a speculative verify: each linear layer keeps the state and conv window
after its last accepted token, each through its own kind's op; a tree verify also moves the
accepted path's keys and values (``kv_cache.commit_tree_kv``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import MappingProxyType

import jax
import jax.numpy as jnp

from hybrid_jax.backend.linear import VerifyStack
from hybrid_jax.kv_cache import KVCache, commit_tree_kv
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind
from hybrid_jax.state_pool import StatePool
from pallas_kernels import conv1d, gdn, mamba2

__all__ = ["STATE_COMMITS", "commit_tree_verified", "commit_verified", "linear_kind"]

STATE_COMMITS: MappingProxyType[LayerKind, Callable[..., jax.Array]] = MappingProxyType(
    {LayerKind.GDN: gdn.commit_states, LayerKind.MAMBA2: mamba2.commit_states}
)
"""The op that commits a linear layer kind's ssm state; a new linear kind adds its row."""


def linear_kind(layer_kinds: Sequence[LayerKind]) -> LayerKind | None:
    """The kind of the layers that own a pool entry (None when there are none); a model's
    linear layers share one pool array, so they are all of one kind."""
    kinds = {kind for kind in layer_kinds if kind is not LayerKind.FULL_ATTENTION}
    if len(kinds) > 1:
        raise ValueError(
            f"linear layers of kinds {sorted(k.name for k in kinds)}: the slot pool holds one "
            f"linear kind per model"
        )
    return kinds.pop() if kinds else None


def commit_verified(
    pool: StatePool,
    verify: tuple[VerifyStack, ...],
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    kind: LayerKind | None,
) -> StatePool:
    """Writes, for every linear layer, the conv window and state after draft token
    ``accepted_steps[n]`` (0-based) into slot ``state_indices[n]``; rows with a negative
    ``accepted_steps`` keep their slot as it was. ``kind``: the linear layers' kind
    (``linear_kind(model.layer_kinds)``). One commit per stack covers all its layers: the
    rows of layer l are ``l * S + state_indices`` of the flat pool."""
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
        conv = conv1d.commit_windows(conv, windows, rows, steps)
        ssm = STATE_COMMITS[kind](ssm, stack.ssm.reshape(-1, *stack.ssm.shape[2:]), rows, steps)
    return dataclasses.replace(
        pool, conv=conv.reshape(pool.conv.shape), ssm=ssm.reshape(pool.ssm.shape)
    )


def commit_tree_verified(
    pool: StatePool,
    kv: KVCache,
    verify: tuple[VerifyStack, ...],
    meta: ForwardMetadata,
    accepted_nodes: jax.Array,
    *,
    kind: LayerKind | None,
) -> tuple[StatePool, KVCache]:
    """The commit of a tree verify step (``meta.tree``): every linear layer keeps the state
    and window after node ``accepted_nodes[n]`` (which already folded its root path in), and
    the full-attention cache moves that path's entries to contiguous positions
    (``kv_cache.commit_tree_kv``). Rows with a negative ``accepted_nodes`` keep both."""
    pool = commit_verified(pool, verify, meta.state_indices, accepted_nodes, kind=kind)
    prefix = meta.context_lens - meta.seq_lens
    kv = commit_tree_kv(kv, meta.pages.table, prefix, meta.parents, accepted_nodes)
    return pool, kv
