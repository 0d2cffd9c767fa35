"""The GDN layer stack through every forward mode: equivalences, pools, tracing, compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.engine.step import StepFunctions
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.models.gdn_stack import GDNStack, tiny_gdn_stack_config
from hybrid_jax.modes import CAPABILITIES, ForwardMode, LayerKind, UnsupportedForwardModeError
from hybrid_jax.state_pool import SlotAllocator, allocate_slots, init_state_pool

M = ForwardMode
D = 3
NUM_SLOTS = 9
POLICY = BucketPolicy(batch_buckets=(1, 2, 4), token_buckets=(8, 16, 32), num_draft_tokens=D)
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(scope="module")
def setup():
    config = tiny_gdn_stack_config()
    model = GDNStack(config, rngs=nnx.Rngs(0))
    return model, StepFunctions(model, impl="reference"), config.layer.hidden_size


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
    qsl = np.asarray(meta.query_start_loc)
    x[: qsl[len(rows)]] = x_tokens
    out = steps(pool, jnp.asarray(x), meta)
    return np.asarray(out.hidden)[: qsl[len(rows)]], out


def tokens(n, hidden, seed):
    return np.random.default_rng(seed).standard_normal((n, hidden)).astype(np.float32)


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
    b, out = run(steps, out.pool, M.TARGET_VERIFY, [RowSpec(slot, prefix, D)], seq[prefix:])
    for got, ref in zip(jax.tree.leaves(host(out.pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, ref)
    meta = build_metadata(M.TARGET_VERIFY, [RowSpec(slot, prefix, D)], POLICY, num_slots=NUM_SLOTS)
    accepted = jnp.full((meta.batch_size,), -1, jnp.int32).at[0].set(D - 1)
    pool = steps.commit(out.pool, out.verify, meta.state_indices, accepted)
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


def test_draft_extend_equals_extend(setup):
    model, steps, hidden = setup
    seq = tokens(10, hidden, 3)
    rows = [RowSpec(3, 0, 8), RowSpec(4, 8, 2)]
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
    untouched = {s: slot_states(out.pool, s) for s in (2, 3, 4)}
    # Slot 1 accepts one draft (state after token index 1); slot 2 rejects all (-1: keep).
    accepted = jnp.asarray([1, -1], jnp.int32)
    pool = steps.commit(out.pool, out.verify, meta.state_indices, accepted)
    _, ref = run(steps, fresh_pool(model, 9), M.EXTEND, [RowSpec(1, 0, prefix + 2)],
                 seq[: prefix + 2])  # fmt: skip
    for got, want in zip(slot_states(pool, 1), slot_states(ref.pool, 1), strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    for s, before in untouched.items():
        for got, want in zip(slot_states(pool, s), before, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", [M.EXTEND, M.DECODE, M.MIXED, M.TARGET_VERIFY, M.DRAFT_EXTEND])
def test_padded_rows_never_change_a_real_slot(setup, mode):
    model, steps, hidden = setup
    n = D if mode in (M.TARGET_VERIFY,) else (2 if mode is M.DRAFT_EXTEND else 1)
    rows = [RowSpec(6, 4, n)]
    pool = fresh_pool(model)
    before = host(pool)
    _, out = run(steps, pool, mode, rows, tokens(n, hidden, 2), batch_size=4)
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


@pytest.mark.parametrize("mode", [m for m in ForwardMode if m not in CAPABILITIES[LayerKind.GDN]])
def test_unsupported_mode_fails_at_lower(setup, mode):
    model, steps, hidden = setup
    traces = steps.total_traces
    meta = example_metadata(M.DECODE, 1, 1, POLICY)
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    with pytest.raises(UnsupportedForwardModeError, match=mode.name) as err:
        steps.lower(mode, pool, jnp.zeros((1, hidden)), meta)
    assert err.value.layer_kind is LayerKind.GDN
    assert err.value.supported == CAPABILITIES[LayerKind.GDN]
    assert "supported: DECODE" in str(err.value)
    assert steps.total_traces == traces + 1  # traced once, refused before any lowering


def test_metadata_of_another_mode_is_refused(setup):
    model, steps, hidden = setup
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    meta = example_metadata(M.DECODE, 1, 1, POLICY)
    with pytest.raises(ValueError, match="metadata built for DECODE"):
        steps.lower(M.EXTEND, pool, jnp.zeros((1, hidden)), meta)
    with pytest.raises(ValueError, match="pad x to meta.num_tokens"):
        steps.lower(M.DECODE, pool, jnp.zeros((3, hidden)), meta)


def test_rejected_step_leaves_the_pool_usable_and_unchanged(setup):
    model, steps, hidden = setup
    pool = fresh_pool(model)
    before = host(pool)
    meta = build_metadata(M.DECODE, [RowSpec(3, 2, 1)], POLICY, num_slots=NUM_SLOTS)
    with pytest.raises(ValueError, match="pad x to meta.num_tokens"):
        steps(pool, jnp.zeros((meta.num_tokens + 1, hidden)), meta)
    for got, want in zip(jax.tree.leaves(host(pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, want)
    out = steps(pool, jnp.ones((meta.num_tokens, hidden)), meta)
    assert np.isfinite(np.asarray(out.hidden)).all()


def test_batches_of_many_sizes_in_one_bucket_compile_once(setup):
    model = GDNStack(tiny_gdn_stack_config(), rngs=nnx.Rngs(1))
    steps = StepFunctions(model, impl="reference")
    hidden = tiny_gdn_stack_config().layer.hidden_size
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    allocator = SlotAllocator(NUM_SLOTS)
    slots, pool = allocate_slots(allocator, pool, 4)
    rng = np.random.default_rng(0)
    for n_rows in (1, 3, 2, 4, 1):
        lens = rng.integers(1, 5, n_rows)
        rows = [RowSpec(s, 0, int(n)) for s, n in zip(slots, lens, strict=False)]
        _, out = run(steps, pool, M.EXTEND, rows, tokens(int(lens.sum()), hidden, 0),
                     num_tokens=16)  # fmt: skip
        pool = out.pool
        _, out = run(steps, pool, M.DECODE, [RowSpec(s, 5, 1) for s in slots[:n_rows]],
                     tokens(n_rows, hidden, 1), batch_size=4)  # fmt: skip
        pool = out.pool
    assert steps.trace_count[M.EXTEND] == 1
    assert steps.trace_count[M.DECODE] == 1


def test_compile_all_then_serving_never_retraces(setup):
    model = GDNStack(tiny_gdn_stack_config(), rngs=nnx.Rngs(2))
    steps = StepFunctions(model, impl="reference")
    hidden = tiny_gdn_stack_config().layer.hidden_size
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    modes = sorted(CAPABILITIES[LayerKind.GDN], key=lambda m: m.value)
    records = steps.compile_all(POLICY, pool, modes, token_shape=(hidden,))
    assert {(r.mode, r.batch_size, r.num_tokens) for r in records} == {
        (m, bs, t) for m in modes for bs, t in POLICY.buckets(m)
    }
    traces = steps.total_traces
    for mode, rows in [
        (M.DECODE, [RowSpec(1, 3, 1), RowSpec(2, 3, 1), RowSpec(3, 1, 1)]),
        (M.EXTEND, [RowSpec(1, 0, 11), RowSpec(2, 0, 3)]),
        (M.MIXED, [RowSpec(1, 0, 5), RowSpec(2, 4, 1)]),
        (M.TARGET_VERIFY, [RowSpec(1, 2, D)]),
        (M.DRAFT_EXTEND, [RowSpec(1, 2, 1), RowSpec(2, 2, D)]),
        (M.IDLE, []),
    ]:
        n = sum(r.num_tokens for r in rows)
        _, out = run(steps, pool, mode, rows, tokens(n, hidden, 3))
        pool = out.pool
    assert steps.total_traces == traces


def test_mixed_runs_the_extend_executable_and_keeps_its_own_capability(monkeypatch):
    from hybrid_jax import modes

    assert {m: modes.program_mode(m) for m in M} == {m: M.EXTEND if m is M.MIXED else m for m in M}
    model = GDNStack(tiny_gdn_stack_config(), rngs=nnx.Rngs(3))
    steps = StepFunctions(model, impl="reference")
    hidden = tiny_gdn_stack_config().layer.hidden_size
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    records = steps.compile_all(POLICY, pool, [M.EXTEND, M.MIXED], token_shape=(hidden,))
    assert {(r.mode, r.batch_size, r.num_tokens) for r in records} == {
        (m, bs, t) for m in (M.EXTEND, M.MIXED) for bs, t in POLICY.buckets(m)
    }
    assert steps.trace_count == {M.EXTEND: len(POLICY.buckets(M.EXTEND))}
    pool = fresh_pool(model)
    rows = [RowSpec(1, 0, 5), RowSpec(2, 4, 1)]
    x = tokens(6, hidden, 4)
    mixed, out = run(steps, pool, M.MIXED, rows, x)
    extend, _ = run(steps, fresh_pool(model), M.EXTEND, rows, x)
    np.testing.assert_array_equal(mixed, extend)
    assert steps.trace_count == {M.EXTEND: len(POLICY.buckets(M.EXTEND))}
    # A layer kind that could run EXTEND but not MIXED refuses MIXED, while tracing nothing.
    without_mixed = {k: v - {M.MIXED} for k, v in CAPABILITIES.items()}
    monkeypatch.setattr(modes, "CAPABILITIES", without_mixed)
    meta = example_metadata(M.MIXED, 2, 8, POLICY)
    with pytest.raises(UnsupportedForwardModeError, match="MIXED"):
        steps.lower(M.MIXED, pool, jnp.zeros((8, hidden)), meta)
    with pytest.raises(UnsupportedForwardModeError, match="MIXED"):
        steps(out.pool, jnp.zeros((8, hidden)), meta)


def test_a_compiled_step_checks_x_and_the_pool_before_running():
    model = GDNStack(tiny_gdn_stack_config(), rngs=nnx.Rngs(5))
    steps = StepFunctions(model, impl="reference")
    hidden = tiny_gdn_stack_config().layer.hidden_size
    pool = fresh_pool(model)
    steps.compile_all(POLICY, pool, [M.DECODE], token_shape=(hidden,))
    before = host(pool)
    meta = build_metadata(M.DECODE, [RowSpec(3, 2, 1)], POLICY, num_slots=NUM_SLOTS)
    with pytest.raises(ValueError, match=r"x is float32\[2, .*pad x to meta.num_tokens=1"):
        steps(pool, jnp.zeros((meta.num_tokens + 1, hidden)), meta)
    small = jax.tree.map(lambda a: a[:-1], pool)  # one slot short
    with pytest.raises(ValueError, match=r"pool.* but the DECODE executable was compiled for"):
        steps(small, jnp.zeros((meta.num_tokens, hidden)), meta)
    for got, want in zip(jax.tree.leaves(host(pool)), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(got, want)
    assert steps.total_traces == len(POLICY.buckets(M.DECODE))  # nothing traced again
    out = steps(pool, jnp.ones((meta.num_tokens, hidden)), meta)
    assert np.isfinite(np.asarray(out.hidden)).all()
