"""The commits after a speculative verify: each linear layer keeps the state and conv window
after its last accepted token, each through its own kind's op; a tree verify also moves the
accepted path's keys and values (``kv_cache.commit_tree_kv``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from types import MappingProxyType

import jax

from hybrid_jax.backend.linear import VerifyStates
from hybrid_jax.kv_cache import KVCache, commit_tree_kv
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind
from hybrid_jax.state_pool import StatePool
from pallas_kernels import conv1d, gdn, mamba2

__all__ = ["STATE_COMMITS", "commit_tree_verified", "commit_verified", "linear_kinds"]

STATE_COMMITS: MappingProxyType[LayerKind, Callable[..., jax.Array]] = MappingProxyType(
    {LayerKind.GDN: gdn.commit_states, LayerKind.MAMBA2: mamba2.commit_states}
)
"""The op that commits a linear layer kind's ssm state; a new linear kind adds its row."""


def linear_kinds(layer_kinds: Sequence[LayerKind]) -> tuple[LayerKind, ...]:
    """The kinds of the layers that own a pool entry, in pool order."""
    return tuple(kind for kind in layer_kinds if kind is not LayerKind.FULL_ATTENTION)


def commit_verified(
    pool: StatePool,
    verify: tuple[VerifyStates, ...],
    state_indices: jax.Array,
    accepted_steps: jax.Array,
    *,
    kinds: tuple[LayerKind, ...],
) -> StatePool:
    """Writes, for every linear layer, the conv window and state after draft token
    ``accepted_steps[n]`` (0-based) into slot ``state_indices[n]``; rows with a negative
    ``accepted_steps`` keep their slot as it was. ``kinds``: each pool entry's layer kind
    (``linear_kinds(model.layer_kinds)``)."""
    if not len(verify) == len(pool.ssm) == len(kinds):
        raise ValueError(
            f"{len(verify)} verify states and {len(kinds)} linear layer kinds for a pool of "
            f"{len(pool.ssm)} layers"
        )
    conv = tuple(
        conv1d.commit_windows(c, v.windows, state_indices, accepted_steps)
        for c, v in zip(pool.conv, verify, strict=True)
    )
    ssm = tuple(
        STATE_COMMITS[kind](s, v.ssm, state_indices, accepted_steps)
        for s, v, kind in zip(pool.ssm, verify, kinds, strict=True)
    )
    return dataclasses.replace(pool, conv=conv, ssm=ssm)


def commit_tree_verified(
    pool: StatePool,
    kv: KVCache,
    verify: tuple[VerifyStates, ...],
    meta: ForwardMetadata,
    accepted_nodes: jax.Array,
    *,
    kinds: tuple[LayerKind, ...],
) -> tuple[StatePool, KVCache]:
    """The commit of a tree verify step (``meta.tree``): every linear layer keeps the state
    and window after node ``accepted_nodes[n]`` (which already folded its root path in), and
    the full-attention cache moves that path's entries to contiguous positions
    (``kv_cache.commit_tree_kv``). Rows with a negative ``accepted_nodes`` keep both."""
    pool = commit_verified(pool, verify, meta.state_indices, accepted_nodes, kinds=kinds)
    prefix = meta.context_lens - meta.seq_lens
    kv = commit_tree_kv(kv, meta.pages.table, prefix, meta.parents, accepted_nodes)
    return pool, kv
