"""The state pass of the chunked GDN prefill, warp-specialised: a producer, and one or two
pairs of a state chain and an output warpgroup per CTA.

A drop-in for ``chunk_mgpu._state`` (kernel 2; same inputs, outputs, grid and varlen rules,
math in ``chunk_mgpu.py``'s docstring). There, one warpgroup per CTA runs five dependent
wgmmas per 64-token chunk (``kS``, ``qS``, ``M Y``, ``k^T v'``, ``P v'``), each behind SMEM
stores and ``commit_smem`` fences, with the next chunk's tiles prefetched one chunk ahead; at
one CTA per SM that leaves one warp per scheduler and the SM idle on latency. Here each CTA
(one per sequence segment, value head and ``block_v`` value columns) splits that work:

* warpgroup 0, the producer (few registers): TMA-streams each chunk's q and k tiles, the v
  columns, ``M``, ``P`` and the row vectors into a ring of ``stages`` SMEM stages.
  ``loaded`` (the TMA barrier of a stage) hands a stage to every consumer; ``consumed`` (one
  arrival per consumer) hands it back once all are done with it.
* warpgroups 1..``chains``, the state chains: each carries ``block_v / chains`` columns of
  ``S`` (float32 registers) and per chunk does only ``kS``, ``v' = M (v - a kS)`` and
  ``S <- d S + k^T (e v')``: three wgmmas, the serial part. It publishes its ``S`` columns
  (bf16, the same tile its own ``kS`` reads) and ``v'`` (bf16) through a 2-slot hand-off
  before its third wgmma, and writes its final state columns to the pool. Two chains of 32
  columns share one stage ring: the same q, k, M, P bytes feed 64 columns, and the SM has
  two independent chains in flight instead of one twice as wide (a 64-column chain is
  ~1.5x slower per chunk than a 32-column one, benchmarks/prefill_notes.md).
* one output warpgroup per chain: ``o = b (q S) + P v'`` for the chain's columns from its
  published tiles, and the store (a full chunk with one TMA, a partial chunk row by row),
  overlapping the next chunk's chain. It also writes the zeros of the padding segment.
  ``published`` (chain -> output) and ``retired`` (output -> chain), one pair per chain,
  hand a slot over; with two slots the output may lag a chunk. (One output warpgroup
  serving two chains ran at 1.8 us per chunk on the H200, one chain at 1.1.)

Every waiting warpgroup waits for every phase of each barrier in order (Mosaic GPU tracks a
barrier's parity per thread): a phase is only signalled when a later chunk waits for it. A
warpgroup hands a stage back only after a ``commit_smem`` (proxy fence) that follows its last
plain read of it, since the producer's next write there is a TMA (the async proxy).

Operands and the order of float32 operations are ``_state``'s, so both give the same bits
(with one chain or two).

Mosaic GPU constraints kept (benchmarks/prefill_notes.md): one wgmma per ``run_scoped``
accumulator (``matmul``); no reductions over axis 0 of a WGMMA tile in the concurrent
warpgroups (they share one SMEM reduction scratch and race; there is no reduction at all);
``setmaxnreg`` executed unconditionally by each warpgroup (an ``increase`` waits for the
registers the producer's ``decrease`` frees, also in CTAs with nothing to do).

SMEM per CTA (``smem_bytes``, equal to Mosaic GPU's count; limit 227 KB), K=128:
``block_v=32``: 162 KB with 2 stages, 215 KB with 3; ``block_v=64``: 218 KB with 2 stages
(one chain or two), 3 do not fit (275 KB). K=64: 114 / 151 KB and 154 / 195 KB.

Status: one chain ran on the H200 (benchmarks/prefill_notes.md, session 3 run 4: same errors
as ``_state``, untouched slots bit-identical). Two chains: checked by the interpreter (the
bits of one) and the ``cuda`` lowering at the production dims; not yet run on a GPU.
"""

from __future__ import annotations

import functools
import math

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
    WG,
    along_rows,
    matmul,
    smem,
)
from pallas_kernels.gdn._chunk_intra import VEC_ROWS

__all__ = ["SMEM_LIMIT", "smem_bytes", "state_pass", "unsupported_reason"]

SMEM_LIMIT = 227 * 1024  # dynamic SMEM per CTA on sm_90 (what Mosaic GPU checks at lowering)
CHAIN_V = (32, 64)  # value columns of S one state chain carries
CHAINS = (1, 2)
STAGES = (2, 3)
HANDOFF = 2  # slots of published S / v' between a state chain and the output warpgroup
PRODUCER = 0  # then the chains, then the output warpgroup
# Registers per thread after rebalancing (setmaxnreg: multiples of 8, at most 512 summed over
# the warpgroups; jax's own warp-specialised attention gives its producer the same 40).
PRODUCER_REGS = 40
_SMEM_ALIGN = 1024  # Mosaic GPU aligns each scratch buffer to this
_BARRIER_BYTES = 8


def compute_registers(chains: int) -> int:
    """Registers per thread of each chain and output warpgroup: what the producer leaves,
    shared evenly (232 with one chain, 112 with two)."""
    return (512 - PRODUCER_REGS) // (2 * chains) // 8 * 8


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


def store_valid_rows(src, o_ref, start, lo, hi, head, cols) -> None:
    """Rows ``lo..hi-1`` of a staged chunk to ``o_ref[start + i, head, cols]``, one TMA each
    (a partial chunk never writes a neighbour's rows), waited for."""

    @pl.loop(lo, hi)
    def _(i):
        plgpu.copy_smem_to_gmem(src.at[pl.ds(i, 1)], o_ref.at[pl.ds(start + i, 1), head, cols])

    plgpu.wait_smem_to_gmem(0)


def _scratch(key_dim: int, block_v: int, stages: int, out_dtype, chains: int = 1) -> tuple:
    """The kernel's scratch list (the one place its SMEM is decided; see ``smem_bytes``).
    Per-chain buffers have a leading ``chains`` axis; the staged q, k, M, P and vectors are
    shared."""
    out_dtype = jnp.dtype(out_dtype)
    cv = block_v // chains
    tile = (CHUNK, cv)
    kmajor = cv < 64

    def b_operand(*shape):  # see ``state_pass``: narrow B operands are stored transposed
        *lead, rows, cols = shape
        return smem((*lead, cols, rows) if kmajor else shape, BF16)

    return (
        smem((stages, CHUNK, key_dim), BF16),  # q
        smem((stages, CHUNK, key_dim), BF16),  # k
        smem((stages, chains, *tile), BF16),  # v columns of each chain
        smem((stages, CHUNK, CHUNK), BF16),  # M
        smem((stages, CHUNK, CHUNK), BF16),  # P
        plgpu.SMEM((stages, VEC_ROWS, CHUNK), F32),
        b_operand(chains, HANDOFF, key_dim, cv),  # published S (bf16)
        b_operand(chains, HANDOFF, *tile),  # published v'
        b_operand(chains, *tile),  # each chain's Y = v - a kS, then e v'
        smem((chains, *tile), out_dtype),  # output staging of a full chunk
        # A TMA's SMEM address must be 128-byte aligned: rows of the row-by-row staging tile
        # are padded to 128 bytes (a 32-column bf16 row is only 64).
        plgpu.SMEM((chains, CHUNK, max(cv, 128 // out_dtype.itemsize)), out_dtype),
        plgpu.SMEM((chains, key_dim, cv), F32),  # initial and final state
        # loaded: the TMAs of a stage (q, k, M, P, the vectors and each chain's v)
        plgpu.Barrier(num_arrivals=5 + chains, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2 * chains, num_barriers=stages),  # consumed
        plgpu.Barrier(num_arrivals=1, num_barriers=chains * HANDOFF),  # published
        plgpu.Barrier(num_arrivals=1, num_barriers=chains * HANDOFF),  # retired
        plgpu.Barrier(num_barriers=chains),  # the initial state's TMA
    )


def smem_bytes(key_dim: int, block_v: int, stages: int, out_dtype=BF16, *, chains: int = 1) -> int:
    """Dynamic SMEM of one CTA, counted as Mosaic GPU allocates it (each buffer aligned to
    1 KB, then 8 bytes per barrier)."""
    total = barriers = 0
    for ref in _scratch(key_dim, block_v, stages, out_dtype, chains):
        if isinstance(ref, plgpu.Barrier):
            barriers += math.prod(ref.num_barriers)
        else:
            size = math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
            total += -(-size // _SMEM_ALIGN) * _SMEM_ALIGN
    return total + _BARRIER_BYTES * barriers


def unsupported_reason(
    key_dim: int,
    value_dim: int,
    *,
    block_v: int,
    stages: int,
    out_dtype=BF16,
    chains: int = 1,
) -> str | None:
    """One sentence on why the state pass cannot take this configuration, or None."""
    if chains not in CHAINS:
        return f"chains={chains} must be one of {CHAINS}"
    if block_v % chains or block_v // chains not in CHAIN_V or value_dim % block_v:
        return (
            f"block_v={block_v} must divide V={value_dim} and give each of the {chains} "
            f"state chains {' or '.join(map(str, CHAIN_V))} columns"
        )
    if stages not in STAGES:
        return f"stages={stages} must be one of {STAGES}"
    need = smem_bytes(key_dim, block_v, stages, out_dtype, chains=chains)
    if need > SMEM_LIMIT:
        return (
            f"block_v={block_v} with stages={stages} and {chains} chain(s) needs {need} bytes "
            f"of SMEM per CTA at K={key_dim}, over the {SMEM_LIMIT} of sm_90: use fewer "
            f"stages or block_v=32"
        )
    return None


def state_pass(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    m: jax.Array,
    p: jax.Array,
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
    chains: int = 1,
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
      n_seqs: N. block_v: value columns per CTA (32 or 64 per chain). stages: chunks in
        flight in the SMEM ring (2 or 3, SMEM permitting: ``unsupported_reason``). chains:
        state-chain warpgroups per CTA (1 or 2), each carrying ``block_v / chains`` columns.
        interpret: None for the GPU, True or ``plgpu.InterpretGPUParams`` for the Mosaic GPU
        CPU interpreter (it runs each warpgroup as a thread of XLA's CPU pool: set ``NPROC``
        >= ``chains + 3`` before JAX starts).

    Returns:
      ``o [T, HV, V]`` in v's dtype; zeros at tokens of the padding segment ``t >= qsl[N]``.
    """
    tokens, kv_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    out_dtype = v.dtype
    reason = unsupported_reason(
        key_dim, value_dim, block_v=block_v, stages=stages, out_dtype=out_dtype, chains=chains
    )
    if reason is not None:
        raise ValueError(f"_chunk_state.state_pass: {reason}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    interpret = interpret or None
    group = heads // kv_heads
    bv = block_v
    cv = bv // chains  # columns of one chain
    tile = (CHUNK, cv)
    state = (key_dim, cv)
    kmajor = cv < 64  # see put_b_operand
    put = functools.partial(put_b_operand, kmajor=kmajor)
    view = functools.partial(b_operand_view, kmajor=kmajor)
    regs = compute_registers(chains)

    inputs = (q, k, v, m, p, vecs, table, first, slots, has_init, pool)

    def body(*refs):
        (
            q_ref,
            k_ref,
            v_ref,
            m_ref,
            p_ref,
            w_ref,
            tab_ref,
            first_ref,
            slot_ref,
            init_ref,
            pool_ref,
        ) = refs[: len(inputs)]
        o_ref, *scratch = refs[len(inputs) :]
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
        wg = lax.axis_index("wg")
        n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
        hk = lax.div(h, group)
        chain_cols = [pl.ds(iv * bv + c * cv, cv) for c in range(chains)]
        c0 = first_ref[n]
        num = first_ref[n + 1] - c0
        real = n < n_seqs
        seq = jnp.minimum(n, n_seqs - 1)  # the padding segment reads no slot
        slot = slot_ref[seq]
        work = real & (num > 0)

        def store(src_full, src_rows, j, cols):
            """Chunk ``j``'s staged output columns ``cols``: one TMA when all 64 rows are the
            segment's, else its valid rows ``lo..hi-1`` one TMA each (never a neighbour's)."""
            start = pl.multiple_of(tab_ref[0, c0 + j], ALIGN)
            lo, hi = tab_ref[1, c0 + j], tab_ref[2, c0 + j]
            whole = (lo == 0) & (hi == CHUNK)

            @pl.when(whole)
            def _():
                plgpu.copy_smem_to_gmem(src_full, o_ref.at[pl.ds(start, CHUNK), h, cols])

            @pl.when(~whole)
            def _():
                store_valid_rows(src_rows, o_ref, start, lo, hi, h, cols)

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

                    rows = pl.ds(pl.multiple_of(tab_ref[0, c], ALIGN), CHUNK)
                    bar = loaded.at[stage]
                    plgpu.copy_gmem_to_smem(q_ref.at[rows, hk], q_s.at[stage], bar)
                    plgpu.copy_gmem_to_smem(k_ref.at[rows, hk], k_s.at[stage], bar)
                    for chain, cols in enumerate(chain_cols):
                        plgpu.copy_gmem_to_smem(v_ref.at[rows, h, cols], v_s.at[stage, chain], bar)
                    plgpu.copy_gmem_to_smem(m_ref.at[c, h], m_s.at[stage], bar)
                    plgpu.copy_gmem_to_smem(p_ref.at[c, h], p_s.at[stage], bar)
                    plgpu.copy_gmem_to_smem(w_ref.at[c, h], w_s.at[stage], bar)

        def state_chain(chain: int):
            cols = chain_cols[chain]
            my_st = st_s.at[chain]

            @pl.when(work)
            def _():
                s0 = load_initial_state(
                    pool_ref, init_ref, seq, slot, h, cols, my_st, st_bar.at[chain]
                )

                def step(j, s):
                    stage = lax.rem(j, stages)
                    half = lax.rem(j, HANDOFF)
                    slot_bar = chain * HANDOFF + half
                    plgpu.barrier_wait(loaded.at[stage])
                    a = plgpu.load(w_s.at[stage, 0], layout=ROWS)
                    e = plgpu.load(w_s.at[stage, 2], layout=ROWS)
                    d = w_s[stage, 3, 0]

                    @pl.when(j >= HANDOFF)
                    def _():
                        plgpu.barrier_wait(retired.at[slot_bar])  # output done with j - 2

                    s_bf = s_pub.at[chain, half]
                    put(s_bf, s)
                    plgpu.commit_smem()
                    ks = matmul(k_s.at[stage], view(s_bf), tile)
                    vt = plgpu.load(v_s.at[stage, chain], layout=WG).astype(F32)
                    put(y_s.at[chain], vt - along_rows(a, tile) * ks)
                    plgpu.commit_smem()
                    vnew = matmul(m_s.at[stage], view(y_s.at[chain]), tile)
                    put(vp_pub.at[chain, half], vnew)
                    # Y was read by the finished M Y: its tile takes e v' (k^T's B operand).
                    put(y_s.at[chain], along_rows(e, tile) * vnew)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(published.at[slot_bar])
                    upd = matmul(k_s.at[stage].T, view(y_s.at[chain]), state)

                    @pl.when(j + stages < num)
                    def _():
                        plgpu.barrier_arrive(consumed.at[stage])

                    return d * s + upd

                s = lax.fori_loop(0, num, step, s0)
                write_final_state(s, pool_ref, slot, h, cols, my_st)

        def output(chain: int):
            cols = chain_cols[chain]
            my_o, my_rows = o_s.at[chain], o_rows.at[chain, :, pl.ds(0, cv)]

            @pl.when(~real)
            def _padding():
                zeros = plgpu.layout_cast(jnp.zeros(tile, out_dtype), WG)
                my_o[...] = zeros
                my_rows[...] = zeros
                plgpu.commit_smem()

                @pl.loop(0, num)
                def _(j):
                    store(my_o, my_rows, j, cols)

                plgpu.wait_smem_to_gmem(0)

            @pl.when(work)
            def _():
                @pl.loop(0, num)
                def _(j):
                    stage = lax.rem(j, stages)
                    half = lax.rem(j, HANDOFF)
                    slot_bar = chain * HANDOFF + half
                    lo, hi = tab_ref[1, c0 + j], tab_ref[2, c0 + j]
                    plgpu.barrier_wait(loaded.at[stage])
                    plgpu.barrier_wait(published.at[slot_bar])
                    b = plgpu.load(w_s.at[stage, 1], layout=ROWS)
                    qs = matmul(q_s.at[stage], view(s_pub.at[chain, half]), tile)
                    pv = matmul(p_s.at[stage], view(vp_pub.at[chain, half]), tile)

                    @pl.when(j + HANDOFF < num)
                    def _():
                        plgpu.barrier_arrive(retired.at[slot_bar])

                    out = (along_rows(b, tile) * qs + pv).astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's store
                    my_o[...] = out

                    @pl.when((lo != 0) | (hi != CHUNK))
                    def _():
                        my_rows[...] = out

                    # The fence also orders this warpgroup's plain read of the stage (b)
                    # before the producer's next TMA into it (generic, then async proxy):
                    # without it the interpreter's race detector reports that pair.
                    plgpu.commit_smem()

                    @pl.when(j + stages < num)
                    def _():
                        plgpu.barrier_arrive(consumed.at[stage])

                    store(my_o, my_rows, j, cols)

                plgpu.wait_smem_to_gmem(0)

        # Warpgroups: the producer, the chains, then one output warpgroup per chain.
        for chain in range(chains):

            @pl.when(wg == PRODUCER + 1 + chain)
            def _(chain=chain):
                plgpu.set_max_registers(regs, action="increase")
                state_chain(chain)

            @pl.when(wg == PRODUCER + 1 + chains + chain)
            def _(chain=chain):
                plgpu.set_max_registers(regs, action="increase")
                output(chain)

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tokens, heads, value_dim), out_dtype),
        scratch_types=_scratch(key_dim, bv, stages, out_dtype, chains),
        grid=(n_seqs + 1, heads, value_dim // bv),
        grid_names=("n", "h", "v"),
        num_threads=1 + 2 * chains,
        thread_name="wg",
        interpret=interpret,
        kernel_name="gdn_chunk_state_ws",
    )(*inputs)
