"""Sampling parameters and the jitted, batch-invariant sampler.

``SamplingParams`` is validated when it is built, so a bad value is rejected before a request
reaches the scheduler. ``sample`` draws one token per row from last-token logits ``[B, V]``;
every row is computed from its own logits and parameters only, and its random key is
``fold_in(key(seed), step)`` (the request's seed and the index of the token being drawn), so a
request gets the same tokens whatever else shares its batch and however its prompt was
chunked. ``temperature == 0`` is greedy (argmax, no randomness). Which stages run (argmax
only, the draw, the top-k and top-p masks) is chosen on the host from the batch's parameters,
among executables compiled for each choice: nothing sorts the vocabulary. ``greedy_tokens`` is
the sampler's whole work for a batch of greedy rows, traceable, so that a serving step draws
those tokens itself and no second executable runs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

__all__ = [
    "EVERY_STAGE",
    "MAX_TOP_LOGPROBS",
    "NON_FINITE_TOKEN",
    "ONE_PASS_GREEDY",
    "VARIANTS",
    "Filters",
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "SamplingParamsError",
    "LogitStats",
    "greedy_tokens",
    "logit_stats",
    "pack_rows",
    "record_tokens",
    "rows_spec",
    "sample",
    "top_k_mask",
    "top_p_mask",
    "unpack_rows",
]

_MAX_SEED = 2**32

MAX_TOP_LOGPROBS = 20
"""The most alternatives ``SamplingParams.logprobs`` may ask for (the OpenAI API's limit)."""

NON_FINITE_TOKEN = -1
"""The token ``Sampler`` returns for a row whose logits hold inf or NaN (no token is drawn:
the request ends with ``FinishReason.NON_FINITE``)."""


ONE_PASS_GREEDY = True
"""Whether a batch of greedy rows finds each row's argmax, its log-probability and whether its
logits are finite in one reduction over the vocabulary (``logit_stats``) instead of an
argmax and a log-sum-exp that read the logits twice; every log-probability the sampler
reports is formed from the same statistics. Read while tracing."""


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
    ends after any of these is produced (it is kept in the output). ``logprobs``: None reports
    nothing; 0 reports each generated token's log-probability under the model (the log-softmax
    of its logits, before temperature, top-k and top-p); N in 1..``MAX_TOP_LOGPROBS`` also the
    N most likely tokens of each step with theirs.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

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
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
            raise SamplingParamsError(
                f"logprobs={lp!r} must be None or an int in 0..{MAX_TOP_LOGPROBS} (0: the "
                "chosen token's only)"
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
        if self.logprobs is not None and self.logprobs > vocab_size:
            raise SamplingParamsError(
                f"logprobs={self.logprobs} asks for more tokens than the vocabulary of "
                f"{vocab_size} holds"
            )
        for i, token in enumerate(self.stop_token_ids):
            if token >= vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids[{i}]={token} is outside the vocabulary "
                    f"(ids 0..{vocab_size - 1})"
                )


def _ordered_keys(logits: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 ``logits`` (``-0.0`` and ``0.0`` alike).

    A float's bits read as an unsigned integer order the positive floats; flipping every bit
    of a negative float and the sign bit of a positive one orders them all.
    """
    bits = jax.lax.bitcast_convert_type(logits.astype(jnp.float32) + 0.0, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def _largest_key_where(keys: jax.Array, holds) -> jax.Array:
    """Per row the largest uint32 ``t`` with ``holds(keys >= t)`` (a predicate ``[B, V]`` bool ->
    ``[B]`` bool that is monotone: true for every smaller ``t`` when true for ``t``), found bit
    by bit from the top in 32 passes over the row, with no sort.

    ``holds`` must be true at ``t = 0``, where every key counts."""
    rows = keys.shape[0]

    def bit(i, answer):
        candidate = answer | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(holds(keys >= candidate[:, None]), candidate, answer)

    # Unrolled: a device-side loop condition would make the host wait on every pass.
    return jax.lax.fori_loop(0, 32, bit, jnp.zeros(rows, jnp.uint32), unroll=True)


def top_k_mask(logits: jax.Array, k: jax.Array) -> jax.Array:
    """``[B, V]`` bool: True where a token is among its row's ``k[b]`` largest logits.

    k: int32 ``[B]``; 0 (or >= V) keeps every token. Ties with the k-th largest logit are kept,
    so a row may keep more than k tokens only when logits are exactly equal. The k-th largest
    value is found by a bitwise search over the logits' order (no sort of the vocabulary).
    """
    vocab = logits.shape[-1]
    keys = _ordered_keys(logits)
    wanted = jnp.clip(k, 1, vocab)
    kth = _largest_key_where(keys, lambda seen: jnp.sum(seen, axis=-1) >= wanted)
    return (keys >= kth[:, None]) | ((k <= 0) | (k >= vocab))[:, None]


def top_p_mask(logits: jax.Array, p: jax.Array) -> jax.Array:
    """``[B, V]`` bool: the smallest set of most likely tokens whose probability reaches
    ``p[b]`` (nucleus); the most likely token is always kept.

    logits: float32 ``[B, V]`` (``-inf`` for tokens already masked out); p: float32 ``[B]`` in
    (0, 1], 1 keeping every token. A token is kept when the probability of the tokens strictly
    more likely than it is below p (so tokens of equal logit are kept or dropped together).
    The boundary is found by a bitwise search over the logits' order (no sort).
    """
    probs = jax.nn.softmax(logits, axis=-1)
    keys = _ordered_keys(logits)

    def reaches_p(seen):  # the probability at or above a key reaches p
        return jnp.sum(jnp.where(seen, probs, 0.0), axis=-1) >= p

    # The largest key whose upper set still holds p: every token above it is kept, and the
    # tokens at it too, since what lies strictly above them is below p.
    boundary = _largest_key_where(keys, reaches_p)
    return (keys >= boundary[:, None]) | (p >= 1.0)[:, None]


class Filters(NamedTuple):
    """Which stages a batch's sampler runs (static; chosen on the host from the batch).

    ``draws``: some row samples (temperature > 0), else every row takes the argmax;
    ``top_k`` / ``top_p``: some row asks for that mask. A stage no row asks for is left out:
    its mask would keep every token, so leaving it out changes no row's token.
    """

    draws: bool
    top_k: bool
    top_p: bool


VARIANTS: tuple[Filters, ...] = (
    Filters(False, False, False),
    *(Filters(True, k, p) for k in (False, True) for p in (False, True)),
)
"""Every ``Filters`` a batch can need: the sampler is compiled for each."""

EVERY_STAGE = Filters(True, True, True)


def _argmax(logits: jax.Array) -> jax.Array:
    """Each row's most likely token, int32 ``[B]``: a greedy row's token."""
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
    filters: Filters = EVERY_STAGE,
) -> jax.Array:
    """One token per row: int32 ``[B]`` (traceable; ``Sampler`` is the compiled form).

    logits: ``[B, V]`` (the last token of each row); temperature, top_p: float32 ``[B]``;
    top_k: int32 ``[B]``; seeds: uint32 ``[B]``; steps: int32 ``[B]``, the index of the token
    being drawn in its request's output (the key is ``fold_in(key(seed), step)``). Rows with
    temperature 0 take the argmax. Rows are independent of each other (batch invariant).
    ``filters`` (static) leaves out the stages no row needs (``SamplingBatch.filters``).

    Nothing sorts the vocabulary, and nothing decides on the device which stages run: a
    device-side condition makes the host wait for the step's logits before it can dispatch
    the next step.
    """
    logits = logits.astype(jnp.float32)
    if not filters.draws:
        return _argmax(logits)
    # The greedy rows' tokens from the reduction record_tokens' statistics take: XLA forms it
    # once for both.
    greedy = logit_stats(logits).argmax
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if filters.top_k:
        scaled = jnp.where(top_k_mask(scaled, top_k), scaled, -jnp.inf)
    if filters.top_p:
        scaled = jnp.where(top_p_mask(scaled, top_p), scaled, -jnp.inf)

    def one(row_logits, seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row_logits)

    drawn = jax.vmap(one)(scaled, seeds, steps).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


class LogitStats(NamedTuple):
    """What each row's log-probabilities are formed from (``logit_stats``), ``[B]`` each
    (float32, int32 or bool): a token's log-probability is ``(logit - maximum) - log_sum``,
    so the most likely token's is ``-log_sum`` exactly, wherever it is formed."""

    maximum: jax.Array
    log_sum: jax.Array  # log(sum(exp(logits - maximum)))
    argmax: jax.Array  # the first of equal maxima
    finite: jax.Array  # bool: every logit of the row is finite

    def logprobs(self, logits: jax.Array) -> jax.Array:
        """The log-probabilities of ``logits`` ``[B, ...]`` (values taken from the rows these
        statistics describe); NaN on a row that is not finite."""
        shape = (-1,) + (1,) * (logits.ndim - 1)
        maximum, log_sum = self.maximum.reshape(shape), self.log_sum.reshape(shape)
        values = (logits.astype(jnp.float32) - maximum) - log_sum
        return jnp.where(self.finite.reshape(shape), values, jnp.nan)


_LONGEST_RUN = 2048
"""The longest run of a row's logits ``logit_stats`` reduces before it combines the runs: a
float32 sum accumulated in order over a whole vocabulary (as the CPU reduces) loses ~1e-4 of
its value; over runs of at most this many, then over the runs, ~1e-6."""


def logit_stats(logits: jax.Array) -> LogitStats:
    """``LogitStats`` of ``logits`` ``[B, V]`` (traceable). With ``ONE_PASS_GREEDY`` from one
    read of the logits: a reduction carries a running maximum, the sum of
    ``exp(logit - maximum)`` rescaled whenever the maximum moves, the maximum's index and an
    all-finite flag, over runs of the row (the longest divisor of V up to ``_LONGEST_RUN``)
    and then over the runs' results. Otherwise XLA's argmax and log-sum-exp, each a read of
    the logits. Where a row is not finite its statistics are meaningless."""
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise ValueError(f"logit_stats: logits must be [B, V] with V >= 1; got {logits.shape}")
    x = logits.astype(jnp.float32)
    if not ONE_PASS_GREEDY:
        maximum = jnp.max(x, axis=-1)
        log_sum = jnp.log(jnp.sum(jnp.exp(x - maximum[:, None]), axis=-1))
        return LogitStats(maximum, log_sum, _argmax(x), jnp.isfinite(x).all(axis=-1))
    rows, vocab = x.shape
    run = max(d for d in range(1, min(vocab, _LONGEST_RUN) + 1) if vocab % d == 0)

    def combine(a, b):
        (max_a, sum_a, at_a, finite_a), (max_b, sum_b, at_b, finite_b) = a, b
        b_wins = (max_b > max_a) | ((max_b == max_a) & (at_b < at_a))
        top = jnp.where(b_wins, max_b, max_a)
        low = jnp.where(b_wins, max_a, max_b)
        # Two -inf maxima (the reduction's start values) would give exp(nan).
        scale = jnp.where(low == top, 1.0, jnp.exp(low - top))
        total = jnp.where(b_wins, sum_b + sum_a * scale, sum_a + sum_b * scale)
        return top, total, jnp.where(b_wins, at_b, at_a), finite_a & finite_b

    start = (
        jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.int32(jnp.iinfo(jnp.int32).max),
        jnp.bool_(True),
    )  # fmt: skip
    shape = (rows, vocab // run, run)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1).reshape(shape)
    x = x.reshape(shape)
    operands = (x, jnp.ones(shape, jnp.float32), index, jnp.isfinite(x))
    runs = jax.lax.reduce(operands, start, combine, (2,))
    maximum, total, argmax, finite = jax.lax.reduce(runs, start, combine, (1,))
    return LogitStats(maximum, jnp.log(total), argmax, finite)


def record_tokens(
    logits: jax.Array, tokens: jax.Array, last_tokens: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What a step reports of the tokens drawn from ``logits`` ``[B, V]`` (traceable): the
    tokens ``[B]`` (``NON_FINITE_TOKEN`` for a row whose logits hold inf or NaN), their
    float32 log-probabilities under the model (NaN for such a row), and ``last_tokens`` with
    each row's token at its slot (0 for a non-finite row)."""
    stats = logit_stats(logits)
    chosen = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    return _recorded(stats, tokens, stats.logprobs(chosen), last_tokens, slots)


def _recorded(
    stats: LogitStats, tokens: jax.Array, logprobs: jax.Array, last_tokens: jax.Array,
    slots: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    # The buffer keeps a valid id: a step dispatched before this one is read back may feed
    # it, and that row's output is dropped when the request ends.
    kept = last_tokens.at[slots].set(jnp.where(stats.finite, tokens, 0))
    return jnp.where(stats.finite, tokens, NON_FINITE_TOKEN), logprobs, kept


def greedy_tokens(
    logits: jax.Array, last_tokens: jax.Array, slots: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``record_tokens`` of each row's argmax: what ``Sampler`` returns for a batch whose rows
    are all greedy (traceable, so a step can draw its own greedy tokens)."""
    stats = logit_stats(logits)
    logprobs = jnp.where(stats.finite, -stats.log_sum, jnp.nan)  # the maximum's, exactly
    return _recorded(stats, stats.argmax, logprobs, last_tokens, slots)


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

    @property
    def filters(self) -> Filters:
        """The sampler stages some row of this batch needs."""
        sampled = self.temperature > 0
        draws = bool(sampled.any())
        return Filters(
            draws,
            draws and bool((self.top_k[sampled] > 0).any()),
            draws and bool((self.top_p[sampled] < 1.0).any()),
        )


_ROW_DTYPES = (jnp.float32, jnp.int32, jnp.float32, jnp.uint32, jnp.int32, jnp.int32)
"""The dtypes of a step's per-row sampler inputs: temperature, top_k, top_p, seeds, steps and
the rows' slots, which travel as the int32 words of one ``[6, B]`` array (``pack_rows``)."""


def pack_rows(batch: SamplingBatch, slots: np.ndarray | jax.Array) -> np.ndarray | jax.Array:
    """The rows' sampling inputs and slots as one int32 ``[6, B]`` array, each float or seed
    by its bits: a step copies it to the device once, not six arrays one by one. Host arrays
    are joined on the host; where one is already on the device, there."""
    parts = (batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps, slots)
    if all(isinstance(part, np.ndarray) for part in parts):
        words = [np.asarray(p, d).view(np.int32) for p, d in zip(parts, _ROW_DTYPES, strict=True)]
        return np.stack(words)
    words = [jnp.asarray(p, d) for p, d in zip(parts, _ROW_DTYPES, strict=True)]
    return jnp.stack([jax.lax.bitcast_convert_type(w, jnp.int32) for w in words])


def rows_spec(batch_size: int) -> jax.ShapeDtypeStruct:
    """The shape and dtype of ``pack_rows``' array for ``batch_size`` rows."""
    return jax.ShapeDtypeStruct((len(_ROW_DTYPES), batch_size), jnp.int32)


def unpack_rows(rows: jax.Array) -> tuple[jax.Array, ...]:
    """``pack_rows``' arrays back from their words (traced)."""
    return tuple(
        jax.lax.bitcast_convert_type(rows[i], dtype) for i, dtype in enumerate(_ROW_DTYPES)
    )


class Sampler:
    """``sample`` compiled ahead of time for each batch size and each of its ``VARIANTS``,
    recording every row's token in a per-slot buffer; counts its traces.

    ``__call__(logits, batch, last_tokens, slots)`` returns ``(tokens [B], logprobs [B],
    last_tokens)`` with ``last_tokens[slots[b]] = tokens[b]`` (``NON_FINITE_TOKEN`` for a row
    whose logits hold inf or NaN, 0 in the buffer) and each token's log-probability under the
    model; ``top_logprobs(logits)`` the ``MAX_TOP_LOGPROBS`` most likely tokens of each row
    and their log-probabilities. A serving loop keeps the buffer on the device
    and its next decode step reads each request's input token from there, without waiting
    for this step's tokens to reach the host. Padded rows name slot 0, the pad slot.
    ``compile(batch_size, vocab_size, num_slots, dtype=)`` before serving; a call with a
    shape or dtype that was not compiled traces (``trace_count`` goes up), which a serving
    loop treats as a retrace.
    """

    def __init__(self) -> None:
        self.trace_count = 0
        self._jitted = jax.jit(self._traced, donate_argnums=2, static_argnums=3)
        self._compiled: dict[tuple[int, int, jnp.dtype, int, Filters], Any] = {}
        self._top_jitted = jax.jit(self._traced_top)
        self._top_compiled: dict[tuple[int, int, jnp.dtype], Any] = {}

    def _traced(self, logits, rows, last_tokens, filters):
        self.trace_count += 1
        temperature, top_k, top_p, seeds, steps, slots = unpack_rows(rows)
        if not filters.draws:
            return greedy_tokens(logits, last_tokens, slots)
        tokens = sample(logits, temperature, top_k, top_p, seeds, steps, filters)
        return record_tokens(logits, tokens, last_tokens, slots)

    def _traced_top(self, logits):
        self.trace_count += 1
        logits = logits.astype(jnp.float32)
        values, ids = jax.lax.top_k(logits, min(MAX_TOP_LOGPROBS, logits.shape[-1]))
        return logit_stats(logits).logprobs(values), ids.astype(jnp.int32)

    def compile(
        self, batch_size: int, vocab_size: int, num_slots: int, *, greedy: bool = True,
        dtype: DTypeLike = jnp.float32,
    ) -> float:  # fmt: skip
        """Compiles every variant for ``[batch_size, vocab_size]`` logits of ``dtype`` (a
        serving step's are in its model's dtype) and a buffer of ``num_slots`` (without
        ``greedy``, only those whose rows draw: a serving step draws a greedy batch's tokens
        itself, ``greedy_tokens``); returns the milliseconds it took."""
        b, spec, dtype = batch_size, jax.ShapeDtypeStruct, jnp.dtype(dtype)
        args = (
            spec((b, vocab_size), dtype),
            rows_spec(b),
            spec((num_slots,), jnp.int32),
        )
        start = time.perf_counter()
        for filters in (f for f in VARIANTS if greedy or f.draws):
            key = (batch_size, vocab_size, dtype, num_slots, filters)
            if key not in self._compiled:
                self._compiled[key] = self._jitted.lower(*args, filters).compile()
        if (batch_size, vocab_size, dtype) not in self._top_compiled:
            top = self._top_jitted.lower(args[0]).compile()
            self._top_compiled[batch_size, vocab_size, dtype] = top
        return 1e3 * (time.perf_counter() - start)

    def __call__(
        self, logits: jax.Array, batch: SamplingBatch, last_tokens: jax.Array, slots: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """int32 ``[B]`` tokens for ``logits`` ``[B, V]``, their float32 log-probabilities and
        the updated buffer (dispatched, not waited for; ``last_tokens`` is donated)."""
        rows = pack_rows(batch, slots)
        filters = batch.filters
        key = (*logits.shape, logits.dtype, last_tokens.shape[0], filters)
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled(logits, rows, last_tokens)
        return self._jitted(logits, rows, last_tokens, filters)

    def top_logprobs(self, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        """float32 ``[B, N]`` log-probabilities, descending, and int32 ``[B, N]`` token ids of
        each row's N = ``min(MAX_TOP_LOGPROBS, V)`` most likely tokens (dispatched, not waited
        for); a row whose logits are not finite gets NaN values."""
        compiled = self._top_compiled.get((*logits.shape, logits.dtype))
        if compiled is not None:
            return compiled(logits)
        return self._top_jitted(logits)
