"""Tree drafts in the verify ops (GDN, conv1d, Mamba2): references and Mosaic GPU kernels.

The oracle of a tree is the chain: node i of a tree must give what a chain verify of its root
path (root, ..., parent, i) gives at its last token, computed in float64 by the chain
reference on the path's inputs. The kernels run under the Mosaic GPU interpreter against that
oracle (unwritten outputs show as NaN there) and are lowered for ``cuda`` on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _compare import rel

from pallas_kernels import conv1d, gdn, mamba2
from pallas_kernels.conv1d import reference as conv_reference
from pallas_kernels.conv1d import update_mgpu
from pallas_kernels.gdn import recurrent_mgpu
from pallas_kernels.gdn import reference as gdn_reference
from pallas_kernels.mamba2 import reference as m2_reference
from pallas_kernels.mamba2 import state_update_mgpu

# Rows' trees: a branching tree, a chain, and a star (every draft a child of the root).
TREES = np.array([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]], np.int32)
SLOTS = np.array([3, 0, 5], np.int32)  # row 1 is padded
NUM_SLOTS = 7


def _path(parents_row: np.ndarray, node: int) -> list[int]:
    path = [node]
    while parents_row[path[0]] >= 0:
        path.insert(0, int(parents_row[path[0]]))
    return path


def _path_oracle(chain_verify, tokens: dict, shared: dict, parents: np.ndarray):
    """Every node's (output, state) from a float64 chain verify of its root path.

    tokens: per-token inputs ``[N, D, ...]``; shared: the rest (pool, weights), with
    ``state_indices`` among them. Returns two ``[N, D, ...]`` arrays.
    """
    with jax.enable_x64(True):
        wide = lambda a: jnp.asarray(np.asarray(a, np.float64))  # noqa: E731
        slots = np.asarray(shared["state_indices"])
        rest = {k: (None if v is None else wide(v)) for k, v in shared.items()}
        n_rows, n_nodes = parents.shape
        outs = np.zeros((n_rows, n_nodes), object)
        for r in range(n_rows):
            for i in range(n_nodes):
                if slots[r] == 0:  # a padded row: zeros, like the ops
                    outs[r, i] = None
                    continue
                path = _path(parents[r], i)
                sliced = {
                    k: wide(np.asarray(v, np.float64)[r : r + 1][:, path])
                    for k, v in tokens.items()
                }
                rest["state_indices"] = jnp.asarray(slots[r : r + 1])
                out, states = jax.jit(chain_verify)(**sliced, **rest)
                outs[r, i] = (np.asarray(out)[0, -1], np.asarray(states)[0, -1])
    real = next(o for o in outs.flat if o is not None)
    pick = lambda o, j: np.zeros_like(real[j]) if o is None else o[j]  # noqa: E731
    first = np.stack([np.stack([pick(o, 0) for o in row]) for row in outs])
    second = np.stack([np.stack([pick(o, 1) for o in row]) for row in outs])
    return first, second


def _pool(rng, shape, dtype):
    """Random slots named by SLOTS, NaN in every other slot (slot 0 included)."""
    pool = rng.standard_normal((NUM_SLOTS, *shape)).astype(np.float32) * 0.5
    pool[np.setdiff1d(np.arange(NUM_SLOTS), SLOTS[SLOTS > 0])] = np.nan
    return jnp.asarray(pool, dtype)


def _check_tree(out, states, oracle, tol):
    """Real rows match the path oracle node by node; padded rows are zeros."""
    real = SLOTS != 0
    o_ref, s_ref = oracle
    for i in range(TREES.shape[1]):
        assert rel(out[real, i], o_ref[real, i]) < tol, f"output of node {i}"
        assert rel(states[real, i], s_ref[real, i]) < tol, f"state of node {i}"
    assert not np.asarray(out, np.float32)[~real].any()
    assert not np.asarray(states, np.float32)[~real].any()


def _same_as_chain(fn, tokens, shared) -> None:
    """Chain parents reproduce the chain verify: bit for bit in the kernel (the same
    arithmetic, the state round-tripping through SMEM), within float32 rounding in the
    reference (XLA fuses the gathers between steps differently)."""
    chain = jnp.asarray(np.tile(TREES[1], (TREES.shape[0], 1)))
    for impl in ("reference", "interpret"):
        run = jax.jit(functools.partial(fn, impl=impl))
        plain, tree = run(**tokens, **shared), run(**tokens, **shared, parents=chain)
        for a, b in zip(plain, tree, strict=True):
            if impl == "interpret":
                np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
            else:
                assert rel(b, a) < 1e-6


# ---------------------------------------------------------------------------------- GDN


def _gdn_case(seed, dtype=jnp.float32, kd=64, vd=64):
    rng = np.random.default_rng(seed)
    n, d, h, hv = *TREES.shape, 1, 2
    tokens = dict(
        q=jnp.asarray(rng.standard_normal((n, d, h, kd)), dtype),
        k=jnp.asarray(rng.standard_normal((n, d, h, kd)), dtype),
        v=jnp.asarray(rng.standard_normal((n, d, hv, vd)), dtype),
        g=jnp.asarray(-np.log1p(np.exp(rng.standard_normal((n, d, hv)))), jnp.float32),
        beta=jnp.asarray(1 / (1 + np.exp(-rng.standard_normal((n, d, hv)))), jnp.float32),
    )
    shared = dict(ssm_pool=_pool(rng, (hv, kd, vd), jnp.float32), state_indices=jnp.asarray(SLOTS))
    return tokens, shared


def test_gdn_tree_reference_follows_each_nodes_root_path():
    tokens, shared = _gdn_case(0)
    fn = jax.jit(functools.partial(gdn.verify_gated_delta_rule, impl="reference"))
    out = fn(**tokens, **shared, parents=jnp.asarray(TREES))
    oracle = _path_oracle(gdn_reference.verify_gated_delta_rule, tokens, shared, TREES)
    _check_tree(*out, oracle, 1e-5)


def test_gdn_tree_kernel_matches_oracle_and_leaves_pool_untouched():
    tokens, shared = _gdn_case(1, jnp.bfloat16)
    before = np.asarray(shared["ssm_pool"]).copy()
    fn = functools.partial(gdn.verify_gated_delta_rule, impl="interpret")
    out = jax.jit(fn)(**tokens, **shared, parents=jnp.asarray(TREES))
    oracle = _path_oracle(gdn_reference.verify_gated_delta_rule, tokens, shared, TREES)
    _check_tree(*out, oracle, 1e-2)
    np.testing.assert_array_equal(np.asarray(shared["ssm_pool"]), before)


def test_gdn_chain_parents_give_the_chain_verify():
    _same_as_chain(gdn.verify_gated_delta_rule, *_gdn_case(2))


def test_gdn_verify_rejects_parents_of_the_wrong_shape():
    tokens, shared = _gdn_case(3)
    with pytest.raises(ValueError, match=r"parents.shape=\(3, 3\) must be \[N, D\]=\(3, 4\)"):
        gdn.verify_gated_delta_rule(**tokens, **shared, parents=jnp.zeros((3, 3), jnp.int32))


# ---------------------------------------------------------------------------------- conv1d


def _conv_case(seed, dtype=jnp.float32, channels=128, width=4):
    rng = np.random.default_rng(seed)
    n, d = TREES.shape
    tokens = dict(x=jnp.asarray(rng.standard_normal((n, d, channels)), dtype))
    shared = dict(
        weight=jnp.asarray(rng.standard_normal((channels, width)) * 0.5, dtype),
        bias=jnp.asarray(rng.standard_normal(channels), dtype),
        conv_pool=_pool(rng, (channels, width - 1), dtype),
        state_indices=jnp.asarray(SLOTS),
    )
    return tokens, shared


@pytest.mark.parametrize("impl, dtype, tol", [("reference", jnp.float32, 1e-6),
                                              ("interpret", jnp.bfloat16, 1e-2)])  # fmt: skip
def test_conv1d_tree_window_is_the_root_path(impl, dtype, tol):
    tokens, shared = _conv_case(4, dtype)
    fn = jax.jit(functools.partial(conv1d.causal_conv1d_verify, impl=impl))
    y, windows = fn(**tokens, **shared, parents=jnp.asarray(TREES))
    oracle = _path_oracle(conv_reference.causal_conv1d_verify, tokens, shared, TREES)
    _check_tree(y, windows, oracle, tol)


def test_conv1d_chain_parents_give_the_chain_verify():
    _same_as_chain(conv1d.causal_conv1d_verify, *_conv_case(5))


# ---------------------------------------------------------------------------------- Mamba2


def _m2_case(seed, dtype=jnp.float32, p_dim=64, n_dim=64):
    rng = np.random.default_rng(seed)
    n, d, heads, groups = *TREES.shape, 2, 1
    f32 = jnp.float32
    tokens = dict(
        x=jnp.asarray(rng.standard_normal((n, d, heads, p_dim)), dtype),
        dt=jnp.asarray(rng.standard_normal((n, d, heads)), f32),
        B=jnp.asarray(rng.standard_normal((n, d, groups, n_dim)), dtype),
        C=jnp.asarray(rng.standard_normal((n, d, groups, n_dim)), dtype),
    )
    shared = dict(
        A=-jnp.asarray(rng.uniform(0.5, 2.0, heads), f32),
        D=jnp.asarray(rng.standard_normal(heads), f32),
        dt_bias=jnp.asarray(rng.standard_normal(heads), f32),
        ssm_pool=_pool(rng, (heads, p_dim, n_dim), f32),
        state_indices=jnp.asarray(SLOTS),
    )
    return tokens, shared


@pytest.mark.parametrize("impl, dtype, tol", [("reference", jnp.float32, 1e-5),
                                              ("interpret", jnp.bfloat16, 1e-2)])  # fmt: skip
def test_mamba2_tree_follows_each_nodes_root_path(impl, dtype, tol):
    tokens, shared = _m2_case(6, dtype)
    fn = jax.jit(functools.partial(mamba2.verify_selective_state_update, impl=impl))
    out = fn(**tokens, **shared, parents=jnp.asarray(TREES))
    oracle = _path_oracle(m2_reference.verify_selective_state_update, tokens, shared, TREES)
    _check_tree(*out, oracle, tol)


def test_mamba2_chain_parents_give_the_chain_verify():
    _same_as_chain(mamba2.verify_selective_state_update, *_m2_case(7))


def test_mamba2_kernel_refuses_a_tree_too_big_for_smem_and_the_reference_takes_it():
    tokens, shared = _m2_case(8, n_dim=128)
    n = TREES.shape[0]
    deep = {k: jnp.concatenate([v, v], axis=1) for k, v in tokens.items()}  # Dt = 8
    parents = jnp.asarray(np.tile(np.arange(-1, 7), (n, 1)), jnp.int32)
    args = dict(**deep, **shared, parents=parents)
    reason = state_update_mgpu.unsupported_reason(**args)
    assert reason is not None and "a tree of Dt=8 tokens needs Dt+1 state tiles" in reason
    with pytest.raises(NotImplementedError, match="at most Dt=4 with N=128"):
        mamba2.verify_selective_state_update(**args, impl="interpret")
    y, _ = mamba2.verify_selective_state_update(**args, impl="reference")
    assert np.isfinite(np.asarray(y)).all()


# ---------------------------------------------------------------------------------- lowering


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _lower_for_cuda(fn, args):
    jax.jit(fn).trace(**args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("n, d", [(16, 4), (2, 8)], ids=str)
def test_gdn_tree_verify_lowers_for_cuda(n, d):
    bf16, f32, h, hv, kd = jnp.bfloat16, jnp.float32, 16, 32, 128
    args = dict(
        q=_sds((n, d, h, kd), bf16), k=_sds((n, d, h, kd), bf16), v=_sds((n, d, hv, kd), bf16),
        g=_sds((n, d, hv), f32), beta=_sds((n, d, hv), f32), ssm_pool=_sds((64, hv, kd, kd), f32),
        state_indices=_sds((n,), jnp.int32), parents=_sds((n, d), jnp.int32),
    )  # fmt: skip
    assert recurrent_mgpu.unsupported_reason(**args) is None
    _lower_for_cuda(recurrent_mgpu.verify_gated_delta_rule, args)


def test_conv1d_tree_verify_lowers_for_cuda():
    bf16, n, d, c = jnp.bfloat16, 8, 4, 1024
    args = dict(
        x=_sds((n, d, c), bf16), weight=_sds((c, 4), bf16), bias=None,
        conv_pool=_sds((64, c, 3), bf16), state_indices=_sds((n,), jnp.int32),
        parents=_sds((n, d), jnp.int32),
    )  # fmt: skip
    assert update_mgpu.unsupported_reason(**args) is None
    _lower_for_cuda(update_mgpu.causal_conv1d_verify, args)


def test_mamba2_tree_verify_lowers_for_cuda():
    bf16, f32, n, d, heads, groups, nd = jnp.bfloat16, jnp.float32, 8, 4, 64, 8, 128
    args = dict(
        x=_sds((n, d, heads, 64), bf16), dt=_sds((n, d, heads), bf16), A=_sds((heads,), f32),
        B=_sds((n, d, groups, nd), bf16), C=_sds((n, d, groups, nd), bf16), D=_sds((heads,), f32),
        dt_bias=_sds((heads,), f32), ssm_pool=_sds((64, heads, 64, nd), f32),
        state_indices=_sds((n,), jnp.int32), parents=_sds((n, d), jnp.int32),
    )  # fmt: skip
    assert state_update_mgpu.unsupported_reason(**args) is None
    _lower_for_cuda(state_update_mgpu.verify_selective_state_update, args)
