"""The state-independent half of a chunked Gated DeltaNet step, for one warpgroup.

The body of ``chunk_mgpu.py``'s intra kernel, kept apart so that a kernel that computes it
inside another (a producer warpgroup, see ``benchmarks/prefill_notes.md``) can share it: from
one 64-token chunk of q, k (bf16 SMEM tiles, not yet normalised), its cumulative log decay
and beta (``chunk_gates``, computed before the kernel) it forms, per the math of
``chunk_mgpu.py``'s docstring, ``M = (I + A)^-1 diag(beta)`` and
``P = tril(scale (q k^T) exp(gc_i - gc_j))`` as bf16 SMEM tiles and four float32 row vectors.
"""

from __future__ import annotations

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, memref
from jaxlib.mlir.dialects import math as mlir_math

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

__all__ = ["EPS", "SOLVE_SHAPE", "VEC_ROWS", "chunk_gates", "chunk_intra", "unit_lower_inverse"]

EPS = 1e-6  # inside the l2 norm's square root

# Rows of the float32 [rows, 64] vectors the intra kernel writes per (chunk, value head):
# rk exp(gc), scale rq exp(gc), rk exp(gc_last - gc), exp(gc_last) (only its first entry is
# read).
VEC_ROWS = 4


BLOCK = 16  # diagonal blocks of T solved by substitution before the doubling levels
# bf16 scratch of the substitution, [64, 64 + 8]: rows padded by 16 bytes so that the eight
# rows a warp stores at once do not share banks. bf16 as every other operand of the inverse
# (the doubling levels multiply bf16 tiles; measured errors did not move).
SOLVE_SHAPE = (CHUNK, CHUNK + 8)


@plgpu.inline_mgpu(
    arg_types=(WG, plgpu.RefType(), plgpu.RefType()),
    return_type=plgpu.ShapeDtypeStruct((CHUNK, CHUNK), F32, layout=WG),
)
def _diagonal_block_inverse(ctx, a, a_ref, x_ref):
    """``(I + A)^-1`` restricted to the 16x16 diagonal blocks (zeros elsewhere).

    ``a``: float32 ``[64, 64]`` registers, strictly lower where read (only the strictly lower
    part of its diagonal blocks is). ``a_ref``, ``x_ref``: bf16 ``[64, 64]`` SMEM views.
    Thread ``c`` of one 64-thread half of the warpgroup solves column ``c`` of its block by
    right-looking substitution in float32: ``x_j = r_j``, then ``r_i -= A_ij x_j`` for
    ``i > j``, so the updates of a step are independent FMAs. Column ``j`` of ``A`` is read
    as scalars that the threads of a block share (broadcast loads). Which half solves
    alternates between CTAs so that the CTAs sharing an SM use all four of its schedulers.
    This is raw Mosaic GPU code (per-thread scalars, which Pallas cannot express); the GPU
    interpreter cannot run it, so ``unit_lower_inverse`` takes the equivalent doubling levels
    there.
    """
    del ctx
    f32, bf16 = ir.F32Type.get(), ir.BF16Type.get()
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    cst = mgpu_utils.c
    a.astype(bf16).store_untiled(a_ref, optimized=False)
    zeros = mgpu.FragmentedArray.splat(cst(0.0, bf16), (CHUNK, CHUNK), layout=mgpu.WGMMA_LAYOUT)
    zeros.store_untiled(x_ref, optimized=False)
    mgpu_utils.warpgroup_barrier()  # A and the zeros are visible to every thread
    tid = arith.remui(mgpu_utils.thread_idx(), cst(128, i32))
    cta = arith.addi(gpu.block_id(gpu.Dimension.x), gpu.block_id(gpu.Dimension.y))
    first = arith.muli(arith.index_cast(i32, arith.remui(cta, cst(2, index))), cst(CHUNK, i32))
    lane = arith.subi(tid, first)  # the column this thread solves, when 0 <= lane < 64
    solves = arith.andi(
        arith.cmpi(arith.CmpIPredicate.sge, lane, cst(0, i32)),
        arith.cmpi(arith.CmpIPredicate.slt, lane, cst(CHUNK, i32)),
    )
    with mgpu_utils.when(solves):
        col = arith.index_cast(index, lane)
        local = arith.remui(lane, cst(BLOCK, i32))
        start = arith.index_cast(index, arith.subi(lane, local))
        zero, one = cst(0.0, f32), cst(1.0, f32)
        r = [
            arith.select(arith.cmpi(arith.CmpIPredicate.eq, local, cst(i, i32)), one, zero)
            for i in range(BLOCK)
        ]
        for j in range(BLOCK):
            row_j = arith.addi(start, cst(j, index))
            memref.store(arith.truncf(bf16, r[j]), x_ref, [row_j, col])
            for i in range(j + 1, BLOCK):
                a_ij = memref.load(a_ref, [arith.addi(start, cst(i, index)), row_j])
                r[i] = mlir_math.fma(arith.negf(arith.extf(f32, a_ij)), r[j], r[i])
    mgpu_utils.warpgroup_barrier()  # every column is written before X is read
    x = mgpu.FragmentedArray.load_untiled(x_ref, layout=mgpu.WGMMA_LAYOUT, optimized=False)
    return x.astype(f32)


def unit_lower_inverse(a: jax.Array, l_s, t_s, solve_s=None) -> jax.Array:
    """``(I + A)^-1`` of a float32 ``[64, 64]`` tile, strictly lower where read.

    Only the strictly lower part of ``a`` is read, so its diagonal and upper part may hold
    anything. ``l_s``, ``t_s``: bf16 ``[64, 64]`` SMEM scratch for the wgmma operands.
    ``solve_s``: two bf16 ``SOLVE_SHAPE`` SMEM buffers: the 16x16 diagonal blocks are then
    solved by substitution (GPU only); None builds them by doubling instead (what the GPU
    interpreter can run; the same function up to bf16 rounding).
    """
    shape = (CHUNK, CHUNK)
    ri = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WG)
    ci = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WG)

    def off_diagonal(b: int) -> jax.Array:  # row block 2, column block 1 of each 2b block
        # Bit tests, not div/rem (b is a power of two): this runs on every element of the
        # tile at every level, where a signed div or rem costs several instructions.
        return ((ri ^ ci) < 2 * b) & ((ri & b) != 0) & ((ci & b) == 0)

    if solve_s is not None:
        a_s, x_s = solve_s
        t = _diagonal_block_inverse(a, a_s.at[:, :CHUNK], x_s.at[:, :CHUNK])
        b = BLOCK
    else:
        t = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(off_diagonal(1), a, 0.0)
        b = 2
    while b < CHUNK:
        l_s[...] = jnp.where(off_diagonal(b), a, 0.0).astype(BF16)
        t_s[...] = t.astype(BF16)
        plgpu.commit_smem()
        # L is read by then (the product has been waited for): L T takes its place.
        l_s[...] = matmul(l_s, t_s, shape).astype(BF16)
        plgpu.commit_smem()
        t = t - matmul(t_s, l_s, shape)
        b *= 2
    return t


def chunk_intra(q_s, k_s, gc_r, gc_c, b_r, b_c, m_s, p_s, vec_s, *, scale: float, solve_s=None):
    """Fill ``m_s``, ``p_s`` (bf16 ``[64, 64]``) and ``vec_s`` (float32 ``[4, 64]``) for a chunk.

    q_s, k_s: bf16 ``[64, K]`` SMEM tiles; gc_r/gc_c: float32 ``[64]`` SMEM copies of the
    chunk-local cumulative log decay, b_r/b_c of beta (one copy per register layout they are
    read in), both already zero where rows belong to a neighbour (``chunk_gates``).
    ``vec_s`` rows: ``rk exp(gc)``, ``scale rq exp(gc)``, ``rk exp(gc_last - gc)``,
    ``exp(gc_last)``. ``solve_s``: see ``unit_lower_inverse``. Ends with the writes committed
    (visible to TMA and wgmma).
    """
    shape = (CHUNK, CHUNK)
    # Ordered so that few [64, 64] float32 tiles are live at once (no spills).
    kk = matmul(k_s, k_s.T, shape)
    ri = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WG)
    ci = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WG)
    # |k_i|^2 is the diagonal of k k^T (exact bf16 products, float32 sums).
    rk_row = lax.rsqrt(jnp.where(ri == ci, kk, 0.0).sum(axis=1) + EPS)
    # The column form goes through SMEM: a sum over axis 0 would be a cross-warp reduction.
    vec_s[0] = rk_row
    plgpu.commit_smem()
    rk_col = plgpu.load(vec_s.at[0], layout=COLS)
    gc_row = plgpu.load(gc_r, layout=ROWS)
    expo = along_rows(gc_row, shape) - along_cols(plgpu.load(gc_c, layout=COLS), shape)
    # Exponents are masked before exp (acausal pairs have gc_i - gc_j > 0). One exp tile
    # serves P (lower) and A, whose diagonal the inverse never reads.
    decay = jnp.exp(jnp.where(ri >= ci, expo, -jnp.inf))
    beta_row = plgpu.load(b_r, layout=ROWS)
    a = kk * along_rows(beta_row * rk_row, shape) * along_cols(rk_col, shape) * decay
    t = unit_lower_inverse(a, m_s, p_s, solve_s)
    m_s[...] = (t * along_cols(plgpu.load(b_c, layout=COLS), shape)).astype(BF16)
    qk = matmul(q_s, k_s.T, shape)
    qf = plgpu.load(q_s, layout=WG).astype(F32)
    rq_row = lax.rsqrt((qf * qf).sum(axis=1) + EPS)
    p = qk * along_rows(scale * rq_row, shape) * along_cols(rk_col, shape) * decay
    p_s[...] = p.astype(BF16)
    g_last = gc_r[CHUNK - 1]  # the chunk's total decay (rows past the end add zeros)
    decay_in = jnp.exp(gc_row)
    vec_s[0] = rk_row * decay_in
    vec_s[1] = scale * rq_row * decay_in
    vec_s[2] = rk_row * jnp.exp(g_last - gc_row)
    vec_s[3] = plgpu.layout_cast(jnp.full((CHUNK,), jnp.exp(g_last)), ROWS)
    plgpu.commit_smem()


def chunk_gates(g_t: jax.Array, beta_t: jax.Array, table: jax.Array) -> tuple[jax.Array, ...]:
    """Per chunk of ``table`` (``_mgpu_chunks.chunk_table``) and value head: the chunk-local
    cumulative log decay ``gc`` and ``beta``, zero on rows a neighbour owns; float32
    ``[HV, NC * 64]`` each (chunk ``c`` at columns ``64 c ..``).

    ``g_t``, ``beta_t``: float32 ``[HV, T]``. A few microseconds of XLA that take the masked
    cumulative sums (cross-thread reductions) out of the intra kernel.
    """
    start, lo, hi = table[0], table[1], table[2]
    rows = jnp.arange(CHUNK, dtype=jnp.int32)
    tokens = start[:, None] + rows
    own = (rows >= lo[:, None]) & (rows < hi[:, None])
    heads = g_t.shape[0]
    # The windows are materialised before the sums, and the sum over 64 is taken as 8 x 8:
    # XLA's cumulative sum is a reduce-window that reads (and re-gathers, when fused) every
    # element once per window position (benchmarks/prefill_notes.md has its cost).
    g = lax.optimization_barrier(jnp.where(own, g_t[:, tokens], 0.0))
    inner = jnp.cumsum(g.reshape(heads, -1, CHUNK // 8, 8), axis=-1)
    ends = inner[..., -1]
    gc = inner + (jnp.cumsum(ends, axis=-1) - ends)[..., None]
    beta = jnp.where(own, beta_t[:, tokens], 0.0)
    return gc.reshape(heads, -1), beta.reshape(heads, -1)
