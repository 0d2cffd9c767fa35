"""The state-independent half of a chunked Gated DeltaNet step, for one warpgroup.

The body of ``chunk_mgpu.py``'s intra kernel, kept apart so that a kernel that computes it
inside another (a producer warpgroup, see ``benchmarks/prefill_notes.md``) can share it: from
one 64-token chunk of q, k (bf16 SMEM tiles, not yet normalised), g and beta it forms, per
the math of ``chunk_mgpu.py``'s docstring, ``M = (I + A)^-1 diag(beta)`` and
``P = tril(scale (q k^T) exp(gc_i - gc_j))`` as bf16 SMEM tiles and four float32 row vectors.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu_chunks import (
    BF16,
    CHUNK,
    COLS,
    F32,
    ROWS,
    WG,
    along_cols,
    along_rows,
    matmul,
)

__all__ = ["EPS", "chunk_intra", "unit_lower_inverse"]

EPS = 1e-6  # inside the l2 norm's square root


def unit_lower_inverse(a: jax.Array, l_s, t_s, n_s) -> jax.Array:
    """``(I + A)^-1`` of a strictly lower float32 ``[64, 64]`` tile by block doubling.

    ``l_s``, ``t_s``, ``n_s``: bf16 ``[64, 64]`` SMEM scratch for the wgmma operands.
    """
    shape = (CHUNK, CHUNK)
    ri = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WG)
    ci = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WG)

    def off_diagonal(b: int) -> jax.Array:  # row block 2, column block 1 of each 2b block
        # Bit tests, not div/rem (b is a power of two): this runs on every element of the
        # tile at every level, where a signed div or rem costs several instructions.
        return ((ri ^ ci) < 2 * b) & ((ri & b) != 0) & ((ci & b) == 0)

    t = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(off_diagonal(1), a, 0.0)
    b = 2
    while b < CHUNK:
        l_s[...] = jnp.where(off_diagonal(b), a, 0.0).astype(BF16)
        t_s[...] = t.astype(BF16)
        plgpu.commit_smem()
        n_s[...] = matmul(l_s, t_s, shape).astype(BF16)
        plgpu.commit_smem()
        t = t - matmul(t_s, n_s, shape)
        b *= 2
    return t


def chunk_intra(q_s, k_s, g_r, g_c, b_r, b_c, lo, hi, m_s, p_s, n_s, vec_s, *, scale: float):
    """Fill ``m_s``, ``p_s`` (bf16 ``[64, 64]``) and ``vec_s`` (float32 ``[4, 64]``) for a chunk.

    q_s, k_s: bf16 ``[64, K]`` SMEM tiles; g_r/g_c, b_r/b_c: float32 ``[64]`` SMEM copies of g
    and beta (one per register layout they are read in). Rows outside ``lo <= i < hi`` belong
    to a neighbour: they get ``g = beta = 0``. ``vec_s`` rows: ``rk exp(gc)``,
    ``scale rq exp(gc)``, ``rk exp(gc_last - gc)``, ``exp(gc_last)``. ``n_s``: bf16 scratch.
    Ends with the writes committed (visible to TMA and wgmma).
    """
    shape = (CHUNK, CHUNK)
    # Ordered so that few [64, 64] float32 tiles are live at once (no spills).
    kk = matmul(k_s, k_s.T, shape)
    ri = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WG)
    ci = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WG)
    # |k_i|^2 is the diagonal of k k^T (exact bf16 products, float32 sums).
    diag = jnp.where(ri == ci, kk, 0.0)
    rk_row = lax.rsqrt(diag.sum(axis=1) + EPS)
    rk_col = lax.rsqrt(diag.sum(axis=0) + EPS)
    iv_r = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=ROWS)
    iv_c = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=COLS)
    in_r = (iv_r >= lo) & (iv_r < hi)
    in_c = (iv_c >= lo) & (iv_c < hi)
    # Masked rows decay by nothing and write nothing (beta = 0 zeroes their v').
    g_row = jnp.where(in_r, plgpu.load(g_r, layout=ROWS), 0.0)
    g_col = jnp.where(in_c, plgpu.load(g_c, layout=COLS), 0.0)
    gc_row = jnp.where(ci <= ri, along_cols(g_col, shape), 0.0).sum(axis=1)
    gc_col = jnp.where(ri <= ci, along_rows(g_row, shape), 0.0).sum(axis=0)
    g_last = along_cols(g_col, shape).sum(axis=1)  # the chunk's total, on every row
    beta_row = jnp.where(in_r, plgpu.load(b_r, layout=ROWS), 0.0)
    # Exponents are masked before exp: acausal pairs have gc_i - gc_j > 0.
    expo = along_rows(gc_row, shape) - along_cols(gc_col, shape)
    decay = jnp.exp(jnp.where(ri > ci, expo, -jnp.inf))
    a = kk * along_rows(beta_row * rk_row, shape) * along_cols(rk_col, shape) * decay
    t = unit_lower_inverse(a, m_s, p_s, n_s)
    beta_col = jnp.where(in_c, plgpu.load(b_c, layout=COLS), 0.0)
    m_s[...] = (t * along_cols(beta_col, shape)).astype(BF16)
    qk = matmul(q_s, k_s.T, shape)
    qf = plgpu.load(q_s, layout=WG).astype(F32)
    rq_row = lax.rsqrt((qf * qf).sum(axis=1) + EPS)
    decay = jnp.exp(jnp.where(ri >= ci, expo, -jnp.inf))
    p = qk * along_rows(scale * rq_row, shape) * along_cols(rk_col, shape) * decay
    p_s[...] = p.astype(BF16)
    vec_s[0] = rk_row * jnp.exp(gc_row)
    vec_s[1] = scale * rq_row * jnp.exp(gc_row)
    vec_s[2] = rk_row * jnp.exp(g_last - gc_row)
    vec_s[3] = jnp.exp(g_last)
    plgpu.commit_smem()
