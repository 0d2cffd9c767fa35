"""The decode kernel of ``decode_mgpu`` (every variant) against the float64 oracle.

Each variant runs under the Mosaic GPU CPU interpreter (values; fresh buffers start as NaN, so
an unwritten output shows) and through the Pallas -> Mosaic GPU lowering for ``cuda`` on the
CPU (layouts and TMA shapes, which the interpreter does not check).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels.gdn import _decode_grids as grids
from pallas_kernels.gdn import decode_mgpu as variants
from pallas_kernels.gdn import reference as gdn_reference

# Every named variant; the pipelined ones also with 3 programs, so that each walks several
# items (padded ones among them) through its ring, once with 16-column blocks (ring stages
# padded to TMA-aligned rows); and the batch-1 tiling of "cols".
_CASES = {
    **variants.VARIANTS,
    "pipe3-wgmma": variants.DecodeVariant("wgmma", stages=3, one_pass=False),
    "pipe3-cols-3programs": variants.DecodeVariant("cols", block_v=32, stages=3, programs=3),
    "pipe2-wgmma-3programs": variants.DecodeVariant("wgmma", block_v=64, stages=2, programs=3),
    "pipe3-cols-bv16-3programs": variants.DecodeVariant("cols", block_v=16, stages=3, programs=3),
    "cols-bv16": variants.DecodeVariant("cols", block_v=16),
}


def _case(seed, *, n, d, kd, vd, slots, dtype, padded, h=1, hv=2):
    """Random inputs, distinct random slots (slot 0 on the rows in ``padded``); the pool is
    NaN in slot 0 and in every slot no row names, so reading a wrong slot shows."""
    rng = np.random.default_rng(seed)
    real = rng.permutation(np.arange(1, slots))[:n]
    idx = np.where(np.isin(np.arange(n), padded), 0, real).astype(np.int32)
    pool = rng.standard_normal((slots, hv, kd, vd)).astype(np.float32) * 0.3
    pool[np.setdiff1d(np.arange(slots), idx[idx > 0])] = np.nan
    args = dict(
        q=jnp.asarray(rng.standard_normal((n, d, h, kd)), dtype),
        k=jnp.asarray(rng.standard_normal((n, d, h, kd)), dtype),
        v=jnp.asarray(rng.standard_normal((n, d, hv, vd)), dtype),
        g=jnp.asarray(-np.log1p(np.exp(rng.standard_normal((n, d, hv)))), jnp.float32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((n, d, hv)))), jnp.float32),
        ssm_pool=jnp.asarray(pool),
        state_indices=jnp.asarray(idx),
    )
    return args, idx


def _oracle(args):
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(x, np.float64)) if name != "state_indices" else x
            for name, x in args.items()
        }
        out = gdn_reference.fused_recurrent_gated_delta_rule(**wide)
        return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("name", list(_CASES))
@pytest.mark.parametrize(
    "dtype, kd, d, tol",
    [(jnp.bfloat16, 64, 1, 1e-2), (jnp.float32, 128, 2, 1e-5)],
    ids=["bf16-K64-D1", "f32-K128-D2"],
)
def test_variant_matches_oracle_and_writes_only_named_slots(name, dtype, kd, d, tol):
    args, idx = _case(0, n=5, d=d, kd=kd, vd=64, slots=11, dtype=dtype, padded=[2])
    fn = functools.partial(
        variants.fused_recurrent_gated_delta_rule, variant=_CASES[name], interpret=True
    )
    o, pool = jax.jit(fn)(**args)
    o_ref, pool_ref = _oracle(args)
    real = idx != 0
    assert np.isfinite(np.asarray(o, np.float32)).all(), "an output was never written (NaN)"
    assert rel(o[real], o_ref[real]) < tol
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"
    named = idx[real]
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(pool.shape[0]), named)  # slot 0 included: never touched
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))


# Qwen3.5's value/key head ratios: 1 (0.8B, 2B), 3 (27B), 4 (122B, 397B); 2 is every case above.
@pytest.mark.parametrize(("h", "hv"), [(2, 2), (1, 3), (1, 4)], ids=["ratio1", "ratio3", "ratio4"])
def test_default_variant_takes_every_value_key_head_ratio(h, hv):
    args, idx = _case(
        7, n=3, d=2, kd=64, vd=64, slots=7, dtype=jnp.bfloat16, padded=[1], h=h, hv=hv
    )
    fn = functools.partial(
        variants.fused_recurrent_gated_delta_rule, variant=variants.VARIANTS[variants.DEFAULT],
        interpret=True,
    )  # fmt: skip
    o, pool = jax.jit(fn)(**args)
    o_ref, pool_ref = _oracle(args)
    real = idx != 0
    assert rel(o[real], o_ref[real]) < 1e-2
    assert rel(pool[idx[real]], pool_ref[idx[real]]) < 1e-5


def test_public_decode_op_runs_the_default_variant():
    from pallas_kernels import gdn

    args, idx = _case(4, n=3, d=1, kd=64, vd=64, slots=7, dtype=jnp.bfloat16, padded=[0])
    public = jax.jit(functools.partial(gdn.fused_recurrent_gated_delta_rule, impl="interpret"))
    kernel = jax.jit(
        functools.partial(
            variants.fused_recurrent_gated_delta_rule,
            variant=variants.DEFAULT,
            interpret=True,
            scale=64**-0.5,
        )
    )
    for got, want in zip(public(**args), kernel(**args), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_pick_block_v_narrows_only_small_grids():
    assert variants.pick_block_v(256, 32, 128) == 64
    assert variants.pick_block_v(1, 32, 128) == 16
    assert variants.pick_block_v(4, 32, 128) == 32


def test_ring_stages_of_narrow_tiles_start_on_tma_aligned_addresses():
    """A stage of the pipelined kernel's value/output ring holds whole 128-byte TMA boxes:
    one bf16 token of 16 columns is 32 bytes, and an unpadded ring's second stage faulted on
    the H200 (CUDA_ERROR_MISALIGNED_ADDRESS at batch 1 with 48 value heads)."""
    for bv in (16, 32, 64):
        for dtype in (jnp.bfloat16, jnp.float32):
            row = bv * jnp.dtype(dtype).itemsize
            for n_tokens in range(1, variants.MAX_TOKENS + 1):
                rows = grids._stage_rows(n_tokens, bv, dtype)
                assert rows * row % 128 == 0 and n_tokens <= rows < n_tokens + max(1, 128 // row)


def test_unknown_variant_is_named_in_the_error():
    args, _ = _case(1, n=2, d=1, kd=64, vd=64, slots=4, dtype=jnp.float32, padded=[])
    with pytest.raises(ValueError, match="'nope' is not one of"):
        variants.fused_recurrent_gated_delta_rule(**args, variant="nope", interpret=True)


@pytest.mark.parametrize("name", ["cols", "pipe3-wgmma", "pipe3-cols-3programs"])
def test_fused_gating_matches_gating_then_oracle(name):
    args, idx = _case(2, n=5, d=2, kd=64, vd=64, slots=9, dtype=jnp.bfloat16, padded=[1])
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((5, 2, 2)) * 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((5, 2, 2)) * 2, jnp.bfloat16)
    a_log = rng.standard_normal(2).astype(np.float32)
    dt_bias = rng.standard_normal(2).astype(np.float32)
    rest = {key: x for key, x in args.items() if key not in ("g", "beta")}
    fn = functools.partial(
        variants.fused_gating_recurrent_gated_delta_rule, variant=_CASES[name], interpret=True
    )
    o, pool = jax.jit(fn)(A_log=jnp.asarray(a_log), a=a, dt_bias=jnp.asarray(dt_bias), b=b, **rest)
    x = np.asarray(a, np.float64) + dt_bias
    args["g"] = -np.exp(a_log.astype(np.float64)) * np.logaddexp(0.0, x)
    args["beta"] = 1 / (1 + np.exp(-np.asarray(b, np.float64)))
    o_ref, pool_ref = _oracle(args)
    real = idx != 0
    assert rel(o[real], o_ref[real]) < 1e-2
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"
    named = idx[real]
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(pool.shape[0]), named)
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))


def _production_gating(n):
    args = _production(n)
    hv = args["v"].shape[2]
    del args["g"], args["beta"]
    return dict(
        args,
        A_log=jax.ShapeDtypeStruct((hv,), jnp.float32),
        a=jax.ShapeDtypeStruct((n, 1, hv), jnp.bfloat16),
        dt_bias=jax.ShapeDtypeStruct((hv,), jnp.float32),
        b=jax.ShapeDtypeStruct((n, 1, hv), jnp.bfloat16),
    )


@pytest.mark.parametrize("name", ["cols", variants.DEFAULT])
def test_fused_gating_lowers_for_cuda_with_the_pool_aliased(name):
    fn = functools.partial(variants.fused_gating_recurrent_gated_delta_rule, variant=name)
    traced = jax.jit(fn, donate_argnames=("ssm_pool",)).trace(**_production_gating(32))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(r"tensor<64x32x128x128xf32> {tf.aliasing_output = 1 ", main)


def test_fused_gating_names_a_misshaped_head_parameter():
    args = _production_gating(4)
    args["dt_bias"] = jax.ShapeDtypeStruct((16,), jnp.float32)
    with pytest.raises(ValueError, match=r"dt_bias.shape=\(16,\) must be \[HV\]=\(32,\)"):
        variants.fused_gating_recurrent_gated_delta_rule(**args)


def _production(n, d=1, dtype=jnp.bfloat16):
    h, hv, kd = 16, 32, 128
    f32 = jnp.float32
    return dict(
        q=jax.ShapeDtypeStruct((n, d, h, kd), dtype),
        k=jax.ShapeDtypeStruct((n, d, h, kd), dtype),
        v=jax.ShapeDtypeStruct((n, d, hv, kd), dtype),
        g=jax.ShapeDtypeStruct((n, d, hv), f32),
        beta=jax.ShapeDtypeStruct((n, d, hv), f32),
        ssm_pool=jax.ShapeDtypeStruct((64, hv, kd, kd), f32),
        state_indices=jax.ShapeDtypeStruct((n,), jnp.int32),
    )


@pytest.mark.parametrize("n", [1, 256])
@pytest.mark.parametrize("name", list(variants.VARIANTS))
def test_variant_lowers_for_cuda_with_the_pool_aliased(name, n):
    fn = functools.partial(variants.fused_recurrent_gated_delta_rule, variant=name)
    traced = jax.jit(fn, donate_argnames=("ssm_pool",)).trace(**_production(n))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(r"tensor<64x32x128x128xf32> {tf.aliasing_output = 1 ", main)


def test_default_variant_lowers_for_cuda_at_the_largest_rows_it_accepts():
    # MAX_TOKENS float32 tokens: the most SMEM a ring stage of the default variant holds.
    args = _production(8, d=variants.MAX_TOKENS, dtype=jnp.float32)
    assert variants.unsupported_reason(**args) is None
    fn = functools.partial(variants.fused_recurrent_gated_delta_rule, variant=variants.DEFAULT)
    jax.jit(fn, donate_argnames=("ssm_pool",)).trace(**args).lower(lowering_platforms=("cuda",))


def test_unsupported_reason_accepts_production_shapes():
    assert variants.unsupported_reason(**_production(256)) is None
    assert variants.unsupported_reason(**_production(1)) is None


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(kd=96), "head dims"),
        (dict(d=variants.MAX_TOKENS + 1), "tokens per row"),
        (dict(dtype=jnp.float16), "bfloat16 or float32"),
        (dict(gate_dtype=jnp.bfloat16), "must be float32 [N, D, HV]"),
        (dict(pool_dtype=jnp.bfloat16), "ssm_pool"),
        (dict(hv=24), "multiple of H"),
    ],
    ids=["K96", "D17", "f16", "bf16-gates", "bf16-pool", "HV24"],
)
def test_unsupported_reason_names_the_rule_and_the_kernel_refuses(change, words):
    n, d, kd, hv = 4, change.get("d", 1), change.get("kd", 128), change.get("hv", 32)
    dtype, gate_dtype = change.get("dtype", jnp.bfloat16), change.get("gate_dtype", jnp.float32)
    args = dict(
        q=jnp.ones((n, d, 16, kd), dtype),
        k=jnp.ones((n, d, 16, kd), dtype),
        v=jnp.ones((n, d, hv, kd), dtype),
        g=jnp.ones((n, d, hv), gate_dtype),
        beta=jnp.ones((n, d, hv), gate_dtype),
        ssm_pool=jnp.ones((4, hv, kd, kd), change.get("pool_dtype", jnp.float32)),
        state_indices=jnp.ones((n,), jnp.int32),
    )
    reason = variants.unsupported_reason(**args)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match=re.escape(words)):
        variants.fused_recurrent_gated_delta_rule(**args, interpret=True)


@pytest.mark.parametrize(
    "tokens, dtype, stages", [(1, jnp.bfloat16, 3), (16, jnp.float32, 2)], ids=["D1", "D16-f32"]
)
def test_the_output_norm_s_items_are_whole_heads_in_a_ring_that_fits(tokens, dtype, stages):
    """Qwen3.5's heads: a whole head's state is 64 KiB a stage, so three stages fit one
    program's SMEM at one bf16 token and two at 16 float32 tokens; one program fits an SM,
    so the persistent grid launches one per SM."""
    heads = grids.Heads(16, 128, 32, 128)
    variant = grids.normed_variant(variants.VARIANTS[variants.DEFAULT], tokens, heads, dtype)
    assert (variant.block_v, variant.stages) == (128, stages)
    assert variant.programs == variants.NUM_SMS
