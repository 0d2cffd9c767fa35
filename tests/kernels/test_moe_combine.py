"""combine_pairs: the Mosaic GPU kernel in the interpreter and the XLA reference against a
float64 oracle (pairs out of range over never-written tiles, weights normalised or not), the
``cuda`` lowering, and the errors for misshapen calls."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe


def _case(seed, rows, choices, width, *, experts=5, spare=3, per_line=None):
    """A down launch's tiles as the launch leaves them: each pair's row at its line, every
    other line, and the tiles of pairs out of range, NaN (never written)."""
    rng = np.random.default_rng(seed)
    per_line = per_line or choices
    pairs = rows * choices
    tiles = rng.standard_normal((pairs + spare, 8, width)).astype(np.float32)
    ids = rng.integers(0, experts, (rows, choices)).astype(np.int32)
    ids[0, -1], ids[-1, 0] = experts, -1  # out of range past either end
    for p, e in enumerate(ids.reshape(-1)):
        if not 0 <= e < experts:
            tiles[p] = np.nan
    args = dict(
        tiles=moe.PairTiles(jnp.asarray(tiles, jnp.bfloat16), jnp.asarray(ids), experts, per_line),
        weights=jnp.asarray(rng.random((rows, choices)) + 0.05, jnp.float32),
        shared=jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16),
        shared_gate=jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16),
        residual=jnp.asarray(rng.standard_normal((rows, width)), jnp.bfloat16),
    )
    return args


def _oracle(tiles, weights, shared, shared_gate, residual, *, normalize):
    """float64, pair by pair: each pair's own row at line ``(p // per_line) % 8``."""
    t = np.asarray(tiles.tiles.astype(jnp.float32), np.float64)
    ids = np.asarray(tiles.experts)
    w = np.asarray(weights, np.float64)
    if normalize:
        w = w / w.sum(1, keepdims=True)
    rows, choices = ids.shape
    out = np.asarray(residual.astype(jnp.float32), np.float64).copy()
    scale = 1 / (1 + np.exp(-np.asarray(shared_gate[:, 0].astype(jnp.float32), np.float64)))
    out += scale[:, None] * np.asarray(shared.astype(jnp.float32), np.float64)
    for r in range(rows):
        for c in range(choices):
            p = r * choices + c
            if 0 <= ids[r, c] < tiles.num_experts:
                out[r] += w[r, c] * t[p, (p // tiles.per_line) % 8]
    return out, (out * out).sum(1)


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize(
    "rows,choices,width,normalize,per_line",
    [(8, 8, 2048, True, None), (5, 2, 128, False, None), (3, 4, 384, True, 8)],
)
def test_combine_pairs_matches_the_float64_oracle(impl, rows, choices, width, normalize,
                                                   per_line):  # fmt: skip
    """The rows within bf16 rounding of the oracle (three bf16 roundings: the routed sum,
    the shared product, the adds), their square sums within float32's of the rows they
    stored; pairs out of range add nothing though their tiles hold NaN."""
    args = _case(rows * 7 + width, rows, choices, width, per_line=per_line)
    out, sums = moe.combine_pairs(**args, normalize=normalize, impl=impl)
    chex.assert_shape(out, (rows, width))
    chex.assert_shape(sums, (rows,))
    assert out.dtype == jnp.bfloat16 and sums.dtype == jnp.float32
    want, want_sums = _oracle(**args, normalize=normalize)
    got = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=3e-2)
    # The sums are of the rows as stored, float32 over N (the interpreter's program may sum
    # the adds' float32 values before their rounding to bf16: XLA's excess precision).
    np.testing.assert_allclose(np.asarray(sums), (got * got).sum(1), rtol=2e-3)
    np.testing.assert_allclose(np.asarray(sums), want_sums, rtol=2e-2)


def test_the_kernel_and_the_reference_agree_to_rounding():
    args = _case(3, 8, 8, 1024)
    k_out, k_sums = moe.combine_pairs(**args, normalize=True, impl="interpret")
    r_out, r_sums = moe.combine_pairs(**args, normalize=True, impl="reference")
    np.testing.assert_allclose(
        np.asarray(k_out, np.float32), np.asarray(r_out, np.float32), rtol=1e-2, atol=2e-2
    )
    np.testing.assert_allclose(np.asarray(k_sums), np.asarray(r_sums), rtol=1e-3)


def test_combine_pairs_lowers_for_cuda_at_the_35b_shapes():
    """The 35B-like batch-1 bucket: 8 rows of 8 choices, 2048 columns, the down launch's
    66 tiles."""
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    tiles = moe.PairTiles(s((66, 8, 2048), bf16), s((8, 8), jnp.int32), 256, 8)
    args = (tiles, s((8, 8), jnp.float32), s((8, 2048), bf16), s((8, 64), bf16),
            s((8, 2048), bf16))  # fmt: skip

    def call(*a):
        return moe.combine_pairs(*a, normalize=True, impl="pallas")

    lowered = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("mosaic_gpu") >= 1


def test_misshapen_calls_name_the_operand_and_the_rule():
    args = _case(0, 4, 2, 128)
    bad = dict(args, weights=args["weights"][:, :1])
    with pytest.raises(ValueError, match=r"weights must be \[R=4, C=2\]"):
        moe.combine_pairs(**bad, impl="reference")
    bad = dict(args, residual=args["residual"][:, :64])
    with pytest.raises(ValueError, match=r"residual must be \[R=4, N=128\]"):
        moe.combine_pairs(**bad, impl="reference")
    bad = dict(args, shared_gate=args["shared_gate"][:, :0])
    with pytest.raises(ValueError, match=r"shared_gate must be \[R=4, G >= 1\]"):
        moe.combine_pairs(**bad, impl="reference")
    narrow = _case(0, 4, 2, 64)
    assert "multiple of 128" in moe.combine_pairs_unsupported_reason(
        narrow["tiles"], narrow["shared"]
    )
    with pytest.raises(NotImplementedError, match="multiple of 128"):
        moe.combine_pairs(**narrow, impl="interpret")
