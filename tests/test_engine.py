"""The serving loop on the tiny preset: invariance, chunking, no retrace, pools, bad input."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _kernel_sized import kernel_sized_nemotron_h_config, with_zero_weights
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

from hybrid_jax import Engine, EngineConfig
from hybrid_jax.engine.lm_step import LastTokenLogits, ServingState
from hybrid_jax.engine.sampling import Sampler, SamplingParams, SamplingParamsError
from hybrid_jax.engine.scheduler import FinishReason, RequestError
from hybrid_jax.engine.startup import ProgramStore, tracing_switches
from hybrid_jax.kv_cache import init_kv_cache
from hybrid_jax.layers import linear, moe
from hybrid_jax.metadata import example_metadata, pack_metadata
from hybrid_jax.models.checkpoint import CheckpointError
from hybrid_jax.models.nemotron_h import NemotronH
from hybrid_jax.models.qwen3_next import tiny_qwen3_next
from hybrid_jax.models.qwen3_next_loading import save_checkpoint
from hybrid_jax.models.safetensors_io import read_header
from hybrid_jax.models.tokenizer import ByteTokenizer
from hybrid_jax.modes import ForwardMode, program_mode
from hybrid_jax.state_pool import init_state_pool
from pallas_kernels import _skinny

M = ForwardMode
# Max context 64 in pages of 8: a full-context request holds 8 of the 16 real pages, so two
# of them fill the cache while four short ones fit.
CONFIG = EngineConfig(
    max_batch=4,
    max_tokens=32,
    max_context=64,
    page_size=8,
    num_pages=17,
    impl="reference",
)
GREEDY = SamplingParams(max_new_tokens=6)
CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # The engine points JAX's persistent cache at its directory, a process-wide setting:
    # put it back afterwards so that later test modules do not write into this one.
    saved = {name: getattr(jax.config, name) for name in CACHE_OPTIONS}
    cache = tmp_path_factory.mktemp("xla_cache")
    yield Engine.from_preset(
        "tiny", dataclasses.replace(CONFIG, cache_dir=str(cache)), progress=False
    )
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def alone(engine):
    """Greedy tokens of a few prompts, each served on its own."""
    prompts = [prompt(n, seed) for seed, n in enumerate((5, 12, 21, 3))]
    return prompts, [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_generate_returns_tokens_text_and_timing(engine):
    (result,) = engine.generate("hi there", SamplingParams(max_new_tokens=5))
    assert len(result.token_ids) == 5 and result.finish_reason is FinishReason.LENGTH
    assert result.text == engine.tokenizer.decode(result.token_ids)
    assert result.prompt_token_ids == list(b"hi there")
    assert 0 < result.ttft <= result.total
    assert len(result.token_latencies) == 4 and min(result.token_latencies) > 0


def test_requests_served_together_match_each_served_alone(engine, alone):
    prompts, want = alone
    got = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    assert got == want


def test_request_joining_running_decodes_in_a_mixed_step_matches_alone(engine, alone):
    prompts, want = alone
    first = engine.add_request(prompts[0], GREEDY)
    events = engine.step()  # the first prompt alone
    second = engine.add_request(prompts[1], GREEDY)
    before = len(engine.step_times[M.MIXED])
    tokens = {first: [e.token_id for e in events], second: []}
    while engine.has_work:
        for event in engine.step():
            tokens[event.request_id].append(event.token_id)
    assert len(engine.step_times[M.MIXED]) > before
    assert [tokens[first], tokens[second]] == want[:2]


def test_chunked_prefill_matches_whole_prefill(engine, alone):
    prompts, want = alone
    config = engine.scheduler.config
    engine.scheduler.config = dataclasses.replace(config, chunk_size=4)
    try:
        got = engine.generate(prompts[2], GREEDY)[0].token_ids
    finally:
        engine.scheduler.config = config
    assert got == want[2]


def test_prompt_longer_than_a_step_is_chunked_and_served(engine):
    long = prompt(50, 9)  # 50 > max_tokens=32: two EXTEND steps, then decodes
    (result,) = engine.generate([long], SamplingParams(max_new_tokens=3))
    assert len(result.token_ids) == 3


def test_no_retrace_after_warm_up(engine, alone):
    prompts, _ = alone
    engine.generate(prompts, GREEDY)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.8, top_k=9))
    assert all(engine.step_times[m] for m in (M.EXTEND, M.DECODE, M.MIXED))
    assert engine.retraces == 0


def test_each_step_records_how_long_the_host_took_to_launch_it(engine, alone):
    prompts, _ = alone
    before = {m: (len(t), len(engine.launch_times[m])) for m, t in engine.step_times.items()}
    engine.generate(prompts, GREEDY)
    for mode in (M.EXTEND, M.DECODE):
        steps = engine.step_times[mode][before[mode][0] :]
        launches = engine.launch_times[mode][before[mode][1] :]
        assert steps and len(launches) == len(steps), mode
        assert all(0 < t < 60 for t in launches), launches
    assert not engine.launch_times.get(M.IDLE)  # an idle step launches nothing


def test_each_step_executable_takes_its_tokens_and_metadata_as_one_vector(engine):
    """Beside the serving state's integer arrays, a step executable's one integer operand is
    an int32 vector of its token ids and the metadata's arrays (``pack_metadata``): a step
    copies its inputs to the device once, not an array at a time."""
    state = jax.tree.leaves(engine.state)
    state_ints = sum(not np.issubdtype(np.dtype(a.dtype), np.floating) for a in state)
    for (program, batch, tokens), executable in engine.executables.items():
        meta = example_metadata(program, batch, tokens, engine.policy)
        layout, _ = pack_metadata((np.zeros(tokens, np.int32), meta))
        text = executable.as_text()
        entry = text[text.index("ENTRY") :]
        entry = entry[: entry.index("\n}")]
        operands = re.findall(r"= (\w+)\[([\d,]*)\]\S* parameter\(", entry)
        ints = [(kind, dims) for kind, dims in operands if kind in ("s32", "pred", "u32")]
        assert len(ints) == state_ints + 1, (program, ints)
        assert ("s32", str(layout.size)) in ints, ints


def test_slots_and_pages_all_returned_after_a_run_with_aborts(engine):
    ids = [engine.add_request(prompt(9, s), SamplingParams(max_new_tokens=8)) for s in range(6)]
    engine.step()
    engine.step()
    assert engine.slots.num_used > 0 and engine.pages.num_used > 0
    aborted = engine.abort(ids[1])
    assert aborted.finish_reason is FinishReason.ABORT
    engine.abort(ids[5])  # still waiting
    while engine.has_work:
        engine.step()
    assert engine.slots.num_used == 0 and engine.pages.num_used == 0


def test_exhausted_pages_make_requests_wait_not_fail(engine):
    # Each spans 40 + 20 - 1 = 59 positions: 8 pages, so only two fit the cache at once.
    prompts = [prompt(40, s) for s in range(3)]
    stream = engine.stream(prompts, SamplingParams(max_new_tokens=20))
    next(stream)
    assert engine.pages.num_used == 16 and len(engine.scheduler.waiting) == 1
    rest = list(stream)
    done = [e.result for _, e in rest if e.result is not None]
    assert sorted(len(r.token_ids) for r in done) == [20, 20, 20]
    assert engine.pages.num_used == 0


@pytest.mark.parametrize(
    ("bad", "params", "error", "match"),
    [
        ("", GREEDY, RequestError, "prompt is empty"),
        ([], GREEDY, RequestError, "prompt is empty"),
        ([1, 256], GREEDY, RequestError, r"token_ids\[1\]=256 is outside the vocabulary"),
        ([-3], GREEDY, RequestError, r"token_ids\[0\]=-3"),
        ([1, 2.5], GREEDY, RequestError, r"token_ids\[1\]=2.5 is not an int"),
        (list(range(65)), GREEDY, RequestError, "65 tokens, longer than the context of 64"),
        ([1], SamplingParams(top_k=300), SamplingParamsError, "top_k=300"),
        ([1], SamplingParams(stop_token_ids=(256,)), SamplingParamsError, "stop_token_ids"),
        ([1], {"temperature": 1.0}, RequestError, "not SamplingParams"),
    ],
)
def test_bad_input_is_rejected_and_other_requests_keep_being_served(
    engine, alone, bad, params, error, match
):
    prompts, want = alone
    good = engine.add_request(prompts[0], GREEDY)
    tokens = [e.token_id for e in engine.step()]
    queued = len(engine.scheduler)
    with pytest.raises(error, match=match):
        engine.add_request(bad, params)
    assert len(engine.scheduler) == queued
    while engine.has_work:
        tokens += [e.token_id for e in engine.step() if e.request_id == good]
    assert tokens == want[0]


def test_one_bad_prompt_rejects_the_whole_call_and_names_it(engine):
    with pytest.raises(RequestError, match=r"prompts\[1\] is empty"):
        engine.generate(["ok", ""], GREEDY)
    assert not engine.has_work


def test_prompt_filling_the_context_gets_one_token(engine):
    (result,) = engine.generate([prompt(64, 3)], GREEDY)
    assert len(result.token_ids) == 1 and result.finish_reason is FinishReason.LENGTH


def test_stop_token_ends_generation(engine, alone):
    prompts, want = alone
    stop = want[1][2]
    first = want[1].index(stop)
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    (result,) = engine.generate([prompts[1]], params)
    assert result.token_ids == want[1][: first + 1]
    assert result.finish_reason is FinishReason.STOP


def test_seeded_sampling_is_reproducible_and_batch_invariant(engine, alone):
    prompts, _ = alone
    params = SamplingParams(max_new_tokens=8, temperature=1.5, seed=1234)
    (solo,) = engine.generate([prompts[1]], params)
    mixed = engine.generate(prompts, [GREEDY, params, GREEDY, GREEDY])
    assert mixed[1].token_ids == solo.token_ids
    (other,) = engine.generate([prompts[1]], dataclasses.replace(params, seed=99))
    assert other.token_ids != solo.token_ids


def test_a_greedy_batch_runs_no_sampler_and_a_sampling_row_brings_it_back(
    engine, alone, monkeypatch
):
    """Greedy rows take the tokens their step drew; a batch with a sampling row runs the
    sampler's executable, and its greedy rows keep their tokens."""
    calls = []
    sampler_call = Sampler.__call__

    def counted(self, logits, batch, *args):
        calls.append(batch.filters)
        return sampler_call(self, logits, batch, *args)

    monkeypatch.setattr(Sampler, "__call__", counted)
    prompts, want = alone
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == want
    assert calls == []
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5)
    mixed = engine.generate(prompts[:2], [GREEDY, sampling])
    assert mixed[0].token_ids == want[0]
    assert len(calls) >= 4 and all(filters.draws for filters in calls)


def test_stream_yields_every_token_in_order(engine, alone):
    prompts, want = alone
    seen: dict[int, list[int]] = {0: [], 1: []}
    text = {0: "", 1: ""}
    results = {}
    for i, event in engine.stream(prompts[:2], GREEDY):
        seen[i].append(event.token_id)
        text[i] += event.text
        if event.result is not None:
            results[i] = event.result
    assert [seen[0], seen[1]] == want[:2]
    assert [text[0], text[1]] == [results[0].text, results[1].text]


def test_closing_a_stream_early_aborts_its_requests(engine):
    stream = engine.stream([prompt(5, 1)], SamplingParams(max_new_tokens=20))
    next(stream)
    stream.close()
    assert not engine.scheduler.has_work and engine.slots.num_used == 0
    assert engine.step() == [] and not engine.has_work  # the step in flight lands, dropped


def test_a_step_is_read_back_only_after_the_next_is_dispatched(engine, alone):
    prompts, want = alone
    rid = engine.add_request(prompts[0], GREEDY)
    assert engine.step() == []  # the prefill is in flight, nothing read back yet
    assert engine.scheduler.running[0].num_pending == 1
    (event,) = engine.step()  # dispatches the first decode, then reads the prefill back
    assert (event.request_id, event.token_id) == (rid, want[0][0])
    engine.abort(rid)
    engine.step()
    engine.overlap = False
    try:
        engine.add_request(prompts[0], GREEDY)
        (event,) = engine.step()
        assert event.token_id == want[0][0]
    finally:
        engine.overlap = True
    while engine.has_work:
        engine.step()


def test_waiting_for_every_step_gives_the_same_tokens_as_overlapping(engine, alone):
    prompts, want = alone
    engine.overlap = False
    try:
        got = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    finally:
        engine.overlap = True
    assert got == want


def test_interleaved_streams_each_get_all_their_tokens(engine, alone):
    prompts, want = alone
    a = engine.stream(prompts[:2], GREEDY)
    b = engine.stream(prompts[2:], GREEDY)
    tokens = {("a", 0): [], ("a", 1): [], ("b", 0): [], ("b", 1): []}
    live = {"a": a, "b": b}
    while live:
        for name, stream in list(live.items()):
            try:
                i, event = next(stream)
            except StopIteration:
                del live[name]
                continue
            tokens[name, i].append(event.token_id)
    assert list(tokens.values()) == want


def test_persistent_compilation_cache_is_written(engine):
    assert any(pathlib.Path(engine.config.cache_dir).iterdir())


def test_second_start_reads_every_step_program_back_without_tracing(engine, alone, caplog):
    programs = pathlib.Path(engine.config.cache_dir) / "programs"
    stored = sorted(programs.glob("*.program"))
    records = engine.compile_records
    executables = {(program_mode(r.mode), r.batch_size, r.num_tokens) for r in records}
    assert len(stored) == len(executables)  # MIXED shares EXTEND's programs
    again = Engine.from_preset("tiny", engine.config, progress=False)
    assert again._steps.total_traces == 0
    assert sorted(programs.glob("*.program")) == stored
    # Reading a program back and lowering its call is part of each record's time.
    shared = [r for r in again.compile_records if r.lower_ms == 0]
    assert all(program_mode(r.mode) is not r.mode for r in shared)  # MIXED, on EXTEND's
    assert all(r.lower_ms <= r.compile_ms for r in again.compile_records)
    prompts, want = alone
    assert [r.token_ids for r in again.generate(prompts, GREEDY)] == want
    # A damaged program is exported again, with a warning naming it.
    stored[0].write_bytes(b"not a program")
    again = Engine.from_preset("tiny", engine.config, progress=False)
    assert again._steps.total_traces == 1
    assert str(stored[0]) in caplog.text
    assert [r.token_ids for r in again.generate(prompts, GREEDY)] == want
    again = Engine.from_preset("tiny", engine.config, progress=False)
    assert again._steps.total_traces == 0


@pytest.mark.parametrize(
    ("module", "name", "value"),
    [
        (linear, "FEW_ROWS", 0),
        (linear, "SPLIT_OUTPUT_PROJECTIONS", False),
        (linear, "MIN_SPLITS", 2),
        (moe, "SHARED_DOWN_WITH_EXPERTS", False),
        (_skinny, "SWAP_OPERANDS", False),
    ],
)
def test_a_stored_program_s_key_sees_the_switches_read_while_tracing(
    tmp_path, monkeypatch, module, name, value
):
    store = ProgramStore(tmp_path)
    before = store.key("step", "decode")
    assert f"{module.__name__}.{name}" in tracing_switches()
    monkeypatch.setattr(module, name, value)
    assert store.key("step", "decode") != before
    monkeypatch.undo()
    assert store.key("step", "decode") == before


def test_checkpoint_with_a_missing_tensor_fails_before_compiling(engine, tmp_path):
    save_checkpoint(engine.model, tmp_path)
    header, _ = read_header(tmp_path / "model.safetensors")
    names = sorted(name for name in header if name != "__metadata__")
    index = {"weight_map": dict.fromkeys(names[1:], "model.safetensors")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lacks 1 tensors.*{names[0]}"):
        Engine.from_checkpoint(tmp_path, CONFIG, tokenizer=ByteTokenizer(), progress=False)


@pytest.mark.slow
def test_checkpoint_round_trip_serves_the_same_tokens(engine, alone, tmp_path):
    prompts, want = alone
    save_checkpoint(engine.model, tmp_path / "ckpt")
    config = dataclasses.replace(CONFIG, cache_dir=engine.config.cache_dir)
    loaded = Engine.from_checkpoint(
        tmp_path / "ckpt", config, tokenizer=ByteTokenizer(), progress=False
    )
    assert [r.token_ids for r in loaded.generate(prompts, GREEDY)] == want


@pytest.mark.slow
def test_second_start_loads_every_executable_from_the_cache(engine):
    cache = pathlib.Path(engine.config.cache_dir)
    before = {p.name for p in cache.glob("jit__*-cache")}
    assert before
    again = Engine.from_preset("tiny", engine.config, progress=False)
    assert {p.name for p in cache.glob("jit__*-cache")} == before
    assert again.retraces == 0


def test_engine_context_is_whole_pages_within_the_model():
    assert EngineConfig(max_context=None, page_size=16).policy(1000).max_context == 992
    assert EngineConfig(max_context=64, page_size=16).policy(1000).max_context == 64
    with pytest.raises(ValueError, match="max_context=2048 exceeds"):
        EngineConfig(max_context=2048).policy(1000)
    with pytest.raises(ValueError, match="not a multiple of page_size=16"):
        EngineConfig(max_context=100).policy(1000)


def test_stream_rejects_bad_input_when_called_not_when_iterated(engine):
    with pytest.raises(RequestError, match=r"prompts\[0\] is empty"):
        engine.stream([""], GREEDY)


def _drain(iterator, timeout=120.0):
    """Every item of ``iterator``, consumed on a thread: a stream that never ends fails the
    test instead of hanging it."""
    items, error = [], []

    def consume():
        try:
            items.extend(iterator)
        except BaseException as err:  # re-raised on the test's thread
            error.append(err)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the stream did not end"
    if error:
        raise error[0]
    return items


def test_a_stream_ends_when_its_consumer_aborts_one_of_its_requests(engine, alone):
    prompts, want = alone
    params = SamplingParams(max_new_tokens=20)
    stream = engine.stream(prompts[:2], params)
    _, first = next(stream)
    engine.abort(first.request_id)
    events = _drain(stream)
    ends = {e.request_id: e.result for _, e in events if e.result is not None}
    assert ends[first.request_id].finish_reason is FinishReason.ABORT
    other = next(rid for rid in ends if rid != first.request_id)
    assert ends[other].finish_reason is not FinishReason.ABORT
    assert not engine.has_work and engine.slots.num_free == engine.slots.capacity


def test_a_stream_created_before_another_is_consumed_keeps_all_its_events(engine, alone):
    prompts, want = alone
    first = engine.stream([prompts[0]], GREEDY)
    second = engine.stream([prompts[1]], GREEDY)
    for stream, tokens in ((first, want[0]), (second, want[1])):
        events = [e for _, e in _drain(stream)]
        assert [e.token_id for e in events] == tokens == events[-1].result.token_ids


def test_interleaved_streams_deliver_each_requests_tokens_in_order(engine, alone):
    prompts, want = alone
    streams = [engine.stream([p], GREEDY) for p in prompts[:3]]
    got: list[list[int]] = [[] for _ in streams]
    live = set(range(len(streams)))
    while live:
        for i in sorted(live):
            try:
                _, event = next(streams[i])
            except StopIteration:
                live.discard(i)
                continue
            got[i].append(event.token_id)
    assert got == want[:3]


def test_a_call_with_a_prompt_the_cache_cannot_hold_queues_nothing(tmp_path):
    # 3 real pages of 8 tokens: a 30-token prompt never fits, a 5-token one does.
    config = dataclasses.replace(CONFIG, max_batch=2, num_pages=4, cache_dir=str(tmp_path))
    small = Engine.from_preset("tiny", config, progress=False)
    before = (small._next_id, small.slots.num_free, small.pages.num_free)
    with pytest.raises(RequestError, match=r"prompts\[1\].*KV pages"):
        small.generate([prompt(5, 0), prompt(30, 1)], GREEDY)
    assert not small.has_work and not small.scheduler.waiting
    assert (small._next_id, small.slots.num_free, small.pages.num_free) == before
    assert len(small.generate([prompt(5, 0)], GREEDY)[0].token_ids) == GREEDY.max_new_tokens


def test_a_request_whose_logits_turn_non_finite_ends_saying_so(engine):
    from flax import nnx

    from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config

    model = Qwen3Next(tiny_qwen3_next_config(), rngs=nnx.Rngs(0))
    table = model.embed_tokens.embedding
    table.set_value(table.get_value().at[7].set(float("nan")))  # token 7 poisons its request
    # The module engine's programs: the same model graph and sizes, other weights.
    config = dataclasses.replace(CONFIG, cache_dir=engine.config.cache_dir)
    poisoned = Engine(model, ByteTokenizer(), config, progress=False, donate_weights=True)
    clean = [prompt(6, 3), prompt(9, 4)]
    assert 7 not in clean[0] + clean[1]
    alone = [r.token_ids for r in poisoned.generate(clean, GREEDY)]
    results = poisoned.generate([clean[0], [1, 7, 2], clean[1]], GREEDY)
    assert results[1].finish_reason is FinishReason.NON_FINITE and results[1].token_ids == []
    assert [results[0].token_ids, results[2].token_ids] == alone  # the others undisturbed
    assert [r.token_ids for r in poisoned.generate(clean, GREEDY)] == alone  # slot reused clean
    assert poisoned.slots.num_free == poisoned.slots.capacity


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(page_size=0), "page_size=0 must be an int >= 1"),
        (dict(max_context=0), "max_context=0 must be an int >= 1"),
        (dict(max_context=60, page_size=16), "max_context=60 is not a multiple of page_size=16"),
        (dict(num_pages=1), "num_pages=1 must be an int >= 2"),
        (dict(seed=-1), "seed=-1 must be an int"),
        (dict(seed="x"), "seed='x' must be an int"),
        (dict(seed=1.5), "seed=1.5 must be an int"),
        (dict(max_batch=True), "max_batch=True must be an int"),
        (dict(impl="fast"), "impl='fast' is not one of"),
    ],
)
def test_engine_config_refuses_bad_sizes_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=f"EngineConfig.{message}"):
        EngineConfig(**kwargs)


def test_a_preset_refuses_a_bad_seed_or_dtype():
    with pytest.raises(ValueError, match="seed='x' must be an int"):
        Engine.from_preset("tiny", CONFIG, seed="x", progress=False)
    with pytest.raises(ValueError, match="dtype='float7' is not one of"):
        Engine.from_preset("tiny", CONFIG, dtype="float7", progress=False)


def test_logprobs_are_reported_only_for_the_requests_that_ask(engine, alone):
    """Greedy rows: each token is its step's most likely one, so it heads its alternatives,
    with its own log-probability; a request beside it that asks nothing gets None."""
    prompts, tokens = alone
    asking = dataclasses.replace(GREEDY, logprobs=3)
    only_chosen = dataclasses.replace(GREEDY, logprobs=0)
    top, chosen, plain = engine.generate(prompts[:3], [asking, only_chosen, GREEDY])
    assert [r.token_ids for r in (top, chosen, plain)] == tokens[:3]
    assert plain.logprobs is None and plain.top_logprobs is None
    assert chosen.top_logprobs is None and len(chosen.logprobs) == len(chosen.token_ids)
    assert len(top.logprobs) == len(top.top_logprobs) == len(top.token_ids)
    for token, logprob, alternatives in zip(
        top.token_ids, top.logprobs, top.top_logprobs, strict=True
    ):
        ids, values = zip(*alternatives, strict=True)
        assert len(ids) == 3 and ids[0] == token and values[0] == logprob
        assert values == tuple(sorted(values, reverse=True)) and values[0] <= 0
        assert sum(np.exp(values)) <= 1 + 1e-6
    events = [e for _, e in engine.stream([prompts[1]], only_chosen)]
    assert [e.logprob for e in events] == events[-1].result.logprobs
    assert all(e.top_logprobs is None for e in events)


def test_a_token_among_its_alternatives_is_reported_with_the_alternatives_value():
    """The step and the top log-probabilities' executable each form a row's log-probabilities
    (on the GPU their reductions may round apart by an ulp): a token among the alternatives
    is reported with its alternative's value, in the event and on the result; one that asks
    no alternatives keeps the step's."""
    top = ([[-0.25, -1.5, -2.0]], [[7, 3, 9]])  # values, ids: one row
    for asked, token, want in ((2, 7, -0.25), (2, 9, -2.0), (2, 4, -0.5), (0, 7, -0.5)):
        tracked = types.SimpleNamespace(
            params=SamplingParams(logprobs=asked), logprobs=[], top_logprobs=[]
        )
        logprob, alternatives = Engine._logprobs(tracked, token, -0.5, top, 0)
        assert logprob == want and tracked.logprobs == [want]
        assert alternatives == (((7, -0.25), (3, -1.5)) if asked else None)


def test_generation_config_sets_the_default_sampling_and_adds_stop_ids(engine, alone, tmp_path):
    """A checkpoint's generation_config.json: its eos ids stop every request, its sampling
    fields are the defaults of calls that give none; a field of the wrong type is refused
    before anything loads."""
    prompts, want = alone
    save_checkpoint(engine.model, tmp_path)
    stop = want[0][1]  # the second greedy token of the first prompt
    generation = {"do_sample": False, "top_k": 20, "max_new_tokens": 6, "eos_token_id": [stop]}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    config = dataclasses.replace(CONFIG, cache_dir=engine.config.cache_dir)
    loaded = Engine.from_checkpoint(tmp_path, config, tokenizer=ByteTokenizer(), progress=False)
    assert loaded.generation_config == {"temperature": 0.0, "top_k": 20, "max_new_tokens": 6}
    assert loaded.default_params == SamplingParams(max_new_tokens=6, top_k=20)
    first = loaded.generate([prompts[0]])[0]  # no params: the file's defaults
    assert first.token_ids == want[0][:2] and first.finish_reason is FinishReason.STOP
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature='hot' must be"):
        Engine.from_checkpoint(tmp_path, config, tokenizer=ByteTokenizer(), progress=False)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature=-1"):
        Engine.from_checkpoint(tmp_path, config, tokenizer=ByteTokenizer(), progress=False)


def test_memory_reports_what_the_engine_holds(engine):
    memory = engine.memory
    assert memory["states"] == engine.slots.num_slots * engine.slots.bytes_per_slot
    assert memory["weights"] == sum(p.nbytes for p in engine._steps.params) > memory["states"]
    assert memory["kv_cache"] > 0 and memory["step_temp"] > 0


def test_pools_that_cannot_fit_the_device_are_refused_before_compiling(monkeypatch):
    import hybrid_jax.engine.engine as engine_module

    gib = 2**30
    monkeypatch.setattr(engine_module, "_device_memory", lambda d: (2 * gib, 2 * gib - 1000))
    match = r"state pool \(5 slots: EngineConfig.max_batch.*device 0 has 0.0 GiB free of 2.0 GiB"
    with pytest.raises(ValueError, match=match):
        Engine.from_preset("tiny", CONFIG, progress=False)


def test_under_tensor_parallelism_each_device_needs_its_share_and_the_fullest_decides(
    monkeypatch,
):
    import types

    import hybrid_jax.engine.engine as engine_module

    gib = 2**30
    devices = [types.SimpleNamespace(id=i) for i in range(2)]
    mesh = types.SimpleNamespace(devices=np.array(devices))
    free = {0: 2 * gib, 1: 2 * gib}
    monkeypatch.setattr(engine_module, "_device_memory", lambda d: (4 * gib, 4 * gib - free[d.id]))
    check = engine_module._check_device_memory
    check(2 * gib, 1 * gib, 5, 9, mesh)  # 1.5 GiB per device fits
    with pytest.raises(ValueError, match=r"device 0 has 2.0 GiB free"):
        check(2 * gib, 1 * gib, 5, 9, None)  # the whole 3 GiB on one device does not
    free[1] = gib
    with pytest.raises(ValueError, match=r"\(1/2 of each on every device\), but device 1 has 1.0"):
        check(2 * gib, 1 * gib, 5, 9, mesh)


def _bfloat16_nemotron_h() -> NemotronH:
    return with_zero_weights(lambda: NemotronH(kernel_sized_nemotron_h_config(), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize(
    "build",
    [lambda: tiny_qwen3_next(seed=3, dtype="bfloat16"), _bfloat16_nemotron_h],
    ids=["qwen3-next", "nemotron-h"],
)
def test_a_bfloat16_model_s_steps_give_logits_in_the_dtype_its_engine_compiles_samplers_for(
    build,
):
    """The LM head's product leaves the step as it is, never widened to a float32 copy, and
    in the dtype ``Engine.logits_dtype`` takes from the model, for which the engine compiles
    its samplers (``test_sampling``: they then draw as from the float32 widening)."""
    model = build()
    policy = CONFIG.policy(model.config.max_position_embeddings)
    state = ServingState(
        init_state_pool(model.state_specs(), 5),
        init_kv_cache(model.kv_specs(), 17, 8),
        jnp.zeros(5, jnp.int32),
    )
    meta = example_metadata(M.DECODE, 2, 2, policy)
    x = jnp.zeros(2, jnp.int32)
    out = jax.eval_shape(lambda: LastTokenLogits(model)(x, state, meta, impl="reference"))
    assert out.logits.shape == (2, model.config.vocab_size)
    assert out.logits.dtype == jnp.bfloat16 == jnp.dtype(model.config.dtype)
