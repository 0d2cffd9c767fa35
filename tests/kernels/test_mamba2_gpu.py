"""The Mamba2 Mosaic GPU kernels compiled and run on an sm_90 GPU, at production shapes.

Nemotron-H 8B-like: H=128, P=64, G=8, N=128, bf16 activations, fp32 ssm pool. Every kernel is
compared with the float64 oracle (on the same GPU, x64 enabled only inside ``_oracle``) by
``|out - ref| / |ref|``; pools are poisoned with NaN in every slot that must not be read, so a
wrong slot read shows as NaN and a stray write as a changed bit. Skipped where there is no
sm_90 GPU (``-m gpu`` selects them). Passed on an H200 (2026-11-29).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels._common import on_hopper_gpu
from pallas_kernels.mamba2 import reference, ssd_mgpu, state_update_mgpu

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

H, P, G, N = 128, 64, 8, 128
SLOTS = 300


def _params(rng):
    return dict(
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 1.0, H)), jnp.float32),
        D=jnp.asarray(rng.standard_normal(H), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-3.0, 0.0, H), jnp.float32),
    )


def _tokens(rng, lead):
    bf16 = jnp.bfloat16
    return dict(
        x=jnp.asarray(rng.standard_normal((*lead, H, P)), bf16),
        dt=jnp.asarray(rng.standard_normal((*lead, H)), bf16),
        B=jnp.asarray(rng.standard_normal((*lead, G, N)) / np.sqrt(N), bf16),
        C=jnp.asarray(rng.standard_normal((*lead, G, N)), bf16),
        z=jnp.asarray(rng.standard_normal((*lead, H, P)), bf16),
    )


def _oracle(fn, args):
    with jax.enable_x64(True):
        wide = {
            k: jnp.asarray(np.asarray(v, np.float64))
            if jnp.issubdtype(v.dtype, jnp.floating)
            else v
            for k, v in args.items()
        }
        return jax.tree.map(np.asarray, fn(**wide))


def _rows_case(seed, n, d, n_padded):
    rng = np.random.default_rng(seed)
    idx = rng.permutation(np.arange(1, SLOTS))[:n].astype(np.int32)
    idx[n - n_padded :] = 0
    pool = rng.standard_normal((SLOTS, H, P, N), np.float32)
    pool[np.setdiff1d(np.arange(SLOTS), idx[idx > 0])] = np.nan
    args = {**_tokens(rng, (n, d)), **_params(rng)}
    return {**args, "ssm_pool": jnp.asarray(pool), "state_indices": jnp.asarray(idx)}, idx


def test_decode_at_batch_256_matches_oracle_in_place():
    args, idx = _rows_case(0, 256, 1, n_padded=6)
    before = np.asarray(args["ssm_pool"]).copy()
    fn = jax.jit(state_update_mgpu.selective_state_update, donate_argnames=("ssm_pool",))
    y, pool = fn(**{**args, "ssm_pool": jnp.asarray(before)})
    y_ref, pool_ref = _oracle(reference.selective_state_update, args)
    real = idx != 0
    assert rel(y[real], y_ref[real]) < 1e-2
    assert not np.asarray(y, np.float32)[~real].any()
    assert rel(pool[idx[real]], pool_ref[idx[real]]) < 1e-5
    others = np.setdiff1d(np.arange(SLOTS), idx[real])
    np.testing.assert_array_equal(bits(pool[others]), bits(before[others]))


def test_verify_matches_oracle():
    args, idx = _rows_case(1, 16, 4, n_padded=2)
    y, inter = jax.jit(state_update_mgpu.verify_selective_state_update)(**args)
    y_ref, inter_ref = _oracle(reference.verify_selective_state_update, args)
    real = idx != 0
    assert rel(y[real], y_ref[real]) < 1e-2
    assert rel(inter[real], inter_ref[real]) < 1e-5
    assert not np.asarray(inter)[~real].any()


def test_ssd_chunk_scan_varlen_matches_oracle():
    rng = np.random.default_rng(2)
    lengths = (1, 300, 0, 1000, 77, 0)
    n = len(lengths)
    t_total = sum(lengths) + 11
    slots = rng.permutation(np.arange(1, SLOTS))[:n].astype(np.int32)
    slots[-1] = 0
    has_init = np.array([True, False, True, True, False, True])
    pool = rng.standard_normal((SLOTS, H, P, N), np.float32)
    pool[np.setdiff1d(np.arange(SLOTS), slots[has_init & (slots > 0)])] = np.nan
    args = {**_tokens(rng, (t_total,)), **_params(rng)}
    args.update(
        ssm_pool=jnp.asarray(pool),
        qsl=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32),
        state_indices=jnp.asarray(slots),
        has_initial_state=jnp.asarray(has_init),
    )
    y, new_pool = jax.jit(ssd_mgpu.ssd_chunk_scan)(**args)
    y_ref, pool_ref = _oracle(reference.ssd_chunk_scan_recurrent, args)
    end = sum(lengths)
    assert rel(y[:end], y_ref[:end]) < 1e-2
    assert not np.asarray(y, np.float32)[end:].any()
    written = np.array([s for s, length in zip(slots, lengths, strict=True) if length])
    assert rel(new_pool[written], pool_ref[written]) < 1e-2
    others = np.setdiff1d(np.arange(SLOTS), written)
    np.testing.assert_array_equal(bits(new_pool[others]), bits(pool[others]))
