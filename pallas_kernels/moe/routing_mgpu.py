"""A row's routing ranked inside a Mosaic GPU launch (sm_90): one warpgroup program takes a
row of router logits, already in GMEM, and stores its ``k`` experts as ``routing.top_k_exps``
gives them and their softmax exponentials within float32 rounding of its. The launch that
forms the logits then hands the experts' launch their ids itself, with no XLA reductions
between the two (``benchmarks/router_ranking.py`` times it against those reductions).

Each entry gets an int32 key that orders entries as the ranking does: the logit's 16-bit
pattern made monotonic (a negative float's magnitude bits flipped, ``-0`` read as ``+0``) in
the high half, ``0xFFFF - index`` in the low half (equal logits: the lower index first).
Keys are distinct, so the ``k`` choices are ``k`` rounds of one max over the row's keys
(held as ``[64]`` blocks in one warpgroup's registers), each round's key taken out of its
block before the next; a choice's key holds both its index and its logit.

The row's logits reach SMEM by TMA and sit there tiled by 64, a transform declared rather
than left to Mosaic GPU's layout search: beside a launch's SwiGLU over a tile's halves
(``projections``' paired weights) the search for an undeclared one runs out of its budget.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu_chunks import strided

__all__ = [
    "DTYPES",
    "MAX_ENTRIES",
    "MAX_K",
    "rank_row",
    "rank_values",
    "scratch",
    "unsupported_reason",
    "values_scratch",
]

_CHOICES = plgpu.Layout.WGMMA.reduce(1)  # [64]: a WGMMA tile's rows, a block of entries
_ROWS = 64  # the entries of a block, and the most choices
MAX_K = _ROWS
MAX_ENTRIES = 1 << 16  # the key's low half holds 0xFFFF - index
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
REDUCTION_SCRATCH_BYTES = 2048  # each round's max across warps
_LOW = 0xFFFF
_TAKEN = -(1 << 31)  # below every key: an entry already chosen


def unsupported_reason(entries: int, k: int, dtype) -> str | None:
    """Why ``rank_row`` cannot rank rows of ``entries`` logits of this dtype, or None."""
    if jnp.dtype(dtype) not in DTYPES:
        return f"the logits must be 16-bit floats (got {jnp.dtype(dtype)})"
    if entries % _ROWS or entries > MAX_ENTRIES:
        return f"entries={entries} must be a multiple of {_ROWS} and at most {MAX_ENTRIES}"
    if not 0 < k <= min(MAX_K, entries):
        return f"k={k} must be in 1..{min(MAX_K, entries)}"
    return None


def scratch(entries: int, dtype) -> tuple:
    """The SMEM ``rank_row`` takes: the row's logits and their barrier, the choices' ids and
    exponentials."""
    return (
        plgpu.SMEM((entries,), dtype, transforms=(plgpu.TilingTransform((_ROWS,)),)),
        plgpu.Barrier(num_arrivals=1),
        plgpu.SMEM((_ROWS,), jnp.int32),
        plgpu.SMEM((_ROWS,), jnp.float32),
    )


def _keys(x: jax.Array, index: jax.Array) -> jax.Array:
    """int32 keys of 16-bit floats ``x`` at ``index`` (same shape and layout): larger for an
    entry that ranks earlier."""
    bits = lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32)
    bits = jnp.where(bits == -32768, 0, bits)  # -0 ties with +0, as the float comparison
    ordered = bits ^ (lax.shift_right_arithmetic(bits, 31) & 0x7FFF)
    return lax.shift_left(ordered, 16) | (_LOW - index)


def rank_row(logits, exps_out, ids_out, logits_s, logits_bar, ids_s, exps_s, *,
             k: int, valid) -> None:  # fmt: skip
    """Stores the ``k`` entries of largest logit of ``logits`` (a GMEM row ``[n]`` of 16-bit
    floats), largest first, equal logits by the lower index: their indices in ``ids_out``
    (int32 ``[k]``; all ``n`` where ``valid``, a traced bool, is False) and ``exp(logit -
    max)`` in ``exps_out`` (float32 ``[k]``), as ``routing.top_k_exps``. The SMEM buffers
    are ``scratch``'s; the launch's ``reduction_scratch_bytes`` at least
    ``REDUCTION_SCRATCH_BYTES``."""
    n = logits.shape[0]
    plgpu.copy_gmem_to_smem(logits, logits_s, logits_bar)
    plgpu.barrier_wait(logits_bar)
    slot = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0, layout=_CHOICES)
    blocks = [
        _keys(plgpu.load(logits_s.at[pl.ds(start, _ROWS)], layout=_CHOICES), slot + start)
        for start in range(0, n, _ROWS)
    ]
    _store_choices(_choose(blocks, k), logits.dtype, n, exps_out, ids_out, ids_s, exps_s,
                   valid=valid)  # fmt: skip


def rank_values(values, exps_out, ids_out, ids_s, exps_s, *, k: int, valid) -> None:
    """``rank_row`` of a row held in registers: ``values`` ``[n]`` 16-bit floats in the
    ``_mgpu_chunks.strided`` layout. SMEM: ``values_scratch``'s."""
    n = values.shape[0]
    index = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=strided((n,)))
    _store_choices(_choose([_keys(values, index)], k), values.dtype, n, exps_out, ids_out,
                   ids_s, exps_s, valid=valid)  # fmt: skip


def values_scratch() -> tuple:
    """The SMEM ``rank_values`` takes: the choices' ids and exponentials."""
    return plgpu.SMEM((_ROWS,), jnp.int32), plgpu.SMEM((_ROWS,), jnp.float32)


def _choose(blocks: list, k: int) -> list:
    """The ``k`` largest of distinct keys held in ``blocks`` (int32 arrays), largest first,
    as scalars: each round's largest is taken out of its block by a compare against it."""
    tops = []
    for _ in range(k):
        top = functools.reduce(jnp.maximum, [jnp.max(block) for block in blocks])
        blocks = [jnp.where(block == top, _TAKEN, block) for block in blocks]
        tops.append(top)
    return tops


def _store_choices(tops, dtype, n: int, exps_out, ids_out, ids_s, exps_s, *, valid) -> None:
    """Each chosen key's index and ``exp(logit - max)`` into ``ids_out`` / ``exps_out``
    (``[k]``), decoded side by side in a ``[64]`` block and read back as scalars."""
    k = len(tops)
    slot = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0, layout=_CHOICES)
    chosen = jnp.zeros((_ROWS,), jnp.int32)
    for c, top in enumerate(tops):
        chosen = jnp.where(slot == c, top, chosen)
    ordered = lax.shift_right_arithmetic(chosen, 16)
    bits = ordered ^ (lax.shift_right_arithmetic(ordered, 31) & 0x7FFF)
    logit = lax.bitcast_convert_type(bits.astype(jnp.int16), dtype).astype(jnp.float32)
    logit = jnp.where(slot < k, logit, -jnp.inf)
    ids_s[...] = _LOW - (chosen & _LOW)
    exps_s[...] = jnp.exp(logit - jnp.max(logit))
    plgpu.commit_smem()  # every choice's entry, read back as scalars
    for c in range(k):
        ids_out[c] = jnp.where(valid, ids_s[c], n)
        exps_out[c] = exps_s[c]
