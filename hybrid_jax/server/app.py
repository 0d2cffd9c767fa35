"""The OpenAI-compatible HTTP API over an ``EngineWorker`` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the checkpoint's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Streams use server-sent
events (``data: {json}`` lines, ``data: [DONE]`` at the end). A request is checked whole
before it reaches the engine: a malformed body, an unknown field or a value out of range
answers 400 naming the field; a full queue answers 503. A client that disconnects aborts its
request, which frees its slot and pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from hybrid_jax.engine.requests import StepEvent
from hybrid_jax.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams, SamplingParamsError
from hybrid_jax.engine.scheduler import FinishReason, RequestError
from hybrid_jax.models.tokenizer import TokenizerError
from hybrid_jax.server.metrics import ServerMetrics
from hybrid_jax.server.worker import EngineClosed, EngineWorker, QueueFull

__all__ = ["ChatRequest", "CompletionRequest", "create_app"]

_SEED_LIMIT = 2**32
# Choices of one request (``n``): each is a request of its own in the engine.
_MAX_CHOICES = 16
# How often a non-streaming handler checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields both endpoints share. ``top_k`` and ``stop_token_ids`` are extensions (as in
    vLLM); ``top_k`` -1 or 0 keeps every token."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    seed: Annotated[int, Field(ge=0, lt=_SEED_LIMIT)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    n: Annotated[int, Field(ge=1, le=_MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Fields that clients send at their defaults; any other value is refused, by name.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def engine_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` of the request (None: it asks for none)."""
        return None

    @model_validator(mode="after")
    def _unserved(self):
        unserved = {
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }
        for name, asked in unserved.items():
            if asked:
                raise PydanticCustomError(
                    "unserved", "{field} is not served by hybrid_jax; leave it unset",
                    {"field": name},
                )  # fmt: skip
        return self


_TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class CompletionRequest(_Sampling):
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    # The chosen token's log-probability and that many alternatives per token.
    logprobs: _TopLogprobs | None = None

    def engine_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: _TopLogprobs | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError(
                "unserved", "{field} needs logprobs=true", {"field": "top_logprobs"}
            )
        return self

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _error(status: int, message: str, param: str | None = None, kind: str | None = None):
    kind = kind or ("invalid_request_error" if status == 400 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if any(not s for s in stops):
        raise RequestError("stop strings must not be empty")
    return stops


class _Generation:
    """One request's events on the handler's event loop, with the stop strings applied."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stops: tuple[str, ...]):
        self.loop = loop
        self.queue: asyncio.Queue[StepEvent | BaseException] = asyncio.Queue()
        self.stops = stops
        self.text = ""
        self.sent = 0  # characters of text handed out
        self.tokens = 0
        self.finish: str | None = None
        self.prompt_tokens = 0
        # (token id, log-probability, alternatives) of each token, when the request asked,
        # and where its text starts in ``text``.
        self.logprobs: list[tuple[int, float, tuple]] = []
        self.starts: list[int] = []
        self.reported = 0  # entries of logprobs handed out

    def sink(self, item: StepEvent | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def take(self, event: StepEvent) -> str:
        """The text this event releases (held back while it may begin a stop string)."""
        if event.token_id >= 0:
            self.tokens += 1
            if event.logprob is not None:
                self.logprobs.append((event.token_id, event.logprob, event.top_logprobs or ()))
                self.starts.append(len(self.text))
        self.text += event.text
        if event.result is not None:
            self.prompt_tokens = len(event.result.prompt_token_ids)
            reason = event.result.finish_reason
            # OpenAI's names where they exist; "non_finite" (logits held inf or NaN) and
            # "abort" as they are.
            self.finish = "stop" if reason is FinishReason.STOP else str(reason)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text, self.finish = self.text[:at], "stop"
                self._trim_logprobs(at)
        end = len(self.text)
        if self.finish is None and self.stops:
            # Hold back a tail that a stop string could still start with.
            longest = max(len(s) for s in self.stops) - 1
            for k in range(min(longest, end - self.sent), 0, -1):
                if any(s.startswith(self.text[end - k :]) for s in self.stops):
                    end -= k
                    break
        new, self.sent = self.text[self.sent : end], max(self.sent, end)
        return new

    def _trim_logprobs(self, length: int) -> None:
        """Drops the entries of tokens whose text starts at or past ``length`` characters
        (a stop string cut the answer there); handed-out entries stay."""
        keep = max(sum(start < length for start in self.starts), self.reported)
        del self.logprobs[keep:], self.starts[keep:]

    def new_logprobs(self) -> list[tuple[int, float, tuple]]:
        """The entries not handed out yet whose text has been (at least partly) handed out,
        all of them once the request finished; marked as handed out. A token whose text is
        held back (it may begin a stop string) is reported with its text, or never when a
        stop string drops it."""
        ready = len(self.logprobs)
        if self.finish is None:
            ready = self.reported + sum(s < self.sent for s in self.starts[self.reported :])
        new, self.reported = self.logprobs[self.reported : ready], max(ready, self.reported)
        return new


def create_app(
    worker: EngineWorker, *, model_name: str, metrics: ServerMetrics | None = None
) -> FastAPI:
    """The API over a started ``worker``; ``model_name`` is the id ``/v1/models`` lists.
    The app closes the worker when it shuts down."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        worker.close()

    app = FastAPI(title="hybrid_jax", version="0.1.0", lifespan=lifespan)
    app.state.worker = worker
    tokenizer = worker.engine.tokenizer
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        kind = first.get("type", "")
        if kind == "json_invalid":
            return _error(
                400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}"
            )
        if kind == "unserved":
            return _error(400, first["msg"], first["ctx"]["field"])
        if not where:
            return _error(400, "the body is not a JSON object (send Content-Type: "
                               "application/json and an object of request fields)")  # fmt: skip
        if kind == "extra_forbidden":
            return _error(400, f"unknown field {where!r}", where)
        value = first.get("input")
        return _error(400, f"{where}={value!r}: {first.get('msg', 'invalid')}", where)

    @app.get("/health")
    async def health():
        if not worker.alive:
            return _error(503, f"the engine is not running: {worker.closed_reason}")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "hybrid_jax"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics_text():
        if metrics is None:
            return PlainTextResponse("", status_code=404)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def _token(token_id: int) -> str:
        return tokenizer.decode([token_id])

    def _completion_logprobs(entries, offset: int) -> dict[str, Any]:
        """The completions API's logprobs object of ``entries`` whose text starts at
        ``offset`` characters into the answer."""
        tokens = [_token(i) for i, _, _ in entries]
        offsets = list(itertools.accumulate((len(s) for s in tokens[:-1]), initial=offset))
        top = []
        for _, _, alts in entries:
            # Keyed by text: alternatives that decode alike keep the most likely one's value.
            by_text: dict[str, float] = {}
            for i, lp in alts:
                by_text.setdefault(_token(i), lp)
            top.append(by_text)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": top if any(alts for _, _, alts in entries) else None,
                "text_offset": offsets[: len(tokens)]}  # fmt: skip

    # A token's own bytes where the tokenizer knows them (one token may hold part of a
    # character); else the UTF-8 of its decoded text.
    token_bytes = getattr(tokenizer, "token_bytes", lambda i: _token(i).encode())

    def _chat_logprobs(entries) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            return {"token": _token(token_id), "logprob": logprob,
                    "bytes": list(token_bytes(token_id))}  # fmt: skip

        content = [{**one(i, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
                   for i, lp, alts in entries]  # fmt: skip
        return {"content": content}

    def _params(body: _Sampling, max_tokens: int | None) -> SamplingParams:
        limit = worker.engine.max_context
        # A field the request leaves out takes the checkpoint's generation_config.json value.
        given = body.model_fields_set
        defaults = worker.engine.generation_config

        def value(name: str, sent):
            return sent if name in given or name not in defaults else defaults[name]

        return SamplingParams(
            logprobs=body.engine_logprobs(),
            max_new_tokens=limit if max_tokens is None else max_tokens,
            temperature=value("temperature", body.temperature),
            top_k=value("top_k", max(body.top_k, 0)),
            top_p=value("top_p", body.top_p),
            seed=body.seed,
            stop_token_ids=tuple(body.stop_token_ids),
        )

    async def _start(body: _Sampling, prompt, max_tokens: int | None):
        """Submits the request's ``n`` choices (choice i seeded ``seed + i`` when a seed is
        given); the list of (generation, request id), or an error response with nothing
        left running."""
        if body.model is not None and body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here; use {model_name!r}",
                          "model", "not_found_error")  # fmt: skip
        started: list[tuple[_Generation, int]] = []
        try:
            params = _params(body, max_tokens)
            stops = _stop_strings(body.stop)
            for i in range(body.n):
                seed = None if body.seed is None else (body.seed + i) % _SEED_LIMIT
                choice = dataclasses.replace(params, seed=seed) if i else params
                generation = _Generation(asyncio.get_running_loop(), stops)
                future = worker.submit(prompt, choice, generation.sink)
                started.append((generation, await asyncio.wrap_future(future)))
        except (RequestError, SamplingParamsError, TokenizerError) as err:
            _abort(started)
            return _error(400, str(err))
        except (QueueFull, EngineClosed) as err:
            _abort(started)
            return _error(503, str(err))
        return started

    def _abort(started: list[tuple[_Generation, int]]) -> None:
        for _, request_id in started:
            worker.abort(request_id)

    async def _events(http: Request, generation: _Generation, request_id: int, stream: bool):
        """The request's released text pieces, until it finishes; aborts it when the client
        goes away or a stop string ends it."""
        finished = False  # by the engine: nothing left to abort
        try:
            while generation.finish is None:
                try:
                    item = await asyncio.wait_for(generation.queue.get(), _DISCONNECT_POLL_S)
                except TimeoutError:
                    if not stream and await http.is_disconnected():
                        return
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.result is not None
                piece = generation.take(item)
                if piece or generation.finish is not None:
                    yield piece
        finally:
            if not finished:
                worker.abort(request_id)

    async def _merged(http: Request, started, stream: bool) -> AsyncIterator[tuple[int, str]]:
        """``(choice index, piece)`` of every choice as they are released."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, generation: _Generation, request_id: int) -> None:
            try:
                async for piece in _events(http, generation, request_id, stream):
                    await queue.put((index, piece))
            except asyncio.CancelledError:
                raise
            except BaseException as err:  # handed to the consumer, which raises it
                await queue.put(err)
            finally:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(i, g, r)) for i, (g, r) in enumerate(started)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is done:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _answer(http: Request, body: _Sampling, started, chunk, whole):
        """Server-sent ``chunk(index, piece)`` events when the request streams; else
        ``whole()`` once every choice finished."""
        generations = [g for g, _ in started]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(generations, _merged(http, started, True), chunk, include_usage)
        try:
            async for _ in _merged(http, started, False):
                pass
        except EngineClosed as err:
            return _error(503, str(err))
        return whole()

    def _prompt_of(body: CompletionRequest) -> str | list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise RequestError(
                    f"prompt holds {len(prompt)} prompts; send one prompt per request"
                )
            return prompt[0]
        return prompt

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        try:
            prompt = _prompt_of(body)
        except RequestError as err:
            return _error(400, str(err), "prompt")
        started = await _start(body, prompt, body.max_tokens)
        if isinstance(started, Response):
            return started
        generations = [g for g, _ in started]
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sent = [0] * len(started)  # characters of each choice's text in earlier chunks

        def choice(index: int, text: str) -> dict[str, Any]:
            generation = generations[index]
            entries = generation.new_logprobs()
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(entries, sent[index])
            sent[index] += len(text)
            return {"index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": generation.finish}  # fmt: skip

        def chunk(index: int, text: str) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": now,
                    "model": model_name, "choices": [choice(index, text)]}  # fmt: skip

        def whole() -> dict[str, Any]:
            choices = [choice(i, g.text) for i, g in enumerate(generations)]
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": choices, "usage": _usage(generations)}  # fmt: skip

        return await _answer(http, body, started, chunk, whole)

    @app.post("/v1/chat/completions")
    async def chat(http: Request, body: ChatRequest):
        render = getattr(tokenizer, "apply_chat_template", None)
        if render is None:
            return _error(400, "this model's tokenizer has no chat template; use "
                               "/v1/completions with a text prompt", "messages")  # fmt: skip
        try:
            prompt = render([m.model_dump() for m in body.messages])
        except TokenizerError as err:
            return _error(400, str(err), "messages")
        max_tokens = body.max_completion_tokens or body.max_tokens
        started = await _start(body, prompt, max_tokens)
        if isinstance(started, Response):
            return started
        generations = [g for g, _ in started]
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first = [True] * len(started)

        def logprobs_of(generation: _Generation) -> dict[str, Any] | None:
            entries = generation.new_logprobs()
            return _chat_logprobs(entries) if body.logprobs else None

        def chunk(index: int, text: str) -> dict[str, Any]:
            delta: dict[str, Any] = {"content": text} if text else {}
            if first[index]:
                delta, first[index] = {"role": "assistant", **delta}, False
            generation = generations[index]
            choice = {"index": index, "delta": delta, "logprobs": logprobs_of(generation),
                      "finish_reason": generation.finish}  # fmt: skip
            return {"id": rid, "object": "chat.completion.chunk", "created": now,
                    "model": model_name, "choices": [choice]}  # fmt: skip

        def whole() -> dict[str, Any]:
            choices = []
            for index, generation in enumerate(generations):
                message = {"role": "assistant", "content": generation.text}
                choices.append({"index": index, "message": message,
                                "logprobs": logprobs_of(generation),
                                "finish_reason": generation.finish})  # fmt: skip
            return {"id": rid, "object": "chat.completion", "created": now,
                    "model": model_name, "choices": choices,
                    "usage": _usage(generations)}  # fmt: skip

        return await _answer(http, body, started, chunk, whole)

    return app


def _usage(generations: list[_Generation]) -> dict[str, int]:
    """One prompt's tokens and every choice's completion tokens."""
    prompt = generations[0].prompt_tokens
    completion = sum(g.tokens for g in generations)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _sse(generations: list[_Generation], pieces: AsyncIterator[tuple[int, str]], chunk,
         include_usage: bool):  # fmt: skip
    """A ``text/event-stream`` response of ``chunk(index, piece)`` per released piece."""

    async def lines() -> AsyncIterator[str]:
        try:
            async for index, piece in pieces:
                yield f"data: {json.dumps(chunk(index, piece))}\n\n"
        except EngineClosed as err:
            error = {"error": {"message": str(err), "type": "server_error", "code": 503}}
            yield f"data: {json.dumps(error)}\n\n"
            return
        if include_usage:
            last = chunk(0, "")
            last["choices"], last["usage"] = [], _usage(generations)
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
