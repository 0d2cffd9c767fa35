"""The Mosaic GPU decode/verify kernels of Gated DeltaNet against the float64 oracle.

Each kernel runs twice here: under the Mosaic GPU CPU interpreter (values; its fresh buffers
start as NaN, so an unwritten output shows) and through the Pallas -> Mosaic GPU lowering for
``cuda`` (layouts and TMA shapes, which the interpreter does not check).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import recurrent_mgpu
from pallas_kernels.gdn import reference as gdn_reference


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def _case(seed, *, n, d, h, hv, kd, vd, slots, dtype, padded):
    """Fresh random inputs; rows listed in ``padded`` use slot 0, the others distinct random
    slots. The pool is random, and NaN in slot 0 and in every slot no row names: a kernel that
    reads a wrong slot shows NaN."""
    rng = np.random.default_rng(seed)
    real = rng.permutation(np.arange(1, slots))[:n]
    idx = np.where(np.isin(np.arange(n), padded), 0, real).astype(np.int32)
    pool = rng.standard_normal((slots, hv, kd, vd)).astype(np.float32) * 0.3
    unnamed = np.setdiff1d(np.arange(slots), idx[idx > 0])
    pool[unnamed] = np.nan
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


def _oracle(fn, args):
    """The reference op on float64 copies of the inputs (token by token)."""
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(x, np.float64)) if name != "state_indices" else x
            for name, x in args.items()
        }
        return jax.tree.map(np.asarray, fn(**wide))


def _check_rows(o, o_ref, idx, tol):
    real = idx != 0
    assert np.isfinite(np.asarray(o, np.float32)).all(), "an output was never written (NaN)"
    assert _rel(o[real], o_ref[real]) < tol
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"


@pytest.mark.parametrize(
    "dtype, kd, vd, d, tol",
    [(jnp.bfloat16, 64, 64, 1, 1e-2), (jnp.float32, 128, 64, 2, 1e-5)],
    ids=["bf16-K64-D1", "f32-K128-D2"],
)
def test_decode_matches_oracle_and_writes_only_named_slots(dtype, kd, vd, d, tol):
    args, idx = _case(0, n=4, d=d, h=1, hv=2, kd=kd, vd=vd, slots=9, dtype=dtype, padded=[2])
    o, pool = jax.jit(
        functools.partial(recurrent_mgpu.fused_recurrent_gated_delta_rule, interpret=True)
    )(**args)
    o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
    _check_rows(o, o_ref, idx, tol)
    named = idx[idx != 0]
    assert _rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(pool.shape[0]), named)  # slot 0 included: never touched
    np.testing.assert_array_equal(_bits(pool[others]), _bits(args["ssm_pool"][others]))


@pytest.mark.parametrize(
    "config",
    [recurrent_mgpu.RecurrentConfig(64, 0), recurrent_mgpu.RecurrentConfig(32, 128)],
    ids=["bv64", "bv32-swizzle128"],
)
def test_decode_tilings_agree_with_oracle(config):
    args, idx = _case(5, n=2, d=2, h=1, hv=1, kd=64, vd=64, slots=5, dtype=jnp.float32, padded=[])
    o, pool = jax.jit(
        functools.partial(
            recurrent_mgpu.fused_recurrent_gated_delta_rule, config=config, interpret=True
        )
    )(**args)
    o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
    _check_rows(o, o_ref, idx, 1e-5)
    assert _rel(pool[idx], pool_ref[idx]) < 1e-5


def test_verify_returns_state_after_every_token_and_leaves_pool_untouched():
    args, idx = _case(1, n=3, d=3, h=1, hv=2, kd=64, vd=64, slots=7, dtype=jnp.bfloat16, padded=[0])
    before = np.asarray(args["ssm_pool"]).copy()
    o, inter = jax.jit(functools.partial(recurrent_mgpu.verify_gated_delta_rule, interpret=True))(
        **args
    )
    o_ref, inter_ref = _oracle(gdn_reference.verify_gated_delta_rule, args)
    _check_rows(o, o_ref, idx, 1e-2)
    real = idx != 0
    assert inter.shape == (3, 3, 2, 64, 64) and inter.dtype == jnp.float32
    for t in range(3):
        assert _rel(inter[real, t], inter_ref[real, t]) < 1e-5, f"state after token {t}"
    assert not np.asarray(inter)[~real].any(), "padded rows' intermediates must be zeros"
    np.testing.assert_array_equal(_bits(args["ssm_pool"]), _bits(before))


def test_fused_gating_matches_gating_then_decode():
    args, idx = _case(2, n=3, d=1, h=1, hv=2, kd=64, vd=64, slots=6, dtype=jnp.bfloat16, padded=[1])
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 1, 2)).astype(np.float32) * 2
    b = rng.standard_normal((3, 1, 2)).astype(np.float32) * 2
    a_log = rng.standard_normal(2).astype(np.float32)
    dt_bias = rng.standard_normal(2).astype(np.float32)
    gate_args = {k: v for k, v in args.items() if k not in ("g", "beta")}
    o, pool = jax.jit(
        functools.partial(recurrent_mgpu.fused_gating_recurrent_gated_delta_rule, interpret=True)
    )(
        A_log=jnp.asarray(a_log),
        a=jnp.asarray(a, jnp.bfloat16),
        dt_bias=jnp.asarray(dt_bias),
        b=jnp.asarray(b, jnp.bfloat16),
        **gate_args,
    )
    x = np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) + dt_bias
    args["g"] = -np.exp(a_log.astype(np.float64)) * np.logaddexp(0.0, x)
    args["beta"] = 1 / (1 + np.exp(-np.asarray(jnp.asarray(b, jnp.bfloat16), np.float64)))
    o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
    _check_rows(o, o_ref, idx, 1e-2)
    named = idx[idx != 0]
    assert _rel(pool[named], pool_ref[named]) < 1e-5


def _production(n, d, kd=128, dtype=jnp.bfloat16):
    h, hv = 16, 32
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


def _lower_for_cuda(fn, args, donate=()):
    traced = jax.jit(fn, donate_argnames=donate).trace(**args)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "n, d, kd", [(1, 1, 128), (256, 1, 128), (16, 1, 64), (8, 2, 128)], ids=str
)
def test_decode_lowers_for_cuda_with_the_pool_aliased(n, d, kd):
    text = _lower_for_cuda(
        recurrent_mgpu.fused_recurrent_gated_delta_rule, _production(n, d, kd), ("ssm_pool",)
    )
    # The donated pool is the kernel's aliased output (result 1): no copy of the pool.
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(rf"tensor<64x32x{kd}x{kd}xf32> {{tf.aliasing_output = 1 ", main)


@pytest.mark.parametrize("n, d, dtype", [(16, 4, jnp.bfloat16), (64, 4, jnp.float32)], ids=str)
def test_verify_lowers_for_cuda(n, d, dtype):
    _lower_for_cuda(recurrent_mgpu.verify_gated_delta_rule, _production(n, d, dtype=dtype))


def test_fused_gating_lowers_for_cuda():
    args = _production(32, 1)
    hv = args["v"].shape[2]
    del args["g"], args["beta"]
    args.update(
        A_log=jax.ShapeDtypeStruct((hv,), jnp.float32),
        a=jax.ShapeDtypeStruct((32, 1, hv), jnp.bfloat16),
        dt_bias=jax.ShapeDtypeStruct((hv,), jnp.float32),
        b=jax.ShapeDtypeStruct((32, 1, hv), jnp.bfloat16),
    )
    _lower_for_cuda(recurrent_mgpu.fused_gating_recurrent_gated_delta_rule, args)


def test_unsupported_reason_accepts_production_shapes():
    args = _production(256, 1)
    assert recurrent_mgpu.unsupported_reason(**args) is None
    assert recurrent_mgpu.unsupported_reason(**_production(64, 4)) is None


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(kd=96), "head dims"),
        (dict(d=recurrent_mgpu.MAX_TOKENS + 1), "tokens per row"),
        (dict(dtype=jnp.float16), "bfloat16 or float32"),
        (dict(pool_dtype=jnp.bfloat16), "float32"),
        (dict(hv=24), "multiple of H"),
    ],
    ids=["K96", "D17", "f16", "bf16-pool", "HV24"],
)
def test_unsupported_reason_names_the_rule(change, words):
    n, d, kd, hv = 4, change.get("d", 1), change.get("kd", 128), change.get("hv", 32)
    dtype = change.get("dtype", jnp.bfloat16)
    args = dict(
        q=jnp.zeros((n, d, 16, kd), dtype),
        k=jnp.zeros((n, d, 16, kd), dtype),
        v=jnp.zeros((n, d, hv, kd), dtype),
        g=jnp.zeros((n, d, hv), jnp.float32),
        beta=jnp.zeros((n, d, hv), jnp.float32),
        ssm_pool=jnp.zeros((4, hv, kd, kd), change.get("pool_dtype", jnp.float32)),
        state_indices=jnp.zeros((n,), jnp.int32),
    )
    reason = recurrent_mgpu.unsupported_reason(**args)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match=words):
        recurrent_mgpu.fused_recurrent_gated_delta_rule(**args, interpret=True)
