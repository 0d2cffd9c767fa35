"""The Mosaic GPU verify kernel of Gated DeltaNet against the float64 oracle (decode:
``test_gdn_decode_mgpu.py``).

The kernel runs twice here: under the Mosaic GPU CPU interpreter (values; its fresh buffers
start as NaN, so an unwritten output shows) and through the Pallas -> Mosaic GPU lowering for
``cuda`` (layouts and TMA shapes, which the interpreter does not check).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels.gdn import recurrent_mgpu
from pallas_kernels.gdn import reference as gdn_reference


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
    assert rel(o[real], o_ref[real]) < tol
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"


@pytest.mark.parametrize(
    "config",
    [recurrent_mgpu.RecurrentConfig(64, 0), recurrent_mgpu.RecurrentConfig(32, 128)],
    ids=["bv64", "bv32-swizzle128"],
)
def test_verify_tilings_agree_with_oracle(config):
    args, idx = _case(5, n=3, d=2, h=1, hv=1, kd=64, vd=64, slots=5, dtype=jnp.float32, padded=[1])
    o, inter = jax.jit(
        functools.partial(recurrent_mgpu.verify_gated_delta_rule, config=config, interpret=True)
    )(**args)
    o_ref, inter_ref = _oracle(gdn_reference.verify_gated_delta_rule, args)
    _check_rows(o, o_ref, idx, 1e-5)
    real = idx != 0
    assert rel(inter[real], inter_ref[real]) < 1e-5


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
        assert rel(inter[real, t], inter_ref[real, t]) < 1e-5, f"state after token {t}"
    assert not np.asarray(inter)[~real].any(), "padded rows' intermediates must be zeros"
    np.testing.assert_array_equal(bits(args["ssm_pool"]), bits(before))


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


def _lower_for_cuda(fn, args):
    traced = jax.jit(fn).trace(**args)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n, d, dtype", [(16, 4, jnp.bfloat16), (64, 4, jnp.float32)], ids=str)
def test_verify_lowers_for_cuda(n, d, dtype):
    _lower_for_cuda(recurrent_mgpu.verify_gated_delta_rule, _production(n, d, dtype=dtype))


def test_unsupported_reason_accepts_production_shapes():
    args = _production(256, 4)
    assert recurrent_mgpu.unsupported_reason(**args) is None
    assert recurrent_mgpu.unsupported_reason(**_production(64, 4)) is None
    assert recurrent_mgpu.unsupported_reason(**_production(16, 16)) is None


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
def test_unsupported_reason_names_the_rule_and_verify_refuses(change, words):
    n, d, kd, hv = 4, change.get("d", 1), change.get("kd", 128), change.get("hv", 32)
    dtype = change.get("dtype", jnp.bfloat16)
    args = dict(
        q=jnp.ones((n, d, 16, kd), dtype),
        k=jnp.ones((n, d, 16, kd), dtype),
        v=jnp.ones((n, d, hv, kd), dtype),
        g=jnp.ones((n, d, hv), jnp.float32),
        beta=jnp.ones((n, d, hv), jnp.float32),
        ssm_pool=jnp.ones((4, hv, kd, kd), change.get("pool_dtype", jnp.float32)),
        state_indices=jnp.ones((n,), jnp.int32),
    )
    reason = recurrent_mgpu.unsupported_reason(**args)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match=words):
        recurrent_mgpu.verify_gated_delta_rule(**args, interpret=True)


def test_unsupported_reason_refuses_parents_that_are_not_int32_rows_by_tokens():
    args = {name: jnp.ones(x.shape, x.dtype) for name, x in _production(2, 3, kd=64).items()}
    for parents in (jnp.zeros((2, 3), jnp.float32), jnp.zeros((2, 4), jnp.int32)):
        reason = recurrent_mgpu.unsupported_reason(**args, parents=parents)
        assert reason is not None and "parents" in reason and "[2, 3]" in reason
    assert recurrent_mgpu.unsupported_reason(**args, parents=jnp.zeros((2, 3), jnp.int32)) is None
