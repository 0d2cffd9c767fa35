"""grouped_matmul: the reference against a float64 oracle, the choice of implementation, and
the errors for misshapen calls."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from pallas_kernels.moe.reference import grouped_matmul_oracle

# The module, not the function of the same name that the package re-exports.
gm_module = importlib.import_module("pallas_kernels.moe.grouped_matmul")


def _case(seed, rows=37, k=64, n=128, groups=5, padding=3):
    rng = np.random.default_rng(seed)
    sizes = np.zeros(groups, np.int32)
    sizes[[0, 2, 3, 4]] = rng.multinomial(rows - padding, np.ones(4) / 4)  # group 1 gets none
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((groups, k, n)).astype(np.float32) / np.sqrt(k)
    return x, w, sizes


@pytest.mark.parametrize("seed", range(3))
def test_reference_matches_the_float64_oracle_and_zeroes_padding_rows(seed):
    x, w, sizes = _case(seed)
    got = np.asarray(moe.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
    want = grouped_matmul_oracle(x, w, sizes)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    np.testing.assert_array_equal(got[sizes.sum() :], 0)


def test_auto_on_the_cpu_is_the_reference_bit_for_bit():
    x, w, sizes = (jnp.asarray(a) for a in _case(7))
    auto = moe.grouped_matmul(x, w, sizes)
    np.testing.assert_array_equal(auto, jax.lax.ragged_dot(x, w, sizes))


def test_pallas_without_a_usable_kernel_names_the_reason(monkeypatch):
    monkeypatch.setattr(gm_module, "_tokamax_ragged_dot", lambda: None)
    x, w, sizes = (jnp.asarray(a) for a in _case(1))
    with pytest.raises(NotImplementedError, match="tokamax is not installed"):
        moe.grouped_matmul(x, w, sizes, impl="pallas")
    with pytest.raises(NotImplementedError, match="grouped_matmul: impl='interpret'"):
        moe.grouped_matmul(x, w, sizes, impl="interpret")


def test_unsupported_reason_names_dtype_and_alignment(monkeypatch):
    monkeypatch.setattr(gm_module, "_tokamax_ragged_dot", lambda: object())
    x = jnp.zeros((8, 64), jnp.bfloat16)
    assert moe.unsupported_reason(x, jnp.zeros((2, 64, 128), jnp.bfloat16)) is None
    assert "16-bit float" in moe.unsupported_reason(x, jnp.zeros((2, 64, 128), jnp.float32))
    assert "multiples of 64" in moe.unsupported_reason(x, jnp.zeros((2, 64, 96), jnp.bfloat16))


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "sizes_shape", "match"),
    [
        ((8, 64), (2, 32, 16), (2,), "one K"),
        ((8, 64), (2, 64, 16), (3,), r"group_sizes must be int \[G=2\]"),
    ],
)
def test_misshapen_calls_raise_naming_the_shapes(x_shape, w_shape, sizes_shape, match):
    with pytest.raises(ValueError, match=match):
        moe.grouped_matmul(
            jnp.zeros(x_shape), jnp.zeros(w_shape), jnp.zeros(sizes_shape, jnp.int32)
        )
