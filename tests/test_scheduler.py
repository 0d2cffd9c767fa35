"""The host-side scheduler: modes, chunked prefill, caps, waiting on exhausted pools, aborts."""

from __future__ import annotations

import pytest

from hybrid_jax.engine.scheduler import (
    PENDING,
    FinishReason,
    Request,
    RequestError,
    Scheduler,
    SchedulerConfig,
)
from hybrid_jax.kv_cache import PageAllocator
from hybrid_jax.metadata import BucketPolicy, PageIds, build_metadata
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import SlotAllocator

M = ForwardMode
POLICY = BucketPolicy.default(max_batch=4, max_tokens=32, page_size=4, max_context=64)


def make(num_slots=5, num_pages=65, **config):
    slots = SlotAllocator(num_slots)
    pages = PageAllocator(num_pages, POLICY.page_size)
    cfg = SchedulerConfig.for_policy(POLICY, **config)
    return Scheduler(cfg, slots, pages, max_context=POLICY.max_context), slots, pages


def req(i, n=5, new=3, stops=()):
    return Request(i, list(range(10, 10 + n)), new, frozenset(stops))


def run_step(sched, token=1):
    """schedule + build_metadata (which validates the rows) + commit a constant token."""
    step = sched.schedule()
    if step.mode is not M.IDLE:
        build_metadata(
            step.mode, step.row_specs, POLICY, num_slots=sched.slots.num_slots,
            num_pages=sched.pages.num_pages,
        )  # fmt: skip
    return step, sched.commit(step, [token] * len(step.rows))


def test_idle_when_nothing_to_do():
    sched, *_ = make()
    step = sched.schedule()
    assert step.mode is M.IDLE and step.rows == ()


def test_prefill_then_decode_then_finish_by_length():
    sched, slots, pages = make()
    sched.add(req(0, n=5, new=3))
    modes = []
    while sched.has_work:
        step, _ = run_step(sched, token=7)
        modes.append(step.mode)
    assert modes == [M.EXTEND, M.DECODE, M.DECODE]
    assert slots.num_used == 0 and pages.num_used == 0


def test_an_admitted_request_hands_every_step_the_same_page_ids():
    """The pages a request holds from admission reach each step's rows as one PageIds, whose
    int64 array build_metadata makes once (a long context holds thousands of pages)."""
    sched, *_ = make()
    sched.add(req(0, n=5, new=3))
    specs = [run_step(sched)[0].row_specs[0] for _ in range(2)]
    assert isinstance(specs[0].pages, PageIds) and specs[1].pages is specs[0].pages


def test_new_request_beside_decodes_is_a_mixed_step():
    sched, *_ = make()
    sched.add(req(0, n=5, new=4))
    run_step(sched)
    sched.add(req(1, n=6, new=4))
    step, _ = run_step(sched)
    assert step.mode is M.MIXED
    assert [len(r.token_ids) for r in step.rows] == [1, 6]
    assert [r.spec.prefix_len for r in step.rows] == [5, 0]


def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    sched, *_ = make(chunk_size=8)
    sched.add(req(0, n=20, new=2))
    starts, samples = [], []
    for _ in range(3):
        step, _ = run_step(sched)
        (row,) = step.rows
        starts.append((row.start, len(row.token_ids)))
        samples.append(row.samples)
    assert starts == [(0, 8), (8, 8), (16, 4)]
    assert samples == [False, False, True]
    assert sched.running[0].output_ids == [1]


def test_step_token_budget_is_respected_and_decodes_go_first():
    sched, *_ = make(max_step_tokens=16)
    sched.add(req(0, n=4, new=5))
    run_step(sched)
    sched.add(req(1, n=30, new=2))
    sched.add(req(2, n=30, new=2))
    for _ in range(4):
        step, _ = run_step(sched)
        assert step.num_tokens <= 16
        assert step.rows[0].request.request_id == 0  # the decode rides along every step


def test_running_cap_makes_requests_wait():
    sched, *_ = make(max_running=2)
    for i in range(4):
        sched.add(req(i, n=3, new=2))
    step, _ = run_step(sched)
    assert [r.request.request_id for r in step.rows] == [0, 1]
    assert len(sched.waiting) == 2


def test_exhausted_slots_make_requests_wait_not_fail():
    sched, slots, _ = make(num_slots=2)  # one real slot
    for i in range(3):
        sched.add(req(i, n=3, new=2))
    order = []
    while sched.has_work:
        step, finished = run_step(sched)
        assert len(step.rows) <= 1
        order += [r.request_id for r in finished]
    assert order == [0, 1, 2] and slots.num_used == 0


def test_exhausted_pages_make_requests_wait_not_fail():
    # Each request spans 8 + 4 - 1 = 11 positions: 3 pages of 4; the cache holds 4 real pages.
    sched, _, pages = make(num_pages=5)
    for i in range(3):
        sched.add(req(i, n=8, new=4))
    step, _ = run_step(sched)
    assert [r.request.request_id for r in step.rows] == [0]
    assert pages.num_used == 3
    finished = []
    while sched.has_work:
        finished += [r.request_id for r in run_step(sched)[1]]
    assert finished == [0, 1, 2] and pages.num_used == 0


def test_stop_token_finishes_the_request():
    sched, *_ = make()
    sched.add(req(0, n=3, new=10, stops=(9,)))
    run_step(sched, token=1)
    _, finished = run_step(sched, token=9)
    assert [r.request_id for r in finished] == [0]
    assert finished[0].finish_reason is FinishReason.STOP
    assert finished[0].output_ids == [1, 9]


def test_abort_frees_slots_and_pages_of_running_and_waiting_requests():
    sched, slots, pages = make(max_running=2)
    for i in range(4):
        sched.add(req(i, n=6, new=5))
    run_step(sched)
    assert slots.num_used == 2 and pages.num_used > 0
    for i in (0, 3):
        assert sched.abort(i).finish_reason is FinishReason.ABORT
    assert sched.abort(0) is None
    while sched.has_work:
        run_step(sched)
    assert slots.num_used == 0 and pages.num_used == 0


def test_abort_between_schedule_and_commit_skips_the_row():
    sched, slots, _ = make()
    sched.add(req(0))
    sched.add(req(1))
    step = sched.schedule()
    sched.abort(0)
    sched.commit(step, [1, 1])
    assert step.rows[0].request.output_ids == []
    assert step.rows[1].request.output_ids == [1]
    assert slots.used_slots == (step.rows[1].request.slot,)


def test_one_token_prompt_is_an_extend_row_not_a_decode():
    sched, *_ = make()
    sched.add(req(0, n=1, new=2))
    step, _ = run_step(sched)
    assert step.mode is M.EXTEND


@pytest.mark.parametrize(
    ("n", "new", "match"),
    [(0, 2, "empty prompt"), (60, 10, "past max_context")],
)
def test_request_that_can_never_run_is_rejected_at_add(n, new, match):
    sched, *_ = make()
    with pytest.raises(RequestError, match=match):
        sched.add(req(0, n=n, new=new))
    assert not sched.has_work


def test_request_larger_than_the_whole_cache_is_rejected():
    sched, *_ = make(num_pages=3)
    with pytest.raises(RequestError, match="could never be admitted"):
        sched.add(req(0, n=20, new=2))


def test_config_rejects_limits_beyond_the_policy():
    with pytest.raises(ValueError, match="largest batch bucket"):
        SchedulerConfig.for_policy(POLICY, max_running=5)
    with pytest.raises(ValueError, match="largest token bucket"):
        SchedulerConfig.for_policy(POLICY, max_step_tokens=64)
    with pytest.raises(ValueError, match="one decode token per running request"):
        SchedulerConfig.for_policy(POLICY, max_running=4, max_step_tokens=2)


def test_next_step_is_scheduled_before_the_previous_is_read_back():
    sched, *_ = make()
    sched.add(req(0, n=5, new=3))
    first = sched.schedule()
    sched.advance(first)
    second = sched.schedule()
    (row,) = second.rows
    assert second.mode is M.DECODE and row.token_ids == (PENDING,) and row.start == 5
    sched.advance(second)
    sched.resolve(first, [7])
    sched.resolve(second, [8])
    assert sched.running[0].output_ids == [7, 8]
    third = sched.schedule()
    assert third.rows[0].token_ids == (8,)


def test_request_that_drew_its_budget_frees_its_slot_before_read_back():
    sched, slots, pages = make()
    sched.add(req(0, n=5, new=2))
    steps = []
    for _ in range(2):
        steps.append(sched.schedule())
        sched.advance(steps[-1])
    assert slots.num_used == 0 and pages.num_used == 0
    assert sched.schedule().mode is M.IDLE
    assert sched.resolve(steps[0], [3]) == []
    (done,) = sched.resolve(steps[1], [4])
    assert done.output_ids == [3, 4] and done.finish_reason is FinishReason.LENGTH


def test_output_of_a_step_after_the_stop_token_is_dropped():
    sched, slots, _ = make()
    sched.add(req(0, n=5, new=10, stops=(9,)))
    first = sched.schedule()
    sched.advance(first)
    second = sched.schedule()
    sched.advance(second)
    (done,) = sched.resolve(first, [9])
    assert done.finish_reason is FinishReason.STOP and slots.num_used == 0
    assert sched.resolve(second, [4]) == []
    assert done.output_ids == [9]
