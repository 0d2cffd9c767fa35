"""A linear layer stack through every forward mode: the checks the GDN and Mamba2 stacks share.

A plain module, not a test module (``_engine_helpers.py`` says why it imports by its bare
name). Each check takes a ``setup`` of ``(model, StepFunctions, hidden size)`` (``build``) for
a model of linear layers whose step returns ``hidden``, ``pool`` and ``verify``: the tiny GDN
stack, or ``Mamba2Stack``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.backend import VerifyStack
from hybrid_jax.backend.commit import commit_verified
from hybrid_jax.engine.step import StepFunctions
from hybrid_jax.layers.mamba2 import Mamba2Config, Mamba2Mixer
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata
from hybrid_jax.models.decoder import LayerStates
from hybrid_jax.models.gdn_stack import GDNStack, tiny_gdn_stack_config
from hybrid_jax.modes import ForwardMode, LayerKind
from hybrid_jax.state_pool import StatePool, init_state_pool

# A verify's commit on its own, the pool donated (a serving loop runs it with its acceptance).
commit = jax.jit(commit_verified, donate_argnums=0)

M = ForwardMode
D = 3
NUM_SLOTS = 9
POLICY = BucketPolicy(batch_buckets=(1, 2, 4), token_buckets=(8, 16, 32), num_draft_tokens=D)
TOL = dict(rtol=2e-5, atol=2e-5)
# The modes whose rows write (or, verifying, read) a real slot.
ROW_MODES = (M.EXTEND, M.DECODE, M.MIXED, M.TARGET_VERIFY, M.DRAFT_EXTEND)


# 4 heads of 8 in 2 groups of state 8; the time-step floor is high enough that some steps clip.
MAMBA2_CONFIG = Mamba2Config(
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


def build(kind: str):
    """The ``setup`` of a stack: ``"gdn"`` (the tiny GDN stack) or ``"mamba2"``."""
    if kind == "gdn":
        config = tiny_gdn_stack_config()
        model, hidden = GDNStack(config, rngs=nnx.Rngs(0)), config.layer.hidden_size
    else:
        model, hidden = Mamba2Stack(MAMBA2_CONFIG, rngs=nnx.Rngs(0)), MAMBA2_CONFIG.hidden_size
    return model, StepFunctions(model, impl="reference"), hidden


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


def check_modes_compute_one_extend(setup):
    """One EXTEND of 13 tokens equals two EXTEND chunks, EXTEND then DECODEs, TARGET_VERIFY
    then a commit of all D drafts (the verify leaves the pool untouched), and a MIXED step
    whose decode row sits beside another request's prefill. Returns the verify step's output."""
    model, steps, hidden = setup
    seq = tokens(13, hidden, 1)
    slot = 5

    whole, out = run(steps, fresh_pool(model), M.EXTEND, [RowSpec(slot, 0, 13)], seq)
    want = slot_states(out.pool, slot)

    def check(got_hidden, pool):
        np.testing.assert_allclose(got_hidden, whole, **TOL)
        for got, ref in zip(slot_states(pool, slot), want, strict=True):
            np.testing.assert_allclose(got, ref, **TOL)

    # Two EXTEND chunks: the second continues from the pool.
    a, out = run(steps, fresh_pool(model, 1), M.EXTEND, [RowSpec(slot, 0, 6)], seq[:6])
    b, out = run(steps, out.pool, M.EXTEND, [RowSpec(slot, 6, 7)], seq[6:])
    check(np.concatenate([a, b]), out.pool)

    # A prefix EXTEND, then DECODE token by token.
    parts = []
    part, out = run(steps, fresh_pool(model, 2), M.EXTEND, [RowSpec(slot, 0, 9)], seq[:9])
    parts.append(part)
    for t in range(9, 13):
        part, out = run(steps, out.pool, M.DECODE, [RowSpec(slot, t, 1)], seq[t : t + 1])
        parts.append(part)
    check(np.concatenate(parts), out.pool)

    # TARGET_VERIFY of the last D tokens, then commit of all D.
    prefix = 13 - D
    a, out = run(steps, fresh_pool(model, 3), M.EXTEND, [RowSpec(slot, 0, prefix)], seq[:prefix])
    before = host(out.pool)
    b, verified = run(steps, out.pool, M.TARGET_VERIFY, [RowSpec(slot, prefix, D)], seq[prefix:])
    for got, ref in zip(jax.tree.leaves(host(verified.pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, ref)  # verify leaves the pool untouched
    meta = build_metadata(M.TARGET_VERIFY, [RowSpec(slot, prefix, D)], POLICY, num_slots=NUM_SLOTS)
    accepted = jnp.full((meta.batch_size,), -1, jnp.int32).at[0].set(D - 1)
    pool = commit(verified.pool, verified.verify, meta.state_indices, accepted)
    check(np.concatenate([a, b]), pool)

    # MIXED: this sequence's last token as a decode row beside another request's prefill.
    other = tokens(8, hidden, 7)
    a, out = run(steps, fresh_pool(model, 4), M.EXTEND, [RowSpec(slot, 0, 12)], seq[:12])
    mixed_rows = [RowSpec(2, 0, 8), RowSpec(slot, 12, 1)]
    b, out = run(steps, out.pool, M.MIXED, mixed_rows, np.concatenate([other, seq[12:]]))
    check(np.concatenate([a, b[8:]]), out.pool)
    alone, alone_out = run(steps, fresh_pool(model, 5), M.EXTEND, [RowSpec(2, 0, 8)], other)
    np.testing.assert_allclose(b[:8], alone, **TOL)
    for got, ref in zip(slot_states(out.pool, 2), slot_states(alone_out.pool, 2), strict=True):
        np.testing.assert_allclose(got, ref, **TOL)
    return verified


def check_draft_extend_equals_extend(setup):
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


def check_commit_keeps_the_accepted_prefix(setup):
    """Slot 1 accepts one draft (the state after token index 1); slot 2 rejects all (-1:
    keep); slots 2-4 are then exactly what they were."""
    model, steps, hidden = setup
    seq = tokens(9, hidden, 5)
    prefix = 9 - D
    _, out = run(steps, fresh_pool(model), M.EXTEND, [RowSpec(1, 0, prefix), RowSpec(2, 0, prefix)],
                 np.concatenate([seq[:prefix], seq[:prefix]]))  # fmt: skip
    rows = [RowSpec(1, prefix, D), RowSpec(2, prefix, D)]
    _, out = run(steps, out.pool, M.TARGET_VERIFY, rows, np.concatenate([seq[prefix:]] * 2))
    meta = build_metadata(M.TARGET_VERIFY, rows, POLICY, num_slots=NUM_SLOTS)
    untouched = {s: slot_states(out.pool, s) for s in (2, 3, 4)}
    accepted = jnp.asarray([1, -1], jnp.int32)
    pool = commit(out.pool, out.verify, meta.state_indices, accepted)
    _, ref = run(steps, fresh_pool(model, 9), M.EXTEND, [RowSpec(1, 0, prefix + 2)],
                 seq[: prefix + 2])  # fmt: skip
    for got, want in zip(slot_states(pool, 1), slot_states(ref.pool, 1), strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    for s, before in untouched.items():
        for got, want in zip(slot_states(pool, s), before, strict=True):
            np.testing.assert_array_equal(got, want)


def check_padded_rows_never_change_a_real_slot(setup, mode):
    """One real row (slot 6) in a bucket of 4: the padded rows write nothing, in any layer
    (every layer's pad slot 0 included: a padded row must not cost a real row's work)."""
    model, steps, hidden = setup
    n = D if mode is M.TARGET_VERIFY else (2 if mode is M.DRAFT_EXTEND else 1)
    pool = fresh_pool(model)
    before = host(pool)
    _, out = run(steps, pool, mode, [RowSpec(6, 4, n)], tokens(n, hidden, 2), batch_size=4)
    for slot in range(NUM_SLOTS):
        if slot == 6 and mode is not M.TARGET_VERIFY:
            continue
        for got, want in zip(slot_states(out.pool, slot), slot_states(before, slot), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"slot {slot} changed")
    if mode is not M.TARGET_VERIFY:
        pairs = zip(slot_states(out.pool, 6), slot_states(before, 6), strict=True)
        assert all(not np.array_equal(a, b) for a, b in pairs), "real slot not written"


def check_idle_step_changes_nothing(setup):
    model, steps, hidden = setup
    pool = fresh_pool(model)
    before = host(pool)
    meta = build_metadata(M.IDLE, [], POLICY, num_slots=NUM_SLOTS)
    out = steps(pool, jnp.zeros((meta.num_tokens, hidden), jnp.float32), meta)
    assert out.hidden.shape == (0, hidden)
    for got, want in zip(jax.tree.leaves(host(out.pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, want)
