"""Continuous batching on the host: which requests run in the next step, and with which tokens.

``Scheduler`` keeps a waiting queue (first come, first served) and a running set. Each
``schedule()`` call describes one step as ``(mode, rows)`` for ``metadata.build_metadata``:

* every running request that is decoding gets one row of one token;
* running requests still prefilling get their next prompt chunk (``chunk_size`` tokens at
  most), within the step's token budget (``max_step_tokens``);
* then waiting requests are admitted in order while the running cap (``max_running``), the
  token budget, a free slot and enough free KV pages allow. A request that does not fit waits
  at the head of the queue (later ones wait behind it, so none starves); nothing fails.

The mode follows from the rows: only decodes is DECODE, only prompt chunks is EXTEND, both is
MIXED, none is IDLE. A request's first chunk is never a DECODE row, even when it is one token
long: a DECODE row continues its slot's state, and a new request's slot holds a stale one.

A request reserves at admission every KV page it can ever need (prompt plus its token budget,
capped by the context), so a running request never runs out of pages and nothing has to be
preempted.

After a step is dispatched, ``advance`` moves its rows forward before its tokens are known: a
row that samples leaves one token *pending* (on the device), and the request's next DECODE
row feeds ``PENDING`` in its place, which the step reads from the device. So the next step
can be scheduled and dispatched before this one is read back. ``resolve`` then records the
read-back tokens and finishes requests (a stop token, their token budget); a request that
stopped while a later step already carried it simply has that row's output dropped.
``commit`` is ``advance`` then ``resolve``, for a loop that waits for every step. Finishing
and ``abort`` return the slot and pages at once: a later step that reuses them is ordered
after every step already dispatched, and a new request never reads what the old one left.

Speculative decoding (``schedule_speculative``, ``resolve_verify``): decoding requests run in
TARGET_VERIFY steps, one row of D tokens each (the last sampled token, the root, then D-1
drafts from a proposer), apart from prefill, which keeps its EXTEND steps; when both kinds
of work wait, the two alternate so neither starves. A verify row's tokens are only known
once the previous step is read back, so this path waits for every step (no ``PENDING``).
The row may run up to D-1 positions past the request's last useful one (its drafts past
the budget are simply never kept), so a scheduler built with ``lookahead=D-1`` reserves
that many more positions of pages per request. ``resolve_verify`` records each row's
accepted drafts and bonus token, and moves ``num_computed`` by the accepted drafts plus one
(the root): the bonus is the next root. The rejected drafts' keys and values need no
release: they sit at positions past the accepted context, inside pages the request
reserved at admission anyway, and the next step writes those positions before anything
reads them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Sequence

from hybrid_jax.engine.sampling import NON_FINITE_TOKEN
from hybrid_jax.engine.speculative import NON_FINITE_MARK
from hybrid_jax.kv_cache import PageAllocator, pages_needed
from hybrid_jax.metadata import BucketPolicy, PageIds, RowSpec
from hybrid_jax.modes import ForwardMode
from hybrid_jax.state_pool import SlotAllocator

__all__ = [
    "PENDING",
    "FinishReason",
    "Request",
    "RequestError",
    "ScheduledRow",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
]


PENDING = -1
"""The token id of a DECODE row whose input is the request's last sampled token, still on the
device (the step reads it from the per-slot buffer the sampler writes)."""


class RequestError(ValueError):
    """A request the engine cannot serve (empty, too long, tokens outside the vocabulary...)."""


class FinishReason(enum.StrEnum):
    STOP = "stop"  # produced one of its stop tokens
    LENGTH = "length"  # reached max_new_tokens or the context
    ABORT = "abort"  # aborted by the caller
    NON_FINITE = "non_finite"  # its logits held inf or NaN: the model gave no distribution


@dataclasses.dataclass(eq=False)
class Request:
    """One request as the scheduler tracks it.

    ``token_ids`` is the prompt followed by the generated tokens read back so far;
    ``num_pending`` tokens more were sampled but are not read back yet. ``num_computed``
    counts the tokens already folded into its slot and pages (the next row's
    ``prefix_len``). ``max_new_tokens`` is already capped so that the request fits the
    context. ``scheduled_out``: no step will carry it again (its slot and pages are freed);
    ``finish_reason`` is set once its output is final.
    """

    request_id: int
    token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    prompt_len: int = dataclasses.field(init=False)
    num_computed: int = 0
    num_pending: int = 0
    scheduled_out: bool = False
    slot: int = 0
    pages: tuple[int, ...] = ()  # PageIds once admitted
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.prompt_len = len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_drawn(self) -> int:
        """Tokens sampled so far, read back or not (the index of the next one to draw)."""
        return self.num_generated + self.num_pending

    @property
    def is_decoding(self) -> bool:
        """The prompt is in the state; only the last sampled token is left to feed."""
        return self.num_computed >= self.prompt_len

    @property
    def max_context(self) -> int:
        """Positions this request can occupy: its last token is sampled, never fed."""
        return self.prompt_len + self.max_new_tokens - 1


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One row of a step: ``request`` feeds ``token_ids`` from position ``start``.

    ``samples`` is True when the step's output at this row is the request's next token (its
    last prompt chunk or a decode); an earlier prompt chunk's output is dropped.
    """

    request: Request
    start: int
    token_ids: tuple[int, ...]
    samples: bool

    @property
    def spec(self) -> RowSpec:
        req = self.request
        return RowSpec(req.slot, self.start, len(self.token_ids), req.pages)


@dataclasses.dataclass(frozen=True)
class ScheduledStep:
    """One step: its forward mode and its rows, in the order of the packed token axis."""

    mode: ForwardMode
    rows: tuple[ScheduledRow, ...]

    @property
    def row_specs(self) -> list[RowSpec]:
        """The rows as ``build_metadata`` takes them."""
        return [row.spec for row in self.rows]

    @property
    def token_ids(self) -> list[int]:
        """The step's tokens, packed row after row."""
        return [t for row in self.rows for t in row.token_ids]

    @property
    def num_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.rows)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step. ``max_running``: requests running at once (rows of a step; at
    most the policy's largest batch bucket). ``max_step_tokens``: tokens of a step (at most
    the largest token bucket, at least ``max_running`` so every decode fits). ``chunk_size``:
    prompt tokens one request feeds per step (chunked prefill). ``batch_invariant``: steps
    never mix decodes with prompt chunks (DECODE and EXTEND alternate while both wait), and a
    prompt chunk is always ``chunk_size`` tokens (or the prompt's rest): one that does not fit
    a step's remaining tokens waits for the next step instead of being cut shorter."""

    max_running: int
    max_step_tokens: int
    chunk_size: int
    batch_invariant: bool = False

    @classmethod
    def for_policy(
        cls,
        policy: BucketPolicy,
        max_running: int | None = None,
        max_step_tokens: int | None = None,
        chunk_size: int | None = None,
        *,
        batch_invariant: bool = False,
    ) -> SchedulerConfig:
        """Defaults from ``policy`` (largest batch and token buckets), checked against it."""
        max_running = policy.max_batch if max_running is None else max_running
        max_step_tokens = policy.max_tokens if max_step_tokens is None else max_step_tokens
        chunk_size = max_step_tokens if chunk_size is None else chunk_size
        for name, value in (
            ("max_running", max_running),
            ("max_step_tokens", max_step_tokens),
            ("chunk_size", chunk_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if max_running > policy.max_batch:
            raise ValueError(
                f"max_running={max_running} exceeds the largest batch bucket "
                f"{policy.max_batch}; lower it or build the BucketPolicy with a larger max_batch"
            )
        if max_step_tokens > policy.max_tokens:
            raise ValueError(
                f"max_step_tokens={max_step_tokens} exceeds the largest token bucket "
                f"{policy.max_tokens}; lower it or raise BucketPolicy max_tokens"
            )
        if max_step_tokens < max_running:
            raise ValueError(
                f"max_step_tokens={max_step_tokens} is below max_running={max_running}: a step "
                f"could not carry one decode token per running request; raise max_step_tokens"
            )
        return cls(max_running, max_step_tokens, chunk_size, batch_invariant)


class Scheduler:
    """Waiting and running requests, and the step each ``schedule()`` call proposes.

    ``slots`` hands out linear-state slots; ``pages`` KV pages (None for a model without
    full-attention layers). ``max_context`` bounds every request's positions; ``lookahead``
    positions more get pages (D-1 under speculative decoding, see the module docstring).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        slots: SlotAllocator,
        pages: PageAllocator | None,
        *,
        max_context: int,
        lookahead: int = 0,
    ) -> None:
        self.config = config
        self.slots = slots
        self.pages = pages
        self.max_context = max_context
        self.lookahead = lookahead
        self._last_verified = False
        self._decoded_last = False  # batch_invariant: the last step with decodes ran them
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._ids: dict[int, Request] = {}

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_for(self, request: Request) -> int:
        if self.pages is None:
            return 0
        return pages_needed(request.max_context + self.lookahead, self.pages.page_size)

    def add(self, request: Request) -> None:
        """Queues ``request``; raises ``RequestError`` (nothing queued) if it can never run."""
        self.check(request)
        self.waiting.append(request)
        self._ids[request.request_id] = request

    def check(self, request: Request) -> None:
        """Raises ``RequestError`` if ``add(request)`` would refuse it; changes nothing."""
        if request.request_id in self._ids:
            raise RequestError(f"request_id={request.request_id} is already queued or running")
        if request.prompt_len < 1:
            raise RequestError(f"request {request.request_id} has an empty prompt")
        if request.max_context > self.max_context:
            raise RequestError(
                f"request {request.request_id} spans {request.max_context} positions (prompt "
                f"{request.prompt_len} + {request.max_new_tokens} new - 1), past "
                f"max_context={self.max_context}; shorten it or lower max_new_tokens"
            )
        need = self.pages_for(request)
        if self.pages is not None and need > self.pages.capacity:
            raise RequestError(
                f"request {request.request_id} needs {need} KV pages but the cache has "
                f"{self.pages.capacity}; it could never be admitted, build a larger cache"
            )

    def abort(self, request_id: int) -> Request | None:
        """Removes the request, frees what it holds; returns it (None if unknown/finished)."""
        request = self._ids.get(request_id)
        if request is None:
            return None
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, FinishReason.ABORT)
        return request

    def _release(self, request: Request) -> None:
        """No more steps for ``request``: frees its slot and pages (once)."""
        if request in self.running:
            self.running.remove(request)
        request.scheduled_out = True
        if request.slot:
            self.slots.free([request.slot])
            request.slot = 0
        if request.pages and self.pages is not None:
            self.pages.free(request.pages)
            request.pages = ()

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self._release(request)
        request.finish_reason = reason
        del self._ids[request.request_id]

    def _can_admit(self, request: Request) -> bool:
        if self.slots.num_free < 1:
            return False
        return self.pages is None or self.pages.num_free >= self.pages_for(request)

    def _admit(self, request: Request) -> None:
        (request.slot,) = self.slots.allocate(1)
        if self.pages is not None:
            request.pages = PageIds(self.pages.allocate(self.pages_for(request)))
        self.running.append(request)

    def _chunk_len(self, request: Request) -> int:
        """Prompt tokens of the request's next chunk when the step has room for them all."""
        return min(request.prompt_len - request.num_computed, self.config.chunk_size)

    def _chunk(self, request: Request, budget: int) -> ScheduledRow | None:
        n = self._chunk_len(request)
        if n > budget and self.config.batch_invariant:
            return None  # its whole chunk in a later step: chunk borders never move
        n = min(n, budget)
        if n < 1:
            return None
        start = request.num_computed
        ids = tuple(request.token_ids[start : start + n])
        return ScheduledRow(request, start, ids, samples=start + n == request.prompt_len)

    def _prefill_rows(self, budget: int) -> list[ScheduledRow]:
        """Next prompt chunks of running requests, then admissions, within ``budget``."""
        chunks = []
        for req in self.running:
            if not req.is_decoding and (row := self._chunk(req, budget)) is not None:
                chunks.append(row)
                budget -= len(row.token_ids)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.config.max_running
            and self._can_admit(self.waiting[0])
        ):
            if self.config.batch_invariant and self._chunk_len(self.waiting[0]) > budget:
                break
            req = self.waiting.popleft()
            self._admit(req)
            row = self._chunk(req, budget)
            chunks.append(row)
            budget -= len(row.token_ids)
        return chunks

    def schedule(self) -> ScheduledStep:
        """The next step. Admits waiting requests (allocating their slot and pages) but
        changes nothing else; call ``advance`` once the step is dispatched (or ``commit``
        with its sampled tokens)."""
        decodes = []
        for req in self.running:
            if req.is_decoding:
                token = PENDING if req.num_pending else req.token_ids[-1]
                decodes.append(ScheduledRow(req, req.num_computed, (token,), True))
        if self.config.batch_invariant and decodes:
            # Alternate: a decode row of a MIXED step would run the prompts' path.
            chunks = self._prefill_rows(self.config.max_step_tokens) if self._decoded_last else []
            self._decoded_last = not chunks
            if chunks:
                return ScheduledStep(ForwardMode.EXTEND, tuple(chunks))
            return ScheduledStep(ForwardMode.DECODE, tuple(decodes))
        chunks = self._prefill_rows(self.config.max_step_tokens - len(decodes))
        mode = (
            ForwardMode.MIXED
            if decodes and chunks
            else ForwardMode.DECODE
            if decodes
            else ForwardMode.EXTEND
            if chunks
            else ForwardMode.IDLE
        )
        return ScheduledStep(mode, (*decodes, *chunks))

    def schedule_speculative(self, propose: Callable[[Request], Sequence[int]]) -> ScheduledStep:
        """The next step under speculative decoding: TARGET_VERIFY of every decoding request
        (its root, then ``propose(request)``, the D-1 drafts) or EXTEND of prompt chunks and
        admissions, alternating when both are possible. Every earlier step must have been
        resolved (``commit`` / ``resolve_verify``): a row's root is its last read-back token.
        """
        decoding = [req for req in self.running if req.is_decoding]
        if any(req.num_pending for req in decoding):
            raise ValueError(
                "a request still has a token pending: speculative steps need every earlier "
                "step read back first (commit or resolve_verify it)"
            )
        if not decoding or self._last_verified:
            chunks = self._prefill_rows(self.config.max_step_tokens)
            if chunks or not decoding:
                self._last_verified = False
                mode = ForwardMode.EXTEND if chunks else ForwardMode.IDLE
                return ScheduledStep(mode, tuple(chunks))
        rows = []
        for req in decoding:
            drafts = tuple(int(t) for t in propose(req))
            rows.append(ScheduledRow(req, req.num_computed, (req.token_ids[-1], *drafts), True))
        self._last_verified = True
        return ScheduledStep(ForwardMode.TARGET_VERIFY, tuple(rows))

    def advance(self, step: ScheduledStep) -> None:
        """Moves ``step``'s rows forward once it is dispatched: its tokens are in the state and
        every sampling row leaves one token pending. A request that has now drawn its whole
        budget is scheduled out (its slot and pages freed); its tokens come with ``resolve``.
        """
        for row in step.rows:
            req = row.request
            if req.scheduled_out:
                continue  # aborted since schedule()
            req.num_computed = row.start + len(row.token_ids)
            if row.samples:
                req.num_pending += 1
                if req.num_drawn >= req.max_new_tokens:
                    self._release(req)

    def resolve(self, step: ScheduledStep, sampled: Sequence[int]) -> list[Request]:
        """Records the read-back tokens of an advanced ``step`` (``sampled[i]`` for row i) and
        finishes requests on a stop token, their budget, or the sampler's ``NON_FINITE_TOKEN``
        (the row's logits held inf or NaN); returns those finished now.

        Rows of a request that already finished (aborted, or stopped in an earlier step) are
        dropped.
        """
        if len(sampled) < len(step.rows):
            raise ValueError(f"{len(sampled)} sampled tokens for a step of {len(step.rows)} rows")
        finished = []
        for row, token in zip(step.rows, sampled, strict=False):
            req = row.request
            if not row.samples or req.finish_reason is not None:
                continue
            req.num_pending -= 1
            if int(token) == NON_FINITE_TOKEN:
                self._finish(req, FinishReason.NON_FINITE)  # no token to keep
                finished.append(req)
                continue
            req.token_ids.append(int(token))
            if int(token) in req.stop_token_ids:
                reason = FinishReason.STOP
            elif req.num_generated >= req.max_new_tokens:
                reason = FinishReason.LENGTH
            else:
                continue
            self._finish(req, reason)
            finished.append(req)
        return finished

    def commit(self, step: ScheduledStep, sampled: Sequence[int]) -> list[Request]:
        """``advance`` then ``resolve``: for a loop that reads every step back before the
        next."""
        self.advance(step)
        return self.resolve(step, sampled)

    def resolve_verify(
        self, step: ScheduledStep, emitted: Sequence[Sequence[int]]
    ) -> list[tuple[Request, list[int]]]:
        """Records a TARGET_VERIFY step read back: ``emitted[i]``, row i's accepted drafts
        then its bonus token. The root and the accepted drafts are now in the state
        (``num_computed`` moves by ``len(emitted[i])``); tokens after a stop token or past the
        budget are dropped, and ``NON_FINITE_MARK`` ends the request with the tokens before
        it. Returns, per row still live, the request and the tokens kept;
        finished requests free their slot and pages.
        """
        if step.mode is not ForwardMode.TARGET_VERIFY:
            raise ValueError(f"resolve_verify takes a TARGET_VERIFY step, got {step.mode.name}")
        if len(emitted) < len(step.rows):
            raise ValueError(f"{len(emitted)} emitted rows for a step of {len(step.rows)} rows")
        kept = []
        for row, tokens in zip(step.rows, emitted, strict=False):
            req = row.request
            if req.finish_reason is not None or req.scheduled_out:
                continue  # aborted since schedule_speculative()
            if not 1 <= len(tokens) <= len(row.token_ids):
                raise ValueError(
                    f"row of request {req.request_id} emitted {len(tokens)} tokens; a verify "
                    f"row of {len(row.token_ids)} emits 1..{len(row.token_ids)}"
                )
            req.num_computed = row.start + len(tokens)
            new, reason = [], None
            for token in tokens:
                if int(token) == NON_FINITE_MARK:
                    self._finish(req, FinishReason.NON_FINITE)  # no token to keep
                    break
                new.append(int(token))
                req.token_ids.append(int(token))
                if int(token) in req.stop_token_ids:
                    reason = FinishReason.STOP
                elif req.num_generated >= req.max_new_tokens:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    self._finish(req, reason)
                    break
            kept.append((req, new))
        return kept
