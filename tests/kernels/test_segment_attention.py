"""segment_causal_attention: the reference against a float64 oracle (output and log-sum-exp),
the choice of implementation, and the errors for misshapen calls."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention
from pallas_kernels.attention.reference import segment_causal_oracle

segments_module = importlib.import_module("pallas_kernels.attention.segments")


def _case(seed, lengths=(5, 1, 7), padding=3, heads=4, kv_heads=2, dim=16):
    rng = np.random.default_rng(seed)
    tokens = sum(lengths) + padding
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    segment_start = np.concatenate(
        [np.repeat(starts, lengths), np.arange(sum(lengths), tokens)]  # padding: itself
    ).astype(np.int32)
    q = rng.standard_normal((tokens, heads, dim))
    k = rng.standard_normal((tokens, kv_heads, dim))
    v = rng.standard_normal((tokens, kv_heads, dim))
    return q, k, v, segment_start


@pytest.mark.parametrize(("seed", "heads", "kv_heads"), [(0, 4, 2), (1, 4, 4), (2, 8, 1)])
def test_reference_matches_the_float64_oracle(seed, heads, kv_heads):
    q, k, v, starts = _case(seed, heads=heads, kv_heads=kv_heads)
    want_out, want_lse = segment_causal_oracle(q, k, v, starts, 0.3)
    with jax.enable_x64(True):
        out, lse = attention.segment_causal_attention(
            *map(jnp.asarray, (q, k, v, starts)), scale=0.3, impl="reference"
        )
        out, lse = np.asarray(out), np.asarray(lse)
    assert np.abs(out - want_out).max() < 1e-12
    assert lse.dtype == np.float64 and np.abs(lse - want_lse).max() < 1e-12


def test_auto_on_the_cpu_is_the_reference_and_explicit_kernels_say_why_not(monkeypatch):
    q, k, v, starts = (jnp.asarray(a, jnp.float32) for a in _case(3))
    starts = starts.astype(jnp.int32)
    auto = attention.segment_causal_attention(q, k, v, starts, scale=0.25)
    ref = attention.segment_causal_attention(q, k, v, starts, scale=0.25, impl="reference")
    jax.tree.map(np.testing.assert_array_equal, auto, ref)
    assert ref[1].dtype == jnp.float32 and ref[1].shape == (16, 4)
    monkeypatch.setattr(segments_module, "_tokamax_flash", lambda: None)
    with pytest.raises(NotImplementedError, match="tokamax is not installed"):
        attention.segment_causal_attention(q, k, v, starts, scale=0.25, impl="pallas")
    with pytest.raises(NotImplementedError, match="impl='interpret'"):
        attention.segment_causal_attention(q, k, v, starts, scale=0.25, impl="interpret")


def test_unsupported_reason_names_dtype_and_head_dim(monkeypatch):
    monkeypatch.setattr(segments_module, "_tokamax_flash", lambda: (object(), object()))
    q = jnp.zeros((8, 4, 128), jnp.bfloat16)
    assert attention.unsupported_reason(q, jnp.zeros((8, 2, 128), jnp.bfloat16)) is None
    assert "16-bit float" in attention.unsupported_reason(q, jnp.zeros((8, 2, 128)))
    odd = jnp.zeros((8, 4, 96), jnp.bfloat16)
    assert "head_dim=96" in attention.unsupported_reason(odd, odd)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "starts_shape", "match"),
    [
        ((8, 4, 16), (8, 2, 32), (8,), r"one T and D"),
        ((8, 3, 16), (8, 2, 16), (8,), "multiple of KVH=2"),
        ((8, 4, 16), (8, 2, 16), (7,), r"segment_start must be int \[T=8\]"),
    ],
)
def test_misshapen_calls_raise_naming_the_shapes(q_shape, k_shape, starts_shape, match):
    with pytest.raises(ValueError, match=match):
        attention.segment_causal_attention(
            jnp.zeros(q_shape), jnp.zeros(k_shape), jnp.zeros(k_shape),
            jnp.zeros(starts_shape, jnp.int32), scale=1.0,
        )  # fmt: skip
