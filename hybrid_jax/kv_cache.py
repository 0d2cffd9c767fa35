"""The paged key/value cache of full-attention layers, and its host-side page allocator.

Each full-attention layer keeps keys and values in pages: ``k[l]`` and ``v[l]`` are
``[P, page_size, KVH, head_dim]``, all layers stacked in one array ``k`` (and ``v``) ``[L, P,
page_size, KVH, head_dim]``; a layer reads the flat ``[L*P, ...]`` view through its page
table shifted by ``l*P`` (``ForwardMetadata.at_attention_layer``). A request owns a list of
pages (``RowSpec.pages``); position p of the request lives at offset ``p % page_size`` of
its page ``p // page_size``. Page 0 is the pad page: padded tokens write into it and no real
row reads it, so it is never handed out. Pages need no zeroing on reuse: attention reads only
positions below a row's context length, and every one of those was written by the request
that owns the page. Which request owns which page is host-side bookkeeping
(``PageAllocator``).

Tree drafts store node i of a verify row at ``prefix_len + i``; after acceptance
``commit_tree_kv`` moves the accepted root path's entries to ``prefix_len .. prefix_len +
depth``, where the next step expects the accepted context. The rejected nodes' entries stay
past the accepted context, and the next steps overwrite them before anything reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.index_allocator import IndexAllocator, is_int
from hybrid_jax.state_pool import common_spec

__all__ = [
    "KVCache",
    "KVCacheSpec",
    "PageAllocator",
    "PageError",
    "PagesExhaustedError",
    "accepted_path",
    "commit_tree_kv",
    "init_kv_cache",
    "pages_needed",
]


class PageError(ValueError):
    """A page that is not allocated, not in the cache, the pad page, or repeated in one call."""


class PagesExhaustedError(RuntimeError):
    """More pages were asked for than are free.

    Attributes: ``requested``, ``capacity`` (real pages, pad page excluded), ``used``,
    ``page_size``.
    """

    def __init__(self, requested: int, capacity: int, used: int, page_size: int) -> None:
        self.requested, self.capacity, self.used, self.page_size = (
            requested, capacity, used, page_size,
        )  # fmt: skip
        super().__init__(
            f"cannot allocate {requested} pages: the cache has {capacity} real pages of "
            f"{page_size} tokens (plus the pad page 0), {used} in use, {capacity - used} free; "
            f"free finished requests or build the cache with more pages"
        )


def _check_geometry(num_pages: object, page_size: object) -> None:
    if not is_int(num_pages) or num_pages < 2:
        raise PageError(
            f"num_pages={num_pages!r} leaves no real page (page 0 is the pad page); "
            f"build the cache with at least 2 pages"
        )
    if not is_int(page_size) or page_size < 1:
        raise PageError(f"page_size={page_size!r} must be a positive int (tokens per page)")


def pages_needed(num_positions: int, page_size: int) -> int:
    """Pages that hold ``num_positions`` positions: ``ceil(num_positions / page_size)``."""
    return -(-num_positions // page_size)


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The cache of one full-attention layer: ``num_kv_heads`` heads of ``head_dim``."""

    num_kv_heads: int
    head_dim: int
    dtype: np.dtype = np.dtype(jnp.bfloat16)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")

    def page_bytes(self, page_size: int) -> int:
        """Bytes one page of this layer holds (keys and values)."""
        return 2 * page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every full-attention layer, ``num_pages`` pages of ``page_size``.

    k, v: ``[L, P, page_size, KVH, head_dim]`` in the layers' dtype (``k[l]``: layer l's
    pages); page 0 of every layer is its pad page.
    """

    k: jax.Array
    v: jax.Array
    num_pages: int = dataclasses.field(metadata={"static": True})
    page_size: int = dataclasses.field(metadata={"static": True})

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]


def init_kv_cache(specs: Sequence[KVCacheSpec], num_pages: int, page_size: int) -> KVCache:
    """A zeroed cache of ``num_pages`` pages of ``page_size`` tokens for ``specs``' layers
    (all of one layout)."""
    _check_geometry(num_pages, page_size)
    spec = common_spec(specs, "full-attention") or KVCacheSpec(1, 1)
    shape = (len(specs), num_pages, page_size, spec.num_kv_heads, spec.head_dim)
    return KVCache(
        k=jnp.zeros(shape, spec.dtype), v=jnp.zeros(shape, spec.dtype), num_pages=num_pages,
        page_size=page_size,
    )  # fmt: skip


class PageAllocator(IndexAllocator):
    """Host-side owner of pages ``1..num_pages-1``: hands out the lowest free pages first.

    Every call validates its whole request before changing anything, so a rejected call
    leaves the allocator as it was.
    """

    noun, container, error = "page", "cache", PageError

    def __init__(self, num_pages: int, page_size: int) -> None:
        _check_geometry(num_pages, page_size)
        super().__init__(num_pages)
        self.num_pages = num_pages
        self.page_size = page_size

    @property
    def used_pages(self) -> tuple[int, ...]:
        return tuple(sorted(self._used))

    def _exhausted(self, requested: int) -> PagesExhaustedError:
        return PagesExhaustedError(requested, self.capacity, self.num_used, self.page_size)

    def grow(self, pages: Sequence[int], num_positions: int) -> list[int]:
        """``pages`` extended with new pages so that they hold ``num_positions`` positions
        (a request about to run more tokens); unchanged when they already do."""
        missing = pages_needed(num_positions, self.page_size) - len(pages)
        return [*pages, *self.allocate(max(0, missing))]

    def __repr__(self) -> str:
        return (
            f"PageAllocator(capacity={self.capacity}, page_size={self.page_size}, "
            f"used={self.num_used}, free={self.num_free})"
        )


def accepted_path(parents: jax.Array, accepted: jax.Array) -> jax.Array:
    """The root path of each row's accepted node, root first.

    parents: int32 ``[N, D]`` (topological, ``-1`` at the root); accepted: int32 ``[N]``, the
    last accepted node, negative for none. Returns int32 ``[N, D]``: ``path[n, j]`` is the
    node at depth j on the path to ``accepted[n]``, ``-1`` past its depth (all ``-1`` when
    nothing is accepted). Example: parents ``[-1, 0, 0, 2]``, accepted 3 -> ``[0, 2, 3, -1]``.
    """
    n_rows, n_nodes = parents.shape
    rows = jnp.arange(n_rows)
    depths = [jnp.zeros(n_rows, jnp.int32)]
    for i in range(1, n_nodes):
        depths.append(jnp.stack(depths, axis=1)[rows, jnp.clip(parents[:, i], 0, i - 1)] + 1)
    depth = jnp.stack(depths, axis=1)
    path = jnp.full((n_rows, n_nodes), -1, jnp.int32)
    node = jnp.where(accepted < n_nodes, accepted, -1).astype(jnp.int32)
    for _ in range(n_nodes):  # walk up: at most D steps from any node to the root
        live = node >= 0
        safe = jnp.clip(node, 0, n_nodes - 1)
        at = jnp.where(live, depth[rows, safe], n_nodes)
        path = path.at[rows, at].set(node, mode="drop")
        node = jnp.where(live, parents[rows, safe], -1)
    return path


def commit_tree_kv(
    cache: KVCache,
    page_table: jax.Array,
    prefix_lens: jax.Array,
    parents: jax.Array,
    accepted: jax.Array,
) -> KVCache:
    """Moves each row's accepted path to contiguous positions, in every layer.

    page_table: int32 ``[N, max_pages]`` of the verify step (``meta.pages.table``);
    prefix_lens: int32 ``[N]`` committed positions before the step (``meta.context_lens -
    meta.seq_lens``); parents int32 ``[N, D]`` (``meta.parents``); accepted int32 ``[N]``, the
    last accepted node (negative: the row keeps its cache as it is). The entry of the path's
    node at depth j moves from ``prefix + node`` to ``prefix + j``. All sources are read
    before any write, so overlapping moves are safe; entries of the rejected nodes are left
    where they are (past the accepted context). Donate ``cache`` under jit.
    """
    path = accepted_path(parents, accepted)
    n_nodes = path.shape[1]
    size = cache.page_size
    prefix = prefix_lens[:, None]
    depth = jnp.arange(n_nodes, dtype=jnp.int32)[None, :]

    def flat_index(positions: jax.Array) -> jax.Array:
        # Clipped: a row with nothing to move may name positions past its pages.
        positions = jnp.clip(positions, 0, page_table.shape[1] * size - 1)
        page = jnp.take_along_axis(page_table, positions // size, axis=1)
        return page * size + positions % size

    moves = path >= 0
    src = flat_index(prefix + jnp.where(moves, path, 0)).reshape(-1)
    # Rows and depths with nothing to move write out of range: dropped.
    dst = jnp.where(moves, flat_index(prefix + depth), cache.num_pages * size).reshape(-1)

    def move(pages: jax.Array) -> jax.Array:  # [L, P, page_size, ...], every layer at once
        flat = pages.reshape(pages.shape[0], -1, *pages.shape[3:])
        return flat.at[:, dst].set(flat[:, src], mode="drop").reshape(pages.shape)

    return dataclasses.replace(cache, k=move(cache.k), v=move(cache.v))
