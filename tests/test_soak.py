"""A bounded soak of the serving loop: a few hundred requests of random lengths and sampling,
stop tokens, aborts and rejected calls between steps (``-m slow`` runs a longer one)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams, SamplingParamsError
from hybrid_jax.engine.scheduler import FinishReason, RequestError

CONFIG = EngineConfig(
    max_batch=4, max_tokens=32, max_context=64, page_size=8, num_pages=20, impl="reference",
    cache_dir=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", CONFIG, progress=False)


def _params(rng: np.random.Generator) -> SamplingParams:
    kind = rng.integers(4)
    new = int(rng.integers(1, 12))
    stops = tuple(int(t) for t in rng.integers(0, 256, rng.integers(0, 3)))
    if kind == 0:
        return SamplingParams(max_new_tokens=new, stop_token_ids=stops)
    return SamplingParams(
        max_new_tokens=new, temperature=float(rng.uniform(0.5, 1.5)),
        top_k=int(rng.integers(0, 40)) if kind == 2 else 0,
        top_p=float(rng.uniform(0.3, 1.0)) if kind == 3 else 1.0,
        seed=int(rng.integers(2**32)), stop_token_ids=stops,
    )  # fmt: skip


_BAD = [
    ([], SamplingParams(), RequestError),  # empty prompt
    (list(range(70)), SamplingParams(), RequestError),  # longer than the context
    ([1, 2, 300], SamplingParams(), RequestError),  # outside the vocabulary
    ([1, 2], SamplingParams(top_k=999), SamplingParamsError),
]


def soak(engine: Engine, requests: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    submitted: dict[int, SamplingParams] = {}
    streamed: dict[int, list[int]] = collections.defaultdict(list)
    results, aborted = {}, set()
    sent = rejected = 0
    while sent < requests or engine.has_work:
        for _ in range(rng.integers(0, 3) if sent < requests else 0):
            prompt = rng.integers(0, 256, rng.integers(1, 50)).tolist()
            params = _params(rng)
            submitted[engine.add_request(prompt, params)] = params
            sent += 1
        if rng.random() < 0.05:
            bad, params, error = _BAD[rng.integers(len(_BAD))]
            queued = len(engine.scheduler)
            with pytest.raises(error):
                engine.add_request(bad, params)
            assert len(engine.scheduler) == queued
            rejected += 1
        if rng.random() < 0.04 and submitted:
            victim = int(rng.choice(list(submitted)))
            if victim not in results and victim not in aborted:
                result = engine.abort(victim)
                aborted.add(victim)
                if result is not None:
                    assert result.finish_reason is FinishReason.ABORT
        for event in engine.step():
            if event.token_id >= 0:
                streamed[event.request_id].append(event.token_id)
            if event.result is not None:
                results[event.request_id] = event.result
    assert engine.retraces == 0
    assert engine.slots.num_used == 0 and engine.pages.num_used == 0
    assert set(results) | aborted == set(submitted)
    # The soak went where it is meant to: every kind of ending, and rejected calls.
    reasons = collections.Counter(r.finish_reason for r in results.values())
    assert reasons[FinishReason.STOP] and reasons[FinishReason.LENGTH] and aborted and rejected
    for rid, result in results.items():
        params = submitted[rid]
        assert streamed[rid] == result.token_ids
        assert 1 <= len(result.token_ids) <= params.max_new_tokens
        if result.finish_reason is FinishReason.STOP:
            assert result.token_ids[-1] in params.stop_token_ids
        elif result.finish_reason is FinishReason.LENGTH:
            assert len(result.token_ids) == params.max_new_tokens
            assert not set(result.token_ids[:-1]) & set(params.stop_token_ids)
        else:
            raise AssertionError(f"request {rid} finished with {result.finish_reason}")


def test_soak_of_a_few_hundred_requests(engine):
    soak(engine, requests=300, seed=0)


@pytest.mark.slow
def test_long_soak(engine):
    soak(engine, requests=3000, seed=1)
