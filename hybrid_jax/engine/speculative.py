"""Speculative decoding: where draft tokens come from and which of them the target accepts.

A verify row carries exactly D tokens: the root (the request's last sampled token, not yet in
its state) followed by D-1 drafts. The target model scores all D in one TARGET_VERIFY step;
``accept`` then keeps the longest prefix of drafts the target agrees with and appends one
token of the target's own (the *bonus*: its token at the first rejection, or after the last
draft when all are accepted). The bonus is not folded into the state; it is the next step's
root. So a row emits between 1 and D tokens per step and its context grows by the accepted
drafts plus one (the root).

Draft sources:

* ``"ngram"`` (prompt lookup, no model): ``NgramDrafter`` finds the most recent earlier
  occurrence of the history's last n tokens (longest n first) and proposes what followed it.
  When nothing matches, or the match runs out before D-1 tokens, the row is padded by
  repeating its last token. The row still runs in TARGET_VERIFY, never DECODE: a padding
  draft is a guess like any other (the acceptance rule never trusts a draft, so correctness
  does not depend on it), every verify step keeps one compiled shape, and a row whose
  padding the target happens to agree with still gains tokens.
* ``"mtp"`` (Qwen3-Next's multi-token-prediction head, ``engine/mtp.py``): after every step
  that samples for a request (its last prompt chunk, or a verify), the head runs over the
  positions the target just folded (EXTEND after a prefill step, DRAFT_EXTEND over the
  accepted tokens after a verify), reading the target's hidden states there and the tokens
  one position ahead, then D-2 DECODE steps of its own; its greedy guesses are the row's
  D-1 drafts. Every step of the head is compiled ahead of time like the target's.

Tree drafts (several candidates per position) are not built: ``SpeculativeConfig`` refuses
``tree=True``.

Acceptance: temperature 0 accepts a draft when it equals the target's argmax. Temperature
> 0 uses rejection sampling for a point-mass draft: draft d is accepted with probability
``p(d)`` (the target's distribution after temperature, top-k and top-p), else the token is
drawn from ``p`` with d removed, renormalised, which leaves every emitted token distributed
exactly as ``p``. Random keys are ``fold_in(key(seed), step + j)`` for the j-th token of the
row, so a seeded request is reproducible whatever shares its batch. A key decides only
tokens that are kept (positions past the first rejection are drawn but ignored) and the next
step starts at the first index not kept, so no key decides two tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.engine.sampling import SamplingBatch, top_k_mask, top_p_mask
from hybrid_jax.metadata import MAX_DRAFT_TOKENS

__all__ = [
    "Acceptance",
    "DRAFT_SOURCES",
    "NgramDrafter",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculativeStats",
    "Verifier",
    "accept",
    "rejection_sample",
    "target_probs",
]

DRAFT_SOURCES = ("ngram", "mtp")
"""The draft sources that are built."""


class SpeculativeConfigError(ValueError):
    """A speculative-decoding setting that is out of range or not built, naming the field."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    ``source``: where drafts come from, ``"ngram"`` or ``"mtp"`` (the model's
    multi-token-prediction head). ``num_draft_tokens``: D, the tokens of every verify row (the
    root plus D-1 drafts), 2..8. ``max_ngram`` / ``min_ngram``: the suffix lengths the n-gram
    lookup tries, longest first. ``tree``: tree drafts (several candidates per position); not
    built, so True is refused.
    """

    source: str = "ngram"
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    tree: bool = False

    def __post_init__(self) -> None:
        if self.source not in DRAFT_SOURCES:
            raise SpeculativeConfigError(
                f"source={self.source!r} is not a draft source; supported sources: "
                f"{', '.join(map(repr, DRAFT_SOURCES))}"
            )
        if self.tree:
            raise SpeculativeConfigError(
                "tree=True: tree drafts (several candidates per position, verified from their "
                "parent's state) are not built; TARGET_VERIFY verifies one chain of D tokens "
                "per row, use tree=False"
            )
        d = self.num_draft_tokens
        if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= MAX_DRAFT_TOKENS:
            raise SpeculativeConfigError(
                f"num_draft_tokens={d!r} is outside 2..{MAX_DRAFT_TOKENS}: a verify row is the "
                f"root plus at least one draft"
            )
        lo, hi = self.min_ngram, self.max_ngram
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise SpeculativeConfigError(f"min_ngram={lo!r} and max_ngram={hi!r} must be ints")
        if not 1 <= lo <= hi:
            raise SpeculativeConfigError(
                f"min_ngram={lo}, max_ngram={hi}: need 1 <= min_ngram <= max_ngram"
            )


class NgramDrafter:
    """Prompt-lookup drafts from a request's own tokens (prompt and generated so far)."""

    def __init__(self, num_drafts: int, max_ngram: int = 3, min_ngram: int = 1):
        self.num_drafts, self.max_ngram, self.min_ngram = num_drafts, max_ngram, min_ngram

    def lookup(self, history: Sequence[int]) -> list[int]:
        """Up to ``num_drafts`` tokens that followed the most recent earlier occurrence of the
        longest suffix of ``history`` (``max_ngram`` down to ``min_ngram`` tokens); [] when
        none occurs."""
        tokens = np.asarray(history, np.int64)
        n_hist = len(tokens)
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            # Windows that start before the suffix itself and leave a token to follow.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + self.num_drafts].tolist()
        return []

    def propose(self, history: Sequence[int]) -> tuple[int, ...]:
        """Exactly ``num_drafts`` tokens: the lookup, padded by repeating the last token."""
        found = self.lookup(history)
        pad = found[-1] if found else int(history[-1])
        return (*found, *[pad] * (self.num_drafts - len(found)))


class Acceptance(NamedTuple):
    """emitted: int32 ``[B, D]``, the accepted drafts then the bonus token, -1 after them;
    num_accepted: int32 ``[B]``, accepted drafts per row (0..D-1; the row emits one more)."""

    emitted: jax.Array
    num_accepted: jax.Array


def target_probs(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """float32 ``[B, D, V]``: the distribution each row samples from at each position (the
    same temperature, top-k and top-p as ``sampling.sample``); rows with temperature 0 get
    the temperature-1 distribution, which greedy acceptance never reads."""
    b, d, v = logits.shape
    divisor = jnp.where(temperature > 0, temperature, 1.0)[:, None, None]
    scaled = logits.astype(jnp.float32) / divisor
    flat = scaled.reshape(b * d, v)
    flat = jnp.where(top_k_mask(flat, jnp.repeat(top_k, d)), flat, -jnp.inf)
    flat = jnp.where(top_p_mask(flat, jnp.repeat(top_p, d)), flat, -jnp.inf)
    return jax.nn.softmax(flat, axis=-1).reshape(b, d, v)


def rejection_sample(probs: jax.Array, drafts: jax.Array, keys: jax.Array) -> Acceptance:
    """The acceptance rule for point-mass drafts (traceable).

    probs: float32 ``[B, D, V]`` the target's distribution after the root and each draft;
    drafts: int32 ``[B, D-1]``; keys: ``[B, D]`` random keys, one per position. Draft j is
    accepted with probability ``probs[:, j, draft_j]``; the first rejected position draws
    from ``probs`` without the draft, renormalised; if all are accepted, the bonus is drawn
    from ``probs[:, D-1]``.
    """
    split = jax.vmap(jax.vmap(lambda k: jax.random.split(k)))(keys)  # [B, D, 2]
    uniforms = jax.vmap(jax.vmap(jax.random.uniform))(split[:, :-1, 0])  # [B, D-1]
    p_draft = jnp.take_along_axis(probs[:, :-1], drafts[..., None], axis=-1)[..., 0]
    accepted = uniforms < p_draft
    removed = jax.nn.one_hot(drafts, probs.shape[-1], dtype=bool)
    residual = jnp.where(removed, 0.0, probs[:, :-1])
    # A draft of probability ~1 leaves (almost) nothing: then draw from p itself, which it
    # equals up to rounding; the rejection that gets here has probability ~0 anyway.
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), probs[:, :-1])
    replace = jnp.concatenate([residual, probs[:, -1:]], axis=1)  # [B, D, V]
    drawn = jax.vmap(jax.vmap(jax.random.categorical))(split[..., 1], jnp.log(replace))
    return _emit(accepted, drafts, drawn.astype(jnp.int32))


def _emit(accepted: jax.Array, drafts: jax.Array, replace: jax.Array) -> Acceptance:
    """accepted: bool ``[B, D-1]``; replace: int32 ``[B, D]``, the token each position emits
    when it is the first rejection (or the last)."""
    b, d = replace.shape
    num = jnp.cumprod(accepted.astype(jnp.int32), axis=1).sum(axis=1).astype(jnp.int32)
    bonus = jnp.take_along_axis(replace, num[:, None], axis=1)
    j = jnp.arange(d)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
    emitted = jnp.where(j < num[:, None], padded, jnp.where(j == num[:, None], bonus, -1))
    return Acceptance(emitted.astype(jnp.int32), num)


def accept(
    logits: jax.Array,
    tokens: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
) -> Acceptance:
    """Acceptance of a verify step (traceable; ``Verifier`` is the compiled form).

    logits: float32 ``[B, D, V]`` the target's logits after each of the row's D tokens;
    tokens: int32 ``[B, D]`` the root then the D-1 drafts; sampling inputs as in
    ``sampling.sample`` (``steps``: the index of the row's next token in its output). Rows
    with temperature 0 accept by exact match with the argmax and take the argmax as bonus.
    """
    d = logits.shape[1]
    drafts = tokens[:, 1:]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, D]
    base = jax.vmap(lambda s: jax.random.key(s))(seeds)
    keys = jax.vmap(lambda k, s: jax.vmap(lambda j: jax.random.fold_in(k, s + j))(jnp.arange(d)))(
        base, steps
    )
    sampled = rejection_sample(target_probs(logits, temperature, top_k, top_p), drafts, keys)
    exact = _emit(greedy[:, :-1] == drafts, drafts, greedy)
    pick = (temperature > 0)[:, None]
    return Acceptance(
        jnp.where(pick, sampled.emitted, exact.emitted),
        jnp.where(pick[:, 0], sampled.num_accepted, exact.num_accepted),
    )


class Verifier:
    """``accept`` and the pool commit, compiled ahead of time for each batch bucket.

    ``commit`` is ``StepFunctions.commit`` (a jitted ``commit_verified``); ``compile`` lowers
    it for the pool and the verify states of one batch bucket. A call for a shape that was
    not compiled goes through jit and counts in ``trace_count``, which a serving loop treats
    as a retrace.
    """

    def __init__(self, commit: Any):
        self.trace_count = 0
        self._commit_jit = commit
        self._accept_jit = jax.jit(self._traced_accept)
        self._accepts: dict[tuple[int, ...], Any] = {}
        self._commits: dict[int, Any] = {}

    def _traced_accept(self, logits, tokens, temperature, top_k, top_p, seeds, steps, slots):
        self.trace_count += 1
        acc = accept(logits, tokens, temperature, top_k, top_p, seeds, steps)
        # Padded rows (the pad slot) keep their slot: the commit skips negative steps.
        return acc, jnp.where(slots > 0, acc.num_accepted, -1)

    def compile(self, logits: Any, pool: Any, verify: Any) -> float:
        """Compiles for logits ``[B, D, V]`` and the pool/verify shapes (ShapeDtypeStructs or
        arrays) of one batch bucket; returns the milliseconds it took."""
        b, d, v = logits.shape
        spec = jax.ShapeDtypeStruct
        start = time.perf_counter()
        if logits.shape not in self._accepts:
            self._accepts[logits.shape] = self._accept_jit.lower(
                spec((b, d, v), jnp.float32), spec((b, d), jnp.int32), spec((b,), jnp.float32),
                spec((b,), jnp.int32), spec((b,), jnp.float32), spec((b,), jnp.uint32),
                spec((b,), jnp.int32), spec((b,), jnp.int32),
            ).compile()  # fmt: skip
        if b not in self._commits:
            shapes = jax.tree.map(lambda a: spec(a.shape, a.dtype), (pool, verify))
            self._commits[b] = self._commit_jit.lower(
                *shapes, spec((b,), jnp.int32), spec((b,), jnp.int32)
            ).compile()
        return 1e3 * (time.perf_counter() - start)

    def accept(
        self, logits: jax.Array, tokens: jax.Array, batch: SamplingBatch, slots: jax.Array
    ) -> tuple[Acceptance, jax.Array]:
        """Dispatches ``accept`` for one verify step (not waited for); also returns the
        commit's ``accepted_steps`` int32 ``[B]`` (-1 for padded rows, slot 0)."""
        args = (batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps, slots)
        compiled = self._accepts.get(logits.shape)
        if compiled is not None:
            return compiled(logits, tokens, *args)
        return self._accept_jit(logits, tokens, *args)

    def commit(
        self, pool: Any, verify: Any, state_indices: jax.Array, accepted_steps: jax.Array
    ) -> Any:
        """Writes each row's state after its last accepted token (``pool`` is donated)."""
        compiled = self._commits.get(state_indices.shape[0])
        if compiled is not None:
            return compiled(pool, verify, state_indices, accepted_steps)
        self.trace_count += 1
        return self._commit_jit(pool, verify, state_indices, accepted_steps)


@dataclasses.dataclass
class SpeculativeStats:
    """Counts over verify steps: ``rows`` verified, ``proposed`` drafts (D-1 per row, padding
    included), ``accepted`` drafts, ``emitted`` tokens (accepted drafts plus the bonus, before
    requests were cut at their stop token or budget)."""

    steps: int = 0
    rows: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per proposed draft (0 before any verify)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row emits on average (accepted drafts + 1; 1 is no gain)."""
        return self.emitted / self.rows if self.rows else 0.0
