"""Causal attention over the paged KV cache, for every token layout.

The step's new keys and values are first written into the pages of their rows (padded
tokens into the pad page 0); then every query token attends to positions ``0..p`` of its
own row, read back through the row's page table. Every layout attends in blocks of one row's
consecutive tokens (a DECODE row is one token, a TARGET_VERIFY chain its D tokens), over the
row's keys in chunks with an online softmax (flash attention's recurrence, in jnp), up to the
row's own length: the cost follows the served context, not ``max_context``. Tree drafts
attend token by token through the whole page table (their mask is not causal); IDLE has no
tokens.

``impl`` (``"auto" | "pallas" | "interpret" | "reference"``) chooses how a ragged step runs:
with the segment kernel (``pallas_kernels.attention``: tokamax's Mosaic GPU flash attention
on an sm_90 GPU), the new tokens attend among themselves in the kernel and to their row's
cached prefix in the paged prefix kernel (``paged_prefix_attention``, jnp key chunks where
it cannot take the step), and the two parts merge by their log-sum-exps; ``interpret`` takes
the same split with the segment op's jnp reference and the prefix kernel's interpreter run;
``reference`` (and ``auto`` off the GPU) reads every key from the pages in jnp, as do
batch-invariant steps (``meta.batch_invariant``).
DECODE and TARGET_VERIFY steps (chains and trees) run the paged decode kernel
(``pallas_kernels.attention.paged_decode_attention``) under ``auto`` on the GPU, ``pallas``
and ``interpret`` where it takes their shapes, and jnp otherwise.

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
from pallas_kernels import attention as attention_kernels
from pallas_kernels import resolve_impl
from pallas_kernels.attention import paged_decode
from pallas_kernels.attention import rows as attention_rows

__all__ = [
    "MERGE_IN_LAUNCH",
    "ROWS_IN_KERNEL",
    "decode_rows",
    "paged_attention",
    "tree_ancestors",
    "write_pages",
]

ROWS_IN_KERNEL = True
"""Whether a DECODE step forms its attention rows in one launch (``decode_rows``: the q/k
norms, the rotary and both page writes) where the kernel takes the step, instead of XLA's
fusions, scatters and copies of the norm weights (nine kernels a layer on the H200, ~13 us
against the launch's ~4: ``benchmarks/RESULTS_serve.md``)."""

MERGE_IN_LAUNCH = False
"""Whether a DECODE step's paged decode kernel merges its splits and applies the output gate
itself (``paged_decode_attention(merge_in_launch=True)``) where it can, instead of one XLA
fusion after the launch. Off: at batch 1 the last program's merge adds ~2.2 us to the launch,
where XLA's fusion takes ~1.3 us (``benchmarks/RESULTS_serve.md``)."""

# Tree-draft tokens attended per vectorised batch: bounds their gathered keys to
# TOKEN_BLOCK x (max_pages * page_size) x KVH x head_dim.
TOKEN_BLOCK = 64
# Ragged layouts attend in blocks of up to QUERY_BLOCK tokens of one row, each block over
# its row's keys in chunks of KEY_CHUNK positions with an online softmax: the scores of one
# (block, chunk) pair are all that is ever materialised, and a block reads only the chunks
# up to its last token's position, so the cost follows the row's length, not max_context.
QUERY_BLOCK = 1024
KEY_CHUNK = 1024


def key_chunk(page_size: int) -> int:
    """Positions per key chunk: ``KEY_CHUNK`` rounded down to whole pages, one page at least
    (a chunk is a run of the row's page table)."""
    return page_size * max(1, KEY_CHUNK // page_size)


def _row_blocks(meta: ForwardMetadata, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Cuts every row's tokens into blocks of at most ``block``: per block its row, first
    token and length (0 for the blocks past the last; there are ``ceil(T / block) + bs``
    blocks, enough for any rows of a T-token bucket). Layouts with a fixed number of tokens
    per row (DECODE, TARGET_VERIFY) whose rows fit a block take one block per row."""
    rows_fit = meta.token_layout is not TokenLayout.RAGGED and meta.num_tokens <= (
        block * meta.batch_size
    )
    if rows_fit:
        row = jnp.arange(meta.batch_size, dtype=jnp.int32)
        start = jnp.asarray(meta.query_start_loc)[:-1].astype(jnp.int32)
        return row, start, jnp.asarray(meta.seq_lens).astype(jnp.int32)
    num_blocks = -(-meta.num_tokens // block) + meta.batch_size
    per_row = -(-jnp.asarray(meta.seq_lens) // block)
    ends = jnp.cumsum(per_row)
    ids = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, ids, side="right"), meta.batch_size - 1)
    j = ids - (ends[row] - per_row[row])  # the block's index within its row
    start = jnp.asarray(meta.query_start_loc)[row] + j * block
    length = jnp.where(ids < ends[-1], jnp.clip(meta.seq_lens[row] - j * block, 0, block), 0)
    return row.astype(jnp.int32), start.astype(jnp.int32), length.astype(jnp.int32)


def _ragged_block(num_tokens: int, batch_size: int) -> int:
    """Tokens per query block: ``QUERY_BLOCK`` at most, and no longer than a power of two
    that holds an average row (many short rows would otherwise fill mostly empty blocks)."""
    average = -(-num_tokens // batch_size)
    return max(1, min(QUERY_BLOCK, num_tokens, 1 << (average - 1).bit_length()))


def _ragged_rows(
    q, k_flat, v_flat, meta: ForwardMetadata, scale: float, acc, *, prefix_only: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of a ragged layout, block by block of one row's tokens, each block
    over key chunks with an online softmax: ``(out [T, H, hd], lse [T, H])`` (rows past the
    real tokens: anything). ``prefix_only``: each row's tokens see only its cached prefix
    (positions below ``context_lens - seq_lens``); a token that sees nothing gets out 0 and
    lse ``-inf``."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    groups = num_heads // num_kv_heads
    size = meta.pages.page_size
    table = jnp.asarray(meta.pages.table)
    # A chunk is never longer than a row's whole page table.
    chunk_pages = min(key_chunk(size) // size, table.shape[1])
    chunk = chunk_pages * size
    # Whole chunks of page table per row, so a chunk's slice never starts out of range.
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % chunk_pages)))
    max_chunks = table.shape[1] // chunk_pages
    prefix = jnp.asarray(meta.context_lens) - jnp.asarray(meta.seq_lens)
    block = _ragged_block(num_tokens, meta.batch_size)
    rows, starts, lengths = _row_blocks(meta, block)
    # Room past the last token, so a block's slice never starts out of range.
    q_pad = jnp.concatenate([q, jnp.zeros((block, *q.shape[1:]), q.dtype)])
    pos_pad = jnp.concatenate([jnp.asarray(meta.positions), jnp.zeros(block, jnp.int32)])
    offsets = jnp.arange(block, dtype=jnp.int32)

    def attend(args):
        row, start, length = args
        q_b = jax.lax.dynamic_slice_in_dim(q_pad, start, block)  # [Q, H, hd]
        last = jax.lax.dynamic_slice_in_dim(pos_pad, start + jnp.maximum(length - 1, 0), 1)[0]
        # The block's tokens are consecutive positions of one row; the rows past its length
        # take the last token's position, so every row sees position 0 and stays finite.
        pos = last - jnp.maximum(length - 1 - offsets, 0)
        if prefix_only:
            last = prefix[row] - 1  # -1: no prefix, no chunk
            pos = jnp.minimum(pos, last)
        q_g = q_b.reshape(block, num_kv_heads, groups, head_dim).astype(k_flat.dtype)
        table_row = table[row]

        def step(c, carry):
            peak, total, out = carry
            pages = jax.lax.dynamic_slice_in_dim(table_row, c * chunk_pages, chunk_pages)
            index = (pages[:, None] * size + jnp.arange(size)).reshape(-1)
            key_pos = c * chunk + jnp.arange(chunk)
            # Unwritten or stale entries may hold anything (even NaN): keys and values past
            # the block's last position are zeroed, and scores are masked per token.
            live = (key_pos <= last)[:, None, None]
            keys = jnp.where(live, k_flat[index], 0)
            values = jnp.where(live, v_flat[index], 0)
            # Products in the cache's dtype (tensor cores for bf16), accumulating in acc.
            scores = jnp.einsum("qkgd,lkd->kgql", q_g, keys, preferred_element_type=acc)
            seen = key_pos[None, :] <= pos[:, None]  # [Q, C]
            scores = jnp.where(seen, scores * scale, -jnp.inf)
            # A row that has seen nothing yet keeps peak -inf; 0 stands in for it, so that
            # exp gives 0 rather than exp(-inf + inf) = NaN.
            new_peak = jnp.maximum(peak, scores.max(-1))
            shift = jnp.where(jnp.isfinite(new_peak), new_peak, 0)
            probs = jnp.exp(scores - shift[..., None])
            decay = jnp.exp(peak - shift)
            total = total * decay + probs.sum(-1)
            out = out * decay[..., None] + jnp.einsum(
                "kgql,lkd->kgqd", probs.astype(values.dtype), values, preferred_element_type=acc
            )
            return new_peak, total, out

        stats = (num_kv_heads, groups, block)
        init = (
            jnp.full(stats, -jnp.inf, acc),
            jnp.zeros(stats, acc),
            jnp.zeros((*stats, head_dim), acc),
        )
        if max_chunks == 1:
            # One chunk covers every row: no loop (a block that sees nothing keeps total 0).
            peak, total, out = step(0, init)
        else:
            num_chunks = jnp.where(length > 0, last // chunk + 1, 0)
            peak, total, out = jax.lax.fori_loop(0, num_chunks, step, init)
        seen_any = total > 0
        out = out / jnp.where(seen_any, total, 1)[..., None]
        lse = jnp.where(seen_any, peak + jnp.log(jnp.where(seen_any, total, 1)), -jnp.inf)
        return (
            out.transpose(2, 0, 1, 3).reshape(block, num_heads, head_dim),
            lse.transpose(2, 0, 1).reshape(block, num_heads),
        )

    # Short blocks run side by side, up to QUERY_BLOCK tokens at a time (each sequential
    # iteration costs a loop trip on the device).
    together = max(1, QUERY_BLOCK // block)
    outs, lses = jax.lax.map(attend, (rows, starts, lengths), batch_size=together)
    # Each real token lies in exactly one block; the rest of a block is dropped.
    inside = offsets[None] < lengths[:, None]
    target = jnp.where(inside, starts[:, None] + offsets[None], num_tokens).reshape(-1)
    out = jnp.zeros((num_tokens, num_heads, head_dim), acc)
    out = out.at[target].set(outs.reshape(-1, num_heads, head_dim), mode="drop")
    lse = jnp.full((num_tokens, num_heads), -jnp.inf, acc)
    return out, lse.at[target].set(lses.reshape(-1, num_heads), mode="drop")


def _segment_starts(meta: ForwardMetadata) -> jax.Array:
    """int32 ``[T]``: the first token of each token's row in the packed layout (a padded
    token is its own segment)."""
    qsl = jnp.asarray(meta.query_start_loc)
    rows = jnp.asarray(meta.token_rows)
    tokens = jnp.arange(meta.num_tokens, dtype=jnp.int32)
    return jnp.where(rows < meta.batch_size, qsl[jnp.minimum(rows, meta.batch_size - 1)], tokens)


def _merge(parts: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
    """Softmax attention over the union of disjoint key sets, from each set's ``(out [T, H,
    hd], lse [T, H])``; a set a token did not see has lse ``-inf`` and weighs nothing."""
    peak = jnp.maximum(*(lse for _, lse in parts))
    weights = [jnp.exp(lse - peak) for _, lse in parts]
    total = sum(weights)
    return (
        sum(w[..., None] * out.astype(w.dtype) for w, (out, _) in zip(weights, parts, strict=True))
        / total[..., None]
    )


def _ragged_kernel(impl: str, q: jax.Array, k_pages: jax.Array) -> str | None:
    """The implementation of the new tokens' segment attention for a ragged step, or None for
    the all-jnp path (keys of every position read from the pages). ``interpret`` runs the
    split path with the segment attention's jnp reference (its kernel is tokamax's, which has
    no interpreter run)."""
    if impl == "interpret":
        return "reference"
    reason = attention_kernels.unsupported_reason(q.astype(k_pages.dtype), k_pages)
    if resolve_impl("paged_attention", impl, reason) == "pallas":
        return "pallas"
    return None


def _paged_choice(impl: str, reason: str | None) -> str | None:
    """A paged kernel's implementation for ``impl`` given its ``unsupported_reason`` (None:
    the jnp key chunks): ``interpret`` runs the interpreter where the kernel can take the
    step, the others go through ``resolve_impl`` (``pallas`` raises where it cannot)."""
    if impl == "interpret":
        return None if reason else "interpret"
    choice = resolve_impl("paged_attention", impl, reason)
    return None if choice == "reference" else choice


def _decode_kernel(impl: str, q: jax.Array, k_pages: jax.Array, tree: bool = False) -> str | None:
    """The implementation of a DECODE or TARGET_VERIFY step's attention (``q`` ``[bs, D, H,
    hd]``; ``tree``: its rows may be trees) in the paged decode kernel (``pallas_kernels.
    attention.paged_decode_attention``), or None for jnp. ``auto`` takes the kernel on an
    sm_90 GPU where it can take the step, ``pallas`` asks for it (and raises where it
    cannot), ``interpret`` runs its interpreter where it can; ``reference`` keeps jnp."""
    if impl == "reference":
        return None
    reason = paged_decode.unsupported_reason(q.astype(k_pages.dtype), k_pages)
    if reason is None and tree:
        reason = paged_decode.tree_unsupported_reason(q.shape[1])
    return _paged_choice(impl, reason)


def _prefix_kernel(impl: str, segment: str, q: jax.Array, k_pages: jax.Array) -> str | None:
    """The implementation of a split ragged step's cached-prefix part in the paged prefix
    kernel (``pallas_kernels.attention.paged_prefix_attention``), or None for the jnp key
    chunks: the kernel under ``interpret`` (its interpreter run) and beside the segment
    kernel (``segment == "pallas"``), where it takes the step's heads, dtype and pages."""
    heads, head_dim = q.shape[1:]
    tokens = paged_decode.tokens_per_tile(heads, k_pages.shape[2])
    tile = jax.ShapeDtypeStruct((1, tokens, heads, head_dim), k_pages.dtype)
    if impl != "interpret" and segment != "pallas":
        return None
    return _paged_choice(impl, paged_decode.unsupported_reason(tile, k_pages))


def _cached_prefix(q, k_pages, v_pages, meta: ForwardMetadata, scale: float, impl: str):
    """Each token over its row's cached prefix in the paged prefix kernel: float32 ``(out
    [T, H, hd], lse [T, H])``, out 0 and lse ``-inf`` for a token that sees nothing (a row
    without a prefix, padding), as ``_ragged_rows(prefix_only=True)`` gives."""
    num_tokens, num_heads, head_dim = q.shape
    tokens = paged_decode.tokens_per_tile(num_heads, k_pages.shape[2])
    prefix = jnp.asarray(meta.context_lens) - jnp.asarray(meta.seq_lens)
    qsl = jnp.asarray(meta.query_start_loc)
    tiles = paged_decode.prefix_tiles(qsl, prefix, num_tokens, tokens)
    q_tiles = jnp.take(q.astype(k_pages.dtype), tiles.token, axis=0, mode="fill", fill_value=0)
    table = jnp.asarray(meta.pages.table)[tiles.row]
    out, lse = paged_decode.paged_prefix_attention(
        q_tiles, k_pages, v_pages, table, tiles.prefix_lens, scale=scale, impl=impl
    )
    where = tiles.token.reshape(-1)  # out of range (dropped) where a tile row has no token
    out = (
        jnp.zeros((num_tokens, num_heads, head_dim), out.dtype)
        .at[where]
        .set(out.reshape(-1, num_heads, head_dim), mode="drop")
    )
    lse = (
        jnp.full((num_tokens, num_heads), -jnp.inf, lse.dtype)
        .at[where]
        .set(lse.reshape(-1, num_heads), mode="drop")
    )
    return out, lse


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
    # Real tokens own distinct slots; padded tokens share the pad page, whose content
    # nothing reads back, so the write may take any of theirs.
    flat = flat.at[page * size + positions % size].set(
        new.astype(pages.dtype), unique_indices=True, mode="promise_in_bounds"
    )
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
    real = meta.real_tokens
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


def _tree_tokens_attention(
    q, k_flat, v_flat, token_pages, meta: ForwardMetadata, tree: _TreeTokens, scale: float, acc
) -> jax.Array:
    """Tree drafts, token by token: each token over its row's committed context and its own
    root path (``tree_ancestors``), read through the row's whole page table."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    groups = num_heads // num_kv_heads
    size = meta.pages.page_size
    span = jnp.arange(token_pages.shape[1] * size)

    def attend(args):
        q_t, pages_t, prefix_t, path_t = args  # [H, hd], [max_pages], [], [D]
        index = (pages_t[:, None] * size + jnp.arange(size)).reshape(-1)
        node = span - prefix_t
        on_path = path_t[jnp.clip(node, 0, path_t.shape[0] - 1)]
        seen = (node < 0) | ((node < path_t.shape[0]) & on_path)
        # Unwritten or stale entries may hold anything (even NaN): mask values as well as
        # scores, since 0 * NaN would still poison the sum.
        keys = jnp.where(seen[:, None, None], k_flat[index], 0).astype(acc)
        values = jnp.where(seen[:, None, None], v_flat[index], 0).astype(acc)
        q_g = q_t.reshape(num_kv_heads, groups, head_dim).astype(acc)
        scores = jnp.einsum("kgd,lkd->kgl", q_g, keys) * scale
        scores = jnp.where(seen, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("kgl,lkd->kgd", probs, values).reshape(num_heads, head_dim)

    args = (q, token_pages, tree.prefix, tree.path)
    return jax.lax.map(attend, args, batch_size=TOKEN_BLOCK)


def decode_rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: ForwardMetadata,
    *,
    q_scale: jax.Array | None,
    k_scale: jax.Array | None,
    eps: float,
    rotary_dim: int,
    theta: float,
    scale_offset: float = 0.0,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """A DECODE step's query and key norms, rotary and page writes in one launch
    (``pallas_kernels.attention.rows``) where ``impl`` takes that kernel for the step:
    ``(q [T, H, hd], k_pages, v_pages)`` with the step's keys and values written (then
    ``paged_attention(..., written=True)``). None where the caller forms them in jnp: other
    layouts, ``reference``, or a step the kernel cannot take (``pallas`` raises there).

    q: ``[T, H, W]``, a head's query in its first ``hd`` features; k, v ``[T, KVH, hd]``;
    ``q_scale`` / ``k_scale``: float32 ``[hd]``, the norms multiply by ``scale_offset`` plus
    them (a zero-centred norm's weight and 1); None for no norms."""
    one_per_row = meta.token_layout is TokenLayout.ONE_PER_ROW and not meta.tree
    one_per_row = one_per_row and q.shape[0] == meta.batch_size  # token n is row n
    empty = q.shape[0] == 0 or meta.pages.max_pages == 0
    if not ROWS_IN_KERNEL or impl == "reference" or not one_per_row or empty:
        return None
    choice = _paged_choice(impl, attention_rows.unsupported_reason(q, k, k_pages, rotary_dim))
    if choice is None:
        return None
    return attention_rows.attention_rows(
        q, k, v, k_pages, v_pages, jnp.asarray(meta.pages.table),
        jnp.asarray(meta.positions).astype(jnp.int32), q_scale=q_scale, k_scale=k_scale,
        eps=eps, rotary_dim=rotary_dim, theta=theta, scale_offset=scale_offset, impl=choice,
    )  # fmt: skip


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    meta: ForwardMetadata,
    *,
    scale: float,
    gate: jax.Array | None = None,
    impl: str = "auto",
    written: bool = False,
    counters: jax.Ref | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Writes this step's keys and values (unless ``written``: ``decode_rows`` did), then
    causal grouped-query attention per row.

    q: ``[T, H, hd]``; k, v: ``[T, KVH, hd]`` with ``H % KVH == 0`` (query head h reads key
    head ``h // (H // KVH)``); k_pages, v_pages: ``[P, page_size, KVH, hd]``; ``gate``: None
    or ``[T, H, w >= hd]``, each head's output times the sigmoid of its last ``hd`` values
    (a gated attention's ``[q | gate]`` projection as it comes), in float32 before the
    output's rounding; ``counters``: the forward's int32 zeros (``[n >= B KVH]``) that a
    kernel merging its splits counts on. Returns ``(out [T, H, hd], k_pages, v_pages)``; out
    is zero at padded tokens. Scores and softmax are float32 (q's dtype when wider). Raises
    ``UnsupportedForwardModeError`` while tracing for a mode that full attention has no path
    for, and ``ValueError`` when the metadata carries no page table.
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
    if gate is not None and (gate.shape[:2] != q.shape[:2] or gate.shape[2] < head_dim):
        raise ValueError(
            f"gate must be [T={num_tokens}, H={num_heads}, w >= {head_dim}]; got {gate.shape}"
        )
    token_pages = _token_pages(meta)
    tree = _tree_tokens(meta) if meta.tree else None
    store = None if tree is None else tree.store
    if not written:
        k_pages = write_pages(k_pages, k, meta, token_pages, store)
        v_pages = write_pages(v_pages, v, meta, token_pages, store)

    k_flat = k_pages.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(-1, num_kv_heads, head_dim)
    acc = jnp.promote_types(q.dtype, jnp.float32)  # float32 at least; float64 oracles stay so
    # Batch-invariant steps read every key from the pages: the segment kernel's key blocks
    # follow a row's place in the packed step.
    ragged = meta.token_layout is TokenLayout.RAGGED and not meta.batch_invariant
    kernel = _ragged_kernel(impl, q, k_pages) if ragged else None
    decode = rows_q = None
    if meta.token_layout in (TokenLayout.ONE_PER_ROW, TokenLayout.DRAFT_PER_ROW):
        rows_q = q.reshape(meta.batch_size, -1, num_heads, head_dim)  # row b's tokens in order
        decode = _decode_kernel(impl, rows_q, k_pages, meta.tree)
    if decode is not None:
        # A row's tokens are the last of its context, causal among themselves or along the
        # row's tree; padded rows have no context (zeros), so a step of one token a row
        # needs no mask after the kernel.
        dtype = k_pages.dtype
        rows_q = rows_q.astype(dtype)
        table = jnp.asarray(meta.pages.table)
        parents = meta.parents if meta.tree else None
        rows_gate = None if gate is None else gate.reshape(*rows_q.shape[:3], gate.shape[-1])
        splits = paged_decode.call_splits(rows_q, k_pages, table)
        merged = MERGE_IN_LAUNCH and (
            paged_decode.merge_unsupported_reason(rows_q, num_kv_heads, splits, parents) is None
        )
        out = paged_decode.paged_decode_attention(
            rows_q, k_pages, v_pages, table, jnp.asarray(meta.context_lens).astype(jnp.int32),
            scale=scale, parents=parents, gate=rows_gate, merge_in_launch=merged,
            counters=counters if merged else None, impl=decode,
        ).reshape(q.shape)  # fmt: skip
        if meta.token_layout is TokenLayout.ONE_PER_ROW:
            return out.astype(q.dtype), k_pages, v_pages
        out = jnp.where(meta.real_tokens[:, None, None], out, 0)
        return out.astype(q.dtype), k_pages, v_pages
    elif tree is not None:
        out = _tree_tokens_attention(q, k_flat, v_flat, token_pages, meta, tree, scale, acc)
    elif kernel is None:
        # Every layout but trees holds consecutive positions per row: key chunks up to each
        # row's length, never the whole max_context window.
        out, _ = _ragged_rows(q, k_flat, v_flat, meta, scale, acc)
    else:
        # The new tokens among themselves (causal within each row) in the segment kernel,
        # the cached prefix from the pages in jnp, merged by their log-sum-exps.
        dtype = k_pages.dtype
        fresh = attention_kernels.segment_causal_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), _segment_starts(meta),
            scale=scale, impl=kernel,
        )  # fmt: skip
        prefix = jnp.asarray(meta.context_lens) - jnp.asarray(meta.seq_lens)
        prefix_impl = _prefix_kernel(impl, kernel, q, k_pages)

        def cached_prefix():
            if prefix_impl is None:
                return _ragged_rows(q, k_flat, v_flat, meta, scale, acc, prefix_only=True)
            out, lse = _cached_prefix(q, k_pages, v_pages, meta, scale, prefix_impl)
            return out.astype(acc), lse.astype(acc)

        # A step of fresh prompts only (no row has a cached prefix) skips the prefix pass.
        cached = jax.lax.cond(
            jnp.any(prefix > 0),
            cached_prefix,
            lambda: (
                jnp.zeros((num_tokens, num_heads, head_dim), acc),
                jnp.full((num_tokens, num_heads), -jnp.inf, acc),
            ),
        )
        out = _merge([fresh, cached])
    real = meta.real_tokens[:, None, None]
    out = paged_decode.gated(out, gate)
    return jnp.where(real, out, 0).astype(q.dtype), k_pages, v_pages
