"""Speculative decoding: n-gram drafts, the acceptance rule, verify scheduling, the engine path."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from hybrid_jax.engine.engine import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.engine.scheduler import FinishReason, Request, Scheduler, SchedulerConfig
from hybrid_jax.engine.speculative import (
    NgramDrafter,
    SpeculativeConfig,
    SpeculativeConfigError,
    accept,
    rejection_sample,
)
from hybrid_jax.kv_cache import PageAllocator
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config
from hybrid_jax.models.tokenizer import ByteTokenizer
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


def _chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=len(probs))
    expected = probs * len(tokens)
    real = expected > 0
    assert counts[~real].sum() == 0, "a token of probability 0 was emitted"
    return float((((counts - expected) ** 2)[real] / expected[real]).sum())


# chi-square 99.9% quantile at 4 degrees of freedom (5 tokens): with a fixed seed the test is
# deterministic, and a wrong rule lands far above it (checked below).
CHI2_4_999 = 18.47


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
    assert _chi_square(emitted[:, 0], p0) < CHI2_4_999
    # Given the first draft was accepted, the second token follows the second distribution.
    second = emitted[num >= 1, 1]
    if p0[draft] > 0:
        assert len(second) > 1000
        assert _chi_square(second, p1) < CHI2_4_999
    else:
        assert len(second) == 0
    # The test can fail: the draft itself (accept always) is far from the target.
    assert _chi_square(np.full(n, draft), np.where(p0 > 0, p0, 1e-9)) > 100 * CHI2_4_999


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
        (["--speculative", "eagle"], "not a draft source; supported sources: 'ngram', 'mtp'"),
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

CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
SPEC_CONFIG = EngineConfig(
    max_batch=2,
    max_tokens=16,
    max_context=48,
    page_size=8,
    impl="reference",
    speculative=SpeculativeConfig(num_draft_tokens=D),
)
GREEDY = SamplingParams(max_new_tokens=10)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """JAX's persistent cache for this module's engines (a process-wide setting, restored)."""
    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    yield str(tmp_path_factory.mktemp("xla_cache"))
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def build_pair(cache_dir, model=None):
    """(speculative, plain) engines of one model (the tiny preset's by default). The plain
    one's context holds the speculative one's lookahead page, so its page tables, and so its
    EXTEND executables and samplers, are the same programs, shared through the cache."""
    spec_config = dataclasses.replace(SPEC_CONFIG, cache_dir=cache_dir)
    context = spec_config.policy(tiny_qwen3_next_config().max_position_embeddings).max_context
    plain_config = dataclasses.replace(spec_config, speculative=None, max_context=context)
    if model is None:
        pair = [Engine.from_preset("tiny", c, progress=False) for c in (spec_config, plain_config)]
    else:
        pair = [
            Engine(model(), ByteTokenizer(), c, progress=False) for c in (spec_config, plain_config)
        ]
    assert pair[0].policy.max_pages == pair[1].policy.max_pages
    return tuple(pair)


@pytest.fixture(scope="module")
def engines(cache_dir):
    return build_pair(cache_dir)


PROMPTS = [
    list(b"abcabcabcabc"),  # repetitive: the n-gram lookup always finds a match
    np.random.default_rng(1).integers(0, 256, 9).tolist(),  # no repeats: padding drafts
    [7, 7, 7, 7, 7],
    list(b"the cat the cat the"),
]


@pytest.fixture(scope="module")
def plain_tokens(engines):
    _, plain = engines
    return [r.token_ids for r in plain.generate(PROMPTS, GREEDY)]


class OracleDrafter:
    """Drafts from the known greedy continuations, one draft wrong at a position that cycles
    with the history's length, so every acceptance length 0..D-1 occurs."""

    def __init__(self, sequences, num_drafts=D - 1):
        self.sequences, self.num_drafts = sequences, num_drafts

    def propose(self, history):
        n = len(history)
        # A history off every known sequence (the engine went wrong) gets plain padding, so
        # the test fails on the tokens, not in here.
        seq = next((s for s in self.sequences if s[:n] == list(history)), [])
        out = (seq[n : n + self.num_drafts] + [0] * self.num_drafts)[: self.num_drafts]
        wrong = n % (self.num_drafts + 1)
        if wrong < self.num_drafts:
            out[wrong] = (out[wrong] + 1) % 256
        return tuple(out)


@pytest.fixture
def oracle(engines, plain_tokens):
    spec, _ = engines
    saved = spec.drafter
    spec.drafter = OracleDrafter([p + t for p, t in zip(PROMPTS, plain_tokens, strict=True)])
    yield spec
    spec.drafter = saved


def test_greedy_with_ngram_drafts_gives_the_tokens_without_speculation(engines, plain_tokens):
    spec, _ = engines
    before = spec.speculative_stats.steps
    assert [r.token_ids for r in spec.generate(PROMPTS, GREEDY)] == plain_tokens
    assert spec.speculative_stats.steps > before
    assert spec.step_times[M.TARGET_VERIFY] and not spec.step_times[M.DECODE]


def test_greedy_with_accepted_drafts_gives_the_tokens_without_speculation(oracle, plain_tokens):
    stats = oracle.speculative_stats
    start = dataclasses.replace(stats)
    got = [r.token_ids for r in oracle.generate(PROMPTS, GREEDY)]
    assert got == plain_tokens
    accepted, proposed = stats.accepted - start.accepted, stats.proposed - start.proposed
    assert 0.3 < accepted / proposed < 0.9  # accepted often, rejected too
    rows, emitted = stats.rows - start.rows, stats.emitted - start.emitted
    assert emitted == rows + accepted
    assert 0 < stats.acceptance_rate < 1 and stats.mean_accepted_length > 1


def test_requests_joining_and_leaving_mid_run_match_each_alone(oracle, plain_tokens):
    short = dataclasses.replace(GREEDY, max_new_tokens=3)
    tokens: dict[int, list[int]] = {}
    ids = [oracle.add_request(PROMPTS[0], GREEDY)]
    for event in oracle.step() + oracle.step():
        tokens.setdefault(event.request_id, []).append(event.token_id)
    ids.append(oracle.add_request(PROMPTS[1], short))  # joins while 0 verifies, leaves early
    joined_late = False
    while oracle.has_work:
        for event in oracle.step():
            tokens.setdefault(event.request_id, []).append(event.token_id)
        if not joined_late and ids[1] not in {r.request_id for r in oracle.scheduler.running}:
            ids.append(oracle.add_request(PROMPTS[3], GREEDY))  # joins after 1 left
            joined_late = True
    assert [tokens[i] for i in ids] == [plain_tokens[0], plain_tokens[1][:3], plain_tokens[3]]
    assert oracle.slots.num_used == 0 and oracle.pages.num_used == 0


def _slot_state(engine, slot):
    pool = engine.state.pool
    return [np.asarray(a[slot]) for a in (*pool.conv, *pool.ssm)]


def _states_by_position(engine, prompt, params):
    """{tokens folded into the slot: every linear layer's state} after each step."""
    engine.add_request(prompt, params)
    states = {}
    while engine.has_work:
        engine.step()
        if engine.scheduler.running:
            req = engine.scheduler.running[0]
            states[req.num_computed] = _slot_state(engine, req.slot)
    return states


def test_pool_after_each_verify_and_commit_equals_the_plain_run(engines, oracle):
    _, plain = engines
    plain.overlap = False
    try:
        want = _states_by_position(plain, PROMPTS[3], GREEDY)
    finally:
        plain.overlap = True
    got = _states_by_position(oracle, PROMPTS[3], GREEDY)
    prompt_len = len(PROMPTS[3])
    verified = sorted(n for n in got if n > prompt_len)
    assert len(verified) >= 2 and set(verified) <= set(want)
    for n in verified:
        for layer, (a, b) in enumerate(zip(got[n], want[n], strict=True)):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=f"{n=} {layer=}")
    # The check can fail: the states of neighbouring positions differ.
    assert not np.allclose(got[verified[0]][-1], want[verified[1]][-1], rtol=2e-5, atol=2e-5)


def test_seeded_sampling_with_speculation_is_reproducible_and_batch_invariant(engines):
    spec, _ = engines
    params = SamplingParams(max_new_tokens=8, temperature=1.2, top_k=50, seed=7)
    (solo,) = spec.generate([PROMPTS[0]], params)
    mixed = spec.generate([PROMPTS[0], PROMPTS[2]], [params, GREEDY])
    assert mixed[0].token_ids == solo.token_ids and len(solo.token_ids) == 8
    (other,) = spec.generate([PROMPTS[0]], dataclasses.replace(params, seed=8))
    assert other.token_ids != solo.token_ids


def test_no_retrace_after_warm_up_with_speculation(engines, plain_tokens):
    spec, _ = engines
    spec.generate(PROMPTS, GREEDY)
    spec.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9))
    assert spec.step_times[M.TARGET_VERIFY] and spec.step_times[M.EXTEND]
    assert spec.retraces == 0


@pytest.mark.slow
def test_bench_compares_tokens_per_s_with_and_without_speculation(capsys, tmp_path):
    from hybrid_jax.cli import main

    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    argv = [
        "bench", "--num-prompts", "2", "--prompt-len", "6", "--new-tokens", "5", "--plot", "",
        "--max-batch", "2", "--max-tokens", "16", "--max-context", "32", "--impl", "reference",
        "--cache-dir", str(tmp_path), "--speculative", "ngram", "--num-draft-tokens", "3",
    ]  # fmt: skip
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
    out = capsys.readouterr().out
    assert exit_info.value.code == 0, out
    assert "TARGET_VERIFY step" in out and "speculative ngram D=3" in out
    assert "\noff " in out and "\nngram D=3 " in out


def repeating_model() -> Qwen3Next:
    """The tiny model made to repeat the token it is fed: embeddings scaled up dominate the
    residual stream, and the LM head is the embedding itself, so the argmax is the input."""
    model = Qwen3Next(tiny_qwen3_next_config(), rngs=nnx.Rngs(0))
    embedding = model.embed_tokens.embedding.get_value()
    model.embed_tokens.embedding.set_value(embedding * 30)
    model.lm_head.kernel.set_value(embedding.T)
    return model


def test_ngram_drafts_accepted_by_a_repeating_model_change_no_token(engines, cache_dir):
    # After the fixture's engines, every program is in the cache: these two only load.
    spec, plain = build_pair(cache_dir, repeating_model)
    want = [r.token_ids for r in plain.generate(PROMPTS, GREEDY)]
    assert want[1] == [PROMPTS[1][-1]] * GREEDY.max_new_tokens  # it does repeat
    assert [r.token_ids for r in spec.generate(PROMPTS, GREEDY)] == want
    stats = spec.speculative_stats
    assert stats.acceptance_rate > 0.9 and stats.mean_accepted_length > D - 0.5
    assert spec.retraces == 0
