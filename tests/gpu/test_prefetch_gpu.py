"""Kernels that prefetch a later launch's weights or states into L2, on an sm_90 GPU at the
Qwen3.5-35B-A3B-like shapes of a batch-1 decode bucket: a prefetch changes no value, so each
launch must give the bits it gives without one (the GDN decode kernel with its output norm,
the paged decode kernel, the experts' hidden rows, the router's projections, the conv
update)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import conv1d, gdn, moe, projections
from pallas_kernels._common import on_hopper_gpu
from pallas_kernels.attention import paged_decode as pd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

ROWS = 8  # the bucket; the first row is real, the others padded


def _same_bits(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(g.view(f"u{g.itemsize}"), w.view(f"u{w.itemsize}"))


def _out_proj(rng) -> jax.Array:
    return jnp.asarray(rng.standard_normal((4096, 2048)) * 0.02, jnp.bfloat16)


def test_gdn_decode_prefetching_the_out_proj_gives_the_same_bits():
    rng = np.random.default_rng(1)
    h, hv, kd, slots = 16, 32, 128, 16
    idx = np.zeros(ROWS, np.int32)
    idx[0] = 5
    args = dict(
        qkv=jnp.asarray(rng.standard_normal((ROWS, 1, 2 * h * kd + hv * kd)), jnp.bfloat16),
        ba=jnp.asarray(rng.standard_normal((ROWS, 1, 2 * hv)), jnp.bfloat16),
        gate_params=gdn.stack_gate_params(
            jnp.asarray(rng.standard_normal(hv), jnp.float32),
            jnp.asarray(rng.standard_normal(hv), jnp.float32),
        ),
        ssm_pool=jnp.asarray(rng.standard_normal((slots, hv, kd, kd)) * 0.1, jnp.float32),
        state_indices=jnp.asarray(idx),
    )
    norm = gdn.OutputNorm(
        jnp.asarray(rng.standard_normal((ROWS, 1, hv * kd)), jnp.bfloat16),
        jnp.asarray(rng.uniform(0.5, 1.5, kd), jnp.float32),
        1e-6,
    )
    op = jax.jit(functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl="pallas"))
    want = op(**args, output_norm=norm)
    got = op(**args, output_norm=norm, prefetch=(_out_proj(rng),))
    assert np.isfinite(np.asarray(got[0], np.float32)).all()
    _same_bits(got, want)


def test_paged_decode_prefetching_the_o_proj_gives_the_same_bits():
    rng = np.random.default_rng(2)
    pages, page_size, kv_heads, head_dim = 64, 16, 2, 256
    k_pages = jnp.asarray(rng.standard_normal((pages, page_size, kv_heads, head_dim)), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal((pages, page_size, kv_heads, head_dim)), jnp.bfloat16)
    table = np.zeros((ROWS, 8), np.int32)
    table[0, :2] = [3, 9]
    lens = np.zeros(ROWS, np.int32)
    lens[0] = 32
    q = jnp.asarray(rng.standard_normal((ROWS, 16, head_dim)), jnp.bfloat16)
    op = jax.jit(functools.partial(pd.paged_decode_attention, scale=0.0625, impl="pallas"))
    args = (q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(lens))
    want = op(*args)
    got = op(*args, prefetch=(_out_proj(rng),))
    assert np.isfinite(np.asarray(got, np.float32)).all()
    _same_bits(got, want)


def test_expert_hidden_prefetching_the_down_weights_gives_the_same_bits():
    rng = np.random.default_rng(3)
    experts, k, width = 256, 2048, 512
    x = jnp.asarray(rng.standard_normal((ROWS, k)), jnp.bfloat16)
    w = moe.pair_halves(
        jnp.asarray(rng.standard_normal((experts, k, 2 * width)) / np.sqrt(k), jnp.bfloat16)
    )
    down = jnp.asarray(rng.standard_normal((experts, width, k)) * 0.02, jnp.bfloat16)
    ids = np.full((ROWS, 8), experts, np.int32)
    ids[0] = rng.choice(experts, 8, replace=False)
    op = jax.jit(functools.partial(moe.expert_hidden, impl="pallas"))
    want = op(x, w, jnp.asarray(ids))
    got = op(x, w, jnp.asarray(ids), prefetch_down=down)
    assert np.abs(np.asarray(got[0], np.float32)).max() > 0
    _same_bits(got, want)


def test_router_launch_prefetching_the_shared_down_gives_the_same_bits():
    rng = np.random.default_rng(4)
    k = 2048
    x = jnp.asarray(rng.standard_normal((ROWS, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
          for n in (256, 1024, 64)]  # fmt: skip
    ws[1] = moe.pair_halves(ws[1])
    down = jnp.asarray(rng.standard_normal((512, k)) * 0.02, jnp.bfloat16)
    op = jax.jit(
        functools.partial(projections.projections, paired=(False, True, False), impl="pallas")
    )
    want = op(x, ws)
    got = op(x, ws, prefetch=(down,))
    _same_bits(got, want)


def test_conv_update_prefetching_the_states_gives_the_same_bits():
    rng = np.random.default_rng(5)
    channels, slots = 8192, 16
    idx = np.zeros(ROWS, np.int32)
    idx[0] = 7
    args = dict(
        x=jnp.asarray(rng.standard_normal((ROWS, 1, channels)), jnp.bfloat16),
        weight=jnp.asarray(rng.standard_normal((channels, 4)), jnp.bfloat16),
        bias=None,
        conv_pool=jnp.asarray(rng.standard_normal((slots, channels, 3)), jnp.bfloat16),
        state_indices=jnp.asarray(idx),
    )
    states = jnp.asarray(rng.standard_normal((slots, 32, 128, 128)), jnp.float32)
    op = jax.jit(functools.partial(conv1d.causal_conv1d_update, impl="pallas"))
    want = op(**args)
    got = op(**args, prefetch_slots=(states,))
    _same_bits(got, want)
