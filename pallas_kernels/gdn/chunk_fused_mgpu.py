"""Chunked Gated DeltaNet prefill for Hopper in Mosaic GPU: one warp-specialised kernel.

The math is ``chunk_mgpu.py``'s (its docstring): per value head and 64-token chunk, a
state-independent part (``M``, ``P`` and four row vectors, ``_chunk_intra.chunk_intra``) and
the in-order state update with ``S`` in registers (five wgmmas per chunk). ``chunk_mgpu``
runs them as two kernels, with ``M`` and ``P`` round-tripping through HBM and the intra
kernel latency-bound (benchmarks/prefill_notes.md). Here one CTA per (sequence, value head,
``block_v`` value columns) runs both, on separate warpgroups:

* warpgroup 0, the consumer: the state chain of ``chunk_mgpu``'s state kernel, reading each
  chunk's q, k, v, ``M``, ``P`` and row vectors from a shared SMEM slot;
* warpgroups 1..``producers``: TMA-load chunk ``j``'s q, k, v, g and beta into slot
  ``j % slots`` and compute its ``M``, ``P`` and row vectors there, while the consumer works
  on another slot. Producer ``j % producers`` owns chunk ``j``. With 3 slots the producer
  issues chunk ``j + 1``'s loads before it computes chunk ``j``.

Two barriers per slot hand it over: ``ready`` (producer -> consumer, after the producer's
SMEM writes are committed) and ``free`` (consumer -> producer, after the consumer's last
read of the slot). The TMA barrier of a slot is waited by its producer and the consumer.
Every waiting warpgroup waits for every phase of a barrier in order (a slot's next
``ready`` needs its ``free``, which needs its ``ready``, so no phase completes twice unseen),
and ``free`` is only signalled for a slot that a later chunk reuses.

``M`` and ``P`` never reach HBM, and the intra work overlaps the serial chain. The price:
each of the ``V / block_v`` CTAs of a head recomputes the chunk's ``M`` and ``P``.

Varlen layout, padding segment, precision and the pool contract are ``chunk_mgpu``'s (the
same chunk table): chunks start at 8-aligned tokens, a neighbour's rows are masked by
``g = beta = 0``, partial chunks store only their valid rows, tokens at ``t >= qsl[N]`` get
zeros, each non-empty sequence reads (when ``has_initial_state``) and writes only its pool
slot.

Measured on the H200 (benchmarks/prefill_notes.md, v2 run 1): correct, but 1.7-2.7x slower
than ``chunk_mgpu`` at every Qwen3-Next shape. The producer needs ~8.6 us per chunk in one
warpgroup (the same latency v1's intra kernel hides behind thousands of parallel CTAs), 4x
the ~2 us state step, so the fused chain runs at the producer's pace. Not the default.
"""

from __future__ import annotations

import dataclasses

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
    chunk_table,
    matmul,
    smem,
)
from pallas_kernels.gdn import chunk_mgpu
from pallas_kernels.gdn._chunk_intra import chunk_intra

__all__ = ["CHUNK", "Config", "chunk_gated_delta_rule", "unsupported_reason"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Static tuning.

    block_v: value columns per CTA (32 or 64; None: ``chunk_mgpu``'s rule, 32 while a grid
      of 64-column blocks leaves multiprocessors idle).
    producers: warpgroups computing the intra-chunk part (1 or 2; each takes every
      ``producers``-th chunk).
    slots: chunks resident in SMEM (2 or 3). With 2 the producer computes chunk ``j + 1``
      while the consumer works on ``j``; with 3 it also has chunk ``j + 2``'s TMA loads in
      flight meanwhile (one producer and ``block_v=32`` only: SMEM).
    """

    block_v: int | None = None
    producers: int = 1
    slots: int = 2


def _block_v(config: Config, n_seqs: int, heads: int, value_dim: int) -> int:
    resolved = chunk_mgpu._resolve(  # the same measured rule as the two-kernel version
        chunk_mgpu.Config(block_v=config.block_v), n_seqs, heads, value_dim
    )
    return resolved.block_v


def _fused(
    q,
    k,
    v,
    g_t,
    beta_t,
    table,
    first,
    pool_slots,
    has_init,
    pool,
    *,
    n_seqs,
    bv,
    cfg,
    scale,
    interpret,
):
    """The kernel; returns ``o [T, HV, V]`` and writes final states into the ``pool`` ref."""
    tokens, kv_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    group = heads // kv_heads
    out_dtype = v.dtype
    producers, n_slots = cfg.producers, cfg.slots
    ahead = n_slots - 2  # chunks whose loads the producer issues before computing the current
    sq = (CHUNK, CHUNK)
    tile = (CHUNK, bv)
    state = (key_dim, bv)
    # wgmma takes one swizzle for both operands; a 32-column B operand only has a 64-byte
    # swizzle in its natural [K, N] layout, so narrow blocks keep B operands transposed.
    kmajor = bv < 64

    def put(ref, x):
        if kmajor:
            ref.T[...] = x.astype(BF16)
        else:
            ref[...] = x.astype(BF16)

    def view(ref):
        return ref.T if kmajor else ref

    def b_operand(shape):
        return smem(shape[::-1] if kmajor else shape, BF16)

    vec = plgpu.SMEM((n_slots, CHUNK), F32)

    def body(
        q_ref,
        k_ref,
        v_ref,
        g_ref,
        b_ref,
        tab_ref,
        first_ref,
        pool_slot_ref,
        init_ref,
        pool_ref,
        o_ref,
        *scratch,
    ):
        (
            q_s,
            k_s,
            v_s,
            m_s,
            p_s,
            n_s,
            w_s,
            g_c,
            b_r,
            b_c,
            s_bf,
            y_s,
            vp_s,
            vc_s,
            o_s,
            o_rows,
            st_s,
            load_bar,
            ready,
            free,
            st_bar,
        ) = scratch
        o_p = o_rows.at[:, pl.ds(0, bv)]  # rows padded to 128 bytes (TMA SMEM alignment)
        wg = lax.axis_index("wg")
        n, h, iv = lax.axis_index("n"), lax.axis_index("h"), lax.axis_index("v")
        hk = lax.div(h, group)
        cols = pl.ds(iv * bv, bv)
        c0 = first_ref[n]
        num = first_ref[n + 1] - c0
        real = n < n_seqs
        seq = jnp.minimum(n, n_seqs - 1)  # the padding segment reads no slot
        pool_slot = pool_slot_ref[seq]

        def store_rows(src, start, lo, hi):
            """Valid rows ``lo..hi-1`` of a chunk, one TMA each (never a neighbour's rows)."""

            @pl.loop(lo, hi)
            def _(i):
                plgpu.copy_smem_to_gmem(src.at[pl.ds(i, 1)], o_ref.at[pl.ds(start + i, 1), h, cols])

            plgpu.wait_smem_to_gmem(0)

        @pl.when((wg == 0) & ~real)
        def _padding():
            zeros = plgpu.layout_cast(jnp.zeros(tile, out_dtype), WG)
            o_s[...] = zeros
            o_p[...] = zeros
            plgpu.commit_smem()

            @pl.loop(0, num)
            def _(j):
                start = pl.multiple_of(tab_ref[0, c0 + j], ALIGN)
                lo, hi = tab_ref[1, c0 + j], tab_ref[2, c0 + j]
                full = (lo == 0) & (hi == CHUNK)

                @pl.when(full)
                def _():
                    plgpu.copy_smem_to_gmem(o_s, o_ref.at[pl.ds(start, CHUNK), h, cols])

                @pl.when(~full)
                def _():
                    store_rows(o_p, start, lo, hi)

            plgpu.wait_smem_to_gmem(0)

        def load(j):
            """TMA of chunk ``j``'s q, k, v, g, beta into slot ``j % slots`` once it is free."""
            s = lax.rem(j, n_slots)
            rows = pl.ds(pl.multiple_of(tab_ref[0, c0 + j], ALIGN), CHUNK)

            @pl.when(j >= n_slots)
            def _():
                plgpu.barrier_wait(free.at[s])  # the consumer is done with chunk j - slots

            bar = load_bar.at[s]
            plgpu.copy_gmem_to_smem(q_ref.at[rows, hk], q_s.at[s], bar)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, hk], k_s.at[s], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[rows, h, cols], v_s.at[s], bar)
            # A vector is loaded once per layout it is read in (layout inference).
            for src, dst in ((g_ref, g_c), (b_ref, b_r), (b_ref, b_c)):
                plgpu.copy_gmem_to_smem(src.at[h, rows], dst.at[s], bar)

        @pl.when((wg > 0) & real & (num > 0))
        def _producer():
            p = wg - 1
            count = lax.div(num - p + producers - 1, producers)  # chunks p, p + producers, ...
            if ahead:
                load(p)

            @pl.loop(0, count)
            def _(i):
                j = p + i * producers
                s = lax.rem(j, n_slots)
                c = c0 + j
                lo, hi = tab_ref[1, c], tab_ref[2, c]
                if ahead:

                    @pl.when(j + 1 < num)
                    def _():
                        load(j + 1)

                else:
                    load(j)
                plgpu.barrier_wait(load_bar.at[s])
                chunk_intra(
                    q_s.at[s],
                    k_s.at[s],
                    g_c.at[s],
                    b_r.at[s],
                    b_c.at[s],
                    lo,
                    hi,
                    m_s.at[s],
                    p_s.at[s],
                    n_s.at[p],
                    w_s.at[s],
                    scale=scale,
                )
                plgpu.barrier_arrive(ready.at[s])

        @pl.when((wg == 0) & real & (num > 0))
        def _consumer():
            @pl.when(init_ref[seq] != 0)
            def _():
                plgpu.copy_gmem_to_smem(pool_ref.at[pool_slot, h, :, cols], st_s, st_bar)
                plgpu.barrier_wait(st_bar)

            @pl.when(init_ref[seq] == 0)
            def _():
                st_s[...] = plgpu.layout_cast(jnp.zeros(state, F32), WG)

            plgpu.commit_smem()
            s0 = plgpu.load(st_s, layout=WG, optimized=False)

            def step(j, s):
                stage = lax.rem(j, n_slots)
                c = c0 + j
                start = pl.multiple_of(tab_ref[0, c], ALIGN)
                lo, hi = tab_ref[1, c], tab_ref[2, c]
                plgpu.barrier_wait(ready.at[stage])
                # The slot's TMA loads completed before `ready`; waiting on their barrier too
                # (it returns at once) orders them for this warpgroup directly instead of
                # through the producer's arrival.
                plgpu.barrier_wait(load_bar.at[stage])
                a = plgpu.load(w_s.at[stage, 0], layout=ROWS)
                b = plgpu.load(w_s.at[stage, 1], layout=ROWS)
                e = plgpu.load(w_s.at[stage, 2], layout=ROWS)
                d = w_s[stage, 3, 0]
                put(s_bf, s)
                plgpu.commit_smem()
                ks = matmul(k_s.at[stage], view(s_bf), tile)
                vt = plgpu.load(v_s.at[stage], layout=WG).astype(F32)
                put(y_s, vt - along_rows(a, tile) * ks)
                plgpu.commit_smem()
                vnew = matmul(m_s.at[stage], view(y_s), tile)
                put(vp_s, vnew)
                put(vc_s, along_rows(e, tile) * vnew)
                plgpu.commit_smem()
                upd = matmul(k_s.at[stage].T, view(vc_s), state)
                qs = matmul(q_s.at[stage], view(s_bf), tile)
                pv = matmul(p_s.at[stage], view(vp_s), tile)

                # Every read of the slot (wgmmas waited, loads in registers) is done. Only a
                # slot that a later chunk reuses is handed back: every phase is then waited.
                @pl.when(j + n_slots < num)
                def _():
                    plgpu.barrier_arrive(free.at[stage])

                out = (along_rows(b, tile) * qs + pv).astype(out_dtype)
                full = (lo == 0) & (hi == CHUNK)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's store
                o_s[...] = out

                @pl.when(~full)
                def _():
                    o_p[...] = out

                plgpu.commit_smem()

                @pl.when(full)
                def _():
                    plgpu.copy_smem_to_gmem(o_s, o_ref.at[pl.ds(start, CHUNK), h, cols])

                @pl.when(~full)
                def _():
                    store_rows(o_p, start, lo, hi)

                return d * s + upd

            s = lax.fori_loop(0, num, step, s0)
            st_s[...] = s
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s, pool_ref.at[pool_slot, h, :, cols])
            plgpu.wait_smem_to_gmem(0)

    scratch = (
        smem((n_slots, CHUNK, key_dim), BF16),  # q
        smem((n_slots, CHUNK, key_dim), BF16),  # k
        smem((n_slots, *tile), BF16),  # v
        smem((n_slots, *sq), BF16),  # M
        smem((n_slots, *sq), BF16),  # P
        smem((producers, *sq), BF16),  # each producer's inverse scratch
        plgpu.SMEM((n_slots, 4, CHUNK), F32),  # row vectors
        vec,
        vec,
        vec,
        b_operand(state),
        b_operand(tile),
        b_operand(tile),
        b_operand(tile),
        smem(tile, out_dtype),
        plgpu.SMEM((CHUNK, max(bv, 128 // jnp.dtype(out_dtype).itemsize)), out_dtype),
        plgpu.SMEM(state, F32),
        plgpu.Barrier(num_arrivals=6, num_barriers=n_slots),
        plgpu.Barrier(num_arrivals=1, num_barriers=n_slots),
        plgpu.Barrier(num_arrivals=1, num_barriers=n_slots),
        plgpu.Barrier(),
    )
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tokens, heads, value_dim), out_dtype),
        scratch_types=scratch,
        grid=(n_seqs + 1, heads, value_dim // bv),
        grid_names=("n", "h", "v"),
        num_threads=1 + producers,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),  # ex2/rsqrt.approx
        interpret=interpret,
        kernel_name="gdn_chunk_fused",
    )(q, k, v, g_t, beta_t, table, first, pool_slots, has_init, pool)


def unsupported_reason(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: object = False,
    config: Config = Config(),
) -> str | None:
    """One sentence on why this kernel cannot take the call, or None when it can."""
    if config.producers not in (1, 2):
        return f"producers={config.producers} must be 1 or 2"
    if config.slots not in (2, 3):
        return f"slots={config.slots} must be 2 or 3"
    if config.slots == 3 and (config.producers != 1 or config.block_v != 32):
        return (
            f"slots=3 fits in SMEM only with producers=1 and block_v=32, got "
            f"producers={config.producers}, block_v={config.block_v}"
        )
    return chunk_mgpu.unsupported_reason(
        q,
        k,
        v,
        g,
        beta,
        ssm_pool,
        qsl,
        state_indices,
        has_initial_state,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        interpret=interpret,
        config=chunk_mgpu.Config(block_v=config.block_v),
    )


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: object = False,
    config: Config = Config(),
) -> tuple[jax.Array, jax.Array]:
    """Chunked Gated DeltaNet over packed sequences (the fused Mosaic GPU kernel).

    Arguments and results are ``chunk_mgpu.chunk_gated_delta_rule``'s: q, k ``[T, H, K]``;
    v ``[T, HV, V]``; g, beta float32 ``[T, HV]``; ssm_pool float32 ``[S, HV, K, V]``; qsl
    ``[N+1]``; state_indices ``[N]``; has_initial_state ``[N]``. Returns ``o [T, HV, V]``
    (zeros at ``t >= qsl[N]``) and the pool with each non-empty sequence's final state in its
    slot (nothing else changes). Donate the pool under ``jit`` for an in-place update.
    """
    reason = unsupported_reason(
        q,
        k,
        v,
        g,
        beta,
        ssm_pool,
        qsl,
        state_indices,
        has_initial_state,
        use_qk_l2norm=use_qk_l2norm,
        config=config,
    )
    if reason is not None:
        raise ValueError(f"chunk_fused_mgpu.chunk_gated_delta_rule: {reason}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    interpret = interpret or None
    tokens, _, key_dim = q.shape
    n_seqs = qsl.shape[0] - 1
    bv = _block_v(config, n_seqs, v.shape[1], v.shape[2])
    scale = key_dim**-0.5 if scale is None else float(scale)
    out_dtype = v.dtype
    # Tokens padded to the 8-row tiling and at least one chunk (chunk_mgpu's layout).
    padded = max(CHUNK, -(-tokens // ALIGN) * ALIGN)
    pad = padded - tokens

    def prepare(x):
        return jnp.pad(x.astype(BF16), [(0, pad), (0, 0), (0, 0)])

    q, k, v = prepare(q), prepare(k), prepare(v)
    g_t = jnp.pad(g.astype(F32).T, [(0, 0), (0, pad)])
    beta_t = jnp.pad(beta.astype(F32).T, [(0, 0), (0, pad)])
    num_chunks = -(-padded // CHUNK) + 2 * (n_seqs + 1)
    table, first = chunk_table(qsl, padded, num_chunks)
    pool = jax.new_ref(ssm_pool)
    o = _fused(
        q,
        k,
        v,
        g_t,
        beta_t,
        table,
        first,
        state_indices.astype(jnp.int32),
        has_initial_state.astype(jnp.int32),
        pool,
        n_seqs=n_seqs,
        bv=bv,
        cfg=config,
        scale=scale,
        interpret=interpret,
    )
    return o[:tokens].astype(out_dtype), jax.freeze(pool)
