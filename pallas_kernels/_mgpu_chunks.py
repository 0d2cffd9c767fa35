"""Pieces shared by the chunked Mosaic GPU prefill kernels (``gdn/chunk_mgpu.py``,
``mamba2/ssd_mgpu.py``): the 64-token chunk and its 8-row alignment, the varlen chunk table
that cuts packed sequences into 8-aligned chunks (layout described in ``gdn/chunk_mgpu.py``),
the re-layout that starts every sequence on an aligned row (packing-invariant calls), the
swizzled SMEM tile that TMA and wgmma want, the WGMMA register layouts with the row and
column broadcasts over them, and the one-accumulator-per-scope tensor-core matmul. They are
op-agnostic, so both kernels take them from here rather than one kernel reaching into the
other's private helpers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import round_up

__all__ = [
    "ALIGN",
    "BF16",
    "CHUNK",
    "COLS",
    "F32",
    "ROWS",
    "SMEM_LIMIT",
    "SMEM_PER_SM",
    "SequenceLayout",
    "WG",
    "along_cols",
    "along_rows",
    "TokenAxis",
    "chunk_table",
    "columns_over_warps",
    "matmul",
    "matmul_into",
    "scratch_smem_bytes",
    "sequence_layout",
    "smem",
    "strided",
    "token_axis",
]

CHUNK = 64
ALIGN = 8  # rows of the SMEM tiling: every chunk's first token is a multiple of this
F32 = jnp.float32
BF16 = jnp.bfloat16
WG = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA tile
COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column
SMEM_LIMIT = 227 * 1024  # dynamic SMEM per CTA on sm_90 (what Mosaic GPU checks at lowering)
SMEM_PER_SM = 228 * 1024  # an SM's shared memory; each resident CTA also takes 1 KB of it
_SMEM_ALIGN = 1024  # Mosaic GPU aligns each scratch buffer to this
_BARRIER_BYTES = 8


def strided(shape: tuple[int, ...]) -> plgpu.Layout:
    """The ``WG_STRIDED`` layout of an array of ``shape`` (its size a multiple of 128) in which
    each thread holds up to 4 adjacent values: rows that one warpgroup forms, reads or ranks
    element by element."""
    size = math.prod(shape)
    vec = next(v for v in (4, 2, 1) if size % (128 * v) == 0)
    return plgpu.Layout.WG_STRIDED(tuple(shape), vec)


def columns_over_warps(width: int, vec: int = 2) -> tuple[plgpu.Layout, int]:
    """The register layout of a ``[rows, width]`` float32 tile whose columns spread over the
    warpgroup's four warps and a few lanes (``vec`` side by side in a thread), its rows over
    the other lanes and the registers, and those lanes' count (``rows`` must be a multiple of
    it). A sum along the rows stays within a warp; one along the columns crosses the warps
    (the kernel's ``reduction_scratch_bytes``). ``width`` a multiple of ``4 * vec``."""
    per_warp = width // 4
    col_lanes = per_warp // vec
    row_lanes = 32 // col_lanes
    # [rows, width] -> [rows / row_lanes, 1, warp, row lane, column lane, vector].
    tiling = plgpu.Tiling(((row_lanes, width), (row_lanes, per_warp), (vec,)))
    layout = plgpu.Layout.TILED(tiling, warp_dims=(-4,), lane_dims=(-3, -2), vector_dim=-1)
    return layout, row_lanes


def scratch_smem_bytes(refs) -> int:
    """Dynamic SMEM of a kernel's scratch list, counted as Mosaic GPU allocates it (each
    buffer aligned to 1 KB, then 8 bytes per barrier)."""
    total = barriers = 0
    for ref in refs:
        if isinstance(ref, plgpu.Barrier):
            barriers += math.prod(ref.num_barriers)
        else:
            size = math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
            total += -(-size // _SMEM_ALIGN) * _SMEM_ALIGN
    return total + _BARRIER_BYTES * barriers


def smem(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """SMEM tile tiled (8 rows) and swizzled as TMA and wgmma want it (minor dim = last)."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    transforms = (
        plgpu.TilingTransform((ALIGN, swizzle // dtype.itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )
    return plgpu.SMEM(shape, dtype, transforms=transforms)


def along_rows(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """``vec[i]`` along row ``i`` (``vec`` in the ROWS layout)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def along_cols(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """``vec[j]`` along column ``j`` (``vec`` in the COLS layout)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def matmul(a, b, shape: tuple[int, int]) -> jax.Array:
    """``a @ b`` on the tensor cores (bf16 SMEM operands), float32 ``shape``.

    One wgmma per scoped accumulator, read at once: with two accumulators in one scope the
    second product came out wrong on the H200 (JAX 0.11.2; the interpreter was right).
    Only ``run_scoped`` accumulators: the GPU interpreter does not run ``run_state``, so an
    accumulator is never initialised from registers and sums are formed afterwards. The
    optimization barrier keeps LLVM from reading the registers before the wgmma wait.
    """

    def body(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return lax.optimization_barrier(pl.run_scoped(body, plgpu.ACC(shape, F32)))


def matmul_into(acc: jax.Array, a, b, *, interpret: bool) -> jax.Array:
    """``acc + a @ b`` on the tensor cores (``acc`` float32 in the WGMMA layout).

    On the GPU the product accumulates onto ``acc`` in place (``run_state``), so the
    accumulator and a second product of its size are never live in registers together;
    the interpreter, which does not run ``run_state``, adds a scoped product (``matmul``).
    """
    if interpret:
        return acc + matmul(a, b, acc.shape)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(body)(plgpu.ACC.init(acc))


def chunk_table(
    qsl: jax.Array, num_tokens: int, num_chunks: int, ends: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Chunks of the N sequences and of the padding segment ``[qsl[N], T)``.

    Sequence ``n`` covers tokens ``[qsl[n], ends[n])``; ``ends`` (int32 ``[N]``) defaults to
    ``qsl[1:]``, the packed layout. Tokens between ``ends[n]`` and ``qsl[n + 1]`` belong to no
    segment (``SequenceLayout``'s gaps): they are masked rows of sequence ``n``'s last chunk.

    Returns ``table`` int32 ``[3, num_chunks]`` (first token, first valid row, end of the
    valid rows; ``0, 0, 0`` for unused entries) and ``first`` int32 ``[N + 2]``: segment
    ``n`` owns chunks ``first[n] .. first[n + 1] - 1`` (segment N is the padding).
    """
    n = qsl.shape[0] - 1
    qsl = qsl.astype(jnp.int32)
    ends = qsl[1:] if ends is None else ends.astype(jnp.int32)
    lo_tok = qsl  # segment n covers [qsl[n], ends[n]) and segment N covers [qsl[N], T)
    hi_tok = jnp.concatenate([ends, jnp.array([num_tokens], jnp.int32)])
    base = lo_tok - lo_tok % ALIGN
    counts = jnp.where(hi_tok > lo_tok, (hi_tok - base + CHUNK - 1) // CHUNK, 0)
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    seg = jnp.clip(jnp.searchsorted(first, c, side="right").astype(jnp.int32) - 1, 0, n)
    nominal = base[seg] + CHUNK * (c - first[seg])
    start = jnp.minimum(nominal, max(num_tokens, CHUNK) - CHUNK)
    used = c < first[n + 1]
    lo = jnp.where(used, jnp.maximum(lo_tok[seg], nominal) - start, 0)
    hi = jnp.where(used, jnp.minimum(hi_tok[seg], nominal + CHUNK) - start, 0)
    table = jnp.stack([jnp.where(used, start, 0), lo, hi])
    return table, first


class SequenceLayout(NamedTuple):
    """Packed sequences re-laid out so that each starts at a multiple of ``ALIGN``: its chunks
    then begin at its own first token, and nothing shifts a chunk back at the end of the
    token axis, so every chunk's rows are the same whatever else the call packs.

    ``qsl`` int32 ``[N+1]``: sequence starts in the new layout (``qsl[N]``: the padding
    segment's start); ``ends`` int32 ``[N]``: where each sequence's tokens end (the rest up to
    the next start is a gap). ``source`` int32 ``[num_tokens]``: the call's token at each new
    position (out of range at gaps and padding); ``position`` int32 ``[T]``: each token's new
    position (out of range for the call's padding tokens ``t >= qsl[N]``).
    """

    qsl: jax.Array
    ends: jax.Array
    source: jax.Array
    position: jax.Array
    num_tokens: int

    def spread(self, x: jax.Array) -> jax.Array:
        """``x`` ``[T, ...]`` in the new layout (zeros at gaps and padding)."""
        return jnp.take(x, self.source, axis=0, mode="fill", fill_value=0)

    def gather(self, x: jax.Array) -> jax.Array:
        """``x`` ``[num_tokens, ...]`` back in the call's layout (zeros at its padding)."""
        return jnp.take(x, self.position, axis=0, mode="fill", fill_value=0)


def sequence_layout(qsl: jax.Array, num_tokens: int) -> SequenceLayout:
    """The ``SequenceLayout`` of ``qsl`` (int32 ``[N+1]``) over ``num_tokens`` packed tokens.

    Each sequence gets its length rounded up to ``ALIGN`` rows, and one chunk of room follows
    the last, so no chunk of a sequence reaches past the axis.
    """
    n = qsl.shape[0] - 1
    qsl = qsl.astype(jnp.int32)
    lens = qsl[1:] - qsl[:-1]
    room = round_up(lens, ALIGN)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(room, dtype=jnp.int32)])
    size = round_up(num_tokens + (ALIGN - 1) * n, ALIGN) + CHUNK
    ends = starts[:-1] + lens
    # searchsorted(side="right") - 1: the last of equal starts, so an empty sequence owns
    # nothing.
    new = jnp.arange(size, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(starts, new, side="right").astype(jnp.int32) - 1, 0, n)
    row = jnp.minimum(seq, n - 1)
    offset = new - starts[seq]
    source = jnp.where((seq < n) & (offset < lens[row]), qsl[row] + offset, num_tokens)
    old = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl, old, side="right").astype(jnp.int32) - 1, 0, n - 1)
    position = jnp.where(old < qsl[n], starts[seq] + old - qsl[seq], size)
    return SequenceLayout(starts, ends, source, position, size)


class TokenAxis(NamedTuple):
    """The chunked kernels' token axis for one call: ``num_tokens`` rows holding the call's
    ``tokens`` packed tokens, zero-padded to the 8-row tiling and at least one chunk, or
    re-laid out per sequence (``layout``, a packing-invariant call)."""

    qsl: jax.Array
    num_tokens: int
    tokens: int
    layout: SequenceLayout | None

    def place(self, x: jax.Array) -> jax.Array:
        """``x`` ``[tokens, ...]`` on the kernels' axis ``[num_tokens, ...]``, zeros elsewhere."""
        if self.layout is not None:
            return self.layout.spread(x)
        return jnp.pad(x, [(0, self.num_tokens - self.tokens)] + [(0, 0)] * (x.ndim - 1))

    def back(self, y: jax.Array) -> jax.Array:
        """The kernels' ``y`` ``[num_tokens, ...]`` in the call's layout ``[tokens, ...]``."""
        return y[: self.tokens] if self.layout is None else self.layout.gather(y)

    def chunks(self) -> tuple[jax.Array, jax.Array]:
        """``chunk_table`` of the N sequences and the padding on this axis."""
        n = self.qsl.shape[0] - 1
        # Each segment takes at most ceil((len + 7) / 64) chunks, which sums to this bound.
        num_chunks = -(-self.num_tokens // CHUNK) + 2 * (n + 1)
        ends = None if self.layout is None else self.layout.ends
        return chunk_table(self.qsl, self.num_tokens, num_chunks, ends)


def token_axis(qsl: jax.Array, tokens: int, packing_invariant: bool) -> TokenAxis:
    """The ``TokenAxis`` of a call of ``tokens`` packed tokens (``qsl`` int32 ``[N+1]``)."""
    if packing_invariant:
        layout = sequence_layout(qsl, tokens)
        return TokenAxis(layout.qsl, layout.num_tokens, tokens, layout)
    # A copy only when T is not already a multiple of 8 (or shorter than a chunk).
    return TokenAxis(qsl, max(CHUNK, round_up(tokens, ALIGN)), tokens, None)
