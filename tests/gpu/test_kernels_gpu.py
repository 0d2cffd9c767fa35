"""The Mosaic GPU token-path kernels compiled and run on an sm_90 GPU, at production shapes.

Qwen3-Next TP1: H=16, HV=32, K=V=128, conv channels C=8192 with W=4, bf16 activations, fp32
ssm pool. Every kernel is compared with the float64 oracle (on the same GPU, x64 enabled only
inside ``_oracle``) by ``|out - ref| / |ref|``; pools are poisoned with NaN in every slot no
row names (and the pad slot 0), so a wrong slot read shows as NaN and a stray write as a
changed bit. Skipped where there is no sm_90 GPU (``-m gpu`` selects them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import gdn
from pallas_kernels._common import on_hopper_gpu
from pallas_kernels.conv1d import prefill_mgpu, update_mgpu
from pallas_kernels.conv1d import reference as conv_reference
from pallas_kernels.gdn import decode_mgpu, recurrent_mgpu
from pallas_kernels.gdn import reference as gdn_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

H, HV, K, V = 16, 32, 128, 128
CHANNELS, WIDTH = 8192, 4
SLOTS = 512


def _slots(rng, n, n_padded):
    """Distinct random real slots; the last ``n_padded`` rows are padding (slot 0)."""
    idx = rng.permutation(np.arange(1, SLOTS))[:n].astype(np.int32)
    idx[n - n_padded :] = 0
    return idx


def _poisoned(pool: np.ndarray, idx: np.ndarray) -> np.ndarray:
    pool[np.setdiff1d(np.arange(pool.shape[0]), idx[idx > 0])] = np.nan
    return pool


def _gdn_case(seed, n, d, n_padded, hv=HV):
    rng = np.random.default_rng(seed)
    idx = _slots(rng, n, n_padded)
    pool = _poisoned(rng.standard_normal((SLOTS, hv, K, V), np.float32) * 0.3, idx)
    bf16 = jnp.bfloat16
    return (
        dict(
            q=jnp.asarray(rng.standard_normal((n, d, H, K)), bf16),
            k=jnp.asarray(rng.standard_normal((n, d, H, K)), bf16),
            v=jnp.asarray(rng.standard_normal((n, d, hv, V)), bf16),
            g=jnp.asarray(-np.logaddexp(0, rng.standard_normal((n, d, hv))), jnp.float32),
            beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((n, d, hv)))), jnp.float32),
            ssm_pool=jnp.asarray(pool),
            state_indices=jnp.asarray(idx),
        ),
        idx,
    )


def _oracle(fn, args, **options):
    """The reference on float64 copies of the inputs, run row block by row block."""
    with jax.enable_x64(True):
        wide = {
            name: jnp.asarray(x, jnp.float64)
            if x is not None and jnp.issubdtype(x.dtype, jnp.floating)
            else x
            for name, x in args.items()
        }
        return jax.tree.map(np.asarray, jax.jit(functools.partial(fn, **options))(**wide))


def _check_pool(pool, pool_ref, idx, before):
    """The real rows' slots hold the oracle's states; every other slot is as ``before``."""
    named = idx[idx != 0]
    pool = np.asarray(pool)
    assert rel(pool[named], pool_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(SLOTS), named)
    np.testing.assert_array_equal(bits(pool[others]), bits(before[others]))


def _check_outputs(o, o_ref, idx, tol):
    o = np.asarray(o, np.float32)
    real = idx != 0
    assert np.isfinite(o).all(), "NaN/inf in the output"
    assert rel(o[real], o_ref[real]) < tol
    assert not o[~real].any(), "padded rows must give zeros"


# Batch 1 takes 16-column blocks; 64 and 256 walk several items per program of the persistent
# pipelined grid, padded rows among them.
@pytest.mark.parametrize(
    "n, n_padded", [(1, 0), (64, 4), (256, 7)], ids=["batch1", "batch64", "batch256"]
)
def test_gdn_decode_op_on_gpu_matches_oracle_in_place(n, n_padded):
    """The public decode op with ``impl="pallas"`` (decode_mgpu's default variant)."""
    args, idx = _gdn_case(0, n, 1, n_padded)
    before = np.asarray(args["ssm_pool"])
    o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
    op = functools.partial(gdn.fused_recurrent_gated_delta_rule, impl="pallas")
    step = jax.jit(op, donate_argnames="ssm_pool")
    pointer = args["ssm_pool"].unsafe_buffer_pointer()
    o, pool = step(**args)
    assert pool.unsafe_buffer_pointer() == pointer, "the donated pool was copied, not aliased"
    _check_outputs(o, o_ref, idx, 1e-2)
    _check_pool(pool, pool_ref, idx, before)


# Qwen3.5's value/key head ratios on 16 key heads: 1 (0.8B, 2B), 3 (27B), 4 (122B, 397B).
# Batch 1 takes the one-item-per-program grid with 16-column blocks, 64 the pipelined one.
@pytest.mark.parametrize("n, n_padded", [(1, 0), (64, 3)], ids=["batch1", "batch64"])
@pytest.mark.parametrize("hv", [16, 48, 64], ids=["ratio1", "ratio3", "ratio4"])
def test_gdn_decode_and_verify_take_every_value_key_head_ratio(hv, n, n_padded):
    for d in (1, 4):  # decode, and verify's per-token states
        args, idx = _gdn_case(hv + d, n, d, n_padded, hv=hv)
        o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
        op = functools.partial(gdn.fused_recurrent_gated_delta_rule, impl="pallas")
        o, pool = jax.jit(op)(**args)
        _check_outputs(o, o_ref, idx, 1e-2)
        named = idx[idx != 0]
        assert rel(np.asarray(pool)[named], pool_ref[named]) < 1e-5


# Four ragged rows in a 2048-token bucket, and one short prompt alone in a 32-token bucket
# (a batch-1 engine's first prefill).
@pytest.mark.parametrize(
    "lens, tokens", [([1000, 1, 513, 300], 2048), ([32], 32)], ids=["ragged", "one-short"]
)
@pytest.mark.parametrize("hv", [16, 48, 64], ids=["ratio1", "ratio3", "ratio4"])
def test_gdn_chunk_prefill_takes_every_value_key_head_ratio(hv, lens, tokens):
    rng = np.random.default_rng(hv)
    idx = rng.permutation(np.arange(1, SLOTS))[: len(lens)].astype(np.int32)
    init = np.arange(len(lens)) % 2 == 0
    pool = rng.standard_normal((SLOTS, hv, K, V)).astype(np.float32) * 0.3
    pool[np.setdiff1d(np.arange(SLOTS), idx[init])] = np.nan
    bf16 = jnp.bfloat16
    args = dict(
        q=jnp.asarray(rng.standard_normal((tokens, H, K)), bf16),
        k=jnp.asarray(rng.standard_normal((tokens, H, K)), bf16),
        v=jnp.asarray(rng.standard_normal((tokens, hv, V)), bf16),
        g=jnp.asarray(-np.logaddexp(0, rng.standard_normal((tokens, hv)) - 1), jnp.float32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((tokens, hv)))), jnp.float32),
        ssm_pool=jnp.asarray(pool),
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        state_indices=jnp.asarray(idx),
        has_initial_state=jnp.asarray(init),
    )
    op = functools.partial(gdn.chunk_gated_delta_rule, impl="pallas")
    o, new_pool = jax.jit(op)(**args)
    ref = functools.partial(gdn.chunk_gated_delta_rule, impl="reference")
    o_ref, pool_ref = jax.jit(ref)(**args)
    end = sum(lens)
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    assert np.isfinite(o[:end]).all() and rel(o[:end], o_ref[:end]) < 2e-2
    assert rel(np.asarray(new_pool)[idx], np.asarray(pool_ref)[idx]) < 2e-2


def _packed_decode(q, k, v, A_log, a, dt_bias, b, ssm_pool, state_indices):  # noqa: N803
    """The packed op, which the DECODE step calls, on the rows as the layer makes them."""
    n, d = v.shape[:2]
    qkv = jnp.concatenate([x.reshape(n, d, -1) for x in (q, k, v)], axis=-1)
    return gdn.packed_gating_recurrent_gated_delta_rule(
        qkv, jnp.concatenate([b, a], axis=-1), gdn.stack_gate_params(A_log, dt_bias),
        ssm_pool, state_indices, impl="pallas",
    )  # fmt: skip


_FUSED_GATING = {
    "kernel": decode_mgpu.fused_gating_recurrent_gated_delta_rule,
    "public-op": functools.partial(gdn.fused_gating_recurrent_gated_delta_rule, impl="pallas"),
    "packed-op": _packed_decode,
}


# The DECODE step's shapes of the Qwen3-Next/3.5 presets: batch 64, and batch 1 at the value
# head ratios 2 and 3 (the 27B-like preset's 48 value heads).
@pytest.mark.parametrize(
    "n, n_padded, hv", [(64, 4, HV), (1, 0, HV), (1, 0, 48)], ids=["b64", "b1", "b1-ratio3"]
)
@pytest.mark.parametrize("entry", list(_FUSED_GATING))
def test_gdn_fused_gating_decode_on_gpu_matches_oracle(entry, n, n_padded, hv):
    """decode_mgpu's fused-gating entry, its public op, and the packed op the DECODE step
    calls."""
    args, idx = _gdn_case(2, n, 1, n_padded, hv=hv)
    before = np.asarray(args["ssm_pool"])
    rng = np.random.default_rng(3)
    a = jnp.asarray(rng.standard_normal((n, 1, hv)) * 2, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((n, 1, hv)) * 2, jnp.bfloat16)
    a_log = rng.standard_normal(hv).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(np.float32)
    x = np.asarray(a, np.float64) + dt_bias
    args["g"] = -np.exp(a_log.astype(np.float64)) * np.logaddexp(0.0, x)
    args["beta"] = 1 / (1 + np.exp(-np.asarray(b, np.float64)))
    o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
    kernel_args = {name: x for name, x in args.items() if name not in ("g", "beta")}
    step = jax.jit(_FUSED_GATING[entry], donate_argnames="ssm_pool")
    pointer = kernel_args["ssm_pool"].unsafe_buffer_pointer()
    o, pool = step(A_log=jnp.asarray(a_log), a=a, dt_bias=jnp.asarray(dt_bias), b=b, **kernel_args)
    assert pool.unsafe_buffer_pointer() == pointer, "the donated pool was copied, not aliased"
    _check_outputs(o, o_ref, idx, 1e-2)
    _check_pool(pool, pool_ref, idx, before)


# A decode bucket of 8 rows with one real (the batch-1 step), 64 rows, and 48 value heads.
@pytest.mark.parametrize(
    "n, n_padded, hv", [(8, 7, HV), (64, 4, HV), (8, 5, 48)], ids=["b8-1", "b64", "b8-ratio3"]
)
def test_gdn_packed_decode_with_the_output_norm_on_gpu_matches_oracle(n, n_padded, hv):
    """The packed op forming the gated output norm (whole-head items, a cross-warp sum):
    ``weight * o / rms(o) * silu(z)`` of the float64 oracle's o; the pool as without it."""
    args, idx = _gdn_case(4, n, 1, n_padded, hv=hv)
    before = np.asarray(args["ssm_pool"])
    rng = np.random.default_rng(5)
    gating = dict(
        A_log=jnp.asarray(rng.standard_normal(hv), jnp.float32),
        a=jnp.asarray(rng.standard_normal((n, 1, hv)) * 2, jnp.bfloat16),
        dt_bias=jnp.asarray(rng.standard_normal(hv), jnp.float32),
        b=jnp.asarray(rng.standard_normal((n, 1, hv)) * 2, jnp.bfloat16),
    )
    x = np.asarray(gating["a"], np.float64) + np.asarray(gating["dt_bias"], np.float64)
    args["g"] = -np.exp(np.asarray(gating["A_log"], np.float64)) * np.logaddexp(0.0, x)
    args["beta"] = 1 / (1 + np.exp(-np.asarray(gating["b"], np.float64)))
    o_ref, pool_ref = _oracle(gdn_reference.fused_recurrent_gated_delta_rule, args)
    z = jnp.asarray(rng.standard_normal((n, 1, hv * V)) * 2, jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, V), jnp.float32)
    n_, d = args["v"].shape[:2]
    qkv = jnp.concatenate([args[key].reshape(n_, d, -1) for key in ("q", "k", "v")], axis=-1)
    norm = gdn.OutputNorm(z, weight, 1e-6)
    op = functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl="pallas")
    o, pool = jax.jit(op)(
        qkv, jnp.concatenate([gating["b"], gating["a"]], -1),
        gdn.stack_gate_params(gating["A_log"], gating["dt_bias"]), args["ssm_pool"],
        args["state_indices"], output_norm=norm,
    )  # fmt: skip
    o64 = np.asarray(o_ref, np.float64)
    z64 = np.asarray(z, np.float64).reshape(o64.shape)
    want = o64 / np.sqrt((o64 * o64).mean(-1, keepdims=True) + 1e-6)
    want = np.asarray(weight, np.float64) * want * z64 / (1 + np.exp(-z64))
    _check_outputs(o, want, idx, 2e-2)
    _check_pool(pool, pool_ref, idx, before)


# The batch-1 step's bucket (8 rows, one real), 64 rows, and three value heads a key head.
@pytest.mark.parametrize(
    "n, n_padded, hv", [(8, 7, HV), (64, 4, HV), (8, 5, 48)], ids=["b8-1", "b64", "b8-ratio3"]
)
def test_gdn_decode_with_the_conv_on_gpu_equals_the_conv_launch_then_the_op(n, n_padded, hv):
    """20 decode steps in a scan, each the packed op forming the conv in its kernel
    (``conv=``, the launches counting in one buffer), against the conv launch then the packed
    op: the same windows bit for bit (raw inputs), outputs and states within a rounding of a
    conv output, both pools updated in place (donated), every slot no row names untouched,
    and the counters back at zero."""
    steps, channels = 20, 2 * H * K + hv * V
    rng = np.random.default_rng(7)
    idx = _slots(rng, n, n_padded)
    bf16 = jnp.bfloat16
    ssm = _poisoned(rng.standard_normal((SLOTS, hv, K, V), np.float32) * 0.3, idx)
    windows = _poisoned(rng.standard_normal((SLOTS, channels, WIDTH - 1)).astype(np.float32), idx)
    inputs = (
        jnp.asarray(rng.standard_normal((steps, n, 1, channels)), bf16),
        jnp.asarray(rng.standard_normal((steps, n, 1, 2 * hv)) * 2, bf16),
        jnp.asarray(rng.standard_normal((steps, n, 1, hv * V)) * 2, bf16),
    )
    conv_weight = jnp.asarray(rng.standard_normal((channels, WIDTH)) * 0.5, bf16)
    gate_params = jnp.asarray(rng.standard_normal((2, hv)), jnp.float32)
    norm_weight = jnp.asarray(rng.uniform(0.5, 1.5, V), jnp.float32)
    slots = jnp.asarray(idx)
    op = functools.partial(gdn.packed_gating_recurrent_gated_delta_rule, impl="pallas")

    def run(in_kernel, ssm, windows):
        counters = jax.new_ref(jnp.zeros((n * H,), jnp.int32))  # shared by the launches

        def step(pools, xs):
            ssm, windows = pools
            qkv, ba, z = xs
            norm = gdn.OutputNorm(z, norm_weight, 1e-6)
            if in_kernel:
                conv = gdn.InputConv(conv_weight, windows)
                o, ssm, windows = op(qkv, ba, gate_params, ssm, slots, output_norm=norm,
                                     conv=conv, counters=counters)  # fmt: skip
            else:
                qkv, windows = update_mgpu.causal_conv1d_update(
                    qkv, conv_weight, None, windows, slots
                )
                o, ssm = op(qkv, ba, gate_params, ssm, slots, output_norm=norm)
            return (ssm, windows), o

        return jax.lax.scan(step, (ssm, windows), inputs), counters[...]

    results = {}
    for in_kernel in (False, True):
        pools = (jnp.asarray(ssm), jnp.asarray(windows, bf16))
        pointers = [x.unsafe_buffer_pointer() for x in pools]
        ((ssm_out, windows_out), o), counts = jax.jit(run, static_argnums=0, donate_argnums=(1, 2))(
            in_kernel, *pools
        )
        assert [ssm_out.unsafe_buffer_pointer(), windows_out.unsafe_buffer_pointer()] == pointers
        assert not np.asarray(counts).any(), "the launches left a counter off zero"
        results[in_kernel] = tuple(np.asarray(x) for x in (o, ssm_out, windows_out))
    (o, ssm_out, windows_out), (o_ref, ssm_ref, windows_ref) = results[True], results[False]
    np.testing.assert_array_equal(bits(windows_out), bits(windows_ref))
    real, named = idx != 0, idx[idx != 0]
    assert np.isfinite(o.astype(np.float32)).all() and not o[:, ~real].astype(np.float32).any()
    assert rel(o[:, real], o_ref[:, real]) < 1e-3
    assert rel(ssm_out[named], ssm_ref[named]) < 1e-5
    others = np.setdiff1d(np.arange(SLOTS), named)
    np.testing.assert_array_equal(bits(ssm_out[others]), bits(ssm[others]))
    before = np.asarray(jnp.asarray(windows, bf16))
    np.testing.assert_array_equal(bits(windows_out[others]), bits(before[others]))
    assert (bits(windows_out[named]) != bits(before[named])).any(axis=(1, 2)).all()


@pytest.mark.parametrize("n", [16, 64])
def test_gdn_verify_on_gpu_matches_oracle_and_leaves_pool(n):
    args, idx = _gdn_case(1, n, 4, 3)
    before = bits(args["ssm_pool"]).copy()
    o, inter = jax.jit(recurrent_mgpu.verify_gated_delta_rule)(**args)
    o_ref, inter_ref = _oracle(gdn_reference.verify_gated_delta_rule, args)
    _check_outputs(o, o_ref, idx, 1e-2)
    real = idx != 0
    inter = np.asarray(inter)
    for t in range(4):
        assert rel(inter[real, t], inter_ref[real, t]) < 1e-5, f"state after token {t}"
    assert not inter[~real].any()
    np.testing.assert_array_equal(bits(args["ssm_pool"]), before)


def _conv_case(seed, n, d, n_padded):
    rng = np.random.default_rng(seed)
    idx = _slots(rng, n, n_padded)
    pool = _poisoned(rng.standard_normal((SLOTS, CHANNELS, WIDTH - 1)).astype(np.float32), idx)
    bf16 = jnp.bfloat16
    return (
        dict(
            x=jnp.asarray(rng.standard_normal((n, d, CHANNELS)), bf16),
            weight=jnp.asarray(rng.standard_normal((CHANNELS, WIDTH)) * 0.5, bf16),
            bias=jnp.asarray(rng.standard_normal(CHANNELS), bf16),
            conv_pool=jnp.asarray(pool, bf16),
            state_indices=jnp.asarray(idx),
        ),
        idx,
    )


def test_conv1d_update_on_gpu_matches_oracle_in_place():
    args, idx = _conv_case(4, 256, 1, 5)
    before = np.asarray(args["conv_pool"])
    y_ref, pool_ref = _oracle(conv_reference.causal_conv1d_update, args)
    step = jax.jit(update_mgpu.causal_conv1d_update, donate_argnames="conv_pool")
    pointer = args["conv_pool"].unsafe_buffer_pointer()
    y, pool = step(**args)
    assert pool.unsafe_buffer_pointer() == pointer, "the donated pool was copied, not aliased"
    _check_outputs(y, y_ref, idx, 1e-2)
    named = idx[idx != 0]
    pool = np.asarray(pool)
    np.testing.assert_array_equal(bits(pool[named]), bits(pool_ref[named].astype(jnp.bfloat16)))
    others = np.setdiff1d(np.arange(SLOTS), named)
    np.testing.assert_array_equal(bits(pool[others]), bits(before[others]))


def test_conv1d_verify_on_gpu_matches_oracle():
    args, idx = _conv_case(5, 64, 4, 2)
    y, windows = jax.jit(update_mgpu.causal_conv1d_verify)(**args)
    y_ref, windows_ref = _oracle(conv_reference.causal_conv1d_verify, args)
    _check_outputs(y, y_ref, idx, 1e-2)
    real = idx != 0
    windows = np.asarray(windows)
    np.testing.assert_array_equal(bits(windows[real]), bits(windows_ref[real].astype(jnp.bfloat16)))
    assert not windows[~real].astype(np.float32).any()


def test_conv1d_prefill_on_gpu_matches_oracle_in_place():
    # Lengths around the window (0, 1, 2 < W-1), long ones across many 16-token blocks.
    lengths = np.array([700, 0, 1, 2, 3000, 37, 5, 0])
    has_init = np.array([True, False, True, False, True, False, True, False])
    rng = np.random.default_rng(6)
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    idx = _slots(rng, len(lengths), 0)
    idx[lengths == 0] = 0
    pool = rng.standard_normal((SLOTS, CHANNELS, WIDTH - 1)).astype(np.float32)
    pool[np.setdiff1d(np.arange(SLOTS), idx[(idx > 0) & has_init])] = np.nan
    bf16 = jnp.bfloat16
    args = dict(
        x=jnp.asarray(rng.standard_normal((int(qsl[-1]) + 11, CHANNELS)), bf16),
        weight=jnp.asarray(rng.standard_normal((CHANNELS, WIDTH)) * 0.5, bf16),
        bias=jnp.asarray(rng.standard_normal(CHANNELS), bf16),
        conv_pool=jnp.asarray(pool, bf16),
        qsl=jnp.asarray(qsl),
        state_indices=jnp.asarray(idx),
        has_initial_state=jnp.asarray(has_init),
    )
    before = np.asarray(args["conv_pool"])
    y_ref, pool_ref = _oracle(conv_reference.causal_conv1d_recurrent, args)
    step = jax.jit(prefill_mgpu.causal_conv1d, donate_argnames="conv_pool")
    pointer = args["conv_pool"].unsafe_buffer_pointer()
    y, pool = step(**args)
    assert pool.unsafe_buffer_pointer() == pointer, "the donated pool was copied, not aliased"
    y = np.asarray(y, np.float32)
    n_real = qsl[-1]
    assert np.isfinite(y).all()
    assert rel(y[:n_real], y_ref[:n_real]) < 1e-2
    assert not y[n_real:].any(), "padding tokens must give zeros"
    written = idx[lengths > 0]
    pool = np.asarray(pool)
    np.testing.assert_array_equal(bits(pool[written]), bits(pool_ref[written].astype(bf16)))
    others = np.setdiff1d(np.arange(SLOTS), written)
    np.testing.assert_array_equal(bits(pool[others]), bits(before[others]))
