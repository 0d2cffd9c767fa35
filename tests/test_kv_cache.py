"""Paged KV cache: page allocator, page tables in the metadata, paged attention and the MoE
block against float64 oracles."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.backend import attention as attention_backend
from hybrid_jax.backend.attention import paged_attention
from hybrid_jax.kv_cache import (
    KVCache,
    KVCacheSpec,
    PageAllocator,
    PageError,
    PagesExhaustedError,
    accepted_path,
    commit_tree_kv,
    init_kv_cache,
    pages_needed,
)
from hybrid_jax.layers.moe import MoEConfig, SparseMoE
from hybrid_jax.metadata import BucketPolicy, MetadataError, PageIds, RowSpec, build_metadata
from hybrid_jax.modes import ForwardMode, LayerKind, UnsupportedForwardModeError
from pallas_kernels._common import on_hopper_gpu

M = ForwardMode
PAGE = 4
POLICY = BucketPolicy(
    batch_buckets=(1, 2, 4), token_buckets=(8, 16, 32), num_draft_tokens=3, page_size=PAGE,
    max_context=24,
)  # fmt: skip
NUM_PAGES = 16


# ---------------------------------------------------------------- page allocator


def test_allocator_hands_out_lowest_free_pages_and_never_the_pad_page():
    alloc = PageAllocator(6, PAGE)
    assert alloc.allocate(3) == [1, 2, 3]
    alloc.free([2])
    assert alloc.allocate(2) == [2, 4]
    assert alloc.used_pages == (1, 2, 3, 4)
    assert (alloc.capacity, alloc.num_free) == (5, 1)


def test_allocator_exhaustion_names_counts_and_changes_nothing():
    alloc = PageAllocator(4, PAGE)
    alloc.allocate(2)
    with pytest.raises(
        PagesExhaustedError, match=r"cannot allocate 2 pages: .* 3 real pages .* 1 free"
    ):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert alloc.allocate(1) == [3]


@pytest.mark.parametrize(
    "pages, message",
    [
        ([0], "pad page"),
        ([9], r"outside the cache \(pages 1..5\)"),
        ([1, 1], "appears twice"),
        ([1, 2], "pages\\[1\\]=2 is not allocated"),
        (["1"], "not an int page"),
    ],
)
def test_free_rejects_bad_pages_atomically(pages, message):
    alloc = PageAllocator(6, PAGE)
    alloc.allocate(1)
    with pytest.raises(PageError, match=message):
        alloc.free(pages)
    assert alloc.used_pages == (1,)


def test_grow_adds_only_the_missing_pages():
    alloc = PageAllocator(8, PAGE)
    pages = alloc.grow([], 5)
    assert pages == [1, 2]
    assert alloc.grow(pages, 8) == [1, 2]
    assert alloc.grow(pages, 9) == [1, 2, 3]
    assert pages_needed(0, PAGE) == 0 and pages_needed(4, PAGE) == 1


def test_cache_geometry_is_validated():
    with pytest.raises(PageError, match="no real page"):
        init_kv_cache([KVCacheSpec(2, 8)], 1, PAGE)
    with pytest.raises(PageError, match="page_size=0"):
        PageAllocator(4, 0)
    cache = init_kv_cache([KVCacheSpec(2, 8, jnp.float32)] * 3, 5, PAGE)
    assert [k.shape for k in cache.k] == [(5, PAGE, 2, 8)] * 3


# ---------------------------------------------------------------- page tables


def test_page_table_holds_each_rows_pages_and_pads_with_page_zero():
    rows = [RowSpec(1, 5, 2, (7, 3)), RowSpec(2, 0, 9, (1, 2, 4))]
    meta = build_metadata(M.EXTEND, rows, POLICY, num_slots=4, num_pages=NUM_PAGES)
    table = np.asarray(meta.pages.table)
    assert table.shape == (meta.batch_size, POLICY.max_pages) == (4, 6)
    np.testing.assert_array_equal(table[0], [7, 3, 0, 0, 0, 0])
    np.testing.assert_array_equal(table[1], [1, 2, 4, 0, 0, 0])
    np.testing.assert_array_equal(table[2:], 0)
    assert meta.pages.page_size == PAGE


def test_policy_without_context_has_an_empty_page_table():
    policy = BucketPolicy(batch_buckets=(1, 2), token_buckets=(8,))
    meta = build_metadata(M.DECODE, [RowSpec(1, 3, 1)], policy, num_slots=4)
    assert meta.pages.table.shape == (1, 0)
    with pytest.raises(MetadataError, match="pages nothing"):
        build_metadata(M.DECODE, [RowSpec(1, 3, 1, (1,))], policy, num_slots=4)


@pytest.mark.parametrize(
    "row, message",
    [
        (RowSpec(1, 6, 3, (1, 2)), r"has 2 pages for 9 positions; it needs 3"),
        (RowSpec(1, 0, 3, (0,)), "pad page"),
        (RowSpec(1, 0, 3, (16,)), r"outside the cache \(pages 1..15\)"),
        (RowSpec(1, 0, 3, (2, 2)), "also a page of rows\\[0\\]"),
        (RowSpec(1, 20, 5, (1, 2, 3, 4, 5, 6, 7)), "past max_context=24"),
        (RowSpec(1, 0, 3, (1, 2, 3, 4, 5, 6, 7)), "more than max_pages=6"),
        (RowSpec(1, 0, 3, (np.True_,)), r"pages\[0\]=np.True_ must be an int"),
        (RowSpec(1, 0, 3, (3, True)), r"pages\[1\]=True must be an int"),
        (RowSpec(1, 0, 3, (2.0,)), r"pages\[0\]=2.0 must be an int"),
        (RowSpec(1, 0, 3, (2**70,)), r"pages\[0\]=1180591620717411303424 is outside the cache"),
        (RowSpec(1, 0, 3, (-3,)), r"pages\[0\]=-3 is outside the cache"),
    ],
)
@pytest.mark.parametrize("ids", [tuple, PageIds])
def test_bad_pages_raise_naming_value_and_rule(row, message, ids):
    row = dataclasses.replace(row, pages=ids(row.pages))
    with pytest.raises(MetadataError, match=message):
        build_metadata(M.EXTEND, [row], POLICY, num_slots=4, num_pages=NUM_PAGES)


def test_page_ids_convert_once_and_give_the_table_a_tuple_gives():
    """A request's PageIds keep their int64 array across steps; rows holding them build the
    metadata that plain tuples build."""
    ids = PageIds([7, 3])
    row = RowSpec(1, 5, 2, ids)
    assert row.pages is ids and row == RowSpec(1, 5, 2, (7, 3))
    assert ids.array is ids.array and not ids.array.flags.writeable
    np.testing.assert_array_equal(ids.array, [7, 3])
    rows = [row, RowSpec(2, 0, 9, PageIds((1, 2, 4)))]
    got = build_metadata(M.EXTEND, rows, POLICY, num_slots=4, num_pages=NUM_PAGES)
    plain = [RowSpec(1, 5, 2, (7, 3)), RowSpec(2, 0, 9, (1, 2, 4))]
    want = build_metadata(M.EXTEND, plain, POLICY, num_slots=4, num_pages=NUM_PAGES)
    chex.assert_trees_all_equal(got, want)
    assert PageIds((1, True)).array is None  # a bool is no page id: the check names it


def test_pages_of_any_integer_type_pass_and_a_page_shared_across_rows_is_named():
    """The array check passes numpy integers and catches a page two rows hold; the error
    still names the first entry that breaks the rule."""
    rows = [RowSpec(1, 0, 3, (np.int32(1), np.int64(2))), RowSpec(2, 0, 3, (3, 4))]
    meta = build_metadata(M.EXTEND, rows, POLICY, num_slots=4, num_pages=NUM_PAGES)
    np.testing.assert_array_equal(meta.pages.table[:2, :2], [[1, 2], [3, 4]])
    rows = [RowSpec(1, 0, 3, (1, 2)), RowSpec(2, 0, 3, (3, 4)), RowSpec(3, 0, 3, (5, 4))]
    with pytest.raises(MetadataError, match=r"rows\[2\].pages\[1\]=4 is also a page of rows\[1\]"):
        build_metadata(M.EXTEND, rows, POLICY, num_slots=4, num_pages=NUM_PAGES)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(page_size=0), "page_size=0"),
        (dict(max_context=-4), "max_context=-4"),
        (dict(max_context=10), "round it up to 12"),
    ],
)
def test_policy_rejects_bad_paging(kw, message):
    with pytest.raises(MetadataError, match=message):
        BucketPolicy(**{"page_size": 4, "max_context": 0, **kw})


# ---------------------------------------------------------------- paged attention


def _oracle(q, keys, values, scale):
    """Causal GQA in float64 for one row: q [n, H, d] are the last n of the row's positions."""
    n, heads, _ = q.shape
    group = heads // keys.shape[1]
    total = keys.shape[0]
    out = np.zeros(q.shape)
    for t in range(n):
        pos = total - n + t
        for h in range(heads):
            s = keys[: pos + 1, h // group] @ q[t, h] * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ values[: pos + 1, h // group]
    return out


@pytest.mark.parametrize(
    ("mode", "block", "chunk"),
    [
        *((m, 128, 1024) for m in (M.EXTEND, M.MIXED, M.DRAFT_EXTEND, M.DECODE, M.TARGET_VERIFY)),
        # Ragged rows in blocks of 2 and 3 tokens: several blocks per row, a partial last one;
        # keys in chunks of one page (4) or two: several chunks per block, the online softmax.
        (M.EXTEND, 2, 4), (M.EXTEND, 3, 8), (M.MIXED, 2, 4), (M.DRAFT_EXTEND, 2, 4),
        # A chunk that is not whole pages rounds down to them (5 -> one page of 4).
        (M.EXTEND, 128, 5),
        # Decode and verify rows over several chunks of their keys (a loop), and in one.
        (M.DECODE, 128, 4), (M.TARGET_VERIFY, 128, 8), (M.TARGET_VERIFY, 128, 24),
    ],
)  # fmt: skip
# interpret: ragged steps split into the new tokens' segment attention and the cached prefix,
# merged by log-sum-exp (the kernel's jnp reference stands in for it on the CPU).
@pytest.mark.parametrize("impl", ["reference", "interpret"])
def test_paged_attention_matches_dense_causal_oracle_and_writes_only_its_pages(
    mode, block, chunk, impl, monkeypatch
):
    monkeypatch.setattr(attention_backend, "QUERY_BLOCK", block)
    monkeypatch.setattr(attention_backend, "KEY_CHUNK", chunk)
    assert attention_backend.key_chunk(PAGE) == max(PAGE, chunk // PAGE * PAGE)
    rng = np.random.default_rng(0)
    heads, kv_heads, dim = 4, 2, 8
    new = {M.DECODE: (1, 1), M.TARGET_VERIFY: (3, 3), M.DRAFT_EXTEND: (2, 3)}.get(mode, (5, 3))
    prefix = (6, 2)
    # Scattered, non-contiguous pages; the cache is poisoned everywhere else (NaN).
    rows = [RowSpec(1, prefix[0], new[0], (9, 2, 14)), RowSpec(2, prefix[1], new[1], (5, 11))]
    if mode in (M.EXTEND, M.MIXED, M.DRAFT_EXTEND):
        rows.append(RowSpec(3, 0, new[0], (7, 12)))  # a fresh row: nothing cached
    meta = build_metadata(mode, rows, POLICY, num_slots=4, num_pages=NUM_PAGES, batch_size=4)
    with jax.enable_x64(True):
        k_pages = np.full((NUM_PAGES, PAGE, kv_heads, dim), np.nan)
        v_pages = np.full((NUM_PAGES, PAGE, kv_heads, dim), np.nan)
        full_k, full_v = [], []
        for row in rows:
            total = row.prefix_len + row.num_tokens
            keys = rng.standard_normal((total, kv_heads, dim))
            values = rng.standard_normal((total, kv_heads, dim))
            for p in range(row.prefix_len):
                k_pages[row.pages[p // PAGE], p % PAGE] = keys[p]
                v_pages[row.pages[p // PAGE], p % PAGE] = values[p]
            full_k.append(keys)
            full_v.append(values)
        q = rng.standard_normal((meta.num_tokens, heads, dim))
        k = np.full((meta.num_tokens, kv_heads, dim), 7.0)  # padded tokens: finite junk
        v = np.full((meta.num_tokens, kv_heads, dim), 7.0)
        qsl = np.asarray(meta.query_start_loc)
        for r, row in enumerate(rows):
            k[qsl[r] : qsl[r + 1]] = full_k[r][row.prefix_len :]
            v[qsl[r] : qsl[r + 1]] = full_v[r][row.prefix_len :]
        out, k_after, v_after = jax.jit(paged_attention, static_argnames=("scale", "impl"))(
            *map(jnp.asarray, (q, k, v, k_pages, v_pages)), meta, scale=dim**-0.5, impl=impl
        )
        out, k_after = np.asarray(out), np.asarray(k_after)
    for r, row in enumerate(rows):
        want = _oracle(q[qsl[r] : qsl[r + 1]], full_k[r], full_v[r], dim**-0.5)
        got = out[qsl[r] : qsl[r + 1]]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-12
        for p in range(row.prefix_len + row.num_tokens):
            np.testing.assert_array_equal(k_after[row.pages[p // PAGE], p % PAGE], full_k[r][p])
    np.testing.assert_array_equal(out[qsl[len(rows)] :], 0)
    untouched = sorted(set(range(1, NUM_PAGES)) - {p for row in rows for p in row.pages})
    assert np.isnan(k_after[untouched]).all() and np.isnan(np.asarray(v_after)[untouched]).all()


def _bf16_step(mode, rows, policy, num_pages, *, heads=8, kv_heads=2, dim=64, seed=5):
    """A bf16 step of ``rows``: metadata, fresh q/k/v, and pages holding each row's prefix
    (NaN everywhere else)."""
    size = policy.page_size
    meta = build_metadata(mode, rows, policy, num_slots=len(rows) + 1, num_pages=num_pages)
    rng = np.random.default_rng(seed)
    k_pages = np.full((num_pages, size, kv_heads, dim), np.nan, np.float32)
    v_pages = np.full((num_pages, size, kv_heads, dim), np.nan, np.float32)
    for row in rows:
        for p in range(row.prefix_len):
            k_pages[row.pages[p // size], p % size] = rng.standard_normal((kv_heads, dim))
            v_pages[row.pages[p // size], p % size] = rng.standard_normal((kv_heads, dim))
    bf16 = jnp.bfloat16
    t = meta.num_tokens
    q = jnp.asarray(rng.standard_normal((t, heads, dim)), bf16)
    k = jnp.asarray(rng.standard_normal((t, kv_heads, dim)), bf16)
    v = jnp.asarray(rng.standard_normal((t, kv_heads, dim)), bf16)
    return meta, q, k, v, jnp.asarray(k_pages, bf16), jnp.asarray(v_pages, bf16)


def _interpret_against_reference(meta, q, k, v, k_pages, v_pages):
    """The step under ``impl="interpret"`` and ``"reference"`` (float32 outputs), after
    checking that both wrote the same pages."""
    run = jax.jit(paged_attention, static_argnames=("scale", "impl"))
    scale = q.shape[-1] ** -0.5
    got, k_after, _ = run(q, k, v, k_pages, v_pages, meta, scale=scale, impl="interpret")
    want, want_k, _ = run(q, k, v, k_pages, v_pages, meta, scale=scale, impl="reference")
    np.testing.assert_array_equal(np.asarray(k_after), np.asarray(want_k))
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@pytest.mark.parametrize("mode", [M.DECODE, M.TARGET_VERIFY])
def test_decode_and_verify_steps_take_the_paged_decode_kernel_when_asked(mode):
    """DECODE and chain TARGET_VERIFY with ``impl="interpret"`` run the paged decode kernel
    (bf16, head_dim 64, pages of 16) and agree with the jnp path; the cache is NaN outside
    the rows."""
    d = 1 if mode is M.DECODE else 3
    policy = BucketPolicy(batch_buckets=(4,), token_buckets=(4 * d,), page_size=16,
                          max_context=64, num_draft_tokens=3)  # fmt: skip
    rows = [RowSpec(1, 40, d, (3, 7, 1)), RowSpec(2, 12, d, (9,)), RowSpec(3, 0, d, (5,))]
    meta, q, k, v, k_pages, v_pages = _bf16_step(mode, rows, policy, num_pages=12)
    rows_q = q.reshape(4, d, *q.shape[1:])
    assert attention_backend._decode_kernel("interpret", rows_q, k_pages) == "interpret"
    assert attention_backend._decode_kernel("reference", rows_q, k_pages) is None
    # auto takes the kernel on an sm_90 GPU only.
    assert attention_backend._decode_kernel("auto", rows_q, k_pages) == (
        "pallas" if on_hopper_gpu() else None
    )
    got, want = _interpret_against_reference(meta, q, k, v, k_pages, v_pages)
    assert np.isfinite(got).all() and not got[3 * d :].any()  # the padded row: zeros
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_tree_verify_steps_take_the_paged_decode_kernel_when_asked():
    """Tree TARGET_VERIFY with ``impl="interpret"`` runs the paged decode kernel with the
    rows' tree masks and agrees with the jnp token-by-token path; a row whose drafts cross a
    page, a chain among the trees, a padded row."""
    d = 4
    policy = BucketPolicy(batch_buckets=(4,), token_buckets=(4 * d,), page_size=16,
                          max_context=64, num_draft_tokens=d, tree_drafts=True)  # fmt: skip
    rows = [
        RowSpec(1, 14, d, (3, 7), parents=(-1, 0, 0, 1)),
        RowSpec(2, 20, d, (9, 4), parents=(-1, 0, 1, 2)),
        RowSpec(3, 0, d, (5,), parents=(-1, 0, 0, 0)),
    ]
    meta, q, k, v, k_pages, v_pages = _bf16_step(M.TARGET_VERIFY, rows, policy, num_pages=12)
    assert meta.tree
    rows_q = q.reshape(4, d, *q.shape[1:])
    assert attention_backend._decode_kernel("interpret", rows_q, k_pages, tree=True) == (
        "interpret"
    )
    wide = jnp.zeros((4, 32, *q.shape[1:]), q.dtype)  # more nodes than a bitmask holds
    assert attention_backend._decode_kernel("interpret", wide, k_pages, tree=True) is None
    got, want = _interpret_against_reference(meta, q, k, v, k_pages, v_pages)
    assert np.isfinite(got).all() and not got[3 * d :].any()  # the padded row: zeros
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("mode", [M.EXTEND, M.MIXED])
def test_ragged_steps_read_cached_prefixes_in_the_paged_prefix_kernel_when_asked(mode):
    """A ragged step with ``impl="interpret"`` (bf16, head_dim 64, pages of 16) attends to its
    rows' cached prefixes in the prefix kernel's interpreter run (tile rows of 8 tokens: a
    20-token prompt chunk takes three) and agrees with the all-jnp path; a fresh row and the
    padding see no prefix, and the cache is NaN outside the rows."""
    policy = BucketPolicy(batch_buckets=(4,), token_buckets=(48,), page_size=16,
                          max_context=96)  # fmt: skip
    rows = [RowSpec(1, 40, 20, (3, 7, 1, 12)), RowSpec(2, 0, 9, (9,)), RowSpec(3, 17, 5, (5, 6))]
    if mode is M.MIXED:
        rows.append(RowSpec(4, 30, 1, (10, 11)))  # a decode row among the prompt chunks
    meta, q, k, v, k_pages, v_pages = _bf16_step(mode, rows, policy, num_pages=16, seed=6)
    assert attention_backend._prefix_kernel("interpret", "reference", q, k_pages) == "interpret"
    assert attention_backend._prefix_kernel("reference", "reference", q, k_pages) is None
    got, want = _interpret_against_reference(meta, q, k, v, k_pages, v_pages)
    end = int(np.asarray(meta.query_start_loc)[len(rows)])
    assert np.isfinite(got).all() and not got[end:].any()  # padding tokens: zeros
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_paged_attention_refuses_a_mode_at_trace_time_and_a_missing_page_table():
    meta = build_metadata(M.DECODE, [RowSpec(1, 0, 1, (1,))], POLICY, num_slots=4)
    pages = jnp.zeros((4, PAGE, 1, 8))
    x = jnp.zeros((1, 1, 8))
    bad = dataclasses.replace(meta, mode=M.SPLIT_PREFILL)
    with pytest.raises(UnsupportedForwardModeError, match="SPLIT_PREFILL") as err:
        jax.eval_shape(lambda m: paged_attention(x, x, x, pages, pages, m, scale=1.0), bad)
    assert err.value.layer_kind is LayerKind.FULL_ATTENTION
    flat = build_metadata(M.DECODE, [RowSpec(1, 0, 1)], BucketPolicy(batch_buckets=(1,)),
                          num_slots=4)  # fmt: skip
    with pytest.raises(ValueError, match="max_context > 0"):
        paged_attention(x, x, x, pages, pages, flat, scale=1.0)
    with pytest.raises(ValueError, match="one page_size"):
        paged_attention(x, x, x, jnp.zeros((4, 8, 1, 8)), jnp.zeros((4, 8, 1, 8)), meta, scale=1.0)


# ---------------------------------------------------------------- tree drafts

TREE_POLICY = dataclasses.replace(POLICY, tree_drafts=True)


def test_tree_attention_sees_the_context_and_the_root_path_only():
    rng = np.random.default_rng(4)
    heads, kv_heads, dim, d = 4, 2, 8, 3
    trees = ((-1, 0, 0), (-1, 0, 1))
    rows = [
        RowSpec(1, 6, d, (9, 2, 14), parents=trees[0]),
        RowSpec(2, 2, d, (5, 11), parents=trees[1]),
    ]
    meta = build_metadata(
        M.TARGET_VERIFY, rows, TREE_POLICY, num_slots=4, num_pages=NUM_PAGES, batch_size=4
    )
    assert meta.tree
    with jax.enable_x64(True):
        k_pages = np.full((NUM_PAGES, PAGE, kv_heads, dim), np.nan)
        v_pages = np.full((NUM_PAGES, PAGE, kv_heads, dim), np.nan)
        context = []
        for row in rows:
            keys = rng.standard_normal((row.prefix_len, kv_heads, dim))
            values = rng.standard_normal((row.prefix_len, kv_heads, dim))
            for p in range(row.prefix_len):
                k_pages[row.pages[p // PAGE], p % PAGE] = keys[p]
                v_pages[row.pages[p // PAGE], p % PAGE] = values[p]
            context.append((keys, values))
        q = rng.standard_normal((meta.num_tokens, heads, dim))
        k = rng.standard_normal((meta.num_tokens, kv_heads, dim))
        v = rng.standard_normal((meta.num_tokens, kv_heads, dim))
        out, k_after, _ = jax.jit(paged_attention, static_argnames="scale")(
            *map(jnp.asarray, (q, k, v, k_pages, v_pages)), meta, scale=dim**-0.5
        )
        out, k_after = np.asarray(out), np.asarray(k_after)
    for r, (row, tree) in enumerate(zip(rows, trees, strict=True)):
        for i in range(d):
            t = r * d + i
            path = [i]
            while tree[path[0]] >= 0:
                path.insert(0, tree[path[0]])
            keys = np.concatenate([context[r][0], k[[r * d + j for j in path]]])
            values = np.concatenate([context[r][1], v[[r * d + j for j in path]]])
            want = _oracle(q[t][None], keys, values, dim**-0.5)[0]
            assert np.linalg.norm(out[t] - want) / np.linalg.norm(want) < 1e-12, (r, i)
            at = row.prefix_len + i  # stored at its index in the row, not at its depth
            np.testing.assert_array_equal(k_after[row.pages[at // PAGE], at % PAGE], k[t])
    np.testing.assert_array_equal(out[len(rows) * d :], 0)  # padded rows


def test_accepted_path_lists_the_root_path_of_the_accepted_node():
    parents = jnp.asarray([[-1, 0, 0, 2], [-1, 0, 1, 2], [-1, 0, 0, 1], [-1, 0, 0, 1]])
    path = accepted_path(parents.astype(jnp.int32), jnp.asarray([3, 3, 2, -1], jnp.int32))
    assert np.asarray(path).tolist() == [
        [0, 2, 3, -1],
        [0, 1, 2, 3],
        [0, 2, -1, -1],
        [-1, -1, -1, -1],
    ]


def test_commit_tree_kv_moves_the_accepted_path_and_nothing_else():
    rng = np.random.default_rng(5)
    pages = np.asarray([[3, 8, 0], [6, 1, 12], [0, 0, 0]], np.int32)
    prefix = np.asarray([2, 5, 0], np.int32)
    parents = np.asarray([[-1, 0, 0, 2], [-1, 0, 1, 1], [-1, 0, 1, 2]], np.int32)
    accepted = np.asarray([3, 3, -1], np.int32)  # paths 0-2-3 and 0-1-3; row 2 keeps all
    shape = (2, NUM_PAGES, PAGE, 2, 8)  # two layers: both move
    cache = KVCache(
        k=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        v=jnp.asarray(rng.standard_normal(shape), jnp.float32),
        num_pages=NUM_PAGES,
        page_size=PAGE,
    )
    after = jax.jit(commit_tree_kv)(cache, *map(jnp.asarray, (pages, prefix, parents, accepted)))
    for layer in range(2):
        old = [np.asarray(cache.k[layer]), np.asarray(cache.v[layer])]
        want = [a.copy() for a in old]
        for r, path in enumerate(([0, 2, 3], [0, 1, 3])):
            for depth, node in enumerate(path):
                src, dst = prefix[r] + node, prefix[r] + depth
                for w, o in zip(want, old, strict=True):
                    w[pages[r, dst // PAGE], dst % PAGE] = o[pages[r, src // PAGE], src % PAGE]
        np.testing.assert_array_equal(np.asarray(after.k[layer]), want[0])
        np.testing.assert_array_equal(np.asarray(after.v[layer]), want[1])


# ---------------------------------------------------------------- MoE


@pytest.mark.parametrize("norm_topk", [True, False])
def test_sparse_moe_matches_per_token_oracle(norm_topk):
    config = MoEConfig(hidden_size=16, num_experts=5, top_k=2, intermediate_size=8,
                       shared_intermediate_size=12, norm_topk_prob=norm_topk)  # fmt: skip
    moe = SparseMoE(config, rngs=nnx.Rngs(3))
    x = np.random.default_rng(1).standard_normal((9, 16)).astype(np.float32)
    got = np.asarray(jax.jit(lambda m, a: m(a))(moe, jnp.asarray(x)))
    params = {k: np.asarray(v, np.float64) for k, v in {
        "router": moe.gate.kernel[...],
        "gate": moe.gate_up_proj[..., :8], "up": moe.gate_up_proj[..., 8:],
        "down": moe.down_proj[...], "sg": moe.shared_expert.gate_proj.kernel[...],
        "su": moe.shared_expert.up_proj.kernel[...], "sd": moe.shared_expert.down_proj.kernel[...],
        "sgate": moe.shared_expert_gate.kernel[...],
    }.items()}  # fmt: skip

    def silu(a):
        return a / (1 + np.exp(-a))

    want = np.zeros(x.shape)
    for t, xt in enumerate(x.astype(np.float64)):
        logits = xt @ params["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs)[:2]
        weights = probs[top] / (probs[top].sum() if norm_topk else 1.0)
        for e, w in zip(top, weights, strict=True):
            h = silu(xt @ params["gate"][e]) * (xt @ params["up"][e])
            want[t] += w * (h @ params["down"][e])
        shared = (silu(xt @ params["sg"]) * (xt @ params["su"])) @ params["sd"]
        want[t] += shared / (1 + np.exp(-(xt @ params["sgate"])))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    assert np.asarray(moe(jnp.zeros((0, 16)))).shape == (0, 16)


def test_sparse_moe_computes_the_experts_of_real_tokens_only():
    config = MoEConfig(hidden_size=16, num_experts=5, top_k=2, intermediate_size=8,
                       shared_intermediate_size=12)  # fmt: skip
    moe = SparseMoE(config, rngs=nnx.Rngs(4))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((7, 16)), jnp.float32)
    real = jnp.arange(7) < 3
    got = jax.jit(lambda m, a, r: m(a, r))(moe, x, real)
    # Real tokens: what they get with every token real; padding: the shared expert alone.
    np.testing.assert_allclose(np.asarray(got[:3]), np.asarray(moe(x)[:3]), rtol=1e-6, atol=1e-6)
    shared = jax.nn.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    np.testing.assert_allclose(np.asarray(got[3:]), np.asarray(shared[3:]), rtol=1e-6, atol=1e-6)
    assert np.abs(np.asarray(got[3:] - moe(x)[3:])).max() > 1e-3  # the routed part is gone


def test_decode_rows_kernel_writes_what_the_layer_writes_in_jnp():
    """A gated attention layer with q/k norms and a half-turned head (bf16, 8 query / 2 KV
    heads of 128): its DECODE step under ``impl="interpret"`` forms the norms, the rotary and
    the page writes in the rows kernel (``decode_rows``) and agrees with ``reference``; the
    pages are NaN wherever neither wrote. Other layouts and ``reference`` keep jnp."""
    from hybrid_jax.layers.attention import Attention, AttentionConfig

    config = AttentionConfig(64, 8, 2, 128, partial_rotary_factor=0.5, dtype="bfloat16")
    layer = Attention(config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    for norm in (layer.q_norm, layer.k_norm):
        norm.weight.set_value(jnp.asarray(0.3 * rng.standard_normal(128), jnp.float32))
    policy = BucketPolicy(batch_buckets=(4,), token_buckets=(4,), page_size=16, max_context=64)
    rows = [RowSpec(1, 40, 1, (3, 7, 1)), RowSpec(2, 12, 1, (9,)), RowSpec(3, 0, 1, (5,))]
    meta, _, _, _, k_pages, v_pages = _bf16_step(M.DECODE, rows, policy, num_pages=12, dim=128)
    x = jnp.asarray(rng.standard_normal((meta.num_tokens, 64)), jnp.bfloat16)
    q = jnp.zeros((4, 8, 256), jnp.bfloat16)
    kv = jnp.zeros((4, 2, 128), jnp.bfloat16)
    options = dict(q_scale=None, k_scale=None, eps=1e-6, rotary_dim=64, theta=1e4)
    assert attention_backend.decode_rows(q, kv, kv, k_pages, v_pages, meta, **options,
                                         impl="reference") is None  # fmt: skip
    assert attention_backend.decode_rows(q, kv, kv, k_pages, v_pages, meta, **options,
                                         impl="interpret") is not None  # fmt: skip
    extend = build_metadata(M.EXTEND, [RowSpec(1, 0, 4, (3,))], policy, num_slots=4,
                            num_pages=12)  # fmt: skip
    assert attention_backend.decode_rows(q, kv, kv, k_pages, v_pages, extend, **options,
                                         impl="interpret") is None  # fmt: skip
    step = jax.jit(lambda impl, *a: layer(*a, impl=impl), static_argnums=0)
    got = step("interpret", x, k_pages, v_pages, meta)
    want = step("reference", x, k_pages, v_pages, meta)
    assert np.linalg.norm(np.asarray(got.y, np.float32) - np.asarray(want.y, np.float32)) < (
        2e-2 * np.linalg.norm(np.asarray(want.y, np.float32))
    )
    for a, b in ((got.k_pages, want.k_pages), (got.v_pages, want.v_pages)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.isnan(a[1:]), np.isnan(b[1:]))  # page 0: the pad page
        live = ~np.isnan(b[1:])
        np.testing.assert_allclose(a[1:][live], b[1:][live], rtol=2e-2, atol=2e-2)
    for row in rows:  # the step's own entry, written by both
        p = row.prefix_len
        entry = np.asarray(got.k_pages[row.pages[p // 16], p % 16], np.float32)
        assert np.isfinite(entry).all()
