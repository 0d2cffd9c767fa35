"""The MoE grouped matmul on an sm_90 GPU (tokamax's Mosaic GPU ragged dot), at Qwen3-Next
expert shapes, against the float64 oracle and ``jax.lax.ragged_dot``; skipped without tokamax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels._common import on_hopper_gpu
from pallas_kernels.moe.reference import grouped_matmul_oracle

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]


@pytest.mark.parametrize(
    ("rows", "experts", "k", "n"),
    [
        (10, 512, 2048, 512),
        (640, 512, 2048, 512),
        (4096 * 8, 256, 512, 2048),
        (37, 64, 512, 2048),
        # Prefill's fused gate/up: 128-row tiles (every group averages a full tile, K wide).
        (128 * 64, 64, 2048, 1024),
    ],
)
def test_kernel_matches_the_oracle_and_zeroes_padding(rows, experts, k, n):
    rng = np.random.default_rng(rows)
    sizes = rng.multinomial(rows - 3, rng.dirichlet(np.ones(experts))).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, n)) / np.sqrt(k), jnp.bfloat16)
    assert moe.unsupported_reason(x, w) is None, moe.unsupported_reason(x, w)
    got = jax.jit(lambda *a: moe.grouped_matmul(*a, impl="pallas"))(x, w, jnp.asarray(sizes))
    ref = jax.lax.ragged_dot(x, w, jnp.asarray(sizes))
    want = grouped_matmul_oracle(np.asarray(x, np.float32), np.asarray(w, np.float32), sizes)
    got64 = np.asarray(got, np.float64)
    assert np.linalg.norm(got64 - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_array_equal(got64[sizes.sum() :], 0)
    assert np.linalg.norm(np.asarray(ref, np.float64) - got64) / np.linalg.norm(want) < 1e-2
