"""Causal attention over the paged KV cache, for every token layout (plain jnp).

The step's new keys and values are first written into the pages of their rows (padded
tokens into the pad page 0); then every query token attends to positions ``0..p`` of its
own row, read back through the row's page table. The ragged layouts (EXTEND, MIXED,
DRAFT_EXTEND) attend in blocks of one row's consecutive tokens, which read the row's keys
once per block; DECODE and TARGET_VERIFY attend token by token (``token_rows`` and
``positions`` say each token's row and position); IDLE has no tokens. There is no Pallas
paged-attention kernel yet, so this op has no ``impl`` choice.

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
from hybrid_jax.modes import LayerKind, TokenLayout, check_supported

__all__ = ["paged_attention", "tree_ancestors", "write_pages"]

# Query tokens attended per vectorised batch: bounds the gathered keys to
# TOKEN_BLOCK x (max_pages * page_size) x KVH x head_dim while a kernel does not exist.
TOKEN_BLOCK = 64
# Ragged layouts attend in blocks of up to QUERY_BLOCK tokens of one row, which read the
# row's keys once per block rather than once per token; a block's float32 scores stay within
# SCORES_BYTES (a shorter block at long contexts).
QUERY_BLOCK = 2048
SCORES_BYTES = 2 << 30


def query_block(num_tokens: int, num_heads: int, num_positions: int) -> int:
    """Tokens per block of a ragged step: ``QUERY_BLOCK`` at most, a power of two whose
    float32 scores over ``num_positions`` keys stay within ``SCORES_BYTES``."""
    fits = SCORES_BYTES // (4 * num_heads * num_positions)
    return max(1, min(QUERY_BLOCK, num_tokens, 1 << max(0, fits.bit_length() - 1)))


def _row_blocks(meta: ForwardMetadata, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cuts every row's tokens into blocks of at most ``block``: per block its row, first
    token and length (0 for the blocks past the last; there are ``ceil(T / block) + bs``
    blocks, enough for any rows of a T-token bucket)."""
    num_blocks = -(-meta.num_tokens // block) + meta.batch_size
    per_row = -(-meta.seq_lens // block)
    ends = jnp.cumsum(per_row)
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, ids, side="right"), meta.batch_size - 1)
    j = ids - (ends[row] - per_row[row])  # the block's index within its row
    start = jnp.asarray(meta.query_start_loc)[row] + j * block
    length = jnp.where(ids < ends[-1], jnp.clip(meta.seq_lens[row] - j * block, 0, block), 0)
    return row.astype(jnp.int32), start.astype(jnp.int32), length.astype(jnp.int32)


def _ragged_rows(q, k_flat, v_flat, meta: ForwardMetadata, scale: float, acc) -> jax.Array:
    """Causal attention of a ragged layout, block by block of one row's tokens: ``[T, H,
    hd]`` (rows past the real tokens: anything)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    groups = num_heads // num_kv_heads
    size = meta.pages.page_size
    table = jnp.asarray(meta.pages.table)
    span = jnp.arange(table.shape[1] * size)
    block = query_block(num_tokens, num_heads, span.shape[0])
    rows, starts, lengths = _row_blocks(meta, block)
    # Room past the last token, so a block's slice never starts out of range.
    q_pad = jnp.concatenate([q, jnp.zeros((block, *q.shape[1:]), q.dtype)])
    pos_pad = jnp.concatenate([jnp.asarray(meta.positions), jnp.zeros(block, jnp.int32)])

    def attend(args):
        row, start, length = args
        q_b = jax.lax.dynamic_slice_in_dim(q_pad, start, block)  # [Q, H, hd]
        pos = jax.lax.dynamic_slice_in_dim(pos_pad, start, block)
        index = (table[row][:, None] * size + jnp.arange(size)).reshape(-1)
        seen = span[None, :] <= pos[:, None]  # [Q, L]: causal within the row
        # Unwritten or stale entries may hold anything (even NaN): keys and values past
        # what the block's last token sees are zeroed, and scores are masked per token.
        last = span <= pos[jnp.maximum(length - 1, 0)]
        keys = jnp.where(last[:, None, None], k_flat[index], 0)
        values = jnp.where(last[:, None, None], v_flat[index], 0)
        # The products run in the cache's dtype (tensor cores for bf16), accumulating in acc.
        q_g = q_b.reshape(block, num_kv_heads, groups, head_dim).astype(keys.dtype)
        scores = jnp.einsum("qkgd,lkd->kgql", q_g, keys, preferred_element_type=acc) * scale
        scores = jnp.where(seen[None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
        out = jnp.einsum("kgql,lkd->qkgd", probs, values, preferred_element_type=acc)
        return out.reshape(block, num_heads, head_dim)

    outs = jax.lax.map(attend, (rows, starts, lengths))  # [blocks, Q, H, hd]
    # Each real token lies in exactly one block; the rest of a block is dropped.
    offsets = jnp.arange(block, dtype=jnp.int32)
    inside = offsets[None] < lengths[:, None]
    target = jnp.where(inside, starts[:, None] + offsets[None], num_tokens)
    out = jnp.zeros((num_tokens, num_heads, head_dim), acc)
    return out.at[target.reshape(-1)].set(outs.reshape(-1, num_heads, head_dim), mode="drop")


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

    if meta.token_layout is TokenLayout.RAGGED:
        out = _ragged_rows(q, k_flat, v_flat, meta, scale, acc)
    else:
        tree_args = None if tree is None else (tree.prefix, tree.path)
        out = jax.lax.map(
            attend, (q, token_pages, meta.positions, tree_args), batch_size=TOKEN_BLOCK
        )
    real = (meta.token_rows < meta.batch_size)[:, None, None]
    return jnp.where(real, out, 0).astype(q.dtype), k_pages, v_pages
