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

from hybrid_jax.layers.linear import FEW_ROWS, project
from hybrid_jax.layers.moe import MoEConfig, SparseMoE
from hybrid_jax.layers.norm import NormedRows, SummedRows, ZeroCenteredRMSNorm, formed, rows_of
from hybrid_jax.layers.norm import summed as summed_rows

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


def test_rows_that_come_with_their_square_sums_give_the_norm_those_sums():
    """``SummedRows`` (a launch that formed the rows summed their squares): the deferred
    and the formed norm read the given sums, reducing nothing, and the formed norm is the
    rows' own; ``summed`` sums an array's rows and leaves ``SummedRows`` as they are."""
    norm, x = _norm(4), _rows(5, 3)
    x64 = np.asarray(x, np.float64)
    sums = jnp.asarray((x64 * x64).sum(-1), jnp.float32)
    summed = SummedRows(x, sums)
    deferred = norm.deferred(summed)
    assert deferred.square_sum() is sums and deferred.x is x
    program = str(jax.make_jaxpr(lambda s: norm.deferred(s).inverse_rms())(summed))
    assert "reduce_sum" not in program
    np.testing.assert_allclose(
        np.asarray(deferred.inverse_rms()), np.asarray(norm.deferred(x).inverse_rms()), rtol=1e-5
    )
    chex.assert_trees_all_equal(norm(summed), norm(x))
    assert "reduce_sum" not in str(jax.make_jaxpr(norm)(summed))
    assert rows_of(summed) is x and rows_of(x) is x
    assert summed_rows(summed) is summed
    np.testing.assert_allclose(np.asarray(summed_rows(x).square_sums), sums, rtol=1e-6)


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
