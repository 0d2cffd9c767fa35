"""Chunked Mamba2 (SSD) prefill for Hopper in Mosaic GPU: one kernel over packed varlen tokens.

Math, per head ``h`` and 64-token chunk (state ``S`` ``[P, N]`` float32; ``dt`` already through
bias, softplus and the clip; ``c`` the chunk-local cumulative sum of ``dt A``)::

    Y = diag(exp(c)) C S^T + (tril(C B^T exp(c_i - c_j)) diag(dt)) x + D x
    Y = Y silu(z)                                                         (when z is given)
    S <- exp(c_last) S + x^T (diag(exp(c_last - c) dt) B)

Unlike Gated DeltaNet there is no state-independent solve, so there is no separate intra-chunk
kernel: one CTA per (sequence, head, 64 state rows) walks the sequence's chunks in order with
``S`` in registers, four wgmmas per chunk (``C B^T``, ``P x``, ``C S^T``, ``x^T (w B)``), the
next chunk's tiles prefetched by TMA. ``dt`` folds into the score columns and into ``B``'s
rows, so the bf16 ``x`` tile enters the tensor cores as loaded (as the B operand of ``P x``
and, transposed, as the A operand of the state update).

The varlen layout is the one of ``gdn/chunk_mgpu.py`` (its docstring; the chunk table and the
Mosaic GPU helpers are shared, in ``pallas_kernels/_mgpu_chunks.py``): chunks start at 8-aligned
tokens, rows of a chunk that belong to a neighbour get ``dt = 0`` (no decay, no input, so they
change neither the state nor the valid rows), partial chunks store only their valid rows, and
the padding tokens ``t >= qsl[N]`` form an extra segment whose chunks store zeros. Mosaic GPU
pitfalls of 0.11.2 (``benchmarks/prefill_notes.md``) are respected: one wgmma accumulator per
``run_scoped`` scope (``matmul``), TMA starts proven multiples of 8, float32 tiles never stored
transposed.

Precision: x, B, C, S and the score tile enter the tensor cores as bf16 (float32 inputs are
rounded to bf16 first); accumulation, decays, dt and the state are float32.

Checked in the Mosaic GPU interpreter (values), by lowering for ``cuda`` on the CPU (layouts,
TMA shapes) and on an H200 (``tests/kernels/test_mamba2_gpu.py``); timings in
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu_chunks import (
    ALIGN,
    BF16,
    CHUNK,
    COLS,
    F32,
    ROWS,
    WG,
    along_cols,
    along_rows,
    matmul,
    smem,
    token_axis,
)
from pallas_kernels.mamba2 import reference

__all__ = ["BLOCK_P", "ssd_chunk_scan", "unsupported_reason"]

BLOCK_P = 64  # state rows per CTA: the ROWS vectors of a chunk then also index state rows
_HEAD_DIMS = (64, 128)  # P
_STATE_DIMS = (64, 128)  # N


def _scan(x, z, dt_t, b, c, a, d, table, first, slots, has_init, pool, *, n_seqs, out_dtype,
          interpret):  # fmt: skip
    """The in-order walk over each sequence's chunks; returns ``y [Tp, H, P]``.

    x, z bf16 ``[Tp, H, P]`` (z may be None); dt_t float32 ``[H, Tp]`` (prepared); b, c bf16
    ``[Tp, G, N]``; a, d float32 ``[H]``. ``pool`` is a mutable ref: each non-empty sequence
    reads its initial state from it (when ``has_init``) and writes its final state back.
    """
    tokens, heads, p_dim = x.shape
    groups, n_dim = b.shape[1:]
    per_group = heads // groups
    has_z = z is not None
    bp = BLOCK_P
    sq = (CHUNK, CHUNK)
    tile = (CHUNK, bp)
    state = (bp, n_dim)

    def body(*refs):
        n_in = 11 + has_z
        x_ref = refs[0]
        z_ref = refs[1] if has_z else None
        dt_ref, b_ref, c_ref, a_ref, d_ref, tab_ref, first_ref, slot_ref, init_ref, pool_ref = refs[
            1 + has_z : n_in
        ]
        y_ref = refs[n_in]
        scratch = list(refs[n_in + 1 :])
        x_s, b_s, c_s, dt_r, dt_c = scratch[:5]
        z_s = scratch[5] if has_z else None
        p_s, s_bf, wb_s, o_s, o_rows, st_s, bar, st_bar = scratch[5 + has_z :]
        # A TMA's SMEM address must be 128-byte aligned: rows of the row-by-row staging tile
        # are padded to 128 bytes.
        o_p = o_rows.at[:, pl.ds(0, bp)]
        n, h, ip = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("p")
        group = lax.div(h, per_group)
        cols = pl.ds(ip * bp, bp)
        c0 = first_ref[n]
        num = first_ref[n + 1] - c0
        real = n < n_seqs
        seq = jnp.minimum(n, n_seqs - 1)  # the padding segment reads no slot
        slot = slot_ref[seq]

        def store_rows(src, start, lo, hi):
            """Valid rows ``lo..hi-1`` of a chunk, one TMA each (never a neighbour's rows)."""

            @pl.loop(lo, hi)
            def _(i):
                plgpu.copy_smem_to_gmem(src.at[pl.ds(i, 1)], y_ref.at[pl.ds(start + i, 1), h, cols])

            plgpu.wait_smem_to_gmem(0)

        @pl.when(~real)
        def _padding():
            zeros = plgpu.layout_cast(jnp.zeros(tile, out_dtype), WG)
            o_s[0] = zeros
            o_p[...] = zeros
            plgpu.commit_smem()

            @pl.loop(0, num)
            def _(j):
                start = pl.multiple_of(tab_ref[0, c0 + j], ALIGN)
                lo, hi = tab_ref[1, c0 + j], tab_ref[2, c0 + j]
                full = (lo == 0) & (hi == CHUNK)

                @pl.when(full)
                def _():
                    plgpu.copy_smem_to_gmem(o_s.at[0], y_ref.at[pl.ds(start, CHUNK), h, cols])

                @pl.when(~full)
                def _():
                    store_rows(o_p, start, lo, hi)

            plgpu.wait_smem_to_gmem(0)

        @pl.when(real & (num > 0))
        def _sequence():
            def issue(j, stage):
                rows = pl.ds(pl.multiple_of(tab_ref[0, c0 + j], ALIGN), CHUNK)
                bj = bar.at[stage]
                plgpu.copy_gmem_to_smem(x_ref.at[rows, h, cols], x_s.at[stage], bj)
                plgpu.copy_gmem_to_smem(b_ref.at[rows, group], b_s.at[stage], bj)
                plgpu.copy_gmem_to_smem(c_ref.at[rows, group], c_s.at[stage], bj)
                # A vector is loaded once per layout it is read in (layout inference).
                plgpu.copy_gmem_to_smem(dt_ref.at[h, rows], dt_r.at[stage], bj)
                plgpu.copy_gmem_to_smem(dt_ref.at[h, rows], dt_c.at[stage], bj)
                if has_z:
                    plgpu.copy_gmem_to_smem(z_ref.at[rows, h, cols], z_s.at[stage], bj)

            issue(0, 0)

            @pl.when(init_ref[seq] != 0)
            def _():
                plgpu.copy_gmem_to_smem(pool_ref.at[slot, h, cols, :], st_s, st_bar)
                plgpu.barrier_wait(st_bar)

            @pl.when(init_ref[seq] == 0)
            def _():
                st_s[...] = plgpu.layout_cast(jnp.zeros(state, F32), WG)

            plgpu.commit_smem()
            s0 = plgpu.load(st_s, layout=WG, optimized=False)
            a_h = a_ref[h]
            d_h = d_ref[h]

            def step(j, s):
                stage = lax.rem(j, 2)
                c = c0 + j
                start = pl.multiple_of(tab_ref[0, c], ALIGN)
                lo, hi = tab_ref[1, c], tab_ref[2, c]
                plgpu.barrier_wait(bar.at[stage])

                # The other stage was last read by chunk j - 1, which has finished.
                @pl.when(j + 1 < num)
                def _():
                    issue(j + 1, 1 - stage)

                ri = plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WG)
                ci = plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WG)
                iv_r = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=ROWS)
                iv_c = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=COLS)
                # Neighbours' rows get dt = 0: no decay, no input.
                dt_row = jnp.where(
                    (iv_r >= lo) & (iv_r < hi), plgpu.load(dt_r.at[stage], layout=ROWS), 0.0
                )
                dt_col = jnp.where(
                    (iv_c >= lo) & (iv_c < hi), plgpu.load(dt_c.at[stage], layout=COLS), 0.0
                )
                cum_row = jnp.where(ci <= ri, along_cols(dt_col * a_h, sq), 0.0).sum(axis=1)
                cum_col = jnp.where(ri <= ci, along_rows(dt_row * a_h, sq), 0.0).sum(axis=0)
                # the chunk's total, on every row
                cum_last = along_cols(dt_col * a_h, sq).sum(axis=1)
                # Exponents are masked before exp: acausal pairs have c_i - c_j > 0.
                expo = along_rows(cum_row, sq) - along_cols(cum_col, sq)
                decay = jnp.exp(jnp.where(ri >= ci, expo, -jnp.inf))
                cb = matmul(c_s.at[stage], b_s.at[stage].T, sq)
                p_s[...] = (cb * decay * along_cols(dt_col, sq)).astype(BF16)
                s_bf[...] = s.astype(BF16)
                w_row = jnp.exp(cum_last - cum_row) * dt_row
                bt = plgpu.load(b_s.at[stage], layout=WG).astype(F32)
                wb_s[...] = (bt * along_rows(w_row, (CHUNK, n_dim))).astype(BF16)
                plgpu.commit_smem()
                px = matmul(p_s, x_s.at[stage], tile)
                cs = matmul(c_s.at[stage], s_bf.T, tile)
                upd = matmul(x_s.at[stage].T, wb_s, state)
                xt = plgpu.load(x_s.at[stage], layout=WG).astype(F32)
                out = along_rows(jnp.exp(cum_row), tile) * cs + px + d_h * xt
                if has_z:
                    zt = plgpu.load(z_s.at[stage], layout=WG).astype(F32)
                    out = out * zt / (1.0 + jnp.exp(-zt))
                out = out.astype(out_dtype)
                full = (lo == 0) & (hi == CHUNK)
                # o_s[stage] was last sent two chunks ago; at most one store is in flight.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                o_s[stage] = out

                @pl.when(~full)
                def _():
                    o_p[...] = out

                plgpu.commit_smem()

                @pl.when(full)
                def _():
                    plgpu.copy_smem_to_gmem(o_s.at[stage], y_ref.at[pl.ds(start, CHUNK), h, cols])

                @pl.when(~full)
                def _():
                    store_rows(o_p, start, lo, hi)

                # cum_last is on every chunk row; BLOCK_P == CHUNK makes it one per state row.
                return along_rows(jnp.exp(cum_last), state) * s + upd

            s = lax.fori_loop(0, num, step, s0)
            st_s[...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, pool_ref.at[slot, h, cols, :])
            plgpu.wait_smem_to_gmem(0)

    vec = plgpu.SMEM((2, CHUNK), F32)
    scratch = [
        smem((2, *tile), BF16),
        smem((2, CHUNK, n_dim), BF16),
        smem((2, CHUNK, n_dim), BF16),
        vec,
        vec,
    ]
    if has_z:
        scratch.append(smem((2, *tile), BF16))
    scratch += [
        smem(sq, BF16),
        smem(state, BF16),
        smem((CHUNK, n_dim), BF16),
        smem((2, *tile), out_dtype),
        plgpu.SMEM((CHUNK, max(bp, 128 // jnp.dtype(out_dtype).itemsize)), out_dtype),
        plgpu.SMEM(state, F32),
        plgpu.Barrier(num_arrivals=5 + has_z, num_barriers=2),
        plgpu.Barrier(),
    ]
    operands = (x, *((z,) if has_z else ()), dt_t, b, c, a, d, table, first, slots, has_init)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tokens, heads, p_dim), out_dtype),
        scratch_types=scratch,
        grid=(n_seqs + 1, heads, p_dim // bp),
        grid_names=("n", "h", "p"),
        interpret=interpret,
        kernel_name="mamba2_ssd_chunk_scan",
    )(*operands, pool)


def unsupported_reason(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    z: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
) -> str | None:
    """One sentence on why this kernel cannot take the call, or None when it can."""
    del dt_softplus, dt_min, dt_max, state_indices, has_initial_state
    if x.ndim != 3 or B.ndim != 3 or C.shape != B.shape or B.shape[0] != x.shape[0]:
        return f"x [T, H, P] and B, C [T, G, N] expected, got {x.shape}, {B.shape}, {C.shape}"
    heads, p_dim = x.shape[1:]
    groups, n_dim = B.shape[1:]
    if groups == 0 or heads % groups:
        return f"H={heads} is not a multiple of G={groups}"
    if p_dim not in _HEAD_DIMS:
        return f"P={p_dim}: the kernel supports head dims {_HEAD_DIMS} only"
    if n_dim not in _STATE_DIMS:
        return f"N={n_dim}: the kernel supports state sizes {_STATE_DIMS} only"
    dtypes = {jnp.dtype(v.dtype) for v in (x, B, C, z) if v is not None}
    if len(dtypes) != 1 or not dtypes <= {jnp.dtype(BF16), jnp.dtype(F32)}:
        got = sorted(map(str, dtypes))
        return f"x, B, C (and z) must share one dtype of bf16 or float32, got {got}"
    if z is not None and z.shape != x.shape:
        return f"z {z.shape} must be x's shape {x.shape}"
    if dt.shape != x.shape[:2] or not jnp.issubdtype(dt.dtype, jnp.floating):
        return f"dt {dt.dtype}{list(dt.shape)} must be floating [T, H]"
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if v.shape != (heads,) or v.dtype != F32:
            return f"{name} {v.dtype}{list(v.shape)} must be float32 [{heads}]"
    if jnp.dtype(ssm_pool.dtype) != jnp.dtype(F32) or ssm_pool.shape[1:] != (heads, p_dim, n_dim):
        got = f"{ssm_pool.dtype}{list(ssm_pool.shape)}"
        return f"ssm_pool {got} must be float32 [S, {heads}, {p_dim}, {n_dim}]"
    if qsl.ndim != 1 or qsl.shape[0] < 2:
        return f"query_start_loc must be [N+1] with N >= 1, got shape {qsl.shape}"
    return None


def ssd_chunk_scan(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    z: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    interpret: object = False,
    packing_invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked Mamba2 over packed sequences (the Mosaic GPU kernel); arguments and results as
    ``pallas_kernels.mamba2.ssd_chunk_scan`` (``packing_invariant`` re-lays the tokens out:
    ``_mgpu_chunks.sequence_layout``), plus ``interpret`` (False for the GPU, True or
    ``plgpu.InterpretGPUParams`` for the Mosaic GPU CPU interpreter). Donate the pool under
    ``jit`` for an in-place update."""
    args = (x, dt, A, B, C, D, dt_bias, ssm_pool, qsl, state_indices, has_initial_state)
    reason = unsupported_reason(*args, z=z)
    if reason is not None:
        raise ValueError(f"ssd_mgpu.ssd_chunk_scan: {reason}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    interpret = interpret or None
    tokens = x.shape[0]
    n_seqs = qsl.shape[0] - 1
    out_dtype = x.dtype
    step = reference.prepare_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, F32)
    axis = token_axis(qsl, tokens, packing_invariant)

    def prepare(v):
        return axis.place(v).astype(BF16)

    dt_t = axis.place(step).T
    table, first = axis.chunks()
    pool = jax.new_ref(ssm_pool)
    y = _scan(
        prepare(x), None if z is None else prepare(z), dt_t, prepare(B), prepare(C), A, D,
        table, first, state_indices.astype(jnp.int32), has_initial_state.astype(jnp.int32),
        pool, n_seqs=n_seqs, out_dtype=out_dtype, interpret=interpret,
    )  # fmt: skip
    return axis.back(y), jax.freeze(pool)
