"""``gdn.fused_gating_recurrent_gated_delta_rule``: decode with the Qwen3-Next gating inside,
and ``gdn.packed_gating_recurrent_gated_delta_rule``, the same op on the layer's ``[Q | K | V]``
conv output and ``[b | a]`` projection.

The op must equal ``gdn_gating`` followed by ``fused_recurrent_gated_delta_rule`` (float64
oracle; bits for the reference), choose its implementation like the other GDN ops, and reject
bad input with the checks of the ops it fuses. Kernels run under the Mosaic GPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import _common, gdn
from pallas_kernels.gdn import decode_mgpu
from pallas_kernels.gdn import reference as gdn_reference

H, HV = 1, 2
SLOTS = 9
_OP = "fused_gating_recurrent_gated_delta_rule"


def _case(seed, *, n=5, d=1, kd=64, dtype=jnp.bfloat16, padded=(1,), h=H):
    """Fresh random rows at distinct random slots (slot 0 on the ``padded`` rows); the pool is
    NaN in slot 0 and in every slot no row names, so a read of a wrong slot shows."""
    rng = np.random.default_rng(seed)
    real = rng.permutation(np.arange(1, SLOTS))[:n]
    idx = np.where(np.isin(np.arange(n), padded), 0, real).astype(np.int32)
    pool = rng.standard_normal((SLOTS, HV, kd, kd)).astype(np.float32) * 0.3
    pool[np.setdiff1d(np.arange(SLOTS), idx[idx > 0])] = np.nan
    args = dict(
        q=jnp.asarray(rng.standard_normal((n, d, h, kd)), dtype),
        k=jnp.asarray(rng.standard_normal((n, d, h, kd)), dtype),
        v=jnp.asarray(rng.standard_normal((n, d, HV, kd)), dtype),
        A_log=jnp.asarray(rng.standard_normal(HV), jnp.float32),
        a=jnp.asarray(rng.standard_normal((n, d, HV)) * 2, dtype),
        dt_bias=jnp.asarray(rng.standard_normal(HV), jnp.float32),
        b=jnp.asarray(rng.standard_normal((n, d, HV)) * 2, dtype),
        ssm_pool=jnp.asarray(pool),
        state_indices=jnp.asarray(idx),
    )
    return args, idx


def _oracle(args):
    """The gating formula, then the token-by-token decode, all in float64."""
    wide = {key: np.asarray(x, np.float64) for key, x in args.items() if key != "state_indices"}
    g = -np.exp(wide["A_log"]) * np.logaddexp(0.0, wide["a"] + wide["dt_bias"])
    beta = 1 / (1 + np.exp(-wide["b"]))
    with jax.enable_x64(True):
        out = gdn_reference.fused_recurrent_gated_delta_rule(
            *(jnp.asarray(wide[key]) for key in ("q", "k", "v")), jnp.asarray(g),
            jnp.asarray(beta), jnp.asarray(wide["ssm_pool"]), args["state_indices"],
        )  # fmt: skip
        return jax.tree.map(np.asarray, out)


def _op(impl):
    return jax.jit(functools.partial(gdn.fused_gating_recurrent_gated_delta_rule, impl=impl))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize(
    "dtype, d, tol", [(jnp.bfloat16, 1, 1e-2), (jnp.float32, 2, 1e-5)], ids=["bf16-D1", "f32-D2"]
)
def test_op_matches_gating_then_oracle_and_writes_only_named_slots(impl, dtype, d, tol):
    args, idx = _case(0, d=d, dtype=dtype)
    o, pool = _op(impl)(**args)
    o_ref, pool_ref = _oracle(args)
    real = idx != 0
    assert o.shape == args["v"].shape and o.dtype == dtype
    assert np.isfinite(np.asarray(o, np.float32)).all(), "an output was never written (NaN)"
    assert rel(o[real], o_ref[real]) < tol
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"
    named = idx[real]
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(SLOTS), named)  # slot 0 included: never touched
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))


def test_interpreted_kernel_matches_the_reference():
    args, idx = _case(1, n=4, padded=(3,))
    got, want = _op("interpret")(**args), _op("reference")(**args)
    real = idx != 0
    assert rel(got[0][real], want[0][real]) < 1e-2
    assert rel(got[1][idx[real]], want[1][idx[real]]) < 1e-5


def test_reference_is_gdn_gating_then_the_reference_decode_bit_for_bit():
    args, _ = _case(2, d=2, dtype=jnp.float32)

    def unfused(q, k, v, A_log, a, dt_bias, b, ssm_pool, state_indices):  # noqa: N803
        g, beta = gdn.gdn_gating(A_log, a.reshape(-1, HV), dt_bias, b.reshape(-1, HV))
        return gdn.fused_recurrent_gated_delta_rule(
            q, k, v, g.reshape(a.shape), beta.reshape(b.shape), ssm_pool, state_indices,
            impl="reference",
        )  # fmt: skip

    for got, want in zip(_op("reference")(**args), jax.jit(unfused)(**args), strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.fixture(params=[False, True], ids=["cpu", "hopper"])
def on_hopper(request, monkeypatch):
    monkeypatch.setattr(_common, "on_hopper_gpu", lambda: request.param)
    return request.param


def _program(impl, args):
    return str(jax.make_jaxpr(functools.partial(gdn.fused_gating_recurrent_gated_delta_rule,
                                                impl=impl))(**args))  # fmt: skip


def test_auto_takes_the_kernel_only_on_hopper_for_calls_it_supports(on_hopper):
    args, _ = _case(3)
    assert _program("auto", args) == _program("pallas" if on_hopper else "reference", args)
    narrow, _ = _case(3, kd=16)  # K=16: outside the kernel's head dims
    assert _program("auto", narrow) == _program("reference", narrow)


@pytest.mark.parametrize("impl", ["pallas", "interpret"])
def test_kernel_impls_refuse_a_call_the_kernel_cannot_take(impl):
    args, _ = _case(4, kd=16)
    with pytest.raises(NotImplementedError, match=f"{_OP}: impl='{impl}' cannot take this call: "):
        gdn.fused_gating_recurrent_gated_delta_rule(**args, impl=impl)


@pytest.mark.parametrize(
    "name, make, message",
    [
        ("A_log", lambda x: x[:1], r"A_log.shape=(1,) must be [HV]=(2,), one value per value"),
        ("dt_bias", lambda x: x[None], r"dt_bias.shape=(1, 2) must be [HV]=(2,)"),
        ("a", lambda x: x[:, :, :1], r"a.shape=(5, 1, 1) must be (5, 1, 2) (the token dims of v"),
        ("b", lambda x: x.astype(jnp.int32), r"b.dtype=int32 must be a floating dtype"),
        ("ssm_pool", lambda x: x[..., :8], r"ssm_pool.shape=(9, 2, 64, 8) must be [S, HV, K, V]"),
    ],
    ids=["A_log-length", "dt_bias-rank", "a-heads", "b-dtype", "pool-dims"],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_bad_input_is_named_before_any_work(impl, name, make, message):
    args, _ = _case(5)
    args[name] = make(args[name])
    with pytest.raises(ValueError, match=re.escape(f"{_OP}: {message}")):
        gdn.fused_gating_recurrent_gated_delta_rule(**args, impl=impl)


_PACKED_OP = "packed_gating_recurrent_gated_delta_rule"


def _packed(args):
    """``args`` as the packed op takes them: ``[Q | K | V]`` and ``[b | a]`` per token."""
    n, d = args["v"].shape[:2]
    flat = [args[key].reshape(n, d, -1) for key in ("q", "k", "v")]
    rest = {key: args[key] for key in ("ssm_pool", "state_indices")}
    return dict(qkv=jnp.concatenate(flat, -1), ba=jnp.concatenate([args["b"], args["a"]], -1),
                gate_params=gdn.stack_gate_params(args["A_log"], args["dt_bias"]),
                **rest)  # fmt: skip


def _packed_op(impl):
    return jax.jit(functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl=impl))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("h", [1, 2], ids=["two-value-heads-a-key", "one-each"])
def test_packed_op_reads_each_head_where_it_sits(impl, h):
    args, idx = _case(6, d=2, h=h, padded=(0, 3))
    o, pool = _packed_op(impl)(**_packed(args))
    o_ref, pool_ref = _oracle(args)
    real = idx != 0
    assert o.shape == args["v"].shape and o.dtype == jnp.bfloat16
    assert rel(o[real], o_ref[real]) < 1e-2
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"
    named = idx[real]
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(SLOTS), named)
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))
    # The same arithmetic as the op on separate q, k, v, a, b: only where it reads differs.
    for got, want in zip((o, pool), _op(impl)(**args), strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


def _output_norm(args, seed):
    """A random ``gdn.OutputNorm`` for ``args``' rows (eps large enough to matter)."""
    rng = np.random.default_rng(seed)
    n, d, hv, vd = args["v"].shape
    z = jnp.asarray(rng.standard_normal((n, d, hv * vd)) * 2, args["v"].dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, vd), jnp.float32)
    return gdn.OutputNorm(z, weight, 1e-3)


def _gated_norm_oracle(o, norm):
    """``weight * o / rms(o) * silu(z)`` per head, float64."""
    o = np.asarray(o, np.float64)
    z = np.asarray(norm.z, np.float64).reshape(o.shape)
    normed = o / np.sqrt((o * o).mean(-1, keepdims=True) + norm.eps)
    return np.asarray(norm.weight, np.float64) * normed * z / (1 + np.exp(-z))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize(
    "dtype, d, tol", [(jnp.bfloat16, 1, 2e-2), (jnp.float32, 2, 1e-5)], ids=["bf16-D1", "f32-D2"]
)
def test_packed_op_forms_the_output_norm_and_leaves_the_pool_as_without_it(impl, dtype, d, tol):
    args, idx = _case(8, d=d, dtype=dtype, h=2, padded=(2,))
    norm = _output_norm(args, 9)
    o, pool = _packed_op(impl)(**_packed(args), output_norm=norm)
    o_ref, pool_ref = _oracle(args)
    real = idx != 0
    assert o.shape == args["v"].shape and o.dtype == dtype
    assert np.isfinite(np.asarray(o, np.float32)).all(), "an output was never written (NaN)"
    assert rel(o[real], _gated_norm_oracle(o_ref, norm)[real]) < tol
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"
    named = idx[real]
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(SLOTS), named)
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))
    # Whole-head items sum the state in another order than the op's own blocks: the same
    # states and outputs within float32 rounding.
    plain_o, plain_pool = _packed_op(impl)(**_packed(args))
    assert rel(pool[named], plain_pool[named]) < 1e-6
    # The norm of the op's own (rounded) output, as the layer's norm would form it.
    layer = gdn_reference.gated_output_norm(plain_o, norm.z.reshape(o.shape), norm.weight,
                                            norm.eps)  # fmt: skip
    assert rel(o, layer) < (1e-2 if dtype == jnp.bfloat16 else 1e-6)


def test_packed_op_names_a_misshaped_output_norm():
    args, _ = _case(10)
    norm = _output_norm(args, 11)
    narrow = dataclasses.replace(norm, weight=jnp.ones(3))
    with pytest.raises(ValueError, match=re.escape("weight float32[3] must be float32[64]")):
        _packed_op("reference")(**_packed(args), output_norm=narrow)
    wide = dataclasses.replace(norm, z=norm.z.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"z float32\[5, 1, 128\] must be bfloat16\[5, 1, 128\]"):
        _packed_op("reference")(**_packed(args), output_norm=wide)


def test_the_output_norm_asks_for_the_pipelined_grid():
    args, _ = _case(12)
    norm = dataclasses.astuple(_output_norm(args, 13))
    with pytest.raises(ValueError, match=r"the output norm runs in the pipelined grid"):
        decode_mgpu.packed_gating_recurrent_gated_delta_rule(
            **_packed(args), output_norm=norm, variant="cols", interpret=True
        )


def test_packed_op_with_the_output_norm_lowers_for_cuda():
    """Qwen3.5's heads (16 key / 32 value heads of 128) at a 64-row bucket: the whole-head
    items, the cross-warp sum of the norm and the z loads lower for Mosaic GPU."""
    n, h, hv, kd = 64, 16, 32, 128
    spec = jax.ShapeDtypeStruct
    args = dict(
        qkv=spec((n, 1, 2 * h * kd + hv * kd), jnp.bfloat16),
        ba=spec((n, 1, 2 * hv), jnp.bfloat16),
        gate_params=spec((2, hv), jnp.float32),
        ssm_pool=spec((n + 1, hv, kd, kd), jnp.float32),
        state_indices=spec((n,), jnp.int32),
    )
    norm = gdn.OutputNorm(spec((n, 1, hv * kd), jnp.bfloat16), spec((kd,), jnp.float32), 1e-6)
    fn = functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl="pallas")
    traced = jax.jit(fn).trace(**args, output_norm=norm)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_packed_op_takes_the_kernel_where_the_unpacked_one_does(on_hopper):
    args, _ = _case(7)
    program = lambda impl, a: str(  # noqa: E731
        jax.make_jaxpr(functools.partial(gdn.packed_gating_recurrent_gated_delta_rule,
                                         impl=impl))(**_packed(a))
    )  # fmt: skip
    assert program("auto", args) == program("pallas" if on_hopper else "reference", args)
    narrow, _ = _case(7, kd=16)
    assert program("auto", narrow) == program("reference", narrow)


@pytest.mark.parametrize(
    "name, make, message",
    [
        (
            "qkv",
            lambda x: x[..., :-64],
            r"qkv.shape[-1]=192 must be 2*H*K + HV*V with the "
            r"pool's HV=2, K=64, V=64 and some H >= 1",
        ),  # fmt: skip
        ("qkv", lambda x: x[:, 0], r"qkv.shape=(5, 256) must be [N, D, H*K + H*K + HV*V]"),
        ("ba", lambda x: x[..., :2], r"ba.shape=(5, 1, 2) must be (5, 1, 4) ([b | a] per token)"),
        (
            "gate_params",
            lambda x: x[:, :1],
            r"gate_params.shape=(2, 1) must be (2, 2): [A_log; dt_bias]",
        ),  # fmt: skip
    ],
    ids=["qkv-width", "qkv-rank", "ba-width", "gate_params-length"],
)
@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_packed_bad_input_is_named_before_any_work(impl, name, make, message):
    args = _packed(_case(8)[0])
    args[name] = make(args[name])
    with pytest.raises(ValueError, match=re.escape(f"{_PACKED_OP}: {message}")):
        gdn.packed_gating_recurrent_gated_delta_rule(**args, impl=impl)
