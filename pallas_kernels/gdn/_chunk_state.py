"""The state pass of the chunked GDN prefill, warp-specialised: three warpgroups per CTA.

A drop-in for ``chunk_mgpu._state`` (kernel 2; same inputs, outputs, grid and varlen rules,
math in ``chunk_mgpu.py``'s docstring). There, one warpgroup per CTA runs five dependent
wgmmas per 64-token chunk (``kS``, ``qS``, ``M Y``, ``k^T v'``, ``P v'``), each behind SMEM
stores and ``commit_smem`` fences, with the next chunk's tiles prefetched one chunk ahead; at
one CTA per SM that leaves one warp per scheduler and the SM idle on latency. Here each CTA
(one per sequence segment, value head and ``block_v`` value columns) splits that work:

* warpgroup 0, the producer (few registers): TMA-streams each chunk's q and k tiles, the v
  block, ``M``, ``P`` and the row vectors into a ring of
  ``stages`` SMEM stages. ``loaded`` (the TMA barrier of a stage) hands a stage to both
  consumers; ``consumed`` (two arrivals) hands it back once both are done with it.
* warpgroup 1, the state chain: carries ``S`` (float32 registers) and per chunk does only
  ``kS``, ``v' = M (v - a kS)`` and ``S <- d S + k^T (e v')``: three wgmmas, the serial part.
  It publishes ``S`` (bf16, the same tile its own ``kS`` reads) and ``v'`` (bf16) through a
  2-slot hand-off before its third wgmma, and writes the final state to the pool.
* warpgroup 2, the output: ``o = b (q S) + P v'`` from the published tiles, and the store
  (a full chunk with one TMA, a partial chunk row by row), overlapping the next chunk's
  chain. It also writes the zeros of the padding segment. ``published`` (state -> output) and
  ``retired`` (output -> state) hand a slot over; with two slots the output may lag a chunk.

Every waiting warpgroup waits for every phase of each barrier in order (Mosaic GPU tracks a
barrier's parity per thread): a phase is only signalled when a later chunk waits for it. A
warpgroup hands a stage back only after a ``commit_smem`` (proxy fence) that follows its last
plain read of it, since the producer's next write there is a TMA (the async proxy).

Operands and the order of float32 operations are ``_state``'s, so both give the same bits:
both passes run the helpers defined here for what they share (a CTA's segment,
``cta_segment``; a chunk's loads, ``load_chunk``; the chain's ``v'``, ``chain_values``; the
initial and final state; a chunk's store, ``store_chunk``).

Mosaic GPU constraints kept (benchmarks/prefill_notes.md): one wgmma per ``run_scoped``
accumulator (``matmul``); no reductions over axis 0 of a WGMMA tile in the concurrent
warpgroups (they share one SMEM reduction scratch and race; there is no reduction at all);
``setmaxnreg`` executed unconditionally by each warpgroup (an ``increase`` waits for the
registers the producer's ``decrease`` frees, also in CTAs with nothing to do).

SMEM per CTA (``smem_bytes``, equal to Mosaic GPU's count; limit 227 KB), K=128:
``block_v=32``: 162 KB with 2 stages, 215 KB with 3; ``block_v=64``: 218 KB with 2 stages,
3 do not fit (275 KB). K=64: 114 / 151 KB and 154 / 195 KB.

One state chain per CTA and ``P`` formed by the intra kernel: the alternatives measured
slower on every shape (benchmarks/prefill_notes.md).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu_chunks import (
    ALIGN,
    BF16,
    CHUNK,
    F32,
    ROWS,
    SMEM_LIMIT,
    WG,
    along_rows,
    matmul,
    scratch_smem_bytes,
    smem,
)
from pallas_kernels.gdn._chunk_intra import VEC_ROWS

__all__ = ["SMEM_LIMIT", "smem_bytes", "state_pass", "unsupported_reason"]

BLOCK_V = (32, 64)
STAGES = (2, 3)
HANDOFF = 2  # slots of published S / v' between the state and the output warpgroup
PRODUCER, STATE, OUTPUT = 0, 1, 2
# Registers per thread after rebalancing (setmaxnreg: multiples of 8, at most 512 summed over
# three warpgroups; jax's own warp-specialised attention uses the same split).
PRODUCER_REGS = 40
COMPUTE_REGS = 232


def put_b_operand(ref, x: jax.Array, kmajor: bool) -> None:
    """Store ``x`` as a bf16 wgmma B operand (transposed when ``kmajor``).

    wgmma takes one swizzle for both operands; a B operand of 32 columns can only have a
    64-byte swizzle in its natural [K, N] layout, so narrow value blocks keep their B operands
    transposed ([N, K], K contiguous, 128-byte swizzle) and store them so.
    """
    if kmajor:
        ref.T[...] = x.astype(BF16)
    else:
        ref[...] = x.astype(BF16)


def b_operand_view(ref, kmajor: bool):
    """The [K, N] view of a B operand stored by ``put_b_operand``."""
    return ref.T if kmajor else ref


def cta_segment(first_ref, slot_ref, *, n_seqs: int, group: int, block_v: int) -> tuple:
    """What this CTA of a state pass (grid ``("n", "h", "v")``) walks: ``(h, hk, cols, c0,
    num, real, seq, slot)``, its value head, key head and value columns, the segment's first
    chunk and chunk count (``first_ref``: ``_mgpu_chunks.chunk_table``), whether the segment
    is a sequence (segment N is the padding ``t >= qsl[N]``), and the sequence whose slot it
    reads with that slot (the padding segment reads the last sequence's, never used)."""
    n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
    hk = lax.div(h, group)
    cols = pl.ds(iv * block_v, block_v)
    c0 = first_ref[n]
    num = first_ref[n + 1] - c0
    real = n < n_seqs
    seq = jnp.minimum(n, n_seqs - 1)  # the padding segment reads no slot
    return h, hk, cols, c0, num, real, seq, slot_ref[seq]


def load_chunk(streamed, tiles, stage, bar, tab_ref, c, head, kv_head, cols) -> None:
    """Chunk ``c``'s inputs into SMEM stage ``stage``, six TMAs on ``bar``.

    ``streamed``: the pass's q, k, v, M, P and row-vector refs (its first six inputs);
    ``tiles``: their staged SMEM buffers, in that order. q and k (key head ``kv_head``) and
    v (columns ``cols`` of ``head``) come from the chunk's 64 token rows, M, P and the
    vectors from ``[c, head]``.
    """
    q_ref, k_ref, v_ref, m_ref, p_ref, w_ref = streamed
    q_s, k_s, v_s, m_s, p_s, w_s = tiles
    rows = pl.ds(pl.multiple_of(tab_ref[0, c], ALIGN), CHUNK)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, kv_head], q_s.at[stage], bar)
    plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_s.at[stage], bar)
    plgpu.copy_gmem_to_smem(v_ref.at[rows, head, cols], v_s.at[stage], bar)
    plgpu.copy_gmem_to_smem(m_ref.at[c, head], m_s.at[stage], bar)
    plgpu.copy_gmem_to_smem(p_ref.at[c, head], p_s.at[stage], bar)
    plgpu.copy_gmem_to_smem(w_ref.at[c, head], w_s.at[stage], bar)


def chain_values(s, a, e, k, v, m, *, s_bf, y, vp, ev, kmajor: bool) -> None:
    """The state chain's ``v' = M (v - a kS)`` for one chunk (its first two wgmmas), staged
    for the third, ``k^T (e v')``.

    ``s``: float32 ``[K, bv]`` state (WGMMA layout); ``a``, ``e``: the chunk's row vectors
    (ROWS layout); ``k``, ``v``, ``m``: its SMEM tiles. Writes, as B operands and fenced:
    ``s_bf`` = ``S`` (bf16, read by ``kS``), ``y`` = ``v - a kS``, ``vp`` = ``v'``, ``ev`` =
    ``e v'`` (may be ``y``: ``M Y`` has finished with it). Both state passes run this, so
    their operands and float32 order, hence their bits, are the same.
    """
    put = functools.partial(put_b_operand, kmajor=kmajor)
    view = functools.partial(b_operand_view, kmajor=kmajor)
    tile = tuple(v.shape)
    put(s_bf, s)
    plgpu.commit_smem()
    ks = matmul(k, view(s_bf), tile)
    vt = plgpu.load(v, layout=WG).astype(F32)
    put(y, vt - along_rows(a, tile) * ks)
    plgpu.commit_smem()
    vnew = matmul(m, view(y), tile)
    put(vp, vnew)
    put(ev, along_rows(e, tile) * vnew)
    plgpu.commit_smem()


def load_initial_state(pool_ref, init_ref, seq, slot, head, cols, st_s, st_bar) -> jax.Array:
    """The sequence's initial state block (float32 ``st_s``-shaped, WGMMA layout): the pool
    slot's columns ``cols`` of ``head`` when ``init_ref[seq]``, else zeros. Staged through
    ``st_s``."""

    @pl.when(init_ref[seq] != 0)
    def _():
        plgpu.copy_gmem_to_smem(pool_ref.at[slot, head, :, cols], st_s, st_bar)
        plgpu.barrier_wait(st_bar)

    @pl.when(init_ref[seq] == 0)
    def _():
        st_s[...] = plgpu.layout_cast(jnp.zeros(st_s.shape, F32), WG)

    plgpu.commit_smem()
    return plgpu.load(st_s, layout=WG, optimized=False)


def write_final_state(s: jax.Array, pool_ref, slot, head, cols, st_s) -> None:
    """``s`` into the pool slot's columns ``cols`` of ``head`` (through ``st_s``), waited for."""
    st_s[...] = s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(st_s, pool_ref.at[slot, head, :, cols])
    plgpu.wait_smem_to_gmem(0)


def store_chunk(full_src, rows_src, whole, o_ref, start, lo, hi, head, cols) -> None:
    """A staged chunk to ``o_ref[start + i, head, cols]``: ``full_src`` with one TMA (left in
    flight) when ``whole`` (all 64 rows are the segment's), else the valid rows ``lo..hi-1``
    of ``rows_src`` one TMA each (a partial chunk never writes a neighbour's rows), waited
    for."""

    @pl.when(whole)
    def _():
        plgpu.copy_smem_to_gmem(full_src, o_ref.at[pl.ds(start, CHUNK), head, cols])

    @pl.when(~whole)
    def _():
        store_valid_rows(rows_src, o_ref, start, lo, hi, head, cols)


def store_valid_rows(src, o_ref, start, lo, hi, head, cols) -> None:
    """Rows ``lo..hi-1`` of a staged chunk to ``o_ref[start + i, head, cols]``, one TMA each
    (a partial chunk never writes a neighbour's rows), waited for."""

    @pl.loop(lo, hi)
    def _(i):
        plgpu.copy_smem_to_gmem(src.at[pl.ds(i, 1)], o_ref.at[pl.ds(start + i, 1), head, cols])

    plgpu.wait_smem_to_gmem(0)


def _scratch(key_dim: int, bv: int, stages: int, out_dtype) -> tuple:
    """The kernel's scratch list (the one place its SMEM is decided; see ``smem_bytes``)."""
    out_dtype = jnp.dtype(out_dtype)
    tile = (CHUNK, bv)
    kmajor = bv < 64

    def b_operand(*shape):  # see ``state_pass``: narrow B operands are stored transposed
        *lead, rows, cols = shape
        return smem((*lead, cols, rows) if kmajor else shape, BF16)

    return (
        smem((stages, CHUNK, key_dim), BF16),  # q
        smem((stages, CHUNK, key_dim), BF16),  # k
        smem((stages, *tile), BF16),  # v block
        smem((stages, CHUNK, CHUNK), BF16),  # M
        smem((stages, CHUNK, CHUNK), BF16),  # P
        plgpu.SMEM((stages, VEC_ROWS, CHUNK), F32),
        b_operand(HANDOFF, key_dim, bv),  # published S (bf16)
        b_operand(HANDOFF, *tile),  # published v'
        b_operand(*tile),  # the state chain's Y = v - a kS, then e v'
        smem(tile, out_dtype),  # output staging of a full chunk
        # A TMA's SMEM address must be 128-byte aligned: rows of the row-by-row staging tile
        # are padded to 128 bytes (a 32-column bf16 row is only 64).
        plgpu.SMEM((CHUNK, max(bv, 128 // out_dtype.itemsize)), out_dtype),
        plgpu.SMEM((key_dim, bv), F32),  # initial and final state
        plgpu.Barrier(num_arrivals=6, num_barriers=stages),  # loaded: q, k, v, M, P, vectors
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # consumed: state + output
        plgpu.Barrier(num_arrivals=1, num_barriers=HANDOFF),  # published
        plgpu.Barrier(num_arrivals=1, num_barriers=HANDOFF),  # retired
        plgpu.Barrier(),  # the initial state's TMA
    )


def smem_bytes(key_dim: int, block_v: int, stages: int, out_dtype=BF16) -> int:
    """Dynamic SMEM of one CTA, counted as Mosaic GPU allocates it."""
    return scratch_smem_bytes(_scratch(key_dim, block_v, stages, out_dtype))


def unsupported_reason(
    key_dim: int,
    value_dim: int,
    *,
    block_v: int,
    stages: int,
    out_dtype=BF16,
) -> str | None:
    """One sentence on why the state pass cannot take this configuration, or None."""
    if block_v not in BLOCK_V or value_dim % block_v:
        return f"block_v={block_v} must be one of {BLOCK_V} and divide V={value_dim}"
    if stages not in STAGES:
        return f"stages={stages} must be one of {STAGES}"
    need = smem_bytes(key_dim, block_v, stages, out_dtype)
    if need > SMEM_LIMIT:
        return (
            f"block_v={block_v} with stages={stages} needs {need} bytes of SMEM per "
            f"CTA at K={key_dim}, over the {SMEM_LIMIT} of sm_90: use fewer stages or "
            f"block_v=32"
        )
    return None


# The interpreter runs each warpgroup as a thread of XLA's CPU pool; with fewer than this
# many threads the three warpgroups wait on each other's barriers forever.
INTERPRETER_THREADS = 4


def _check_interpreter_threads() -> None:
    """Refuse (instead of hanging) when XLA's CPU pool is too small for the warpgroups. The
    pool has ``NPROC`` threads (read when the CPU client starts), else one per CPU."""
    threads = int(os.environ.get("NPROC") or 0) or os.cpu_count() or 1
    if threads < INTERPRETER_THREADS:
        raise ValueError(
            f"_chunk_state.state_pass: the Mosaic GPU interpreter runs the pass's 3 warpgroups "
            f"as threads of XLA's CPU pool, which has {threads} here (NPROC, else the CPU "
            f"count); they need at least {INTERPRETER_THREADS} or they deadlock: set NPROC=16 "
            f"before JAX starts, or run the one-warpgroup pass (chunk_mgpu.Config(state_stages=0))"
        )


def state_pass(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    m: jax.Array,
    p: jax.Array | None,
    vecs: jax.Array,
    table: jax.Array,
    first: jax.Array,
    slots: jax.Array,
    has_init: jax.Array,
    pool,
    *,
    n_seqs: int,
    block_v: int,
    stages: int = 2,
    interpret: object = None,
) -> jax.Array:
    """The in-order walk over each sequence's chunks (``chunk_mgpu._state``'s contract).

    Args:
      q, k: bf16 ``[T, H, K]`` and v: bf16 ``[T, HV, V]``, T a multiple of 8 and >= 64 (as
        ``chunk_mgpu`` prepares them). m, p: bf16 ``[NC, HV, 64, 64]`` and vecs: float32
        ``[NC, HV, 4, 64]``, the intra kernel's outputs. table int32 ``[3, NC]`` and first
        int32 ``[N + 2]``: ``_mgpu_chunks.chunk_table``. slots int32 ``[N]``; has_init int32
        ``[N]`` (nonzero: start from the slot's state, else from zeros).
      pool: a mutable ref (``jax.new_ref``) of the float32 ``[S, HV, K, V]`` pool: each
        non-empty sequence reads its slot (when ``has_init``) and writes its final state
        there; nothing else is touched.
      n_seqs: N. block_v: value columns per CTA (32 or 64). stages: chunks in flight in the
        SMEM ring (2 or 3, SMEM permitting: ``unsupported_reason``). interpret: None for the
        GPU, True or ``plgpu.InterpretGPUParams`` for the Mosaic GPU CPU interpreter (it runs
        each warpgroup as a thread of XLA's CPU pool: set ``NPROC`` >= 4 before JAX starts).

    Returns:
      ``o [T, HV, V]`` in v's dtype; zeros at tokens of the padding segment ``t >= qsl[N]``.
    """
    tokens, kv_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    out_dtype = v.dtype
    reason = unsupported_reason(
        key_dim, value_dim, block_v=block_v, stages=stages, out_dtype=out_dtype
    )
    if reason is not None:
        raise ValueError(f"_chunk_state.state_pass: {reason}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    interpret = interpret or None
    if interpret is not None:
        _check_interpreter_threads()
    group = heads // kv_heads
    bv = block_v
    tile = (CHUNK, bv)
    state = (key_dim, bv)
    kmajor = bv < 64  # see put_b_operand
    view = functools.partial(b_operand_view, kmajor=kmajor)

    inputs = (q, k, v, m, p, vecs, table, first, slots, has_init, pool)

    def body(*refs):
        streamed = refs[:6]  # q, k, v, M, P, vectors: what load_chunk streams
        tab_ref, first_ref, slot_ref, init_ref, pool_ref, o_ref, *scratch = refs[6:]
        (
            q_s,
            k_s,
            v_s,
            m_s,
            p_s,
            w_s,
            s_pub,
            vp_pub,
            y_s,
            o_s,
            o_rows,
            st_s,
            loaded,
            consumed,
            published,
            retired,
            st_bar,
        ) = scratch
        tiles = (q_s, k_s, v_s, m_s, p_s, w_s)
        o_p = o_rows.at[:, pl.ds(0, bv)]
        wg = lax.axis_index("wg")
        h, hk, cols, c0, num, real, seq, slot = cta_segment(
            first_ref, slot_ref, n_seqs=n_seqs, group=group, block_v=bv
        )
        work = real & (num > 0)

        def store(src_full, src_rows, j):
            """Chunk ``j``'s staged output: one TMA when all 64 rows are the segment's, else
            its valid rows ``lo..hi-1`` one TMA each (never a neighbour's rows)."""
            start = pl.multiple_of(tab_ref[0, c0 + j], ALIGN)
            lo, hi = tab_ref[1, c0 + j], tab_ref[2, c0 + j]
            whole = (lo == 0) & (hi == CHUNK)
            store_chunk(src_full, src_rows, whole, o_ref, start, lo, hi, h, cols)

        @pl.when(wg == PRODUCER)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGS, action="decrease")

            @pl.when(work)
            def _():
                @pl.loop(0, num)
                def _(j):
                    stage = lax.rem(j, stages)
                    c = c0 + j

                    @pl.when(j >= stages)
                    def _():
                        plgpu.barrier_wait(consumed.at[stage])  # chunk j - stages is done

                    load_chunk(streamed, tiles, stage, loaded.at[stage], tab_ref, c, h, hk, cols)

        @pl.when(wg == STATE)
        def _state_chain():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")

            @pl.when(work)
            def _():
                s0 = load_initial_state(pool_ref, init_ref, seq, slot, h, cols, st_s, st_bar)

                def step(j, s):
                    stage = lax.rem(j, stages)
                    half = lax.rem(j, HANDOFF)
                    plgpu.barrier_wait(loaded.at[stage])
                    a = plgpu.load(w_s.at[stage, 0], layout=ROWS)
                    e = plgpu.load(w_s.at[stage, 2], layout=ROWS)
                    d = w_s[stage, 3, 0]

                    @pl.when(j >= HANDOFF)
                    def _():
                        plgpu.barrier_wait(retired.at[half])  # output done with j - 2

                    # Y's tile takes e v' too (k^T's B operand): two tiles, not three.
                    chain_values(
                        s, a, e, k_s.at[stage], v_s.at[stage], m_s.at[stage],
                        s_bf=s_pub.at[half], y=y_s, vp=vp_pub.at[half], ev=y_s, kmajor=kmajor,
                    )  # fmt: skip
                    plgpu.barrier_arrive(published.at[half])
                    upd = matmul(k_s.at[stage].T, view(y_s), state)

                    @pl.when(j + stages < num)
                    def _():
                        plgpu.barrier_arrive(consumed.at[stage])

                    return d * s + upd

                s = lax.fori_loop(0, num, step, s0)
                write_final_state(s, pool_ref, slot, h, cols, st_s)

        @pl.when(wg == OUTPUT)
        def _output():
            plgpu.set_max_registers(COMPUTE_REGS, action="increase")

            @pl.when(~real)
            def _padding():
                zeros = plgpu.layout_cast(jnp.zeros(tile, out_dtype), WG)
                o_s[...] = zeros
                o_p[...] = zeros
                plgpu.commit_smem()

                @pl.loop(0, num)
                def _(j):
                    store(o_s, o_p, j)

                plgpu.wait_smem_to_gmem(0)

            @pl.when(work)
            def _():
                @pl.loop(0, num)
                def _(j):
                    stage = lax.rem(j, stages)
                    half = lax.rem(j, HANDOFF)
                    lo, hi = tab_ref[1, c0 + j], tab_ref[2, c0 + j]
                    plgpu.barrier_wait(loaded.at[stage])
                    plgpu.barrier_wait(published.at[half])
                    b = plgpu.load(w_s.at[stage, 1], layout=ROWS)
                    qs = matmul(q_s.at[stage], view(s_pub.at[half]), tile)
                    pv = matmul(p_s.at[stage], view(vp_pub.at[half]), tile)

                    @pl.when(j + HANDOFF < num)
                    def _():
                        plgpu.barrier_arrive(retired.at[half])

                    out = (along_rows(b, tile) * qs + pv).astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's store
                    o_s[...] = out

                    @pl.when((lo != 0) | (hi != CHUNK))
                    def _():
                        o_p[...] = out

                    # The fence also orders this warpgroup's plain read of the stage (b)
                    # before the producer's next TMA into it (generic, then async proxy):
                    # without it the interpreter's race detector reports that pair.
                    plgpu.commit_smem()

                    @pl.when(j + stages < num)
                    def _():
                        plgpu.barrier_arrive(consumed.at[stage])

                    store(o_s, o_p, j)

                plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tokens, heads, value_dim), out_dtype),
        scratch_types=_scratch(key_dim, bv, stages, out_dtype),
        grid=(n_seqs + 1, heads, value_dim // bv),
        grid_names=("n", "h", "v"),
        num_threads=3,
        thread_name="wg",
        interpret=interpret,
        kernel_name="gdn_chunk_state_ws",
    )(*inputs)
