"""paged_decode_attention and paged_prefix_attention: the Mosaic GPU kernel in the
interpreter and the jnp references, against float64 oracles written row by row in numpy, on
fresh random inputs with every position past a row's length (and the pad page) poisoned with
NaN; the kernel also lowers for the GPU at production shapes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import rel

from pallas_kernels.attention import paged_decode as pd

SCALE = 0.125


def _case(seed, *, batch, heads, kv_heads, head_dim, page_size, max_pages, lens, tokens=0):
    rng = np.random.default_rng(seed)
    num_pages = batch * max_pages + 1
    k = rng.standard_normal((num_pages, page_size, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, kv_heads, head_dim)).astype(np.float32)
    table = np.zeros((batch, max_pages), np.int32)
    pages = rng.permutation(np.arange(1, num_pages))
    for b, length in enumerate(lens):
        used = -(-length // page_size)
        table[b, :used] = pages[:used]
        pages = pages[used:]
        for p in range(used):  # stale entries past the row's length hold NaN
            tail = slice(max(0, length - p * page_size), page_size)
            k[table[b, p], tail] = np.nan
            v[table[b, p], tail] = np.nan
    k[0] = v[0] = np.nan  # the pad page, which unused table entries name
    # tokens = 0: decode's [B, H, hd]; else a verify chain's [B, D, H, hd]
    q = rng.standard_normal((batch, *((tokens,) if tokens else ()), heads, head_dim))
    q = q.astype(np.float32)
    bf16 = jnp.bfloat16
    return dict(
        q=jnp.asarray(q, bf16), k_pages=jnp.asarray(k, bf16), v_pages=jnp.asarray(v, bf16),
        page_table=jnp.asarray(table), context_lens=jnp.asarray(np.asarray(lens, np.int32)),
    )  # fmt: skip


def _oracle(q, k_pages, v_pages, page_table, context_lens, parents=None):
    """Row by row, token by token in float64 numpy, from the bf16 values the kernel reads:
    token t of D sees positions 0 .. context_lens[b] - D + t, or with ``parents`` the
    positions before the D and those of the nodes on t's root path."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    q4 = q if q.ndim == 4 else q[:, None]
    batch, tokens, heads, head_dim = q4.shape
    page_size, kv_heads = k.shape[1:3]
    out = np.zeros_like(q4)
    for b in range(batch):
        n = int(context_lens[b])
        if n == 0:
            continue
        pages = np.asarray(page_table[b])[: -(-n // page_size)]
        keys = k[pages].reshape(-1, kv_heads, head_dim)
        values = v[pages].reshape(-1, kv_heads, head_dim)
        for t in range(tokens):
            seen = list(range(n - tokens + t + 1))
            if parents is not None:
                path, node = [], t
                while node >= 0:
                    path.append(n - tokens + node)
                    node = int(parents[b, node])
                seen = list(range(n - tokens)) + sorted(path)
            for h in range(heads):
                g = h // (heads // kv_heads)
                s = keys[seen, g] @ q4[b, t, h] * SCALE
                w = np.exp(s - s.max())
                out[b, t, h] = w @ values[seen, g] / w.sum()
    return out.reshape(q.shape)


CASES = {
    # lengths: empty row, one position, mid-page, a page's end, several 64-position blocks
    "gqa8-d128-p16": dict(batch=5, heads=8, kv_heads=1, head_dim=128, page_size=16,
                          max_pages=12, lens=[0, 1, 37, 64, 190]),
    "gqa4-d64-p32": dict(batch=3, heads=8, kv_heads=2, head_dim=64, page_size=32,
                         max_pages=6, lens=[150, 33, 96]),
    "gqa1-d64-p64": dict(batch=2, heads=2, kv_heads=2, head_dim=64, page_size=64,
                         max_pages=4, lens=[200, 64]),
    # verify chains of 4 tokens: 4 x 8 and 4 x 4 tile rows; a row whose chain starts a block
    "verify4-gqa8": dict(batch=3, heads=8, kv_heads=1, head_dim=64, page_size=16,
                         max_pages=12, lens=[4, 67, 190], tokens=4),
    "verify4-gqa4": dict(batch=2, heads=8, kv_heads=2, head_dim=128, page_size=32,
                         max_pages=4, lens=[100, 9], tokens=4),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("num_splits", "stages"), [(1, 2), (3, 2), (3, 1), (1, 3), (3, 4)])
def test_kernel_in_the_interpreter_matches_the_oracle(name, num_splits, stages):
    args = _case(1, **CASES[name])
    want = _oracle(**args)
    got = pd.paged_decode_attention(
        **args, scale=SCALE, num_splits=num_splits, stages=stages, impl="interpret"
    )
    got = np.asarray(got, np.float64)
    assert got.shape == args["q"].shape
    assert np.isfinite(got).all(), "a NaN past some row's length reached the output"
    empty = np.asarray(args["context_lens"]) == 0
    assert not got[empty].any(), "a row of length 0 must get zeros"
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_oracle(name):
    args = _case(2, **CASES[name])
    with jax.enable_x64(True):
        wide = {n: jnp.asarray(a, jnp.float64) if a.dtype == jnp.bfloat16 else a
                for n, a in args.items()}  # fmt: skip
        got = pd.paged_decode_attention(**wide, scale=SCALE, impl="reference")
        assert got.dtype == jnp.float64
    assert rel(got, _oracle(**args)) < 1e-12


def _gate(seed: int, q: jax.Array) -> jax.Array:
    """A gated attention's packed ``[q | gate]`` rows: random, the gate in each head's last
    ``hd`` values."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((*q.shape[:-1], 2 * q.shape[-1])), jnp.bfloat16)


MERGE_CASES = {
    # (case, splits): up to 64 partial rows a (row, KV head), 8 tile rows x 8 splits at most
    "gqa8-d128-p16-s1": ("gqa8-d128-p16", 1),
    "gqa8-d128-p16-s3": ("gqa8-d128-p16", 3),
    "gqa8-d128-p16-s8": ("gqa8-d128-p16", 8),
    "verify4-gqa4-s4": ("verify4-gqa4", 4),
    "qwen-d256-s5": (dict(batch=3, heads=16, kv_heads=2, head_dim=256, page_size=32,
                          max_pages=8, lens=[0, 250, 17]), 5),
}  # fmt: skip


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("name", list(MERGE_CASES))
def test_splits_merged_in_the_launch_match_the_oracle_and_the_merge_after_it(name, gated):
    """The last of a (row, KV head)'s programs merges the splits (and gates them) itself:
    bit for bit the output of the XLA merge after the launch, within bf16 rounding of the
    float64 oracle, zeros for empty rows, and the shared counters left at zero."""
    case, num_splits = MERGE_CASES[name]
    args = _case(3, **(CASES[case] if isinstance(case, str) else case))
    q, kv_heads = args["q"], args["k_pages"].shape[2]
    assert pd.merge_unsupported_reason(q, kv_heads, num_splits) is None
    gate = _gate(4, q) if gated else None
    want = _oracle(**args)
    if gated:
        want = want / (1 + np.exp(-np.asarray(gate[..., q.shape[-1] :], np.float64)))
    counters = jax.new_ref(jnp.zeros((q.shape[0] * kv_heads + 3,), jnp.int32))
    call = functools.partial(
        pd.paged_decode_attention, **args, scale=SCALE, num_splits=num_splits, gate=gate,
        impl="interpret",
    )  # fmt: skip
    got = call(merge_in_launch=True, counters=counters)
    after = call(merge_in_launch=False)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(after, np.float32))
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    assert not got[np.asarray(args["context_lens"]) == 0].any(), "empty rows get zeros"
    assert rel(got, want) < 1e-2
    assert not np.asarray(counters[...]).any(), "the launch leaves its counters at zero"


def test_a_merge_in_the_launch_it_cannot_take_says_why():
    pages = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    q = jnp.zeros((2, 16, 128), jnp.bfloat16)  # 8 tile rows a KV head
    call = functools.partial(pd.paged_decode_attention, k_pages=pages, v_pages=pages,
                             page_table=table, context_lens=lens, scale=1.0,
                             merge_in_launch=True, impl="interpret")  # fmt: skip
    assert pd.merge_unsupported_reason(q, 2, 8) is None
    assert "8 tile rows x 9 splits are more than the 64" in pd.merge_unsupported_reason(q, 2, 9)
    with pytest.raises(ValueError, match=r"merge_in_launch: 8 tile rows x 9 splits"):
        call(q, num_splits=9)
    narrow = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"merge_in_launch: head_dim=64 is not a multiple of"):
        pd.paged_decode_attention(q[..., :64], narrow, narrow, table, lens, scale=1.0,
                                  merge_in_launch=True, impl="interpret")  # fmt: skip
    tree = jnp.array([[-1, 0]] * 2)
    assert "tree drafts" in pd.merge_unsupported_reason(q.reshape(2, 2, 8, 128), 2, 2, tree)
    with pytest.raises(ValueError, match=r"merge_in_launch: tree drafts merge their splits"):
        call(q.reshape(2, 2, 8, 128), num_splits=2, parents=jnp.array([[-1, 0]] * 2))
    with pytest.raises(ValueError, match=r"counters must be int32 \[n >= 4\]"):
        call(q, num_splits=2, counters=jax.new_ref(jnp.zeros((3,), jnp.int32)))
    with pytest.raises(ValueError, match=r"gate must be q's leading shape \(2, 16\)"):
        call(q, num_splits=2, gate=jnp.zeros((2, 16, 64), jnp.bfloat16))


@pytest.mark.parametrize(
    "batch, heads, kv_heads, head_dim, page_size, splits, tokens",
    [
        (64, 16, 2, 256, 16, 1, 0),
        (1, 16, 2, 256, 16, 8, 0),
        (8, 24, 4, 256, 32, 2, 0),
        (4, 32, 8, 128, 64, 1, 0),
        (16, 16, 2, 256, 16, 2, 4),
    ],
    ids=["qwen-b64", "qwen-b1-split8", "27b-like-gqa6", "nemotron-like", "qwen-verify4"],
)  # fmt: skip
def test_kernel_lowers_for_the_gpu_at_production_shapes(
    batch, heads, kv_heads, head_dim, page_size, splits, tokens
):
    spec = jax.ShapeDtypeStruct
    pages = spec((4096, page_size, kv_heads, head_dim), jnp.bfloat16)
    q_shape = (batch, *((tokens,) if tokens else ()), heads, head_dim)
    args = (spec(q_shape, jnp.bfloat16), pages, pages,
            spec((batch, 8192 // page_size), jnp.int32), spec((batch,), jnp.int32))  # fmt: skip
    assert pd.unsupported_reason(args[0], args[1]) is None
    if not tokens:
        args = (spec((batch, 1, heads, head_dim), jnp.bfloat16), *args[1:])
    for stages in (1, 2, 3):  # a single buffer, the default ring and a longer one
        call = functools.partial(
            pd._kernel, scale=0.0625, num_splits=splits, causal=True, interpret=False,
            stages=stages,
        )  # fmt: skip
        text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    q = args[0]
    if pd.merge_unsupported_reason(q, kv_heads, splits) is None:  # merged and gated

        def merged(q, k_pages, v_pages, table, lens, gate):
            return pd.paged_decode_attention(
                q, k_pages, v_pages, table, lens, scale=0.0625, num_splits=splits, gate=gate,
                merge_in_launch=True, impl="pallas",
            )  # fmt: skip

        gate = spec((*q.shape[:-1], 2 * head_dim), jnp.bfloat16)
        lowered = jax.jit(merged).trace(*args, gate).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def test_the_ring_fits_shared_memory_and_a_bad_one_says_why():
    for head_dim in (64, 128, 256):  # a buffer of 64 positions at 256 is 64 KiB
        assert pd.stages_unsupported_reason(pd.STAGES, head_dim, 2) is None
        assert pd.stages_unsupported_reason(3, head_dim, 2) is None
    assert pd.stages_unsupported_reason(1, 256, 2) is None  # a single buffer is allowed
    assert pd.stages_unsupported_reason(0, 128, 2) == "stages=0 must be at least 1"
    assert "stages=4 at head_dim=256 needs" in pd.stages_unsupported_reason(4, 256, 2)
    q, pages = jnp.zeros((2, 8, 256), jnp.bfloat16), jnp.zeros((4, 16, 2, 256), jnp.bfloat16)
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"paged_decode_attention: stages=4 at head_dim=256"):
        pd.paged_decode_attention(q, pages, pages, table, lens, scale=1.0, stages=4,
                                  impl="interpret")  # fmt: skip


def test_prefix_kernel_lowers_for_the_gpu_at_a_prompt_chunks_shape():
    """An 8192-token chunk of a Qwen3-Next-like model (16 query / 2 KV heads of 256): 1028
    tile rows of 8 tokens over pages of 16."""
    spec = jax.ShapeDtypeStruct
    tokens = pd.tokens_per_tile(16, 2)
    rows = 8192 // tokens + 4
    pages = spec((4096, 16, 2, 256), jnp.bfloat16)
    args = (spec((rows, tokens, 16, 256), jnp.bfloat16), pages, pages,
            spec((rows, 1024), jnp.int32), spec((rows,), jnp.int32))  # fmt: skip
    call = functools.partial(pd._kernel, scale=0.0625, num_splits=1, causal=False, interpret=False)
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _prefix_oracle(q, k_pages, v_pages, page_table, prefix_lens):
    """float64 numpy: every token of tile row b sees positions 0 .. prefix_lens[b] - 1;
    (out, lse), zeros and -inf where it sees nothing."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    batch, tokens, heads, head_dim = q.shape
    page_size, kv_heads = k.shape[1:3]
    out, lse = np.zeros_like(q), np.full(q.shape[:3], -np.inf)
    for b in range(batch):
        n = int(prefix_lens[b])
        if n == 0:
            continue
        pages = np.asarray(page_table[b])[: -(-n // page_size)]
        keys = k[pages].reshape(-1, kv_heads, head_dim)[:n]
        values = v[pages].reshape(-1, kv_heads, head_dim)[:n]
        for t in range(tokens):
            for h in range(heads):
                g = h // (heads // kv_heads)
                s = keys[:, g] @ q[b, t, h] * SCALE
                w = np.exp(s - s.max())
                out[b, t, h] = w @ values[:, g] / w.sum()
                lse[b, t, h] = s.max() + np.log(w.sum())
    return out, lse


PREFIX_CASES = {
    # a tile row of 8 tokens per KV head (8 query heads on 1), of 16 (8 on 2)
    "gqa8-d128-p16": dict(batch=4, heads=8, kv_heads=1, head_dim=128, page_size=16,
                          max_pages=12, lens=[0, 1, 70, 190]),
    "gqa4-d64-p32": dict(batch=3, heads=8, kv_heads=2, head_dim=64, page_size=32,
                         max_pages=6, lens=[150, 33, 64]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PREFIX_CASES))
@pytest.mark.parametrize("num_splits", [1, 2])
def test_prefix_kernel_in_the_interpreter_matches_the_oracle(name, num_splits):
    case = PREFIX_CASES[name]
    tokens = pd.tokens_per_tile(case["heads"], case["kv_heads"])
    args = _case(3, **case, tokens=tokens)
    args["prefix_lens"] = args.pop("context_lens")
    want, want_lse = _prefix_oracle(**args)
    got, lse = pd.paged_prefix_attention(
        **args, scale=SCALE, num_splits=num_splits, impl="interpret"
    )
    assert got.dtype == lse.dtype == jnp.float32 and lse.shape == args["q"].shape[:3]
    got, lse = np.asarray(got, np.float64), np.asarray(lse, np.float64)
    assert np.isfinite(got).all(), "a NaN past some row's prefix reached the output"
    empty = np.asarray(args["prefix_lens"]) == 0
    assert not got[empty].any() and np.isneginf(lse[empty]).all()
    assert rel(got, want) < 1e-2
    np.testing.assert_allclose(lse[~empty], want_lse[~empty], rtol=0, atol=2e-2)
    with jax.enable_x64(True):
        wide = {n: jnp.asarray(a, jnp.float64) if a.dtype == jnp.bfloat16 else a
                for n, a in args.items()}  # fmt: skip
        ref, ref_lse = pd.paged_prefix_attention(**wide, scale=SCALE, impl="reference")
    assert rel(ref, want) < 1e-12
    np.testing.assert_allclose(np.asarray(ref_lse)[~empty], want_lse[~empty], rtol=1e-12)


def test_prefix_tiles_hold_every_token_of_the_rows_with_a_prefix_once():
    lens, prefix = [5, 0, 20, 3, 9], [4, 7, 0, 30, 2]
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    tokens, num_tokens = 4, 48  # 11 padding tokens
    tiles = pd.prefix_tiles(qsl, jnp.asarray(prefix, jnp.int32), num_tokens, tokens)
    token, row, plen = (np.asarray(x) for x in tiles)
    assert token.shape == (num_tokens // tokens + len(lens), tokens)
    starts = np.asarray(qsl)
    for r, (n, p) in enumerate(zip(lens, prefix, strict=True)):
        mine = token[(row == r) & (plen > 0)]
        held = sorted(mine[mine < num_tokens].tolist())
        assert held == (list(range(starts[r], starts[r] + n)) if p else [])
        assert (plen[(row == r) & (plen > 0)] == p).all()
        # each tile row holds consecutive tokens of one row from its start
        for tile in mine:
            live = tile[tile < num_tokens]
            assert (np.diff(live) == 1).all() and (live - starts[r])[0] % tokens == 0
    assert (token[plen == 0] == num_tokens).all()  # unused tile rows hold no token


def _random_parents(seed, batch, tokens):
    """Topological trees: node 0 the root, every other node's parent an earlier node."""
    rng = np.random.default_rng(seed)
    parents = np.full((batch, tokens), -1, np.int32)
    for t in range(1, tokens):
        parents[:, t] = rng.integers(0, t, batch)
    return jnp.asarray(parents)


TREE_CASES = {
    # 6 nodes x 8 heads = 48 tile rows; a row whose drafts start a block, one that spans two
    "tree6-gqa8": dict(batch=3, heads=8, kv_heads=1, head_dim=64, page_size=16,
                       max_pages=12, lens=[6, 67, 190], tokens=6),
    # 31 nodes (the bitmask's limit) x 2 heads = 62 tile rows
    "tree31-gqa2": dict(batch=2, heads=4, kv_heads=2, head_dim=64, page_size=32,
                        max_pages=4, lens=[100, 40], tokens=31),
}  # fmt: skip


def test_root_paths_hold_each_nodes_ancestors():
    parents = jnp.asarray([[-1, 0, 0, 1, 3, 2]], jnp.int32)
    paths = np.asarray(pd.root_paths(parents))[0]
    want = [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 3, 4}, {0, 2, 5}]
    assert [{j for j in range(6) if p >> j & 1} for p in paths] == want


@pytest.mark.parametrize("name", list(TREE_CASES))
@pytest.mark.parametrize("num_splits", [1, 2])
def test_tree_kernel_in_the_interpreter_matches_the_oracle(name, num_splits):
    args = _case(3, **TREE_CASES[name])
    parents = _random_parents(4, len(TREE_CASES[name]["lens"]), TREE_CASES[name]["tokens"])
    want = _oracle(**args, parents=np.asarray(parents))
    chain = _oracle(**args)
    assert rel(want, chain) > 1e-2, "the trees must differ from the chain somewhere"
    got = pd.paged_decode_attention(
        **args, scale=SCALE, num_splits=num_splits, parents=parents, impl="interpret"
    )
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "a NaN past some row's length reached the output"
    assert rel(got, want) < 1e-2


def test_a_chain_given_as_a_tree_is_the_causal_verify():
    spec = TREE_CASES["tree6-gqa8"]
    args = _case(5, **spec)
    chain = jnp.tile(jnp.arange(-1, spec["tokens"] - 1, dtype=jnp.int32), (spec["batch"], 1))
    causal = pd.paged_decode_attention(**args, scale=SCALE, num_splits=2, impl="interpret")
    tree = pd.paged_decode_attention(
        **args, scale=SCALE, num_splits=2, parents=chain, impl="interpret"
    )
    np.testing.assert_array_equal(np.asarray(tree), np.asarray(causal))


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_tree_reference_matches_the_oracle(name):
    args = _case(6, **TREE_CASES[name])
    parents = _random_parents(7, len(TREE_CASES[name]["lens"]), TREE_CASES[name]["tokens"])
    with jax.enable_x64(True):
        wide = {n: jnp.asarray(a, jnp.float64) if a.dtype == jnp.bfloat16 else a
                for n, a in args.items()}  # fmt: skip
        got = pd.paged_decode_attention(**wide, scale=SCALE, parents=parents, impl="reference")
    assert rel(got, _oracle(**args, parents=np.asarray(parents))) < 1e-12


def test_tree_kernel_lowers_for_the_gpu_at_a_qwen_shape():
    """16 rows of an 8-node tree over 16 query / 2 KV heads of 256: 64 tile rows."""
    spec = jax.ShapeDtypeStruct
    pages = spec((4096, 16, 2, 256), jnp.bfloat16)
    args = (spec((16, 8, 16, 256), jnp.bfloat16), pages, pages, spec((16, 512), jnp.int32),
            spec((16,), jnp.int32), spec((16, 8), jnp.int32))  # fmt: skip
    call = functools.partial(pd._kernel, scale=0.0625, num_splits=2, causal=True, interpret=False)
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_unsupported_calls_and_bad_arguments_say_why():
    q = jnp.zeros((2, 8, 64), jnp.bfloat16)
    pages = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    assert "page_size=8" in pd.unsupported_reason(q, jnp.zeros((4, 8, 2, 64), jnp.bfloat16))
    assert "head_dim=96" in pd.unsupported_reason(
        jnp.zeros((2, 8, 96), jnp.bfloat16), jnp.zeros((4, 16, 2, 96), jnp.bfloat16)
    )
    assert "16-bit" in pd.unsupported_reason(q.astype(jnp.float32), pages)
    chain = jnp.zeros((2, 17, 8, 64), jnp.bfloat16)  # 17 tokens x 4 heads > 64 tile rows
    assert "17 tokens x 4 query heads" in pd.unsupported_reason(chain, pages)
    table, lens = jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match=r"H=8 query heads must be a multiple of KVH=3"):
        pd.paged_decode_attention(q, pages[:, :, :1].repeat(3, 2), pages[:, :, :1].repeat(3, 2),
                                  table, lens, scale=1.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"page_table must be int32 \[B=2, max_pages\]"):
        pd.paged_decode_attention(q, pages, pages, table[:1], lens, scale=1.0)
    with pytest.raises(ValueError, match=r"context_lens must be int32 \[B=2\]"):
        pd.paged_decode_attention(q, pages, pages, table, np.zeros(2, np.int64), scale=1.0)
    chain4 = jnp.zeros((2, 4, 8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"parents.shape=\(2, 3\) must be \[N, D\]=\(2, 4\)"):
        pd.paged_decode_attention(chain4, pages, pages, table, lens, scale=1.0,
                                  parents=jnp.zeros((2, 3), jnp.int32))  # fmt: skip
    assert pd.tree_unsupported_reason(31) is None
    assert pd.tree_unsupported_reason(32) == "a tree of D=32 nodes is over 31"
    with pytest.raises(ValueError, match=r"a tree of D=32 nodes is over 31"):
        tree = jnp.zeros((2, 32), jnp.int32)
        pd.paged_decode_attention(jnp.zeros((2, 32, 2, 64), jnp.bfloat16), pages, pages,
                                  table, lens, scale=1.0, parents=tree)  # fmt: skip
    with pytest.raises(NotImplementedError, match="page_size=8"):
        pd.paged_decode_attention(q, pages[:, :8], pages[:, :8], table, lens, scale=1.0,
                                  impl="interpret")  # fmt: skip
    with pytest.raises(ValueError, match=r"paged_prefix_attention: q must be \[B, D, H, hd\]"):
        pd.paged_prefix_attention(q, pages, pages, table, lens, scale=1.0)
    with pytest.raises(ValueError, match=r"paged_prefix_attention: prefix_lens must be int32"):
        pd.paged_prefix_attention(q[:, None], pages, pages, table, lens[:1], scale=1.0)


def test_splits_finish_soonest_in_waves_over_the_sms_and_never_leave_a_split_short():
    assert pd.NUM_SMS == 132
    assert pd.pick_num_splits(batch=1, kv_heads=2, max_blocks=128) == 64  # 128 programs
    assert pd.pick_num_splits(batch=16, kv_heads=2, max_blocks=128) == 4  # 128
    assert pd.pick_num_splits(batch=64, kv_heads=2, max_blocks=128) == 1  # 128
    assert pd.pick_num_splits(batch=96, kv_heads=2, max_blocks=128) == 2  # 384: 3 full waves
    assert pd.pick_num_splits(batch=128, kv_heads=2, max_blocks=128) == 1  # 256: 2 waves
    assert pd.pick_num_splits(batch=256, kv_heads=2, max_blocks=128) == 1
    assert pd.pick_num_splits(batch=1, kv_heads=2, max_blocks=16) == 8  # 2 blocks a split
    assert pd.pick_num_splits(batch=48, kv_heads=2, max_blocks=128) == 4  # 384: 3 full waves
    assert pd.pick_num_splits(batch=48, kv_heads=2, max_blocks=16) == 1  # short rows: the ramp
    assert pd.pick_num_splits(batch=1, kv_heads=2, max_blocks=3) == 1
