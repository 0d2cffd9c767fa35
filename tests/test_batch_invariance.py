"""EngineConfig(batch_invariant=True): a request's logits do not depend on its batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.engine.speculative import SpeculativeConfig
from hybrid_jax.metadata import RowSpec, build_metadata
from hybrid_jax.modes import ForwardMode

CONFIG = EngineConfig(
    max_batch=4, max_tokens=16, chunk_size=8, max_context=64, page_size=8, impl="reference",
    cache_dir=None, batch_invariant=True,
)  # fmt: skip
# logprobs=0: each token's log-probability, the bits a difference in the logits would change.
PARAMS = SamplingParams(max_new_tokens=6, logprobs=0)


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_preset("tiny", CONFIG, progress=False)


def test_a_request_gets_the_same_bits_alone_and_among_others(engine):
    """Alone, then after a request that takes part of its steps, with two more joining while
    it prefills and decodes: its prompt (21 tokens: chunks 8, 8, 5) and every decode share
    steps with different rows at different positions."""
    target = prompt(21, 0)
    [alone] = engine.generate([target], PARAMS)
    before = {mode: len(times) for mode, times in engine.step_times.items()}
    first = engine.add_request(prompt(5, 1), PARAMS)
    rid = engine.add_request(target, PARAMS)
    late = [prompt(13, 2), prompt(3, 3)]
    results = {}
    steps = 0
    while engine.has_work:
        for event in engine.step():
            if event.result is not None:
                results[event.request_id] = event.result
        steps += 1
        if steps in (2, 5):
            engine.add_request(late.pop(), dataclasses.replace(PARAMS, max_new_tokens=9))
    together = results[rid]
    assert together.token_ids == alone.token_ids
    assert together.logprobs == alone.logprobs  # bit for bit
    assert len(results) == 4 and first in results
    ran = {mode: len(times) - before.get(mode, 0) for mode, times in engine.step_times.items()}
    assert ran.get(ForwardMode.MIXED, 0) == 0
    assert ran[ForwardMode.DECODE] > 0 and ran[ForwardMode.EXTEND] > 0
    assert engine.retraces == 0


def test_the_mode_runs_one_bucket_and_its_metadata_asks_for_invariant_paths():
    engine_policy = CONFIG.policy(64)
    assert engine_policy.batch_buckets == (4,) and engine_policy.token_buckets == (16,)
    # The layers read the flag from the step's metadata (static: part of the compile key):
    # the chunked scans re-lay their tokens out, attention reads every key from the pages.
    meta = build_metadata(ForwardMode.EXTEND, [RowSpec(1, 0, 5, (1,))], engine_policy,
                          num_slots=4, num_pages=8)  # fmt: skip
    assert meta.batch_invariant is True
    plain = dataclasses.replace(CONFIG, batch_invariant=False).policy(64)
    assert build_metadata(ForwardMode.EXTEND, [RowSpec(1, 0, 5, (1,))], plain,
                          num_slots=4, num_pages=8).batch_invariant is False  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(batch_buckets=(1, 4)), r"batch_buckets=\(1, 4\): batch_invariant=True runs the one"),
        (dict(token_buckets=(8,)), r"token_buckets=\(8,\): batch_invariant=True"),
        (dict(speculative=SpeculativeConfig()), "batch_invariant=True with speculative"),
    ],
)
def test_settings_the_mode_cannot_keep_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **change)
