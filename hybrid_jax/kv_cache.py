"""The paged key/value cache of full-attention layers, and its host-side page allocator.

Each full-attention layer keeps keys and values in pages: ``k[l]`` and ``v[l]`` are
``[P, page_size, KVH, head_dim]``. A request owns a list of pages (``RowSpec.pages``);
position p of the request lives at offset ``p % page_size`` of its page ``p // page_size``.
Page 0 is the pad page: padded tokens write into it and no real row reads it, so it is never
handed out. Pages need no zeroing on reuse: attention reads only positions below a row's
context length, and every one of those was written by the request that owns the page.
Which request owns which page is host-side bookkeeping (``PageAllocator``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.index_allocator import IndexAllocator, is_int

__all__ = [
    "KVCache",
    "KVCacheSpec",
    "PageAllocator",
    "PageError",
    "PagesExhaustedError",
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

    k[l], v[l]: ``[P, page_size, KVH_l, head_dim_l]`` in the layer's dtype; page 0 is the pad
    page.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    num_pages: int = dataclasses.field(metadata={"static": True})
    page_size: int = dataclasses.field(metadata={"static": True})


def init_kv_cache(specs: Sequence[KVCacheSpec], num_pages: int, page_size: int) -> KVCache:
    """A zeroed cache of ``num_pages`` pages of ``page_size`` tokens for ``specs``' layers."""
    _check_geometry(num_pages, page_size)

    def pages(s: KVCacheSpec) -> jax.Array:
        return jnp.zeros((num_pages, page_size, s.num_kv_heads, s.head_dim), s.dtype)

    return KVCache(
        k=tuple(pages(s) for s in specs),
        v=tuple(pages(s) for s in specs),
        num_pages=num_pages,
        page_size=page_size,
    )


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
