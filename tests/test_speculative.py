"""Speculative decoding: n-gram drafts, the acceptance rule, verify scheduling, the engine path."""

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
    OracleDrafter,
    assert_same_states,
    check_agreeing_drafts_are_accepted,
    chi_square,
    engine_pair,
    generate_tokens,
    repeating_model,
    run_bench,
    run_joining_and_leaving,
    seeded_runs,
    speculative_fixtures,
    states_by_position,
)
from flax import nnx

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.engine.scheduler import (
    FinishReason,
    Request,
    RequestError,
    Scheduler,
    SchedulerConfig,
)
from hybrid_jax.engine.speculative import (
    NON_FINITE_MARK,
    NgramDrafter,
    SpeculativeConfig,
    SpeculativeConfigError,
    accept,
    mark_non_finite,
    rejection_sample,
)
from hybrid_jax.kv_cache import PageAllocator
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import SlotAllocator

M = ForwardMode
D = 4

# ---------------------------------------------------------------- drafts and acceptance alone


def test_ngram_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(3, max_ngram=3, min_ngram=1)
    # The suffix (7, 8) occurred twice: the later occurrence (followed by 5, 6) wins over
    # the earlier (followed by 1, 2); the 3-gram (0, 7, 8) occurs once, followed by 9.
    assert drafter.propose([7, 8, 1, 2, 7, 8, 5, 6, 7, 8]) == (5, 6, 7)
    assert drafter.propose([0, 7, 8, 9, 4, 7, 8, 3, 0, 7, 8]) == (9, 4, 7)


def test_ngram_pads_a_short_match_and_a_miss_with_the_last_token():
    drafter = NgramDrafter(3)
    assert drafter.lookup([1, 2, 3, 4]) == []
    assert drafter.propose([1, 2, 3, 4]) == (4, 4, 4)
    assert drafter.propose([5, 9, 5]) == (9, 5, 5)  # match runs out after two tokens


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_the_argmax_bonus():
    vocab = 6
    argmax = np.array([[3, 1, 4, 2], [5, 0, 2, 1], [2, 2, 2, 3]])  # [B, D]
    logits = np.random.default_rng(0).standard_normal((3, D, vocab)).astype(np.float32)
    np.put_along_axis(logits, argmax[..., None], 10.0, axis=-1)
    tokens = np.array([[9, 3, 1, 0], [9, 4, 0, 2], [9, 2, 2, 2]])  # root, then drafts
    zeros = jnp.zeros(3)
    acc = accept(
        jnp.asarray(logits), jnp.asarray(tokens), zeros, jnp.zeros(3, jnp.int32), zeros + 1,
        jnp.zeros(3, jnp.uint32), jnp.zeros(3, jnp.int32),
    )  # fmt: skip
    assert np.asarray(acc.num_accepted).tolist() == [2, 0, 3]
    assert np.asarray(acc.emitted).tolist() == [[3, 1, 4, -1], [5, -1, -1, -1], [2, 2, 2, 3]]


@pytest.mark.parametrize("d", [2, 8])
def test_greedy_acceptance_works_for_every_d(d):
    rng = np.random.default_rng(d)
    logits = rng.standard_normal((d, d, 7)).astype(np.float32)  # row k agrees k drafts
    argmax = logits.argmax(-1)
    tokens = np.zeros((d, d), np.int32)
    for k in range(d):
        tokens[k, 1:] = argmax[k, :-1]
        if k < d - 1:
            tokens[k, 1 + k] = (argmax[k, k] + 1) % 7
    zeros = jnp.zeros(d)
    acc = jax.jit(accept)(
        jnp.asarray(logits), jnp.asarray(tokens), zeros, jnp.zeros(d, jnp.int32), zeros + 1,
        jnp.zeros(d, jnp.uint32), jnp.zeros(d, jnp.int32),
    )  # fmt: skip
    assert np.asarray(acc.num_accepted).tolist() == list(range(d))
    emitted = np.asarray(acc.emitted)
    for k in range(d):
        assert emitted[k, : k + 1].tolist() == argmax[k, : k + 1].tolist()
        assert (emitted[k, k + 1 :] == -1).all()


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_rejection_sampling_keeps_the_target_distribution(draft):
    p0 = np.array([0.1, 0.4, 0.25, 0.25, 0.0])
    p1 = np.array([0.3, 0.05, 0.15, 0.2, 0.3])
    p2 = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
    n = 40000
    probs = jnp.asarray(np.broadcast_to(np.stack([p0, p1, p2]), (n, 3, 5)), jnp.float32)
    drafts = jnp.full((n, 2), draft, jnp.int32).at[:, 1].set(3)
    keys = jax.random.split(jax.random.key(draft), (n, 3))
    acc = rejection_sample(probs, drafts, keys)
    emitted, num = np.asarray(acc.emitted), np.asarray(acc.num_accepted)
    assert chi_square(emitted[:, 0], p0) < CHI2_4_999
    # Given the first draft was accepted, the second token follows the second distribution.
    second = emitted[num >= 1, 1]
    if p0[draft] > 0:
        assert len(second) > 1000
        assert chi_square(second, p1) < CHI2_4_999
    else:
        assert len(second) == 0
    # The test can fail: the draft itself (accept always) is far from the target.
    assert chi_square(np.full(n, draft), np.where(p0 > 0, p0, 1e-9)) > 100 * CHI2_4_999


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "eagle"}, "not a draft source; supported sources: 'ngram', 'mtp'"),
        ({"tree": True}, "source='ngram': the n-gram lookup .* from source='mtp'"),
        ({"tree_parents": (-1, 0, 0, 1)}, "tree_parents=.* but tree=False"),
        ({"num_draft_tokens": 1}, "num_draft_tokens=1 is outside 2..8"),
        ({"num_draft_tokens": 9}, "num_draft_tokens=9 is outside 2..8"),
        ({"min_ngram": 3, "max_ngram": 2}, "need 1 <= min_ngram <= max_ngram"),
    ],
)
def test_speculative_config_refuses_what_is_not_built(kwargs, match):
    with pytest.raises(SpeculativeConfigError, match=match):
        SpeculativeConfig(**kwargs)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--speculative", "eagle"], "--speculative: invalid choice: 'eagle'.*ngram.*mtp"),
        (["--speculative", "ngram", "--num-draft-tokens", "9"], "num_draft_tokens=9"),
        (["--speculative", "ngram", "--tree-width", "2"], "source='ngram'.* source='mtp'"),
        (["--tree-width", "2"], "--tree-width / --tree-parents need --speculative mtp"),
        (["--speculative", "mtp", "--tree-parents=-1,x"], "'-1,x' is not a comma-separated"),
    ],
)
def test_cli_refuses_what_is_not_built_before_building_a_model(flags, match, capsys):
    from hybrid_jax.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", *flags])
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_a_verify_row_of_other_than_d_tokens_is_refused_before_tracing():
    # A row is D tokens whether a chain or a tree of D nodes: the layout refuses any other.
    policy = BucketPolicy.default(2, 16, D, page_size=8, max_context=64)
    with pytest.raises(ValueError, match="TARGET_VERIFY rows carry exactly 4 tokens"):
        build_metadata(M.TARGET_VERIFY, [RowSpec(1, 5, D + 2)], policy, num_slots=3)


# ---------------------------------------------------------------- scheduling verify steps

POLICY = BucketPolicy.default(2, 16, D, page_size=4, max_context=48)


def scheduler(lookahead=D - 1):
    slots, pages = SlotAllocator(3), PageAllocator(40, POLICY.page_size)
    cfg = SchedulerConfig.for_policy(POLICY)
    return Scheduler(cfg, slots, pages, max_context=44, lookahead=lookahead)


def drafts(req):
    return (1, 2, 3)


def test_verify_steps_alternate_with_prefill_and_advance_by_accepted_plus_one():
    sched = scheduler()
    a = Request(0, [10, 11, 12], 8)
    sched.add(a)
    step = sched.schedule_speculative(drafts)
    assert step.mode is M.EXTEND
    sched.commit(step, [20])
    sched.add(Request(1, [30, 31], 8))
    step = sched.schedule_speculative(drafts)
    assert step.mode is M.TARGET_VERIFY and step.rows[0].token_ids == (20, 1, 2, 3)
    assert step.rows[0].start == 3
    kept = sched.resolve_verify(step, [[1, 2, 7]])  # two drafts accepted, bonus 7
    assert kept == [(a, [1, 2, 7])]
    assert a.num_computed == 3 + 3 and a.token_ids[-1] == 7  # root + 2 drafts folded
    step = sched.schedule_speculative(drafts)
    assert step.mode is M.EXTEND  # the waiting request is not starved by verifies
    sched.commit(step, [40])
    step = sched.schedule_speculative(drafts)
    assert step.mode is M.TARGET_VERIFY and [r.start for r in step.rows] == [6, 2]
    assert [r.token_ids[0] for r in step.rows] == [7, 40]


def test_stop_token_among_accepted_drafts_finishes_and_drops_the_rest():
    sched = scheduler()
    req = Request(0, [10, 11], 8, frozenset({2}))
    sched.add(req)
    sched.commit(sched.schedule_speculative(drafts), [5])
    step = sched.schedule_speculative(drafts)
    ((_, kept),) = sched.resolve_verify(step, [[1, 2, 3, 9]])
    assert kept == [1, 2] and req.output_ids == [5, 1, 2]
    assert req.finish_reason is FinishReason.STOP and sched.slots.num_used == 0


def test_budget_cuts_a_verify_row_and_lookahead_pages_cover_its_drafts():
    sched = scheduler()
    req = Request(0, list(range(40)), 5)  # spans 44 positions: the whole max_context
    sched.add(req)
    while not req.is_decoding:  # a 40-token prompt is prefilled in chunks of 16
        sched.commit(sched.schedule_speculative(drafts), [5])
    assert len(req.pages) == -(-(44 + D - 1) // POLICY.page_size)
    sched.resolve_verify(sched.schedule_speculative(drafts), [[1]])  # all drafts rejected
    last = sched.schedule_speculative(drafts)
    (row,) = last.row_specs
    assert row.prefix_len + row.num_tokens == 45  # one position past the request's 44
    build_metadata(last.mode, last.row_specs, POLICY, num_slots=3, num_pages=40)
    with pytest.raises(ValueError, match="past max_context=44"):
        build_metadata(last.mode, last.row_specs, dataclasses.replace(POLICY, max_context=44),
                       num_slots=3)  # fmt: skip
    sched.resolve_verify(last, [[2, 3, 4, 9]])
    assert req.output_ids == [5, 1, 2, 3, 4] and req.finish_reason is FinishReason.LENGTH
    assert sched.pages.num_used == 0 and sched.slots.num_used == 0


# ---------------------------------------------------------------- the engine

SPEC_CONFIG = EngineConfig(
    max_batch=2,
    max_tokens=16,
    max_context=48,
    page_size=8,
    impl="reference",
    speculative=SpeculativeConfig(num_draft_tokens=D),
)


PROMPTS = [
    list(b"abcabcabcabc"),  # repetitive: the n-gram lookup always finds a match
    np.random.default_rng(1).integers(0, 256, 9).tolist(),  # no repeats: padding drafts
    [7, 7, 7, 7, 7],
    list(b"the cat the cat the"),
]
engines, plain_tokens = speculative_fixtures(SPEC_CONFIG, PROMPTS)


def test_a_speculative_engine_refuses_logprobs_naming_the_field(engines):
    speculative, _ = engines
    with pytest.raises(RequestError, match="logprobs=0 .* speculative"):
        speculative.add_request([1, 2, 3], SamplingParams(logprobs=0))
    assert not speculative.has_work


@pytest.fixture
def oracle(engines, plain_tokens):
    spec, _ = engines
    saved = spec.drafter
    sequences = [p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)]
    spec.drafter = OracleDrafter(sequences, D - 1)
    yield spec
    spec.drafter = saved


def test_greedy_with_ngram_drafts_gives_the_tokens_without_speculation(engines, plain_tokens):
    spec, _ = engines
    before = spec.speculative_stats.steps
    assert generate_tokens(spec, PROMPTS, GREEDY) == plain_tokens
    assert spec.speculative_stats.steps > before
    assert spec.step_times[M.TARGET_VERIFY] and not spec.step_times[M.DECODE]
    # Every verify step read back was launched once (launch_times: the host's part of it).
    assert len(spec.launch_times[M.TARGET_VERIFY]) == len(spec.step_times[M.TARGET_VERIFY])


def test_greedy_with_accepted_drafts_gives_the_tokens_without_speculation(oracle, plain_tokens):
    stats = oracle.speculative_stats
    start = dataclasses.replace(stats)
    got = generate_tokens(oracle, PROMPTS, GREEDY)
    assert got == plain_tokens
    accepted, proposed = stats.accepted - start.accepted, stats.proposed - start.proposed
    assert 0.3 < accepted / proposed < 0.9  # accepted often, rejected too
    rows, emitted = stats.rows - start.rows, stats.emitted - start.emitted
    assert emitted == rows + accepted
    assert 0 < stats.acceptance_rate < 1 and stats.mean_accepted_length > 1


def test_requests_joining_and_leaving_mid_run_match_each_alone(oracle, plain_tokens):
    got = run_joining_and_leaving(oracle, PROMPTS, GREEDY)
    assert got == [plain_tokens[0], plain_tokens[1][:3], plain_tokens[3]]
    assert oracle.slots.num_used == 0 and oracle.pages.num_used == 0


def test_mark_non_finite_cuts_a_row_at_its_first_undecidable_token():
    logits = np.random.default_rng(0).standard_normal((3, D, 5)).astype(np.float32)
    logits[0, 2, 1] = np.nan  # decides row 0's third token
    logits[1, 3, 0] = np.inf  # row 1 emits only two tokens: never read
    logits[2, 1, 4] = np.nan  # row 2's tree path: node 3 decides its second token
    emitted = np.array([[5, 6, 7, 8], [5, 6, -1, -1], [5, 6, 7, -1]], np.int32)
    deciders = np.array([[0, 1, 2, 3], [0, 1, 2, 3], [0, 3, 1, 0]], np.int32)
    got = np.asarray(mark_non_finite(jnp.asarray(emitted), jnp.asarray(logits), deciders))
    mark = NON_FINITE_MARK
    np.testing.assert_array_equal(got, [[5, 6, mark, -1], [5, 6, -1, -1], [5, 6, mark, -1]])


def test_a_request_whose_logits_turn_non_finite_ends_alike_with_and_without_speculation(
    engines, plain_tokens, cache_dir
):
    """Token X's embedding is NaN; X is the third token the clean model generates, so the
    request keeps X and ends there, whether X comes as a verify row's root, an accepted
    draft or a bonus token."""
    _, plain = engines
    index = next(i for i, t in enumerate(plain_tokens) if t[2] not in PROMPTS[i] + t[:2])
    poison = plain_tokens[index][2]

    def poisoned():
        model = Qwen3Next(tiny_qwen3_next_config(), rngs=nnx.Rngs(0))
        table = model.embed_tokens.embedding
        table.set_value(table.get_value().at[poison].set(float("nan")))
        return model

    spec, plain = engine_pair(SPEC_CONFIG, cache_dir, poisoned)
    want = plain.generate([PROMPTS[index]], GREEDY)[0]
    assert want.finish_reason is FinishReason.NON_FINITE
    assert want.token_ids == plain_tokens[index][:3]
    for drafter in (None, OracleDrafter([PROMPTS[index] + plain_tokens[index]], D - 1)):
        if drafter is not None:
            spec.drafter = drafter
        events = [e for _, e in spec.stream([PROMPTS[index]], GREEDY)]
        got = events[-1].result
        assert (got.finish_reason, got.token_ids) == (want.finish_reason, want.token_ids)
        assert [e.token_id for e in events if e.token_id >= 0] == want.token_ids
        assert spec.slots.num_used == 0 and spec.pages.num_used == 0


def test_pool_after_each_verify_and_commit_equals_the_plain_run(engines, oracle):
    _, plain = engines
    plain.overlap = False
    try:
        want = states_by_position(plain, PROMPTS[3], GREEDY)
    finally:
        plain.overlap = True
    got = states_by_position(oracle, PROMPTS[3], GREEDY)
    assert_same_states(got, want, len(PROMPTS[3]))


def test_seeded_sampling_with_speculation_is_reproducible_and_batch_invariant(engines):
    spec, _ = engines
    solo, mixed, other_seed = seeded_runs(spec, PROMPTS, GREEDY)
    assert mixed == solo and len(solo) == 8
    assert other_seed != solo


def test_no_retrace_after_warm_up_with_speculation(engines, plain_tokens):
    spec, _ = engines
    spec.generate(PROMPTS, GREEDY)
    spec.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9))
    assert spec.step_times[M.TARGET_VERIFY] and spec.step_times[M.EXTEND]
    assert spec.retraces == 0


@pytest.mark.slow
def test_bench_compares_tokens_per_s_with_and_without_speculation(capsys, tmp_path):
    code = run_bench(tmp_path, "--speculative", "ngram", "--num-draft-tokens", "3")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "TARGET_VERIFY step" in out and "speculative ngram D=3" in out
    assert "\noff " in out and "\nngram D=3 " in out


def test_ngram_drafts_accepted_by_a_repeating_model_change_no_token(engines, cache_dir):
    check_agreeing_drafts_are_accepted(SPEC_CONFIG, cache_dir, repeating_model, PROMPTS)
