"""EngineConfig(batch_invariant=True) on the H200: a request's log-probabilities alone and
among others, with the Pallas kernels (impl="auto") and XLA's cuBLAS products, in bf16 at
kernel-sized dimensions (two GDN + two attention layers, Qwen3-Next head shapes): bit for bit,
as on the CPU (tests/test_batch_invariance.py). The chunked scans' per-sequence layout is
what the prompt's log-probabilities need: in the packed layout a prompt's GDN chunk borders
move with the tokens packed before it."""

from __future__ import annotations

import numpy as np
import pytest
from _kernel_sized import kernel_sized_qwen3_next_config
from flax import nnx

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.models.qwen3_next import Qwen3Next
from hybrid_jax.models.tokenizer import ByteTokenizer
from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

PARAMS = SamplingParams(max_new_tokens=8, logprobs=0)


def _engine(batch_invariant: bool) -> Engine:
    config = kernel_sized_qwen3_next_config(num_experts=16, num_experts_per_tok=4)
    model = Qwen3Next(config, rngs=nnx.Rngs(0))
    engine_config = EngineConfig(
        max_batch=8, max_tokens=64, chunk_size=32, max_context=256, cache_dir=None,
        batch_invariant=batch_invariant,
    )  # fmt: skip
    return Engine(model, ByteTokenizer(), engine_config, progress=False, donate_weights=True)


def _alone_and_among_others(engine: Engine) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(0)
    target = rng.integers(0, 256, 45).tolist()
    [alone] = engine.generate([target], PARAMS)
    others = [rng.integers(0, 256, n).tolist() for n in (7, 60, 3, 33, 12)]
    results = engine.generate([others[0], target, *others[1:]], PARAMS)
    return alone.logprobs, results[1].logprobs


def test_batch_invariant_mode_gives_the_same_bits_on_the_gpu():
    alone, together = _alone_and_among_others(_engine(batch_invariant=True))
    assert together == alone
