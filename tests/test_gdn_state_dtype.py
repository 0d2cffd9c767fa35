"""GDN states kept at a narrower precision (Qwen3.5's ``mamba_ssm_dtype``): the pools stay
float32, and every state a step writes is rounded to the model's precision, which is what
storing it narrow gives. Each mode is compared with the float32 run on the same inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.backend import GDNDims, gdn_mix
from hybrid_jax.layers.gdn import GDNConfig
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.hf_config import ConfigError
from hybrid_jax.models.qwen3_next import tiny_qwen3_next_config
from hybrid_jax.modes import ForwardMode

DIMS = GDNDims(num_key_heads=1, num_value_heads=2, head_k_dim=16, head_v_dim=16)
SLOTS, WIDTH = 7, 4
POLICY = BucketPolicy(batch_buckets=(4,), token_buckets=(16,), num_draft_tokens=2)
# Three real rows at scattered slots (slot 3 a fresh prompt), the bucket adds a padded row.
ROWS = {
    ForwardMode.EXTEND: (RowSpec(5, 3, 4), RowSpec(2, 0, 6), RowSpec(6, 1, 2)),
    ForwardMode.DECODE: (RowSpec(5, 3, 1), RowSpec(2, 9, 1), RowSpec(6, 1, 1)),
    ForwardMode.TARGET_VERIFY: (RowSpec(5, 3, 2), RowSpec(2, 9, 2), RowSpec(6, 1, 2)),
}


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint32)


def _run(mode, dims, seed=0):
    meta = build_metadata(mode, ROWS[mode], POLICY, num_slots=SLOTS)
    channels = 2 * DIMS.key_dim + DIMS.value_dim
    keys = jax.random.split(jax.random.key(seed), 8)
    t, hv = meta.num_tokens, DIMS.num_value_heads
    args = (
        jax.random.normal(keys[0], (t, channels)),
        jax.random.normal(keys[1], (channels, WIDTH)) * 0.5,
        jax.random.normal(keys[2], (2, hv)),  # [A_log; dt_bias]
        jax.random.normal(keys[3], (t, 2 * hv)),
        jax.random.normal(keys[6], (SLOTS, channels, WIDTH - 1)),
        jax.random.normal(keys[7], (SLOTS, hv, DIMS.head_k_dim, DIMS.head_v_dim)) * 0.3,
    )
    result = jax.jit(gdn_mix, static_argnames=("dims", "impl"))(*args, meta, dims, impl="reference")
    return args[-1], result, np.asarray(meta.state_indices)


def _rounded(x):
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_a_step_rounds_the_states_it_writes_and_no_other(mode):
    before, wide, slots = _run(mode, DIMS)
    _, narrow, _ = _run(mode, DIMS._replace(state_dtype="bfloat16"))
    real = slots[slots != 0]
    # The step's outputs come from the states as read: the same bits.
    np.testing.assert_array_equal(_bits(narrow.out), _bits(wide.out))
    np.testing.assert_array_equal(_bits(narrow.conv_state), _bits(wide.conv_state))
    wide_ssm, narrow_ssm = np.asarray(wide.ssm_state), np.asarray(narrow.ssm_state)
    assert not np.array_equal(wide_ssm[real], _rounded(wide_ssm[real]))  # rounding shows
    np.testing.assert_array_equal(_bits(narrow_ssm[real]), _bits(_rounded(wide_ssm[real])))
    others = np.setdiff1d(np.arange(SLOTS), real)  # the pad slot 0 among them
    np.testing.assert_array_equal(_bits(narrow_ssm[others]), _bits(np.asarray(before)[others]))


def test_a_verify_step_hands_the_commit_rounded_states_and_leaves_the_pool():
    before, wide, _ = _run(ForwardMode.TARGET_VERIFY, DIMS)
    _, narrow, _ = _run(ForwardMode.TARGET_VERIFY, DIMS._replace(state_dtype="bfloat16"))
    np.testing.assert_array_equal(_bits(narrow.out), _bits(wide.out))
    np.testing.assert_array_equal(_bits(narrow.ssm_state), _bits(before))
    states = np.asarray(wide.verify.ssm)
    np.testing.assert_array_equal(_bits(narrow.verify.ssm), _bits(_rounded(states)))


def test_the_model_config_carries_the_precision_to_its_layers():
    config = tiny_qwen3_next_config()
    assert config.gdn_config().dims.state_dtype == "float32"
    narrow = type(config).from_hf_dict({**config.to_hf_dict(), "mamba_ssm_dtype": "bfloat16"})
    assert narrow.gdn_config().dims.state_dtype == "bfloat16"
    with pytest.raises(ConfigError, match=r"mamba_ssm_dtype='int8': .* one of \['float32'"):
        type(config).from_hf_dict({**config.to_hf_dict(), "mamba_ssm_dtype": "int8"})
    with pytest.raises(ValueError, match="mamba_ssm_dtype='float64'"):
        GDNConfig(64, 2, 4, 16, 16, state_dtype="float64")
