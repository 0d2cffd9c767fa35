"""The linear layer stacks (GDN, Mamba2) through every forward mode: equivalences, pools, tracing,
compiles."""

from __future__ import annotations

import _stack_modes as stack
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _stack_modes import NUM_SLOTS, POLICY, D, fresh_pool, host, run, tokens
from flax import nnx

from hybrid_jax.engine.step import StepFunctions
from hybrid_jax.metadata import RowSpec, build_metadata, example_metadata
from hybrid_jax.models.gdn_stack import GDNStack, tiny_gdn_stack_config
from hybrid_jax.modes import CAPABILITIES, ForwardMode, LayerKind, UnsupportedForwardModeError
from hybrid_jax.state_pool import SlotAllocator, allocate_slots, init_state_pool

M = ForwardMode


@pytest.fixture(scope="module")
def setup():
    return stack.build("gdn")


@pytest.fixture(scope="module", params=["gdn", "mamba2"])
def any_stack(request):
    """Each linear layer kind's stack: the tests below hold for both."""
    return stack.build(request.param)


def test_one_extend_equals_two_chunks_decodes_verify_commit_and_mixed(any_stack):
    verified = stack.check_modes_compute_one_extend(any_stack)
    model = any_stack[0]
    assert [v.layers for v in verified.verify] == [(i,) for i in range(len(model.layer_kinds))]
    if model.layer_kinds[0] is LayerKind.MAMBA2:
        assert verified.verify[0].ssm.shape[2:] == (D, 4, 8, 8)


def test_draft_extend_equals_extend(any_stack):
    stack.check_draft_extend_equals_extend(any_stack)


def test_commit_with_rejected_drafts_keeps_accepted_prefix(any_stack):
    stack.check_commit_keeps_the_accepted_prefix(any_stack)


@pytest.mark.parametrize("mode", stack.ROW_MODES)
def test_padded_rows_never_change_a_real_slot(any_stack, mode):
    stack.check_padded_rows_never_change_a_real_slot(any_stack, mode)


def test_idle_step_runs_and_changes_nothing(any_stack):
    stack.check_idle_step_changes_nothing(any_stack)


@pytest.mark.parametrize("mode", [m for m in ForwardMode if m not in CAPABILITIES[LayerKind.GDN]])
def test_unsupported_mode_fails_at_lower(any_stack, mode):
    model, steps, hidden = any_stack
    kind = model.layer_kinds[0]
    traces = steps.total_traces
    meta = example_metadata(M.DECODE, 1, 1, POLICY)
    pool = init_state_pool(model.state_specs(), NUM_SLOTS)
    with pytest.raises(UnsupportedForwardModeError, match=mode.name) as err:
        steps.lower(mode, pool, jnp.zeros((1, hidden)), meta)
    assert err.value.layer_kind is kind
    assert err.value.supported == CAPABILITIES[kind]
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
    # Each record splits its time: the lowering before XLA's compile, none where MIXED took
    # EXTEND's executable.
    assert all(0 < r.lower_ms < r.compile_ms for r in records if r.mode is M.EXTEND)
    assert all(r.lower_ms == 0 for r in records if r.mode is M.MIXED)
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


@pytest.mark.parametrize("stored", [False, True], ids=["jit", "program-store"])
def test_decode_and_verify_steps_compile_as_whole_graphs_and_prefill_as_xla_chooses(
    monkeypatch, tmp_path, stored
):
    from hybrid_jax import xla_flags
    from hybrid_jax.engine.startup import ProgramStore

    given = []
    compile_lowered = jax.stages.Lowered.compile

    def recording(self, compiler_options=None):
        given.append(compiler_options)
        return compile_lowered(self, compiler_options=compiler_options)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    monkeypatch.setattr(xla_flags, "STEP_GRAPHS", True)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    model = GDNStack(tiny_gdn_stack_config(), rngs=nnx.Rngs(6))
    store = ProgramStore(tmp_path) if stored else None
    steps = StepFunctions(model, impl="reference", store=store)
    hidden = tiny_gdn_stack_config().layer.hidden_size
    modes = [M.EXTEND, M.DECODE, M.TARGET_VERIFY]
    records = steps.compile_all(POLICY, fresh_pool(model), modes, token_shape=(hidden,))
    assert len(given) == len(records)
    for record, options in zip(records, given, strict=True):
        graphed = record.mode is not M.EXTEND
        assert options == (xla_flags.STEP_GRAPH_OPTIONS if graphed else {}), record
    # Turned off, or named by the user's XLA_FLAGS, the options stay XLA's.
    given.clear()
    monkeypatch.setattr(xla_flags, "STEP_GRAPHS", False)
    StepFunctions(model, impl="reference").compile_all(
        POLICY, fresh_pool(model), [M.DECODE], token_shape=(hidden,)
    )
    monkeypatch.setattr(xla_flags, "STEP_GRAPHS", True)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    StepFunctions(model, impl="reference").compile_all(
        POLICY, fresh_pool(model), [M.DECODE], token_shape=(hidden,)
    )
    assert given and all(options == {} for options in given), given
