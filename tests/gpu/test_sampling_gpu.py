"""The sampler's row statistics on the H200 (``sampling.logit_stats``, one variadic reduction
compiled by XLA's GPU emitter): within float32 rounding of float64 at the 35B-like
vocabulary, in a step-like executable whose logits come from a bf16 product and in the
sampler's top log-probabilities, which read those logits back. The two executables' reductions
may round apart by an ulp (the step's reads the product's bf16 values): the engine reports
one number for a token among its alternatives (``Engine._logprobs``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.engine.sampling import Sampler, greedy_tokens, logit_stats
from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

VOCAB = 248320
HIDDEN = 512


@pytest.mark.parametrize("rows", [8, 256])
def test_a_step_s_greedy_log_probabilities_are_its_top_log_probabilities_and_the_oracle_s(rows):
    rng = np.random.default_rng(rows)
    hidden = jnp.asarray(rng.standard_normal((rows, HIDDEN)), jnp.bfloat16)
    head = jnp.asarray(rng.standard_normal((HIDDEN, VOCAB)) / np.sqrt(HIDDEN) * 4, jnp.bfloat16)
    slots = jnp.arange(rows, dtype=jnp.int32)

    @jax.jit
    def step(hidden, head, last_tokens):
        logits = (hidden @ head).astype(jnp.float32)
        return logits, greedy_tokens(logits, last_tokens, slots)

    logits, (tokens, logprobs, _) = step(hidden, head, jnp.zeros(rows, jnp.int32))
    top_values, top_ids = Sampler().top_logprobs(logits)
    np.testing.assert_array_equal(np.asarray(top_ids)[:, 0], np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(top_values)[:, 0], np.asarray(logprobs), rtol=1e-6)
    wide = np.asarray(logits, np.float64)
    top = wide.max(-1, keepdims=True)
    want = -np.log(np.exp(wide - top).sum(-1))
    np.testing.assert_array_equal(np.asarray(tokens), wide.argmax(-1))
    np.testing.assert_allclose(np.asarray(logprobs), want, rtol=1e-6, atol=1e-6)
    stats = jax.jit(logit_stats)(logits.at[rows // 2, 5].set(jnp.nan))
    np.testing.assert_array_equal(np.asarray(stats.finite), np.arange(rows) != rows // 2)
