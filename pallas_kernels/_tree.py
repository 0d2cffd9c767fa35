"""Tree drafts in the verify ops, shared by the references of every op.

A verify row of D tokens may be a tree: ``parents`` int32 ``[N, D]`` gives each node's
parent, ``-1`` for node 0 (the root) and ``0 <= parents[n, i] < i`` for the others (the
nodes are in topological order). A node starts from its parent's state (the root from the
pool slot), so ``intermediates[n, i]`` is the state after the path root..i. ``parents=None``
is the chain ``[-1, 0, 1, ..., D-2]``, the plain verify.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_parents", "start_of_node"]


def check_parents(op: str, parents: jax.Array | None, n_rows: int, n_steps: int) -> None:
    """``parents`` is None or int32 ``[N, D]`` (static facts only: values are the metadata
    builder's job)."""
    if parents is None:
        return
    if tuple(parents.shape) != (n_rows, n_steps):
        raise ValueError(
            f"{op}: parents.shape={tuple(parents.shape)} must be [N, D]=({n_rows}, {n_steps}), "
            f"one parent per verified token (-1 at the root)"
        )
    if parents.dtype != jnp.int32:
        raise ValueError(f"{op}: parents.dtype={parents.dtype} must be int32")


def start_of_node(history: list[jax.Array], parents: jax.Array | None, node: int) -> jax.Array:
    """The state node ``node`` starts from, per row.

    history: ``[root, after node 0, ..., after node node-1]``, each ``[N, ...]``. Chain
    (``parents`` None): the last entry. Tree: entry ``parents[n, node] + 1`` of row n (a
    gather, so values are copied exactly).
    """
    if parents is None:
        return history[-1]
    stacked = jnp.stack(history, axis=1)
    rows = jnp.arange(stacked.shape[0])
    return stacked[rows, jnp.clip(parents[:, node] + 1, 0, node)]
