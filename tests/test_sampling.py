"""Sampling: parameter validation, top-k / top-p masks, greedy, seeds, batch invariance."""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from hybrid_jax.engine import sampling
from hybrid_jax.engine.sampling import (
    NON_FINITE_TOKEN,
    VARIANTS,
    Filters,
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingParamsError,
    greedy_tokens,
    logit_stats,
    record_tokens,
    sample,
    top_k_mask,
    top_p_mask,
)

V = 32
sample_jit = jax.jit(sample)


def logits(rows, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, V)).astype(np.float32) * 3


def draw(x, params, seeds, steps):
    b = SamplingBatch.pack(params, seeds, steps, len(x))
    args = (b.temperature, b.top_k, b.top_p, b.seeds, b.steps)
    return np.asarray(sample_jit(jnp.asarray(x), *map(jnp.asarray, args)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=2.0), "max_new_tokens=2.0"),
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=True), "temperature=True"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(seed=-1), "seed=-1"),
        (dict(seed=2**32), "seed=4294967296"),
        (dict(stop_token_ids=(3, -2)), r"stop_token_ids\[1\]=-2"),
        (dict(stop_token_ids="ab"), "stop_token_ids='ab'"),
        (dict(logprobs=-1), "logprobs=-1"),
        (dict(logprobs=21), "logprobs=21"),
        (dict(logprobs=True), "logprobs=True"),
        (dict(logprobs=2.0), "logprobs=2.0"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_vocab_dependent_params_are_checked_against_the_vocabulary():
    SamplingParams(top_k=V, stop_token_ids=(V - 1,)).check_vocab(V)
    with pytest.raises(SamplingParamsError, match=f"top_k={V + 1}"):
        SamplingParams(top_k=V + 1).check_vocab(V)
    with pytest.raises(SamplingParamsError, match=rf"stop_token_ids\[0\]={V}"):
        SamplingParams(stop_token_ids=(V,)).check_vocab(V)
    SamplingParams(logprobs=20).check_vocab(20)
    with pytest.raises(SamplingParamsError, match="logprobs=20 asks for more tokens"):
        SamplingParams(logprobs=20).check_vocab(19)


def test_sampler_logprobs_match_a_float64_log_softmax():
    """The chosen tokens' log-probabilities (greedy and drawn rows, a non-finite row) and each
    row's most likely tokens, against float64 on fresh random logits."""
    vocab = 300  # more tokens than MAX_TOP_LOGPROBS
    x = np.random.default_rng(21).standard_normal((3, vocab)).astype(np.float32) * 4
    x[2, 7] = np.nan
    sampler = Sampler()
    sampler.compile(3, vocab, 4)
    traces = sampler.trace_count
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5), SamplingParams()]
    batch = SamplingBatch.pack(params, [0, 4, 0], [0, 2, 0], 3)
    tokens, logprobs, _ = sampler(jnp.asarray(x), batch, jnp.zeros(4, jnp.int32), jnp.arange(3))
    top_values, top_ids = sampler.top_logprobs(jnp.asarray(x))
    assert sampler.trace_count == traces  # compiled with the sampler
    wide = x.astype(np.float64)
    log_softmax = wide - np.log(np.exp(wide - wide.max(-1, keepdims=True)).sum(-1, keepdims=True))
    log_softmax -= wide.max(-1, keepdims=True)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    for row in (0, 1):
        np.testing.assert_allclose(logprobs[row], log_softmax[row, tokens[row]], rtol=1e-6)
        order = np.argsort(-wide[row])[:20]
        np.testing.assert_array_equal(np.asarray(top_ids)[row], order)
        np.testing.assert_allclose(np.asarray(top_values)[row], log_softmax[row, order], rtol=1e-6)
    assert tokens[0] == np.argmax(x[0]) and tokens[2] == NON_FINITE_TOKEN
    assert np.isnan(logprobs[2]) and np.isnan(np.asarray(top_values)[2]).all()


def test_top_k_mask_keeps_exactly_the_k_largest():
    x = logits(4)
    k = np.array([1, 5, 0, V])
    mask = np.asarray(top_k_mask(jnp.asarray(x), jnp.asarray(k)))
    for row, kk in enumerate(k):
        want = np.zeros(V, bool)
        want[np.argsort(-x[row])[: kk or V]] = True
        np.testing.assert_array_equal(mask[row], want)


def test_top_p_mask_keeps_the_smallest_nucleus():
    x = logits(3, seed=1)
    p = np.array([0.3, 0.9, 1e-6])
    mask = np.asarray(top_p_mask(jnp.asarray(x), jnp.asarray(p, np.float32)))
    for row in range(3):
        probs = np.exp(x[row] - x[row].max())
        probs /= probs.sum()
        order = np.argsort(-probs)
        n = int(np.searchsorted(np.cumsum(probs[order]), p[row])) + 1
        want = np.zeros(V, bool)
        want[order[:n]] = True
        np.testing.assert_array_equal(mask[row], want)


def test_greedy_takes_the_argmax():
    x = logits(3)
    out = draw(x, [SamplingParams()] * 3, [0, 1, 2], [0, 0, 0])
    np.testing.assert_array_equal(out, x.argmax(-1))


def test_sampled_tokens_stay_inside_top_k():
    x = logits(1)
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    allowed = set(np.argsort(-x[0])[:3].tolist())
    tokens = {int(draw(x, [params], [0], [s])[0]) for s in range(64)}
    assert tokens <= allowed and len(tokens) > 1


def test_same_seed_and_step_reproduce_and_other_seeds_differ():
    x = np.repeat(logits(1), 8, axis=0)
    params = [SamplingParams(temperature=2.0)] * 8
    a = draw(x, params, [7] * 8, list(range(8)))
    b = draw(x, params, [7] * 8, list(range(8)))
    c = draw(x, params, [8] * 8, list(range(8)))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_a_row_samples_the_same_token_in_any_batch():
    x = logits(4, seed=3)
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=1.3),
    ]
    seeds, steps = [11, 12, 13, 14], [0, 3, 5, 2]
    together = draw(x, params, seeds, steps)
    for i in range(4):
        alone = draw(x[i : i + 1], params[i : i + 1], seeds[i : i + 1], steps[i : i + 1])
        assert together[i] == alone[0]


def test_sampler_records_tokens_per_slot_and_does_not_retrace_once_compiled():
    sampler = Sampler()
    sampler.compile(2, V, 5)
    traces = sampler.trace_count
    batch = SamplingBatch.pack([SamplingParams()] * 2, [0, 0], [0, 0], 2)
    buffer = jnp.full(5, -7, jnp.int32)
    tokens, _, buffer = sampler(jnp.asarray(logits(2)), batch, buffer, jnp.asarray([3, 1]))
    want = logits(2).argmax(-1)
    np.testing.assert_array_equal(np.asarray(tokens), want)
    np.testing.assert_array_equal(np.asarray(buffer), [-7, want[1], -7, want[0], -7])
    assert sampler.trace_count == traces
    batch = SamplingBatch.pack([], [], [], 3)
    sampler(jnp.asarray(logits(3)), batch, jnp.zeros(5, jnp.int32), jnp.zeros(3, jnp.int32))
    assert sampler.trace_count == traces + 1


@pytest.mark.parametrize("one_pass", [True, False])
def test_greedy_tokens_are_what_the_sampler_returns_for_a_greedy_batch(monkeypatch, one_pass):
    """The step's own greedy draw (``greedy_tokens``) against the sampler's greedy variant and
    against each row's argmax recorded as a drawn token (``record_tokens``): the same
    tokens, log-probabilities and buffer bit for bit, a non-finite row included; and the
    most likely of a row's top log-probabilities is its greedy token's, bit for bit."""
    monkeypatch.setattr(sampling, "ONE_PASS_GREEDY", one_pass)
    x = logits(4, seed=3)
    x[2, 5] = np.nan
    slots = jnp.asarray([3, 0, 6, 1])
    start = jnp.asarray(np.random.default_rng(4).integers(0, V, 8), jnp.int32)
    sampler = Sampler()
    batch = SamplingBatch.pack([SamplingParams()] * 3, [0, 0, 0], [0, 0, 0], 4)
    # Fresh functions: jit's cache does not know the switch.
    got = jax.jit(lambda *args: greedy_tokens(*args))(jnp.asarray(x), start, slots)
    chex.assert_trees_all_equal(sampler(jnp.asarray(x), batch, jnp.array(start), slots), got)
    argmax = jnp.argmax(jnp.asarray(x), axis=-1).astype(jnp.int32)
    recorded = jax.jit(lambda *args: record_tokens(*args))(jnp.asarray(x), argmax, start, slots)
    chex.assert_trees_all_equal(recorded, got)
    top_values, top_ids = sampler.top_logprobs(jnp.asarray(x))
    for row in (0, 1, 3):
        assert int(top_ids[row, 0]) == int(got[0][row])
        assert float(top_values[row, 0]) == float(got[1][row])
    assert int(got[0][2]) == NON_FINITE_TOKEN and int(got[2][6]) == 0 and np.isnan(got[1][2])
    assert np.isnan(np.asarray(top_values)[2]).all()
    np.testing.assert_array_equal(np.asarray(got[0])[[0, 1, 3]], x[[0, 1, 3]].argmax(-1))


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("vocab", [1009, 6000, 248320])
def test_logit_stats_match_a_float64_oracle(monkeypatch, one_pass, vocab):
    """Each row's argmax (the first of equal maxima), log-probabilities and finiteness
    against float64 on fresh logits, in one reduction and in XLA's two: a prime vocabulary
    (one run), one of several runs and the 35B-like model's, whose float32 sum over runs
    stays within 1e-6 of float64."""
    monkeypatch.setattr(sampling, "ONE_PASS_GREEDY", one_pass)
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((7, vocab)) * rng.uniform(1, 8, (7, 1))).astype(np.float32)
    x[1, [vocab // 3, vocab - 1]] = x[1].max() + 0.5  # a tie: the lower index wins
    x[2, vocab // 2] = 60.0  # one logit far above the rest: a log-probability near 0
    x[3] = x[3] * 0.01  # a flat row: log-probabilities near -log(V)
    x[4, 0] = np.nan
    x[5, vocab - 1] = np.inf
    x[6, 7] = -np.inf
    stats, logprobs = jax.jit(lambda z: (logit_stats(z), logit_stats(z).logprobs(z)))(
        jnp.asarray(x)
    )
    np.testing.assert_array_equal(np.asarray(stats.finite), [True] * 4 + [False] * 3)
    assert np.isnan(np.asarray(logprobs)[4:]).all()
    wide = x[:4].astype(np.float64)
    np.testing.assert_array_equal(np.asarray(stats.argmax)[:4], wide.argmax(-1))
    assert int(stats.argmax[1]) == vocab // 3
    top = wide.max(-1, keepdims=True)
    want = wide - top - np.log(np.exp(wide - top).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(-stats.log_sum)[:4], want.max(-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logprobs)[:4], want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("shape", [(7,), (2, 0), (2, 3, 4)])
def test_logit_stats_refuse_logits_that_are_not_rows_by_vocabulary(shape):
    want = re.escape(f"logits must be [B, V] with V >= 1; got {shape}")
    with pytest.raises(ValueError, match=want):
        logit_stats(jnp.zeros(shape, jnp.float32))


def _primitives(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax_core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_the_sampler_never_sorts_the_vocabulary():
    b = SamplingBatch.pack([SamplingParams(temperature=1.0, top_k=4, top_p=0.5)], [0], [0], 2)
    args = (b.temperature, b.top_k, b.top_p, b.seeds, b.steps)
    jaxpr = jax.make_jaxpr(sample)(jnp.asarray(logits(2)), *map(jnp.asarray, args)).jaxpr
    used = _primitives(jaxpr)
    assert "argmax" in used
    assert not used & {"sort", "top_k", "approx_top_k"}, used


@pytest.mark.parametrize("seed", range(3))
def test_masks_match_a_sorting_oracle_on_wide_rows_with_ties_and_signed_zeros(seed):
    rng = np.random.default_rng(seed)
    vocab = 4096
    x = rng.standard_normal((6, vocab)).astype(np.float32) * 4
    x[:, :64] = np.round(x[:, :64])  # exact ties
    x[0, 100], x[0, 101] = 0.0, -0.0
    x[1, 200:] = -np.inf  # masked by an earlier filter
    k = np.array([1, 7, 64, 500, vocab - 1, 0])
    got = np.asarray(top_k_mask(jnp.asarray(x), jnp.asarray(k, np.int32)))
    for row, kk in enumerate(k):
        kth = np.sort(x[row])[::-1][max(kk, 1) - 1]
        want = (x[row] >= kth) | (kk <= 0)
        np.testing.assert_array_equal(got[row], want)
    p = np.array([0.05, 0.5, 0.9, 0.999, 1.0, 1e-6], np.float32)
    got = np.asarray(top_p_mask(jnp.asarray(x), jnp.asarray(p)))
    for row in range(6):
        z = x[row].astype(np.float64)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        above = np.array([probs[z > v].sum() for v in z])  # strictly more likely tokens
        want = (above < p[row]) | (p[row] >= 1)
        margin = np.abs(above - p[row]) > 1e-5  # float32 sums may differ within rounding
        np.testing.assert_array_equal(got[row][margin], want[margin])
        assert got[row][np.argmax(z)]


def test_a_batch_runs_only_the_stages_some_row_needs():
    greedy = SamplingBatch.pack([SamplingParams()] * 2, [0, 0], [0, 0], 3)
    assert greedy.filters == Filters(False, False, False)
    mixed = SamplingBatch.pack(
        [SamplingParams(top_k=5), SamplingParams(temperature=1.0, top_p=0.5)], [0, 0], [0, 0], 2
    )
    # top_k of a greedy row asks for nothing; the sampled row's top_p does.
    assert mixed.filters == Filters(True, False, True)
    assert all(f in VARIANTS for f in (greedy.filters, mixed.filters))
    args = [jnp.asarray(a) for a in (greedy.temperature, greedy.top_k, greedy.top_p)]
    jaxpr = jax.make_jaxpr(lambda x, *a: sample(x, *a, greedy.filters))(
        jnp.asarray(logits(3)), *args, jnp.asarray(greedy.seeds), jnp.asarray(greedy.steps)
    ).jaxpr
    assert _primitives(jaxpr) <= {"argmax", "convert_element_type"}, _primitives(jaxpr)


def test_a_row_gets_the_same_token_whichever_stages_its_batch_runs():
    sampler = Sampler()
    sampler.compile(2, V, 4)
    traces = sampler.trace_count
    x = logits(2, seed=5)
    plain = SamplingParams(temperature=1.3, seed=9)
    filtered = SamplingParams(temperature=0.9, top_k=4, top_p=0.7, seed=3)
    alone = SamplingBatch.pack([plain, plain], [9, 9], [4, 4], 2)
    beside = SamplingBatch.pack([plain, filtered], [9, 3], [4, 4], 2)
    assert alone.filters != beside.filters
    buffer, slots = jnp.zeros(4, jnp.int32), jnp.asarray([1, 2])
    a, _, _ = sampler(jnp.asarray(x), alone, buffer, slots)
    b, _, _ = sampler(jnp.asarray(x), beside, jnp.zeros(4, jnp.int32), slots)
    assert int(a[0]) == int(b[0])
    assert sampler.trace_count == traces  # every variant was compiled ahead of time


def test_the_sampler_takes_host_and_device_slots_alike_and_keeps_every_bit():
    """The rows' inputs travel as the int32 words of one array: with host slots (joined on
    the host) and with device slots (joined there) the sampler draws what ``sample`` draws
    from the arrays themselves, seeds above 2**31 and fractional temperatures included, and
    records each real row's token in its slot."""
    x = jnp.asarray(logits(4, seed=3))
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9),
    ]
    batch = SamplingBatch.pack(params, [0, 2**32 - 5, 2**31 + 7], [0, 3, 1], 4)
    sampler = Sampler()
    sampler.compile(4, V, 8)
    slots = np.array([1, 2, 3, 0], np.int32)
    from_host = sampler(x, batch, jnp.zeros(8, jnp.int32), slots)
    from_device = sampler(x, batch, jnp.zeros(8, jnp.int32), jnp.asarray(slots))
    chex.assert_trees_all_equal(from_host, from_device)
    fields = (batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps)
    expected = sample(x, *map(jnp.asarray, fields), batch.filters)
    tokens, _, buffer = from_host
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(buffer)[1:4], np.asarray(tokens)[:3])


def test_a_sampler_compiled_without_greedy_leaves_only_greedy_batches_to_trace():
    # A serving engine draws a greedy batch's tokens in its step, so it compiles the rest.
    sampler = Sampler()
    sampler.compile(2, V, 4, greedy=False)
    traces = sampler.trace_count
    drawn = SamplingBatch.pack([SamplingParams(temperature=0.7, top_k=3)] * 2, [1, 2], [0, 0], 2)
    greedy = SamplingBatch.pack([SamplingParams()] * 2, [0, 0], [0, 0], 2)
    x, slots = jnp.asarray(logits(2)), jnp.asarray([1, 2])
    sampler(x, drawn, jnp.zeros(4, jnp.int32), slots)
    assert sampler.trace_count == traces
    sampler.compile(2, V, 4)  # the greedy variant alone is left to compile
    assert sampler.trace_count == traces + 1
    tokens, _, _ = sampler(x, greedy, jnp.zeros(4, jnp.int32), slots)
    assert sampler.trace_count == traces + 1
    np.testing.assert_array_equal(np.asarray(tokens), logits(2).argmax(-1))


def test_a_sampler_compiled_for_bfloat16_logits_draws_as_from_their_float32_widening():
    """A serving step gives its logits in the model's dtype; the sampler compiled for that
    dtype takes them without tracing and draws, scores and ranks exactly as from the same
    values in float32."""
    vocab = 300
    narrow = jnp.asarray(np.random.default_rng(5).standard_normal((3, vocab)) * 4, jnp.bfloat16)
    widened = narrow.astype(jnp.float32)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5), SamplingParams(top_p=0.9)]
    batch = SamplingBatch.pack(params, [0, 4, 9], [0, 2, 3], 3)
    results = []
    for x in (narrow, widened):
        sampler = Sampler()
        sampler.compile(3, vocab, 4, dtype=x.dtype)
        traces = sampler.trace_count
        drawn = sampler(x, batch, jnp.zeros(4, jnp.int32), jnp.arange(1, 4))
        top = sampler.top_logprobs(x)
        assert sampler.trace_count == traces, f"{x.dtype} logits traced again"
        results.append((drawn, top))
    chex.assert_trees_all_equal(*results)
