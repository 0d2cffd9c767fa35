"""expert_matmul: the Mosaic GPU kernel in the interpreter and the XLA reference against a
float64 oracle, padding ids, the ``cuda`` lowering, and the errors for misshapen calls."""

from __future__ import annotations

import importlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels._skinny import current_variant

# The module, not the function of the same name that the package re-exports.
em_module = importlib.import_module("pallas_kernels.moe.expert_matmul")


def _case(seed, rows, choices, k, n, experts=6):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, n)) / np.sqrt(k), jnp.bfloat16)
    ids = rng.integers(0, experts, (rows, choices)).astype(np.int32)
    ids[1, -1] = experts  # padding ids, past either end: zero rows, nothing read
    ids[-1, 0] = -1
    return x, w, ids


def _oracle(x, w, ids):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((*ids.shape, w.shape[2]))
    for r, c in np.ndindex(ids.shape):
        if 0 <= ids[r, c] < w.shape[0]:
            out[r, c] = x64[r] @ w64[ids[r, c]]
    return out


@pytest.mark.parametrize(
    ("rows", "choices", "k", "n"),
    [
        (5, 3, 256, 128),  # rows not a multiple of 8: the last group is padded
        (11, 1, 128, 64),  # the down product's one choice per row
        (4, 4, 256, 64 * 17),  # 17 column tiles: 7 programs a tile, up to 3 pairs each
    ],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_matches_the_float64_oracle_and_zeroes_padding_ids(
    rows, choices, k, n, impl, product_variant
):
    x, w, ids = _case(rows * k + n, rows, choices, k, n)
    got = moe.expert_matmul(x, w, jnp.asarray(ids), impl=impl)
    chex.assert_shape(got, (rows, choices, n))
    assert got.dtype == jnp.bfloat16
    got64, want = np.asarray(got, np.float64), _oracle(x, w, ids)
    assert np.linalg.norm(got64 - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_array_equal(got64[1, -1], 0)
    np.testing.assert_array_equal(got64[-1, 0], 0)


def test_programs_stay_within_one_wave_and_share_the_pairs():
    assert em_module.programs_per_tile(64, 16) == 8  # gate/up of 8 tokens at top 8
    assert em_module.programs_per_tile(64, 32) == 4  # their down product
    assert em_module.programs_per_tile(3, 2) == 3  # never more programs than pairs
    assert em_module.programs_per_tile(64, 200) == 1
    assert em_module.programs_per_tile(64, 32, per_sm=3) == 12  # three programs an SM
    # A dense product's program per column tile stays in the wave too.
    assert em_module.programs_per_tile(64, 8, reserved=8) == 15


def test_the_kernel_lowers_for_cuda(product_variant):
    x = jnp.zeros((8, 2048), jnp.bfloat16)
    w = jnp.zeros((256, 2048, 1024), jnp.bfloat16)
    ids = jnp.zeros((8, 8), jnp.int32)

    def call(*a):
        return em_module._kernel(*a, variant=current_variant(), interpret=False)

    text = jax.jit(call).trace(x, w, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_unsupported_reason_names_dtype_and_alignment():
    x = jnp.zeros((8, 256), jnp.bfloat16)
    assert moe.expert_matmul_unsupported_reason(x, jnp.zeros((2, 256, 64), jnp.bfloat16)) is None
    assert "16-bit float" in moe.expert_matmul_unsupported_reason(
        x, jnp.zeros((2, 256, 64), jnp.float32)
    )
    assert "multiple of 64" in moe.expert_matmul_unsupported_reason(
        x, jnp.zeros((2, 256, 96), jnp.bfloat16)
    )
    short = jnp.zeros((8, 64), jnp.bfloat16)
    assert "multiple of 128" in moe.expert_matmul_unsupported_reason(
        short, jnp.zeros((2, 64, 64), jnp.bfloat16)
    )


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "ids", "match"),
    [
        ((8, 128), (2, 64, 64), jnp.zeros((8, 2), jnp.int32), "one K"),
        ((8, 128), (2, 128, 64), jnp.zeros((7, 2), jnp.int32), r"int32 \[R=8, C\]"),
        ((8, 128), (2, 128, 64), jnp.zeros((8, 2), jnp.float32), r"int32 \[R=8, C\]"),
    ],
)
def test_misshapen_calls_raise_naming_the_shapes(x_shape, w_shape, ids, match):
    with pytest.raises(ValueError, match=match):
        moe.expert_matmul(jnp.zeros(x_shape, jnp.bfloat16), jnp.zeros(w_shape, jnp.bfloat16), ids)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize(("dense_rows", "dense_k"), [(5, 128), (8, 384)])
def test_a_dense_product_runs_in_the_same_launch(impl, dense_rows, dense_k, product_variant):
    rows, choices, k, n = 5, 3, 256, 128
    x, w, ids = _case(7 + dense_k, rows, choices, k, n)
    rng = np.random.default_rng(dense_k)
    xd = jnp.asarray(rng.standard_normal((dense_rows, dense_k)), jnp.bfloat16)
    wd = jnp.asarray(rng.standard_normal((dense_k, n)) / np.sqrt(dense_k), jnp.bfloat16)
    got, got_dense = moe.expert_matmul(x, w, jnp.asarray(ids), dense=(xd, wd), impl=impl)
    chex.assert_shape([got, got_dense], [(rows, choices, n), (dense_rows, n)])
    want = _oracle(x, w, ids)
    got64 = np.asarray(got, np.float64)
    assert np.linalg.norm(got64 - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_array_equal(got64[1, -1], 0)
    want_dense = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64)
    err = np.linalg.norm(np.asarray(got_dense, np.float64) - want_dense)
    assert err / np.linalg.norm(want_dense) < 1e-2
    # The routed products are the ones the launch gives without the dense one.
    chex.assert_trees_all_equal(got, moe.expert_matmul(x, w, jnp.asarray(ids), impl=impl))


def test_the_launch_with_a_dense_product_lowers_for_cuda():
    x = jnp.zeros((64, 512), jnp.bfloat16)
    w = jnp.zeros((256, 512, 2048), jnp.bfloat16)
    ids = jnp.zeros((64, 1), jnp.int32)
    dense = (jnp.zeros((8, 512), jnp.bfloat16), jnp.zeros((512, 2048), jnp.bfloat16))

    def call(*a):
        return em_module._kernel(*a, variant=current_variant(), interpret=False)

    text = jax.jit(call).trace(x, w, ids, dense).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1


@pytest.mark.parametrize(
    ("dense", "match"),
    [
        ((jnp.zeros((8, 128)), jnp.zeros((128, 64))), "dense operands must be bfloat16"),
        ((jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 64), jnp.bfloat16)), "multiple of 128"),
        ((jnp.zeros((72, 128), jnp.bfloat16), jnp.zeros((128, 64), jnp.bfloat16)), "72 rows"),
    ],
)
def test_unsupported_dense_products_are_named(dense, match):
    x, w = jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((2, 256, 64), jnp.bfloat16)
    assert match in moe.expert_matmul_unsupported_reason(x, w, dense)


def test_a_dense_product_of_another_width_is_refused():
    x, w = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((2, 128, 64), jnp.bfloat16)
    dense = (jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((128, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"wd \[Kd, N=64\]"):
        moe.expert_matmul(x, w, jnp.zeros((8, 2), jnp.int32), dense=dense)


def _hidden_oracle(x64, w64, ids):
    """float64 ``silu(gate) * up`` of each (row, choice), the gate's columns then the up
    projection's in ``w64``."""
    width = w64.shape[2] // 2
    want = np.zeros(ids.shape + (width,))
    for r, c in np.ndindex(ids.shape):
        if 0 <= ids[r, c] < w64.shape[0]:
            sums = x64[r] @ w64[ids[r, c]]
            gate, up = sums[:width], sums[width:]
            want[r, c] = gate / (1 + np.exp(-gate)) * up
    return want


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("scaled", [False, True], ids=["rows", "rms-scaled"])
def test_hidden_rows_match_the_float64_oracle(impl, scaled):
    """``expert_hidden`` over weights laid out by ``pair_halves``: each program reads one tile
    of 32 gate and 32 up columns and stores the 32 hidden columns, the oracle's SwiGLU of the
    unpaired weights (each row times its inverse RMS first, with ``rms_eps``); padding ids
    give zero rows."""
    rng = np.random.default_rng(31 + scaled)
    rows, k, width, experts = 5, 256, 128, 4
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, 2 * width)) / np.sqrt(k), jnp.bfloat16)
    ids = rng.integers(0, experts, (rows, 2)).astype(np.int32)
    ids[4] = experts  # a padding row
    square_sum = jnp.asarray(rng.uniform(0.5, 2.0, rows) * k, jnp.float32) if scaled else None
    got = moe.expert_hidden(
        x, moe.pair_halves(w), jnp.asarray(ids), row_scale=square_sum,
        rms_eps=1e-6 if scaled else None, impl=impl,
    )  # fmt: skip
    chex.assert_shape(got, (rows, 2, width))
    x64 = np.asarray(x, np.float64)
    if scaled:
        x64 = x64 / np.sqrt(np.asarray(square_sum, np.float64) / k + 1e-6)[:, None]
    want = _hidden_oracle(x64, np.asarray(w, np.float64), ids)
    got64 = np.asarray(got, np.float64)
    assert np.linalg.norm(got64 - want) / np.linalg.norm(want) < 1e-2
    np.testing.assert_array_equal(got64[4], 0)


def test_the_hidden_rows_launch_lowers_for_cuda_at_the_35b_shapes():
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    args = (s((8, 2048), bf16), s((256, 2048, 1024), bf16), s((8, 8), jnp.int32),
            s((8,), jnp.float32))  # fmt: skip

    def call(x, w, ids, square_sum):
        return moe.expert_hidden(x, w, ids, row_scale=square_sum, rms_eps=1e-6, impl="pallas")

    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_hidden_calls_refuse_what_they_cannot_take(monkeypatch):
    x = jnp.zeros((4, 256), jnp.bfloat16)
    w = jnp.zeros((3, 256, 256), jnp.bfloat16)
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="rms_eps=0.1 scales rows by their row_scale; none"):
        moe.expert_hidden(x, w, ids, rms_eps=0.1)
    with pytest.raises(ValueError, match="2I=160 must be whole tiles of 64 columns"):
        moe.expert_hidden(x, jnp.zeros((3, 256, 160), jnp.bfloat16), ids)
    assert moe.expert_hidden_unsupported_reason(x, w) is None
    monkeypatch.setattr(importlib.import_module("pallas_kernels._skinny"), "SWAP_OPERANDS", False)
    assert "swapped products" in moe.expert_hidden_unsupported_reason(x, w)


def test_a_down_launch_reads_the_hidden_tiles_in_place_as_it_reads_their_rows():
    """``expert_hidden(tiles=True)`` gives the launch's ``PairTiles``; the down launch over
    them equals the launch over the rows XLA would gather, bit for bit, and so does its
    reference path."""
    rng = np.random.default_rng(41)
    rows, k, width, experts = 5, 256, 128, 4
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((experts, k, 2 * width)) / np.sqrt(k), jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((experts, width, k)) / np.sqrt(width), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, experts, (rows, 2)), jnp.int32).at[4].set(experts)
    tiles = moe.expert_hidden(x, w, ids, tiles=True, impl="interpret")
    assert isinstance(tiles, moe.PairTiles)
    chex.assert_shape(tiles.rows(), (rows, 2, width))
    hidden = tiles.rows().reshape(-1, width)
    pair_ids = ids.reshape(-1, 1)
    in_place = moe.expert_matmul(tiles, down, pair_ids, impl="interpret")
    gathered = moe.expert_matmul(hidden, down, pair_ids, impl="interpret")
    chex.assert_trees_all_equal(in_place, gathered)
    chex.assert_trees_all_equal(
        moe.expert_matmul(tiles, down, pair_ids, impl="reference"),
        moe.expert_matmul(hidden, down, pair_ids, impl="reference"),
    )
    np.testing.assert_array_equal(np.asarray(in_place[8:], np.float32), 0)  # row 4's pairs


def _lowered_hidden_then_down() -> str:
    """The 35B-like hidden-rows launch and the down launch over its tiles, lowered for
    ``cuda``."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16

    def call(x, w, ids, down):
        tiles = moe.expert_hidden(x, w, ids, tiles=True, impl="pallas")
        return moe.expert_matmul(tiles, down, ids.reshape(-1, 1), impl="pallas")

    args = (s((8, 2048), bf16), s((256, 2048, 1024), bf16), s((8, 8), jnp.int32),
            s((256, 512, 2048), bf16))  # fmt: skip
    return jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_down_launch_over_hidden_tiles_lowers_for_cuda_at_the_35b_shapes():
    assert _lowered_hidden_then_down().count("mosaic_gpu") >= 2


def test_pair_halves_puts_each_tiles_gate_and_up_columns_side_by_side():
    """Tile t of a paired weight: gate columns 32t .. 32t + 31, then the same up columns;
    ``unpair_halves`` gives the weight back."""
    from pallas_kernels._skinny import unpair_halves

    w = jnp.arange(2 * 256, dtype=jnp.int32).reshape(2, 256)  # gate 0..127, up 128..255
    paired = moe.pair_halves(w)
    np.testing.assert_array_equal(paired[0, :32], np.arange(32))
    np.testing.assert_array_equal(paired[0, 32:64], 128 + np.arange(32))
    np.testing.assert_array_equal(paired[1, 64:96], 256 + 32 + np.arange(32))
    chex.assert_trees_all_equal(unpair_halves(paired), w)


def _mlp_case(seed, rows=5, k=256, width=128, n=192, experts=4):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    up = jnp.asarray(rng.standard_normal((experts, k, 2 * width)) / np.sqrt(k), jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((experts, width, n)) / np.sqrt(width), jnp.bfloat16)
    ids = rng.integers(0, experts, (rows, 2)).astype(np.int32)
    ids[rows - 1] = experts  # a padding row
    ids[1, 1] = -1
    dense = (
        jnp.asarray(rng.standard_normal((3, width)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((width, n)) / np.sqrt(width), jnp.bfloat16),
    )
    square_sum = jnp.asarray(rng.uniform(0.5, 2.0, rows) * k, jnp.float32)
    return x, up, down, jnp.asarray(ids), dense, square_sum


def test_the_mlp_launch_gives_the_two_launches_products_bit_for_bit():
    """``expert_mlp``: the hidden launch's programs and the down launch's in one grid give
    the pairs' down products and the dense product of ``expert_hidden`` followed by
    ``expert_matmul`` over its tiles, bit for bit (the interpreter runs the hidden programs
    first, as the launch order on the GPU does), as tiles too."""
    x, up, down, ids, dense, square_sum = _mlp_case(5)
    paired = moe.pair_halves(up)
    kw = dict(row_scale=square_sum, rms_eps=1e-6)
    got, got_dense = moe.expert_mlp(x, paired, down, ids, dense=dense, impl="interpret", **kw)
    hidden = moe.expert_hidden(x, paired, ids, tiles=True, impl="interpret", **kw)
    pair_ids = ids.reshape(-1, 1)
    two = moe.expert_matmul(hidden, down, pair_ids, dense=dense, impl="interpret")
    chex.assert_trees_all_equal((got, got_dense), two)
    chex.assert_shape(got, (10, 1, 192))
    tiles, _ = moe.expert_mlp(x, paired, down, ids, dense=dense, tiles=True, impl="interpret", **kw)
    assert isinstance(tiles, moe.PairTiles)
    chex.assert_trees_all_equal(tiles.rows(), got)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_the_mlp_launch_matches_the_float64_oracle(impl):
    """Each pair's ``silu(gate) * up`` of its scaled row times its expert's down weight;
    padding ids give zero rows, and the dense product rides along."""
    x, up, down, ids, dense, square_sum = _mlp_case(6)
    got, got_dense = moe.expert_mlp(
        x, moe.pair_halves(up), down, ids, dense=dense, row_scale=square_sum, rms_eps=1e-6,
        impl=impl,
    )  # fmt: skip
    x64 = (
        np.asarray(x, np.float64)
        / np.sqrt(np.asarray(square_sum, np.float64) / 256 + 1e-6)[:, None]
    )
    hidden = _hidden_oracle(x64, np.asarray(up, np.float64), np.asarray(ids))
    want = _oracle(hidden.reshape(-1, 128), down, np.asarray(ids).reshape(-1, 1))
    got64 = np.asarray(got, np.float64)
    assert np.linalg.norm(got64 - want) / np.linalg.norm(want) < 2e-2
    np.testing.assert_array_equal(got64[[3, 8, 9]], 0)  # ids -1 and the padding row's
    dense_want = np.asarray(dense[0], np.float64) @ np.asarray(dense[1], np.float64)
    dense64 = np.asarray(got_dense, np.float64)
    assert np.linalg.norm(dense64 - dense_want) / np.linalg.norm(dense_want) < 1e-2


def test_the_mlp_launch_lowers_for_cuda_at_the_35b_shapes_with_its_counters():
    """One Mosaic GPU launch whose per-pair counters are zeros computed from its own ids (a
    comparison, not a constant XLA could share between launches), updated in place."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16

    def call(x, up, down, ids, shared, shared_down, square_sum):
        return moe.expert_mlp(
            x, up, down, ids, dense=(shared, shared_down), row_scale=square_sum, rms_eps=1e-6,
            tiles=True, impl="pallas",
        )  # fmt: skip

    args = (s((8, 2048), bf16), s((256, 2048, 1024), bf16), s((256, 512, 2048), bf16),
            s((8, 8), jnp.int32), s((8, 512), bf16), s((512, 2048), bf16),
            s((8,), jnp.float32))  # fmt: skip
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    counters = [line for line in text.splitlines() if "stablehlo.convert" in line]
    assert any("tensor<64xi1>) -> tensor<64xi32>" in line for line in counters)  # one a pair
    assert "output_operand_aliases" in text


def test_launches_in_a_scan_share_one_counters_buffer_without_zero_fills():
    """Handed one ``counters`` buffer, each launch of a scan counts in it (the scan carries
    it, the launch updates it in place) and computes no zeros of its own."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16

    def call(xs, up, down, ids, shared, shared_down, square_sum):
        counters = jax.new_ref(jnp.zeros((64,), jnp.int32))

        def body(_, x):
            return None, moe.expert_mlp(
                x, up, down, ids, dense=(shared, shared_down), row_scale=square_sum,
                rms_eps=1e-6, counters=counters, impl="pallas",
            )  # fmt: skip

        return jax.lax.scan(body, None, xs)[1]

    args = (s((3, 8, 2048), bf16), s((256, 2048, 1024), bf16), s((256, 512, 2048), bf16),
            s((8, 8), jnp.int32), s((8, 512), bf16), s((512, 2048), bf16),
            s((8,), jnp.float32))  # fmt: skip
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "tensor<64xi1>) -> tensor<64xi32>" not in text  # no zeros from the ids
    (loop,) = [line for line in text.splitlines() if "stablehlo.while" in line]
    assert "tensor<64xi32>" in loop  # the buffer, carried
    assert "output_operand_aliases" in text


def test_counters_of_the_wrong_kind_are_refused_naming_them():
    x, up, down, ids, dense, _ = _mlp_case(8)
    paired = moe.pair_halves(up)
    with pytest.raises(TypeError, match="counters must be a jax.Ref"):
        moe.expert_mlp(x, paired, down, ids, counters=jnp.zeros(16, jnp.int32))
    short = jax.new_ref(jnp.zeros(ids.size - 1, jnp.int32))
    with pytest.raises(ValueError, match=rf"int32 \[n >= {ids.size}\]; got int32"):
        moe.expert_mlp(x, paired, down, ids, counters=short)
    wide = jax.new_ref(jnp.zeros(ids.size, jnp.float32))
    with pytest.raises(ValueError, match="got float32"):
        moe.expert_mlp(x, paired, down, ids, counters=wide)


def test_mlp_calls_refuse_what_they_cannot_take():
    x, up, down, ids, dense, _ = _mlp_case(7)
    with pytest.raises(ValueError, match="tiles=True needs the kernel"):
        moe.expert_mlp(x, moe.pair_halves(up), down, ids, tiles=True, impl="reference")
    with pytest.raises(ValueError, match=r"x must be \[R, K\] and w \[E, K, N\]"):
        moe.expert_mlp(x, moe.pair_halves(up), down[:, :64], ids)
    assert moe.expert_mlp_unsupported_reason(x, up, down, dense) is None
    odd = jnp.zeros((4, 128, 100), jnp.bfloat16)
    assert "multiple of 64" in moe.expert_mlp_unsupported_reason(x, up, odd)
