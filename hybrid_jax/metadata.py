"""Forward metadata: one pytree per (mode, bucket), built by one function for every path.

``build_metadata`` turns a host-side description of a batch (``RowSpec`` per row) into a
``ForwardMetadata`` padded to a bucket of the ``BucketPolicy``. The same function, called
with ``rows=()`` and an explicit bucket (``example_metadata``), gives the all-padding
metadata that ahead-of-time compilation traces with, so the compiled and the served shapes
cannot drift apart. What each mode's rows may carry and how its token axis is sized is data,
the mode's row of ``modes.MODES``; a mode missing there raises ``UnsupportedForwardModeError``
before anything is built.

Padding rules (docs/DESIGN.md): padded rows have length 0 (query_start_loc repeats), slot 0 (the
pad slot) and no initial state; padded tokens sit after ``query_start_loc[num_rows]``, at
position 0, in row ``batch_size`` (one past the last row, so a segment op drops them).

Full-attention layers keep their keys and values in a paged cache (``kv_cache.py``); each row
names its pages (``RowSpec.pages``) and the metadata carries them as a ``PageTable``, padded
with page 0, the pad page, exactly as the linear layers' rows are padded with slot 0.

Tree drafts: a TARGET_VERIFY row is a tree of D nodes in topological order, given by
``RowSpec.parents`` (node 0 is the root, ``parents[i] < i``; empty means the chain
``[-1, 0, 1, ..., D-2]``). The metadata carries the parents as an int32 array, so the tree's
shape changes without a recompile; a node's position is ``prefix_len + depth(node)``. Whether
a step may hold trees at all is static (``BucketPolicy.tree_drafts``): a chain-only step keeps
the kernels' chain path.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.modes import (
    MODES,
    TOKEN_LAYOUTS,
    ForwardMode,
    ModeSpec,
    TokenLayout,
    UnsupportedForwardModeError,
)

__all__ = [
    "BUILDABLE_MODES",
    "BucketPolicy",
    "ForwardMetadata",
    "MAX_DRAFT_TOKENS",
    "MetadataError",
    "MetadataLayout",
    "PageIds",
    "PageTable",
    "RowSpec",
    "build_metadata",
    "chain_parents",
    "describe",
    "example_metadata",
    "pack_metadata",
    "tree_depths",
]

MAX_DRAFT_TOKENS = 8


class MetadataError(ValueError):
    """A batch, a bucket or a policy that cannot be turned into forward metadata."""


def chain_parents(num_nodes: int) -> tuple[int, ...]:
    """The parents of a chain of ``num_nodes`` nodes: ``(-1, 0, 1, ..., num_nodes - 2)``."""
    return tuple(range(-1, num_nodes - 1))


def tree_depths(parents: Sequence[int]) -> tuple[int, ...]:
    """Depth of every node of a tree in topological order (root 0): ``depth[parent] + 1``."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return tuple(depths)


# The smallest default batch bucket. A step of fewer rows moves the same bytes (every weight
# is read once per step; padding rows touch no state slot, page or expert), while XLA turns a
# product with a one-row operand and a weight under 10M elements into a multiply and a
# reduction kernel, which at batch 1 costs several times the product
# (benchmarks/RESULTS_serve.md: a bucket of 8 made a batch-1 MoE step 35% faster).
MIN_BATCH_BUCKET = 8


def _default_batch_buckets(max_batch: int) -> tuple[int, ...]:
    # Powers of two and 3 * 2**k (8, 12, 16, 24, ...) from MIN_BATCH_BUCKET: padding stays
    # under a third of the bucket with only two executables per doubling.
    ladder = {m << k for m in (1, 3) for k in range(max_batch.bit_length())}
    return tuple(sorted({b for b in ladder if MIN_BATCH_BUCKET <= b < max_batch} | {max_batch}))


def _default_token_buckets(max_tokens: int) -> tuple[int, ...]:
    powers = {1 << k for k in range(4, max_tokens.bit_length())}
    return tuple(sorted({t for t in powers if t < max_tokens} | {max_tokens}))


def _check_buckets(name: str, buckets: tuple[int, ...]) -> None:
    ok = bool(buckets) and all(isinstance(b, int) and not isinstance(b, bool) for b in buckets)
    ok = ok and buckets[0] >= 1 and all(a < b for a, b in itertools.pairwise(buckets))
    if not ok:
        raise MetadataError(
            f"{name}={buckets!r} must be a non-empty, increasing tuple of distinct positive ints; "
            f"BucketPolicy.default(max_batch=..., max_tokens=...) builds a valid one"
        )


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    return next(b for b in buckets if b >= n)


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """The padded shapes every call is rounded up to, so that all of them compile ahead of time.

    ``batch_buckets``: row counts (DECODE, TARGET_VERIFY and DRAFT_EXTEND compile one
    executable per batch bucket). ``token_buckets``: token-axis lengths (EXTEND and MIXED
    compile one executable per token bucket, see ``buckets``). ``num_draft_tokens``: D, the
    tokens per row of TARGET_VERIFY and the most tokens per row of DRAFT_EXTEND.
    ``page_size`` and ``max_context``: the paged KV cache of full-attention layers; a row
    spans at most ``max_context`` tokens (prefix plus new), so its page table has
    ``max_pages = max_context // page_size`` entries. ``max_context=0`` (the default) pages
    nothing: models without full-attention layers need no page table. ``tree_drafts``:
    TARGET_VERIFY rows may be trees (``RowSpec.parents``); False keeps every verify row a
    chain, so the kernels run their chain path. ``batch_invariant``: the layers take the
    paths whose arithmetic on a row does not depend on the other rows of the step or on
    where the row sits among them (slower prefill: the chunked scans re-lay their tokens
    out and attention reads every key from the pages).
    """

    batch_buckets: tuple[int, ...] = _default_batch_buckets(256)
    token_buckets: tuple[int, ...] = _default_token_buckets(8192)
    num_draft_tokens: int = 4
    page_size: int = 16
    max_context: int = 0
    tree_drafts: bool = False
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "batch_buckets", tuple(self.batch_buckets))
        object.__setattr__(self, "token_buckets", tuple(self.token_buckets))
        _check_buckets("batch_buckets", self.batch_buckets)
        _check_buckets("token_buckets", self.token_buckets)
        d = self.num_draft_tokens
        if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= MAX_DRAFT_TOKENS:
            raise MetadataError(
                f"num_draft_tokens={d!r} is outside 2..{MAX_DRAFT_TOKENS}: a verify step checks "
                f"the root plus at least one draft, and the speculative paths are built for at "
                f"most {MAX_DRAFT_TOKENS} tokens per row"
            )
        size, context = self.page_size, self.max_context
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MetadataError(f"page_size={size!r} must be a positive int (tokens per page)")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise MetadataError(
                f"max_context={context!r} must be an int >= 0 (0: no paged KV cache)"
            )
        if context % size:
            raise MetadataError(
                f"max_context={context} is not a multiple of page_size={size}; round it up to "
                f"{-(-context // size) * size}"
            )
        for name in ("tree_drafts", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise MetadataError(f"{name}={getattr(self, name)!r} must be a bool")

    @classmethod
    def default(
        cls,
        max_batch: int = 256,
        max_tokens: int = 8192,
        num_draft_tokens: int = 4,
        *,
        page_size: int = 16,
        max_context: int = 0,
        tree_drafts: bool = False,
    ) -> BucketPolicy:
        """Batch buckets 1, 2, 4, 8, 12, 16, 24, ... and token buckets 16, 32, 64, ...

        Each ladder stops at (and includes) its maximum. ``page_size`` and ``max_context``
        size the page table of full-attention layers (0: none); ``tree_drafts`` lets verify
        rows be trees.
        """
        for name, value in (("max_batch", max_batch), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MetadataError(f"{name}={value!r} must be a positive int")
        return cls(
            _default_batch_buckets(max_batch),
            _default_token_buckets(max_tokens),
            num_draft_tokens,
            page_size,
            max_context,
            tree_drafts,
        )

    @property
    def max_batch(self) -> int:
        return self.batch_buckets[-1]

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1]

    @property
    def max_pages(self) -> int:
        """Entries of each row's page table (0 when the policy pages nothing)."""
        return self.max_context // self.page_size

    def batch_bucket(self, num_rows: int) -> int:
        """The smallest batch bucket that holds ``num_rows`` rows."""
        if num_rows > self.max_batch:
            raise MetadataError(
                f"batch of {num_rows} rows exceeds the largest batch bucket {self.max_batch}; "
                f"raise BucketPolicy.max_batch or split the batch"
            )
        return _bucket(self.batch_buckets, num_rows)

    def token_bucket(self, num_tokens: int) -> int:
        """The smallest token bucket that holds ``num_tokens`` tokens."""
        if num_tokens > self.max_tokens:
            raise MetadataError(
                f"batch of {num_tokens} tokens exceeds the largest token bucket "
                f"{self.max_tokens}; raise BucketPolicy.max_tokens or split the batch "
                f"(prefill long prompts in chunks)"
            )
        return _bucket(self.token_buckets, num_tokens)

    def rows_for_tokens(self, num_tokens: int) -> int:
        """Rows of the EXTEND/MIXED bucket whose token axis is ``num_tokens`` long.

        Every ragged row carries at least one token, so ``min(T, max_batch)`` rows always
        suffice: one executable per token bucket instead of one per (rows, tokens) pair.
        Empty rows cost only their int32 metadata; kernels skip length-0 rows.
        """
        return self.batch_bucket(min(num_tokens, self.max_batch))

    def bucket(self, mode: ForwardMode, num_rows: int, num_tokens: int) -> tuple[int, int]:
        """The (rows, tokens) bucket ``build_metadata`` pads a batch of this size to."""
        return _choose_bucket(mode, _layout(mode, self), self, num_rows, num_tokens, None, None)

    def buckets(self, mode: ForwardMode) -> list[tuple[int, int]]:
        """Every (rows, tokens) shape ``mode`` compiles for, i.e. every ``bucket`` it can return.

        DECODE: (bs, bs); TARGET_VERIFY and DRAFT_EXTEND: (bs, bs*D), for every batch bucket.
        EXTEND and MIXED: (rows_for_tokens(T), T) for every token bucket T. IDLE: (0, 0).
        """
        layout = _layout(mode, self)
        if not layout.has_rows:
            return [(0, 0)]
        if layout.tokens_per_row is None:
            return [(self.rows_for_tokens(t), t) for t in self.token_buckets]
        return [(bs, bs * layout.tokens_per_row) for bs in self.batch_buckets]


class PageIds(tuple):
    """A row's page ids: a tuple that keeps them as one read-only int64 array, made once.
    A request holds the pages of its whole context at every step (thousands at long
    contexts), so ``build_metadata`` reads this array instead of converting the tuple again
    each step; any other sequence of page ids is converted each time."""

    @functools.cached_property
    def array(self) -> np.ndarray | None:
        """The ids as int64, None when some entry is not an integer (the check names it)."""
        return _page_array(self)


def _page_array(pages: Sequence) -> np.ndarray | None:
    """``pages`` as read-only int64, None when an entry is no integer (bools and floats are
    not) or overflows int64."""
    if not set(map(type, pages)) <= _PAGE_ID_TYPES:
        return None
    try:
        array = np.asarray(pages, np.int64)
    except OverflowError:
        return None
    array.flags.writeable = False
    return array


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One request's row in a step: its pool slot, tokens already in its state, new tokens,
    and, for models with full-attention layers, the KV-cache pages that hold its positions
    in order (position p lives in ``pages[p // page_size]``); they must cover
    ``prefix_len + num_tokens`` positions. Any sequence of integers is kept as a tuple; a
    ``PageIds`` is kept as it is, so its array is made once for all the steps it serves.

    ``parents``: for a TARGET_VERIFY row, the parent of each of its ``num_tokens`` nodes
    (``-1`` for the root, node 0; ``parents[i] < i`` otherwise); empty means a chain. The
    node's keys and values are stored at ``prefix_len + i`` whatever its depth."""

    slot: int
    prefix_len: int
    num_tokens: int
    pages: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.pages, PageIds):
            object.__setattr__(self, "pages", tuple(self.pages))
        object.__setattr__(self, "parents", tuple(self.parents))


def _static() -> dataclasses.Field:
    return dataclasses.field(metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageTable:
    """The KV-cache pages of every row, for full-attention layers.

    ``page_size`` (static): tokens per page. ``table`` int32 ``[bs, max_pages]``: position p of
    row r lives at offset ``p % page_size`` of page ``table[r, p // page_size]``; 0, the pad
    page, where a row has no page (its unused tail, and every entry of a padded row). Padded
    tokens write their keys and values into page 0, which no real row ever reads.
    ``max_pages`` is 0 when the bucket policy pages nothing.
    """

    page_size: int = _static()
    table: jax.Array

    @property
    def max_pages(self) -> int:
        return self.table.shape[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardMetadata:
    """Everything a layer needs to know about a padded batch; one structure per (mode, bucket).

    Static (part of the compile key): ``mode``; ``batch_size`` bs, the rows of the bucket;
    ``num_tokens`` T, its token-axis length; ``num_draft_tokens``, D for TARGET_VERIFY and
    DRAFT_EXTEND, 1 for DECODE, 0 otherwise; ``tree``, True when TARGET_VERIFY rows may be
    trees (``BucketPolicy.tree_drafts``; False for every other mode); ``batch_invariant``,
    ``BucketPolicy.batch_invariant``.

    Arrays (always present, never None; ``build_metadata`` leaves them on the host, and the
    step that takes them copies them to the device as one vector, ``pack_metadata``):
      query_start_loc   int32 [bs+1]  row r owns tokens [qsl[r], qsl[r+1]); padded rows repeat
      state_indices     int32 [bs]    pool slot of each row; 0 (pad slot) for padded rows
      has_initial_state bool  [bs]    the row continues a state (prefix_len > 0)
      seq_lens          int32 [bs]    new tokens of each row; 0 for padded rows
      context_lens      int32 [bs]    prefix + new tokens; 0 for padded rows
      positions         int32 [T]     absolute position of each token in its request; 0 at padding
      token_rows        int32 [T]     row of each token; bs at padding
      num_rows          int32 []      real rows n (rows n..bs-1 are padding)
      parents           int32 [bs, D] TARGET_VERIFY: parent node of each node of a row (-1 at
                                      the root, a chain on padded rows); [bs, 0] otherwise
      pages             PageTable     KV-cache pages per row (full-attention layers)

    TARGET_VERIFY positions are ``prefix_len + depth(node)`` (the node's place on its root
    path); the node's key/value entry is stored at ``prefix_len + i``, its index in the row.
    """

    mode: ForwardMode = _static()
    batch_size: int = _static()
    num_tokens: int = _static()
    num_draft_tokens: int = _static()
    tree: bool = _static()
    batch_invariant: bool = _static()
    query_start_loc: jax.Array
    state_indices: jax.Array
    has_initial_state: jax.Array
    seq_lens: jax.Array
    context_lens: jax.Array
    positions: jax.Array
    token_rows: jax.Array
    num_rows: jax.Array
    parents: jax.Array
    pages: PageTable

    @property
    def token_layout(self) -> TokenLayout:
        return TOKEN_LAYOUTS[self.mode]

    @property
    def real_tokens(self) -> jax.Array:
        """bool ``[T]``: the tokens of real rows (False at padding)."""
        return self.token_rows < self.batch_size

    def at_linear_layer(self, layer: jax.Array | int, num_slots: int) -> ForwardMetadata:
        """The metadata of linear layer ``layer`` (an int, or traced inside a scan over
        layers): its slots are rows ``layer * num_slots + slot`` of the flat ``[L*S, ...]``
        pool (``state_pool.StatePool``). A padded row keeps index 0: every kernel and
        reference skips the flat pool's row 0 (layer 0's pad slot), where a shifted pad slot
        would be read and written like a real row's."""
        indices = jnp.asarray(self.state_indices)
        shifted = jnp.where(indices == 0, 0, indices + layer * num_slots)
        return dataclasses.replace(self, state_indices=shifted.astype(indices.dtype))

    def at_attention_layer(self, layer: jax.Array | int, num_pages: int) -> ForwardMetadata:
        """The metadata of full-attention layer ``layer``: its pages are pages ``layer *
        num_pages + page`` of the flat ``[L*P, ...]`` cache (``kv_cache.KVCache``)."""
        table = self.pages.table + layer * num_pages
        return dataclasses.replace(self, pages=dataclasses.replace(self.pages, table=table))


BUILDABLE_MODES: frozenset[ForwardMode] = frozenset(MODES)
"""The modes ``build_metadata`` has a layout for (those of ``modes.MODES``)."""


def _layout(mode: ForwardMode, policy: BucketPolicy) -> ModeSpec:
    """The row of ``mode`` with the policy's draft tokens in place of ``DRAFT``."""
    mode = ForwardMode(mode)
    if mode not in MODES:
        raise UnsupportedForwardModeError(
            mode, BUILDABLE_MODES, what=f"no metadata builder for forward mode {mode.name}"
        )
    return MODES[mode].resolved(policy.num_draft_tokens)


def _slot_range(num_slots: int) -> str:
    return f"slots 1..{num_slots - 1}" if num_slots > 1 else f"no real slots: num_slots={num_slots}"


def _check_rows(
    mode: ForwardMode, layout: ModeSpec, rows: Sequence[RowSpec], num_slots: int
) -> None:
    if rows and not layout.has_rows:
        raise MetadataError(
            f"{mode.name} steps carry no rows, got {len(rows)}; a rank with work runs DECODE, "
            f"EXTEND or MIXED"
        )
    seen: dict[int, int] = {}
    for i, row in enumerate(rows):
        for name in ("slot", "prefix_len", "num_tokens"):
            value = getattr(row, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise MetadataError(f"rows[{i}].{name}={value!r} must be an int")
        if row.slot == 0:
            raise MetadataError(
                f"rows[{i}].slot=0 is the pad slot; real rows use {_slot_range(num_slots)} "
                f"(allocate them with SlotAllocator)"
            )
        if not 0 < row.slot < num_slots:
            raise MetadataError(
                f"rows[{i}].slot={row.slot} is outside the pool ({_slot_range(num_slots)})"
            )
        if row.slot in seen:
            raise MetadataError(
                f"rows[{i}].slot={row.slot} repeats rows[{seen[row.slot]}].slot: two rows of one "
                f"batch would write one state; give each request its own slot"
            )
        seen[row.slot] = i
        if row.prefix_len < 0:
            raise MetadataError(
                f"rows[{i}].prefix_len={row.prefix_len} is negative; it counts the tokens "
                f"already folded into the slot's state (0 for a new request)"
            )
        if row.num_tokens < 0:
            raise MetadataError(f"rows[{i}].num_tokens={row.num_tokens} is negative")
        lo, hi = layout.min_row_tokens, layout.max_row_tokens
        if row.num_tokens < lo or (hi is not None and row.num_tokens > hi):
            allowed = (
                f"exactly {lo}" if lo == hi else f"at least {lo}" if hi is None else f"{lo}..{hi}"
            )
            raise MetadataError(
                f"rows[{i}].num_tokens={row.num_tokens}, but {mode.name} rows carry {allowed} "
                f"tokens; {layout.hint}"
            )


def _check_parents(mode: ForwardMode, rows: Sequence[RowSpec], policy: BucketPolicy) -> None:
    for i, row in enumerate(rows):
        parents = row.parents
        if not parents:
            continue
        if mode is not ForwardMode.TARGET_VERIFY:
            raise MetadataError(
                f"rows[{i}].parents={parents!r}, but only TARGET_VERIFY rows are trees; leave "
                f"parents empty for {mode.name}"
            )
        if len(parents) != row.num_tokens:
            raise MetadataError(
                f"rows[{i}].parents has {len(parents)} entries for {row.num_tokens} nodes; give "
                f"one parent per node (-1 for the root)"
            )
        for j, parent in enumerate(parents):
            if isinstance(parent, bool) or not isinstance(parent, int | np.integer):
                raise MetadataError(f"rows[{i}].parents[{j}]={parent!r} must be an int")
            if j == 0 and parent != -1:
                raise MetadataError(
                    f"rows[{i}].parents[0]={parent}: node 0 is the root, its parent must be -1"
                )
            if j > 0 and not 0 <= parent < j:
                raise MetadataError(
                    f"rows[{i}].parents[{j}]={parent}: a node's parent must be an earlier node "
                    f"(0..{j - 1}); order the tree's nodes topologically, the root first"
                )
        if not policy.tree_drafts and parents != chain_parents(len(parents)):
            raise MetadataError(
                f"rows[{i}].parents={parents!r} is a tree, but the bucket policy verifies chains "
                f"only; build it with BucketPolicy(tree_drafts=True)"
            )


_PAGE_ID_TYPES = frozenset({int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                            np.uint32, np.uint64})  # fmt: skip


def _check_pages(
    rows: Sequence[RowSpec], policy: BucketPolicy, num_pages: int | None
) -> list[np.ndarray]:
    """Every row's page ids as int64 arrays, once they follow ``_page_errors``' rules. A
    request holds the pages of its whole context from admission, thousands at long contexts,
    so the common case is checked with array operations; only a batch that looks wrong walks
    its pages one by one, to name the first offending entry."""
    ids = _page_ids_if_valid(rows, policy, num_pages)
    if ids is None:
        _page_errors(rows, policy, num_pages)
        # A false alarm: the pages follow the rules after all.
        ids = [
            row.pages.array if isinstance(row.pages, PageIds) else np.asarray(row.pages, np.int64)
            for row in rows
        ]
    return ids


def _page_ids_if_valid(
    rows: Sequence[RowSpec], policy: BucketPolicy, num_pages: int | None
) -> list[np.ndarray] | None:
    """Each row's page ids when no rule of ``_page_errors`` can fail, else None (which may be
    a false alarm)."""
    if not policy.max_pages:
        return None if any(row.pages for row in rows) else [np.zeros(0, np.int64)] * len(rows)
    arrays = []
    for row in rows:
        end = row.prefix_len + row.num_tokens
        if end > policy.max_context or len(row.pages) > policy.max_pages:
            return None
        if len(row.pages) < -(-end // policy.page_size):
            return None
        pages = row.pages
        array = pages.array if isinstance(pages, PageIds) else _page_array(pages)
        if array is None:
            return None
        arrays.append(array)
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    if not ids.size:
        return arrays
    if ids.min() < 1 or (num_pages is not None and ids.max() >= num_pages):
        return None
    if num_pages is not None:  # counting is linear; a sort is not
        unique = int(np.bincount(ids, minlength=num_pages).max()) <= 1
    else:
        unique = np.unique(ids).size == ids.size
    return arrays if unique else None


def _page_errors(rows: Sequence[RowSpec], policy: BucketPolicy, num_pages: int | None) -> None:
    """Raises ``MetadataError`` for the first page entry (in row order) that breaks a rule."""
    size, context = policy.page_size, policy.max_context
    owner: dict[int, int] = {}
    for i, row in enumerate(rows):
        if not policy.max_pages:
            if row.pages:
                raise MetadataError(
                    f"rows[{i}].pages={row.pages!r}, but the bucket policy pages nothing "
                    f"(max_context=0); set BucketPolicy(max_context=...) for a model with "
                    f"full-attention layers"
                )
            continue
        end = row.prefix_len + row.num_tokens
        if end > context:
            raise MetadataError(
                f"rows[{i}] reaches position {end} (prefix {row.prefix_len} + {row.num_tokens} "
                f"new tokens), past max_context={context}; shorten the request or raise "
                f"BucketPolicy.max_context"
            )
        need = -(-end // size)
        if len(row.pages) < need:
            raise MetadataError(
                f"rows[{i}] has {len(row.pages)} pages for {end} positions; it needs {need} "
                f"pages of {size} tokens (allocate them with PageAllocator)"
            )
        if len(row.pages) > policy.max_pages:
            raise MetadataError(
                f"rows[{i}] has {len(row.pages)} pages, more than max_pages={policy.max_pages} "
                f"(max_context {context} / page_size {size}); free the pages past its context"
            )
        for j, page in enumerate(row.pages):
            if isinstance(page, bool) or not isinstance(page, int | np.integer):
                raise MetadataError(f"rows[{i}].pages[{j}]={page!r} must be an int")
            if page == 0:
                raise MetadataError(
                    f"rows[{i}].pages[{j}]=0 is the pad page; real rows use pages 1.. "
                    f"(allocate them with PageAllocator)"
                )
            if page < 0 or (num_pages is not None and page >= num_pages):
                top = f"pages 1..{num_pages - 1}" if num_pages is not None else "pages >= 1"
                raise MetadataError(f"rows[{i}].pages[{j}]={page} is outside the cache ({top})")
            if page in owner:
                raise MetadataError(
                    f"rows[{i}].pages[{j}]={page} is also a page of rows[{owner[page]}]: two "
                    f"positions would share one page entry; give each request its own pages"
                )
            owner[page] = i


def _choose_bucket(
    mode: ForwardMode,
    layout: ModeSpec,
    policy: BucketPolicy,
    n: int,
    t: int,
    batch_size: int | None,
    num_tokens: int | None,
) -> tuple[int, int]:
    """(bs, T) for n rows and t tokens; explicit values are checked, missing ones looked up."""
    if not layout.has_rows:
        if batch_size not in (None, 0) or num_tokens not in (None, 0):
            raise MetadataError(
                f"{mode.name} has the single bucket (0, 0), got batch_size={batch_size}, "
                f"num_tokens={num_tokens}; leave them unset"
            )
        return 0, 0
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < n:
            raise MetadataError(
                f"batch_size={batch_size!r} is smaller than the {n} rows of this batch; leave "
                f"batch_size unset to pick the bucket from the policy"
            )
        if batch_size < 1:
            raise MetadataError(f"batch_size={batch_size} must be >= 1 for {mode.name}")
    if layout.tokens_per_row is not None:
        bs = policy.batch_bucket(n) if batch_size is None else batch_size
        fixed = bs * layout.tokens_per_row
        if num_tokens is not None and num_tokens != fixed:
            raise MetadataError(
                f"num_tokens={num_tokens} does not fit the {mode.name} layout of {bs} rows x "
                f"{layout.tokens_per_row} tokens = {fixed}; leave num_tokens unset"
            )
        return bs, fixed
    if num_tokens is None:
        policy.batch_bucket(n)  # rejects too many rows before the token count does
        num_tokens = policy.token_bucket(t)
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < max(t, 1):
        raise MetadataError(
            f"num_tokens={num_tokens!r} is smaller than the {max(t, 1)} tokens this batch needs; "
            f"leave num_tokens unset to pick the bucket from the policy"
        )
    bs = policy.rows_for_tokens(num_tokens) if batch_size is None else batch_size
    return bs, num_tokens


def build_metadata(
    mode: ForwardMode,
    rows: Sequence[RowSpec],
    policy: BucketPolicy,
    *,
    num_slots: int,
    batch_size: int | None = None,
    num_tokens: int | None = None,
    num_pages: int | None = None,
) -> ForwardMetadata:
    """The padded metadata of one step: ``rows`` (n of them) in the bucket of ``policy``.

    ``num_slots`` is the pool's slot count S (real slots 1..S-1); ``num_pages``, when given,
    the KV cache's page count P (real pages 1..P-1). ``batch_size`` and
    ``num_tokens`` pin the bucket (ahead-of-time compilation: ``rows=()``); left unset they
    come from ``policy.bucket``. Every input is validated before anything is built
    (``MetadataError``; ``UnsupportedForwardModeError`` for a mode without a layout).
    Positions are ``prefix_len + offset`` (TARGET_VERIFY: ``prefix_len + depth``);
    ``has_initial_state`` is ``prefix_len > 0``.
    """
    mode = ForwardMode(mode)
    layout = _layout(mode, policy)
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise MetadataError(f"num_slots={num_slots!r} must be a positive int (the pool's S)")
    rows = tuple(rows)
    _check_rows(mode, layout, rows, num_slots)
    _check_parents(mode, rows, policy)
    page_ids = _check_pages(rows, policy, num_pages)
    n, t = len(rows), sum(int(row.num_tokens) for row in rows)
    bs, T = _choose_bucket(mode, layout, policy, n, t, batch_size, num_tokens)

    seq_lens = np.zeros(bs, np.int32)
    prefix = np.zeros(bs, np.int32)
    slots = np.zeros(bs, np.int32)
    seq_lens[:n] = [row.num_tokens for row in rows]
    prefix[:n] = [row.prefix_len for row in rows]
    slots[:n] = [row.slot for row in rows]
    qsl = np.zeros(bs + 1, np.int32)
    np.cumsum(seq_lens, out=qsl[1:])
    token_rows = np.full(T, bs, np.int32)
    token_rows[:t] = np.repeat(np.arange(bs, dtype=np.int32), seq_lens)
    positions = np.zeros(T, np.int32)
    real = token_rows[:t]
    offsets = np.arange(t, dtype=np.int32) - qsl[real]
    is_verify = mode is ForwardMode.TARGET_VERIFY
    parents = np.tile(np.asarray(chain_parents(layout.num_draft_tokens), np.int32), (bs, 1))
    if not is_verify:
        parents = parents[:, :0]
    for r, row in enumerate(rows):
        if row.parents:
            parents[r] = row.parents
            offsets[qsl[r] : qsl[r + 1]] = tree_depths(row.parents)
    positions[:t] = prefix[real] + offsets
    page_table = np.zeros((bs, policy.max_pages), np.int32)
    for r, ids in enumerate(page_ids):
        page_table[r, : ids.size] = ids
    # Host arrays: the step joins them into one vector (``pack_metadata``), which its
    # executable's call copies to the device at once.
    arrays = {
        "query_start_loc": qsl,
        "state_indices": slots,
        "has_initial_state": prefix > 0,
        "seq_lens": seq_lens,
        "context_lens": prefix + seq_lens,
        "positions": positions,
        "token_rows": token_rows,
        "num_rows": np.int32(n),
        "parents": parents,
        "page_table": page_table,
    }
    pages = PageTable(page_size=policy.page_size, table=arrays.pop("page_table"))
    return ForwardMetadata(
        mode=mode,
        batch_size=bs,
        num_tokens=T,
        num_draft_tokens=layout.num_draft_tokens,
        tree=is_verify and policy.tree_drafts,
        batch_invariant=policy.batch_invariant,
        pages=pages,
        **arrays,
    )


@dataclasses.dataclass(frozen=True)
class MetadataLayout:
    """Where ``pack_metadata`` put a metadata's arrays in one int32 vector: the structure
    packed (the metadata's, its static fields with it; or a step's token ids and metadata)
    and each array's shape and dtype, in leaf order. Static: a step takes it as the key of
    its executable, the vector as its operand."""

    treedef: jax.tree_util.PyTreeDef
    leaves: tuple[tuple[tuple[int, ...], str], ...]

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for shape, _ in self.leaves)

    def unpack(self, packed: jax.Array) -> Any:
        """What was packed, back from its vector (traced: slices of the step's operand)."""
        arrays, start = [], 0
        for shape, dtype in self.leaves:
            size = int(np.prod(shape))
            array = packed[start : start + size].reshape(shape)
            arrays.append(array != 0 if dtype == "bool" else array)
            start += size
        return jax.tree.unflatten(self.treedef, arrays)


_PACKED_DTYPES = {np.dtype(np.int32): "int32", np.dtype(np.bool_): "bool"}


def pack_metadata(meta: Any) -> tuple[MetadataLayout, np.ndarray | jax.Array]:
    """``meta``'s arrays (int32 and bool, ``build_metadata``'s host arrays) as one int32
    vector, and where each lies in it: a step's metadata goes to the device as one copy,
    where each array would cost the host a copy of its own (benchmarks/RESULTS_serve.md).
    ``meta`` may be any pytree of such arrays: a step packs its token ids with it. Arrays
    already on the device are joined there."""
    leaves, treedef = jax.tree.flatten(meta)
    kinds = []
    for leaf in leaves:
        # A dict lookup: this runs every step, and naming a dtype costs microseconds.
        name = _PACKED_DTYPES.get(leaf.dtype)
        if name is None:
            raise MetadataError(f"metadata arrays are int32 or bool; got {leaf.dtype}")
        kinds.append((tuple(leaf.shape), name))
    layout = MetadataLayout(treedef, tuple(kinds))
    if all(isinstance(leaf, np.ndarray | np.generic) for leaf in leaves):
        return layout, np.concatenate([x.ravel() for x in leaves], dtype=np.int32)
    return layout, jnp.concatenate([jnp.asarray(x).astype(jnp.int32).ravel() for x in leaves])


def example_metadata(
    mode: ForwardMode, batch_size: int, num_tokens: int, policy: BucketPolicy
) -> ForwardMetadata:
    """All-padding metadata of one bucket (no real rows), for ahead-of-time compilation.

    ``for bs, T in policy.buckets(mode): step.lower(..., example_metadata(mode, bs, T, policy))``
    """
    return build_metadata(
        mode, (), policy, num_slots=1, batch_size=batch_size, num_tokens=num_tokens
    )


def describe(meta: ForwardMetadata) -> str:
    """A short table of the real rows, for notebooks and error reports."""
    n = int(meta.num_rows)
    columns = {
        "slot": meta.state_indices,
        "prefix": np.asarray(meta.context_lens) - np.asarray(meta.seq_lens),
        "new": meta.seq_lens,
        "start": np.asarray(meta.query_start_loc)[:-1],
        "initial": meta.has_initial_state,
    }
    lines = [
        f"{meta.mode.name}: bucket {meta.batch_size} rows x {meta.num_tokens} tokens "
        f"(D={meta.num_draft_tokens}), {n} real rows, "
        f"{int(np.asarray(meta.query_start_loc)[n])} real tokens",
        "row " + " ".join(f"{name:>7}" for name in columns),
    ]
    values = {name: np.asarray(array)[:n].tolist() for name, array in columns.items()}
    for r in range(n):
        lines.append(f"{r:>3} " + " ".join(f"{values[name][r]!s:>7}" for name in columns))
    return "\n".join(lines)
