"""The Mamba2 mixer through every forward mode: a float64 oracle, mode equivalences, pools."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.backend import VerifyStack
from hybrid_jax.engine.step import StepFunctions
from hybrid_jax.layers.mamba2 import GroupedGatedRMSNorm, Mamba2Config, Mamba2Mixer
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.models.decoder import LayerStates
from hybrid_jax.modes import CAPABILITIES, ForwardMode, LayerKind, UnsupportedForwardModeError
from hybrid_jax.state_pool import StatePool, init_state_pool

M = ForwardMode
D = 3
NUM_SLOTS = 9
POLICY = BucketPolicy(batch_buckets=(1, 2, 4), token_buckets=(8, 16, 32), num_draft_tokens=D)
TOL = dict(rtol=2e-5, atol=2e-5)
# 4 heads of 8 in 2 groups of state 8; the time-step floor is high enough that some steps clip.
CONFIG = Mamba2Config(
    hidden_size=32, num_heads=4, head_dim=8, n_groups=2, state_size=8, conv_kernel=4,
    time_step_limit=(0.05, float("inf")), rms_norm_eps=1e-5,
)  # fmt: skip


class StackOutput(NamedTuple):
    hidden: jax.Array
    pool: StatePool
    verify: tuple[VerifyStack, ...]


class Mamba2Stack(nnx.Module):
    """Two residual Mamba2 mixers: the smallest model the step functions serve."""

    def __init__(self, config: Mamba2Config, *, rngs: nnx.Rngs):
        self.config = config
        self.mixers = nnx.List([Mamba2Mixer(config, rngs=rngs) for _ in range(2)])
        for mixer in self.mixers:  # every parameter away from its identity value
            h = config.num_heads
            mixer.A_log.set_value(jnp.log(jax.random.uniform(rngs.params(), (h,), minval=0.5,
                                                             maxval=4.0)))  # fmt: skip
            mixer.D.set_value(jax.random.normal(rngs.params(), (h,)))
            mixer.dt_bias.set_value(jax.random.uniform(rngs.params(), (h,), minval=-3.0,
                                                       maxval=1.0))  # fmt: skip
            w = mixer.norm.weight
            w.set_value(1.0 + 0.2 * jax.random.normal(rngs.params(), w.get_value().shape))

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return (LayerKind.MAMBA2,) * len(self.mixers)

    def state_specs(self):
        return (self.config.state_spec(),) * len(self.mixers)

    def __call__(self, x, pool, meta, *, impl="auto"):
        states = LayerStates(
            pool, None, num_linear=len(self.mixers), num_attention=0, linear_name="Mamba2"
        )
        for mixer in self.mixers:
            x = x + states.linear(mixer, x, meta, impl=impl)
        pool, _, verify = states.updated()
        return StackOutput(x, pool, verify)


@pytest.fixture(scope="module")
def setup():
    model = Mamba2Stack(CONFIG, rngs=nnx.Rngs(0))
    return model, StepFunctions(model, impl="reference"), CONFIG.hidden_size


def fresh_pool(model, seed=0):
    """A pool whose every slot holds random (non-zero) states, so stale reads show."""
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree.map(lambda a: jax.random.normal(next(keys), a.shape, a.dtype), pool)


def host(pool):
    return jax.tree.map(np.array, pool)


def slot_states(pool, slot):
    return [np.asarray(a[slot]) for a in (*pool.conv, *pool.ssm)]


def run(steps, pool, mode, rows, x_tokens, **bucket):
    """Runs one step on ``rows``; x_tokens is the real tokens' hidden states, packed."""
    meta = build_metadata(mode, rows, POLICY, num_slots=NUM_SLOTS, **bucket)
    x = np.zeros((meta.num_tokens, x_tokens.shape[-1]), np.float32)
    n = int(np.asarray(meta.query_start_loc)[len(rows)])
    x[:n] = x_tokens
    out = steps(pool, jnp.asarray(x), meta)
    return np.asarray(out.hidden)[:n], out


def tokens(n, hidden, seed):
    return np.random.default_rng(seed).standard_normal((n, hidden)).astype(np.float32)


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


# ---------------------------------------------------------------- mode equivalence


def test_one_extend_equals_two_chunks_decodes_verify_commit_and_mixed(setup):
    model, steps, hidden = setup
    seq = tokens(13, hidden, 1)
    slot = 5

    whole, out = run(steps, fresh_pool(model), M.EXTEND, [RowSpec(slot, 0, 13)], seq)
    want = slot_states(out.pool, slot)

    def check(got_hidden, pool):
        np.testing.assert_allclose(got_hidden, whole, **TOL)
        for got, ref in zip(slot_states(pool, slot), want, strict=True):
            np.testing.assert_allclose(got, ref, **TOL)

    a, out = run(steps, fresh_pool(model, 1), M.EXTEND, [RowSpec(slot, 0, 6)], seq[:6])
    b, out = run(steps, out.pool, M.EXTEND, [RowSpec(slot, 6, 7)], seq[6:])
    check(np.concatenate([a, b]), out.pool)

    parts = []
    part, out = run(steps, fresh_pool(model, 2), M.EXTEND, [RowSpec(slot, 0, 9)], seq[:9])
    parts.append(part)
    for t in range(9, 13):
        part, out = run(steps, out.pool, M.DECODE, [RowSpec(slot, t, 1)], seq[t : t + 1])
        parts.append(part)
    check(np.concatenate(parts), out.pool)

    prefix = 13 - D
    a, out = run(steps, fresh_pool(model, 3), M.EXTEND, [RowSpec(slot, 0, prefix)], seq[:prefix])
    before = host(out.pool)
    b, out = run(steps, out.pool, M.TARGET_VERIFY, [RowSpec(slot, prefix, D)], seq[prefix:])
    for got, ref in zip(jax.tree.leaves(host(out.pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, ref)  # verify leaves the pool untouched
    assert [v.layers for v in out.verify] == [(0,), (1,)]
    assert out.verify[0].ssm.shape[2:] == (D, 4, 8, 8)
    meta = build_metadata(M.TARGET_VERIFY, [RowSpec(slot, prefix, D)], POLICY, num_slots=NUM_SLOTS)
    accepted = jnp.full((meta.batch_size,), -1, jnp.int32).at[0].set(D - 1)
    pool = steps.commit(out.pool, out.verify, meta.state_indices, accepted)
    check(np.concatenate([a, b]), pool)

    other = tokens(8, hidden, 7)
    a, out = run(steps, fresh_pool(model, 4), M.EXTEND, [RowSpec(slot, 0, 12)], seq[:12])
    mixed_rows = [RowSpec(2, 0, 8), RowSpec(slot, 12, 1)]
    b, out = run(steps, out.pool, M.MIXED, mixed_rows, np.concatenate([other, seq[12:]]))
    check(np.concatenate([a, b[8:]]), out.pool)
    alone, alone_out = run(steps, fresh_pool(model, 5), M.EXTEND, [RowSpec(2, 0, 8)], other)
    np.testing.assert_allclose(b[:8], alone, **TOL)
    for got, ref in zip(slot_states(out.pool, 2), slot_states(alone_out.pool, 2), strict=True):
        np.testing.assert_allclose(got, ref, **TOL)


def test_draft_extend_equals_extend(setup):
    model, steps, hidden = setup
    seq = tokens(10, hidden, 3)
    _, base = run(steps, fresh_pool(model), M.EXTEND, [RowSpec(4, 0, 8)], seq[:8])
    pool = base.pool
    x = np.concatenate([tokens(8, hidden, 4)[:2], seq[8:]])
    rows = [RowSpec(3, 0, 2), RowSpec(4, 8, 2)]
    got, out_draft = run(steps, jax.tree.map(jnp.copy, pool), M.DRAFT_EXTEND, rows, x)
    want, out_ext = run(steps, pool, M.EXTEND, rows, x)
    np.testing.assert_allclose(got, want, **TOL)
    for a, b in zip(jax.tree.leaves(out_draft.pool), jax.tree.leaves(out_ext.pool), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_commit_with_rejected_drafts_keeps_accepted_prefix(setup):
    model, steps, hidden = setup
    seq = tokens(9, hidden, 5)
    prefix = 9 - D
    _, out = run(steps, fresh_pool(model), M.EXTEND, [RowSpec(1, 0, prefix), RowSpec(2, 0, prefix)],
                 np.concatenate([seq[:prefix], seq[:prefix]]))  # fmt: skip
    rows = [RowSpec(1, prefix, D), RowSpec(2, prefix, D)]
    _, out = run(steps, out.pool, M.TARGET_VERIFY, rows, np.concatenate([seq[prefix:]] * 2))
    meta = build_metadata(M.TARGET_VERIFY, rows, POLICY, num_slots=NUM_SLOTS)
    before_2 = slot_states(out.pool, 2)
    pool = steps.commit(out.pool, out.verify, meta.state_indices, jnp.asarray([1, -1], jnp.int32))
    _, ref = run(steps, fresh_pool(model, 9), M.EXTEND, [RowSpec(1, 0, prefix + 2)],
                 seq[: prefix + 2])  # fmt: skip
    for got, want in zip(slot_states(pool, 1), slot_states(ref.pool, 1), strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    for got, want in zip(slot_states(pool, 2), before_2, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.MIXED, M.TARGET_VERIFY, M.DRAFT_EXTEND])
def test_padded_rows_never_change_a_real_slot(setup, mode):
    model, steps, hidden = setup
    n = D if mode is M.TARGET_VERIFY else (2 if mode is M.DRAFT_EXTEND else 1)
    pool = fresh_pool(model)
    before = host(pool)
    _, out = run(steps, pool, mode, [RowSpec(6, 4, n)], tokens(n, hidden, 2), batch_size=4)
    for slot in range(1, NUM_SLOTS):
        if slot == 6 and mode is not M.TARGET_VERIFY:
            continue
        for got, want in zip(slot_states(out.pool, slot), slot_states(before, slot), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"slot {slot} changed")
    if mode is not M.TARGET_VERIFY:
        pairs = zip(slot_states(out.pool, 6), slot_states(before, 6), strict=True)
        assert all(not np.array_equal(a, b) for a, b in pairs), "real slot not written"


def test_idle_step_runs_and_changes_nothing(setup):
    model, steps, hidden = setup
    pool = fresh_pool(model)
    before = host(pool)
    meta = build_metadata(M.IDLE, [], POLICY, num_slots=NUM_SLOTS)
    out = steps(pool, jnp.zeros((meta.num_tokens, hidden), jnp.float32), meta)
    assert out.hidden.shape == (0, hidden)
    for got, want in zip(jax.tree.leaves(host(out.pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, want)


def test_mamba2_runs_exactly_the_modes_gdn_runs():
    assert CAPABILITIES[LayerKind.MAMBA2] == CAPABILITIES[LayerKind.GDN]


@pytest.mark.parametrize(
    "mode", [m for m in ForwardMode if m not in CAPABILITIES[LayerKind.MAMBA2]]
)
def test_unsupported_mode_fails_at_lower(setup, mode):
    model, steps, hidden = setup
    meta = example_metadata(M.DECODE, 1, 1, POLICY)
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    with pytest.raises(UnsupportedForwardModeError, match=mode.name) as err:
        steps.lower(mode, pool, jnp.zeros((1, hidden)), meta)
    assert err.value.layer_kind is LayerKind.MAMBA2


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="mamba_num_heads=6 is not a multiple of n_groups=4"):
        dataclasses.replace(CONFIG, num_heads=6, n_groups=4)
    with pytest.raises(ValueError, match="time_step_limit"):
        dataclasses.replace(CONFIG, time_step_limit=(0.1, 0.01))
