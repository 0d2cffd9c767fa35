"""Arrays brought into L2 by a launch's spare programs, for the launch after it.

A decode step at a few rows runs launches that leave most SMs and most of HBM idle for
microseconds (a GDN decode kernel of 32 programs, a paged decode kernel of 16), each followed
by a product that streams a weight from HBM: the first loads' latency and the tail are a
large part of its time. A launch given ``prefetch`` arrays adds programs that issue TMA
prefetches of them into L2 (``cp.async.bulk.prefetch.L2``: no shared memory, nothing to wait
for) and end; the product after it then reads them from L2. A prefetch changes no value
(the interpreter runs it as a no-op), so a kernel's results are the same with or without it.

An array is prefetched in boxes of at most ``BOX x BOX`` elements (TMA's largest box
dimension); the boxes of the last rows and columns start early enough to end at the array's
edge, overlapping their neighbours (a prefetched line prefetched again costs nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels._common import NUM_SMS

__all__ = [
    "BOX",
    "MIN_PROGRAMS",
    "box_origin",
    "boxes",
    "check_prefetch",
    "issue_prefetches",
    "prefetch_programs",
    "spare_rows",
    "unsupported_reason",
]

BOX = 256  # TMA's largest box dimension
MIN_PROGRAMS = 8
"""Prefetching programs a launch adds even when its own programs fill the SMs: they start as
the launch's programs end, when HBM has room again."""
_ROW_ALIGN = 16  # bytes: TMA's global strides and a box row are multiples of this


def unsupported_reason(array: jax.Array) -> str | None:
    """Why ``array`` cannot be prefetched, or None: it must be a non-empty ``[R, C]`` array
    whose rows are a multiple of 16 bytes (TMA's rule for global strides and box rows)."""
    row_bytes = array.shape[-1] * jnp.dtype(array.dtype).itemsize if array.ndim else 0
    if array.ndim != 2 or row_bytes % _ROW_ALIGN or 0 in array.shape:
        return (
            f"{array.dtype}{list(array.shape)} must be a non-empty [R, C] array whose rows "
            f"are a multiple of {_ROW_ALIGN} bytes"
        )
    return None


def check_prefetch(op: str, arrays: Sequence[jax.Array]) -> None:
    """Raises a ValueError naming ``op`` and the array for one ``unsupported_reason``
    refuses."""
    for i, a in enumerate(arrays):
        reason = unsupported_reason(a)
        if reason is not None:
            raise ValueError(f"{op}: prefetch[{i}] {reason}")


def _box(shape: tuple[int, int]) -> tuple[int, int]:
    return min(shape[0], BOX), min(shape[1], BOX)


def boxes(shape: tuple[int, int]) -> int:
    """How many boxes cover an array of ``shape``."""
    rows, cols = _box(shape)
    return -(-shape[0] // rows) * -(-shape[1] // cols)


def box_origin(index, shape: tuple[int, int]):
    """``(row, column)`` where box ``index`` (an int or a traced int32) of an array of
    ``shape`` starts: boxes row-major, the last of a row or column ending at the edge."""
    rows, cols = _box(shape)
    per_row = -(-shape[1] // cols)
    r = jnp.minimum((index // per_row) * rows, shape[0] - rows)
    c = jnp.minimum((index % per_row) * cols, shape[1] - cols)
    return r, c


def prefetch_programs(arrays: Sequence[jax.Array], busy: int) -> int:
    """Programs a launch of ``busy`` programs adds to prefetch ``arrays``: the SMs it leaves
    free (at least ``MIN_PROGRAMS``), never more than the boxes; 0 without arrays."""
    total = sum(boxes(a.shape) for a in arrays)
    if not total:
        return 0
    return min(total, max(MIN_PROGRAMS, NUM_SMS - busy))


def spare_rows(arrays: Sequence[jax.Array], busy: int, width: int = 1) -> int:
    """Rows of ``width`` programs that a launch of ``busy`` programs appends to its grid to
    prefetch ``arrays``: ``prefetch_programs``, rounded up to whole rows (0 without arrays)."""
    return -(-prefetch_programs(arrays, busy) // width)


def issue_prefetches(refs: Sequence, program, programs: int) -> None:
    """In a kernel: prefetching program ``program`` of ``programs`` (a traced index, or 0
    of 1 for all of them) issues boxes ``program, program + programs, ...`` of the boxes of
    ``refs`` (GMEM refs, each ``[R, C]``) numbered one array after another."""
    counts = [boxes(tuple(ref.shape)) for ref in refs]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    total = sum(counts)
    for turn in range(-(-total // programs)):
        index = program + turn * programs
        for ref, start, count in zip(refs, starts, counts, strict=True):
            shape = tuple(ref.shape)
            local = index - start
            mine = (local >= 0) & (local < count)
            if mine is False:  # a static index past this array's boxes
                continue
            r, c = box_origin(jnp.clip(local, 0, count - 1), shape)
            rows, cols = _box(shape)
            box = ref.at[pl.ds(r, rows), pl.ds(c, cols)]
            plgpu.async_prefetch(box, predicate=None if mine is True else mine)
