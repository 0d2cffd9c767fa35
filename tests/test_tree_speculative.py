"""Tree drafts from the MTP head: topologies, the acceptance walk, and the engine serving them.

The engine tests serve with MTP tree drafts and compare against serving without speculation
(tokens, every linear layer's state and the attention cache at each position); a rigged
agreeing model accepts along a branch that is not node 1, so the accepted path's keys and
values must be moved (``commit_tree_verified``) for the tokens, states and cache to match.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_helpers import (
    CHI2_4_999,
    GREEDY,
    PROMPTS,
    FromScratch,
    agreeing_model,
    assert_same_states,
    chi_square,
    engine_pair,
    generate_tokens,
    run_bench,
    run_joining_and_leaving,
    seeded_runs,
    slot_states,
    speculative_fixtures,
    states_by_position,
)

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.speculative import (
    SpeculativeConfig,
    SpeculativeConfigError,
    accept,
    accept_tree,
    candidate_ranks,
    tree_rejection_sample,
    width_tree,
)
from hybrid_jax.modes import ForwardMode

M = ForwardMode
D = 4
WIDE = width_tree(D, 2)  # (-1, 0, 0, 1): two children of the root, a chain below the first
OFF_CHAIN = (-1, 0, 0, 2)  # the head's best guess is node 2, its second node 1

# ---------------------------------------------------------------- topologies


def test_tree_width_builds_root_children_then_a_chain_below_the_first():
    assert width_tree(4, 2) == (-1, 0, 0, 1)
    assert width_tree(6, 3) == (-1, 0, 0, 0, 1, 4)
    assert width_tree(5, 4) == (-1, 0, 0, 0, 0)
    config = SpeculativeConfig("mtp", 6, tree=True, tree_width=3)
    assert config.parents == (-1, 0, 0, 0, 1, 4)
    assert SpeculativeConfig("mtp", 4).parents == (-1, 0, 1, 2)  # a chain without tree
    # The spine child takes the head's best guess wherever it sits among its siblings.
    assert candidate_ranks(WIDE) == (-1, 0, 1, 0)
    assert candidate_ranks(OFF_CHAIN) == (-1, 1, 0, 0)
    assert candidate_ranks((-1, 0, 0, 0)) == (-1, 0, 1, 2)


@pytest.mark.parametrize(
    ("source", "d", "tree", "match"),
    [
        ("ngram", 4, {"tree_width": 2}, "source='ngram'.* from source='mtp'"),
        ("mtp", 4, {"tree_width": 4}, r"tree_width=4 is outside 2..3"),
        ("mtp", 4, {"tree_width": 1}, r"tree_width=1 is outside 2..3"),
        ("mtp", 4, {"tree_parents": (-1, 0, 0)}, "tree_parents has 3 nodes but"),
        ("mtp", 4, {"tree_parents": (-1, 0, 2, 1)}, r"tree_parents\[2\]=2"),
        ("mtp", 4, {"tree_parents": (0, 0, 0, 1)}, r"tree_parents\[0\]=0"),
        # Nodes 1 and 2 both have children: two branches the head would have to follow.
        ("mtp", 6, {"tree_parents": (-1, 0, 0, 1, 2, 3)}, "must form a single path"),
    ],
)
def test_tree_configs_that_cannot_be_drafted_are_refused(source, d, tree, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        SpeculativeConfig(source, d, tree=True, **tree)


# ---------------------------------------------------------------- the acceptance walk


def _greedy_tree(argmax, tokens, parents):
    """accept_tree at temperature 0 for logits peaked at ``argmax`` ``[B, D]``."""
    b, d = argmax.shape
    logits = np.random.default_rng(0).standard_normal((b, d, 9)).astype(np.float32)
    np.put_along_axis(logits, np.asarray(argmax)[..., None], 10.0, axis=-1)
    zeros = jnp.zeros(b)
    return jax.jit(accept_tree)(
        jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
        zeros, jnp.zeros(b, jnp.int32), zeros + 1, jnp.zeros(b, jnp.uint32),
        jnp.zeros(b, jnp.int32),
    )  # fmt: skip


def test_greedy_walk_follows_the_child_with_the_targets_token_off_the_chain():
    parents = [WIDE, WIDE, OFF_CHAIN, WIDE, (-1, 0, 0, 0)]
    argmax = [
        [4, 5, 8, 1],  # node 2 (4) matches at the root: a leaf, bonus its argmax 8
        [3, 6, 0, 2],  # node 1 (3) then node 3 (6): the full depth, bonus 2
        [4, 6, 5, 7],  # node 2 (4), then node 3 below it (5): bonus 7
        [7, 0, 0, 0],  # nothing matches: the root's argmax alone
        [4, 0, 1, 2],  # node 2 and node 3 both carry 4: the first in node order wins
    ]
    tokens = [[0, 3, 4, 6], [0, 3, 4, 6], [0, 3, 4, 5], [0, 3, 4, 6], [0, 3, 4, 4]]
    acc = _greedy_tree(np.array(argmax), tokens, parents)
    assert np.asarray(acc.nodes).tolist() == [2, 3, 3, 0, 2]
    assert np.asarray(acc.num_accepted).tolist() == [1, 2, 2, 0, 1]
    assert np.asarray(acc.emitted).tolist() == [
        [4, 8, -1, -1],
        [3, 6, 2, -1],
        [4, 5, 7, -1],
        [7, -1, -1, -1],
        [4, 1, -1, -1],
    ]


def test_the_walk_over_a_chain_draws_exactly_what_the_chain_rule_draws():
    n, v = 3000, 6
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((n, D, v)) * 2, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (n, D)), jnp.int32)
    chain = jnp.tile(jnp.arange(-1, D - 1, dtype=jnp.int32), (n, 1))
    temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0], n), jnp.float32)
    args = (temperature, jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.arange(n, dtype=jnp.uint32),
            jnp.asarray(rng.integers(0, 50, n), jnp.int32))  # fmt: skip
    want = jax.jit(accept)(logits, tokens, *args)
    got = jax.jit(accept_tree)(logits, tokens, chain, *args)
    np.testing.assert_array_equal(got.emitted, want.emitted)
    np.testing.assert_array_equal(got.num_accepted, want.num_accepted)
    np.testing.assert_array_equal(got.nodes, want.num_accepted)
    assert 0 < float((np.asarray(want.num_accepted) > 0).mean()) < 1  # both outcomes occur


def _without(p: np.ndarray, removed) -> np.ndarray:
    q = p.copy()
    q[list(removed)] = 0
    return q / q.sum()


@pytest.mark.parametrize(
    "candidates",
    [(1, 2), (2, 1), (4, 2), (1, 1)],  # (4, _): probability 0; (1, 1): a repeated candidate
)
def test_tree_rejection_sampling_keeps_the_target_distribution(candidates):
    # Root children nodes 1 and 2 carry the candidates; node 3 (below node 1) carries 3.
    p0 = np.array([0.1, 0.4, 0.25, 0.25, 0.0])
    p1 = np.array([0.3, 0.05, 0.15, 0.2, 0.3])
    p2 = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
    p3 = np.array([0.5, 0.1, 0.1, 0.1, 0.2])
    n = 40000
    probs = jnp.asarray(np.broadcast_to(np.stack([p0, p1, p2, p3]), (n, D, 5)), jnp.float32)
    tokens = jnp.asarray(np.broadcast_to([0, *candidates, 3], (n, D)), jnp.int32)
    parents = jnp.asarray(np.broadcast_to(WIDE, (n, D)), jnp.int32)
    keys = jax.random.split(jax.random.key(10 * candidates[0] + candidates[1]), (n, D))
    argmax = jnp.zeros((n, D), jnp.int32)
    acc = jax.jit(tree_rejection_sample)(probs, argmax, tokens, parents, keys, jnp.zeros(n, bool))
    emitted, nodes = np.asarray(acc.emitted), np.asarray(acc.nodes)
    assert chi_square(emitted[:, 0], p0) < CHI2_4_999
    # Below an accepted node, the next token follows that node's distribution.
    for node, p in ((1, p1), (2, p2)):
        below = emitted[(nodes == node) | ((node == 1) & (nodes == 3)), 1]
        if p0[candidates[node - 1]] > 0 and candidates[node - 1] not in candidates[: node - 1]:
            assert len(below) > 1000
            assert chi_square(below, p) < CHI2_4_999
        else:
            assert len(below) == 0  # never accepted: probability 0, or already rejected
    # The test can fail: trying the second candidate with its unrenormalised p (no residual)
    # emits a distribution the statistic rejects.
    a, b = candidates
    if a != b and p0[a] > 0:
        wrong = (1 - p0[a]) * (1 - p0[b]) * _without(p0, {a, b})
        wrong[a] += p0[a]
        wrong[b] += (1 - p0[a]) * p0[b]
        assert chi_square(emitted[:, 0], wrong) > 10 * CHI2_4_999


# ---------------------------------------------------------------- the engine with tree drafts

TREE_CONFIG = EngineConfig(
    max_batch=2,
    max_tokens=16,
    max_context=48,
    page_size=8,
    batch_buckets=(2,),
    chunk_size=12,
    impl="reference",
    speculative=SpeculativeConfig("mtp", num_draft_tokens=D, tree=True, tree_width=2),
)


engines, plain_tokens = speculative_fixtures(TREE_CONFIG, PROMPTS)


def test_greedy_with_mtp_tree_drafts_gives_the_tokens_without_speculation(engines, plain_tokens):
    spec, _ = engines
    assert spec.policy.tree_drafts and spec.speculative.parents == WIDE
    assert generate_tokens(spec, PROMPTS, GREEDY) == plain_tokens
    assert spec.speculative_stats.steps > 0 and spec.step_times[M.DRAFT_EXTEND]
    assert not spec.step_times[M.DECODE] and not spec.mtp.drafts  # every draft was used
    assert spec.retraces == 0


def test_requests_joining_and_leaving_mid_run_match_each_alone(engines, plain_tokens):
    spec, _ = engines
    got = run_joining_and_leaving(spec, PROMPTS, GREEDY)
    assert got == [plain_tokens[0], plain_tokens[1][:3], plain_tokens[3]]
    assert spec.slots.num_used == 0 and spec.pages.num_used == 0 and not spec.mtp.drafts
    assert spec.retraces == 0


class TreeOracleDrafter:
    """Tree drafts for ``WIDE`` (nodes: 1 and 2 below the root, 3 below 1) from the known
    greedy continuations, placed so that the accepted path cycles with the history's length
    through [0, 1, 3], [0, 2], [0, 1] and [0]: two of them leave the chain."""

    def __init__(self, sequences):
        self.sequences = sequences

    def propose(self, history):
        n = len(history)
        seq = next((s for s in self.sequences if s[:n] == list(history)), [])
        right = (seq[n : n + 2] + [0, 0])[:2]
        wrong = [(t + 1) % 256 for t in right]
        return {
            0: (right[0], wrong[0], right[1]),
            1: (wrong[0], right[0], right[1]),
            2: (right[0], wrong[0], wrong[1]),
            3: (wrong[0], wrong[0], right[1]),
        }[n % 4]


def _position_state(engine, req):
    """``slot_states`` and {"cache": every attention layer's keys and values at the request's
    positions 0..num_computed-1, read through its own pages}."""
    kv = engine.state.kv
    pages, n = list(req.pages), req.num_computed
    cache = [np.asarray(a, np.float32)[pages].reshape(-1, *a.shape[2:])[:n] for a in (*kv.k, *kv.v)]
    return {**slot_states(engine, req), "cache": cache}


def test_pool_and_cache_after_each_tree_verify_equal_the_plain_run(engines, plain_tokens):
    spec, plain = engines
    spec.drafter = TreeOracleDrafter([p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)])
    fresh = FromScratch(spec)
    heads = []

    def head_matches_a_fresh_computation(req):
        # The head extended over the accepted (moved) path: its cache and its spine guesses
        # (nodes 1 and 3; node 2 is its second guess at the root) are a fresh chain's.
        want_drafts = fresh.assert_head_cache(spec, req)
        drafts = spec.mtp.drafts[req.request_id]
        assert (drafts[0], drafts[2]) == want_drafts[:2]
        heads.append(req.num_computed)

    plain.overlap = False
    stats = spec.speculative_stats
    start = dataclasses.replace(stats)
    try:
        want = states_by_position(plain, PROMPTS[3], GREEDY, _position_state)
        got = states_by_position(
            spec, PROMPTS[3], GREEDY, _position_state, head_matches_a_fresh_computation
        )
    finally:
        plain.overlap, spec.drafter = True, None
    assert_same_states(got, want, len(PROMPTS[3]))
    assert len(heads) >= 3
    # Every path length occurred: 0, 1 and 2 accepted drafts in 10 tokens.
    assert stats.accepted - start.accepted >= 3 and stats.rows - start.rows < 10
    assert spec.retraces == 0


def test_an_agreeing_head_is_accepted_along_a_branch_off_node_1(engines, cache_dir):
    # After the fixture's engines every program is in the cache: these two only load (another
    # topology of D nodes is the same programs: its parents are metadata data).
    speculative = dataclasses.replace(TREE_CONFIG.speculative, tree_parents=OFF_CHAIN)
    config = dataclasses.replace(TREE_CONFIG, speculative=speculative)
    spec, plain = engine_pair(config, cache_dir, agreeing_model)
    assert spec.speculative.parents == OFF_CHAIN and spec.retraces == 0
    plain.overlap = False
    want = states_by_position(plain, PROMPTS[0], GREEDY, _position_state)
    got = states_by_position(spec, PROMPTS[0], GREEDY, _position_state)
    # Path 0-2-3 every step: nodes 2 and 3 moved to the positions after the root.
    assert_same_states(got, want, len(PROMPTS[0]))
    want_tokens = generate_tokens(plain, PROMPTS, GREEDY)
    assert generate_tokens(spec, PROMPTS, GREEDY) == want_tokens
    stats = spec.speculative_stats
    assert stats.mean_accepted_length > 2.5  # the tree's depth 2, plus the bonus
    assert spec.retraces == 0


def test_seeded_sampling_with_tree_drafts_is_reproducible_and_batch_invariant(engines):
    spec, _ = engines
    solo, mixed, other_seed = seeded_runs(spec, PROMPTS, GREEDY)
    assert mixed == solo and len(solo) == 8
    assert other_seed != solo
    assert spec.retraces == 0


@pytest.mark.slow
def test_bench_reports_tree_drafts_against_plain_serving(capsys, tmp_path):
    flags = ("--speculative", "mtp", "--num-draft-tokens", "4", "--tree-parents=-1,0,0,2")
    code = run_bench(tmp_path, *flags)
    out = capsys.readouterr().out
    assert code == 0, out  # 1: a retrace after warm-up
    assert "speculative mtp D=4 tree (-1, 0, 0, 2)" in out
    assert re.search(r"\nmtp D=4 tree +[0-9.]+ +[0-9.]+ +[0-9.]+%", out)
