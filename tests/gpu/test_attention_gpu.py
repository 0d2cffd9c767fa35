"""Ragged prefill attention on an sm_90 GPU at Qwen3-Next attention shapes: the segment kernel
(tokamax's Mosaic GPU flash attention) against its jnp reference, and the paged attention's
split path (kernel + cached prefix in the paged prefix kernel + merge) against its all-jnp
path, with the cache poisoned outside the rows, and the paged decode and prefix kernels
against their references; skipped without tokamax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.backend.attention import paged_attention
from hybrid_jax.metadata import BucketPolicy, ForwardMode, RowSpec, build_metadata
from pallas_kernels import attention
from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 2, 256), (32, 8, 128), (8, 8, 64)])
def test_segment_kernel_matches_the_reference(heads, kv_heads, dim):
    lengths = (1000, 1, 2047, 3, 777)
    tokens = 4096
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    segment_start = np.concatenate(
        [np.repeat(starts, lengths), np.arange(sum(lengths), tokens)]
    ).astype(np.int32)
    keys = jax.random.split(jax.random.key(dim), 3)
    q = jax.random.normal(keys[0], (tokens, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (tokens, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (tokens, kv_heads, dim), jnp.bfloat16)
    assert attention.unsupported_reason(q, k) is None, attention.unsupported_reason(q, k)
    run = jax.jit(attention.segment_causal_attention, static_argnames=("scale", "impl"))
    got, got_lse = run(q, k, v, jnp.asarray(segment_start), scale=dim**-0.5, impl="pallas")
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want, want_lse = run(
        f32(q), f32(k), f32(v), jnp.asarray(segment_start), scale=dim**-0.5, impl="reference"
    )
    got, want = np.asarray(got, np.float32), np.asarray(want)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    assert np.abs(np.asarray(got_lse) - np.asarray(want_lse)).max() < 2e-2


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED])
def test_split_paged_attention_matches_the_all_jnp_path(mode):
    page, heads, kv_heads, dim = 16, 16, 2, 256
    rows_shape = [(0, 700), (1500, 300), (33, 1), (0, 1024)]  # (prefix, new) per row
    per_row = [-(-(p + n) // page) for p, n in rows_shape]
    num_pages = sum(per_row) + 8
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(1, num_pages))
    pages, used = [], 0
    for count in per_row:
        pages.append(tuple(int(p) for p in order[used : used + count]))
        used += count
    specs = [RowSpec(r + 1, p, n, pages[r]) for r, (p, n) in enumerate(rows_shape)]
    policy = BucketPolicy(
        batch_buckets=(4,), token_buckets=(2048,), page_size=page, max_context=2048
    )
    meta = build_metadata(mode, specs, policy, num_slots=8, num_pages=num_pages)
    keys = jax.random.split(jax.random.key(1), 5)
    shape = (num_pages, page, kv_heads, dim)
    cached_k = jax.random.normal(keys[0], shape, jnp.bfloat16)
    cached_v = jax.random.normal(keys[1], shape, jnp.bfloat16)
    # Pages no row holds are NaN: the split path must never read them.
    outside = np.setdiff1d(np.arange(1, num_pages), np.concatenate([np.array(p) for p in pages]))
    cached_k = cached_k.at[outside].set(jnp.nan)
    cached_v = cached_v.at[outside].set(jnp.nan)
    tokens = meta.num_tokens
    q = jax.random.normal(keys[2], (tokens, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[3], (tokens, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[4], (tokens, kv_heads, dim), jnp.bfloat16)
    run = jax.jit(paged_attention, static_argnames=("scale", "impl"))
    got, got_k, _ = run(q, k, v, cached_k, cached_v, meta, scale=dim**-0.5, impl="pallas")
    want, want_k, _ = run(q, k, v, cached_k, cached_v, meta, scale=dim**-0.5, impl="reference")
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    # Page 0 is the pad page: padded tokens race to write it, so it is compared nowhere.
    np.testing.assert_array_equal(
        np.asarray(got_k[1:], np.float32), np.asarray(want_k[1:], np.float32)
    )
    real = int(np.asarray(meta.query_start_loc)[-1])
    np.testing.assert_array_equal(got[real:], 0)


def _poisoned_cache(batch, kv_heads, dim, page_size, seed, min_len=0):
    """Ragged lengths up to 8k (an empty row, one position, whole pages; at least
    ``min_len``), pages scattered over the cache, NaN in every entry no row holds: (k, v,
    page table, lengths)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 8192, batch).astype(np.int32)
    if batch >= 3:
        lens[:3] = [0, 1, 4 * page_size]
    lens = np.maximum(lens, min_len)
    max_pages = -(-8192 // page_size)
    num_pages = batch * max_pages + 1
    pages = rng.permutation(np.arange(1, num_pages)).reshape(batch, max_pages).astype(np.int32)
    keys = jax.random.split(jax.random.key(seed), 2)
    shape = (num_pages, page_size, kv_heads, dim)
    k = jax.random.normal(keys[0], shape, jnp.bfloat16)
    v = jax.random.normal(keys[1], shape, jnp.bfloat16)
    position = pages[..., None] * page_size + np.arange(page_size)  # [B, max_pages, page]
    held = np.arange(max_pages * page_size).reshape(max_pages, page_size) < lens[:, None, None]
    live = np.zeros(num_pages * page_size, bool)
    live[position[held]] = True
    live = jnp.asarray(live.reshape(num_pages, page_size, 1, 1))
    k, v = jnp.where(live, k, jnp.nan), jnp.where(live, v, jnp.nan)
    return k, v, jnp.asarray(pages), lens


SHAPES = pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "dim", "page_size"),
    [(64, 16, 2, 256, 16), (1, 16, 2, 256, 16), (8, 24, 4, 256, 64), (16, 32, 8, 128, 32)],
    ids=["qwen-b64", "qwen-b1", "27b-like", "nemotron-like"],
)


@SHAPES
@pytest.mark.parametrize("stages", [1, 2, 3], ids=["one-stage", "two-stages", "three-stages"])
def test_paged_decode_kernel_matches_its_reference_with_poisoned_pages(
    batch, heads, kv_heads, dim, page_size, stages
):
    from pallas_kernels.attention import paged_decode as pd

    k, v, table, lens = _poisoned_cache(batch, kv_heads, dim, page_size, dim + batch)
    q = jax.random.normal(jax.random.key(1), (batch, heads, dim), jnp.bfloat16)
    assert pd.unsupported_reason(q, k) is None
    args = (q, k, v, table, jnp.asarray(lens))
    got = pd.paged_decode_attention(*args, scale=dim**-0.5, stages=stages, impl="pallas")
    want = pd.paged_decode_attention(*args, scale=dim**-0.5, impl="reference")
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "an entry no row holds reached the output"
    assert not got[lens == 0].any()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "page_size"),
    [(16, 2, 256, 16), (16, 4, 256, 64), (32, 8, 128, 32)],
    ids=["qwen", "9b-like", "nemotron-like"],
)
def test_splits_merged_and_gated_in_the_launch_over_one_counters_buffer(
    batch, heads, kv_heads, dim, page_size
):
    """20 decode launches in a scan, each merging its splits (as many as the call takes, at
    most ``MERGE_LOADS`` partial rows) and gating them itself, counting on one buffer: each
    output within bf16 rounding of the gated reference, empty rows zero, the buffer zero
    after them."""
    from pallas_kernels.attention import paged_decode as pd

    k, v, table, lens = _poisoned_cache(batch, kv_heads, dim, page_size, dim + batch)
    keys = jax.random.split(jax.random.key(5), 2)
    qs = jax.random.normal(keys[0], (20, batch, heads, dim), jnp.bfloat16)
    gates = jax.random.normal(keys[1], (20, batch, heads, 2 * dim), jnp.bfloat16)
    rows = heads // kv_heads
    splits = min(pd.call_splits(qs[0], k, table), pd.MERGE_LOADS // rows)
    assert pd.merge_unsupported_reason(qs[0], kv_heads, splits) is None
    args = (k, v, table, jnp.asarray(lens))
    call = dict(scale=dim**-0.5, num_splits=splits)

    @jax.jit
    def merged(qs, gates):
        counters = jax.new_ref(jnp.zeros((batch * kv_heads,), jnp.int32))

        def body(_, qg):
            out = pd.paged_decode_attention(
                qg[0], *args, **call, gate=qg[1], merge_in_launch=True, counters=counters,
                impl="pallas",
            )  # fmt: skip
            return None, out

        outs = jax.lax.scan(body, None, (qs, gates))[1]
        return outs, counters[...]

    outs, counters = merged(qs, gates)
    assert not np.asarray(counters).any(), "the launches leave their counters at zero"
    for i in (0, 7, 19):
        want = pd.paged_decode_attention(qs[i], *args, **call, gate=gates[i], impl="reference")
        got, want = np.asarray(outs[i], np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all(), "an entry no row holds reached the output"
        assert not got[lens == 0].any()
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@SHAPES
def test_paged_decode_kernel_takes_tree_drafts(batch, heads, kv_heads, dim, page_size):
    """Random topological trees of as many nodes as a tile holds (up to 31), rows of at
    least that many positions."""
    from pallas_kernels.attention import paged_decode as pd

    nodes = min(pd.MAX_TREE_NODES, 64 // (heads // kv_heads))
    k, v, table, lens = _poisoned_cache(batch, kv_heads, dim, page_size, dim + batch + 2, nodes)
    rng = np.random.default_rng(batch)
    parents = np.full((batch, nodes), -1, np.int32)
    for t in range(1, nodes):
        parents[:, t] = rng.integers(0, t, batch)
    q = jax.random.normal(jax.random.key(3), (batch, nodes, heads, dim), jnp.bfloat16)
    args = (q, k, v, table, jnp.asarray(lens))
    tree = dict(scale=dim**-0.5, parents=jnp.asarray(parents))
    got = np.asarray(pd.paged_decode_attention(*args, **tree, impl="pallas"), np.float32)
    want = np.asarray(pd.paged_decode_attention(*args, **tree, impl="reference"), np.float32)
    assert np.isfinite(got).all(), "an entry no row holds reached the output"
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@SHAPES
def test_paged_prefix_kernel_matches_its_reference_with_poisoned_pages(
    batch, heads, kv_heads, dim, page_size
):
    """Tile rows of a full tile's tokens over prefixes up to 8k: out and log-sum-exp."""
    from pallas_kernels.attention import paged_decode as pd

    k, v, table, lens = _poisoned_cache(batch, kv_heads, dim, page_size, dim + batch + 1)
    tokens = pd.tokens_per_tile(heads, kv_heads)
    q = jax.random.normal(jax.random.key(2), (batch, tokens, heads, dim), jnp.bfloat16)
    args = (q, k, v, table, jnp.asarray(lens))
    got, lse = pd.paged_prefix_attention(*args, scale=dim**-0.5, impl="pallas")
    want, want_lse = pd.paged_prefix_attention(*args, scale=dim**-0.5, impl="reference")
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all(), "an entry no row holds reached the output"
    empty = lens == 0
    assert not got[empty].any() and np.isneginf(np.asarray(lse)[empty]).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(want_lse)[~empty], atol=2e-2)
