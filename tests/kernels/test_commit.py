"""The commit after speculative verification: one rule for every pool, and each op's entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import conv1d, gdn, mamba2

S = 13
# Each commit with the trailing dims of its pool: the GDN state [HV, K, V], the Mamba2 state
# [H, P, N], a conv window [C, W-1], and the generic op on any of them.
COMMITS = {
    "gdn.commit_states": (gdn.commit_states, (4, 6, 5)),
    "mamba2.commit_states": (mamba2.commit_states, (4, 4, 8)),
    "conv1d.commit_windows": (conv1d.commit_windows, (12, 3)),
    "commit_states (GDN pool)": (pallas_kernels.commit_states, (4, 6, 5)),
    "commit_states (bf16 conv pool)": (pallas_kernels.commit_states, (12, 3)),
}


@pytest.mark.parametrize("name", list(COMMITS))
def test_commit_writes_exactly_the_accepted_states(name):
    op, dims = COMMITS[name]
    dtype = jnp.bfloat16 if "bf16" in name else np.float32
    rng = np.random.default_rng(7)
    pool = rng.normal(size=(S, *dims)).astype(dtype)
    pool[0] = np.nan  # the pad slot: never read, never written
    per_step = rng.normal(size=(5, 4, *dims)).astype(dtype)
    slots = np.array([3, 8, 12, 6, 0], np.int32)
    accepted = np.array([2, 0, -1, 3, 1], np.int32)  # row 4 is padded: slot 0 is never written
    new_pool = np.asarray(jax.jit(op)(pool, per_step, slots, accepted))
    expected = pool.copy()
    for n in range(4):
        if accepted[n] >= 0:
            expected[slots[n]] = per_step[n, accepted[n]]
    np.testing.assert_array_equal(new_pool, expected)


def test_the_generic_commit_names_what_breaks_its_rule():
    pool = np.zeros((S, 4, 3), np.float32)
    per_step = np.zeros((2, 3, 4, 3), np.float32)
    rows, steps = np.array([1, 2], np.int32), np.zeros(2, np.int32)
    commit = pallas_kernels.commit_states
    with pytest.raises(ValueError, match=r"commit_states: per_step.shape=\(2, 3, 4, 2\) must be"):
        commit(pool, per_step[..., :2], rows, steps)
    with pytest.raises(ValueError, match=r"per_step.shape=\(2, 0, 4, 3\) .* D >= 1"):
        commit(pool, per_step[:, :0], rows, steps)
    with pytest.raises(ValueError, match="per_step.dtype=float16 must equal pool.dtype=float32"):
        commit(pool, per_step.astype(np.float16), rows, steps)
    with pytest.raises(ValueError, match=r"state_indices.shape=\(3,\) must be \(2,\)"):
        commit(pool, per_step, np.arange(3, dtype=np.int32), steps)
    with pytest.raises(ValueError, match="accepted_steps.dtype=int64 must be int32"):
        commit(pool, per_step, rows, steps.astype(np.int64))
    with pytest.raises(NotImplementedError, match="commit_states: impl='pallas' cannot take"):
        commit(pool, per_step, rows, steps, impl="pallas")
