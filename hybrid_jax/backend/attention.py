"""Causal attention over the paged KV cache, one path for every token layout (plain jnp).

The step's new keys and values are first written into the pages of their rows (padded
tokens into the pad page 0); then every query token attends to positions ``0..p`` of its
own row, read back through the row's page table. Because a token's row and position are in
``ForwardMetadata`` for every layout (``token_rows``, ``positions``), ragged EXTEND / MIXED /
DRAFT_EXTEND, DECODE and TARGET_VERIFY share this one function; IDLE has no tokens. There
is no Pallas paged-attention kernel yet, so this op has no ``impl`` choice.

TARGET_VERIFY writes the D draft tokens' keys and values into the row's pages like any other
step. Nothing needs undoing when drafts are rejected: their entries sit at positions past
the accepted context, no later query reads a position it has not written first (a step
writes before it attends, and the next step starts where the accepted context ends), so the
next steps overwrite them. Pages that only the rejected drafts used may simply be freed.

Tree drafts (``meta.tree``): node i of a row is stored at ``prefix_len + i`` (its index in the
row, since nodes of one depth share a position), takes its rotary position from
``meta.positions`` (``prefix_len + depth``), and attends to the row's committed context
(positions below ``prefix_len``) plus the nodes on its own root path, itself included (the
tree mask). A chain's tree mask is the causal mask. After acceptance the accepted path's
entries move to ``prefix_len .. prefix_len + depth`` (``kv_cache.commit_tree_kv``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind, check_supported

__all__ = ["paged_attention", "tree_ancestors", "write_pages"]

# Query tokens attended per vectorised batch: bounds the gathered keys to
# TOKEN_BLOCK x (max_pages * page_size) x KVH x head_dim while a kernel does not exist.
TOKEN_BLOCK = 64


def _token_pages(meta: ForwardMetadata) -> jax.Array:
    """``[T, max_pages]`` page table of each token's row; all zeros (pad page) at padding."""
    table = meta.pages.table
    table = jnp.concatenate([table, jnp.zeros((1, table.shape[1]), table.dtype)])
    return table[meta.token_rows]


def write_pages(
    pages: jax.Array,
    new: jax.Array,
    meta: ForwardMetadata,
    token_pages: jax.Array,
    positions: jax.Array | None = None,
) -> jax.Array:
    """pages ``[P, page_size, KVH, hd]`` with ``new`` ``[T, KVH, hd]`` written at each token's
    (page, offset) of its storage position (``positions`` ``[T]``, default
    ``meta.positions``); padded tokens land in the pad page."""
    size = meta.pages.page_size
    positions = meta.positions if positions is None else positions
    page = jnp.take_along_axis(token_pages, (positions // size)[:, None], axis=1)[:, 0]
    flat = pages.reshape(-1, *pages.shape[2:])
    flat = flat.at[page * size + positions % size].set(new.astype(pages.dtype))
    return flat.reshape(pages.shape)


def tree_ancestors(parents: jax.Array) -> jax.Array:
    """parents int32 ``[bs, D]`` (topological, ``-1`` at the root) -> bool ``[bs, D, D]``:
    ``[r, i, j]`` is True when node j lies on node i's root path (i itself included)."""
    n_rows, n_nodes = parents.shape
    rows = jnp.arange(n_rows)
    eye = jnp.eye(n_nodes, dtype=bool)
    paths = [jnp.broadcast_to(eye[0], (n_rows, n_nodes))]
    for i in range(1, n_nodes):
        parent = jnp.clip(parents[:, i], 0, i - 1)
        paths.append(jnp.stack(paths, axis=1)[rows, parent] | eye[i])
    return jnp.stack(paths, axis=1)


class _TreeTokens(NamedTuple):
    """Per token of a tree step: storage position, row prefix, root-path mask ``[T, D]``."""

    store: jax.Array
    prefix: jax.Array
    path: jax.Array


def _tree_tokens(meta: ForwardMetadata) -> _TreeTokens:
    n_nodes = meta.num_draft_tokens
    real = meta.token_rows < meta.batch_size
    prefix = jnp.concatenate([meta.context_lens - meta.seq_lens, jnp.zeros(1, jnp.int32)])
    prefix = prefix[meta.token_rows]
    node = jnp.arange(meta.num_tokens, dtype=jnp.int32) % n_nodes
    store = jnp.where(real, prefix + node, 0)
    ancestors = tree_ancestors(meta.parents)
    # Padded tokens see position 0 of the pad page, which they have just written, as in a
    # chain step: no softmax row is empty (NaN).
    pad = jnp.zeros((1, n_nodes, n_nodes), bool).at[:, :, 0].set(True)
    ancestors = jnp.concatenate([ancestors, pad])
    return _TreeTokens(store, prefix, ancestors[meta.token_rows, node])


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: ForwardMetadata,
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes this step's keys and values, then causal grouped-query attention per row.

    q: ``[T, H, hd]``; k, v: ``[T, KVH, hd]`` with ``H % KVH == 0`` (query head h reads key
    head ``h // (H // KVH)``); k_pages, v_pages: ``[P, page_size, KVH, hd]``. Returns
    ``(out [T, H, hd], k_pages, v_pages)``; out is zero at padded tokens. Scores and softmax
    are float32 (q's dtype when wider). Raises ``UnsupportedForwardModeError`` while tracing
    for a mode that full attention has no path for, and ``ValueError`` when the metadata
    carries no page table.
    """
    check_supported(LayerKind.FULL_ATTENTION, meta.mode)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if meta.pages.max_pages == 0 and num_tokens:
        raise ValueError(
            "the metadata has no page table (BucketPolicy.max_context=0) but the model has "
            "full-attention layers; build the policy with max_context > 0"
        )
    if meta.pages.page_size != k_pages.shape[1]:
        raise ValueError(
            f"the metadata pages {meta.pages.page_size} tokens per page but the KV cache "
            f"{k_pages.shape[1]}; build BucketPolicy and KV cache with one page_size"
        )
    if num_tokens == 0:
        return jnp.zeros_like(q), k_pages, v_pages
    token_pages = _token_pages(meta)
    tree = _tree_tokens(meta) if meta.tree else None
    store = None if tree is None else tree.store
    k_pages = write_pages(k_pages, k, meta, token_pages, store)
    v_pages = write_pages(v_pages, v, meta, token_pages, store)

    size = meta.pages.page_size
    groups = num_heads // num_kv_heads
    span = jnp.arange(token_pages.shape[1] * size)
    k_flat = k_pages.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(-1, num_kv_heads, head_dim)
    acc = jnp.promote_types(q.dtype, jnp.float32)  # float32 at least; float64 oracles stay so

    def visible(pos_t, tree_t):
        """Which of the row's storage positions the token sees: causal, or the tree mask."""
        if tree_t is None:
            return span <= pos_t
        prefix_t, path_t = tree_t  # [], [D]
        node = span - prefix_t
        on_path = path_t[jnp.clip(node, 0, path_t.shape[0] - 1)]
        return (node < 0) | ((node < path_t.shape[0]) & on_path)

    def attend(args):
        q_t, pages_t, pos_t, tree_t = args  # [H, hd], [max_pages], [], tree or None
        index = (pages_t[:, None] * size + jnp.arange(size)).reshape(-1)
        seen = visible(pos_t, tree_t)
        # Unwritten or stale entries may hold anything (even NaN): mask values as well as
        # scores, since 0 * NaN would still poison the sum.
        keys = jnp.where(seen[:, None, None], k_flat[index], 0).astype(acc)
        values = jnp.where(seen[:, None, None], v_flat[index], 0).astype(acc)
        q_g = q_t.reshape(num_kv_heads, groups, head_dim).astype(acc)
        scores = jnp.einsum("kgd,lkd->kgl", q_g, keys) * scale
        scores = jnp.where(seen, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("kgl,lkd->kgd", probs, values).reshape(num_heads, head_dim)

    tree_args = None if tree is None else (tree.prefix, tree.path)
    out = jax.lax.map(attend, (q, token_pages, meta.positions, tree_args), batch_size=TOKEN_BLOCK)
    real = (meta.token_rows < meta.batch_size)[:, None, None]
    return jnp.where(real, out, 0).astype(q.dtype), k_pages, v_pages
