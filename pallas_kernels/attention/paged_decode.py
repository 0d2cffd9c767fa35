"""paged_decode_attention: a row's last D query tokens (decode: D = 1; a verify chain: its D
tokens, causal) over that row's pages of a paged KV cache; paged_prefix_attention: a ragged
step's new tokens over their rows' cached prefixes (every token sees the whole prefix), with
the log-sum-exps that merge it with the new tokens' own attention.

Grouped-query attention: query head ``h`` reads key head ``h // (H // KVH)``. Row ``b`` holds
``context_lens[b]`` positions in its page table (position ``p`` lives in
``page_table[b, p // page_size]`` at offset ``p % page_size``), its D query tokens being the
last D of them: token ``t`` attends positions ``0 .. context_lens[b] - D + t``; with
``parents`` (tree drafts: node t's parent, ``-1`` at the root, nodes in topological order) it
attends the positions before the D tokens and those of the nodes on its root path, itself
included. Nothing past a row's positions is read into the result, whatever the cache holds
there (stale or NaN entries included).

The Mosaic GPU kernel (sm_90): one program per (split, row, KV head). The (token, query
head) pairs of one KV head are the rows of a 64-row wgmma tile (padded with zeros), so one
program reads each of its row's keys and values once for all of them. A program walks
64-position blocks (64 / page_size pages, one TMA each) through rings of ``stages`` key and
``stages`` value buffers with a barrier each: a block's scores start once its keys have
landed and its values may still be in flight, and a stage refills with block ``j + stages``
as soon as block ``j``'s keys (then values) are read, so ``stages`` blocks stay in flight
while this one's scores, online softmax and ``p @ v`` run on the tensor cores (``p`` straight
from registers). The page ids of the block a stage takes next load from the table one step
early, under the wait. The last block's values past the row's length are zeroed in SMEM
before ``p @ v`` (a zero weight times a NaN would be NaN). Long rows split their blocks over
``num_splits`` programs; the splits' outputs merge by their log-sum-exps in XLA, or, with
``merge_in_launch``, in the last of a (row, KV head)'s programs to finish, which counts the
others' arrivals on a GMEM counter (``_counters``), reads their rows back and stores the
merged (and gated) output: no launch after the kernel.
The prefix op runs the same kernel without the causal tail over "tile rows" of up to
``64 // (H // KVH)`` consecutive tokens of one row each (``prefix_tiles``), so a prompt chunk
of thousands of tokens is many programs, each reading its row's prefix once for its tokens.
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _counters
from pallas_kernels._common import (
    NUM_SMS,
    SMEM_BYTES,
    interpret_params,
    resolve_impl,
    round_up,
)
from pallas_kernels._mgpu_chunks import (
    F32,
    ROWS,
    WG,
    along_rows,
    matmul,
    matmul_into,
    smem,
    strided,
)
from pallas_kernels._tree import check_parents

__all__ = [
    "MAX_TREE_NODES",
    "MERGE_LOADS",
    "PrefixTiles",
    "STAGES",
    "call_splits",
    "gated",
    "merge_unsupported_reason",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefix_attention",
    "paged_prefix_attention_reference",
    "prefix_tiles",
    "root_paths",
    "stages_unsupported_reason",
    "tree_unsupported_reason",
    "tokens_per_tile",
    "unsupported_reason",
]

_OP = "paged_decode_attention"
_PREFIX_OP = "paged_prefix_attention"
BLOCK = 64  # positions per block: the wgmma N of the scores, the K of p @ v
ROWS_PER_TILE = 64  # query rows of a program (its KV head's query heads, zero-padded)
# Two blocks in flight while one is computed; a third ring buffer (it fits at head_dim 256,
# p being in registers) runs slower on the H200 (benchmarks/RESULTS_attention.md).
STAGES = 2
_PAGE_SIZES = (16, 32, 64)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _smem_bytes(stages: int, head_dim: int, itemsize: int) -> int:
    """Shared memory of one program: the query tile (reused for the output), the ring of
    keys and values, the log-sum-exps and tree paths, the barriers."""
    tile = ROWS_PER_TILE * head_dim * itemsize
    ring = 2 * stages * BLOCK * head_dim * itemsize
    return tile + ring + 2 * ROWS_PER_TILE * 4 + 8 * (2 * stages + 1)


def stages_unsupported_reason(stages: int, head_dim: int, itemsize: int) -> str | None:
    """Why the kernel cannot run a ring of ``stages`` buffers, or None when it can."""
    if stages < 1:
        return f"stages={stages} must be at least 1"
    need = _smem_bytes(stages, head_dim, itemsize)
    if need > SMEM_BYTES:
        return (
            f"stages={stages} at head_dim={head_dim} needs {need} bytes of shared memory "
            f"(at most {SMEM_BYTES})"
        )
    return None


def _check(op: str, q, k_pages, v_pages, page_table, lengths, lengths_name: str) -> None:
    """The shapes and dtypes ``op`` takes; ``lengths`` is its per-row ``lengths_name``."""
    if q.ndim not in (3, 4) or k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"{op}: q must be [B, H, hd] or [B, D, H, hd] and k_pages, v_pages [P, "
            f"page_size, KVH, hd]; got {q.shape}, {k_pages.shape}, {v_pages.shape}"
        )
    batch, heads, head_dim = q.shape[0], *q.shape[-2:]
    kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(
            f"{op}: H={heads} query heads must be a multiple of KVH={kv_heads}, and the "
            f"pages' head_dim {k_pages.shape[3]} must be q's {head_dim}"
        )
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(
            f"{op}: page_table must be int32 [B={batch}, max_pages]; got {page_table.dtype} "
            f"{page_table.shape}"
        )
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(
            f"{op}: {lengths_name} must be int32 [B={batch}]; got {lengths.dtype} {lengths.shape}"
        )


def unsupported_reason(q: jax.Array, k_pages: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call, or None when it can."""
    heads, head_dim = q.shape[-2:]
    tokens = q.shape[1] if q.ndim == 4 else 1
    page_size, kv_heads = k_pages.shape[1:3]
    if q.dtype not in _DTYPES or k_pages.dtype != q.dtype:
        return f"q and the pages must share a 16-bit float dtype (got {q.dtype}, {k_pages.dtype})"
    if head_dim % 64 or head_dim > 256:
        return f"head_dim={head_dim} must be a multiple of 64 up to 256"
    if tokens * (heads // kv_heads) > ROWS_PER_TILE:
        return (
            f"{tokens} tokens x {heads // kv_heads} query heads per KV head exceed the "
            f"{ROWS_PER_TILE} rows of a tile"
        )
    if page_size not in _PAGE_SIZES:
        return f"page_size={page_size} is not one of {_PAGE_SIZES}"
    return None


MAX_TREE_NODES = 31  # a node's root path is a bitmask of int32


def tree_unsupported_reason(num_nodes: int) -> str | None:
    """Why tree drafts of ``num_nodes`` nodes per row cannot be masked here, or None."""
    if num_nodes > MAX_TREE_NODES:
        return f"a tree of D={num_nodes} nodes is over {MAX_TREE_NODES}"
    return None


def root_paths(parents: jax.Array) -> jax.Array:
    """parents int32 ``[B, D]`` (``-1`` at the root, topological) -> int32 ``[B, D]``: bit j
    of ``[b, t]`` is set when node j lies on node t's root path (t itself included)."""
    n_nodes = parents.shape[1]
    paths = [jnp.ones(parents.shape[:1], jnp.int32)]
    for t in range(1, n_nodes):
        parent = jnp.clip(parents[:, t], 0, t - 1)
        paths.append(jnp.stack(paths, axis=1)[jnp.arange(parents.shape[0]), parent] | (1 << t))
    return jnp.stack(paths, axis=1)


def _reference(q, k_pages, v_pages, page_table, lengths, *, scale: float, causal: bool,
               parents: jax.Array | None = None):  # fmt: skip
    """jnp over ``q`` ``[B, D, H, hd]``: every page of the table gathered, the values past
    each row's ``lengths`` zeroed (stale NaN never reaches the result), and each token's
    positions past its last masked (``causal``: the row's last D tokens, or with ``parents``
    their root paths; else all of ``lengths``). Float32 ``(out, lse)`` at least; lse ``-inf``
    where a token sees nothing."""
    batch, tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    groups = heads // kv_heads
    acc = jnp.promote_types(q.dtype, F32)
    keys = k_pages[page_table].reshape(batch, -1, kv_heads, head_dim)  # [B, L, KVH, hd]
    values = v_pages[page_table].reshape(batch, -1, kv_heads, head_dim)
    pos = jnp.arange(keys.shape[1])
    live = pos[None, :] < lengths[:, None]  # [B, L]
    values = jnp.where(live[..., None, None], values, 0).astype(acc)
    if causal and parents is not None:
        node = pos[None, :] - (lengths[:, None] - tokens)  # [B, L]: the draft node held there
        bits = root_paths(parents)[:, :, None] >> jnp.clip(node, 0, MAX_TREE_NODES)[:, None]
        on_path = (node[:, None, :] < tokens) & (bits & 1 == 1)
        seen = live[:, None, :] & ((node[:, None, :] < 0) | on_path)  # [B, D, L]
    elif causal:
        last = lengths[:, None] - tokens + jnp.arange(tokens)[None, :]  # [B, D]
        seen = pos[None, None, :] <= last[..., None]  # [B, D, L]
    else:
        seen = jnp.broadcast_to(live[:, None, :], (batch, tokens, live.shape[1]))
    qg = q.reshape(batch, tokens, kv_heads, groups, head_dim).astype(acc)
    scores = jnp.einsum("btkgd,blkd->btkgl", qg, keys.astype(acc)) * scale
    scores = jnp.where(seen[:, :, None, None, :], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0)
    weights = jnp.exp(scores - peak)
    total = weights.sum(-1)
    found = total > 0
    safe = jnp.where(found, total, 1)
    out = jnp.einsum("btkgl,blkd->btkgd", weights, values) / safe[..., None]
    lse = jnp.where(found, peak[..., 0] + jnp.log(safe), -jnp.inf)
    return out.reshape(q.shape), lse.reshape(batch, tokens, heads)


def paged_decode_attention_reference(
    q, k_pages, v_pages, page_table, context_lens, *, scale: float, parents=None, gate=None
) -> jax.Array:
    """jnp ``paged_decode_attention`` (``_reference``, causal or a tree, maybe gated), in
    float32 at least, rounded to q's dtype."""
    q4 = q if q.ndim == 4 else q[:, None]
    out, _ = _reference(
        q4, k_pages, v_pages, page_table, context_lens, scale=scale, causal=True,
        parents=parents,
    )  # fmt: skip
    return gated(out.reshape(q.shape), gate).astype(q.dtype)


# A program's start (its query tile, the first loads of its ring, the output store) costs
# about as long as streaming this many blocks (benchmarks/RESULTS_attention.md).
RAMP_BLOCKS = 4


def pick_num_splits(batch: int, kv_heads: int, max_blocks: int) -> int:
    """Splits of a row's blocks that finish soonest, never a split with fewer than two
    blocks of the longest row the table can hold. Programs run in waves over the SMs and a
    wave lasts as long as its programs' ramp and blocks: 192 programs on 132 SMs take two
    waves of whole rows, 384 take three of half rows; a short row's extra split is mostly
    ramp. Ties go to fewer splits (less to merge)."""
    options = [1]
    while max_blocks // (2 * options[-1]) >= 2:
        options.append(2 * options[-1])

    def cost(splits: int) -> int:
        waves = -(-batch * kv_heads * splits // NUM_SMS)
        return waves * (RAMP_BLOCKS + -(-max_blocks // splits))

    return min(options, key=cost)


def _kernel_call(q_tiles, k_pages, v_pages, page_table, context_lens, paths, merge=None, *,
                 scale, num_splits, tokens, groups, causal, stages, interpret):  # fmt: skip
    """The kernel over query tiles ``[B, KVH, R, hd]`` (tile row ``r``: token ``r // groups``,
    query head ``r % groups`` of the KV head; ``R`` a multiple of 8 up to 64, the rows past
    ``tokens * groups`` zero): per split, its output rows (q's dtype) and float32
    log-sum-exps ``[S, B, KVH, R]`` (``-inf``: saw nothing). A program's wgmma tile has 64
    rows; only the first ``R`` are loaded and stored (the others hold whatever SMEM held,
    and every row's softmax and product are its own).
    ``causal``: token t sees positions below ``length - tokens + 1 + t``; else every token
    sees all ``length`` positions. ``paths`` (tree drafts, with ``causal``): int32 ``[B, 64]``,
    each tile row's root-path bits (``root_paths``): it sees the positions before the
    ``tokens`` draft positions and the draft positions whose bit is set.

    ``merge`` ``(gate, counters)``: the last of a pair's programs to store its split
    (``_counters.count_arrival`` on ``counters[pair]``, int32 ``[n >= B KVH]`` of zeros, left
    at zero) merges the pair's splits (``_merged_rows``) into a third result ``[B, KVH, R,
    hd]`` (q's dtype; the rows past ``tokens * groups`` unwritten), gated by ``gate`` ``[B,
    tokens, H, w]`` when given."""
    batch, kv_heads, held, head_dim = q_tiles.shape
    pairs = batch * kv_heads  # (row, KV head) pairs
    page_size = k_pages.shape[1]
    pages_per_block = BLOCK // page_size
    max_pages = page_table.shape[1]
    tile = (ROWS_PER_TILE, head_dim)
    scores = (ROWS_PER_TILE, BLOCK)
    dtype = q_tiles.dtype

    tree = paths is not None
    merging = merge is not None
    gate, counters = merge if merging else (None, None)
    has_gate = gate is not None

    def body(table_ref, lens_ref, q_ref, k_ref, v_ref, *refs):
        paths_ref, refs = (refs[0], refs[1:]) if tree else (None, refs)
        gate_ref, refs = (refs[0], refs[1:]) if has_gate else (None, refs)
        counters_ref, refs = (refs[0], refs[1:]) if merging else (None, refs)
        o_ref, lse_ref, refs = refs[0], refs[1], refs[2:]
        merged_ref, refs = (refs[0], refs[1:]) if merging else (None, refs)
        q_s, k_s, v_s, lse_s, refs = refs[0], refs[1], refs[2], refs[3], refs[4:]
        paths_s, refs = (refs[0], refs[1:]) if tree else (None, refs)
        count_s, refs = (refs[0], refs[1:]) if merging else (None, refs)
        q_bar, k_bar, v_bar, *p_s = refs
        # Program p takes split p // pairs of pair p % pairs = row * KVH + head. The kernel
        # on a 1-D grid runs 1-2% faster on the H200 than on a (split, head, row) grid of
        # the same programs (benchmarks/RESULTS_attention.md).
        program = lax.axis_index("p")
        split, pair = program // pairs, program % pairs
        row, head = pair // kv_heads, pair % kv_heads
        length = lens_ref[row]
        num_blocks = (length + BLOCK - 1) // BLOCK
        per_split = (num_blocks + num_splits - 1) // num_splits
        first = split * per_split
        num = jnp.clip(num_blocks - first, 0, per_split)

        plgpu.copy_gmem_to_smem(q_ref.at[row, head], q_s.at[pl.ds(0, held)], q_bar)
        if tree:
            plgpu.copy_gmem_to_smem(paths_ref.at[row], paths_s, q_bar)

        def pages_of(j):
            """Block j's page ids (clamped into the table past the row's last block)."""
            base = (first + j) * pages_per_block
            return [
                table_ref[row, jnp.minimum(base + i, max_pages - 1)] for i in range(pages_per_block)
            ]

        def issue(ref, ring, bars, pages, stage):
            for i, page in enumerate(pages):
                rows = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(ref.at[page, :, head], ring.at[stage, rows], bars.at[stage])

        def fill(stage, pages):
            issue(k_ref, k_s, k_bar, pages, stage)
            issue(v_ref, v_s, v_bar, pages, stage)

        for j in range(stages):  # the ring's first blocks
            pl.when(j < num)(functools.partial(fill, j, pages_of(j)))

        plgpu.barrier_wait(q_bar)
        if tree:
            row_paths = along_rows(plgpu.load(paths_s, layout=ROWS), scores)

        def step(j, carry):
            peak, total, acc = carry
            stage = lax.rem(j, stages)
            # Block j + stages takes this stage once its keys, then its values, are read:
            # its page ids load now, under this block's wait and products.
            later = pages_of(j + stages)
            refill = j + stages < num
            plgpu.barrier_wait(k_bar.at[stage])
            qk = matmul(q_s, k_s.at[stage].T, scores) * scale
            pl.when(refill)(lambda: issue(k_ref, k_s, k_bar, later, stage))

            start = (first + j) * BLOCK
            col = plgpu.broadcasted_iota(jnp.int32, scores, 1, layout=WG)
            tile_row = plgpu.broadcasted_iota(jnp.int32, scores, 0, layout=WG)
            if causal and not tree:
                # Token t of the row sees positions below length - tokens + 1 + t.
                limit = jnp.minimum(length - tokens + 1 + tile_row // groups, length)
            else:
                limit = length
            if tree:
                # The draft node held at each position (negative: before the drafts).
                node = start + col - (length - tokens)
                bit = lax.shift_right_logical(row_paths, jnp.clip(node, 0, MAX_TREE_NODES))
                qk = jnp.where((start + col < limit) & ((node < 0) | (bit & 1 == 1)), qk, -jnp.inf)
            else:
                qk = jnp.where(start + col < limit, qk, -jnp.inf)

            # A tile row that has seen nothing yet keeps peak -inf; 0 stands in for it, so
            # that exp gives 0 rather than exp(-inf + inf) = NaN.
            new_peak = jnp.maximum(peak, qk.max(axis=1))
            shift = jnp.where(new_peak > -jnp.inf, new_peak, 0.0)
            decay = jnp.exp(peak - shift)
            weights = jnp.exp(qk - along_rows(shift, scores))
            total = total * decay + weights.sum(axis=1)
            p = weights.astype(dtype)
            if interpret:  # the interpreter's wgmma reads its operands from SMEM only
                p_s[0][...] = p
                p = p_s[0]

            plgpu.barrier_wait(v_bar.at[stage])

            @pl.when(start + BLOCK > length)
            def _zero_values_past_the_row():
                rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK, head_dim), 0, layout=WG)
                values = plgpu.load(v_s.at[stage], layout=WG)
                v_s[stage] = jnp.where(start + rows < length, values, jnp.zeros_like(values))
                plgpu.commit_smem()

            acc = matmul_into(acc * along_rows(decay, tile), p, v_s.at[stage], interpret=interpret)
            pl.when(refill)(lambda: issue(v_ref, v_s, v_bar, later, stage))
            return new_peak, total, acc

        init = (
            plgpu.layout_cast(jnp.full((ROWS_PER_TILE,), -jnp.inf, F32), ROWS),
            plgpu.layout_cast(jnp.zeros((ROWS_PER_TILE,), F32), ROWS),
            plgpu.layout_cast(jnp.zeros(tile, F32), WG),
        )
        peak, total, acc = lax.fori_loop(0, num, step, init)
        seen = total > 0
        safe = jnp.where(seen, total, 1.0)
        # The query tile is read by no later product: it takes the output.
        q_s[...] = (acc / along_rows(safe, tile)).astype(dtype)
        lse_s[...] = jnp.where(seen, peak + jnp.log(safe), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s.at[pl.ds(0, held)], o_ref.at[split, row, head])
        plgpu.copy_smem_to_gmem(lse_s.at[pl.ds(0, held)], lse_ref.at[split, row, head])
        if not merging:
            plgpu.wait_smem_to_gmem(0)
            return
        # The split has landed in GMEM before its arrival counts.
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        counter = counters_ref.at[pl.ds(pair, 1)]
        before = _counters.count_arrival(counter, num_splits, count_s, interpret=interpret)

        @pl.when(before == num_splits - 1)
        def _merge_the_pair():
            _merged_rows(o_ref, lse_ref, gate_ref, merged_ref, row, head, rows=tokens * groups,
                         groups=groups)  # fmt: skip

    out_type = [
        jax.ShapeDtypeStruct((num_splits, batch, kv_heads, held, head_dim), dtype),
        jax.ShapeDtypeStruct((num_splits, batch, kv_heads, held), F32),
    ]
    if merging:
        out_type.append(jax.ShapeDtypeStruct((batch, kv_heads, held, head_dim), dtype))
    scratch = [
        smem(tile, dtype),
        smem((stages, BLOCK, head_dim), dtype),
        smem((stages, BLOCK, head_dim), dtype),
        plgpu.SMEM((ROWS_PER_TILE,), F32),
    ]
    extra = (paths,) if tree else ()
    if tree:
        scratch.append(plgpu.SMEM((ROWS_PER_TILE,), jnp.int32))
    if merging:
        extra += ((gate,) if has_gate else ()) + (counters,)
        scratch.append(plgpu.SMEM((1,), jnp.int32))
    scratch += [
        plgpu.Barrier(num_arrivals=1 + tree),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
    ]
    if interpret:
        scratch.append(smem(scores, dtype))
    return plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(num_splits * pairs,),
        grid_names=("p",),
        # The row reductions of a WGMMA tile stay within warps: no cross-warp scratch, so
        # the ring may take all of shared memory.
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
        interpret=interpret_params(interpret),
        kernel_name="paged_decode_attention",
    )(page_table, context_lens, q_tiles, k_pages, v_pages, *extra)


def _merged_rows(o_ref, lse_ref, gate_ref, merged_ref, row, head, *, rows: int, groups: int):
    """One (row, KV head)'s splits ``o_ref[:, row, head]`` merged by their log-sum-exps into
    ``merged_ref[row, head]``, tile row by tile row (``rows`` of them), as ``_merge``; with
    ``gate_ref`` each tile row r (token ``r // groups``, query head ``head * groups + r %
    groups``) times the sigmoid of that head's last ``hd`` gate values. Every load is issued
    before the sums that wait on it: the rows and splits are few (``merge_unsupported_reason``)."""
    num_splits, head_dim = o_ref.shape[0], o_ref.shape[-1]
    layout = strided((head_dim,))
    for r in range(rows):
        lses = [lse_ref[s, row, head, r] for s in range(num_splits)]
        parts = [plgpu.load(o_ref.at[s, row, head, r], layout=layout) for s in range(num_splits)]
        gate = None
        if gate_ref is not None:
            width = gate_ref.shape[-1]
            view = gate_ref.at[row, r // groups, head * groups + r % groups]
            gate = plgpu.load(view.at[pl.ds(width - head_dim, head_dim)], layout=layout)
        peak = functools.reduce(jnp.maximum, lses)
        peak = jnp.where(peak > -jnp.inf, peak, 0.0)  # no split saw anything: weights 0
        weights = [jnp.exp(lse - peak) for lse in lses]
        total = functools.reduce(operator.add, weights)
        out = functools.reduce(
            operator.add, [w * p.astype(F32) for w, p in zip(weights, parts, strict=True)]
        )
        out = out / jnp.where(total > 0, total, 1.0)
        if gate is not None:
            out = out / (1.0 + jnp.exp(-gate.astype(F32)))
        merged_ref[row, head, r] = out.astype(merged_ref.dtype)


def _merge(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Splits' outputs ``[S, ...rows, D]`` weighted by their log-sum-exps ``[S, ...rows]``:
    float32 ``(out, lse)`` of the union (lse ``-inf`` where no split saw anything)."""
    peak = jnp.max(lse, axis=0)
    peak = jnp.where(jnp.isfinite(peak), peak, 0)
    weight = jnp.exp(lse - peak)  # 0 for a split that saw nothing
    total = weight.sum(axis=0)
    merged = (weight[..., None] * out.astype(F32)).sum(axis=0)
    seen = total > 0
    safe = jnp.where(seen, total, 1)
    return merged / safe[..., None], jnp.where(seen, peak + jnp.log(safe), -jnp.inf)


def _tiles(q: jax.Array, kv_heads: int) -> tuple[jax.Array, int]:
    """q ``[B, D, H, hd]`` as the kernel's query tiles ``[B, KVH, R, hd]`` (tile row r: token
    ``r // groups``, query head ``r % groups`` of the KV head; the rows past ``D * groups``
    zero, up to a multiple of 8: TMA moves whole 8-row groups of the swizzled tile), and
    ``D * groups``."""
    batch, tokens, heads, head_dim = q.shape
    groups = heads // kv_heads
    rows = tokens * groups
    tiles = q.reshape(batch, tokens, kv_heads, groups, head_dim).transpose(0, 2, 1, 3, 4)
    tiles = tiles.reshape(batch, kv_heads, rows, head_dim)
    return jnp.pad(tiles, ((0, 0), (0, 0), (0, round_up(rows, 8) - rows), (0, 0))), rows


def _untiled(x: jax.Array, shape: tuple[int, ...], kv_heads: int) -> jax.Array:
    """Tile rows ``[B, KVH, R, ...]`` (``_tiles``) back as ``[B, D, H, ...]`` of ``shape``
    ``(B, D, H)``."""
    batch, tokens, heads = shape
    groups = heads // kv_heads
    x = x[:, :, : tokens * groups].reshape(batch, kv_heads, tokens, groups, *x.shape[3:])
    return jnp.swapaxes(x, 1, 2).reshape(batch, tokens, heads, *x.shape[4:])


@functools.partial(
    jax.jit, static_argnames=("scale", "num_splits", "causal", "stages", "interpret")
)
def _kernel(q, k_pages, v_pages, page_table, context_lens, parents=None, *, scale, num_splits,
            causal, interpret, stages=STAGES):  # fmt: skip
    """float32 ``(out, lse)``: out ``[B, D, H, hd]``, lse ``[B, D, H]``; ``parents``: tree
    drafts (with ``causal``)."""
    kv_heads = k_pages.shape[2]
    tiles, rows = _tiles(q, kv_heads)
    groups = q.shape[2] // kv_heads
    paths = None
    if parents is not None:  # tile row r is token r // groups; padding rows see no draft
        paths = jnp.repeat(root_paths(parents), groups, axis=1)
        paths = jnp.pad(paths, ((0, 0), (0, ROWS_PER_TILE - rows)))
    out, lse = _kernel_call(
        tiles, k_pages, v_pages, page_table, context_lens, paths, scale=scale,
        num_splits=num_splits, tokens=q.shape[1], groups=groups, causal=causal, stages=stages,
        interpret=interpret,
    )  # fmt: skip
    out, lse = out[:, :, :, :rows], lse[:, :, :, :rows]
    out, lse = (out[0].astype(F32), lse[0]) if num_splits == 1 else _merge(out, lse)
    return _untiled(out, q.shape[:3], kv_heads), _untiled(lse, q.shape[:3], kv_heads)


# The most (tile row, split) pairs whose partial rows a program merges, every load in flight
# at once (``_merged_rows``).
MERGE_LOADS = 64


def merge_unsupported_reason(
    q: jax.Array, kv_heads: int, num_splits: int, parents: jax.Array | None = None
) -> str | None:
    """Why the kernel cannot merge the splits of this decode call itself (``merge_in_launch``),
    or None when it can."""
    if parents is not None:
        return "tree drafts merge their splits in XLA"
    head_dim = q.shape[-1]
    tokens = q.shape[1] if q.ndim == 4 else 1
    rows = tokens * (q.shape[-2] // kv_heads)
    if head_dim % 128:
        return f"head_dim={head_dim} is not a multiple of 128 (a warpgroup's row)"
    if rows * num_splits > MERGE_LOADS:
        return (
            f"{rows} tile rows x {num_splits} splits are more than the {MERGE_LOADS} partial "
            f"rows one program merges"
        )
    return None


def _merged_kernel(q, k_pages, v_pages, page_table, context_lens, gate, counters, *, scale,
                   num_splits, stages, interpret):  # fmt: skip
    """q's dtype ``[B, D, H, hd]``: the causal chain, its splits merged (and gated) in the
    launch."""
    kv_heads = k_pages.shape[2]
    tiles, _ = _tiles(q, kv_heads)
    if counters is None:
        counters = jax.new_ref(jnp.zeros((q.shape[0] * kv_heads,), jnp.int32))
    _, _, merged = _kernel_call(
        tiles, k_pages, v_pages, page_table, context_lens, None, (gate, counters),
        scale=scale, num_splits=num_splits, tokens=q.shape[1], groups=q.shape[2] // kv_heads,
        causal=True, stages=stages, interpret=interpret,
    )  # fmt: skip
    return _untiled(merged, q.shape[:3], kv_heads)


def _stages(op: str, q: jax.Array, stages: int) -> int:
    """``stages``, checked for q's head_dim and dtype."""
    reason = stages_unsupported_reason(int(stages), q.shape[-1], q.dtype.itemsize)
    if reason is not None:
        raise ValueError(f"{op}: {reason}")
    return int(stages)


def call_splits(q, k_pages, page_table, num_splits: int | None = None) -> int:
    """The splits a call takes: ``num_splits``, or when None ``pick_num_splits`` for the
    call's rows, KV heads and the blocks its page table can hold."""
    if num_splits is not None:
        return int(num_splits)
    max_blocks = -(-page_table.shape[1] * k_pages.shape[1] // BLOCK)
    return pick_num_splits(q.shape[0], k_pages.shape[2], max_blocks)


def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    context_lens: jax.Array,
    *,
    scale: float,
    num_splits: int | None = None,
    parents: jax.Array | None = None,
    gate: jax.Array | None = None,
    merge_in_launch: bool = False,
    counters: jax.Ref | None = None,
    stages: int = STAGES,
    impl: str = "auto",
) -> jax.Array:
    """Attention of each row's last query tokens over its first ``context_lens[b]`` cached
    positions, causal among them, or along their tree (see the module docstring).

    Args:
      q: ``[B, H, hd]`` (one token per row) or ``[B, D, H, hd]``; k_pages, v_pages:
        ``[P, page_size, KVH, hd]`` (q's dtype).
      page_table: int32 ``[B, max_pages]``; context_lens: int32 ``[B]`` (0: the row reads
        nothing and gets zeros).
      scale: the scores' scale.
      num_splits: programs per (row, KV head) (None: ``pick_num_splits``).
      parents: None (a chain) or int32 ``[B, D]`` tree drafts (D <= 31): token t's parent
        among the D, ``-1`` at the root, topological; token t sees the positions before the
        D and those of its root path.
      gate: None or q's leading shape with a last axis ``w >= hd``: each head's output is
        multiplied by the sigmoid of the head's last ``hd`` gate values (so a gated
        attention's ``[q | gate]`` projection is passed as it comes), in float32 before the
        output's rounding.
      merge_in_launch: the kernel merges the splits (and gates) itself, the last of a (row,
        KV head)'s programs reading the others' rows (``merge_unsupported_reason`` says
        when it cannot); else XLA merges them after the launch.
      counters: with ``merge_in_launch``, optional int32 ``Ref`` ``[n >= B KVH]`` of zeros
        that the launch counts its programs on and leaves at zero (None: its own).
      stages: the kernel's ring of key and value buffers.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      q's shape and dtype.
    """
    _check(_OP, q, k_pages, v_pages, page_table, context_lens, "context_lens")
    tokens = q.shape[1] if q.ndim == 4 else 1
    check_parents(_OP, parents, q.shape[0], tokens)
    tree_reason = None if parents is None else tree_unsupported_reason(tokens)
    if tree_reason is not None:
        raise ValueError(f"{_OP}: {tree_reason}")
    _check_gate(q, gate)
    reason = unsupported_reason(q, k_pages) if impl != "reference" else None
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference":
        return paged_decode_attention_reference(
            q, k_pages, v_pages, page_table, context_lens, scale=scale, parents=parents,
            gate=gate,
        )  # fmt: skip
    q4 = q if q.ndim == 4 else q[:, None]
    stages = _stages(_OP, q, stages)
    splits = call_splits(q, k_pages, page_table, num_splits)
    if merge_in_launch:
        kv_heads = k_pages.shape[2]
        reason = merge_unsupported_reason(q, kv_heads, splits, parents)
        if reason is not None:
            raise ValueError(f"{_OP}: merge_in_launch: {reason}")
        _counters.check_counters(_OP, counters, q.shape[0] * kv_heads)
        gate4 = None if gate is None else gate.reshape(*q4.shape[:3], gate.shape[-1])
        out = _merged_kernel(
            q4, k_pages, v_pages, page_table, context_lens, gate4, counters,
            scale=float(scale), num_splits=splits, stages=stages,
            interpret=choice == "interpret",
        )  # fmt: skip
        return out.reshape(q.shape)
    out, _ = _kernel(
        q4, k_pages, v_pages, page_table, context_lens, parents, scale=float(scale),
        num_splits=splits, causal=True, stages=stages, interpret=choice == "interpret",
    )  # fmt: skip
    return gated(out.reshape(q.shape), gate).astype(q.dtype)


def _check_gate(q: jax.Array, gate: jax.Array | None) -> None:
    if gate is None:
        return
    if gate.shape[:-1] != q.shape[:-1] or gate.shape[-1] < q.shape[-1]:
        raise ValueError(
            f"{_OP}: gate must be q's leading shape {q.shape[:-1]} with a last axis of at "
            f"least head_dim={q.shape[-1]}; got {gate.shape}"
        )


def gated(out: jax.Array, gate: jax.Array | None) -> jax.Array:
    """``out`` times the sigmoid of each head's last ``hd`` gate values, in float32 at least,
    rounded to ``out``'s dtype."""
    if gate is None:
        return out
    acc = jnp.promote_types(out.dtype, F32)
    gate = gate[..., gate.shape[-1] - out.shape[-1] :].astype(acc)
    return (out.astype(acc) * jax.nn.sigmoid(gate)).astype(out.dtype)


def tokens_per_tile(heads: int, kv_heads: int) -> int:
    """Query tokens of one program of the prefix op: the (token, query head) pairs of a KV
    head fill the 64 rows of its tile."""
    return ROWS_PER_TILE // (heads // kv_heads)


class PrefixTiles(NamedTuple):
    """A ragged step's new tokens cut into tile rows of ``D`` consecutive tokens of one row.

    ``token`` int32 ``[V, D]``: each tile row's tokens in the step (``T``, out of range, where
    it has fewer); ``row`` int32 ``[V]``: the step's row of each tile row (rows without a
    prefix get none; unused tile rows point at row 0 with ``prefix_lens`` 0);
    ``prefix_lens`` int32 ``[V]``.
    """

    token: jax.Array
    row: jax.Array
    prefix_lens: jax.Array


def prefix_tiles(
    query_start_loc: jax.Array, prefix_lens: jax.Array, num_tokens: int, tokens: int
) -> PrefixTiles:
    """The tile rows of ``tokens`` tokens of a ragged step (``query_start_loc`` int32 ``[N+1]``
    over ``num_tokens`` packed tokens, ``prefix_lens`` int32 ``[N]``): ``num_tokens // tokens
    + N`` of them, enough for any step of that size."""
    n = prefix_lens.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    lens = qsl[1:] - qsl[:-1]
    count = jnp.where(prefix_lens > 0, -(-lens // tokens), 0)
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(count, dtype=jnp.int32)])
    tile = jnp.arange(num_tokens // tokens + n, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(first, tile, side="right").astype(jnp.int32) - 1, 0, n - 1)
    used = tile < first[n]
    offset = (tile - first[row])[:, None] * tokens + jnp.arange(tokens, dtype=jnp.int32)
    live = used[:, None] & (offset < lens[row][:, None])
    token = jnp.where(live, qsl[row][:, None] + offset, num_tokens)
    return PrefixTiles(token, jnp.where(used, row, 0), jnp.where(used, prefix_lens[row], 0))


def paged_prefix_attention_reference(
    q, k_pages, v_pages, page_table, prefix_lens, *, scale: float
) -> tuple[jax.Array, jax.Array]:
    """jnp ``paged_prefix_attention`` (``_reference``, every token over the whole prefix).
    Float32 at least."""
    return _reference(q, k_pages, v_pages, page_table, prefix_lens, scale=scale, causal=False)


def paged_prefix_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    prefix_lens: jax.Array,
    *,
    scale: float,
    num_splits: int | None = None,
    stages: int = STAGES,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Attention of each tile row's query tokens over the first ``prefix_lens[b]`` positions
    of its page table, every token seeing all of them (no causal mask: the prefix lies
    before every new token).

    Args:
      q: ``[B, D, H, hd]`` (``D * H // KVH <= 64``: ``tokens_per_tile``); k_pages, v_pages:
        ``[P, page_size, KVH, hd]`` (q's dtype).
      page_table: int32 ``[B, max_pages]``; prefix_lens: int32 ``[B]`` (0: the tile row
        reads nothing: out 0, lse ``-inf``).
      scale: the scores' scale.
      num_splits: programs per (tile row, KV head) (None: ``pick_num_splits``).
      stages: the kernel's ring of key and value buffers.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      float32 ``(out [B, D, H, hd], lse [B, D, H])``, lse the natural log of each token's sum
      of ``exp(scale * q . k)`` over the positions it saw.
    """
    if q.ndim != 4:
        raise ValueError(f"{_PREFIX_OP}: q must be [B, D, H, hd]; got {q.shape}")
    _check(_PREFIX_OP, q, k_pages, v_pages, page_table, prefix_lens, "prefix_lens")
    reason = unsupported_reason(q, k_pages) if impl != "reference" else None
    choice = resolve_impl(_PREFIX_OP, impl, reason)
    if choice == "reference":
        return paged_prefix_attention_reference(
            q, k_pages, v_pages, page_table, prefix_lens, scale=scale
        )
    stages = _stages(_PREFIX_OP, q, stages)
    return _kernel(
        q, k_pages, v_pages, page_table, prefix_lens, scale=float(scale),
        num_splits=call_splits(q, k_pages, page_table, num_splits), causal=False,
        stages=stages, interpret=choice == "interpret",
    )  # fmt: skip
