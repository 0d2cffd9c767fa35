"""The Mosaic GPU decode/verify kernels of Mamba2 against the float64 oracle.

Each kernel runs twice here: under the Mosaic GPU CPU interpreter (values; its fresh buffers
start as NaN, so an unwritten output shows) and through the Pallas -> Mosaic GPU lowering for
``cuda`` (layouts and TMA shapes, which the interpreter does not check). None of this has run
on a GPU yet.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import mamba2
from pallas_kernels.mamba2 import reference as mamba2_reference
from pallas_kernels.mamba2 import state_update_mgpu


def _case(seed, *, n, d, h, g, p, nd, slots, dtype, padded, gate):
    """Fresh random inputs; rows listed in ``padded`` use slot 0, the others distinct random
    slots. The pool is random, and NaN in slot 0 and in every slot no row names: a kernel that
    reads a wrong slot shows NaN."""
    rng = np.random.default_rng(seed)
    real = rng.permutation(np.arange(1, slots))[:n]
    idx = np.where(np.isin(np.arange(n), padded), 0, real).astype(np.int32)
    pool = rng.standard_normal((slots, h, p, nd)).astype(np.float32)
    unnamed = np.setdiff1d(np.arange(slots), idx[idx > 0])
    pool[unnamed] = np.nan
    args = dict(
        x=jnp.asarray(rng.standard_normal((n, d, h, p)), dtype),
        dt=jnp.asarray(rng.standard_normal((n, d, h)), dtype),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 1.0, h)), jnp.float32),
        B=jnp.asarray(rng.standard_normal((n, d, g, nd)) / np.sqrt(nd), dtype),
        C=jnp.asarray(rng.standard_normal((n, d, g, nd)), dtype),
        D=jnp.asarray(rng.standard_normal(h), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(0.5, 1.5, h), jnp.float32),
        ssm_pool=jnp.asarray(pool),
        state_indices=jnp.asarray(idx),
    )
    if gate:
        args["z"] = jnp.asarray(rng.standard_normal((n, d, h, p)), dtype)
    return args, idx


def _oracle(fn, args, **options):
    """The reference op on float64 copies of the inputs (token by token)."""
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(v, np.float64)) if name != "state_indices" else v
            for name, v in args.items()
        }
        return jax.tree.map(np.asarray, fn(**wide, **options))


def _check_rows(y, y_ref, idx, tol):
    real = idx != 0
    assert np.isfinite(np.asarray(y, np.float32)).all(), "an output was never written (NaN)"
    assert rel(y[real], y_ref[real]) < tol
    assert not np.asarray(y, np.float32)[~real].any(), "padded rows must give zeros"


@pytest.mark.parametrize(
    "dtype, p, nd, d, gate, options, tol",
    [
        (jnp.bfloat16, 64, 128, 1, False, {}, 1e-2),
        (jnp.float32, 128, 64, 2, True, {"dt_min": 0.2, "dt_max": 0.9}, 1e-5),
    ],
    ids=["bf16-P64-N128-D1", "f32-P128-N64-D2-gated-limits"],
)
def test_decode_matches_oracle_and_writes_only_named_slots(dtype, p, nd, d, gate, options, tol):
    args, idx = _case(
        0, n=3, d=d, h=2, g=1, p=p, nd=nd, slots=8, dtype=dtype, padded=[1], gate=gate
    )
    y, pool = jax.jit(
        functools.partial(state_update_mgpu.selective_state_update, interpret=True, **options)
    )(**args)
    y_ref, pool_ref = _oracle(mamba2_reference.selective_state_update, args, **options)
    _check_rows(y, y_ref, idx, tol)
    named = idx[idx != 0]
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(pool.shape[0]), named)  # slot 0 included: never touched
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))


def test_verify_returns_state_after_every_token_and_leaves_pool_untouched():
    args, idx = _case(
        1, n=3, d=3, h=4, g=2, p=64, nd=64, slots=7, dtype=jnp.bfloat16, padded=[0], gate=True
    )
    before = np.asarray(args["ssm_pool"]).copy()
    y, inter = jax.jit(
        functools.partial(state_update_mgpu.verify_selective_state_update, interpret=True)
    )(**args)
    y_ref, inter_ref = _oracle(mamba2_reference.verify_selective_state_update, args)
    _check_rows(y, y_ref, idx, 1e-2)
    real = idx != 0
    assert inter.shape == (3, 3, 4, 64, 64) and inter.dtype == jnp.float32
    for t in range(3):
        assert rel(inter[real, t], inter_ref[real, t]) < 1e-5, f"state after token {t}"
    assert not np.asarray(inter)[~real].any(), "padded rows' intermediates must be zeros"
    np.testing.assert_array_equal(bits(args["ssm_pool"]), bits(before))


def test_public_op_runs_the_kernel_with_impl_interpret():
    args, idx = _case(
        2, n=2, d=1, h=2, g=2, p=64, nd=64, slots=5, dtype=jnp.float32, padded=[], gate=False
    )
    options = {"dt_softplus": False, "dt_max": 2.0}
    positional = [args[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "ssm_pool")]
    y, pool = mamba2.selective_state_update(
        *positional, args["state_indices"], **options, impl="interpret"
    )
    y_ref, pool_ref = _oracle(mamba2_reference.selective_state_update, args, **options)
    _check_rows(y, y_ref, idx, 1e-5)
    assert rel(pool[idx], pool_ref[idx]) < 1e-5


def _production(n, d, *, h=128, g=8, p=64, nd=128, dtype=jnp.bfloat16, gate=False):
    """Nemotron-H 8B-like shapes."""
    f32 = jnp.float32
    args = dict(
        x=jax.ShapeDtypeStruct((n, d, h, p), dtype),
        dt=jax.ShapeDtypeStruct((n, d, h), dtype),
        A=jax.ShapeDtypeStruct((h,), f32),
        B=jax.ShapeDtypeStruct((n, d, g, nd), dtype),
        C=jax.ShapeDtypeStruct((n, d, g, nd), dtype),
        D=jax.ShapeDtypeStruct((h,), f32),
        dt_bias=jax.ShapeDtypeStruct((h,), f32),
        ssm_pool=jax.ShapeDtypeStruct((64, h, p, nd), f32),
        state_indices=jax.ShapeDtypeStruct((n,), jnp.int32),
    )
    if gate:
        args["z"] = jax.ShapeDtypeStruct((n, d, h, p), dtype)
    return args


def _lower_for_cuda(fn, args, donate=()):
    traced = jax.jit(fn, donate_argnames=donate).trace(**args)
    return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "n, d, shape",
    [
        (256, 1, {}),
        (1, 1, {"h": 64, "g": 1}),
        (8, 2, {"p": 128, "nd": 64, "dtype": jnp.float32, "gate": True}),
    ],
    ids=["256-production", "1-H64-G1", "8-D2-P128-N64-f32-gated"],
)
def test_decode_lowers_for_cuda_with_the_pool_aliased(n, d, shape):
    args = _production(n, d, **shape)
    text = _lower_for_cuda(state_update_mgpu.selective_state_update, args, ("ssm_pool",))
    # The donated pool is the kernel's aliased output (result 1): no copy of the pool.
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    pool_type = "x".join(map(str, args["ssm_pool"].shape))
    assert re.search(rf"tensor<{pool_type}xf32> {{tf.aliasing_output = 1 ", main)


@pytest.mark.parametrize("n, d, dtype", [(16, 4, jnp.bfloat16), (64, 4, jnp.float32)], ids=str)
def test_verify_lowers_for_cuda(n, d, dtype):
    _lower_for_cuda(
        state_update_mgpu.verify_selective_state_update, _production(n, d, dtype=dtype, gate=True)
    )


def test_unsupported_reason_accepts_production_shapes():
    assert state_update_mgpu.unsupported_reason(**_production(256, 1)) is None
    assert state_update_mgpu.unsupported_reason(**_production(64, 4, gate=True)) is None


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(p=96), "head dims"),
        (dict(nd=256), "state sizes"),
        (dict(d=state_update_mgpu.MAX_TOKENS + 1), "tokens per row"),
        (dict(dtype=jnp.float16), "bfloat16 or float32"),
        (dict(g=4), "multiple of G"),
    ],
    ids=["P96", "N256", "D17", "f16", "G4"],
)
def test_unsupported_reason_names_the_rule(change, words):
    n, d = 4, change.get("d", 1)
    h, g, p, nd = 6, change.get("g", 2), change.get("p", 64), change.get("nd", 64)
    dtype = change.get("dtype", jnp.bfloat16)
    args = dict(
        x=jnp.ones((n, d, h, p), dtype),
        dt=jnp.ones((n, d, h), jnp.float32),
        A=-jnp.ones((h,), jnp.float32),
        B=jnp.ones((n, d, g, nd), dtype),
        C=jnp.ones((n, d, g, nd), dtype),
        D=jnp.ones((h,), jnp.float32),
        dt_bias=jnp.ones((h,), jnp.float32),
        ssm_pool=jnp.ones((4, h, p, nd), jnp.float32),
        state_indices=jnp.ones((n,), jnp.int32),
    )
    reason = state_update_mgpu.unsupported_reason(**args)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match=words):
        state_update_mgpu.selective_state_update(**args, interpret=True)
