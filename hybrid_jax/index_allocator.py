"""Host-side allocation of the rows of a pool whose row 0 is the pad row.

The linear layers' state pool (slots) and the full-attention layers' KV cache (pages) hand out
their rows the same way: lowest free first (deterministic, and reused rows stay dense), row 0
never, and every call validates its whole request before changing anything, so a rejected
call leaves the allocator as it was.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np

__all__ = ["IndexAllocator", "is_int"]


def is_int(value: object) -> bool:
    """An int or numpy integer, and not a bool."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class IndexAllocator:
    """Owner of rows ``1..size-1`` of one pool. Subclasses name the row (``noun``: "slot"),
    the pool (``container``: "pool"), the error for a bad row (``error``) and raise their own
    exhaustion error from ``_exhausted``."""

    noun = "index"
    container = "pool"
    error: type[Exception] = ValueError

    def __init__(self, size: int) -> None:
        self._size = size
        self._free = list(range(1, size))  # a sorted list is a valid heap
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        """Real rows (the pad row excluded)."""
        return self._size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def _exhausted(self, requested: int) -> Exception:
        """The error for asking ``requested`` rows when fewer are free (subclasses say more)."""
        return RuntimeError(
            f"cannot allocate {requested} {self.noun}s: {self.num_free} of {self.capacity} free"
        )

    def allocate(self, n: int) -> list[int]:
        """The ``n`` lowest free rows, now in use."""
        if not is_int(n) or n < 0:
            raise self.error(f"allocate(n={n!r}): n must be an int >= 0")
        if n > len(self._free):
            raise self._exhausted(n)
        rows = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(rows)
        return rows

    def free(self, rows: Iterable[int]) -> None:
        """Returns ``rows`` to the free list (all of them, or none on error)."""
        rows = list(rows)
        noun, seen = self.noun, set()
        for i, row in enumerate(rows):
            if not is_int(row):
                raise self.error(f"{noun}s[{i}]={row!r} is not an int {noun}")
            where = f"{noun}s[{i}]={row}"
            if row == 0:
                raise self.error(f"{where} is the pad {noun}; it is never allocated or freed")
            if not 0 < row < self._size:
                raise self.error(
                    f"{where} is outside the {self.container} ({noun}s 1..{self._size - 1})"
                )
            if row in seen:
                raise self.error(f"{where} appears twice in one free() call")
            if row not in self._used:
                raise self.error(f"{where} is not allocated (freed twice, or never allocated)")
            seen.add(row)
        self._used.difference_update(rows)
        for row in rows:
            heapq.heappush(self._free, int(row))
