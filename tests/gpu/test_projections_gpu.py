"""The projections kernel on an sm_90 GPU at the shapes of a Qwen3.5-35B-A3B-like decode
bucket (GDN qkv | z | b a, attention q/k/v, the router and shared expert), against the
float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import rel

from pallas_kernels import moe, projections
from pallas_kernels._common import on_hopper_gpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]


@pytest.mark.parametrize(
    ("rows", "k", "widths"),
    [
        (8, 2048, (8192, 4096, 64)),  # GDN
        (8, 2048, (8192, 512, 512)),  # gated attention q, k, v
        (8, 2048, (256, 512, 512)),  # router, shared expert gate and up
        (1, 4096, (12288, 12288)),  # one row; the 9B-like MLP's widths
        (8, 5120, (10240, 6144)),  # the 27B-like GDN's qkv and z (its 96-wide b|a: cuBLAS)
        (37, 2048, (64,)),
    ],
)
def test_projections_match_the_oracle(rows, k, widths, product_variant):
    rng = np.random.default_rng(rows * k + len(widths))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for n in widths]
    got = jax.jit(lambda x, ws: projections.projections(x, ws, impl="pallas"))(x, ws)
    for out, w in zip(got, ws, strict=True):
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        out64 = np.asarray(out, np.float64)
        assert out64.shape == want.shape and np.isfinite(out64).all()
        assert np.linalg.norm(out64 - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("rows", [1, 8])
def test_a_paired_shared_expert_gives_its_swiglu_in_the_router_s_launch(rows):
    """The 35B-like router (256), its shared expert's gate/up laid out by ``pair_halves``
    (1024) and the widened shared gate (64), rows scaled by their inverse RMS: the paired
    weight's entry is ``silu(gate) * up`` of the scaled sums."""
    rng = np.random.default_rng(rows + 11)
    k = 2048
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
          for n in (256, 1024, 64)]  # fmt: skip
    ws[1] = moe.pair_halves(ws[1])
    square_sum = jnp.asarray(rng.uniform(0.05, 4.0, rows) * k, jnp.float32)

    def call(x, ws, s):
        return projections.projections(
            x, ws, row_scale=s, rms_eps=1e-6, paired=(False, True, False), impl="pallas"
        )

    got = jax.jit(call)(x, ws, square_sum)
    scale = 1 / np.sqrt(np.asarray(square_sum, np.float64) / k + 1e-6)
    x64 = np.asarray(x, np.float64)
    sums = [(x64 @ np.asarray(w, np.float64)) * scale[:, None] for w in ws]
    gate, up = np.split(np.asarray(moe.unpair_halves(jnp.asarray(sums[1])), np.float64), 2, -1)
    sums[1] = gate / (1 + np.exp(-gate)) * up
    for out, want in zip(got, sums, strict=True):
        out64 = np.asarray(out, np.float64)
        assert out64.shape == want.shape and np.isfinite(out64).all()
        assert np.linalg.norm(out64 - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize(
    ("rows", "k", "widths"),
    [
        (8, 2048, (8192, 4096, 64)),  # a GDN layer's input norm in its projections' launch
        (1, 4096, (12288, 12288)),
        (24, 2048, (256, 512, 512)),
    ],
)
def test_row_scaled_projections_match_the_oracle(rows, k, widths, product_variant):
    """Each row scaled by ``1 / sqrt(square_sum / K + eps)`` in the launch (an RMS norm's)."""
    rng = np.random.default_rng(rows * k + 3)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for n in widths]
    square_sum = jnp.asarray(rng.uniform(0.05, 400.0, rows) * k, jnp.float32)

    def call(x, ws, s):
        return projections.projections(x, ws, row_scale=s, rms_eps=1e-6, impl="pallas")

    got = jax.jit(call)(x, ws, square_sum)
    scale = 1 / np.sqrt(np.asarray(square_sum, np.float64) / k + 1e-6)
    for out, w in zip(got, ws, strict=True):
        want = (np.asarray(x, np.float64) @ np.asarray(w, np.float64)) * scale[:, None]
        out64 = np.asarray(out, np.float64)
        assert out64.shape == want.shape and np.isfinite(out64).all()
        assert np.linalg.norm(out64 - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize(
    ("rows", "k", "widths"),
    [
        (8, 4096, (2048,)),  # GDN out_proj / attention o_proj: 4 parts of K
        (8, 512, (2048,)),  # the shared expert's down product: one block of K a part
        (64, 4096, (4096,)),  # the 9B-like out_proj at the most rows: 2 parts
        (1, 4096, (2048,)),
        (8, 2048, (256, 512, 512)),  # router, shared expert gate and up: 4 parts
        (24, 2048, (256, 512, 512)),
    ],
)
def test_partial_products_sum_to_the_oracle(rows, k, widths, product_variant):
    rng = np.random.default_rng(rows + k + sum(widths))
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for n in widths]
    got = jax.jit(lambda x, ws: projections.projection_partials(x, ws, impl="pallas"))(x, ws)
    splits = projections.partial_splits(k, widths)
    for out, w in zip(got, ws, strict=True):
        assert out.shape == (splits, rows, w.shape[1])
        out64 = np.asarray(out, np.float64).sum(axis=0)
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert np.isfinite(out64).all()
        assert np.linalg.norm(out64 - want) / np.linalg.norm(want) < 1e-3


@pytest.mark.parametrize(
    ("rows", "k", "widths", "partial"),
    [
        (8, 2048, (256, 512, 512), False),  # router, shared gate and up: 20 programs, 12 stages
        (64, 2048, (256, 512, 512), False),  # 64-row buffers: 6 stages
        (8, 4096, (2048,), True),  # out_proj partials: 128 programs, 6 stages of 8 blocks
    ],
)
def test_filled_rings_match_the_oracle(rows, k, widths, partial, monkeypatch):
    """``_skinny.RING_FILLS_SM``: launches of one program an SM with the deepest ring that
    fits a block's shared memory (a larger scratch than any other launch takes)."""
    from pallas_kernels import _skinny

    monkeypatch.setattr(_skinny, "RING_FILLS_SM", True)
    rng = np.random.default_rng(rows + k + 11)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for n in widths]
    if partial:
        call = lambda x, ws: projections.projection_partials(x, ws, impl="pallas")  # noqa: E731
    else:
        call = lambda x, ws: projections.projections(x, ws, impl="pallas")  # noqa: E731
    got = jax.jit(call)(x, ws)
    for out, w in zip(got, ws, strict=True):
        out64 = np.asarray(out, np.float64)
        out64 = out64.sum(axis=0) if partial else out64
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        assert out64.shape == want.shape and np.isfinite(out64).all()
        assert np.linalg.norm(out64 - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("rows", [1, 8])
def test_add_launches_sharing_one_counters_buffer_match_the_split_product(rows):
    """``projection_add`` at the 35B-like output projection (``[4096, 2048]`` in 4 parts of
    K), 50 launches in a ``lax.scan`` on other rows each, counting in one carried buffer:
    each launch's rows equal the residual plus the partials summed by XLA bit for bit (a
    row program that read a partial before it was stored would differ in some launch),
    their square sums the rows', and the buffer is zero after them all."""
    rng = np.random.default_rng(rows + 90)
    xs = jnp.asarray(rng.standard_normal((50, rows, 4096)), jnp.bfloat16)
    residuals = jnp.asarray(rng.standard_normal((50, rows, 2048)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4096, 2048)) / np.sqrt(4096), jnp.bfloat16)

    @jax.jit
    def apart(xs, residuals):
        def body(_, xr):
            (partial,) = projections.projection_partials(xr[0], [w], splits=4, impl="pallas")
            product = partial[0] + partial[1] + partial[2] + partial[3]
            return None, xr[1] + product.astype(jnp.bfloat16)

        return jax.lax.scan(body, None, (xs, residuals))[1]

    @jax.jit
    def in_one_launch(xs, residuals):
        counters = jax.new_ref(jnp.zeros((8,), jnp.int32))

        def body(_, xr):
            kw = dict(splits=4, counters=counters, impl="pallas")
            return None, projections.projection_add(xr[0], w, xr[1], **kw)

        outs = jax.lax.scan(body, None, (xs, residuals))[1]
        return outs, counters[...]

    want = np.asarray(apart(xs, residuals))
    (got, sums), counters = in_one_launch(xs, residuals)
    got = np.asarray(got)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    got32 = got.astype(np.float32)
    np.testing.assert_allclose(np.asarray(sums), (got32 * got32).sum(-1), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(counters), 0)


@pytest.mark.parametrize("splits", [1, 4], ids=["whole-k", "4-parts"])
@pytest.mark.parametrize(
    ("rows", "experts", "top_k"),
    [(1, 256, 8), (8, 256, 8), (8, 512, 10), (8, 64, 8)],
    ids=["35b-1-row", "35b-8-rows", "qwen3-next", "64-experts"],
)
def test_ranked_launches_sharing_one_counters_buffer_rank_what_they_store(
    rows, experts, top_k, splits
):
    """``ranked_projections`` at a router's shapes (the 35B-like router, its paired shared
    gate/up and widened gate, rows scaled by their inverse RMS), 50 launches in a
    ``lax.scan`` on other rows each, counting in one carried buffer: each launch's products
    equal the unranked launch's bit for bit (over parts of K, ``splits``: both within the
    float64 oracle's 1e-2), its ids are ``moe.top_k_exps`` of the logits it stored (a row
    program that ranked before every tile or partial landed would differ in some launch; a
    third of the router's columns repeat others, so equal logits tie), its exponentials
    theirs within float32 rounding, padding rows get no expert, and the buffer is zero
    after them all."""
    if splits > 1 and experts % projections.COMBINED_WIDTH:
        pytest.skip(f"a combined launch takes widths of whole {projections.COMBINED_WIDTH}")
    rng = np.random.default_rng(rows + experts)
    k = 2048
    xs = jnp.asarray(rng.standard_normal((50, rows, k)), jnp.bfloat16)
    sums = jnp.asarray(rng.uniform(0.05, 4.0, (50, rows)) * k, jnp.float32)
    router = rng.standard_normal((k, experts)) / np.sqrt(k)
    router[:, 2::3] = router[:, 1::3][:, : router[:, 2::3].shape[1]]
    gate_width = 64 if splits == 1 else projections.COMBINED_WIDTH
    ws = [jnp.asarray(w, jnp.bfloat16) for w in
          (router, rng.standard_normal((k, 1024)) / np.sqrt(k),
           rng.standard_normal((k, gate_width)) / np.sqrt(k))]  # fmt: skip
    ws[1] = moe.pair_halves(ws[1])
    valid = jnp.arange(rows) < max(1, rows - 3)
    kw = dict(rms_eps=1e-6, paired=(False, True, False), splits=splits, impl="pallas")

    @jax.jit
    def plain(xs, sums):
        counters = jax.new_ref(jnp.zeros((8,), jnp.int32))

        def body(_, xs_):
            return None, projections.projections(
                xs_[0], ws, row_scale=xs_[1], counters=counters if splits > 1 else None, **kw
            )

        return jax.lax.scan(body, None, (xs, sums))[1], counters[...]

    @jax.jit
    def ranked(xs, sums):
        counters = jax.new_ref(jnp.zeros((8,), jnp.int32))

        def body(_, xs_):
            return None, projections.ranked_projections(
                xs_[0], ws, top_k=top_k, valid=valid, row_scale=xs_[1], counters=counters, **kw
            )

        outs = jax.lax.scan(body, None, (xs, sums))[1]
        return outs, counters[...]

    want, plain_counters = plain(xs, sums)
    (products, exps, ids), counters = ranked(xs, sums)
    for got, expected in zip(products, want, strict=True):
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint16), np.asarray(expected).view(np.uint16)
        )
    scale = 1 / np.sqrt(np.asarray(sums, np.float64) / k + 1e-6)
    logits64 = np.einsum("lrk,kn->lrn", np.asarray(xs, np.float64), np.asarray(ws[0], np.float64))
    assert rel(products[0], logits64 * scale[..., None]) < 1e-2
    want_exps, want_ids = jax.vmap(
        lambda logits: moe.top_k_exps(logits.astype(jnp.float32), top_k, valid)
    )(products[0])
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    assert (np.asarray(ids)[:, ~np.asarray(valid)] == experts).all()
    np.testing.assert_allclose(np.asarray(exps), np.asarray(want_exps), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(counters), 0)
    np.testing.assert_array_equal(np.asarray(plain_counters), 0)
