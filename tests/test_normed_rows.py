"""A norm left to its products (``layers.norm.NormedRows``): the launch that reads the rows
times the norm's weight and scales each row of its sums by the row's inverse RMS gives what
the formed norm followed by the products gives, and every other path forms the norm exactly
as the norm module does."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers import linear
from hybrid_jax.layers.linear import FEW_ROWS, project
from hybrid_jax.layers.moe import MoEConfig, SparseMoE
from hybrid_jax.layers.norm import NormedRows, ZeroCenteredRMSNorm, formed

HIDDEN = 256


def _norm(seed: int) -> ZeroCenteredRMSNorm:
    norm = ZeroCenteredRMSNorm(HIDDEN)
    norm.weight[...] = jax.random.normal(jax.random.key(seed), (HIDDEN,)) * 0.5
    return norm


def _rows(seed: int, tokens: int) -> jax.Array:
    # A residual stream far from unit RMS, different per row: the scale must matter.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, HIDDEN)) * rng.uniform(0.5, 20.0, (tokens, 1))
    return jnp.asarray(x, jnp.bfloat16)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_the_deferred_norm_formed_is_the_norm_bit_for_bit():
    norm, x = _norm(0), _rows(1, 5)
    deferred = norm.deferred(x)
    chex.assert_trees_all_equal(formed(deferred), norm(x))
    chex.assert_shape(deferred.inverse_rms(), (5,))
    assert deferred.shape == x.shape and deferred.dtype == x.dtype
    assert formed(x) is x


@pytest.mark.parametrize("tokens", [3, 8])
def test_projections_of_normed_rows_in_one_launch_match_the_float64_oracle(tokens):
    norm, x = _norm(2), _rows(3, tokens)
    layers = [
        nnx.Linear(HIDDEN, n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                   rngs=nnx.Rngs(n))
        for n in (128, 64)
    ]  # fmt: skip
    got = project(norm.deferred(x), layers, impl="interpret")
    x64 = np.asarray(x, np.float64)
    normed = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + norm.eps)
    normed *= 1 + np.asarray(norm.weight[...], np.float64)
    for out, layer in zip(got, layers, strict=True):
        want = normed @ np.asarray(layer.kernel[...], np.float64)
        assert out.dtype == jnp.bfloat16
        assert _rel(out, want) < 1e-2


def test_a_folded_norms_rows_sum_their_squares_in_the_launch_when_switched_on(monkeypatch):
    """``SQUARE_SUMS_IN_LAUNCH``: the launch of a folded norm's products forms the rows'
    square sums itself; the products equal the formed norm's, as with XLA's sums (an unfolded
    norm's rows, weighted, still take XLA's)."""
    norm, x = _norm(5), _rows(6, 8)
    layers = [
        nnx.Linear(HIDDEN, n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                   rngs=nnx.Rngs(n))
        for n in (128, 64)
    ]  # fmt: skip
    want = [layer(norm(x)) for layer in layers]
    norm.fold_into([layer.kernel for layer in layers])
    calls = []
    real = linear.projections.projections
    monkeypatch.setattr(linear.projections, "projections",
                        lambda *a, **k: calls.append(k) or real(*a, **k))  # fmt: skip
    monkeypatch.setattr(linear, "SQUARE_SUMS_IN_LAUNCH", True)
    got = project(norm.deferred(x), layers, impl="interpret")
    assert calls[-1]["square_sums"] and calls[-1].get("row_scale") is None
    for out, ref in zip(got, want, strict=True):
        assert _rel(out, ref) < 2e-2
    monkeypatch.setattr(linear, "SQUARE_SUMS_IN_LAUNCH", False)
    project(norm.deferred(x), layers, impl="interpret")
    assert "square_sums" not in calls[-1] and calls[-1]["row_scale"] is not None


def test_normed_rows_are_formed_where_no_launch_takes_them():
    """Past FEW_ROWS, and on the reference, the layers read the formed norm: the same bits as
    the norm module's output."""
    norm = _norm(4)
    layer = nnx.Linear(HIDDEN, 64, use_bias=False, dtype=jnp.bfloat16,
                       param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # fmt: skip
    for tokens, impl in ((FEW_ROWS + 1, "interpret"), (4, "reference")):
        x = _rows(tokens, tokens)
        (got,) = project(norm.deferred(x), [layer], impl=impl)
        chex.assert_trees_all_equal(got, layer(norm(x)))


def test_split_input_projections_scale_the_summed_partials(monkeypatch):
    monkeypatch.setattr(linear, "SPLIT_INPUT_PROJECTIONS", True)
    monkeypatch.setattr(linear, "MIN_SPLITS", 2)
    norm, x = _norm(5), _rows(6, 8)
    layers = [
        nnx.Linear(HIDDEN, 64, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                   rngs=nnx.Rngs(i))
        for i in range(2)
    ]  # fmt: skip
    assert linear._splits(x, [layer.kernel[...] for layer in layers]) == 2
    got = project(norm.deferred(x), layers, impl="interpret")
    for out, layer in zip(got, layers, strict=True):
        assert _rel(out, layer(norm(x))) < 1e-2


def _moe_case(seed: int):
    """(a bf16 MoE block of 8 experts, top 2; a norm; 5 rows; a run of the block on rows
    with an impl, the last row padding)."""
    config = MoEConfig(hidden_size=HIDDEN, num_experts=8, top_k=2, intermediate_size=128,
                       shared_intermediate_size=128, dtype="bfloat16")  # fmt: skip
    moe, norm, x = SparseMoE(config, rngs=nnx.Rngs(seed)), _norm(seed + 1), _rows(seed + 2, 5)
    real = jnp.arange(5) < 4

    def run(rows, impl):
        return jax.jit(lambda m, r, a: m(r, a, impl=impl))(moe, rows, real)

    return moe, norm, x, run


def test_a_moe_block_of_normed_rows_matches_the_formed_norm():
    """By id (the experts' products of the weighted rows, scaled per token, and the shared
    gate likewise) against the sorted path on the formed norm."""
    moe, norm, x, run = _moe_case(7)
    assert moe._runs_by_id(norm.deferred(x), "interpret")
    deferred = run(norm.deferred(x), "interpret")
    reference = run(norm(x), "reference")
    assert isinstance(norm.deferred(x), NormedRows)
    assert _rel(deferred, reference) < 2e-2


def test_a_moe_block_with_its_norm_folded_in_matches_the_formed_norm():
    """The norm's weight folded into every product that reads it (``fold_into``), the shared
    gate widened into the router's launch: the launches read the rows themselves (no weighted
    rows), and the block gives what it gave on the formed norm before the fold."""
    moe, norm, x, run = _moe_case(10)
    before = run(norm(x), "reference")
    norm.fold_into(moe.input_readers())
    moe.widen_shared_gate()
    deferred = norm.deferred(x)
    assert norm.folded and deferred.scale is None and deferred.weighted() is x
    assert moe._shared_gate_in_launch() and moe._runs_by_id(deferred, "interpret")
    assert _rel(run(deferred, "interpret"), before) < 2e-2
    assert _rel(run(norm(x), "reference"), before) < 2e-2


def test_a_fold_into_a_weight_of_another_width_is_refused_and_changes_nothing():
    norm = _norm(13)
    weight = norm.weight.get_value()
    good = nnx.Param(jnp.ones((HIDDEN, 64), jnp.bfloat16))
    bad = nnx.Param(jnp.ones((HIDDEN + 1, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\(257, 64\) is not \[\.\.\., 256, N\]"):
        norm.fold_into([good, bad])
    assert not norm.folded
    chex.assert_trees_all_equal(
        (norm.weight.get_value(), good.get_value()), (weight, jnp.ones((HIDDEN, 64), jnp.bfloat16))
    )


@pytest.mark.parametrize("hidden_in_launch", [False, True])
def test_a_moe_block_routes_its_split_router_products_in_one_launch(hidden_in_launch, monkeypatch):
    """``SPLIT_INPUT_PROJECTIONS`` with ``ROUTING_IN_KERNEL``, the norm folded: the router's
    float32 partial products and the rows' inverse RMS go to ``moe.top_k_routing`` unsummed,
    and the block gives what it gives with the ranking in XLA; with
    ``HIDDEN_IN_EXPERT_LAUNCH`` too (the router then launches alone)."""
    from hybrid_jax.layers import moe as moe_layer
    from pallas_kernels import moe as moe_kernels

    monkeypatch.setattr(moe_layer, "HIDDEN_IN_EXPERT_LAUNCH", hidden_in_launch)
    monkeypatch.setattr(linear, "SPLIT_INPUT_PROJECTIONS", True)
    monkeypatch.setattr(linear, "MIN_SPLITS", 2)
    config = MoEConfig(hidden_size=HIDDEN, num_experts=128, top_k=4, intermediate_size=128,
                       shared_intermediate_size=128, dtype="bfloat16")  # fmt: skip
    moe, norm, x = SparseMoE(config, rngs=nnx.Rngs(21)), _norm(22), _rows(23, 5)
    real = jnp.arange(5) < 4
    norm.fold_into(moe.input_readers())
    moe.widen_shared_gate()
    routed = []
    top_k_routing = moe_kernels.top_k_routing

    def recorded(logits, k, valid=None, **kwargs):
        routed.append((logits.shape, logits.dtype, kwargs.get("row_scale") is not None))
        return top_k_routing(logits, k, valid, **kwargs)

    monkeypatch.setattr(moe_kernels, "top_k_routing", recorded)

    def run():
        # A function of its own per run: the switch is read while tracing.
        return jax.jit(lambda m, r, a: m(r, a, impl="interpret"))(moe, norm.deferred(x), real)

    in_xla = run()
    assert routed == []
    monkeypatch.setattr(moe_layer, "ROUTING_IN_KERNEL", True)
    in_kernel = run()
    (shape, dtype, scaled), *_ = routed
    assert len(shape) == 3 and shape[1:] == (5, 128) and shape[0] >= 2
    assert moe._hidden_in_launch(norm.deferred(x), "interpret") == hidden_in_launch
    assert dtype == jnp.float32 and scaled
    assert _rel(in_kernel, in_xla) < 2e-2
