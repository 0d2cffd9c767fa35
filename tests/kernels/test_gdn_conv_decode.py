"""``gdn.packed_gating_recurrent_gated_delta_rule(conv=)``: the decode op forming the layer's
causal conv1d on its input in the kernel.

The op must equal the conv (``causal_conv1d_update``, SiLU, no bias) followed by the packed op
(float64 oracle on fresh random inputs), write each real row's window and state and nothing
else, and refuse what the kernel cannot take. The kernel's programs take a key head's value
heads one after another (they share its q and k windows): several key heads a program must
give what one each gives. Kernels run under the Mosaic GPU interpreter.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import gdn
from pallas_kernels.conv1d import reference as conv_reference
from pallas_kernels.gdn import decode_mgpu
from pallas_kernels.gdn import reference as gdn_reference

H, HV, DIM, WIDTH = 2, 4, 128, 4
CHANNELS = 2 * H * DIM + HV * DIM
SLOTS = 9
_OP = "packed_gating_recurrent_gated_delta_rule"


def _case(seed, *, n=4, d=1, dtype=jnp.bfloat16, padded=(1,)):
    """Rows at distinct random slots (slot 0 on the ``padded`` rows); both pools are NaN in
    slot 0 and in every slot no row names, so a read of a wrong slot shows."""
    rng = np.random.default_rng(seed)
    real = rng.permutation(np.arange(1, SLOTS))[:n]
    idx = np.where(np.isin(np.arange(n), padded), 0, real).astype(np.int32)
    unnamed = np.setdiff1d(np.arange(SLOTS), idx[idx > 0])
    pool = rng.standard_normal((SLOTS, HV, DIM, DIM)).astype(np.float32) * 0.3
    windows = rng.standard_normal((SLOTS, CHANNELS, WIDTH - 1)).astype(np.float32)
    pool[unnamed], windows[unnamed] = np.nan, np.nan
    args = dict(
        qkv=jnp.asarray(rng.standard_normal((n, d, CHANNELS)), dtype),
        ba=jnp.asarray(rng.standard_normal((n, d, 2 * HV)) * 2, dtype),
        gate_params=jnp.asarray(rng.standard_normal((2, HV)), jnp.float32),
        ssm_pool=jnp.asarray(pool),
        state_indices=jnp.asarray(idx),
    )
    weight = jnp.asarray(rng.standard_normal((CHANNELS, WIDTH)) * 0.5, dtype)
    z = jnp.asarray(rng.standard_normal((n, d, HV * DIM)) * 2, dtype)
    norm = gdn.OutputNorm(z, jnp.asarray(rng.uniform(0.5, 1.5, DIM), jnp.float32), 1e-3)
    return args, gdn.InputConv(weight, jnp.asarray(windows, dtype)), norm, idx


def _oracle(args, conv, norm):
    """The conv, the gating, the token-by-token decode and the output norm, all in float64:
    ``(o, ssm_pool, conv_pool)``."""
    with jax.enable_x64(True):
        wide = lambda x: jnp.asarray(np.asarray(x, np.float64))  # noqa: E731
        idx = args["state_indices"]
        qkv, windows = conv_reference.causal_conv1d_update(
            wide(args["qkv"]), wide(conv.weight), None, wide(conv.pool), idx
        )
        q, k, v = gdn.split_qkv(qkv, H, DIM, DIM)
        b, a = gdn.split_ba(wide(args["ba"]))
        a_log, dt_bias = wide(args["gate_params"])
        g = -jnp.exp(a_log) * jnp.logaddexp(0.0, a + dt_bias)
        beta = 1 / (1 + jnp.exp(-b))
        o, pool = gdn_reference.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, wide(args["ssm_pool"]), idx
        )
        o = gdn_reference.gated_output_norm(o, wide(norm.z).reshape(o.shape), wide(norm.weight),
                                            norm.eps)  # fmt: skip
        return tuple(np.asarray(x) for x in (o, pool, windows))


def _op(impl):
    return jax.jit(functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl=impl))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize(
    "dtype, d, tol", [(jnp.bfloat16, 1, 2e-2), (jnp.float32, 2, 1e-5)], ids=["bf16-D1", "f32-D2"]
)
def test_the_op_with_the_conv_matches_the_float64_oracle(impl, dtype, d, tol):
    args, conv, norm, idx = _case(1, d=d, dtype=dtype)
    o, pool, windows = _op(impl)(**args, output_norm=norm, conv=conv)
    o_ref, pool_ref, windows_ref = _oracle(args, conv, norm)
    real, named = idx != 0, idx[idx != 0]
    assert o.shape == (*args["qkv"].shape[:2], HV, DIM) and o.dtype == dtype
    assert rel(o[real], o_ref[real]) < tol
    assert not np.asarray(o, np.float32)[~real].any(), "padded rows must give zeros"
    # The conv rounds its outputs to the activations' dtype before the delta rule.
    assert rel(pool[named], pool_ref[named]) < (1e-2 if dtype == jnp.bfloat16 else 1e-5)
    # A window holds raw inputs: exactly the oracle's.
    np.testing.assert_array_equal(np.asarray(windows[named], np.float64), windows_ref[named])
    others = np.setdiff1d(np.arange(SLOTS), named)  # the pad slot 0 among them
    np.testing.assert_array_equal(bits(pool[others]), bits(args["ssm_pool"][others]))
    np.testing.assert_array_equal(bits(windows[others]), bits(conv.pool[others]))


def test_the_kernel_equals_the_conv_op_then_the_packed_op_bit_for_bit():
    args, conv, norm, _ = _case(2, n=5, d=1, padded=(0, 3))
    o, pool, windows = _op("interpret")(**args, output_norm=norm, conv=conv)
    qkv, want_windows = conv_reference.causal_conv1d_update(
        args["qkv"], conv.weight, None, conv.pool, args["state_indices"]
    )
    want_o, want_pool = _op("interpret")(**{**args, "qkv": qkv}, output_norm=norm)
    for got, want in ((o, want_o), (pool, want_pool), (windows, want_windows)):
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("programs", [1, 3])
def test_programs_walking_several_items_give_what_one_each_gives(programs):
    """5 rows of 4 value heads on 1 or 3 programs, each walking its items through the ring
    (padded rows among them), the two value heads of a key head on different programs or
    one after another on the same."""
    args, conv, norm, _ = _case(3, n=5, d=2, padded=(2,))
    norm_in = (norm.z, norm.weight, norm.eps)

    def run(variant):
        call = lambda a, c, n: decode_mgpu.packed_gating_recurrent_gated_delta_rule(  # noqa: E731
            *a, interpret=True, variant=variant, output_norm=(*n, norm.eps), conv=c
        )
        order = ("qkv", "ba", "gate_params", "ssm_pool", "state_indices")
        return jax.jit(call)([args[key] for key in order], (conv.weight, conv.pool), norm_in[:2])

    few = run(decode_mgpu.DecodeVariant("cols", stages=3, programs=programs))
    each = run(decode_mgpu.VARIANTS[decode_mgpu.DEFAULT])
    for got, want in zip(few, each, strict=True):
        np.testing.assert_array_equal(bits(got), bits(want))


def test_the_conv_counts_in_the_counters_it_is_given_and_leaves_them_at_zero():
    """A key head's last value head to read its q and k windows writes them (the others
    count their reads on the row's key-head counter): the counters handed in end at zero,
    as the next launch sharing them needs, and a buffer shorter than N H is named."""
    args, conv, norm, _ = _case(6, n=3, padded=())
    counters = jax.new_ref(jnp.zeros((3 * H + 5,), jnp.int32))
    o, pool, windows = _op("interpret")(**args, output_norm=norm, conv=conv, counters=counters)
    want = _op("interpret")(**args, output_norm=norm, conv=conv)
    for got, expected in zip((o, pool, windows), want, strict=True):
        np.testing.assert_array_equal(bits(got), bits(expected))
    assert not np.asarray(counters[...]).any()
    short = jax.new_ref(jnp.zeros((3 * H - 1,), jnp.int32))
    with pytest.raises(ValueError, match=re.escape(f"counters must be int32 [n >= {3 * H}]")):
        _op("interpret")(**args, conv=conv, counters=short)


def test_heads_the_conv_cannot_take_are_named():
    """Head dims of 64: the kernel refuses the conv (one channel a thread takes 128), and
    ``impl="auto"`` forms it in the reference."""
    rng = np.random.default_rng(4)
    n, kd, channels = 2, 64, 2 * H * 64 + HV * 64
    args = dict(
        qkv=jnp.asarray(rng.standard_normal((n, 1, channels)), jnp.bfloat16),
        ba=jnp.asarray(rng.standard_normal((n, 1, 2 * HV)), jnp.bfloat16),
        gate_params=jnp.asarray(rng.standard_normal((2, HV)), jnp.float32),
        ssm_pool=jnp.asarray(rng.standard_normal((SLOTS, HV, kd, kd)), jnp.float32),
        state_indices=jnp.asarray([3, 5], jnp.int32),
    )
    conv = gdn.InputConv(
        jnp.asarray(rng.standard_normal((channels, WIDTH)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((SLOTS, channels, WIDTH - 1)), jnp.bfloat16),
    )
    reason = decode_mgpu.conv_unsupported_reason(
        args["qkv"], args["ssm_pool"], args["state_indices"], conv.weight, conv.pool
    )
    assert reason == "K, V = (64, 64): the conv in the decode kernel takes K = V = 128"
    with pytest.raises(
        NotImplementedError, match=re.escape(f"impl='pallas' cannot take this call: {reason}")
    ):
        _op("pallas")(**args, conv=conv)
    got = _op("auto")(**args, conv=conv)
    for x, y in zip(got, _op("reference")(**args, conv=conv), strict=True):
        np.testing.assert_array_equal(bits(x), bits(y))


@pytest.mark.parametrize("impl", ["interpret", "reference"])
def test_a_misshaped_conv_is_named_before_any_work(impl):
    args, conv, _, _ = _case(5)
    narrow = gdn.InputConv(conv.weight, conv.pool[:, :-1])
    with pytest.raises(ValueError, match=re.escape(f"{_OP}: conv_pool.shape=(9, 1023, 3) must be")):
        _op(impl)(**args, conv=narrow)
    wide = gdn.InputConv(conv.weight, conv.pool.astype(jnp.float32))
    with pytest.raises(ValueError, match=re.escape("conv_pool.dtype=float32 must equal x.dtype")):
        _op(impl)(**args, conv=wide)
