"""Sampling parameters and the jitted, batch-invariant sampler.

``SamplingParams`` is validated when it is built, so a bad value is rejected before a request
reaches the scheduler. ``sample`` draws one token per row from last-token logits ``[B, V]``;
every row is computed from its own logits and parameters only, and its random key is
``fold_in(key(seed), step)`` (the request's seed and the index of the token being drawn), so a
request gets the same tokens whatever else shares its batch and however its prompt was
chunked. ``temperature == 0`` is greedy (argmax, no randomness).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "SamplingParamsError",
    "sample",
    "top_k_mask",
    "top_p_mask",
]

_MAX_SEED = 2**32


class SamplingParamsError(ValueError):
    """A sampling parameter outside its valid range, naming the field and the rule."""


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request draws its tokens.

    ``max_new_tokens``: tokens to generate at most (>= 1). ``temperature``: 0 is greedy
    (argmax), > 0 divides the logits before sampling. ``top_k``: keep the k most likely tokens
    (0: all). ``top_p``: keep the smallest set of most likely tokens whose probability reaches
    ``top_p`` (1: all); applied after top-k. ``seed``: the request's random stream (None: the
    engine picks one); with a seed the tokens are reproducible. ``stop_token_ids``: generation
    ends after any of these is produced (it is kept in the output).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if not _is_int(n) or n < 1:
            raise SamplingParamsError(f"max_new_tokens={n!r} must be an int >= 1")
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise SamplingParamsError(
                f"temperature={t!r} must be a finite number >= 0 (0 means greedy decoding)"
            )
        k = self.top_k
        if not _is_int(k) or k < 0:
            raise SamplingParamsError(f"top_k={k!r} must be an int >= 0 (0 keeps every token)")
        p = self.top_p
        if not _is_real(p) or not 0 < p <= 1:
            raise SamplingParamsError(f"top_p={p!r} must be in (0, 1] (1 keeps every token)")
        s = self.seed
        if s is not None and (not _is_int(s) or not 0 <= s < _MAX_SEED):
            raise SamplingParamsError(f"seed={s!r} must be None or an int in 0..{_MAX_SEED - 1}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise SamplingParamsError(
                f"stop_token_ids={self.stop_token_ids!r} must be a sequence of token ids"
            )
        stops = tuple(self.stop_token_ids)
        for i, token in enumerate(stops):
            if not _is_int(token) or token < 0:
                raise SamplingParamsError(
                    f"stop_token_ids[{i}]={token!r} must be a token id (an int >= 0)"
                )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ``SamplingParamsError`` for a top_k or stop token the vocabulary cannot have."""
        if self.top_k > vocab_size:
            raise SamplingParamsError(
                f"top_k={self.top_k} exceeds the vocabulary of {vocab_size} tokens; use "
                f"0..{vocab_size} (0 keeps every token)"
            )
        for i, token in enumerate(self.stop_token_ids):
            if token >= vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids[{i}]={token} is outside the vocabulary "
                    f"(ids 0..{vocab_size - 1})"
                )


def top_k_mask(logits: jax.Array, k: jax.Array) -> jax.Array:
    """``[B, V]`` bool: True where a token is among its row's ``k[b]`` largest logits.

    k: int32 ``[B]``; 0 (or >= V) keeps every token. Ties with the k-th largest logit are kept,
    so a row may keep more than k tokens only when logits are exactly equal.
    """
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1, descending=True)
    kth = jnp.take_along_axis(ordered, jnp.clip(k - 1, 0, vocab - 1)[:, None], axis=-1)
    return (logits >= kth) | ((k <= 0) | (k >= vocab))[:, None]


def top_p_mask(logits: jax.Array, p: jax.Array) -> jax.Array:
    """``[B, V]`` bool: the smallest set of most likely tokens whose probability reaches
    ``p[b]`` (nucleus); the most likely token is always kept.

    logits: float32 ``[B, V]`` (``-inf`` for tokens already masked out); p: float32 ``[B]`` in
    (0, 1]. A token is kept when the probability of the tokens strictly more likely than it is
    below p.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    order = jnp.argsort(-logits, axis=-1, stable=True)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = (before < p[:, None]) | (jnp.arange(logits.shape[-1]) == 0)
    keep = jnp.zeros_like(keep_sorted)
    rows = jnp.arange(logits.shape[0])[:, None]
    return keep.at[rows, order].set(keep_sorted)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
) -> jax.Array:
    """One token per row: int32 ``[B]`` (traceable; ``Sampler`` is the compiled form).

    logits: ``[B, V]`` (the last token of each row); temperature, top_p: float32 ``[B]``;
    top_k: int32 ``[B]``; seeds: uint32 ``[B]``; steps: int32 ``[B]``, the index of the token
    being drawn in its request's output (the key is ``fold_in(key(seed), step)``). Rows with
    temperature 0 take the argmax. Rows are independent of each other (batch invariant).
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = jnp.where(top_k_mask(scaled, top_k), scaled, -jnp.inf)
    scaled = jnp.where(top_p_mask(scaled, top_p), scaled, -jnp.inf)

    def one(row_logits, seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row_logits)

    drawn = jax.vmap(one)(scaled, seeds, steps).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling inputs of one step, padded to the step's batch size (host arrays).

    Padded rows are greedy with seed 0; their tokens are never read.
    """

    temperature: np.ndarray  # float32 [B]
    top_k: np.ndarray  # int32 [B]
    top_p: np.ndarray  # float32 [B]
    seeds: np.ndarray  # uint32 [B]
    steps: np.ndarray  # int32 [B]

    @classmethod
    def pack(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        batch_size: int,
    ) -> SamplingBatch:
        """Rows ``0..len(params)-1`` from ``params``, their seeds and token indices; the rest
        padding."""
        if not len(params) == len(seeds) == len(steps) <= batch_size:
            raise ValueError(
                f"{len(params)} params, {len(seeds)} seeds and {len(steps)} steps for a batch "
                f"of {batch_size} rows; give one of each per real row"
            )
        n = len(params)
        temperature = np.zeros(batch_size, np.float32)
        top_k = np.zeros(batch_size, np.int32)
        top_p = np.ones(batch_size, np.float32)
        seed = np.zeros(batch_size, np.uint32)
        step = np.zeros(batch_size, np.int32)
        temperature[:n] = [p.temperature for p in params]
        top_k[:n] = [p.top_k for p in params]
        top_p[:n] = [p.top_p for p in params]
        seed[:n] = seeds
        step[:n] = steps
        return cls(temperature, top_k, top_p, seed, step)


class Sampler:
    """``sample`` compiled ahead of time for each batch size, recording every row's token in a
    per-slot buffer; counts its traces.

    ``__call__(logits, batch, last_tokens, slots)`` returns ``(tokens [B], last_tokens)``
    with ``last_tokens[slots[b]] = tokens[b]``: a serving loop keeps the buffer on the device
    and its next decode step reads each request's input token from there, without waiting
    for this step's tokens to reach the host. Padded rows name slot 0, the pad slot.
    ``compile(batch_size, vocab_size, num_slots)`` before serving; a call with a shape that
    was not compiled traces (``trace_count`` goes up), which a serving loop treats as a
    retrace.
    """

    def __init__(self) -> None:
        self.trace_count = 0
        self._jitted = jax.jit(self._traced, donate_argnums=6)
        self._compiled: dict[tuple[int, int, int], Any] = {}

    def _traced(self, logits, temperature, top_k, top_p, seeds, steps, last_tokens, slots):
        self.trace_count += 1
        tokens = sample(logits, temperature, top_k, top_p, seeds, steps)
        return tokens, last_tokens.at[slots].set(tokens)

    def compile(self, batch_size: int, vocab_size: int, num_slots: int) -> float:
        """Compiles for ``[batch_size, vocab_size]`` float32 logits and a buffer of
        ``num_slots``; returns the milliseconds it took."""
        key = (batch_size, vocab_size, num_slots)
        if key in self._compiled:
            return 0.0
        b, spec = batch_size, jax.ShapeDtypeStruct
        args = (
            spec((b, vocab_size), jnp.float32),
            spec((b,), jnp.float32),
            spec((b,), jnp.int32),
            spec((b,), jnp.float32),
            spec((b,), jnp.uint32),
            spec((b,), jnp.int32),
            spec((num_slots,), jnp.int32),
            spec((b,), jnp.int32),
        )
        start = time.perf_counter()
        self._compiled[key] = self._jitted.lower(*args).compile()
        return 1e3 * (time.perf_counter() - start)

    def __call__(
        self, logits: jax.Array, batch: SamplingBatch, last_tokens: jax.Array, slots: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """int32 ``[B]`` tokens for ``logits`` ``[B, V]`` and the updated buffer (dispatched,
        not waited for; ``last_tokens`` is donated)."""
        args = (batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps)
        compiled = self._compiled.get((*logits.shape, last_tokens.shape[0]))
        if compiled is not None:
            return compiled(logits, *args, last_tokens, slots)
        return self._jitted(logits, *args, last_tokens, slots)
