"""Chunked Gated DeltaNet prefill for Hopper in Mosaic GPU: two kernels over packed varlen tokens.

Math, per value head and 64-token chunk (state ``S`` ``[K, V]`` float32, ``gc`` the chunk-local
cumulative log decay, ``k``/``q`` l2-normalised):

    A = strictly_lower(beta_i (k_i . k_j) exp(gc_i - gc_j)),   T = (I + A)^-1
    M = T diag(beta),   v' = M (v - diag(exp(gc)) k S)          (the WY/UT form: u - w S)
    o = scale diag(exp(gc)) q S + tril(scale (q k^T) exp(gc_i - gc_j)) v'
    S <- exp(gc_last) S + k^T diag(exp(gc_last - gc)) v'

Kernel 1 (``_intra``, one CTA per (chunk, value head), fully parallel; the math is in
``_chunk_intra.py``; the chunk-local cumulative decays come from XLA, ``chunk_gates``) forms
everything that does not depend on the state: ``M`` and ``P = tril(...)`` as bf16 ``[64, 64]``
tiles and four float32 row vectors (``rk exp(gc)``, ``scale rq exp(gc)``,
``rk exp(gc_last - gc)``, ``exp(gc_last)``; ``rq``/``rk`` the inverse l2 norms, so q and k are
never rewritten). ``T`` is built by blocks: the 16x16 diagonal blocks by float32 substitution
(on the GPU; the interpreter doubles from 2x2 blocks), then each level merges diagonal blocks
of size ``b`` into ``2b`` with ``T <- T - T (L T)`` (``L`` the strictly-lower off-diagonal
``b x b`` blocks of ``A``), two bf16 wgmmas per level. Block doubling is exact forward
substitution at block level; the Neumann product ``(I - A)(I + A^2)...`` is not used because
its terms grow like binomials for correlated keys and cancel catastrophically.

Kernel 2, the state pass (one CTA per (sequence, value head, ``block_v`` value columns)),
walks the sequence's chunks in order with ``S`` in registers: five wgmmas per chunk (``kS``,
``qS``, ``M Y``, ``k^T v'``, ``P v'``). On the GPU it is warp-specialised by default
(``_chunk_state.py``: a TMA warpgroup, the three-wgmma state chain, the output warpgroup);
``_state`` is the one-warpgroup form (the interpreter's default). The two run the same
helpers, in ``_chunk_state.py``, for what they share (a CTA's segment, a chunk's loads, the
chain's ``v'``, the state in and out, a chunk's store). Splitting the value columns is what
gives a single long sequence more than ``HV`` CTAs. ``P`` stays in kernel 1: formed by the
state pass's output warpgroup instead, it made that warpgroup the pass's limit (slower on
every shape, H200; benchmarks/prefill_notes.md).

Chunks start at 8-aligned token positions: a TMA into a swizzled SMEM tile needs its first
row to be a multiple of the 8-row tiling (layout inference refuses an unproven start). A
sequence starting at ``a`` therefore owns chunks ``floor8(a) + 64 j``; rows of a chunk that
belong to a neighbour (``< lo`` or ``>= hi``) get ``g = beta = 0``, which makes their ``v'``
rows exactly zero, so they change neither the state nor the valid rows. A chunk that would
run past the (8-padded) token axis is shifted back to end on it instead, which only adds
leading masked rows. Full chunks are stored with one TMA; chunks with masked rows store
their valid rows one by one (a TMA per row from an unswizzled tile), so a sequence never
writes a neighbour's outputs. Tokens at ``t >= qsl[N]`` form an extra segment whose chunks
store zeros.

Precision: q, k, v, ``M`` and ``P`` enter the tensor cores as bf16 (float32 inputs are
rounded to bf16 first); accumulation, the decays, the norms and the state are float32.

Speed: benchmarks/RESULTS.md; what limits it: benchmarks/prefill_notes.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NUM_SMS
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
    token_axis,
)
from pallas_kernels.gdn import _chunk_state
from pallas_kernels.gdn._chunk_intra import SOLVE_SHAPE, VEC_ROWS, chunk_gates, chunk_intra

__all__ = ["CHUNK", "Config", "chunk_gated_delta_rule", "unsupported_reason"]

HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class Config:
    """Static tuning of the state pass.

    block_v: value columns per CTA of the state pass (32 or 64; None picks per call, see
      ``_resolve``). Fewer columns give more CTAs (a single sequence gets
      ``HV * V / block_v`` of them) at the price of re-reading q, k, M and P once per block.
    kmajor: store the state pass's B operands transposed (None: only when block_v < 64,
      where it is required).
    substitution: solve the 16x16 diagonal blocks of ``T`` by float32 substitution before
      the two last doubling levels (GPU only: the interpreter always doubles from 2x2 blocks).
    state_stages: 0 runs the state pass in one warpgroup (``_state``); 2 or 3 run the
      warp-specialised state pass (``_chunk_state.py``) with that many input stages; None
      picks (``_resolve``).
    """

    block_v: int | None = None
    kmajor: bool | None = None
    substitution: bool = True
    state_stages: int | None = None


@functools.cache
def _resolve(
    config: Config, n_seqs: int, heads: int, value_dim: int, *, interpret: object = None
) -> Config:
    """``config`` with ``block_v`` and ``state_stages`` chosen where they are None.

    32 columns while a grid of 64-column blocks would leave SMs idle, 64 once it fills them;
    the warp-specialised state pass with 3 stages at 32 columns and 2 at 64 (3 do not fit in
    SMEM); the measurements behind both choices are in benchmarks/prefill_notes.md. The
    interpreter takes the one-warpgroup pass unless asked: its warpgroups are host threads of
    the XLA CPU client's pool, which needs at least
    ``_chunk_state.INTERPRETER_THREADS`` (env ``NPROC``, read when the client starts; the pass
    refuses a smaller pool) or the warpgroups deadlock.
    """
    if config.block_v is None:
        blocks_of_64 = n_seqs * heads * (value_dim // 64)
        config = dataclasses.replace(config, block_v=32 if blocks_of_64 < NUM_SMS else 64)
    if config.state_stages is None:
        stages = 0 if interpret else (3 if config.block_v == 32 else 2)
        config = dataclasses.replace(config, state_stages=stages)
    return config


def _intra(q, k, g_t, beta_t, table, first, *, n_seqs: int, scale: float, solve=False, interpret):
    """Kernel 1: per (chunk, value head) ``M``, ``P`` (bf16 ``[NC, HV, 64, 64]``) and the
    row vectors (float32 ``[NC, HV, 4, 64]``); see the module docstring. ``solve``: the
    diagonal blocks of ``T`` by substitution (GPU only, ``Config.substitution``)."""
    _, kv_heads, key_dim = q.shape
    heads = g_t.shape[0]
    group = heads // kv_heads
    num_chunks = table.shape[1]
    shape = (CHUNK, CHUNK)
    vec = plgpu.SMEM((CHUNK,), F32)
    gc, beta_c = chunk_gates(g_t, beta_t, table)

    def body(q_ref, k_ref, g_ref, b_ref, tab_ref, first_ref, m_ref, p_ref, v_ref, *scratch):
        q_s, k_s, g_r, g_c, b_r, b_c, m_s, p_s, vec_s, bar, *solve_s = scratch
        c, h = lax.axis_index("c"), lax.axis_index("h")
        hk = lax.div(h, group)
        start = pl.multiple_of(tab_ref[0, c], ALIGN)
        lo, hi = tab_ref[1, c], tab_ref[2, c]

        @pl.when((c < first_ref[n_seqs]) & (hi > lo))
        def _():
            rows = pl.ds(start, CHUNK)
            plgpu.copy_gmem_to_smem(q_ref.at[rows, hk], q_s, bar)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, hk], k_s, bar)
            # A vector is loaded once per layout it is read in (layout inference).
            window = pl.ds(c * CHUNK, CHUNK)
            for src, dst in ((g_ref, g_r), (g_ref, g_c), (b_ref, b_r), (b_ref, b_c)):
                plgpu.copy_gmem_to_smem(src.at[h, window], dst, bar)
            plgpu.barrier_wait(bar)
            chunk_intra(
                q_s, k_s, g_r, g_c, b_r, b_c, m_s, p_s, vec_s, scale=scale, solve_s=solve_s or None
            )
            plgpu.copy_smem_to_gmem(m_s, m_ref.at[c, h], commit_group=False)
            plgpu.copy_smem_to_gmem(p_s, p_ref.at[c, h], commit_group=False)
            plgpu.copy_smem_to_gmem(vec_s, v_ref.at[c, h], commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

    tiles = jax.ShapeDtypeStruct((num_chunks, heads, CHUNK, CHUNK), BF16)
    out_type = (tiles, tiles, jax.ShapeDtypeStruct((num_chunks, heads, VEC_ROWS, CHUNK), F32))
    scratch = (
        smem((CHUNK, key_dim), BF16),
        smem((CHUNK, key_dim), BF16),
        vec,
        vec,
        vec,
        vec,
        smem(shape, BF16),
        smem(shape, BF16),
        plgpu.SMEM((VEC_ROWS, CHUNK), F32),
        plgpu.Barrier(num_arrivals=6),
    )
    if solve:
        scratch += (plgpu.SMEM(SOLVE_SHAPE, BF16), plgpu.SMEM(SOLVE_SHAPE, BF16))
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_chunks, heads),
        grid_names=("c", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True),  # ex2/rsqrt.approx
        interpret=interpret,
        kernel_name="gdn_chunk_intra",
    )(q, k, gc, beta_c, table, first)


def _state(q, k, v, m, p, vecs, table, first, slots, has_init, pool, *, n_seqs, cfg, interpret):
    """Kernel 2: the in-order walk over each sequence's chunks; returns ``o [T, HV, V]``.

    ``pool`` is a mutable ref: each non-empty sequence reads its initial state from it (when
    ``has_init``) and writes its final state back; nothing else touches it.
    """
    tokens, kv_heads, key_dim = q.shape
    heads, value_dim = v.shape[1], v.shape[2]
    group = heads // kv_heads
    bv = cfg.block_v
    out_dtype = v.dtype
    sq = (CHUNK, CHUNK)
    tile = (CHUNK, bv)
    state = (key_dim, bv)
    kmajor = cfg.kmajor if cfg.kmajor is not None else bv < 64  # see put_b_operand
    view = functools.partial(_chunk_state.b_operand_view, kmajor=kmajor)

    def b_operand(shape):
        return smem(shape[::-1] if kmajor else shape, BF16)

    def body(*refs):
        streamed = refs[:6]  # q, k, v, M, P, vectors: what load_chunk streams
        tab_ref, first_ref, slot_ref, init_ref, pool_ref, o_ref, *scratch = refs[6:]
        (q_s, k_s, v_s, m_s, p_s, w_s, s_bf, y_s, vp_s, vc_s, o_s, o_rows, st_s, bar, st_bar) = (
            scratch
        )
        tiles = (q_s, k_s, v_s, m_s, p_s, w_s)
        # A TMA's SMEM address must be 128-byte aligned: rows of the row-by-row staging tile
        # are padded to 128 bytes (a 32-column bf16 row is only 64).
        o_p = o_rows.at[:, pl.ds(0, bv)]
        h, hk, cols, c0, num, real, seq, slot = _chunk_state.cta_segment(
            first_ref, slot_ref, n_seqs=n_seqs, group=group, block_v=bv
        )

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

                # Not _chunk_state.store_chunk(o_s.at[0], ...): a view made outside the branch
                # would pass its index into it as an operand (another program).
                @pl.when(full)
                def _():
                    plgpu.copy_smem_to_gmem(o_s.at[0], o_ref.at[pl.ds(start, CHUNK), h, cols])

                @pl.when(~full)
                def _():
                    _chunk_state.store_valid_rows(o_p, o_ref, start, lo, hi, h, cols)

            plgpu.wait_smem_to_gmem(0)

        @pl.when(real & (num > 0))
        def _sequence():
            def issue(j, stage):
                _chunk_state.load_chunk(
                    streamed, tiles, stage, bar.at[stage], tab_ref, c0 + j, h, hk, cols
                )

            issue(0, 0)

            s0 = _chunk_state.load_initial_state(
                pool_ref, init_ref, seq, slot, h, cols, st_s, st_bar
            )

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

                a = plgpu.load(w_s.at[stage, 0], layout=ROWS)
                b = plgpu.load(w_s.at[stage, 1], layout=ROWS)
                e = plgpu.load(w_s.at[stage, 2], layout=ROWS)
                d = w_s[stage, 3, 0]
                _chunk_state.chain_values(
                    s, a, e, k_s.at[stage], v_s.at[stage], m_s.at[stage],
                    s_bf=s_bf, y=y_s, vp=vp_s, ev=vc_s, kmajor=kmajor,
                )  # fmt: skip
                upd = matmul(k_s.at[stage].T, view(vc_s), state)
                qs = matmul(q_s.at[stage], view(s_bf), tile)
                pv = matmul(p_s.at[stage], view(vp_s), tile)
                out = (along_rows(b, tile) * qs + pv).astype(out_dtype)
                full = (lo == 0) & (hi == CHUNK)
                # o_s[stage] was last sent two chunks ago; at most one store is in flight.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                o_s[stage] = out

                @pl.when(~full)
                def _():
                    o_p[...] = out

                plgpu.commit_smem()
                _chunk_state.store_chunk(o_s.at[stage], o_p, full, o_ref, start, lo, hi, h, cols)

                return d * s + upd

            s = lax.fori_loop(0, num, step, s0)
            _chunk_state.write_final_state(s, pool_ref, slot, h, cols, st_s)

    scratch = (
        smem((2, CHUNK, key_dim), BF16),
        smem((2, CHUNK, key_dim), BF16),
        smem((2, *tile), BF16),
        smem((2, *sq), BF16),
        smem((2, *sq), BF16),
        plgpu.SMEM((2, 4, CHUNK), F32),
        b_operand(state),
        b_operand(tile),
        b_operand(tile),
        b_operand(tile),
        smem((2, *tile), out_dtype),
        plgpu.SMEM((CHUNK, max(bv, 128 // jnp.dtype(out_dtype).itemsize)), out_dtype),
        plgpu.SMEM(state, F32),
        plgpu.Barrier(num_arrivals=6, num_barriers=2),
        plgpu.Barrier(),
    )
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((tokens, heads, value_dim), out_dtype),
        scratch_types=scratch,
        grid=(n_seqs + 1, heads, value_dim // bv),
        grid_names=("n", "h", "v"),
        interpret=interpret,
        kernel_name="gdn_chunk_state",
    )(q, k, v, m, p, vecs, table, first, slots, has_init, pool)


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
    del scale, g, beta, state_indices, has_initial_state
    if not use_qk_l2norm:
        return "the kernel always l2-normalises q and k (use_qk_l2norm=False is not built)"
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        return f"q, k [T, H, K] and v [T, HV, V] expected, got {q.shape}, {k.shape}, {v.shape}"
    key_dim, value_dim = q.shape[2], v.shape[2]
    if key_dim not in HEAD_DIMS or value_dim not in HEAD_DIMS:
        return f"head dims K={key_dim}, V={value_dim} must be in {HEAD_DIMS}"
    if v.shape[1] % q.shape[1]:
        return f"HV={v.shape[1]} is not a multiple of H={q.shape[1]}"
    if qsl.ndim != 1 or qsl.shape[0] < 2:
        return f"query_start_loc must be [N+1] with N >= 1, got shape {qsl.shape}"
    config = _resolve(config, qsl.shape[0] - 1, v.shape[1], value_dim, interpret=interpret)
    if value_dim % config.block_v or config.block_v not in (32, 64):
        return f"block_v={config.block_v} must be 32 or 64 and divide V={value_dim}"
    if config.state_stages:
        # v enters the kernels as bf16 whatever its dtype (the default out_dtype).
        reason = _chunk_state.unsupported_reason(
            key_dim, value_dim, block_v=config.block_v, stages=config.state_stages
        )
        if reason is not None:
            return reason
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if len(dtypes) != 1 or not dtypes <= {jnp.dtype(BF16), jnp.dtype(F32)}:
        return f"q, k, v must share one dtype of bf16 or float32, got {sorted(map(str, dtypes))}"
    if jnp.dtype(ssm_pool.dtype) != jnp.dtype(F32):
        return f"the ssm pool must be float32, got {ssm_pool.dtype}"
    if ssm_pool.shape[1:] != (v.shape[1], key_dim, value_dim):
        return f"ssm_pool {ssm_pool.shape} does not match [S, HV={v.shape[1]}, K, V]"
    return None


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
    packing_invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Chunked Gated DeltaNet over packed sequences (the Mosaic GPU kernels).

    Args:
      q, k: ``[T, H, K]`` bf16 or float32 (l2-normalised inside); v: ``[T, HV, V]``,
        ``HV % H == 0``, value head ``h`` reads key head ``h // (HV // H)``.
      g: float32 ``[T, HV]`` log decay (<= 0); beta: float32 ``[T, HV]``.
      ssm_pool: float32 ``[S, HV, K, V]``; qsl: int32 ``[N+1]`` sequence starts;
        state_indices: int32 ``[N]`` slots; has_initial_state: bool ``[N]``.
      scale: defaults to ``K ** -0.5``. interpret: False for the GPU, True (or
        ``plgpu.InterpretGPUParams``) for the Mosaic GPU CPU interpreter.
      config: static tuning (value columns per CTA of the state pass).
      packing_invariant: re-lay the tokens out so every sequence starts on an aligned row
        (``_mgpu_chunks.sequence_layout``): a sequence's outputs and final state are then the
        same bits whatever else the call packs and wherever it sits, at the cost of a gather
        of the inputs and the outputs.

    Returns:
      ``o [T, HV, V]`` (v's dtype; zeros at ``t >= qsl[N]``) and the pool with each non-empty
      sequence's final state at ``pool[state_indices[n]]`` (an empty sequence leaves its
      slot as it was). Donate the pool under ``jit`` for an in-place update.
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
        interpret=interpret,
        config=config,
    )
    if reason is not None:
        raise ValueError(f"chunk_mgpu.chunk_gated_delta_rule: {reason}")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    interpret = interpret or None
    tokens, _, key_dim = q.shape
    n_seqs = qsl.shape[0] - 1
    config = _resolve(config, n_seqs, v.shape[1], v.shape[2], interpret=interpret)
    scale = key_dim**-0.5 if scale is None else float(scale)
    out_dtype = v.dtype
    axis = token_axis(qsl, tokens, packing_invariant)
    q, k, v = (axis.place(x).astype(BF16) for x in (q, k, v))
    g_t, beta_t = (axis.place(x.astype(F32)).T for x in (g, beta))
    table, first = axis.chunks()
    m, p, vecs = _intra(
        q, k, g_t, beta_t, table, first, n_seqs=n_seqs, scale=scale,
        solve=config.substitution and interpret is None, interpret=interpret,
    )  # fmt: skip
    pool = jax.new_ref(ssm_pool)
    walk = (q, k, v, m, p, vecs, table, first)
    slots, has_init = state_indices.astype(jnp.int32), has_initial_state.astype(jnp.int32)
    if config.state_stages:
        o = _chunk_state.state_pass(
            *walk, slots, has_init, pool, n_seqs=n_seqs, block_v=config.block_v,
            stages=config.state_stages, interpret=interpret,
        )  # fmt: skip
    else:
        o = _state(*walk, slots, has_init, pool, n_seqs=n_seqs, cfg=config, interpret=interpret)
    return axis.back(o).astype(out_dtype), jax.freeze(pool)
