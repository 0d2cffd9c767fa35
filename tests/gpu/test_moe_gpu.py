"""The MoE kernels on an sm_90 GPU at Qwen3-Next / Qwen3.5 expert shapes: the grouped matmul
(tokamax's Mosaic GPU ragged dot; its test needs tokamax) against the float64 oracle and
``jax.lax.ragged_dot``, and the experts by id (``moe.expert_matmul``) against the oracle,
alone and inside the MoE layer of a decode bucket."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers import moe as moe_layer
from hybrid_jax.layers.moe import MoEConfig, SparseMoE
from hybrid_jax.layers.norm import SummedRows
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


@pytest.mark.parametrize(
    ("rows", "choices", "k", "n", "real"),
    [
        (8, 8, 2048, 1024, 1),  # the fused gate/up of batch 1 in a bucket of 8 rows
        (8, 8, 2048, 1024, 8),
        (64, 1, 512, 2048, 8),  # their down product, one row per (token, choice)
        (5, 3, 2048, 512, 5),  # rows not a multiple of 8
    ],
)
def test_experts_by_id_match_the_oracle_and_read_no_padding_expert(
    rows, choices, k, n, real, product_variant
):
    rng = np.random.default_rng(rows * choices + real)
    experts = 256
    pad = real if choices > 1 else real * 8  # the first padding row
    x = rng.standard_normal((rows, k))
    # Padding rows are NaN: a real row that shares their 8-row group must not see them.
    x[pad:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, n)) / np.sqrt(k), jnp.bfloat16)
    ids = np.stack([rng.choice(experts, choices, replace=False) for _ in range(rows)])
    ids = ids.astype(np.int32)
    ids[pad:] = experts  # out of range: read nothing, give zeros
    got = jax.jit(lambda *a: moe.expert_matmul(*a, impl="pallas"))(x, w, jnp.asarray(ids))
    got64 = np.asarray(got, np.float64)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want = np.zeros(got64.shape)
    for r, c in np.ndindex(ids.shape):
        if r < pad:
            want[r, c] = x64[r] @ w64[ids[r, c]]
    assert np.isfinite(got64).all()
    assert np.linalg.norm(got64 - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_array_equal(got64[pad:], 0)


def test_the_shared_expert_s_down_product_in_the_experts_launch_matches_the_oracle():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((64, 512)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 512, 2048)) / np.sqrt(512), jnp.bfloat16)
    ids = jnp.asarray(rng.choice(256, (64, 1)), jnp.int32)
    xd = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((512, 2048)) / np.sqrt(512), jnp.bfloat16)
    run = jax.jit(lambda *a: moe.expert_matmul(*a[:3], dense=a[3:], impl="pallas"))
    got, got_dense = run(x, w, ids, xd, wd)
    alone = jax.jit(lambda *a: moe.expert_matmul(*a, impl="pallas"))(x, w, ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))
    want = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64)
    err = np.linalg.norm(np.asarray(got_dense, np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-2


@pytest.mark.parametrize("hidden_in_launch", [False, True])
def test_a_decode_bucket_s_experts_by_id_match_the_reference_layer(hidden_in_launch, monkeypatch):
    """With ``HIDDEN_IN_EXPERT_LAUNCH`` and the weights paired the routed hidden rows come
    from ``expert_hidden``'s tiles, which the down launch reads in place, and the shared
    expert's from the router's launch."""
    monkeypatch.setattr(moe_layer, "HIDDEN_IN_EXPERT_LAUNCH", hidden_in_launch)
    config = MoEConfig(hidden_size=2048, num_experts=256, top_k=8, intermediate_size=512,
                       shared_intermediate_size=512, dtype="bfloat16")  # fmt: skip
    layer = SparseMoE(config, rngs=nnx.Rngs(0))
    if hidden_in_launch:
        layer.pair_halves()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 2048)), jnp.bfloat16)
    real = jnp.arange(8) < 3
    assert layer._hidden_in_launch(x, "auto") is hidden_in_launch

    def run(impl):
        return np.asarray(jax.jit(lambda m, a, r: m(a, r, impl=impl))(layer, x, real), np.float64)

    got, want = run("auto"), run("reference")
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_the_shared_hidden_formed_with_the_experts_changes_no_bit_on_the_gpu(monkeypatch):
    """``SHARED_HIDDEN_WITH_EXPERTS`` (the default): each down launch reads its rows of the
    one array in place, and the block's output is that of the products formed apart."""
    config = MoEConfig(hidden_size=2048, num_experts=256, top_k=8, intermediate_size=512,
                       shared_intermediate_size=512, dtype="bfloat16")  # fmt: skip
    layer = SparseMoE(config, rngs=nnx.Rngs(2))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 2048)), jnp.bfloat16)
    real = jnp.arange(8) < 5

    def run():
        return np.asarray(jax.jit(lambda m, a, r: m(a, r, impl="auto"))(layer, x, real))

    assert moe_layer.SHARED_HIDDEN_WITH_EXPERTS is True
    together = run()
    monkeypatch.setattr(moe_layer, "SHARED_HIDDEN_WITH_EXPERTS", False)
    apart = run()
    np.testing.assert_array_equal(together.view(np.uint16), apart.view(np.uint16))


@pytest.mark.parametrize(("real", "scaled"), [(1, True), (8, False)])
def test_the_hidden_rows_formed_in_the_expert_launch_match_the_oracle(real, scaled):
    """``moe.expert_hidden`` at the 35B-like shapes (8 rows, top 8 of 256 experts, gate|up
    1024 wide laid out by ``moe.pair_halves``): ``silu(gate) * up`` of each pair, each row
    scaled by its inverse RMS in the launch; padding rows NaN, their pairs zero."""
    rng = np.random.default_rng(real)
    rows, k, width, experts = 8, 2048, 512, 256
    x = rng.standard_normal((rows, k))
    x[real:] = np.nan  # padding: a real row sharing their 8-row group must not see them
    x = jnp.asarray(x, jnp.bfloat16)
    w = jnp.asarray(
        rng.standard_normal((experts, k, 2 * width), np.float32) / np.sqrt(k), jnp.bfloat16
    )
    ids = np.stack([rng.choice(experts, 8, replace=False) for _ in range(rows)]).astype(np.int32)
    ids[real:] = experts
    square_sum = jnp.asarray(rng.uniform(0.5, 2.0, rows) * k, jnp.float32) if scaled else None
    run = jax.jit(
        lambda x, w, i, q: moe.expert_hidden(
            x, w, i, row_scale=q, rms_eps=1e-6 if scaled else None, impl="pallas"
        )
    )
    got = np.asarray(run(x, moe.pair_halves(w), jnp.asarray(ids), square_sum), np.float64)
    x64 = np.asarray(x, np.float64)
    if scaled:
        x64 = x64 / np.sqrt(np.asarray(square_sum, np.float64) / k + 1e-6)[:, None]
    want = np.zeros(got.shape)
    for r, c in np.ndindex(ids.shape):
        if r < real:
            sums = x64[r] @ np.asarray(w[ids[r, c]], np.float64)
            gate, up = sums[:width], sums[width:]
            want[r, c] = gate / (1 + np.exp(-gate)) * up
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_array_equal(got[real:], 0)


def test_a_down_launch_over_the_hidden_tiles_changes_no_bit_on_the_gpu():
    """The 35B-like down launch reading ``expert_hidden``'s tiles in place equals the launch
    over the rows XLA gathers from them."""
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    w = jnp.asarray(
        rng.standard_normal((256, 2048, 1024), np.float32) / np.sqrt(2048), jnp.bfloat16
    )
    down = jnp.asarray(
        rng.standard_normal((256, 512, 2048), np.float32) / np.sqrt(512), jnp.bfloat16
    )
    ids = np.full((8, 8), 256, np.int32)
    ids[:3] = np.stack([rng.choice(256, 8, replace=False) for _ in range(3)])
    ids = jnp.asarray(ids)

    @jax.jit
    def both(x, w, ids, down):
        tiles = moe.expert_hidden(x, w, ids, tiles=True, impl="pallas")
        pair_ids = ids.reshape(-1, 1)
        in_place = moe.expert_matmul(tiles, down, pair_ids, impl="pallas")
        gathered = moe.expert_matmul(tiles.rows().reshape(64, 512), down, pair_ids, impl="pallas")
        return in_place, gathered

    in_place, gathered = (np.asarray(a) for a in both(x, w, ids, down))
    np.testing.assert_array_equal(in_place.view(np.uint16), gathered.view(np.uint16))
    assert np.abs(in_place[:24].astype(np.float32)).max() > 0
    np.testing.assert_array_equal(in_place[24:].astype(np.float32), 0)


@pytest.mark.parametrize("real", [1, 8])
def test_the_combine_launch_matches_the_oracle_at_the_35b_shapes(real):
    """``moe.combine_pairs`` over a down launch's tiles (8 rows of top 8, 2048 columns), the
    never-written tiles of padding pairs NaN: rows within bf16 rounding of the float64 sum,
    square sums those of the rows as stored."""
    rng = np.random.default_rng(real + 40)
    rows, choices, width, experts = 8, 8, 2048, 256
    tiles = rng.standard_normal((66, 8, width)).astype(np.float32)
    ids = rng.integers(0, experts, (rows, choices)).astype(np.int32)
    ids[real:] = experts
    tiles[real * choices :] = np.nan
    pairs = moe.PairTiles(jnp.asarray(tiles, jnp.bfloat16), jnp.asarray(ids), experts, choices)
    weights = jnp.asarray(rng.random((rows, choices)) + 0.05, jnp.float32)
    shared = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16)
    run = jax.jit(lambda *a: moe.combine_pairs(*a, normalize=True, impl="pallas"))
    out, sums = run(pairs, weights, shared, gate, residual)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    t = np.asarray(pairs.tiles.astype(jnp.float32), np.float64)
    w = np.asarray(weights, np.float64)
    w = w / w.sum(1, keepdims=True)
    scale = 1 / (1 + np.exp(-np.asarray(gate[:, 0].astype(jnp.float32), np.float64)))
    want = np.asarray(residual.astype(jnp.float32), np.float64)
    want = want + scale[:, None] * np.asarray(shared.astype(jnp.float32), np.float64)
    for r, c in np.ndindex(rows, choices):
        if r < real:
            want[r] += w[r, c] * t[r * choices + c, r % 8]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=3e-2)
    np.testing.assert_allclose(np.asarray(sums), (got * got).sum(1), rtol=1e-5)


@pytest.mark.parametrize("experts_in_one_launch", [False, True])
def test_a_decode_bucket_combined_in_one_launch_matches_the_reference_layer(
    experts_in_one_launch, monkeypatch
):
    """``SparseMoE.add_to`` with ``COMBINE_IN_LAUNCH`` at the 35B-like shapes: the residual
    plus the block's output from the combine launch, against the reference layer's sum (the
    experts' hidden rows and down products in two launches or, ``EXPERTS_IN_ONE_LAUNCH``,
    one)."""
    monkeypatch.setattr(moe_layer, "COMBINE_IN_LAUNCH", True)
    monkeypatch.setattr(moe_layer, "EXPERTS_IN_ONE_LAUNCH", experts_in_one_launch)
    config = MoEConfig(hidden_size=2048, num_experts=256, top_k=8, intermediate_size=512,
                       shared_intermediate_size=512, dtype="bfloat16")  # fmt: skip
    layer = SparseMoE(config, rngs=nnx.Rngs(4))
    layer.widen_shared_gate()
    layer.pair_halves()
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    real = jnp.arange(8) < 3
    fused = jax.jit(lambda m, res, a, r: m.add_to(res, a, r, impl="auto"))(layer, residual, x, real)
    assert isinstance(fused, SummedRows)
    want = np.asarray(residual, np.float64) + np.asarray(
        jax.jit(lambda m, a, r: m(a, r, impl="reference"))(layer, x, real), np.float64
    )
    got = np.asarray(fused.x, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_allclose(np.asarray(fused.square_sums), (got * got).sum(1), rtol=1e-5)


def _mlp_shapes_35b(rng, real: int):
    """``expert_mlp``'s operands at the 35B-like shapes (a bucket of 8 rows, top 8, the shared
    down beside) with ``real`` rows routed."""
    up = jnp.asarray(
        rng.standard_normal((256, 2048, 1024), np.float32) / np.sqrt(2048), jnp.bfloat16
    )
    down = jnp.asarray(
        rng.standard_normal((256, 512, 2048), np.float32) / np.sqrt(512), jnp.bfloat16
    )
    shared = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
    shared_down = jnp.asarray(rng.standard_normal((512, 2048)) / np.sqrt(512), jnp.bfloat16)
    square_sum = jnp.asarray(rng.uniform(0.5, 2.0, 8) * 2048, jnp.float32)
    ids = np.full((8, 8), 256, np.int32)
    ids[:real] = np.stack([rng.choice(256, 8, replace=False) for _ in range(real)])
    return up, down, jnp.asarray(ids), shared, shared_down, square_sum


@pytest.mark.parametrize("real", [1, 8])
def test_launches_sharing_one_counters_buffer_leave_it_at_zero(real):
    """50 ``expert_mlp`` launches in a ``lax.scan`` that carries one ``counters`` buffer, on
    other rows each: every launch's products equal the two launches' bit for bit (a launch
    that found its counters already counted would let its down programs read the hidden
    tiles the launch before stored), and the buffer is zero after them all."""
    rng = np.random.default_rng(real + 70)
    up, down, ids, shared, shared_down, square_sum = _mlp_shapes_35b(rng, real)
    xs = jnp.asarray(rng.standard_normal((50, 8, 2048)), jnp.bfloat16)
    kw = dict(row_scale=square_sum, rms_eps=1e-6, impl="pallas")

    @jax.jit
    def two_launches(xs):
        def body(_, x):
            tiles = moe.expert_hidden(x, up, ids, tiles=True, **kw)
            return None, moe.expert_matmul(
                tiles, down, ids.reshape(-1, 1), dense=(shared, shared_down), impl="pallas"
            )

        return jax.lax.scan(body, None, xs)[1]

    @jax.jit
    def shared_counters(xs):
        counters = jax.new_ref(jnp.zeros((64,), jnp.int32))

        def body(_, x):
            dense = (shared, shared_down)
            return None, moe.expert_mlp(x, up, down, ids, dense=dense, counters=counters, **kw)

        outs = jax.lax.scan(body, None, xs)[1]
        return outs, counters[...]

    want = [np.asarray(a).view(np.uint16) for a in two_launches(xs)]
    (got, got_dense), counters = shared_counters(xs)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want[0])
    np.testing.assert_array_equal(np.asarray(got_dense).view(np.uint16), want[1])
    np.testing.assert_array_equal(np.asarray(counters), 0)


@pytest.mark.parametrize("real", [1, 3, 8])
def test_the_experts_in_one_launch_change_no_bit_on_the_gpu(real):
    """``moe.expert_mlp`` at the 35B-like shapes (a bucket of 8 rows, top 8, the shared down
    beside): the down products, dense rows included, equal the hidden launch followed by the
    down launch bit for bit, in each of 50 launches: a down program that read its hidden
    tiles before their semaphores said they were stored would differ in some launch."""
    rng = np.random.default_rng(real + 60)
    x = jnp.asarray(rng.standard_normal((8, 2048)), jnp.bfloat16)
    up, down, ids, shared, shared_down, square_sum = _mlp_shapes_35b(rng, real)
    kw = dict(row_scale=square_sum, rms_eps=1e-6)

    @jax.jit
    def two_launches(x, up, down, ids, shared, shared_down):
        tiles = moe.expert_hidden(x, up, ids, tiles=True, impl="pallas", **kw)
        return moe.expert_matmul(
            tiles, down, ids.reshape(-1, 1), dense=(shared, shared_down), impl="pallas"
        )

    @jax.jit
    def one_launch(x, up, down, ids, shared, shared_down):
        return moe.expert_mlp(x, up, down, ids, dense=(shared, shared_down), impl="pallas", **kw)

    args = (x, up, down, ids, shared, shared_down)
    want, want_dense = (np.asarray(a) for a in two_launches(*args))
    assert np.abs(want[: real * 8].astype(np.float32)).max() > 0
    np.testing.assert_array_equal(want[real * 8 :].astype(np.float32), 0)
    for _ in range(50):
        got, got_dense = one_launch(*args)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
        np.testing.assert_array_equal(
            np.asarray(got_dense).view(np.uint16), want_dense.view(np.uint16)
        )
