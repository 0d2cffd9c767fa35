"""The OpenAI-compatible server on the tiny preset, started on 127.0.0.1 by the fixture and
driven by the official ``openai`` client and raw HTTP: answers, streams, concurrency,
disconnects, bad requests, a full queue, metrics."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import shutil
import socket
import threading
import time

import jax
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hybrid_jax import Engine, EngineConfig, SamplingParams  # noqa: E402
from hybrid_jax.cli.serve import build_server  # noqa: E402
from hybrid_jax.models.tokenizer import ByteTokenizer, TokenizerError  # noqa: E402

# On an accelerator a row's float results depend on the batch it shares (products tile by
# batch size), so "the tokens a request gets alone" holds only in batch-invariant mode there.
CONFIG = EngineConfig(
    max_batch=8, max_tokens=64, max_context=128, impl="reference",
    batch_invariant=jax.default_backend() != "cpu",
)  # fmt: skip
TIMEOUT = 120.0


class ChatBytes(ByteTokenizer):
    """The byte tokenizer with a plain chat template (the tiny preset has none)."""

    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        if any(m["role"] == "tool" for m in messages):
            raise TokenizerError("the chat template refused the conversation: no tools here")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(engine, model_name):
    """The server over ``engine`` on a free port, started on a thread: yields (server, url,
    engine) and stops it afterwards."""
    port = _free_port()
    srv = build_server(engine, host="127.0.0.1", port=port, model_name=model_name,
                       max_waiting=64, drain_s=2.0, log_level="warning")  # fmt: skip
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield srv, f"http://127.0.0.1:{port}", engine
    srv.should_exit = True
    thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = dataclasses.replace(CONFIG, cache_dir=str(tmp_path_factory.mktemp("xla")))
    engine = Engine.from_preset("tiny", config, progress=False)
    engine.tokenizer = ChatBytes()
    yield from _serving(engine, "tiny")


@pytest.fixture(scope="module")
def client(server):
    _, url, _ = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)


def _worker(server):
    srv, _, _ = server
    return srv.config.app.state.worker


def _idle(server) -> bool:
    stats = _worker(server).stats()
    return stats.running == 0 and stats.waiting == 0 and stats.slots_used == 0


def _wait(predicate, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


PROMPTS = [f"request {i}: hybrid models mix" + " x" * (i % 5) for i in range(16)]


def test_completion_answers_with_text_usage_and_finish_reason(client):
    answer = client.completions.create(model="tiny", prompt="The pool holds", max_tokens=6,
                                       temperature=0)  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert answer.usage.prompt_tokens == len(b"The pool holds")
    assert answer.usage.completion_tokens == 6
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 6


def test_streamed_completion_equals_the_whole_answer_and_reports_usage(client):
    kw = dict(model="tiny", prompt="Hybrid models", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_streamed_and_not(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=7,
                                           temperature=0)  # fmt: skip
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ChatBytes().encode(
        ChatBytes().apply_chat_template(messages)))  # fmt: skip
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=7,
                                                 temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_logprobs_in_completions_and_chat_streamed_and_not(client, server):
    """Greedy: each token heads its alternatives, with its own log-probability; streamed
    chunks carry the same entries as the whole answer."""
    _, url, _ = server
    kw = dict(model="tiny", prompt="Hybrid models", max_tokens=5, temperature=0, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Two alternatives may decode to the same text (bytes >= 128 each decode to U+FFFD).
        assert 1 <= len(top) <= 2 and top[token] == logprob == max(top.values())
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True)]
    assert sum((c.logprobs.token_logprobs for c in chunks), []) == lp.token_logprobs
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    raw = bytes(b for c in content for b in c.bytes)  # one byte per token here
    assert raw.decode(errors="replace") == chat.choices[0].message.content
    for c in content:
        assert len(c.bytes) == 1 and len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                           temperature=0)  # fmt: skip
    assert plain.choices[0].logprobs is None
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True, stream=True
    )
    entries = [e for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == [c.logprob for c in content]
    with httpx.Client(timeout=TIMEOUT) as http:
        body = {"messages": messages, "top_logprobs": 2}
        answer = http.post(f"{url}/v1/chat/completions", json=body)
    assert answer.status_code == 400 and "top_logprobs needs logprobs" in answer.text


def test_fields_a_request_leaves_out_take_the_checkpoints_generation_config(client, server):
    _, _, engine = server
    kw = dict(model="tiny", prompt="Hybrid models", max_tokens=6)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    engine.generation_config = {"temperature": 0.0}  # as from_checkpoint sets it
    try:
        assert client.completions.create(**kw).choices[0].text == greedy
        seeded = dict(kw, temperature=1.0, seed=5)
        assert client.completions.create(**seeded).choices[0].text != greedy  # sent: kept
    finally:
        engine.generation_config = {}


def test_n_choices_are_requests_of_their_own_seeded_in_turn(client, server):
    kw = dict(model="tiny", prompt="Hybrid models", max_tokens=5, temperature=1.0)
    alone = [client.completions.create(**kw, seed=7 + i).choices[0].text for i in range(3)]
    answer = client.completions.create(**kw, seed=7, n=3)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.text for c in answer.choices] == alone
    assert answer.usage.completion_tokens == 15
    assert answer.usage.prompt_tokens == len(b"Hybrid models")
    chunks = list(client.completions.create(**kw, seed=7, n=3, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                for i in range(3)]  # fmt: skip
    assert streamed == alone
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                          temperature=0, n=2)  # fmt: skip
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    _wait(lambda: _idle(server))


def test_concurrent_clients_get_the_tokens_they_get_alone(client, server):
    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                         temperature=0).choices[0].text  # fmt: skip

    alone = [ask(p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert together == alone
    _wait(lambda: _idle(server))


def test_stop_string_ends_the_answer_before_it(client, server):
    kw = dict(model="tiny", prompt="The pool holds", max_tokens=24, temperature=0)
    full = client.completions.create(**kw, logprobs=0).choices[0]
    text = full.text
    stop = text[5:7]
    cut = text.index(stop)
    reported = []
    for stream in (False, True):
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(
                **kw, stop=[stop], stream=True, logprobs=0)]  # fmt: skip
            got = "".join(c.text for c in chunks)
            reported.append(sum((c.logprobs.token_logprobs for c in chunks), []))
        else:
            answer = client.completions.create(**kw, stop=stop, logprobs=0)
            got = answer.choices[0].text
            assert answer.choices[0].finish_reason == "stop"
            reported.append(answer.choices[0].logprobs.token_logprobs)
        assert got == text[:cut]
    # The same entries streamed or not, the answer's first tokens: the held-back tokens that
    # the stop string drops are never reported.
    kept = len(reported[0])
    assert reported[1] == reported[0] == full.logprobs.token_logprobs[:kept]
    assert 0 < kept < len(full.logprobs.token_logprobs)
    _wait(lambda: _idle(server))


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
    _, url, _ = server
    body = {"model": "tiny", "prompt": "disconnect", "max_tokens": 100, "temperature": 0,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data:"))
            first = [json.loads(next(events)[5:]) for _ in range(3)]
            assert all(e["choices"][0]["finish_reason"] is None for e in first)
            assert _worker(server).stats().running == 1
    _wait(lambda: _idle(server))
    assert _worker(server).engine.pages.num_free == _worker(server).engine.pages.capacity


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "not a JSON object"),
        ({"prompt": "x", "temprature": 0.5}, 400, "temprature"),
        ({"prompt": "x", "temperature": 5}, 400, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "n": 17}, 400, "n"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "seed": -1}, 400, "seed"),
        ({"prompt": [1, 2, 999]}, 400, "outside the vocabulary"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": "x" * 200}, 400, "longer than the context"),
        ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
        ({"prompt": "x", "stop": [""]}, 400, "stop strings"),
        ({"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
        ({"max_tokens": 3}, 400, "prompt"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ],
)
def test_bad_requests_are_refused_naming_the_field_and_leave_others_running(
    server, body, status, needle
):
    _, url, _ = server
    with httpx.Client(timeout=TIMEOUT) as http:
        running = {"prompt": "bystander", "max_tokens": 40, "temperature": 0}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            bystander = pool.submit(http.post, f"{url}/v1/completions", json=running)
            kw = {"json": body}
            if isinstance(body, bytes):
                kw = {"content": body, "headers": {"content-type": "application/json"}}
            answer = http.post(f"{url}/v1/completions", **kw)
            assert answer.status_code == status, answer.text
            assert needle in answer.json()["error"]["message"]
            done = bystander.result(TIMEOUT)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
    _wait(lambda: _idle(server))


def test_chat_without_a_usable_template_answers_400(server):
    _, url, _ = server
    messages = [{"role": "tool", "content": "x"}]
    answer = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages},
                        timeout=TIMEOUT)  # fmt: skip
    assert answer.status_code == 400 and "no tools here" in answer.json()["error"]["message"]


def test_a_full_queue_answers_503_and_admits_again_after(server, client):
    worker = _worker(server)
    limit, worker.max_waiting = worker.max_waiting, 0
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "--max-waiting" in str(err.value)
    finally:
        worker.max_waiting = limit
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text


def test_models_health_and_metrics(server, client):
    _, url, _ = server
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt="metrics", max_tokens=3)
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("hybrid_jax_requests_running", "hybrid_jax_slots_used", "hybrid_jax_kv_pages_used",
                 "hybrid_jax_retraces", "hybrid_jax_generated_tokens",
                 "hybrid_jax_time_to_first_token_seconds",
                 "hybrid_jax_inter_token_latency_seconds"):  # fmt: skip
        assert name in families, sorted(families)
    ttft = {s.name: s.value for s in families["hybrid_jax_time_to_first_token_seconds"].samples}
    assert ttft["hybrid_jax_time_to_first_token_seconds_count"] >= 1
    retraces = families["hybrid_jax_retraces"].samples[0].value
    assert retraces == 0


def test_serve_cli_refuses_bad_flags_by_name(capsys):
    from hybrid_jax.cli import main

    for flags, needle in ((["--port", "0"], "--port=0"), (["--max-waiting", "0"], "--max-waiting")):
        with pytest.raises(SystemExit) as exit_code:
            main(["serve", *flags])
        assert exit_code.value.code == 2
        assert needle in capsys.readouterr().err


def test_serve_cli_exits_cleanly_on_sigterm_with_a_stream_in_flight(server):
    import signal
    import subprocess
    import sys

    # The module server's configuration and cache: the child loads the programs the server's
    # engine stored instead of compiling its own.
    _, _, engine = server
    port = _free_port()
    cmd = [sys.executable, "-c", "from hybrid_jax.cli import main; main()", "serve",
           "--port", str(port), "--max-batch", str(CONFIG.max_batch),
           "--max-tokens", str(CONFIG.max_tokens), "--max-context", str(CONFIG.max_context),
           "--impl", "reference", "--cache-dir", engine.config.cache_dir,
           "--drain-s", "1"] + ["--batch-invariant"] * CONFIG.batch_invariant  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy():
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                assert proc.poll() is None, proc.stdout.read()
                return False

        _wait(healthy, timeout=300)
        lines: list[str] = []
        body = {"prompt": "drain", "max_tokens": 120, "temperature": 0, "stream": True}

        def read_stream():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data:"))

        reader = threading.Thread(target=read_stream)
        reader.start()
        _wait(lambda: len(lines) > 0 or not reader.is_alive())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
        reader.join(TIMEOUT)
        assert not reader.is_alive()  # the stream ended: finished, or cut at the drain deadline
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_serve_reports_latencies_of_a_running_server(server, tmp_path, capsys):
    from hybrid_jax.cli import main

    _, url, _ = server
    path = tmp_path / "bench.json"
    argv = ["bench", "serve", "--url", url, "--num-prompts", "6", "--random-input-len", "12",
            "--random-output-len", "5", "--max-concurrency", "3", "--request-rate", "50",
            "--save-result", str(path)]  # fmt: skip
    with pytest.raises(SystemExit) as code:
        main(argv)
    assert code.value.code == 0
    report = json.loads(path.read_text())
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["total_output_tokens"] == sum(r["output_tokens"] for r in report["requests"])
    assert all(0 < r["ttft"] <= r["latency"] for r in report["requests"])
    assert report["ttft"]["median_ms"] > 0 and report["output_throughput"] > 0
    assert "TTFT" in capsys.readouterr().out
    with pytest.raises(SystemExit) as code:
        main(["bench", "serve", "--url", url, "--request-rate", "0"])
    assert code.value.code == 2 and "--request-rate=0.0 must be > 0" in capsys.readouterr().err


# ---------------------------------------------------------------- a Hugging Face folder

CHECKPOINT = pathlib.Path(__file__).parent / "fixtures" / "qwen3_5" / "dense_vl"
WORDS = [f"w{i}" for i in range(200)]


def test_a_checkpoint_folder_is_served_with_its_tokenizer_template_and_defaults(tmp_path):
    """The tiny random Qwen3.5 vision-language checkpoint of the parity tests, given the files
    a Hub folder has beside its weights (tokenizer.json, tokenizer_config.json with a chat
    template, generation_config.json): the OpenAI client gets what the engine generates, the
    chat template of the folder, and the folder's defaults for fields it leaves out."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    folder = tmp_path / "checkpoint"
    shutil.copytree(CHECKPOINT, folder)
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}, "<|end|>": 201}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<|end|>"])
    tok.save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}w0"
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|end|>"})
    )
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    config = dataclasses.replace(CONFIG, cache_dir=str(tmp_path / "xla"))
    engine = Engine.from_checkpoint(folder, config, progress=False)
    prompt = " ".join(WORDS[3:11])
    [alone] = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0))
    chat_prompt = "user " + " ".join(WORDS[20:25]) + " w0"
    [chat_alone] = engine.generate([chat_prompt], SamplingParams(max_new_tokens=5))
    serving = _serving(engine, "tiny-qwen3.5")
    _, url, _ = next(serving)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=TIMEOUT,
                               max_retries=0)  # fmt: skip
        assert [m.id for m in client.models.list().data] == ["tiny-qwen3.5"]
        # temperature left out: the folder's generation_config (greedy) decides.
        answer = client.completions.create(model="tiny-qwen3.5", prompt=prompt, max_tokens=6)
        assert answer.choices[0].text == alone.text
        assert answer.usage.prompt_tokens == len(engine.tokenizer.encode(prompt)) == 8
        messages = [{"role": "user", "content": " ".join(WORDS[20:25])}]
        chat = client.chat.completions.create(model="tiny-qwen3.5", messages=messages,
                                              max_tokens=5)  # fmt: skip
        assert chat.choices[0].message.content == chat_alone.text
        assert chat.usage.prompt_tokens == len(engine.tokenizer.encode(chat_prompt))
    finally:
        next(serving, None)
