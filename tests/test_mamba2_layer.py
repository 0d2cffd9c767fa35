"""The Mamba2 mixer: a float64 oracle from a saved state, its grouped norm, its config (the modes
it runs: test_step_modes.py, beside the GDN stack)."""

from __future__ import annotations

import dataclasses

import _stack_modes as stack
import jax.numpy as jnp
import numpy as np
import pytest
from _stack_modes import MAMBA2_CONFIG as CONFIG
from _stack_modes import NUM_SLOTS, POLICY, fresh_pool, tokens
from flax import nnx

from hybrid_jax.layers.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer
from hybrid_jax.metadata import RowSpec, build_metadata
from hybrid_jax.modes import CAPABILITIES, ForwardMode, LayerKind

M = ForwardMode


@pytest.fixture(scope="module")
def setup():
    return stack.build("mamba2")


# ---------------------------------------------------------------- float64 oracle


def oracle_mixer(mixer: Mamba2Mixer, x, conv0, ssm0):
    """The mixer on one sequence, token by token in float64 numpy, from window ``conv0``
    ``[C, W-1]`` and state ``ssm0`` ``[H, P, N]``. Returns (y, final window, final state)."""
    c = mixer.config
    f = lambda v: np.asarray(v.get_value(), np.float64)  # noqa: E731
    h, p, g, n = c.num_heads, c.head_dim, c.n_groups, c.state_size
    proj = x.astype(np.float64) @ f(mixer.in_proj.kernel)
    z, xbc, dt = np.split(proj, [c.inner_dim, c.inner_dim + c.conv_dim], axis=-1)
    window = conv0.astype(np.float64).T  # [W-1, C], oldest first
    state = ssm0.astype(np.float64)
    A = -np.exp(f(mixer.A_log))
    ys = []
    for t in range(len(x)):
        ext = np.concatenate([window, xbc[t : t + 1]])  # [W, C]
        window = ext[1:]
        u = (ext * f(mixer.conv_weight).T).sum(0) + f(mixer.conv_bias)
        u = u / (1 + np.exp(-u))
        xs = u[: c.inner_dim].reshape(h, p)
        b = np.repeat(u[c.inner_dim : c.inner_dim + g * n].reshape(g, n), h // g, axis=0)
        cc = np.repeat(u[c.inner_dim + g * n :].reshape(g, n), h // g, axis=0)
        step = np.log1p(np.exp(dt[t] + f(mixer.dt_bias)))
        step = np.clip(step, *c.time_step_limit)
        state = np.exp(step * A)[:, None, None] * state + step[:, None, None] * np.einsum(
            "hp,hn->hpn", xs, b
        )
        y = np.einsum("hpn,hn->hp", state, cc) + f(mixer.D)[:, None] * xs
        gated = y.reshape(-1) * z[t] / (1 + np.exp(-z[t]))
        grouped = gated.reshape(g, -1)
        normed = grouped / np.sqrt((grouped**2).mean(-1, keepdims=True) + c.rms_norm_eps)
        ys.append((normed.reshape(-1) * f(mixer.norm.weight)) @ f(mixer.out_proj.kernel))
    return np.stack(ys), window.T, state


def test_layer_matches_float64_oracle_from_a_saved_state(setup):
    model, _, hidden = setup
    mixer = model.mixers[0]
    pool = fresh_pool(model, 11)
    x = tokens(7, hidden, 12)
    slot = 4
    meta = build_metadata(M.EXTEND, [RowSpec(slot, 5, 7)], POLICY, num_slots=NUM_SLOTS)
    xp = jnp.zeros((meta.num_tokens, hidden)).at[:7].set(x)
    # Jitted: eager op-by-op dispatch of the scan costs far more than one compile.
    forward = nnx.jit(lambda m, *args: m(*args, impl="reference"))
    out = forward(mixer, xp, pool.conv[0], pool.ssm[0], meta)
    want_y, want_conv, want_ssm = oracle_mixer(
        mixer, x, np.asarray(pool.conv[0][slot]), np.asarray(pool.ssm[0][slot])
    )
    np.testing.assert_allclose(np.asarray(out.y)[:7], want_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.conv_state[slot]), want_conv, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out.ssm_state[slot]), want_ssm, rtol=1e-4, atol=1e-5)
    # The clip is active in this test: without it some steps would be below the floor.
    raw = (x @ np.asarray(mixer.in_proj.kernel.get_value()))[:, -CONFIG.num_heads :]
    assert (np.log1p(np.exp(raw + np.asarray(mixer.dt_bias.get_value()))) < 0.05).any()


def test_grouped_gated_norm_normalises_each_group_after_the_gate():
    norm = GroupedGatedRMSNorm(8, 2, eps=1e-6)
    norm.weight.set_value(jnp.arange(1.0, 9.0))
    rng = np.random.default_rng(0)
    x, gate = rng.standard_normal((3, 8)), rng.standard_normal((3, 8))
    got = np.asarray(norm(jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32)))
    h = (x * gate / (1 + np.exp(-gate))).reshape(3, 2, 4)
    want = (h / np.sqrt((h**2).mean(-1, keepdims=True) + 1e-6)).reshape(3, 8) * np.arange(1, 9)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(ValueError, match="does not split into n_groups=3"):
        GroupedGatedRMSNorm(8, 3)


def test_mamba2_runs_exactly_the_modes_gdn_runs():
    assert CAPABILITIES[LayerKind.MAMBA2] == CAPABILITIES[LayerKind.GDN]


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="mamba_num_heads=6 is not a multiple of n_groups=4"):
        dataclasses.replace(CONFIG, num_heads=6, n_groups=4)
    with pytest.raises(ValueError, match="time_step_limit"):
        dataclasses.replace(CONFIG, time_step_limit=(0.1, 0.01))
