"""top_k_routing: the Mosaic GPU kernel in the interpreter and the jnp reference against a
float64 oracle written token by token in numpy, on fresh random logits (ties, rows of padding,
partial products over parts of K); the kernel also lowers for the GPU at the Qwen3.5 MoE
router's shape; a MoE layer routes through it as through the XLA ranking."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers import moe as moe_layer
from hybrid_jax.layers.moe import MoEConfig, SparseMoE
from pallas_kernels.moe import routing


def _oracle(
    logits: np.ndarray, k: int, valid: np.ndarray, scale: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """float64 weights and int ids of each token's k largest logits, each token's logits
    times its ``scale`` (ties: lower index)."""
    x = np.asarray(logits, np.float64)
    if x.ndim == 3:
        x = x.sum(axis=0)
    if scale is not None:
        x = x * np.asarray(scale, np.float64)[:, None]
    weights, ids = [], []
    for row, ok in zip(x, valid, strict=True):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        exps = np.exp(row[order] - row[order[0]])
        weights.append(exps / exps.sum())
        ids.append(order if ok else [len(row)] * k)
    return np.asarray(weights), np.asarray(ids)


def _logits(seed: int, shape: tuple[int, ...], dtype) -> jax.Array:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    # Ties: a token's second and third largest logits equal, and a repeated value elsewhere.
    flat = x.reshape(-1, shape[-1])
    for row in flat[:: max(1, len(flat) // 3)]:
        order = np.argsort(-row)
        row[order[2]] = row[order[1]]
        row[order[-1]] = row[order[-2]]
    return jnp.asarray(x, dtype)


CASES = [
    # (shape, dtype, k): a decode bucket's router logits at the Qwen3.5 MoE shape, partial
    # products over 4 parts of K, and a narrower router at k = 4.
    ((8, 256), jnp.bfloat16, 8),
    ((4, 5, 256), jnp.float32, 8),
    ((3, 128), jnp.float32, 4),
]


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize(("shape", "dtype", "k"), CASES, ids=str)
def test_routing_matches_the_float64_oracle(impl, shape, dtype, k):
    tokens = shape[-2]
    logits = _logits(sum(shape) + k, shape, dtype)
    valid = np.arange(tokens) % 3 != 1  # some rows are padding
    weights, ids = routing.top_k_routing(logits, k, jnp.asarray(valid), impl=impl)
    chex.assert_shape((weights, ids), (tokens, k))
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32
    want_w, want_ids = _oracle(np.asarray(logits, np.float32), k, valid)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6, atol=2e-7)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_partials_with_a_row_scale_match_the_float64_oracle(impl):
    """A folded norm's inverse RMS scales each token's summed partials before the ranking
    and the softmax (the weights change with it; the choices do not)."""
    logits = _logits(5, (4, 6, 256), jnp.float32)
    scale = jnp.asarray(np.random.default_rng(6).uniform(0.2, 3.0, 6), jnp.float32)
    valid = np.array([True, True, False, True, True, True])
    weights, ids = routing.top_k_routing(logits, 8, jnp.asarray(valid), row_scale=scale, impl=impl)
    want_w, want_ids = _oracle(np.asarray(logits), 8, valid, np.asarray(scale))
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=2e-6, atol=2e-7)
    unscaled, _ = _oracle(np.asarray(logits), 8, valid)
    assert np.abs(unscaled - want_w).max() > 1e-3


def test_kernel_and_reference_agree_without_a_validity_mask():
    logits = _logits(3, (6, 256), jnp.float32)
    got = routing.top_k_routing(logits, 8, impl="interpret")
    want = routing.top_k_routing(logits, 8, impl="reference")
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    chex.assert_trees_all_close(got[0], want[0], rtol=1e-6, atol=1e-7)


def test_equal_logits_are_chosen_by_the_lower_index():
    """A row of one value: the choices are experts 0..k-1, each weighted 1/k."""
    logits = jnp.full((2, 128), 0.25, jnp.float32)
    weights, ids = routing.top_k_routing(logits, 4, impl="interpret")
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3]] * 2)
    np.testing.assert_allclose(np.asarray(weights), 0.25, rtol=1e-7)


@pytest.mark.parametrize(("shape", "dtype"), [((8, 256), jnp.bfloat16), ((4, 8, 256), jnp.float32),
                                              ((64, 128), jnp.bfloat16)])  # fmt: skip
def test_kernel_lowers_for_the_gpu(shape, dtype):
    spec = jax.ShapeDtypeStruct
    tokens = shape[-2]
    logits, valid, scale = (
        spec(shape, dtype),
        spec((tokens,), jnp.bool_),
        spec((tokens,), jnp.float32),
    )
    assert routing.unsupported_reason(logits, 8) is None
    call = lambda x, v, s: routing.top_k_routing(x, 8, v, row_scale=s, impl="pallas")  # noqa: E731
    with jax.default_device(jax.devices("cpu")[0]):
        traced = jax.jit(call).trace(logits, valid, scale)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_unsupported_calls_and_bad_arguments_say_why():
    x = jnp.zeros((4, 256), jnp.float32)
    assert "n=512" in routing.unsupported_reason(jnp.zeros((4, 512)), 8)
    assert "k=10" in routing.unsupported_reason(x, 10)
    assert "float32" in routing.unsupported_reason(jnp.zeros((2, 4, 256), jnp.bfloat16), 8)
    with pytest.raises(NotImplementedError, match="k=10"):
        routing.top_k_routing(x, 10, impl="pallas")
    with pytest.raises(ValueError, match="k=300 must be in 1..n=256"):
        routing.top_k_routing(x, 300)
    with pytest.raises(ValueError, match="valid must be bool"):
        routing.top_k_routing(x, 8, jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="row_scale must be float32"):
        routing.top_k_routing(x, 8, row_scale=jnp.ones((4,), jnp.bfloat16))
    with pytest.raises(ValueError, match="logits must be float"):
        routing.top_k_routing(jnp.zeros((4, 256), jnp.int32), 8)


def test_a_moe_layer_routes_through_the_kernel_as_through_the_ranking(monkeypatch):
    """``ROUTING_IN_KERNEL``: the layer's experts are the XLA ranking's, its weights equal to
    a rounding, and padding tokens get no expert either way."""
    config = MoEConfig(hidden_size=64, num_experts=128, top_k=8, intermediate_size=32,
                       shared_intermediate_size=32, dtype="bfloat16")  # fmt: skip
    layer = SparseMoE(config, rngs=nnx.Rngs(0))
    logits = _logits(11, (8, 128), jnp.bfloat16)
    real = jnp.arange(8) < 5
    ranked = layer.route(logits, real, impl="interpret")
    monkeypatch.setattr(moe_layer, "ROUTING_IN_KERNEL", True)
    assert layer._routes_in_kernel(8, "interpret")
    assert not layer._routes_in_kernel(8, "reference")
    in_kernel = layer.route(logits, real, impl="interpret")
    np.testing.assert_array_equal(np.asarray(in_kernel[1]), np.asarray(ranked[1]))
    assert (np.asarray(in_kernel[1])[5:] == 128).all()
    chex.assert_trees_all_close(in_kernel[0], ranked[0], rtol=1e-2)
    assert in_kernel[0].dtype == jnp.bfloat16


def test_the_layer_keeps_the_ranking_where_the_kernel_cannot_route():
    """Top 10 (not a multiple of 4) and 512 experts stay with the XLA ranking, switch on."""
    for num_experts, top_k in ((128, 10), (512, 8)):
        config = MoEConfig(hidden_size=64, num_experts=num_experts, top_k=top_k,
                           intermediate_size=32, shared_intermediate_size=32)  # fmt: skip
        layer = SparseMoE(config, rngs=nnx.Rngs(0))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe_layer, "ROUTING_IN_KERNEL", True)
            assert not layer._routes_in_kernel(4, "interpret")
