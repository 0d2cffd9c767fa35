"""A few tokens' routing by ranking: each token's ``k`` experts of largest router logit
(``ranked_top_k``) and the softmax over them (``top_k_softmax``). In XLA a few tokens' ranking
is two reductions over ``[T, n, n]`` and ``[T, k, n]`` comparisons (every entry's rank, then
each choice's entry), where ``lax.top_k`` on the GPU is a sort of its own per call.

Order: the largest logit first; equal logits by the lower index (``jax.lax.top_k``'s order).
The weights are ``softmax`` over the chosen logits, ``exp(l_j - l_0) / sum_i exp(l_i -
l_0)`` with the sum taken in choice order. A token whose ``valid`` is False gets expert ``n``
(out of range: no expert) for every choice, its weights as the logits give them.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

__all__ = ["ranked_top_k", "softmax_of_exps", "top_k_exps", "top_k_softmax"]


def _ranking(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the indices ``[n]``; ``before`` ``[T, n, n]``: whether entry j comes before entry i,
    larger or equal at a lower index; ``chosen`` ``[T, k, n]``: whether an entry's rank, its
    place in that order, is the choice's) of ``x`` ``[T, n]``."""
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    mine, other = x[..., :, None], x[..., None, :]
    before = (other > mine) | ((other == mine) & (index[None, :] < index[:, None]))
    rank = before.sum(axis=-1, dtype=jnp.int32)  # [T, n]
    return index, before, rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]


def _chosen_indices(chosen: jax.Array, index: jax.Array, valid: jax.Array | None) -> jax.Array:
    """The index of each row's chosen entry per choice (``chosen`` ``[T, k, n]``, one entry
    each), or ``n`` in rows where ``valid`` is False."""
    # An invalid row's index inside the sum (one entry is chosen per choice), not after
    # it: XLA then needs no kernel of its own for the mask.
    ids = index if valid is None else jnp.where(valid[:, None, None], index, index.shape[0])
    return jnp.where(chosen, ids, 0).sum(axis=-1, dtype=jnp.int32)


def ranked_top_k(
    x: jax.Array, k: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` along the last axis of ``x`` ``[T, n]`` (int32 indices; rows
    where ``valid`` is False get index ``n``) by counting, for every entry, the entries that
    come before it and picking those of ranks ``0..k-1``: an ``[T, n, n]`` comparison that XLA
    fuses into a reduction, where ``lax.top_k`` on the GPU is a sort of its own per call."""
    index, _, chosen = _ranking(x, k)
    values = jnp.where(chosen, x[..., None, :], 0).sum(axis=-1)
    return values.astype(x.dtype), _chosen_indices(chosen, index, valid)


def top_k_exps(x: jax.Array, k: int, valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(each row's ``k`` largest entries as ``exp(value - max)``, float32 ``[T, k]``; their
    int32 indices ``[T, k]``) of float32 ``x`` ``[T, n]``, largest first, ranked as
    ``ranked_top_k`` ranks (rows where ``valid`` is False get index ``n``): the softmax over
    them is each divided by their sum (``top_k_softmax``), left to whoever reads them.

    Two reductions, each over the ``[T, n, n]`` or ``[T, k, n]`` comparisons the ranking
    makes anyway: every entry's rank beside the largest of its own value and those ranked
    before it (the row's max, whatever the entry), then each choice's index beside its
    ``exp(value - max)``."""
    index, before, chosen = _ranking(x, k)
    at_or_before = before | (index[None, :] == index[:, None])
    top = jnp.where(at_or_before, x[..., None, :], -jnp.inf).max(axis=-1)  # the row's max
    exps = jnp.exp(x - top)  # at most 1: the largest entry's is 1
    picked = jnp.where(chosen, exps[..., None, :], 0).sum(axis=-1)  # [T, k]
    return picked, _chosen_indices(chosen, index, valid)


def top_k_softmax(
    x: jax.Array, k: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(the softmax over each row's ``k`` largest entries, float32 ``[T, k]``; their int32
    indices ``[T, k]``) of float32 ``x`` ``[T, n]``, largest first, ranked as ``ranked_top_k``
    ranks (rows where ``valid`` is False get index ``n``): ``top_k_exps`` divided by their
    sum, written as adds, which XLA may fuse into the weights' reader."""
    picked, ids = top_k_exps(x, k, valid)
    return softmax_of_exps(picked), ids


def softmax_of_exps(exps: jax.Array) -> jax.Array:
    """Each row of ``exps`` ``[T, k]`` (a softmax's exponentials, ``top_k_exps``) divided by
    its sum, the sum taken in column order as adds."""
    total = functools.reduce(operator.add, (exps[:, j] for j in range(exps.shape[1])))
    return exps / total[:, None]
