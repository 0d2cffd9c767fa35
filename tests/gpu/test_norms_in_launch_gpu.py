"""The norms in the projections' launch (``layers.linear.NORMS_IN_LAUNCH``) with their
weights folded into the products (``layers.norm.FOLD_NORM_WEIGHTS``) on the H200: a
Qwen3-Next model at kernel-sized dimensions with bf16 weights stays as close to the same
weights computed in float32 as it does with each norm formed, weighted, before its products.
Steps at few rows (the prompt's step and every decode step here) run the projections' launch
with the row scale and the experts by id with the inverse RMS applied after their products;
the model's 8 layers are two repeats of a block, which the engine scans and folds.

A random model's next-token distributions are nearly flat: bf16 rounding alone moves its
log-probabilities by up to a few tenths, and two roundings may pick different greedy tokens.
So the oracle is the float32 computation, each bf16 run is scored by its distance to it, and
the comparison is teacher-forced: a request's steps count while all three runs have produced
the same tokens before them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from _kernel_sized import repeated_moe_qwen3_next_config
from flax import nnx

from benchmarks.switches import switches_set
from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from hybrid_jax.layers import linear
from hybrid_jax.layers import norm as norm_layer
from hybrid_jax.models.qwen3_next import Qwen3Next
from hybrid_jax.models.tokenizer import ByteTokenizer
from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

PARAMS = SamplingParams(max_new_tokens=4, logprobs=MAX_TOP_LOGPROBS)
PROMPT_LENGTHS = (9, 12, 4, 7, 5, 11, 3, 6, 10, 8, 5, 12, 4, 9, 6, 7)


def _generate(dtype: str, norms_in_launch: bool, fold: bool) -> list:
    config = repeated_moe_qwen3_next_config()
    model = Qwen3Next(config, rngs=nnx.Rngs(0))
    if dtype != "bfloat16":  # the bf16 weights, computed wider
        wide = Qwen3Next(dataclasses.replace(config, dtype=dtype), rngs=nnx.Rngs(0))
        nnx.update(wide, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param)))
        model = wide
    engine_config = EngineConfig(
        max_batch=8, max_tokens=64, max_context=256, batch_buckets=(8,), token_buckets=(64,),
        cache_dir=None,
    )  # fmt: skip
    switches = {
        (linear, "NORMS_IN_LAUNCH"): norms_in_launch,
        (norm_layer, "FOLD_NORM_WEIGHTS"): fold,
    }
    with switches_set(switches):
        engine = Engine(model, ByteTokenizer(), engine_config, progress=False)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, n).tolist() for n in PROMPT_LENGTHS]
        return engine.generate(prompts, PARAMS)


def _distance(run, oracle, step: int) -> float:
    """The largest |log-probability difference| at ``step`` over the tokens either reports
    among its most likely: exact where both report a token; where one does not, it puts that
    token at or below its own least likely reported one, so the difference is at least how
    far the other's value lies above that (flat distributions may share no reported token)."""
    ours, theirs = dict(run.top_logprobs[step]), dict(oracle.top_logprobs[step])

    def gap(token: int) -> float:
        if token in ours and token in theirs:
            return abs(ours[token] - theirs[token])
        if token in ours:
            return max(0.0, ours[token] - min(theirs.values()))
        return max(0.0, theirs[token] - min(ours.values()))

    return max(gap(token) for token in ours.keys() | theirs.keys())


def _teacher_forced_distances(runs: list[list], oracle: list) -> np.ndarray:
    """``[steps, runs]``: each run's distance to the oracle at every step of every request
    before which all runs and the oracle produced the same tokens."""
    rows = []
    for results in zip(*runs, oracle, strict=True):
        # A request that met a stop token early reports fewer steps.
        for step in range(min(len(r.top_logprobs) for r in results)):
            rows.append([_distance(r, results[-1], step) for r in results[:-1]])
            if len({tuple(r.token_ids[: step + 1]) for r in results}) > 1:
                break
    return np.asarray(rows)


def test_decode_with_the_norms_in_the_launch_is_as_close_to_float32_as_the_formed_norms():
    oracle = _generate("float32", norms_in_launch=False, fold=False)
    launch = _generate("bfloat16", norms_in_launch=True, fold=True)  # the defaults
    formed = _generate("bfloat16", norms_in_launch=False, fold=False)
    distances = _teacher_forced_distances([launch, formed], oracle)
    # The prompt's step and a decode step for at least half the requests: a random model's
    # flat distributions part the runs' greedy tokens early (benchmarks/RESULTS_serve.md),
    # so the requests are many rather than long.
    assert len(distances) >= 1.5 * len(PROMPT_LENGTHS)
    total_launch, total_formed = distances.sum(axis=0)
    assert total_launch <= 1.25 * total_formed, distances
