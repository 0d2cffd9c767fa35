"""Packed-varlen bookkeeping shared by the chunked references (static shapes, ``qsl`` dynamic).

Each sequence is cut into chunks of ``chunk`` tokens aligned to its own first token, and the
chunks of all sequences are numbered one after the other. ``sum_n ceil(L_n / chunk) <=
(T + (chunk - 1) N) // chunk`` whatever the lengths, so that many ``[chunk]`` token tiles (also
at most ``T``) is a static bound; unused tiles at the end are all masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["num_tiles", "tile_layout", "token_segments"]


def token_segments(qsl: jax.Array, t_total: int) -> tuple[jax.Array, ...]:
    """Per packed token ``[T]``: its sequence, whether it is that sequence's first and last
    token, whether it is a real token (``t < qsl[N]``). Empty sequences own no token."""
    n_seq = qsl.shape[0] - 1
    t = jnp.arange(t_total, dtype=qsl.dtype)
    seq = jnp.clip(jnp.searchsorted(qsl, t, side="right") - 1, 0, n_seq - 1).astype(qsl.dtype)
    valid = t < qsl[n_seq]
    first = valid & (t == qsl[seq])
    last = valid & (t == qsl[seq + 1] - 1)
    return seq, first, last, valid


def num_tiles(t_total: int, n_seq: int, chunk: int) -> int:
    """Static bound on ``sum_n ceil(L_n / chunk)`` given ``sum_n L_n <= T``."""
    return max(1, min(t_total, (t_total + (chunk - 1) * n_seq) // chunk))


def tile_layout(qsl: jax.Array, t_total: int, n_tiles: int, chunk: int) -> dict[str, jax.Array]:
    """Where each tile's tokens come from and where each token's output lands.

    Per tile ``[n_tiles]``: ``seq``, ``first``/``last`` (it starts/ends its sequence);
    ``token``/``mask`` ``[n_tiles, chunk]``: the packed token of each tile row and whether it
    is real. Per token ``[T]``: ``out_tile``/``out_row`` (where its output is) and ``valid``.
    """
    lengths = qsl[1:] - qsl[:-1]
    n_chunks = (lengths + chunk - 1) // chunk
    chunk_end = jnp.cumsum(n_chunks)
    chunk_start = chunk_end - n_chunks
    tile = jnp.arange(n_tiles, dtype=qsl.dtype)
    used = tile < chunk_end[-1]
    tile_seq = jnp.clip(jnp.searchsorted(chunk_end, tile, side="right"), 0, lengths.shape[0] - 1)
    j = tile - chunk_start[tile_seq]
    offset = jnp.arange(chunk, dtype=qsl.dtype)
    in_seq = offset[None, :] < lengths[tile_seq, None] - chunk * j[:, None]
    token_seq, _, _, valid = token_segments(qsl, t_total)
    position = jnp.arange(t_total, dtype=qsl.dtype) - qsl[token_seq]
    return {
        "seq": tile_seq,
        "first": used & (j == 0),
        "last": used & (j == n_chunks[tile_seq] - 1),
        "token": jnp.clip(qsl[tile_seq, None] + chunk * j[:, None] + offset, 0, t_total - 1),
        "mask": used[:, None] & in_seq,
        "out_tile": chunk_start[token_seq] + position // chunk,
        "out_row": position % chunk,
        "valid": valid,
    }
