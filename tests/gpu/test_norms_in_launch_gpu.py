"""The norms in the projections' launch (``layers.linear.NORMS_IN_LAUNCH``) on the H200: a
Qwen3-Next model at kernel-sized dimensions decodes the same greedy tokens, with the same
log-probabilities to bf16 rounding, as with each norm formed before its products. Decode
steps at few rows run the projections' launch with the row scale and the experts by id with
the inverse RMS applied after their products; the prompt's step forms the norms either way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

from benchmarks.switches import switches_set
from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.layers import linear
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config
from hybrid_jax.models.tokenizer import ByteTokenizer
from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

PARAMS = SamplingParams(max_new_tokens=12, logprobs=3)


def _generate(norms_in_launch: bool) -> list:
    config = dataclasses.replace(
        tiny_qwen3_next_config("bfloat16"), hidden_size=1024, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, num_experts=64,
        num_experts_per_tok=8, moe_intermediate_size=256, shared_expert_intermediate_size=256,
        intermediate_size=1024, num_nextn_predict_layers=0,
    )  # fmt: skip
    model = Qwen3Next(config, rngs=nnx.Rngs(0))
    engine_config = EngineConfig(
        max_batch=8,
        max_tokens=64,
        max_context=256,
        batch_buckets=(8,),
        token_buckets=(64,),
        cache_dir=None,
    )
    with switches_set({(linear, "NORMS_IN_LAUNCH"): norms_in_launch}):
        engine = Engine(model, ByteTokenizer(), engine_config, progress=False)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 256, n).tolist() for n in (9, 30, 4)]
        return engine.generate(prompts, PARAMS)


def test_decode_with_the_norms_in_the_launch_matches_the_formed_norms():
    got, want = _generate(True), _generate(False)
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=3e-2)
        for top_a, top_b in zip(a.top_logprobs, b.top_logprobs, strict=True):
            np.testing.assert_allclose([p for _, p in top_a], [p for _, p in top_b], atol=3e-2)
