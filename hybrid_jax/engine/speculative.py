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

Tree drafts (``tree=True``, MTP source only): a verify row is a tree of D nodes in
topological order (``SpeculativeConfig.parents``; node 0 is the root), verified in one
TARGET_VERIFY step where every node starts from its parent's state (``metadata.py``). The
topology is static per engine but travels as data (``ForwardMetadata.parents``), so another
topology needs no recompile. The MTP head fills it along one *spine*: the nodes with
children form a single root path, and the spine node at depth k gets as children the head's
top-c guesses after k DECODE steps along the spine (its expanded child takes the head's
best guess, its leaves the next ones, in node order). ``tree_width=k`` builds the default
shape: k children of the root, then a chain below the first (``(-1, 0, 0, 1)`` for D=4,
k=2). Why this shape: the head's cache is one sequence of positions, so it follows one
branch at the cost of a chain; siblings come free from the same step's distribution; and a
chain loses every draft when its first is wrong, which candidates at the root hedge. After the
verify, ``accept_tree`` walks the tree and ``commit_tree_verified`` (``backend/commit.py``)
keeps the accepted node's states and moves its root path's keys and values to contiguous
positions, so the row continues as if the path had been a chain. The n-gram source proposes
one continuation and builds no trees.

Acceptance: temperature 0 accepts a draft when it equals the target's argmax. Temperature
> 0 uses rejection sampling for a point-mass draft: draft d is accepted with probability
``p(d)`` (the target's distribution after temperature, top-k and top-p), else the token is
drawn from ``p`` with d removed, renormalised, which leaves every emitted token distributed
exactly as ``p``. Random keys are ``fold_in(key(seed), step + j)`` for the j-th token of the
row, so a seeded request is reproducible whatever shares its batch. A key decides only
tokens that are kept (positions past the first rejection are drawn but ignored) and the next
step starts at the first index not kept, so no key decides two tokens.

Over a tree, temperature 0 walks from the root, at each node following the first child
(in node order) whose token is the target's argmax there, and emits the argmax where no
child matches. Temperature > 0 tries the children of the current node in order: child c is
accepted with probability ``r(c)``, where r is the node's distribution ``p`` with the
children tried before removed and renormalised; a rejected child is removed from r. When
every child is rejected the token is drawn from r. Each try keeps the emitted token
distributed as ``p`` (the chain's argument, applied to r), so the rule is exact for any
number of point-mass candidates; a repeated candidate has r = 0 and is never accepted. The
token at depth j of the path is decided by key j (child t's uniform from ``fold_in(k, t)``
for t > 0, so a chain draws exactly what ``rejection_sample`` draws).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.backend.commit import commit_tree_verified, commit_verified
from hybrid_jax.engine.sampling import (
    SamplingBatch,
    pack_rows,
    rows_spec,
    top_k_mask,
    top_p_mask,
    unpack_rows,
)
from hybrid_jax.metadata import MAX_DRAFT_TOKENS, chain_parents, pack_metadata, tree_depths
from hybrid_jax.parallel import spec_of

__all__ = [
    "Acceptance",
    "DRAFT_SOURCES",
    "NON_FINITE_MARK",
    "NgramDrafter",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "SpeculativeStats",
    "TreeAcceptance",
    "TreeVerifier",
    "Verifier",
    "accept",
    "accept_tree",
    "candidate_ranks",
    "mark_non_finite",
    "rejection_sample",
    "target_probs",
    "tree_rejection_sample",
    "tree_spine",
    "width_tree",
]

DRAFT_SOURCES = ("ngram", "mtp")
"""The draft sources that are built."""

NON_FINITE_MARK = -2
"""In a verify row's emitted tokens: the logits that would decide this token held inf or NaN
(the row keeps the tokens before it, and its request ends with ``FinishReason.NON_FINITE``)."""


class SpeculativeConfigError(ValueError):
    """A speculative-decoding setting that is out of range or not built, naming the field."""


def tree_spine(parents: Sequence[int]) -> tuple[int, ...]:
    """The nodes with children of a tree (topological parents, ``-1`` at the root), root
    first. They must form one root path (the spine the MTP head drafts along); raises
    ``SpeculativeConfigError`` otherwise."""
    parents = tuple(parents)
    expanded = sorted({p for p in parents[1:]}, key=lambda node: tree_depths(parents)[node])
    for upper, lower in itertools.pairwise(expanded):
        if parents[lower] != upper:
            raise SpeculativeConfigError(
                f"tree_parents={parents!r}: nodes {upper} and {lower} both have children but "
                f"{lower} is not a child of {upper}; the MTP head drafts along one path, so the "
                f"nodes with children must form a single path from the root"
            )
    return tuple(expanded)


def candidate_ranks(parents: Sequence[int]) -> tuple[int, ...]:
    """Which of the head's guesses at its parent each node takes (0: the best; ``-1`` for
    the root): a spine node's expanded child takes 0, its leaves 1, 2, ... in node order."""
    parents = tuple(parents)
    spine = set(tree_spine(parents))
    ranks, taken = [-1], {}
    for node, parent in enumerate(parents[1:], start=1):
        has_spine_child = any(parents[c] == parent and c in spine for c in range(len(parents)))
        if node in spine:
            ranks.append(0)
        else:
            rank = taken.get(parent, 1 if has_spine_child else 0)
            ranks.append(rank)
            taken[parent] = rank + 1
    return tuple(ranks)


def width_tree(num_nodes: int, width: int) -> tuple[int, ...]:
    """The parents of ``width`` children of the root followed by a chain below the first:
    ``width_tree(5, 2) == (-1, 0, 0, 1, 3)``."""
    chain = [1, *range(width + 1, num_nodes - 1)][: num_nodes - 1 - width]
    return (-1, *[0] * width, *chain)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    ``source``: where drafts come from, ``"ngram"`` or ``"mtp"`` (the model's
    multi-token-prediction head). ``num_draft_tokens``: D, the tokens of every verify row (the
    root plus D-1 drafts), 2..8. ``max_ngram`` / ``min_ngram``: the suffix lengths the n-gram
    lookup tries, longest first. ``tree``: tree drafts (``source="mtp"`` only), D nodes per
    row; ``tree_parents``: their topology (parent of each node, ``-1`` at the root, nodes
    with children on one root path), or ``tree_width``: k children of the root then a chain
    below the first (``width_tree``), 2..D-1, when ``tree_parents`` is empty.
    """

    source: str = "ngram"
    num_draft_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    tree: bool = False
    tree_width: int = 2
    tree_parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree_parents", tuple(self.tree_parents))
        if self.source not in DRAFT_SOURCES:
            raise SpeculativeConfigError(
                f"source={self.source!r} is not a draft source; supported sources: "
                f"{', '.join(map(repr, DRAFT_SOURCES))}"
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
        self._check_tree()

    def _check_tree(self) -> None:
        d, parents = self.num_draft_tokens, self.tree_parents
        if not self.tree:
            if parents:
                raise SpeculativeConfigError(
                    f"tree_parents={parents!r} is given but tree=False; set tree=True"
                )
            return
        if self.source != "mtp":
            raise SpeculativeConfigError(
                f"tree=True with source={self.source!r}: the n-gram lookup proposes one "
                f"continuation, so it builds no trees; tree drafts come from source='mtp' "
                f"(the multi-token-prediction head), or use tree=False"
            )
        if not parents:
            w = self.tree_width
            if isinstance(w, bool) or not isinstance(w, int) or not 2 <= w <= d - 1:
                raise SpeculativeConfigError(
                    f"tree_width={w!r} is outside 2..{d - 1}: the root has at most D-1="
                    f"{d - 1} children, and one child is a chain (tree=False)"
                )
            return
        if len(parents) != d:
            raise SpeculativeConfigError(
                f"tree_parents has {len(parents)} nodes but num_draft_tokens={d}; give one "
                f"parent per node of the verify row (the root's is -1)"
            )
        for i, parent in enumerate(parents):
            ok = isinstance(parent, int) and not isinstance(parent, bool)
            if not ok or (i == 0 and parent != -1) or (i > 0 and not 0 <= parent < i):
                raise SpeculativeConfigError(
                    f"tree_parents[{i}]={parent!r}: node 0 is the root (parent -1) and every "
                    f"other node's parent is an earlier node (topological order)"
                )
        tree_spine(parents)

    @property
    def parents(self) -> tuple[int, ...]:
        """The topology of every verify row: the chain, ``tree_parents``, or ``width_tree``."""
        d = self.num_draft_tokens
        if not self.tree:
            return chain_parents(d)
        return self.tree_parents or width_tree(d, self.tree_width)


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
    drafts = tokens[:, 1:]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, D]
    keys = _position_keys(seeds, steps, logits.shape[1])
    sampled = rejection_sample(target_probs(logits, temperature, top_k, top_p), drafts, keys)
    exact = _emit(greedy[:, :-1] == drafts, drafts, greedy)
    pick = (temperature > 0)[:, None]
    return Acceptance(
        jnp.where(pick, sampled.emitted, exact.emitted),
        jnp.where(pick[:, 0], sampled.num_accepted, exact.num_accepted),
    )


def _position_keys(seeds: jax.Array, steps: jax.Array, d: int) -> jax.Array:
    """``[B, d]`` keys: ``fold_in(key(seeds[b]), steps[b] + j)`` decides the row's j-th token."""
    base = jax.vmap(lambda s: jax.random.key(s))(seeds)
    return jax.vmap(lambda k, s: jax.vmap(lambda j: jax.random.fold_in(k, s + j))(jnp.arange(d)))(
        base, steps
    )


class TreeAcceptance(NamedTuple):
    """emitted, num_accepted: as ``Acceptance`` (the accepted path's tokens below the root,
    then the bonus); nodes: int32 ``[B]``, the last accepted node (0: only the root);
    deciders: int32 ``[B, D]``, the node whose logits decided each emitted token."""

    emitted: jax.Array
    num_accepted: jax.Array
    nodes: jax.Array
    deciders: jax.Array


def mark_non_finite(emitted: jax.Array, logits: jax.Array, deciders: jax.Array) -> jax.Array:
    """``emitted`` ``[B, D]`` (-1 after a row's tokens) cut at the first token whose deciding
    logits (``logits[b, deciders[b, j]]``, ``[B, D, V]``) are not finite: that token becomes
    ``NON_FINITE_MARK`` and the ones after it -1. Other rows are returned as they are."""
    finite = jnp.isfinite(logits).all(axis=-1)
    bad = ~jnp.take_along_axis(finite, deciders, axis=1) & (emitted >= 0)
    first = jnp.where(bad.any(axis=1), jnp.argmax(bad, axis=1), emitted.shape[1])[:, None]
    j = jnp.arange(emitted.shape[1])[None, :]
    return jnp.where(j < first, emitted, jnp.where(j == first, NON_FINITE_MARK, -1))


def _walk_row(
    probs: jax.Array,
    argmax: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    keys: jax.Array,
    greedy: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row of ``tree_rejection_sample``: probs ``[D, V]``, argmax/tokens/parents ``[D]``,
    keys ``[D]``, greedy a bool scalar. Returns (emitted ``[D]``, accepted count, node)."""
    d, v = probs.shape
    split = jax.vmap(jax.random.split)(keys)  # [D, 2]

    def uniforms(key: jax.Array) -> jax.Array:
        # The first child's uniform is the chain's draw, so a chain walks like
        # rejection_sample; later children fold their rank in.
        ks = [key, *(jax.random.fold_in(key, t) for t in range(1, d - 1))]
        return jnp.stack([jax.random.uniform(k) for k in ks])

    u = jax.vmap(uniforms)(split[:, 0])  # [D, D-1]: depth, rank among the children tried
    node_ids = jnp.arange(d)
    earlier = node_ids[None, :] < node_ids[:, None]  # [c, c']: c' comes before c
    same = tokens[None, :] == tokens[:, None]

    def depth(j, carry):
        emitted, num, cur, done, deciders = carry
        deciders = deciders.at[j].set(cur)
        p = probs[cur]
        child = (parents == cur) & (node_ids > 0)
        rank = jnp.cumsum(child) - 1
        before = earlier & child[None, :]  # children tried before c (when c is tried)
        repeat = (before & same).any(axis=1)  # c's token was removed already
        first = child & ~repeat
        p_tok = p[tokens]
        removed = jnp.where(before & first[None, :], p_tok[None, :], 0.0).sum(axis=1)
        left = 1.0 - removed
        # t = 0: left is exactly 1, so r is p(token) as in the chain rule.
        r = jnp.where(repeat | (left <= 0), 0.0, p_tok / jnp.where(left > 0, left, 1.0))
        hit = jnp.where(greedy, tokens == argmax[cur], u[j, jnp.clip(rank, 0, d - 2)] < r)
        hit = child & hit
        took = hit.any()
        chosen = jnp.argmax(hit).astype(jnp.int32)
        # Every child rejected: draw from p without the children's tokens, renormalised (a
        # leaf keeps p itself, exactly as the chain's last position).
        gone = jnp.zeros(v, bool).at[jnp.where(child, tokens, v)].set(True, mode="drop")
        residual = jnp.where(gone, 0.0, p)
        mass = residual.sum()
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
        residual = jnp.where(child.any(), residual, p)
        drawn = jax.random.categorical(split[j, 1], jnp.log(residual)).astype(jnp.int32)
        token = jnp.where(took, tokens[chosen], jnp.where(greedy, argmax[cur], drawn))
        emitted = emitted.at[j].set(jnp.where(done, -1, token))
        step = ~done & took
        cur = jnp.where(step, chosen, cur)
        return emitted, num + step.astype(jnp.int32), cur, ~step, deciders

    # A path is at most D-1 edges long: the D-th step always ends it.
    start = (jnp.full(d, -1, jnp.int32), jnp.int32(0), jnp.int32(0), jnp.bool_(False),
             jnp.zeros(d, jnp.int32))  # fmt: skip
    emitted, num, cur, _, deciders = jax.lax.fori_loop(0, d, depth, start)
    return emitted, num, cur, deciders


def tree_rejection_sample(
    probs: jax.Array,
    argmax: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    keys: jax.Array,
    greedy: jax.Array,
) -> TreeAcceptance:
    """The acceptance walk over tree drafts (traceable; module docstring for the rule).

    probs: float32 ``[B, D, V]`` the target's distribution after each node; argmax: int32
    ``[B, D]`` its argmax there (greedy rows); tokens: int32 ``[B, D]`` the nodes' tokens
    (the root's is not read); parents: int32 ``[B, D]`` (topological, ``-1`` at the root);
    keys: ``[B, D]``, key j decides the token at depth j+1 of the path; greedy: bool ``[B]``,
    rows that follow the argmax instead of sampling. Over a chain this draws exactly the
    tokens of ``rejection_sample``.
    """
    emitted, num, nodes, deciders = jax.vmap(_walk_row)(
        probs, argmax, tokens, parents, keys, greedy
    )
    return TreeAcceptance(emitted, num, nodes, deciders)


def accept_tree(
    logits: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    steps: jax.Array,
) -> TreeAcceptance:
    """Acceptance of a tree verify step (traceable; ``TreeVerifier`` is the compiled form):
    ``accept`` with ``tokens`` the D nodes of each row and ``parents`` int32 ``[B, D]`` their
    topology (``ForwardMetadata.parents``)."""
    probs = target_probs(logits, temperature, top_k, top_p)
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = _position_keys(seeds, steps, logits.shape[1])
    return tree_rejection_sample(probs, argmax, tokens, parents, keys, temperature <= 0)


class Verifier:
    """``accept`` and the pool commit of a chain verify step as one executable, compiled
    ahead of time for each batch bucket (``compile``).

    A call dispatches both (not waited for; ``pool`` donated) and returns the acceptance and
    the pool with each row's state after its last accepted token. A call for a shape that
    was not compiled goes through jit and counts in ``trace_count``, which a serving loop
    treats as a retrace.
    """

    def __init__(self) -> None:
        self.trace_count = 0
        self._jit = jax.jit(self._traced, donate_argnums=3)
        self._compiled: dict[tuple[int, ...], Any] = {}

    def _traced(self, logits, tokens, rows, pool, verify):
        self.trace_count += 1
        temperature, top_k, top_p, seeds, steps, slots = unpack_rows(rows)
        acc = accept(logits, tokens, temperature, top_k, top_p, seeds, steps)
        # A chain's j-th emitted token is decided by the logits after its j-th token.
        deciders = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        acc = acc._replace(emitted=mark_non_finite(acc.emitted, logits, deciders))
        # Padded rows (the pad slot) keep their slot: the commit skips negative steps.
        accepted = jnp.where(slots > 0, acc.num_accepted, -1)
        return acc, commit_verified(pool, verify, slots, accepted)

    def compile(self, logits: Any, pool: Any, verify: Any) -> float:
        """Compiles for logits ``[B, D, V]`` and the pool/verify shapes (ShapeDtypeStructs or
        arrays) of one batch bucket; returns the milliseconds it took."""
        b, d, _ = logits.shape
        start = time.perf_counter()
        if logits.shape not in self._compiled:
            spec = jax.ShapeDtypeStruct
            shapes = jax.tree.map(spec_of, (pool, verify))
            self._compiled[logits.shape] = self._jit.lower(
                spec_of(logits), spec((b, d), jnp.int32), rows_spec(b), *shapes
            ).compile()
        return 1e3 * (time.perf_counter() - start)

    def __call__(
        self,
        logits: jax.Array,
        tokens: jax.Array | np.ndarray,
        batch: SamplingBatch,
        slots: jax.Array | np.ndarray,
        pool: Any,
        verify: Any,
    ) -> tuple[Acceptance, Any]:
        """The acceptance of one verify step (``slots``: each row's pool slot, 0 for padded
        rows) and the committed pool."""
        args = (logits, tokens, pack_rows(batch, slots), pool, verify)
        compiled = self._compiled.get(logits.shape)
        return compiled(*args) if compiled is not None else self._jit(*args)


class TreeVerifier:
    """``accept_tree`` and ``commit_tree_verified`` (pool states and windows, KV compaction)
    of a tree verify step as one executable, compiled ahead of time for each batch bucket,
    as ``Verifier`` for chains; it takes the step's metadata packed (``pack_metadata``) and
    donates the pool and the KV cache."""

    def __init__(self) -> None:
        self.trace_count = 0
        self._jit = jax.jit(self._traced, static_argnums=5, donate_argnums=(3, 4))
        self._compiled: dict[tuple[int, ...], Any] = {}

    def _traced(self, logits, tokens, rows, pool, kv, layout, packed, verify):
        self.trace_count += 1
        meta = layout.unpack(packed)
        temperature, top_k, top_p, seeds, steps, slots = unpack_rows(rows)
        acc = accept_tree(logits, tokens, meta.parents, temperature, top_k, top_p, seeds, steps)
        acc = acc._replace(emitted=mark_non_finite(acc.emitted, logits, acc.deciders))
        # Padded rows (the pad slot) keep their slot and cache: the commit skips them.
        nodes = jnp.where(slots > 0, acc.nodes, -1)
        pool, kv = commit_tree_verified(pool, kv, verify, meta, nodes)
        return acc, pool, kv

    def compile(self, logits: Any, pool: Any, kv: Any, verify: Any, meta: Any) -> float:
        """Compiles for logits ``[B, D, V]``, the pool, cache and verify states, and the
        metadata of one batch bucket; returns the milliseconds it took."""
        b, d, _ = logits.shape
        start = time.perf_counter()
        if logits.shape not in self._compiled:
            spec = jax.ShapeDtypeStruct
            layout, packed = pack_metadata(meta)
            pool, kv, verify = jax.tree.map(spec_of, (pool, kv, verify))
            self._compiled[logits.shape] = self._jit.lower(
                spec_of(logits), spec((b, d), jnp.int32), rows_spec(b), pool, kv,
                layout, spec_of(packed), verify,
            ).compile()  # fmt: skip
        return 1e3 * (time.perf_counter() - start)

    def __call__(
        self,
        logits: jax.Array,
        tokens: jax.Array | np.ndarray,
        batch: SamplingBatch,
        meta: Any,
        pool: Any,
        kv: Any,
        verify: Any,
    ) -> tuple[TreeAcceptance, Any, Any]:
        """The acceptance of one tree verify step of metadata ``meta``, and the committed pool
        and cache: each row keeps the state after its accepted node, whose root path moves to
        contiguous cache positions."""
        layout, packed = pack_metadata(meta)
        rows = pack_rows(batch, meta.state_indices)
        compiled = self._compiled.get(logits.shape)
        if compiled is not None:
            return compiled(logits, tokens, rows, pool, kv, packed, verify)
        return self._jit(logits, tokens, rows, pool, kv, layout, packed, verify)


@dataclasses.dataclass
class SpeculativeStats:
    """Counts over verify steps: ``rows`` verified, ``proposed`` drafts (D-1 per row, padding
    included; a tree's D-1 nodes, of which at most its depth can be accepted), ``accepted``
    drafts (the accepted path's nodes below the root), ``emitted`` tokens (accepted drafts
    plus the bonus, before requests were cut at their stop token or budget)."""

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
