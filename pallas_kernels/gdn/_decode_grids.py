"""The bodies and grids of the Gated DeltaNet decode kernel (``decode_mgpu``'s entries launch
them). The design, each part separately switchable (``DecodeVariant``) so that one GPU run
says which pays:

* Grid order (all variants): the programs of one ``(row, head)`` are adjacent in launch order,
  so the two ``[K, 64]`` halves of a head's contiguous 64 KiB ``[K, V]`` block are read at the
  same time, not a whole sweep apart; a ``[K, 64]`` tile alone is 128 pieces of 256 B at a
  512 B stride (the Mamba2 decode kernel reads whole contiguous 32 KiB tiles).
* ``layout="cols"``: the ``[K, bv]`` state tile is held in registers with the value columns
  spread over the four warps and the K rows over registers and a few lanes. The delta rule's
  two mat-vecs ``S^T k`` and ``S^T q`` (and the q/k norms) then reduce within a warp (register
  adds and lane shuffles). In the WGMMA layout (``layout="wgmma"``, as the verify kernel in
  ``recurrent_mgpu``) the K rows are spread over the warps, so each of those four reductions
  goes through SMEM with a warpgroup barrier (the Mamba2 kernel reduces along its columns:
  in-warp).
* ``one_pass`` (with "cols"): ``S^T k`` and ``S^T q`` both from the state before the update
  (``o = decay S^T q + (q . k) u``): two independent reductions in one read of the tile, then
  one write pass, instead of reduce, update, reduce.
* ``stages >= 2``: a persistent grid (two programs per SM) in which each program walks work
  items ``(row, head, column block)`` through a ring of ``stages`` SMEM tiles: the TMA load of
  item ``i + stages - 1`` is in flight while item ``i`` is computed and stored, so a program
  keeps HBM busy on its own instead of relying on other resident programs. ``stages == 0`` is
  one item per program.
* Batch 1 (latency): 16-column blocks (256 programs instead of 128) and, in the one-item
  programs, the q/k/v copies start before the slot is read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import _counters
from pallas_kernels._common import NUM_SMS, SMEM_BYTES, interpret_params
from pallas_kernels._mgpu_chunks import SMEM_PER_SM, columns_over_warps
from pallas_kernels.conv1d import update_mgpu as conv_kernels

__all__ = [
    "VEC",
    "Columns",
    "DecodeVariant",
    "Heads",
    "conv_lanes",
    "load_token",
    "normed_variant",
    "one_item_per_program",
    "pipelined",
]

VEC = 2  # fp32 per register vector along V in the "cols" layout (8-byte SMEM accesses)
_REDUCTION_SCRATCH = 128 * 4 * 4  # SMEM bytes of the pipelined kernel's cross-warp reductions
_TMA_SMEM_ALIGN = 128  # bytes: a TMA's SMEM address is a multiple of this


@dataclasses.dataclass(frozen=True)
class DecodeVariant:
    """Static choices of one kernel.

    ``layout``: "cols" (value columns over warps: in-warp reductions) or "wgmma" (K rows
    over warps, as the verify kernel). ``block_v``: value columns per work item, or 0 for
    ``pick_block_v``. ``stages``: 0 for one item per program, else the SMEM ring depth of the
    persistent pipelined kernel, which launches at most ``programs`` programs (two per SM by
    default: one program's compute hides behind the other's copies). ``one_pass``: both
    mat-vecs from the state before the update (``o = decay S^T q + (q . k) u``), so the tile
    is read once for ``S^T k`` and ``S^T q`` together and written once; otherwise ``S^T q`` is
    a second reduction after the update, as in the verify kernel.
    """

    layout: str = "cols"
    block_v: int = 0
    stages: int = 0
    programs: int = 2 * NUM_SMS
    one_pass: bool = True


def _layouts(variant: DecodeVariant, bv: int):
    """(state [K, bv], row vector [K], column vector [bv]) register layouts."""
    if variant.layout == "wgmma":
        state = plgpu.Layout.WGMMA
    else:
        state, _ = columns_over_warps(bv, VEC)
    return state, state.reduce(1), state.reduce(0)


class Heads(NamedTuple):
    """Head counts and dims of a call (static)."""

    h: int
    k_dim: int
    hv: int
    v_dim: int


class Columns(NamedTuple):
    """Where the heads sit along the last axis of the ``[N, D, width]`` inputs: key head i's
    q at ``q + i K`` (k likewise), value head j's v at ``v + j V``, its two gate scalars
    (g and beta, or a and b) at ``gate_first + j`` and ``gate_second + j``. Separate q, k,
    v arrays have every offset 0; a conv output ``[Q | K | V]`` has ``(0, H K, 2 H K)``, so
    the kernel reads the heads where the conv wrote them, without a slice per input."""

    q: int = 0
    k: int = 0
    v: int = 0
    gate_first: int = 0
    gate_second: int = 0


def load_token(q_smem, k_smem, v_smem, t, *, row, col, scale, use_qk_l2norm):
    """Token ``t``'s float32 ``(q, k, v, q_scale)`` from SMEM in the ``row`` (q, k) and ``col``
    (v) register layouts. With ``use_qk_l2norm`` k is L2-normalised and ``q_scale`` (the
    scale the caller applies to the output, not to q) includes q's inverse norm."""
    q_t = plgpu.load(q_smem.at[t], layout=row).astype(jnp.float32)
    k_t = plgpu.load(k_smem.at[t], layout=row).astype(jnp.float32)
    v_t = plgpu.load(v_smem.at[t], layout=col).astype(jnp.float32)
    q_scale = jnp.float32(scale)
    if use_qk_l2norm:
        q_scale = q_scale * lax.rsqrt(jnp.sum(q_t * q_t) + 1e-6)
        k_t = k_t * lax.rsqrt(jnp.sum(k_t * k_t) + 1e-6)
    return q_t, k_t, v_t, q_scale


def _update(state, q_smem, k_smem, v_smem, o_smem, gates, *, layouts, scale, use_qk_l2norm,
            one_pass, out_norm=None):  # fmt: skip
    """Runs the tokens of one item on the register tile ``state``; writes ``o`` to SMEM.

    ``gates``: per token ``(decay, beta)`` float32 scalars. With ``out_norm`` ``(z_smem,
    weight, eps)`` (the item is a whole head: ``weight`` float32 ``[V]`` in the column
    layout) each token's ``o`` is written gated-normed (``gated_output_norm``). Returns the
    final state.
    """
    _, row, col = layouts
    for t, (decay, beta_t) in enumerate(gates):
        q_t, k_t, v_t, q_scale = load_token(
            q_smem, k_smem, v_smem, t, row=row, col=col, scale=scale, use_qk_l2norm=use_qk_l2norm
        )
        k_rows = lax.broadcast_in_dim(k_t, state.shape, [0])
        if one_pass:
            # S' = decay S + k u^T with u = beta (v - decay S^T k), hence
            # S'^T q = decay S^T q + (k . q) u: two independent reductions of the old state.
            s_k = jnp.sum(k_rows * state, axis=0)
            s_q = jnp.sum(lax.broadcast_in_dim(q_t, state.shape, [0]) * state, axis=0)
            u = (v_t - decay * s_k) * beta_t
            o_t = decay * s_q + jnp.sum(q_t * k_t) * u
            state = state * decay + k_rows * lax.broadcast_in_dim(u, state.shape, [1])
        else:
            state = state * decay
            u = (v_t - jnp.sum(k_rows * state, axis=0)) * beta_t
            state = state + k_rows * lax.broadcast_in_dim(u, state.shape, [1])
            o_t = jnp.sum(lax.broadcast_in_dim(q_t, state.shape, [0]) * state, axis=0)
        o_t = o_t * q_scale
        if out_norm is not None:
            z_smem, weight, eps = out_norm
            z_t = plgpu.load(z_smem.at[t], layout=col).astype(jnp.float32)
            o_t = _gated_norm(o_t, z_t, weight, eps, o_smem.dtype)
        o_smem[t] = o_t.astype(o_smem.dtype)
    return state


def _gated_norm(o, z, weight, eps: float, dtype):
    """``gated_output_norm`` of one token's head ``o`` (float32 ``[V]``, rounded to ``dtype``
    first, as the op stores it) with its gate ``z``: the same roundings in the same order."""
    o = o.astype(dtype).astype(jnp.float32)
    normed = o * lax.rsqrt(jnp.sum(o * o) * (1.0 / o.shape[0]) + eps)
    normed = normed.astype(dtype).astype(jnp.float32)
    return weight * normed * (z / (1.0 + jnp.exp(-z)))


def _softplus(x: jax.Array) -> jax.Array:
    # Overflow-free, and only exp/log/abs, which lower for scalars (log1p does not).
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _load_gates(gate_refs, cols: Columns, n, head, n_tokens):
    """The gate scalars of item (row ``n``, ``head``) as read from GMEM, flat: ``(g, beta)``
    per token, or (fused gating) ``A_log, dt_bias`` then ``(a, b)`` per token, those in
    float32. Fused gating comes as four refs ``(A_log, a, dt_bias, b)`` or as three,
    ``(gate_params, a, b)`` with ``gate_params`` ``[2, HV]`` = ``[A_log; dt_bias]``."""
    first, second = head + cols.gate_first, head + cols.gate_second
    if len(gate_refs) == 2:
        g_ref, beta_ref = gate_refs
        return tuple(
            x for t in range(n_tokens) for x in (g_ref[n, t, first], beta_ref[n, t, second])
        )
    if len(gate_refs) == 3:
        params_ref, a_ref, b_ref = gate_refs
        a_log, dt_bias = params_ref[0, head], params_ref[1, head]
    else:
        a_log_ref, a_ref, dt_bias_ref, b_ref = gate_refs
        a_log, dt_bias = a_log_ref[head], dt_bias_ref[head]
    per_token = (x for t in range(n_tokens) for x in (a_ref[n, t, first], b_ref[n, t, second]))
    return tuple(x.astype(jnp.float32) for x in (a_log, dt_bias, *per_token))


def _decays(gates, raw_gating: bool):
    """``(decay, beta)`` per token from ``_load_gates``' scalars; with ``raw_gating`` the
    Qwen3-Next gating ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    if not raw_gating:
        return tuple((jnp.exp(gates[i]), gates[i + 1]) for i in range(0, len(gates), 2))
    a_log, dt_bias = gates[:2]
    pairs = [(gates[i], gates[i + 1]) for i in range(2, len(gates), 2)]
    return tuple(
        (jnp.exp(-jnp.exp(a_log) * _softplus(a + dt_bias)), 1.0 / (1.0 + jnp.exp(-b)))
        for a, b in pairs
    )


def _wait_stores_read():
    # A program may exit once its bulk stores have read SMEM; their writes complete with the
    # kernel (waiting for them, as the verify kernel does, holds the program's SMEM and registers
    # for a whole write round trip longer).
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _zeros_o(o_smem, n_tokens, bv, col):
    zeros = plgpu.layout_cast(jnp.zeros((bv,), jnp.float32), col)
    for t in range(n_tokens):
        o_smem[t] = zeros.astype(o_smem.dtype)


def _key(offset: int, head, k_dim: int):
    """The columns of key head ``head``'s q (or k) in an input whose heads start at
    ``offset``."""
    return pl.ds(offset + head * k_dim, k_dim)


def _value(offset: int, head, v_dim: int, block, bv: int):
    """The columns of value head ``head``'s column block ``block`` (``bv`` wide)."""
    return pl.ds(offset + head * v_dim + block * bv, bv)


def one_item_per_program(q, k, v, gates_in, pool_ref, idx, *, heads, cols, bv, variant, scale,
                          l2, interpret):  # fmt: skip
    """Grid (column block, value head, row): one TMA round trip per program. q, k, v
    ``[N, D, width]`` with heads at ``cols``; ``gates_in``: ``(g, beta)`` or (fused gating)
    ``(A_log, a, dt_bias, b)`` or ``(gate_params, a, b)`` (``_load_gates``)."""
    n_rows, n_tokens = q.shape[:2]
    h, k_dim, hv, v_dim = heads
    group = hv // h
    layouts = _layouts(variant, bv)

    n_gates = len(gates_in)
    raw = n_gates > 2

    def body(idx_ref, q_ref, k_ref, v_ref, *refs):
        gate_refs, (pool, o_ref) = refs[:n_gates], refs[n_gates : n_gates + 2]
        state_smem, q_smem, k_smem, v_smem, o_smem, qkv_bar, state_bar = refs[n_gates + 2 :]
        n = lax.axis_index("n")
        head = lax.axis_index("h")
        j = lax.axis_index("j")
        # q/k/v do not depend on the slot: their copies start before the slot is known.
        plgpu.copy_gmem_to_smem(q_ref.at[n, :, _key(cols.q, head // group, k_dim)], q_smem,
                                qkv_bar)  # fmt: skip
        plgpu.copy_gmem_to_smem(k_ref.at[n, :, _key(cols.k, head // group, k_dim)], k_smem,
                                qkv_bar)  # fmt: skip
        plgpu.copy_gmem_to_smem(v_ref.at[n, :, _value(cols.v, head, v_dim, j, bv)], v_smem,
                                qkv_bar)  # fmt: skip
        slot = idx_ref[n]
        gates = _load_gates(gate_refs, cols, n, head, n_tokens)  # in flight with the slot
        tile = pool.at[slot, head, :, pl.ds(j * bv, bv)]

        @pl.when(slot != 0)
        def _real_row():
            plgpu.copy_gmem_to_smem(tile, state_smem, state_bar)
            plgpu.barrier_wait(qkv_bar)
            plgpu.barrier_wait(state_bar)
            state = plgpu.load(state_smem, layout=layouts[0])
            state = _update(state, q_smem, k_smem, v_smem, o_smem, _decays(gates, raw),
                            layouts=layouts, scale=scale, use_qk_l2norm=l2,
                            one_pass=variant.one_pass)  # fmt: skip
            state_smem[...] = state
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(state_smem, tile)

        @pl.when(slot == 0)
        def _padded_row():
            # The q/k/v copies land in this program's SMEM: they must finish before it exits.
            plgpu.barrier_wait(qkv_bar)
            _zeros_o(o_smem, n_tokens, bv, layouts[2])
            plgpu.commit_smem()

        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[n, :, head, pl.ds(j * bv, bv)])
        _wait_stores_read()

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_rows, n_tokens, hv, v_dim), v.dtype),
        # The column block varies fastest (it is CUDA's x), so the programs of one (row, head)
        # run side by side and read its [K, V] block as one contiguous region.
        grid=(v_dim // bv, hv, n_rows),
        grid_names=("j", "h", "n"),
        scratch_types=[
            plgpu.SMEM((k_dim, bv), jnp.float32),
            plgpu.SMEM((n_tokens, k_dim), q.dtype),
            plgpu.SMEM((n_tokens, k_dim), k.dtype),
            plgpu.SMEM((n_tokens, bv), v.dtype),
            plgpu.SMEM((n_tokens, bv), v.dtype),
            plgpu.Barrier(num_arrivals=3),
            plgpu.Barrier(num_arrivals=1),
        ],
        interpret=interpret_params(interpret),
        kernel_name="gdn_decode",
    )
    return kernel(idx, q, k, v, *gates_in, pool_ref)


def normed_variant(variant: DecodeVariant, n_tokens: int, heads: Heads, dtype) -> DecodeVariant:
    """``variant`` for a pipelined call with the output norm, whose items are whole heads
    (``block_v = V``): its ring stages (at most ``variant.stages``, at least 2) as many as fit
    the SMEM an sm_90 block may use, with the cross-warp reduction's scratch, and its
    programs as many as can be resident at once (a persistent program that waits for an SM
    would run its items after the others' instead of beside them)."""
    size = jnp.dtype(dtype).itemsize
    rows = _stage_rows(n_tokens, heads.v_dim, dtype)

    def smem(s: int) -> int:
        state = s * heads.k_dim * heads.v_dim * 4
        qk = 2 * s * n_tokens * heads.k_dim * size
        voz = 3 * s * rows * heads.v_dim * size
        return state + qk + voz + heads.v_dim * 4 + _REDUCTION_SCRATCH + 64 * (s + 1)

    stages = variant.stages
    while stages > 2 and smem(stages) > SMEM_BYTES:
        stages -= 1
    resident = NUM_SMS * max(1, SMEM_PER_SM // (smem(stages) + 1024))
    return dataclasses.replace(
        variant, block_v=heads.v_dim, stages=stages, programs=min(variant.programs, resident)
    )


def _stage_rows(n_tokens: int, bv: int, dtype) -> int:
    """Rows of one ring stage of a ``[n_tokens, bv]`` tile: ``n_tokens`` rounded up so that
    every stage starts on a TMA-aligned address (a narrow value tile of one token is 32
    bytes, and the second stage of an unpadded ring is misaligned on the GPU)."""
    per_row = bv * jnp.dtype(dtype).itemsize
    step = max(1, _TMA_SMEM_ALIGN // per_row)
    return -(-n_tokens // step) * step


def pipelined(q, k, v, gates_in, pool_ref, idx, *, heads, cols, bv, variant, scale, l2,
               interpret, out_norm=None, conv=None):  # fmt: skip
    """Persistent grid; each program walks items ``c, c + P, c + 2P, ...`` (``P`` programs)
    through a ring of ``stages`` SMEM tiles, loads running ``stages - 1`` items ahead. With
    ``out_norm`` ``(z, weight, eps)`` (z ``[N, D, HV V]``, weight float32 ``[V]``; items of
    whole heads, ``bv == V``) the output is gated-normed (``_update``).

    With ``conv`` ``(weight [C, W], conv_pool Ref [S, C, W-1], counters Ref int32
    [>= N H])`` q, k, v are the inputs of the layer's causal conv1d (``C = 2 H K + H V``,
    channels ``[Q | K | V]`` at ``cols``) and each item convolves its heads' channels (SiLU,
    rounded to the inputs' dtype, as the conv op) before the delta rule, one channel a
    thread (``K = V = 128``, whole heads). The ``group`` value heads of a key head all read
    its q and k windows: each item counts its arrival on the (row, key head)'s counter once
    it has read them, and the last to arrive writes them back (``_counters.count_arrival``),
    leaving the counter at zero."""
    n_rows, n_tokens = q.shape[:2]
    h, k_dim, hv, v_dim = heads
    v_rows = _stage_rows(n_tokens, bv, v.dtype)
    group = hv // h
    n_blocks = v_dim // bv
    n_items = n_rows * hv * n_blocks
    n_progs = min(n_items, variant.programs)
    stages = variant.stages
    layouts = _layouts(variant, bv)
    if conv is not None and not (bv == v_dim == k_dim == conv_lanes()):
        raise ValueError(f"the conv in the decode kernel takes whole heads of K = V = "
                         f"{conv_lanes()}; got K={k_dim}, V={v_dim}, block_v={bv}")  # fmt: skip

    n_gates = len(gates_in)
    raw = n_gates > 2
    normed = out_norm is not None
    norm_in = tuple(out_norm[:2]) if normed else ()
    conv_in = (conv[0],) if conv is not None else ()
    conv_refs = tuple(conv[1:]) if conv is not None else ()

    def body(idx_ref, q_ref, k_ref, v_ref, *refs):
        gate_refs, refs = refs[:n_gates], refs[n_gates:]
        z_ref, weight_ref = refs[:2] if normed else (None, None)
        refs = refs[len(norm_in) :]
        conv_w_ref, conv_pool, counters = None, None, None
        if conv is not None:
            conv_w_ref, refs = refs[0], refs[1:]
        pool, refs = refs[0], refs[1:]
        if conv is not None:
            (conv_pool, counters), refs = refs[:2], refs[2:]
        o_ref, state_smem, q_smem, k_smem, v_smem, o_smem, bars, *extra_smem = refs
        norm_smem, count_smem = (extra_smem[:3], extra_smem[3:]) if normed else ((), extra_smem)
        prog = lax.axis_index("c")
        count = (n_items - prog + n_progs - 1) // n_progs  # this program's items

        def coords(i):
            """(row, head, columns) of this program's item i (clamped into range)."""
            item = jnp.minimum(prog + i * n_progs, n_items - 1)
            return item // (hv * n_blocks), (item // n_blocks) % hv, item % n_blocks

        def slot_of(i):
            return idx_ref[coords(i)[0]]

        def issue(i, slot):
            """Starts the loads of item i into stage i % stages (nothing for a padded row)."""
            n, head, j = coords(i)
            s = i % stages
            block = pl.ds(j * bv, bv)

            @pl.when((i < count) & (slot != 0))
            def _():
                bar = bars.at[s]
                key = head // group
                plgpu.copy_gmem_to_smem(pool.at[slot, head, :, block], state_smem.at[s], bar)
                plgpu.copy_gmem_to_smem(q_ref.at[n, :, _key(cols.q, key, k_dim)], q_smem.at[s],
                                        bar)  # fmt: skip
                plgpu.copy_gmem_to_smem(k_ref.at[n, :, _key(cols.k, key, k_dim)], k_smem.at[s],
                                        bar)  # fmt: skip
                plgpu.copy_gmem_to_smem(v_ref.at[n, :, _value(cols.v, head, v_dim, j, bv)],
                                        v_smem.at[s, :n_tokens], bar)  # fmt: skip
                if normed:
                    plgpu.copy_gmem_to_smem(z_ref.at[n, :, _value(0, head, v_dim, j, bv)],
                                            norm_smem[0].at[s, :n_tokens], bar)  # fmt: skip

        def gates_of(i):
            n, head, _ = coords(i)
            return _load_gates(gate_refs, cols, n, head, n_tokens)

        slots = tuple(slot_of(i) for i in range(stages))
        if normed:
            z_smem, weight_smem, weight_bar = norm_smem
            plgpu.copy_gmem_to_smem(weight_ref, weight_smem, weight_bar)
        for i in range(stages - 1):
            issue(i, slots[i])
        if normed:
            plgpu.barrier_wait(weight_bar)

        def step(i, carry):
            # Scalars read one iteration before their use (slots: stages - 1 items ahead for
            # the prefetch; gates: the next item), so no GMEM latency is on the item's path.
            slots, gates = carry
            n, head, j = coords(i)
            s = i % stages
            block = pl.ds(j * bv, bv)
            slot = slots[0]
            next_slot = slot_of(i + stages)
            next_gates = gates_of(i + 1)
            tile = pool.at[slot, head, :, block]

            @pl.when(slot != 0)
            def _real_row():
                convolve = None
                if conv is not None:  # the windows' loads in flight with the item's copies
                    key_counter = counters.at[pl.ds(n * h + head // group, 1)]
                    arrive = functools.partial(_counters.count_arrival, key_counter, group,
                                               count_smem[0], interpret=interpret)  # fmt: skip
                    convolve = _conv_item(conv_w_ref, conv_pool, slot, head, group, cols,
                                          heads, n_tokens, arrive)  # fmt: skip
                plgpu.barrier_wait(bars.at[s])
                if convolve is not None:
                    convolve(q_smem.at[s], k_smem.at[s], v_smem.at[s])
                state = plgpu.load(state_smem.at[s], layout=layouts[0])
                item_norm = None
                if normed:  # the weight loaded per item: registers are held by the state
                    weight = plgpu.load(weight_smem, layout=layouts[2])
                    item_norm = (z_smem.at[s], weight, out_norm[2])
                state = _update(state, q_smem.at[s], k_smem.at[s], v_smem.at[s], o_smem.at[s],
                                _decays(gates, raw), layouts=layouts, scale=scale,
                                use_qk_l2norm=l2, one_pass=variant.one_pass,
                                out_norm=item_norm)  # fmt: skip
                state_smem[s] = state

            @pl.when(slot == 0)
            def _padded_row():
                _zeros_o(o_smem.at[s], n_tokens, bv, layouts[2])

            # Stage (i - 1) % stages is refilled next: the stores of item i - 1 out of it
            # (two bulk groups: state and o) must have read it. Item i's stores come after.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            issue(i + stages - 1, slots[stages - 1])
            plgpu.commit_smem()

            @pl.when(slot != 0)
            def _store_state():
                plgpu.copy_smem_to_gmem(state_smem.at[s], tile)

            plgpu.copy_smem_to_gmem(o_smem.at[s, :n_tokens], o_ref.at[n, :, head, block])
            return (*slots[1:], next_slot), next_gates

        lax.fori_loop(0, count, step, (slots, gates_of(0)))
        _wait_stores_read()

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n_rows, n_tokens, hv, v_dim), v.dtype),
        grid=(n_progs,),
        grid_names=("c",),
        scratch_types=[
            plgpu.SMEM((stages, k_dim, bv), jnp.float32),
            plgpu.SMEM((stages, n_tokens, k_dim), q.dtype),
            plgpu.SMEM((stages, n_tokens, k_dim), k.dtype),
            plgpu.SMEM((stages, v_rows, bv), v.dtype),
            plgpu.SMEM((stages, v_rows, bv), v.dtype),
            plgpu.Barrier(num_arrivals=4 + normed, num_barriers=stages),
            *(
                [
                    plgpu.SMEM((stages, v_rows, bv), out_norm[0].dtype),
                    plgpu.SMEM((bv,), jnp.float32),
                    plgpu.Barrier(num_arrivals=1),
                ]
                if normed
                else []
            ),
            *([plgpu.SMEM((1,), jnp.int32)] if conv is not None else []),
        ],  # fmt: skip
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=_REDUCTION_SCRATCH),
        interpret=interpret_params(interpret),
        kernel_name="gdn_decode_ring_conv" if conv is not None else "gdn_decode_ring",
    )
    return kernel(idx, q, k, v, *gates_in, *norm_in, *conv_in, pool_ref, *conv_refs)


def conv_lanes() -> int:
    """The head dims the conv in the decode kernel takes: one channel a thread."""
    return conv_kernels.BLOCK_C


def _conv_item(w_ref, conv_pool, slot, head, group: int, cols: Columns, heads: Heads,
               n_tokens: int, arrive):  # fmt: skip
    """Loads the conv windows and taps of item (``slot``, value ``head``) into registers and
    sums the taps on the windows (``window_sums``), all before the item's inputs arrive;
    returns the function that, once they are in SMEM, replaces them by the conv's outputs
    (rounded to their dtype) and writes the windows that move on: the value head's always,
    its key head's q and k only from the last of the key head's items to ``arrive()``
    (which returns how many arrived before it), called here, once the windows are read."""
    key = head // group
    chans = (
        pl.ds(cols.q + key * heads.k_dim, heads.k_dim),
        pl.ds(cols.k + key * heads.k_dim, heads.k_dim),
        pl.ds(cols.v + head * heads.v_dim, heads.v_dim),
    )
    width = w_ref.shape[1]
    load = conv_kernels.load_lane
    windows = [[load(conv_pool.at[slot, c, w]) for w in range(width - 1)] for c in chans]
    taps = [[load(w_ref.at[c, w]) for w in range(width)] for c in chans]
    sums = [
        conv_kernels.window_sums(window, taps_c, None, n_tokens)
        for window, taps_c in zip(windows, taps, strict=True)
    ]
    # Every thread's window reads are done (their values are summed): the count may go on.
    last = None if group == 1 else arrive() == group - 1

    def store_windows(c, ext):
        for w in range(width - 1):
            conv_pool[slot, c, w] = ext[n_tokens + w].astype(conv_pool.dtype)

    def convolve(*inputs_smem):
        exts = []
        parts = zip(windows, taps, sums, inputs_smem, strict=True)
        for window, taps_c, sums_c, x_smem in parts:
            inputs = [load(x_smem.at[t]) for t in range(n_tokens)]
            for t, y_t in enumerate(conv_kernels.finish_outputs(sums_c, inputs, taps_c, "silu")):
                x_smem[t] = y_t.astype(x_smem.dtype)
            exts.append([*window, *inputs])
        store_windows(chans[2], exts[2])  # the value head's channels: this item's alone

        def store_key_windows():
            store_windows(chans[0], exts[0])
            store_windows(chans[1], exts[1])

        if last is None:
            store_key_windows()
        else:
            pl.when(last)(store_key_windows)

    return convolve
