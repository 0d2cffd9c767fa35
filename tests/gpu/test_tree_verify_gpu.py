"""Tree verify (parents ``[N, D]``) in the Mosaic GPU kernels on an sm_90 GPU, production shapes.

Qwen3-Next TP1 GDN (H=16, HV=32, K=V=128) and conv1d (C=8192, W=4); Nemotron-H 8B-like Mamba2
(H=128, P=64, G=8, N=128). bf16 activations, fp32 pools poisoned with NaN in every slot no row
names. The oracle is the tree reference in float64 (checked against per-node root-path chain
verifies in ``tests/kernels/test_tree_verify_kernels.py``); each row gets its own random tree,
the last rows are padding. Skipped where there is no sm_90 GPU (``-m gpu`` selects them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import bits, rel

from pallas_kernels import conv1d, gdn, mamba2
from pallas_kernels._common import on_hopper_gpu
from pallas_kernels.conv1d import reference as conv_reference
from pallas_kernels.gdn import reference as gdn_reference
from pallas_kernels.mamba2 import reference as m2_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not on_hopper_gpu(), reason="needs an sm_90 GPU"),
]

ROWS, PADDED, NODES, SLOTS = 16, 3, 4, 64


def _case(seed):
    """Random trees (parent of node i drawn from 0..i-1), distinct slots, padded last rows."""
    rng = np.random.default_rng(seed)
    parents = np.full((ROWS, NODES), -1, np.int32)
    for i in range(1, NODES):
        parents[:, i] = rng.integers(0, i, ROWS)
    idx = rng.permutation(np.arange(1, SLOTS))[:ROWS].astype(np.int32)
    idx[ROWS - PADDED :] = 0
    return rng, jnp.asarray(parents), idx


def _pool(rng, idx, shape, scale=0.3):
    pool = rng.standard_normal((SLOTS, *shape)).astype(np.float32) * scale
    pool[np.setdiff1d(np.arange(SLOTS), idx[idx > 0])] = np.nan
    return jnp.asarray(pool)


def _run_and_check(op, reference, args, parents, idx, tol, pool_name):
    """The kernel against the float64 tree reference; the pool is left as it was."""
    before = np.asarray(args[pool_name]).copy()
    got = jax.jit(functools.partial(op, impl="pallas"))(**args, parents=parents)
    with jax.enable_x64(True):
        wide = {
            k: jnp.asarray(v, jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v
            for k, v in args.items()
        }
        ref = jax.jit(reference)(**wide, parents=parents)
        ref = [np.asarray(r) for r in ref]
    real = idx != 0
    for name, x, r in zip(("outputs", "states"), got, ref, strict=True):
        x = np.asarray(x, np.float32)
        assert np.isfinite(x[real]).all(), f"NaN/inf in the {name}"
        assert rel(x[real], r[real]) < tol, f"{name}: rel err {rel(x[real], r[real]):.2e}"
        assert not x[~real].any(), f"padded rows must give zero {name}"
    np.testing.assert_array_equal(bits(args[pool_name]), bits(before))  # NaN slots included


def test_gdn_tree_verify_on_gpu_matches_reference():
    rng, parents, idx = _case(0)
    h, hv, k, v = 16, 32, 128, 128
    bf16 = jnp.bfloat16
    args = dict(
        q=jnp.asarray(rng.standard_normal((ROWS, NODES, h, k)), bf16),
        k=jnp.asarray(rng.standard_normal((ROWS, NODES, h, k)), bf16),
        v=jnp.asarray(rng.standard_normal((ROWS, NODES, hv, v)), bf16),
        g=jnp.asarray(-np.logaddexp(0, rng.standard_normal((ROWS, NODES, hv))), jnp.float32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((ROWS, NODES, hv)))), jnp.float32),
        ssm_pool=_pool(rng, idx, (hv, k, v)),
        state_indices=jnp.asarray(idx),
    )
    _run_and_check(
        gdn.verify_gated_delta_rule,
        gdn_reference.verify_gated_delta_rule,
        args,
        parents,
        idx,
        1e-2,
        "ssm_pool",
    )


def test_conv1d_tree_verify_on_gpu_matches_reference():
    rng, parents, idx = _case(1)
    channels, width = 8192, 4
    bf16 = jnp.bfloat16
    args = dict(
        x=jnp.asarray(rng.standard_normal((ROWS, NODES, channels)), bf16),
        weight=jnp.asarray(rng.standard_normal((channels, width)) * 0.5, bf16),
        bias=jnp.asarray(rng.standard_normal(channels), bf16),
        conv_pool=_pool(rng, idx, (channels, width - 1)).astype(bf16),
        state_indices=jnp.asarray(idx),
    )
    _run_and_check(
        conv1d.causal_conv1d_verify,
        conv_reference.causal_conv1d_verify,
        args,
        parents,
        idx,
        1e-2,
        "conv_pool",
    )


def test_mamba2_tree_verify_on_gpu_matches_reference():
    rng, parents, idx = _case(2)
    heads, p_dim, groups, n_dim = 128, 64, 8, 128
    bf16 = jnp.bfloat16
    args = dict(
        x=jnp.asarray(rng.standard_normal((ROWS, NODES, heads, p_dim)), bf16),
        dt=jnp.asarray(rng.standard_normal((ROWS, NODES, heads)), bf16),
        A=jnp.asarray(-np.exp(rng.uniform(-1.5, 1.0, heads)), jnp.float32),
        B=jnp.asarray(rng.standard_normal((ROWS, NODES, groups, n_dim)) / np.sqrt(n_dim), bf16),
        C=jnp.asarray(rng.standard_normal((ROWS, NODES, groups, n_dim)), bf16),
        D=jnp.asarray(rng.standard_normal(heads), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-3.0, 0.0, heads), jnp.float32),
        ssm_pool=_pool(rng, idx, (heads, p_dim, n_dim)),
        state_indices=jnp.asarray(idx),
    )
    _run_and_check(
        mamba2.verify_selective_state_update,
        m2_reference.verify_selective_state_update,
        args,
        parents,
        idx,
        1e-2,
        "ssm_pool",
    )
