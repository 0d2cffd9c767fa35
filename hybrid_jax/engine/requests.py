"""What the engine reports per request: finished ``Result``s, ``StepEvent``s as tokens arrive,
and the bookkeeping behind them (``Tracked`` requests, the ``InFlight`` step)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from hybrid_jax.engine.sampling import SamplingParams
from hybrid_jax.engine.scheduler import FinishReason, Request, ScheduledStep
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.models.tokenizer import TextStream

__all__ = ["InFlight", "Result", "StepEvent", "Tracked"]


@dataclasses.dataclass
class Result:
    """One finished request. Times are seconds: ``ttft`` from submission to the first token,
    ``token_latencies`` between consecutive tokens, ``total`` from submission to the end.
    ``logprobs``: each output token's log-probability, and ``top_logprobs`` each step's most
    likely ``(token id, log-probability)`` pairs, when ``SamplingParams.logprobs`` asked
    (None otherwise; ``top_logprobs`` holds ``logprobs`` of them per step)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    ttft: float
    token_latencies: list[float]
    total: float
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token (0 with fewer than two tokens)."""
        spent = sum(self.token_latencies)
        return len(self.token_latencies) / spent if spent > 0 else 0.0


class StepEvent(NamedTuple):
    """A token for ``request_id`` (``text``: the new text it completes, possibly empty);
    ``result`` is set when the request finished with this event. An aborted request that a
    stream follows ends with an event of ``token_id`` -1 (no token) carrying its result.
    ``logprob`` and ``top_logprobs``: the token's, as ``Result`` has them (None unless the
    request asked)."""

    request_id: int
    token_id: int
    text: str
    result: Result | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class InFlight(NamedTuple):
    """A dispatched step whose tokens are not read back yet."""

    step: ScheduledStep
    sampled: jax.Array  # int32 [bs], on the device
    dispatched: float
    meta: ForwardMetadata
    hidden: jax.Array | tuple  # [T, hidden] when the step keeps them (MTP drafts), else ()
    logprobs: jax.Array | None  # float32 [bs], each sampled token's; None: no row reports them
    top_logprobs: tuple  # (float32 [bs, N], int32 [bs, N]) when a row asked for N > 0, else ()


@dataclasses.dataclass(eq=False)
class Tracked:
    """A request the engine serves, with what it reports: its sampling, submission time, the
    text of its tokens as they are read back, and the time of each."""

    request: Request
    params: SamplingParams
    seed: int
    submitted: float
    text: TextStream
    token_times: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
