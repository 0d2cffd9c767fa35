"""ExpertDispatch: rows sorted by expert, and the weighted combine back to tokens, against a
float64 loop over the (token, choice) pairs; a few tokens' experts run by id instead."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import primitives_outside_kernels
from flax import nnx

from hybrid_jax.layers import linear as linear_layer
from hybrid_jax.layers import moe as moe_layer
from hybrid_jax.layers.moe import (
    BY_ID_MAX_PAIRS,
    MLP,
    RANKED_TOP_K_TOKENS,
    ExpertDispatch,
    MoEConfig,
    SparseMoE,
    top_k,
    top_k_softmax,
)
from hybrid_jax.layers.norm import NormedRows, SummedRows
from pallas_kernels import moe as moe_kernels


@pytest.mark.parametrize("tokens,top_k,experts", [(13, 3, 5), (1, 4, 8), (32, 1, 3)])
def test_rows_are_grouped_by_expert_and_combine_weights_each_token_s_choices(
    tokens, top_k, experts
):
    rng = np.random.default_rng(tokens * 100 + top_k)
    choice = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    choice = choice.astype(np.int32)
    x = rng.standard_normal((tokens, 6)).astype(np.float32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    dispatch = ExpertDispatch.sort(jnp.asarray(choice), experts)

    sizes = np.asarray(dispatch.group_sizes)
    np.testing.assert_array_equal(sizes, np.bincount(choice.ravel(), minlength=experts))
    # The rows of expert e are its tokens, in token order (the sort is stable).
    token = np.asarray(dispatch.token)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for e in range(experts):
        want = [t for t in range(tokens) if e in choice[t]]
        np.testing.assert_array_equal(token[starts[e] : starts[e + 1]], want)
    np.testing.assert_array_equal(np.asarray(dispatch.rows(jnp.asarray(x))), x[token])

    # Each sorted row's expert output: a distinct function of (token, expert).
    row_expert = np.repeat(np.arange(experts), sizes)
    ys = x[token] * (1.0 + row_expert[:, None])
    want = np.zeros((tokens, 6))
    for row, (t, e) in enumerate(zip(token, row_expert, strict=True)):
        k = list(choice[t]).index(e)
        want[t] += np.float64(weights[t, k]) * ys[row]
    got = dispatch.combine(jnp.asarray(ys), jnp.asarray(weights))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_padding_tokens_belong_to_no_group_and_combine_to_zero():
    rng = np.random.default_rng(7)
    tokens, top_k, experts = 10, 3, 6
    choice = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    real = np.arange(tokens) < 4  # a bucket of 10 rows, 4 of them real
    dispatch = ExpertDispatch.sort(jnp.asarray(choice, jnp.int32), experts, jnp.asarray(real))

    sizes = np.asarray(dispatch.group_sizes)
    np.testing.assert_array_equal(sizes, np.bincount(choice[real].ravel(), minlength=experts))
    token = np.asarray(dispatch.token)
    groups = sizes.sum()
    assert set(token[:groups]) == set(range(4)) and set(token[groups:]) == set(range(4, tokens))
    # Rows past the groups come back as zeros from the grouped matmul.
    ys = np.where(np.arange(tokens * top_k)[:, None] < groups, 1.0 + token[:, None], 0.0)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    got = np.asarray(dispatch.combine(jnp.asarray(ys, jnp.float32), jnp.asarray(weights)))
    np.testing.assert_allclose(got[:4, 0], (1.0 + np.arange(4)) * weights[:4].sum(1), rtol=1e-6)
    np.testing.assert_array_equal(got[4:], 0.0)


def test_the_dispatch_has_no_scatter():
    # A scatter costs a copy of its zeroed buffer plus a kernel per MoE block on the GPU.
    experts = jax.ShapeDtypeStruct((8, 4), jnp.int32)
    real = jax.ShapeDtypeStruct((8,), jnp.bool_)
    text = jax.jit(ExpertDispatch.sort, static_argnums=1).lower(experts, 16, real).as_text()
    assert "scatter" not in text and "sort" in text


def _bf16_moe(seed, shared_width=64):
    config = MoEConfig(hidden_size=128, num_experts=8, top_k=2, intermediate_size=128,
                       shared_intermediate_size=shared_width, dtype="bfloat16")  # fmt: skip
    return SparseMoE(config, rngs=nnx.Rngs(seed))


# With SHARED_DOWN_WITH_EXPERTS, width 128 runs the shared expert's down product in the
# experts' down launch; 64 (not a multiple of the kernel's K block) on its own either way.
@pytest.mark.parametrize("with_experts", [False, True])
@pytest.mark.parametrize("shared_width", [128, 64])
def test_a_few_tokens_run_their_experts_by_id_as_the_sorted_path_does(
    shared_width, with_experts, monkeypatch
):
    monkeypatch.setattr(moe_layer, "SHARED_DOWN_WITH_EXPERTS", with_experts)
    moe = _bf16_moe(5, shared_width)
    in_launch = moe_kernels.expert_matmul_unsupported_reason(
        jnp.zeros((10, 128), jnp.bfloat16), moe.down_proj[...],
        (jnp.zeros((5, shared_width), jnp.bfloat16), moe.shared_expert.down_proj.kernel[...]),
    )  # fmt: skip
    assert (in_launch is None) == (shared_width == 128)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 128)), jnp.bfloat16)
    real = jnp.arange(5) < 3  # a bucket of 5 rows, 3 real

    def run(impl):
        return jax.jit(lambda m, a, r: m(a, r, impl=impl))(moe, x, real)

    by_id, sorted_ = np.asarray(run("interpret"), np.float64), np.asarray(run("reference"))
    sorted_ = sorted_.astype(np.float64)
    assert np.linalg.norm(by_id - sorted_) / np.linalg.norm(sorted_) < 1e-2
    # Padding tokens get the shared expert alone on both paths.
    shared = jax.nn.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    np.testing.assert_allclose(by_id[3:], np.asarray(shared[3:], np.float64), rtol=1e-2, atol=1e-2)

    def lowered(tokens, impl):
        a = jax.ShapeDtypeStruct((tokens, 128), jnp.bfloat16)
        return jax.jit(lambda m, a: m(a, impl=impl)).lower(moe, a).as_text()

    # By id: no sort of the pairs; past BY_ID_MAX_PAIRS pairs, or on the reference, the sort.
    assert "stablehlo.sort" not in lowered(5, "interpret")
    assert "stablehlo.sort" in lowered(5, "reference")
    assert not moe._runs_by_id(
        jnp.zeros((BY_ID_MAX_PAIRS // 2 + 1, 128), jnp.bfloat16), "interpret"
    )


@pytest.mark.parametrize("shared_width", [128, 64])
def test_the_shared_hidden_formed_with_the_experts_changes_no_bit(shared_width, monkeypatch):
    """``SHARED_HIDDEN_WITH_EXPERTS``: both SiLU products in one array, each down launch
    reading its rows of it, where the widths agree (128); a narrower shared expert (64) keeps
    its own."""
    moe = _bf16_moe(6, shared_width)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 128)), jnp.bfloat16)
    real = jnp.arange(5) < 4

    def run():
        step = jax.jit(lambda m, a, r: m(a, r, impl="interpret"))
        return np.asarray(step(moe, x, real)), step.lower(moe, x, real).as_text()

    assert moe_layer.SHARED_HIDDEN_WITH_EXPERTS is True  # the default
    together, together_program = run()
    monkeypatch.setattr(moe_layer, "SHARED_HIDDEN_WITH_EXPERTS", False)
    apart, apart_program = run()
    np.testing.assert_array_equal(together.view(np.uint16), apart.view(np.uint16))
    # One barrier more (the interpreted kernels have their own) where the widths agree.
    barriers = [p.count("optimization_barrier") for p in (apart_program, together_program)]
    assert barriers[1] - barriers[0] == (shared_width == 128)


@pytest.mark.parametrize("normed", [False, True], ids=["rows", "normed-rows"])
@pytest.mark.parametrize("shared_width", [128, 64])
def test_paired_weights_form_the_hidden_rows_in_the_expert_launch(
    shared_width, normed, monkeypatch
):
    """``SparseMoE.pair_halves`` with ``HIDDEN_IN_EXPERT_LAUNCH``: the experts' hidden rows
    from an ``expert_hidden`` launch and the shared expert's from the router's
    (the norm's inverse RMS formed in both), no SiLU product in XLA, for a shared expert as
    wide as the experts (128) or narrower (64); with the switch off, and on the sorted path
    (``reference``), the paired products split in XLA. The block's output moves by rounding
    only."""
    # 64 experts: a router of a whole column tile, which the projections' launch takes.
    config = MoEConfig(hidden_size=128, num_experts=64, top_k=2, intermediate_size=128,
                       shared_intermediate_size=shared_width, dtype="bfloat16")  # fmt: skip
    moe = SparseMoE(config, rngs=nnx.Rngs(7))
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    if normed:
        norm_weight = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32)
        x = NormedRows(x, norm_weight, 1e-6)
    real = jnp.arange(5) < 4

    def run(impl="interpret"):
        step = jax.jit(lambda m, a, r: m(a, r, impl=impl))
        out = np.asarray(step(moe, x, real), np.float64)
        return out, str(jax.make_jaxpr(step)(moe, x, real))

    monkeypatch.setattr(moe_layer, "HIDDEN_IN_EXPERT_LAUNCH", False)
    apart, apart_program = run()
    sorted_apart, _ = run("reference")
    gate_up = np.asarray(moe.gate_up_proj[...])
    moe.pair_halves()
    assert moe.paired and moe.shared_expert.paired
    assert not hasattr(moe.shared_expert, "up_proj")
    assert not moe._hidden_in_launch(x, "interpret")  # the switch is off
    split, _ = run()  # paired products split in XLA
    assert np.linalg.norm(split - apart) / np.linalg.norm(apart) < 1e-2
    monkeypatch.setattr(moe_layer, "HIDDEN_IN_EXPERT_LAUNCH", True)
    assert moe._hidden_in_launch(x, "interpret")
    assert not moe._hidden_in_launch(x, "reference")
    # The same columns, each 64-column tile 32 gate and the same 32 up ones.
    paired = np.asarray(moe.gate_up_proj[...])
    np.testing.assert_array_equal(paired[..., 32:64], gate_up[..., 128:160])
    np.testing.assert_array_equal(np.sort(paired, -1), np.sort(gate_up, -1))
    together, together_program = run()
    sorted_together, _ = run("reference")
    for got, want in ((together, apart), (sorted_together, sorted_apart)):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    # The shared expert's gate is the one sigmoid left where the launch forms the hidden rows.
    sigmoids = [p.count("logistic") for p in (apart_program, together_program)]
    assert sigmoids == [3, 1]
    moe.pair_halves()  # paired once: a second call changes nothing
    np.testing.assert_array_equal(np.asarray(moe.gate_up_proj[...]), paired)


@pytest.mark.parametrize("axis", [0, 1])
def test_short_sum_adds_the_parts_where_the_switch_says(axis, monkeypatch):
    x = jnp.asarray(np.random.default_rng(axis).standard_normal((4, 3, 5)), jnp.float32)
    want = np.asarray(x, np.float64).sum(axis)
    for adds in (False, True):
        monkeypatch.setattr(linear_layer, "ADDS_FOR_SHORT_SUMS", adds)
        # A fresh function each time: a traced one is cached, whatever the switch says now.
        program = str(jax.make_jaxpr(lambda a: linear_layer.short_sum(a, axis))(x))
        assert ("reduce_sum" in program) is not adds
        np.testing.assert_allclose(linear_layer.short_sum(x, axis), want, rtol=1e-6, atol=1e-6)


# 5 tokens run their experts by id (the kernels interpreted, bf16); 40 sort (float32).
@pytest.mark.parametrize("tokens,impl,dtype", [(5, "interpret", "bfloat16"),
                                               (40, "reference", "float32")])  # fmt: skip
def test_adds_for_short_sums_change_a_moe_block_by_rounding_and_drop_its_small_reduces(
    tokens, impl, dtype, monkeypatch
):
    """``ADDS_FOR_SHORT_SUMS``: the softmax over each token's chosen experts (its max is the
    first, as ``top_k`` orders them), the sum over its choices and, by id, the shared expert's
    partial products become adds; the block's output moves by rounding only. (The softmax
    after the ranking: ``SOFTMAX_IN_RANKING`` forms it inside the ranking's reductions.)"""
    monkeypatch.setattr(moe_layer, "SOFTMAX_IN_RANKING", False)
    monkeypatch.setattr(linear_layer, "ADDS_FOR_SHORT_SUMS", False)
    config = MoEConfig(hidden_size=128, num_experts=8, top_k=2, intermediate_size=128,
                       shared_intermediate_size=128, dtype=dtype)  # fmt: skip
    moe = SparseMoE(config, rngs=nnx.Rngs(11))
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, 128)), dtype)
    real = jnp.arange(tokens) < tokens - 1  # the last token is padding

    def run():
        step = jax.jit(lambda m, a, r: m(a, r, impl=impl))
        return np.asarray(step(moe, x, real), np.float64), step.lower(moe, x, real).as_text()

    assert moe._runs_by_id(x, impl) is (impl == "interpret")
    reduced, reduced_program = run()
    monkeypatch.setattr(linear_layer, "ADDS_FOR_SHORT_SUMS", True)
    added, added_program = run()
    tol = 1e-2 if dtype == "bfloat16" else 1e-6
    np.testing.assert_allclose(added, reduced, rtol=tol, atol=tol)
    reduces = [p.count("stablehlo.reduce") for p in (reduced_program, added_program)]
    # The softmax's max and sum, the choices' sum; by id also the shared expert's partials
    # (sorted, the layers' own products take no partials).
    assert reduces[0] - reduces[1] >= 3


@pytest.mark.parametrize("tokens,n,k", [(8, 256, 8), (5, 16, 3), (0, 8, 2), (64, 32, 32)])
def test_top_k_by_rank_is_lax_top_k_ties_included(tokens, n, k):
    rng = np.random.default_rng(tokens + n)
    # Few distinct values, so most rows hold ties: the lower index must come first.
    x = jnp.asarray(rng.integers(-3, 4, (tokens, n)), jnp.float32) / 2
    values, indices = jax.jit(top_k, static_argnums=1)(x, k)
    want_values, want_indices = jax.lax.top_k(x, k)
    assert indices.dtype == jnp.int32
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_array_equal(values, want_values)
    # Above RANKED_TOP_K_TOKENS rows it is lax.top_k itself.
    many = jnp.asarray(rng.standard_normal((RANKED_TOP_K_TOKENS + 1, n)), jnp.float32)
    program = lambda a: str(jax.make_jaxpr(top_k, static_argnums=1)(a, k))  # noqa: E731
    assert "top_k[" not in program(x) and "top_k[" in program(many)
    np.testing.assert_array_equal(top_k(many, k)[1], jax.lax.top_k(many, k)[1])


@pytest.mark.parametrize("tokens", [6, RANKED_TOP_K_TOKENS + 2])  # ranked, then sorted
def test_top_k_gives_rows_not_valid_the_out_of_range_index(tokens):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, 16)), jnp.float32)
    valid = jnp.asarray(rng.random(tokens) < 0.5).at[0].set(True).at[1].set(False)
    values, indices = top_k(x, 3, valid)
    want_values, want = jax.lax.top_k(x, 3)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, np.where(np.asarray(valid)[:, None], want, 16))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_weights_are_the_softmax_probabilities_of_the_chosen_experts(norm_topk_prob):
    config = MoEConfig(hidden_size=16, num_experts=32, top_k=4, intermediate_size=8,
                       shared_intermediate_size=8, norm_topk_prob=norm_topk_prob)  # fmt: skip
    layer = SparseMoE(config, rngs=nnx.Rngs(0))
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((6, 32)) * 3, jnp.float32)
    weights, experts = layer.route(logits)
    wide = np.asarray(logits, np.float64)
    probs = np.exp(wide - wide.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.argsort(-probs, axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(experts, want)
    chosen = np.take_along_axis(probs, want, axis=-1)
    if norm_topk_prob:
        chosen = chosen / chosen.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(weights, chosen, rtol=1e-6)


@pytest.mark.parametrize(
    "tokens,n,k,spread", [(8, 256, 8, 3.0), (5, 16, 3, 0.5), (3, 32, 4, 400.0)]
)
def test_top_k_softmax_is_the_softmax_of_lax_top_k_s_values(tokens, n, k, spread):
    """Ties (few distinct values) keep lax.top_k's order; a spread of logits past exp's range
    gives weights of 0 and 1, never NaN."""
    rng = np.random.default_rng(tokens * n)
    x = jnp.asarray(rng.integers(-3, 4, (tokens, n)) * spread, jnp.float32)
    valid = jnp.arange(tokens) < tokens - 1  # the last row is padding
    weights, indices = jax.jit(top_k_softmax, static_argnums=1)(x, k, valid)
    values, want = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(indices, np.where(np.asarray(valid)[:, None], want, n))
    np.testing.assert_allclose(weights, jax.nn.softmax(values, axis=-1), rtol=1e-6, atol=1e-30)
    assert np.isfinite(np.asarray(weights)).all()


def test_softmax_in_ranking_routes_as_the_softmax_after_it_with_no_reduce_of_its_own(
    monkeypatch,
):
    """``SOFTMAX_IN_RANKING``: the same experts and weights, and every reduction of the route
    is over the ranking's comparisons (rank 3), none over the chosen values."""
    config = MoEConfig(hidden_size=16, num_experts=32, top_k=4, intermediate_size=8,
                       shared_intermediate_size=8)  # fmt: skip
    layer = SparseMoE(config, rngs=nnx.Rngs(0))
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((6, 32)) * 3, jnp.bfloat16)
    real = jnp.arange(6) < 5

    def routed():
        program = jax.make_jaxpr(layer.route)(logits, real)
        reduces = [e for e in program.eqns if e.primitive.name.startswith("reduce_")]
        return layer.route(logits, real), [e.invars[0].aval.ndim for e in reduces]

    # Short sums as reduces: the softmax after the ranking then shows its reduce over the
    # chosen values (as adds it has none either way).
    monkeypatch.setattr(linear_layer, "ADDS_FOR_SHORT_SUMS", False)
    monkeypatch.setattr(moe_layer, "SOFTMAX_IN_RANKING", False)
    (weights, experts), ranks_after = routed()
    monkeypatch.setattr(moe_layer, "SOFTMAX_IN_RANKING", True)
    (in_ranking, in_ranking_experts), ranks_in = routed()
    np.testing.assert_array_equal(in_ranking_experts, experts)
    np.testing.assert_allclose(np.asarray(in_ranking, np.float32),
                               np.asarray(weights, np.float32), rtol=1e-2)  # fmt: skip
    assert 2 in ranks_after and set(ranks_in) == {3}


def _paired_block(experts, top_k, seed, *, normed, norm_topk_prob=True, hidden=128):
    """(a MoE block laid out as an engine lays out its blocks, 5 rows of residual and input,
    the input as ``NormedRows`` when ``normed``, the first 4 rows real) and ``run(impl)``:
    its jitted ``add_to`` of them, with the traced program's text."""
    config = MoEConfig(hidden_size=hidden, num_experts=experts, top_k=top_k,
                       intermediate_size=128, shared_intermediate_size=128, dtype="bfloat16",
                       norm_topk_prob=norm_topk_prob)  # fmt: skip
    moe = SparseMoE(config, rngs=nnx.Rngs(seed))
    moe.widen_shared_gate()
    moe.pair_halves()
    rng = np.random.default_rng(seed + 6)
    residual = jnp.asarray(rng.standard_normal((5, hidden)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((5, hidden)), jnp.bfloat16)
    if normed:
        scale = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.float32)
        x = NormedRows(x, scale, 1e-6)
    real = jnp.arange(5) < 4

    def run(impl="interpret"):
        step = jax.jit(lambda m, res, a, r: m.add_to(res, a, r, impl=impl))
        return step(moe, residual, x, real), str(jax.make_jaxpr(step)(moe, residual, x, real))

    return (moe, residual, x, real), run


@pytest.mark.parametrize("normed,norm_topk_prob", [(False, True), (True, True), (False, False)])
def test_add_to_combines_into_the_residual_in_one_launch_with_the_rows_square_sums(
    normed, norm_topk_prob, monkeypatch
):
    """``SparseMoE.add_to`` with ``COMBINE_IN_LAUNCH``: the residual plus the block's output
    from one ``combine_pairs`` launch (the routing's softmax divided there, or, without
    ``norm_topk_prob``, the weights as ``route`` gives them), within bf16 rounding of
    ``residual + block(x)``, as ``SummedRows`` whose sums are the new rows' squares; with the
    switch off, or on the sorted path, ``residual + block(x)`` itself."""
    (moe, residual, x, real), run = _paired_block(64, 2, 3, normed=normed,
                                                   norm_topk_prob=norm_topk_prob)  # fmt: skip

    plain = np.asarray(jax.jit(lambda m, a, r: m(a, r, impl="interpret"))(moe, x, real))
    want = np.asarray(residual, np.float64) + np.asarray(plain, np.float64)
    monkeypatch.setattr(moe_layer, "COMBINE_IN_LAUNCH", False)
    apart, apart_program = run()
    assert isinstance(apart, jax.Array) and "combine_pairs" not in apart_program
    np.testing.assert_allclose(np.asarray(apart, np.float64), want, rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(moe_layer, "COMBINE_IN_LAUNCH", True)
    fused, fused_program = run()
    assert isinstance(fused, SummedRows) and "combine_pairs" in fused_program
    rows = np.asarray(fused.x, np.float64)
    assert np.linalg.norm(rows - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_allclose(np.asarray(fused.square_sums), (rows * rows).sum(1), rtol=2e-3)
    # The sorted path (the reference) has no tiles to combine: the plain sum.
    sorted_sum, sorted_program = run("reference")
    assert isinstance(sorted_sum, jax.Array) and "combine_pairs" not in sorted_program


@pytest.mark.parametrize("combine", [True, False], ids=["combine-launch", "xla-combine"])
def test_experts_in_one_launch_give_the_two_launches_block_bit_for_bit(combine, monkeypatch):
    """``EXPERTS_IN_ONE_LAUNCH``: a block whose experts run by id forms its hidden rows and
    their down products (with the shared expert's) in one ``expert_mlp`` launch, and its
    output (``add_to``, or the block itself without the combine launch) is that of the
    hidden and down launches, bit for bit."""
    config = MoEConfig(hidden_size=128, num_experts=64, top_k=2, intermediate_size=128,
                       shared_intermediate_size=128, dtype="bfloat16")  # fmt: skip
    moe = SparseMoE(config, rngs=nnx.Rngs(4))
    moe.widen_shared_gate()
    moe.pair_halves()
    rng = np.random.default_rng(12)
    residual = jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(128), jnp.float32)
    x = NormedRows(jnp.asarray(rng.standard_normal((5, 128)), jnp.bfloat16), scale, 1e-6)
    real = jnp.arange(5) < 4
    monkeypatch.setattr(moe_layer, "COMBINE_IN_LAUNCH", combine)

    def run():
        step = jax.jit(lambda m, res, a, r: m.add_to(res, a, r, impl="interpret"))
        return step(moe, residual, x, real), str(jax.make_jaxpr(step)(moe, residual, x, real))

    monkeypatch.setattr(moe_layer, "EXPERTS_IN_ONE_LAUNCH", False)
    apart, apart_program = run()
    assert "expert_mlp" not in apart_program and "expert_hidden" in apart_program
    monkeypatch.setattr(moe_layer, "EXPERTS_IN_ONE_LAUNCH", True)
    one, one_program = run()
    assert "expert_mlp" in one_program and "expert_hidden" not in one_program
    chex.assert_trees_all_equal(one, apart)


@pytest.mark.parametrize("normed", [False, True], ids=["rows", "normed-rows"])
def test_ranking_in_the_router_launch_gives_the_block_bit_for_bit(normed, monkeypatch):
    """``RANKING_IN_ROUTER_LAUNCH``: a block that ranks its experts ranks them in the
    router's launch (``projections_ranked``, no XLA reductions between it and the experts'
    launch), and ``add_to`` gives what the two reductions give, bit for bit, padding rows
    included; with the reference (the CPU's ``auto``) the switch changes nothing."""
    _, run = _paired_block(128, 4, 5, normed=normed)
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", False)
    apart, apart_program = run()
    reference, _ = run("reference")
    assert "projections_ranked" not in apart_program
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", True)
    ranked, ranked_program = run()
    assert "projections_ranked" in ranked_program
    chex.assert_trees_all_equal(ranked, apart)
    on_reference, reference_program = run("reference")
    assert "projections_ranked" not in reference_program
    chex.assert_trees_all_equal(on_reference, reference)


@pytest.mark.parametrize(
    "normed",
    [pytest.param(False, marks=pytest.mark.slow), True],  # slow: a minute; normed is the default
    ids=["rows", "normed-rows"],
)
def test_a_router_launch_over_parts_of_k_gives_the_block_and_ranks_as_xla(normed, monkeypatch):
    """``SPLIT_ROUTER_LAUNCH``: the router's launch over parts of K combined by its row
    programs (``projections_combined``) gives the block within bf16 rounding of the whole-K
    launch, and ranking in it (``RANKING_IN_ROUTER_LAUNCH``) gives what the XLA reductions
    of its stored logits give, bit for bit; the reference (the CPU's ``auto``) is
    unchanged by the switch. K = 512 (4 parts), 128 experts, the gate widened to 128."""
    block = _paired_block(128, 4, 7, normed=normed, hidden=512)
    run = block[1]
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", False)
    monkeypatch.setattr(moe_layer, "SPLIT_ROUTER_LAUNCH", False)
    whole, whole_program = run()
    reference, _ = run("reference")
    assert "projections_combined" not in whole_program
    monkeypatch.setattr(moe_layer, "SPLIT_ROUTER_LAUNCH", True)
    split, split_program = run()
    assert "projections_combined" in split_program and "projections_ranked" not in split_program
    rows, want = np.asarray(split.x, np.float64), np.asarray(whole.x, np.float64)
    assert np.linalg.norm(rows - want) / np.linalg.norm(want) < 1e-2
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", True)
    ranked, ranked_program = run()
    assert "projections_combined" in ranked_program
    chex.assert_trees_all_equal(ranked, split)
    # The XLA reductions of the ranking (its max among them) are gone.
    (moe, residual, x, real), _ = block

    def primitives():  # a new function each time: a traced one is cached with its switches
        step = jax.make_jaxpr(lambda m, res, a, r: m.add_to(res, a, r, impl="interpret"))
        return primitives_outside_kernels(step(moe, residual, x, real).jaxpr)[0]

    in_launch = primitives()
    monkeypatch.setattr(moe_layer, "RANKING_IN_ROUTER_LAUNCH", False)
    in_xla = primitives()
    assert "reduce_max" in in_xla - in_launch and in_launch <= in_xla
    on_reference, reference_program = run("reference")
    assert "projections_combined" not in reference_program
    chex.assert_trees_all_equal(on_reference, reference)


def test_softmax_of_exps_divides_each_row_by_its_sum_and_top_k_softmax_uses_it():
    rng = np.random.default_rng(17)
    exps = jnp.asarray(rng.random((5, 8)) + 0.01, jnp.float32)
    want = np.asarray(exps, np.float64) / np.asarray(exps, np.float64).sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(moe_kernels.softmax_of_exps(exps)), want, rtol=1e-6)
    logits = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
    picked, ids = moe_kernels.top_k_exps(logits, 8)
    weights, same_ids = top_k_softmax(logits, 8)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(same_ids))
    np.testing.assert_array_equal(
        np.asarray(weights), np.asarray(moe_kernels.softmax_of_exps(picked))
    )


def test_a_paired_dense_mlp_forms_its_hidden_rows_in_the_launch():
    """``MLP.pair_halves``: at few rows the projections' launch (interpreted) forms the SwiGLU
    hidden rows in its epilogue, so no sigmoid is left outside it; the outputs are the
    unpaired MLP's to bf16 rounding, above few rows too (one XLA product, split after)."""
    rng = np.random.default_rng(7)
    mlp = MLP(128, 256, dtype="bfloat16", rngs=nnx.Rngs(0))
    for layer in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        shape = layer.kernel.get_value().shape
        layer.kernel.set_value(
            jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.bfloat16)
        )
    few = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    many = jnp.asarray(rng.standard_normal((linear_layer.FEW_ROWS + 8, 128)), jnp.bfloat16)

    def run(x, impl="interpret"):
        step = jax.jit(lambda m, a: m(a, impl=impl))
        return np.asarray(step(mlp, x), np.float64), str(jax.make_jaxpr(step)(mlp, x))

    apart = [run(x) for x in (few, many)]
    mlp.pair_halves()
    assert mlp.paired and not hasattr(mlp, "up_proj")
    together = [run(x) for x in (few, many)]
    for (got, _), (want, _) in zip(together, apart, strict=True):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    assert apart[0][1].count("logistic") == 1 and together[0][1].count("logistic") == 0
