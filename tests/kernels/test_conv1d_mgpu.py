"""The Mosaic GPU conv1d kernels (update/verify, varlen prefill) against the float64 oracle.

Each kernel runs under the Mosaic GPU CPU interpreter (values; fresh buffers start as NaN, so
an unwritten output shows) and through the Pallas -> Mosaic GPU lowering for ``cuda``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels.conv1d import prefill_mgpu, update_mgpu
from pallas_kernels.conv1d import reference as conv_reference


def _case(seed, *, n, d, c, width, slots, dtype, padded, bias=True):
    """Fresh random inputs; rows in ``padded`` use slot 0, the others distinct random slots.
    Slot 0 and every slot no row names hold NaN: reading a wrong slot shows."""
    rng = np.random.default_rng(seed)
    real = rng.permutation(np.arange(1, slots))[:n]
    idx = np.where(np.isin(np.arange(n), padded), 0, real).astype(np.int32)
    pool = rng.standard_normal((slots, c, width - 1)).astype(np.float32)
    pool[np.setdiff1d(np.arange(slots), idx[idx > 0])] = np.nan
    args = dict(
        x=jnp.asarray(rng.standard_normal((n, d, c)), dtype),
        weight=jnp.asarray(rng.standard_normal((c, width)) * 0.5, dtype),
        bias=jnp.asarray(rng.standard_normal(c), dtype) if bias else None,
        conv_pool=jnp.asarray(pool, dtype),
        state_indices=jnp.asarray(idx),
    )
    return args, idx


def _oracle(fn, args, activation):
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(np.asarray(x, np.float64))
            if x is not None and jnp.issubdtype(x.dtype, jnp.floating)
            else x
            for name, x in args.items()
        }
        out = fn(**wide, activation=activation)
        return jax.tree.map(np.asarray, out)


def _check_rows(y, y_ref, idx, tol):
    real = idx != 0
    assert np.isfinite(np.asarray(y, np.float32)).all(), "an output was never written (NaN)"
    assert rel(y[real], y_ref[real]) < tol
    assert not np.asarray(y, np.float32)[~real].any(), "padded rows must give zeros"


@pytest.mark.parametrize(
    "dtype, d, width, bias, activation, tol",
    [
        (jnp.bfloat16, 1, 4, True, "silu", 1e-2),
        (jnp.float32, 3, 3, False, None, 1e-6),
    ],
    ids=["bf16-D1-W4-silu", "f32-D3-W3-nobias"],
)
@pytest.mark.parametrize("rows_per_program", [1, 3], ids=["row-a-program", "3-rows-a-program"])
def test_update_matches_oracle_and_moves_only_named_windows(
    dtype, d, width, bias, activation, tol, rows_per_program
):
    """With 3 rows a program the second program's last two rows lie past the call's 4."""
    args, idx = _case(0, n=4, d=d, c=256, width=width, slots=7, dtype=dtype, padded=[1], bias=bias)
    y, pool = jax.jit(
        functools.partial(
            update_mgpu.causal_conv1d_update,
            activation=activation,
            interpret=True,
            rows_per_program=rows_per_program,
        )  # fmt: skip
    )(**args)
    y_ref, pool_ref = _oracle(conv_reference.causal_conv1d_update, args, activation)
    _check_rows(y, y_ref, idx, tol)
    named = idx[idx != 0]
    # Windows hold raw inputs: they move exactly, in any dtype.
    np.testing.assert_array_equal(bits(pool[named]), bits(pool_ref[named].astype(dtype)))
    others = np.setdiff1d(np.arange(pool.shape[0]), named)  # slot 0 included: never touched
    np.testing.assert_array_equal(bits(pool[others]), bits(args["conv_pool"][others]))


@pytest.mark.parametrize("rows_per_program", [1, 2], ids=["row-a-program", "2-rows-a-program"])
def test_verify_returns_window_after_every_token_and_leaves_pool_untouched(rows_per_program):
    args, idx = _case(1, n=3, d=4, c=128, width=4, slots=6, dtype=jnp.bfloat16, padded=[2])
    before = bits(args["conv_pool"]).copy()
    verify = functools.partial(
        update_mgpu.causal_conv1d_verify, interpret=True, rows_per_program=rows_per_program
    )
    y, windows = jax.jit(verify)(**args)
    y_ref, windows_ref = _oracle(conv_reference.causal_conv1d_verify, args, "silu")
    _check_rows(y, y_ref, idx, 1e-2)
    real = idx != 0
    assert windows.shape == (3, 4, 128, 3) and windows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(windows[real]), bits(windows_ref[real].astype(jnp.bfloat16)))
    assert not np.asarray(windows, np.float32)[~real].any(), "padded rows' windows must be zeros"
    np.testing.assert_array_equal(bits(args["conv_pool"]), before)


def _production(n, d, c=8192, width=4, dtype=jnp.bfloat16, bias=True):
    return dict(
        x=jax.ShapeDtypeStruct((n, d, c), dtype),
        weight=jax.ShapeDtypeStruct((c, width), dtype),
        bias=jax.ShapeDtypeStruct((c,), dtype) if bias else None,
        conv_pool=jax.ShapeDtypeStruct((64, c, width - 1), dtype),
        state_indices=jax.ShapeDtypeStruct((n,), jnp.int32),
    )


@pytest.mark.parametrize(
    "n, d, bias, rows_per_program",
    [(1, 1, True, 1), (256, 1, False, 1), (256, 1, True, 8), (16, 4, True, 2)],
    ids=str,
)
def test_update_lowers_for_cuda_with_the_pool_aliased(n, d, bias, rows_per_program):
    args = _production(n, d, bias=bias)
    update = functools.partial(update_mgpu.causal_conv1d_update, rows_per_program=rows_per_program)
    text = (
        jax.jit(update, donate_argnames=("conv_pool",))
        .trace(**args)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(r"tensor<64x8192x3xbf16> \{tf.aliasing_output = 1 ", main)


@pytest.mark.parametrize("n, d, dtype", [(16, 4, jnp.bfloat16), (64, 2, jnp.float32)], ids=str)
def test_verify_lowers_for_cuda(n, d, dtype):
    jax.jit(update_mgpu.causal_conv1d_verify).trace(**_production(n, d, dtype=dtype)).lower(
        lowering_platforms=("cuda",)
    )


def test_unsupported_reason_accepts_production_shapes():
    assert update_mgpu.unsupported_reason(**_production(256, 1)) is None
    assert update_mgpu.unsupported_reason(**_production(16, 4, bias=False)) is None


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(c=200), "multiple of 128"),
        (dict(d=update_mgpu.MAX_TOKENS + 1), "tokens per row"),
        (dict(dtype=jnp.float16), "bfloat16 or float32"),
        (dict(pool_dtype=jnp.float32), "conv_pool"),
        (dict(activation="gelu"), "activation"),
    ],
    ids=["C200", "D17", "f16", "f32-pool", "gelu"],
)
def test_unsupported_reason_names_the_rule(change, words):
    n, d, c, dtype = 2, change.get("d", 1), change.get("c", 256), change.get("dtype", jnp.bfloat16)
    args = dict(
        x=jnp.ones((n, d, c), dtype),
        weight=jnp.ones((c, 4), dtype),
        bias=None,
        conv_pool=jnp.ones((3, c, 3), change.get("pool_dtype", dtype)),
        state_indices=jnp.ones((n,), jnp.int32),
    )
    activation = change.get("activation", "silu")
    reason = update_mgpu.unsupported_reason(**args, activation=activation)
    assert reason is not None and words in reason
    with pytest.raises(ValueError, match=words):
        update_mgpu.causal_conv1d_update(**args, activation=activation, interpret=True)


def test_rows_a_program_below_one_is_refused_by_name():
    args, _ = _case(2, n=2, d=1, c=128, width=4, slots=4, dtype=jnp.bfloat16, padded=[])
    for op in (update_mgpu.causal_conv1d_update, update_mgpu.causal_conv1d_verify):
        with pytest.raises(ValueError, match=r"rows_per_program=0 must be at least 1"):
            op(**args, interpret=True, rows_per_program=0)


def _varlen_case(seed, lengths, *, c, width, slots, dtype, has_init, extra_tokens):
    """Packed sequences of the given lengths (0 = empty, slot 0) and ``extra_tokens`` of
    padding after them. Slots without an initial state, slot 0 and unnamed slots hold NaN."""
    rng = np.random.default_rng(seed)
    n = len(lengths)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = rng.permutation(np.arange(1, slots))[:n].astype(np.int32)
    idx[np.asarray(lengths) == 0] = 0
    pool = rng.standard_normal((slots, c, width - 1)).astype(np.float32)
    keep = idx[(idx > 0) & np.asarray(has_init)]
    pool[np.setdiff1d(np.arange(slots), keep)] = np.nan
    args = dict(
        x=jnp.asarray(rng.standard_normal((int(qsl[-1]) + extra_tokens, c)), dtype),
        weight=jnp.asarray(rng.standard_normal((c, width)) * 0.5, dtype),
        bias=jnp.asarray(rng.standard_normal(c), dtype),
        conv_pool=jnp.asarray(pool, dtype),
        qsl=jnp.asarray(qsl),
        state_indices=jnp.asarray(idx),
        has_initial_state=jnp.asarray(has_init),
    )
    return args, idx, qsl


def test_prefill_matches_oracle_across_sequence_and_block_edges():
    # BLOCK_T = 16: sequence 0 (14 tokens) ends inside block 0, sequence 2 starts at 15 and
    # its first taps (old window) are read in block 0 while its last token, which writes the
    # new window, is in block 1. Lengths 1 and 2 are shorter than the window (W-1 = 3); the
    # empty sequence must leave its slot alone; 5 padding tokens must come out as zeros.
    lengths = [14, 0, 4, 1, 2, 20]
    has_init = [True, False, True, False, True, False]
    args, idx, qsl = _varlen_case(
        6, lengths, c=128, width=4, slots=9, dtype=jnp.float32, has_init=has_init,
        extra_tokens=5,
    )  # fmt: skip
    y, pool = jax.jit(functools.partial(prefill_mgpu.causal_conv1d, interpret=True))(**args)
    y_ref, pool_ref = _oracle(conv_reference.causal_conv1d_recurrent, args, "silu")
    n_real = qsl[-1]
    assert np.isfinite(np.asarray(y)).all(), "an output was never written (NaN)"
    assert rel(y[:n_real], y_ref[:n_real]) < 1e-6
    assert not np.asarray(y)[n_real:].any(), "padding tokens must give zeros"
    written = idx[np.asarray(lengths) > 0]
    np.testing.assert_array_equal(bits(pool[written]), bits(pool_ref[written].astype(np.float32)))
    others = np.setdiff1d(np.arange(pool.shape[0]), written)
    np.testing.assert_array_equal(bits(pool[others]), bits(args["conv_pool"][others]))


def test_prefill_bf16_without_bias_matches_oracle():
    args, idx, qsl = _varlen_case(
        7, [3, 17], c=256, width=3, slots=4, dtype=jnp.bfloat16, has_init=[True, True],
        extra_tokens=0,
    )  # fmt: skip
    args["bias"] = None
    y, pool = jax.jit(
        functools.partial(prefill_mgpu.causal_conv1d, activation=None, interpret=True)
    )(**args)
    y_ref, pool_ref = _oracle(conv_reference.causal_conv1d_recurrent, args, None)
    assert rel(y, y_ref) < 1e-2
    np.testing.assert_array_equal(bits(pool[idx]), bits(pool_ref[idx].astype(jnp.bfloat16)))


def test_prefill_lowers_for_cuda_with_the_pool_aliased():
    n_seq, t_total = 8, 8192
    args = dict(
        x=jax.ShapeDtypeStruct((t_total, 8192), jnp.bfloat16),
        weight=jax.ShapeDtypeStruct((8192, 4), jnp.bfloat16),
        bias=jax.ShapeDtypeStruct((8192,), jnp.bfloat16),
        conv_pool=jax.ShapeDtypeStruct((64, 8192, 3), jnp.bfloat16),
        qsl=jax.ShapeDtypeStruct((n_seq + 1,), jnp.int32),
        state_indices=jax.ShapeDtypeStruct((n_seq,), jnp.int32),
        has_initial_state=jax.ShapeDtypeStruct((n_seq,), jnp.bool_),
    )
    text = (
        jax.jit(prefill_mgpu.causal_conv1d, donate_argnames=("conv_pool",))
        .trace(**args)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert re.search(r"tensor<64x8192x3xbf16> \{tf.aliasing_output = 1 ", main)
    assert prefill_mgpu.unsupported_reason(**args) is None


def test_prefill_unsupported_reason_names_the_rule():
    args = dict(
        x=jnp.ones((32, 128), jnp.bfloat16),
        weight=jnp.ones((128, 4), jnp.bfloat16),
        bias=None,
        conv_pool=jnp.ones((3, 128, 3), jnp.bfloat16),
        qsl=jnp.asarray([0, 32], jnp.int32),
        state_indices=jnp.asarray([1], jnp.int32),
        has_initial_state=jnp.asarray([1], jnp.int32),
    )
    reason = prefill_mgpu.unsupported_reason(**args)
    assert reason is not None and "has_initial_state" in reason
    with pytest.raises(ValueError, match="has_initial_state"):
        prefill_mgpu.causal_conv1d(**args, interpret=True)
