"""Bucket policy and forward metadata: shapes per (mode, bucket), padding, and every bad input."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.metadata import (
    BUILDABLE_MODES,
    BucketPolicy,
    ForwardMetadata,
    MetadataError,
    RowSpec,
    build_metadata,
    chain_parents,
    describe,
    example_metadata,
    pack_metadata,
    tree_depths,
)
from hybrid_jax.modes import CAPABILITIES, ForwardMode, UnsupportedForwardModeError

M = ForwardMode
D = 3
S = 16  # pool slots: real slots 1..15
# Small batch buckets, so that padding rows show at every size (the default ladder starts at 8).
POLICY = BucketPolicy((1, 2, 4, 8), (16, 32, 64), num_draft_tokens=D)
BUILT = sorted(BUILDABLE_MODES, key=lambda m: m.name)
UNBUILT = sorted(set(ForwardMode) - BUILDABLE_MODES, key=lambda m: m.name)


def build(mode, rows, **kw):
    return build_metadata(mode, [RowSpec(*r) for r in rows], POLICY, num_slots=S, **kw)


def distinct(n, num_tokens):
    """n fresh rows on slots 1..n."""
    return [(slot, 0, num_tokens) for slot in range(1, n + 1)]


def host(meta):
    arrays = jax.Array | np.ndarray | np.generic
    return {k: np.asarray(v) for k, v in vars(meta).items() if isinstance(v, arrays)}


def shapes(meta):
    return jax.tree.map(lambda a: (a.shape, a.dtype), meta)


def random_rows(rng, mode, n):
    slots = rng.choice(np.arange(1, S), size=n, replace=False)
    lens = {
        M.DECODE: np.ones(n, int),
        M.TARGET_VERIFY: np.full(n, D),
        M.DRAFT_EXTEND: rng.integers(1, D + 1, n),
        M.EXTEND: rng.integers(1, 8, n),
        M.MIXED: rng.integers(1, 8, n),
    }[mode]
    prefix = rng.integers(0, 20, n)
    return [RowSpec(int(s), int(p), int(t)) for s, p, t in zip(slots, prefix, lens, strict=True)]


# ---------------------------------------------------------------- bucket policy


def test_default_policy_ladders():
    policy = BucketPolicy()
    assert policy == BucketPolicy.default()
    assert policy.batch_buckets == (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert BucketPolicy.default(max_batch=5).batch_buckets == (5,)
    assert policy.token_buckets == tuple(2**k for k in range(4, 14))
    assert policy.num_draft_tokens == 4
    assert (policy.max_batch, policy.max_tokens) == (256, 8192)


def test_default_policy_ends_at_its_maxima():
    policy = BucketPolicy.default(max_batch=100, max_tokens=1000, num_draft_tokens=2)
    assert policy.batch_buckets == (8, 12, 16, 24, 32, 48, 64, 96, 100)
    assert policy.token_buckets == (16, 32, 64, 128, 256, 512, 1000)


@pytest.mark.parametrize(
    "buckets", [(), (2, 1), (1, 1, 2), (0, 4), (-1, 4), (1.0, 2), (True, 2)], ids=str
)
def test_policy_rejects_bad_batch_buckets(buckets):
    with pytest.raises(MetadataError, match=r"batch_buckets=.* increasing tuple of distinct"):
        BucketPolicy(batch_buckets=buckets)


def test_policy_rejects_bad_token_buckets():
    with pytest.raises(MetadataError, match=r"token_buckets=\(32, 16\)"):
        BucketPolicy(token_buckets=(32, 16))


@pytest.mark.parametrize("d", [0, 1, 9, 2.0])
def test_policy_rejects_draft_tokens_outside_2_to_8(d):
    with pytest.raises(MetadataError, match=rf"num_draft_tokens={d!r} is outside 2\.\.8"):
        BucketPolicy(num_draft_tokens=d)


def test_policy_accepts_lists_and_stays_hashable():
    policy = BucketPolicy([1, 4], [8, 16], 2)
    assert policy.batch_buckets == (1, 4)
    assert hash(policy) == hash(BucketPolicy((1, 4), (8, 16), 2))


def test_batch_and_token_bucket_pick_the_smallest_that_fits():
    assert [POLICY.batch_bucket(n) for n in (0, 1, 2, 3, 5, 8)] == [1, 1, 2, 4, 8, 8]
    assert [POLICY.token_bucket(t) for t in (0, 1, 16, 17, 64)] == [16, 16, 16, 32, 64]


def test_batch_bucket_over_the_largest_names_count_and_fix():
    with pytest.raises(MetadataError) as info:
        BucketPolicy().batch_bucket(300)
    assert str(info.value) == (
        "batch of 300 rows exceeds the largest batch bucket 256; raise BucketPolicy.max_batch "
        "or split the batch"
    )


def test_token_bucket_over_the_largest_names_count_and_fix():
    with pytest.raises(
        MetadataError, match="batch of 65 tokens exceeds the largest token bucket 64"
    ):
        POLICY.token_bucket(65)


def test_buckets_per_mode():
    assert POLICY.buckets(M.DECODE) == [(1, 1), (2, 2), (4, 4), (8, 8)]
    assert POLICY.buckets(M.TARGET_VERIFY) == [(1, 3), (2, 6), (4, 12), (8, 24)]
    assert POLICY.buckets(M.DRAFT_EXTEND) == [(1, 3), (2, 6), (4, 12), (8, 24)]
    # One executable per token bucket; rows = min(T, max_batch).
    assert POLICY.buckets(M.EXTEND) == [(8, 16), (8, 32), (8, 64)]
    assert POLICY.buckets(M.MIXED) == [(8, 16), (8, 32), (8, 64)]
    assert POLICY.buckets(M.IDLE) == [(0, 0)]
    assert BucketPolicy().buckets(M.EXTEND)[:3] == [(16, 16), (32, 32), (64, 64)]
    assert BucketPolicy().buckets(M.EXTEND)[-1] == (256, 8192)


@pytest.mark.parametrize("mode", UNBUILT, ids=lambda m: m.name)
def test_buckets_of_unbuilt_mode_raise(mode):
    with pytest.raises(UnsupportedForwardModeError, match=f"forward mode {mode.name}"):
        POLICY.buckets(mode)


@pytest.mark.parametrize("mode", sorted(BUILDABLE_MODES - {M.IDLE}, key=lambda m: m.name))
def test_every_built_batch_lands_in_a_precompiled_bucket(mode):
    rng = np.random.default_rng(0)
    compiled = set(POLICY.buckets(mode))
    for _ in range(30):
        meta = build_metadata(mode, random_rows(rng, mode, rng.integers(0, 9)), POLICY, num_slots=S)
        assert (meta.batch_size, meta.num_tokens) in compiled


def test_buildable_modes_are_exactly_the_modes_some_layer_supports():
    assert BUILDABLE_MODES == frozenset().union(*CAPABILITIES.values())


# ---------------------------------------------------------------- shapes and structure


@pytest.mark.parametrize("mode", BUILT, ids=lambda m: m.name)
def test_example_metadata_shapes_for_every_bucket(mode):
    expected_d = {M.DECODE: 1, M.TARGET_VERIFY: D, M.DRAFT_EXTEND: D}.get(mode, 0)
    for bs, t in POLICY.buckets(mode):
        meta = example_metadata(mode, bs, t, POLICY)
        assert (meta.mode, meta.batch_size, meta.num_tokens) == (mode, bs, t)
        assert meta.num_draft_tokens == expected_d
        a = host(meta)
        assert {k: (v.shape, v.dtype.name) for k, v in a.items()} == {
            "query_start_loc": ((bs + 1,), "int32"),
            "state_indices": ((bs,), "int32"),
            "has_initial_state": ((bs,), "bool"),
            "seq_lens": ((bs,), "int32"),
            "context_lens": ((bs,), "int32"),
            "positions": ((t,), "int32"),
            "token_rows": ((t,), "int32"),
            "num_rows": ((), "int32"),
            "parents": ((bs, D if mode is M.TARGET_VERIFY else 0), "int32"),
        }
        np.testing.assert_array_equal(a["query_start_loc"], 0)
        np.testing.assert_array_equal(a["state_indices"], 0)
        np.testing.assert_array_equal(a["token_rows"], bs)
        assert int(a["num_rows"]) == 0


@pytest.mark.parametrize("mode", sorted(BUILDABLE_MODES - {M.IDLE}, key=lambda m: m.name))
def test_real_rows_and_no_rows_share_structure_and_shapes(mode):
    rows = random_rows(np.random.default_rng(1), mode, 3)
    real = build_metadata(mode, rows, POLICY, num_slots=S)
    empty = example_metadata(mode, real.batch_size, real.num_tokens, POLICY)
    assert jax.tree.structure(real) == jax.tree.structure(empty)
    assert shapes(real) == shapes(empty)


def test_same_bucket_never_retraces_under_jit():
    traces = []

    @jax.jit
    def step(meta: ForwardMetadata):
        traces.append(meta.mode)
        return meta.positions + meta.token_rows

    step(example_metadata(M.EXTEND, 8, 16, POLICY))
    step(build(M.EXTEND, [(3, 0, 5), (4, 2, 9)]))
    step(build(M.EXTEND, [(1, 7, 1)]))
    assert traces == [M.EXTEND]
    step(build(M.EXTEND, [(1, 7, 17)]))  # the 32-token bucket
    assert len(traces) == 2


def test_metadata_is_immutable():
    meta = build(M.DECODE, [(1, 4, 1)])
    with pytest.raises(AttributeError):
        meta.batch_size = 4


# ---------------------------------------------------------------- contents per mode


def test_decode_qsl_is_arange_with_padded_rows_repeating_n():
    meta = build(M.DECODE, [(5, 9, 1), (2, 3, 1), (7, 1, 1)])
    a = host(meta)
    assert (meta.batch_size, meta.num_tokens, meta.num_draft_tokens) == (4, 4, 1)
    assert a["query_start_loc"].tolist() == [0, 1, 2, 3, 3]
    assert a["state_indices"].tolist() == [5, 2, 7, 0]
    assert a["seq_lens"].tolist() == [1, 1, 1, 0]
    assert a["context_lens"].tolist() == [10, 4, 2, 0]
    assert a["has_initial_state"].tolist() == [True, True, True, False]
    assert a["positions"].tolist() == [9, 3, 1, 0]
    assert a["token_rows"].tolist() == [0, 1, 2, 4]
    assert int(a["num_rows"]) == 3


def test_target_verify_qsl_is_d_times_decode_qsl():
    meta = build(M.TARGET_VERIFY, [(5, 9, D), (2, 0, D), (7, 1, D)])
    a = host(meta)
    assert (meta.batch_size, meta.num_tokens, meta.num_draft_tokens) == (4, 4 * D, D)
    assert a["query_start_loc"].tolist() == [0, D, 2 * D, 3 * D, 3 * D]
    assert a["positions"].tolist() == [9, 10, 11, 0, 1, 2, 1, 2, 3, 0, 0, 0]
    assert a["token_rows"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 4, 4, 4]
    assert a["has_initial_state"].tolist() == [True, False, True, False]


def test_extend_packs_ragged_rows_and_pads_the_token_axis():
    meta = build(M.EXTEND, [(3, 0, 4), (9, 6, 2), (1, 0, 1)])
    a = host(meta)
    assert (meta.batch_size, meta.num_tokens, meta.num_draft_tokens) == (8, 16, 0)
    assert a["query_start_loc"].tolist() == [0, 4, 6, 7, 7, 7, 7, 7, 7]
    assert a["state_indices"].tolist() == [3, 9, 1, 0, 0, 0, 0, 0]
    assert a["seq_lens"].tolist() == [4, 2, 1, 0, 0, 0, 0, 0]
    assert a["context_lens"].tolist() == [4, 8, 1, 0, 0, 0, 0, 0]
    assert a["has_initial_state"].tolist() == [False, True, False] + [False] * 5
    assert a["positions"].tolist() == [0, 1, 2, 3, 6, 7, 0] + [0] * 9
    assert a["token_rows"].tolist() == [0, 0, 0, 0, 1, 1, 2] + [8] * 9


def test_mixed_decode_rows_continue_their_state():
    a = host(build(M.MIXED, [(2, 0, 5), (4, 11, 1), (6, 3, 1)]))
    assert a["has_initial_state"][:3].tolist() == [False, True, True]
    assert a["positions"][:7].tolist() == [0, 1, 2, 3, 4, 11, 3]
    assert a["query_start_loc"][:4].tolist() == [0, 5, 6, 7]


def test_draft_extend_is_ragged_on_a_bs_times_d_token_axis():
    meta = build(M.DRAFT_EXTEND, [(2, 10, 3), (4, 5, 1)])
    a = host(meta)
    assert (meta.batch_size, meta.num_tokens, meta.num_draft_tokens) == (2, 2 * D, D)
    assert a["query_start_loc"].tolist() == [0, 3, 4]
    assert a["positions"].tolist() == [10, 11, 12, 5, 0, 0]
    assert a["token_rows"].tolist() == [0, 0, 0, 1, 2, 2]


def test_idle_has_the_empty_bucket():
    meta = build(M.IDLE, [])
    assert (meta.batch_size, meta.num_tokens) == (0, 0)
    assert host(meta)["query_start_loc"].tolist() == [0]
    assert int(meta.num_rows) == 0


def test_explicit_bucket_larger_than_needed_pads_further():
    meta = build(M.EXTEND, [(3, 0, 4)], batch_size=4, num_tokens=32)
    a = host(meta)
    assert (meta.batch_size, meta.num_tokens) == (4, 32)
    assert a["query_start_loc"].tolist() == [0, 4, 4, 4, 4]
    assert a["token_rows"][4:].tolist() == [4] * 28


def test_describe_lists_real_rows():
    text = describe(build(M.EXTEND, [(3, 5, 2), (7, 0, 3)]))
    assert text.splitlines()[0] == (
        "EXTEND: bucket 8 rows x 16 tokens (D=0), 2 real rows, 5 real tokens"
    )
    assert len(text.splitlines()) == 4
    assert text.splitlines()[2].split() == ["0", "3", "5", "2", "0", "True"]


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("mode", UNBUILT, ids=lambda m: m.name)
def test_unbuilt_mode_raises_naming_the_mode_and_the_buildable_ones(mode):
    with pytest.raises(UnsupportedForwardModeError) as info:
        build(mode, [])
    names = ", ".join(sorted(m.name for m in BUILDABLE_MODES))
    assert (
        str(info.value) == f"no metadata builder for forward mode {mode.name}; supported: {names}"
    )
    assert info.value.layer_kind is None


BAD_ROWS = [
    (M.DECODE, distinct(9, 1), "batch of 9 rows exceeds the largest batch bucket 8"),
    (M.EXTEND, [(1, 0, 40), (2, 0, 30)], "batch of 70 tokens exceeds the largest token bucket 64"),
    (M.DECODE, [(1, 0, 1), (2, 0, 1), (3, 0, 1), (16, 0, 1)],
     r"rows\[3\]\.slot=16 is outside the pool \(slots 1\.\.15\)"),
    (M.DECODE, [(-2, 0, 1)], r"rows\[0\]\.slot=-2 is outside the pool"),
    (M.DECODE, [(4, 0, 1), (0, 0, 1)], r"rows\[1\]\.slot=0 is the pad slot"),
    (M.EXTEND, [(4, 0, 1), (5, 0, 1), (4, 0, 1)],
     r"rows\[2\]\.slot=4 repeats rows\[0\]\.slot"),
    (M.EXTEND, [(4, -1, 1)], r"rows\[0\]\.prefix_len=-1 is negative"),
    (M.EXTEND, [(4, 0, -3)], r"rows\[0\]\.num_tokens=-3 is negative"),
    (M.DECODE, [(4, 0, 2)], r"rows\[0\]\.num_tokens=2, but DECODE rows carry exactly 1 tokens"),
    (M.DECODE, [(4, 3, 0)], r"rows\[0\]\.num_tokens=0, but DECODE rows carry exactly 1"),
    (M.TARGET_VERIFY, [(4, 3, D - 1)],
     rf"num_tokens={D - 1}, but TARGET_VERIFY rows carry exactly {D} tokens"),
    (M.TARGET_VERIFY, [(4, 3, D + 1)], "TARGET_VERIFY rows carry exactly"),
    (M.EXTEND, [(4, 3, 2), (5, 0, 0)],
     r"rows\[1\]\.num_tokens=0, but EXTEND rows carry at least 1 tokens"),
    (M.MIXED, [(5, 0, 0)], "MIXED rows carry at least 1 tokens"),
    (M.DRAFT_EXTEND, [(5, 0, 0)], rf"DRAFT_EXTEND rows carry 1\.\.{D} tokens"),
    (M.DRAFT_EXTEND, [(5, 0, D + 1)], rf"DRAFT_EXTEND rows carry 1\.\.{D} tokens"),
    (M.IDLE, [(5, 0, 1)], "IDLE steps carry no rows, got 1"),
    (M.DECODE, [(5, 0.0, 1)], r"rows\[0\]\.prefix_len=0\.0 must be an int"),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "rows", "message"), BAD_ROWS, ids=[m for _, _, m in BAD_ROWS])
def test_bad_rows_raise_naming_value_and_rule(mode, rows, message):
    with pytest.raises(MetadataError, match=message):
        build(mode, rows)


def test_mixed_accepts_any_row_length_from_one():
    meta = build(M.MIXED, [(1, 0, 1), (2, 5, 30)])
    assert meta.num_tokens == 32


BAD_BUCKETS = [
    (M.DECODE, distinct(3, 1), {"batch_size": 2}, "batch_size=2 is smaller than the 3 rows"),
    (M.DECODE, [], {"batch_size": 0}, "batch_size=0 must be >= 1 for DECODE"),
    (M.EXTEND, [(1, 0, 20)], {"num_tokens": 16}, "num_tokens=16 is smaller than the 20 tokens"),
    (M.EXTEND, [], {"num_tokens": 0}, "num_tokens=0 is smaller than the 1 tokens"),
    (M.EXTEND, distinct(3, 2), {"batch_size": 2}, "batch_size=2 is smaller than the 3 rows"),
    (M.DECODE, [], {"batch_size": 4, "num_tokens": 8},
     "num_tokens=8 does not fit the DECODE layout of 4 rows x 1 tokens = 4"),
    (M.TARGET_VERIFY, [], {"batch_size": 2, "num_tokens": 2},
     f"num_tokens=2 does not fit the TARGET_VERIFY layout of 2 rows x {D} tokens = {2 * D}"),
    (M.IDLE, [], {"batch_size": 1}, r"IDLE has the single bucket \(0, 0\)"),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "rows", "kw", "message"), BAD_BUCKETS, ids=str)
def test_explicit_bucket_smaller_or_off_layout_raises(mode, rows, kw, message):
    with pytest.raises(MetadataError, match=message):
        build(mode, rows, **kw)


def test_slot_error_names_an_empty_pool():
    with pytest.raises(MetadataError, match=r"slot=1 is outside the pool \(no real slots"):
        build_metadata(M.DECODE, [RowSpec(1, 0, 1)], POLICY, num_slots=1)


@pytest.mark.parametrize("num_slots", [0, -4, 2.5])
def test_num_slots_must_be_positive(num_slots):
    with pytest.raises(MetadataError, match=f"num_slots={num_slots!r} must be a positive int"):
        build_metadata(M.DECODE, [], POLICY, num_slots=num_slots)


# ---------------------------------------------------------------- tree drafts

TREE_POLICY = BucketPolicy((1, 2, 4, 8), (16, 32, 64), num_draft_tokens=4, tree_drafts=True)


def build_tree(rows, policy=TREE_POLICY):
    return build_metadata(M.TARGET_VERIFY, rows, policy, num_slots=S)


def test_chain_is_the_default_tree_and_keeps_chain_positions():
    plain = build(M.TARGET_VERIFY, [(5, 9, D), (2, 0, D)])
    spelled = build_metadata(
        M.TARGET_VERIFY,
        [RowSpec(5, 9, D, parents=chain_parents(D)), RowSpec(2, 0, D, parents=(-1, 0, 1))],
        POLICY,
        num_slots=S,
    )
    assert jax.tree.structure(plain) == jax.tree.structure(spelled)
    for name, a in host(plain).items():
        np.testing.assert_array_equal(a, host(spelled)[name], err_msg=name)
    padded = build(M.TARGET_VERIFY, [(5, 9, D)], batch_size=4)
    assert host(padded)["parents"].tolist() == [[-1, 0, 1]] * 4  # padded rows: chains too
    assert not plain.tree


def test_tree_positions_are_prefix_plus_depth():
    meta = build_tree([RowSpec(3, 10, 4, parents=(-1, 0, 0, 1)), RowSpec(4, 2, 4)])
    a = host(meta)
    assert meta.tree
    assert a["parents"].tolist() == [[-1, 0, 0, 1], [-1, 0, 1, 2]]
    assert a["positions"].tolist() == [10, 11, 11, 12, 2, 3, 4, 5]
    assert tree_depths((-1, 0, 1, 1, 0, 4)) == (0, 1, 2, 2, 1, 2)


def test_tree_and_chain_rows_share_one_compiled_structure():
    chain = build_tree([RowSpec(3, 1, 4)])
    tree = build_tree([RowSpec(3, 1, 4, parents=(-1, 0, 0, 0))])
    assert jax.tree.structure(chain) == jax.tree.structure(tree)
    assert shapes(chain) == shapes(tree)


def test_only_target_verify_is_a_tree_step():
    assert not build_metadata(M.DECODE, [RowSpec(1, 0, 1)], TREE_POLICY, num_slots=S).tree


BAD_TREES = [
    ((0, 0, 1), "node 0 is the root, its parent must be -1"),
    ((-1, 1, 0), r"parents\[1\]=1: a node's parent must be an earlier node \(0\.\.0\)"),
    ((-1, 0, 3), r"parents\[2\]=3: a node's parent must be an earlier node"),
    ((-1, 0, -1), r"parents\[2\]=-1: a node's parent must be an earlier node"),
    ((-1, 0), "parents has 2 entries for 3 nodes"),
    ((-1, 0, 1.0), r"parents\[2\]=1\.0 must be an int"),
]


@pytest.mark.parametrize(("parents", "message"), BAD_TREES, ids=[m for _, m in BAD_TREES])
def test_bad_tree_raises_naming_value_and_rule(parents, message):
    policy = BucketPolicy.default(max_batch=8, max_tokens=64, num_draft_tokens=D, tree_drafts=True)
    with pytest.raises(MetadataError, match=message):
        build_tree([RowSpec(4, 0, D, parents=parents)], policy)


def test_tree_needs_a_tree_policy():
    with pytest.raises(MetadataError, match=r"BucketPolicy\(tree_drafts=True\)"):
        build_metadata(M.TARGET_VERIFY, [RowSpec(4, 0, D, parents=(-1, 0, 0))], POLICY, num_slots=S)


def test_parents_on_a_non_verify_row_raise():
    with pytest.raises(MetadataError, match="only TARGET_VERIFY rows are trees"):
        build_metadata(M.DECODE, [RowSpec(4, 0, 1, parents=(-1,))], POLICY, num_slots=S)


def test_tree_drafts_must_be_a_bool():
    with pytest.raises(MetadataError, match="tree_drafts=1 must be a bool"):
        BucketPolicy(tree_drafts=1)


# ---------------------------------------------------------------- one copy to the device


@pytest.mark.parametrize("mode", BUILT, ids=lambda m: m.name)
def test_packed_metadata_unpacks_to_the_same_arrays_and_statics(mode):
    """Random rows of every buildable mode (paged: with a page table): one int32 vector on
    the host, and back (in a jitted function, as a step unpacks it) the same arrays, dtypes
    and static fields."""
    rng = np.random.default_rng(7)
    policy = BucketPolicy(
        (1, 2, 4, 8), (16, 32, 64), num_draft_tokens=D, page_size=4, max_context=64
    )
    rows, first = [], 1
    for row in [] if mode is M.IDLE else random_rows(rng, mode, 3):
        count = -(-(row.prefix_len + row.num_tokens) // 4)
        rows.append(dataclasses.replace(row, pages=tuple(range(first, first + count))))
        first += count
    meta = build_metadata(mode, rows, policy, num_slots=S, num_pages=64)
    assert meta.pages.table.shape == (meta.batch_size, 16)
    layout, packed = pack_metadata(meta)
    assert isinstance(packed, np.ndarray) and packed.dtype == np.int32
    assert packed.shape == (layout.size,)
    back = jax.jit(layout.unpack)(packed)
    chex.assert_trees_all_equal(back, jax.tree.map(jnp.asarray, meta))
    assert (back.mode, back.batch_size, back.num_tokens) == (mode, meta.batch_size, meta.num_tokens)
    # Arrays already on the device are joined there, to the same vector.
    _, on_device = pack_metadata(jax.tree.map(jnp.asarray, meta))
    np.testing.assert_array_equal(np.asarray(on_device), packed)


def test_packing_names_an_array_it_cannot_carry():
    meta = example_metadata(M.DECODE, 2, 2, POLICY)
    wide = dataclasses.replace(meta, seq_lens=np.zeros(2, np.float32))
    with pytest.raises(MetadataError, match="int32 or bool; got float32"):
        pack_metadata(wide)
