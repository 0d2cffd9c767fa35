"""Gated DeltaNet token path (decode and speculative verify) as Mosaic GPU kernels (sm_90).

One program per (row ``n``, value head ``h``, block of ``block_v`` value columns ``j``): it
reads the ``[K, block_v]`` tile of ``pool[idx[n], h]`` through TMA into SMEM, runs the ``D``
tokens of the row on it in registers and writes the tile back (decode) or writes the state
after every token to ``intermediates`` (verify). The tile is independent of every other
tile: the delta rule only mixes the K axis, so splitting V costs nothing but re-reading
``q``/``k`` (a few hundred bytes against the 32 KiB tile).

Register layouts (Mosaic GPU "lane" semantics): the state tile is a WGMMA-layout array
``[K, block_v]`` (rows spread over the warpgroup's four warps); ``q_t``/``k_t`` are loaded
in ``WGMMA.reduce(1)`` (one value per row) and ``v_t``, ``o_t`` live in ``WGMMA.reduce(0)``
(one value per column), so the two mat-vecs ``S^T k`` and ``S^T q`` are column sums.

Tree drafts (verify with ``parents``): the program keeps the state after every token in its
own SMEM tile (``D+1`` tiles: the root, then one per token, each copied out to
``intermediates`` and never overwritten), and token ``t`` starts from the tile of its parent,
``parents[n, t] + 1``. The chain verify keeps the state in registers from one token to the
next. ``D+1`` tiles must fit ``TREE_SMEM_BYTES``, so a tree call narrows ``block_v``.

Padded rows (``state_indices[n] == 0``): the program touches no pool memory and writes
zeros to ``o`` (and to ``intermediates``). This is stricter than the contract (which lets
the pad slot be read and written) and avoids every padded row of a bucket racing on slot 0.

Entries: ``fused_recurrent_gated_delta_rule`` (pool updated in place under ``jit`` with the
pool donated), ``fused_gating_recurrent_gated_delta_rule`` (the same with the Qwen3-Next
gating computed in the kernel), ``verify_gated_delta_rule`` (pool read-only) and
``unsupported_reason``. Each takes the public op's arguments plus ``interpret``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

__all__ = [
    "RecurrentConfig",
    "fused_gating_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "pick_config",
    "unsupported_reason",
    "verify_gated_delta_rule",
]

_STATE = plgpu.Layout.WGMMA  # [K, block_v]
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [K]: one value per state row
_COL = plgpu.Layout.WGMMA.reduce(0)  # [block_v]: one value per state column

_HEAD_DIMS = (64, 128)
_ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# D tokens of q/k/v/o live in SMEM next to the state tiles; 16 keeps the whole program
# under 100 KiB at K = V = 128 while covering every speculative depth in use.
MAX_TOKENS = 16
_NUM_SMS = 132  # H100/H200 SXM
# SMEM for the D+1 state tiles of a tree verify; the rest of the 227 KiB an sm_90 block may
# use holds the q/k/v/o tiles.
TREE_SMEM_BYTES = 160 * 1024
_MIN_BLOCK_V = 16


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Static tiling of one call.

    ``block_v`` value columns per program (divides V; 16..128). ``swizzle``: 0, or the SMEM
    swizzle in bytes (32, 64, 128) of the state tile, which spreads the rows of a register
    load/store over the banks (unswizzled, rows of 64 fp32 are 256 B apart: same banks).
    """

    block_v: int = 64
    swizzle: int = 0


def pick_config(n_rows: int, hv: int, v_dim: int) -> RecurrentConfig:
    """64 columns per program, or 32 (twice the programs) when 64 would not give every SM two."""
    block_v = min(64, v_dim)
    if n_rows * hv * (v_dim // block_v) < 2 * _NUM_SMS and v_dim % 32 == 0:
        block_v = 32
    return RecurrentConfig(block_v=block_v)


def _tree_config(config: RecurrentConfig, n_tokens: int, k_dim: int) -> RecurrentConfig:
    """``config`` with ``block_v`` halved until the ``D+1`` state tiles fit the SMEM budget."""
    bv = config.block_v
    while (n_tokens + 1) * k_dim * bv * 4 > TREE_SMEM_BYTES and bv > _MIN_BLOCK_V:
        bv //= 2
    swizzle = min(config.swizzle, bv * 4)  # a swizzle row may not exceed a tile row
    return RecurrentConfig(block_v=bv, swizzle=swizzle)


def _interpret_params(interpret: bool) -> plgpu.InterpretGPUParams | bool:
    return plgpu.InterpretGPUParams() if interpret else False


def _softplus(x: jax.Array) -> jax.Array:
    # max(x, 0) + log(1 + exp(-|x|)): overflow-free, and only exp/log/abs, which lower for
    # scalars in Mosaic GPU (log1p does not).
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    gates: tuple[jax.Array, ...],
    ssm_pool: jax.Array | jax.Ref,
    state_indices: jax.Array,
    *,
    scale: float,
    use_qk_l2norm: bool,
    write_pool: bool,
    config: RecurrentConfig,
    interpret: bool,
    parents: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The kernel call. ``gates`` is ``(g, beta)`` or ``(A_log, a, dt_bias, b)``.

    With ``write_pool`` the pool must be a mutable ref and the result is ``o``; without it
    the pool is only read and the result is ``(o, intermediates)``. ``parents`` (verify
    only): int32 ``[N, D]`` tree of every row.
    """
    n_rows, n_tokens, h, k_dim = q.shape
    hv, v_dim = v.shape[2:]
    group = hv // h
    tree = parents is not None
    if tree:
        config = _tree_config(config, n_tokens, k_dim)
    bv = config.block_v
    raw_gating = len(gates) == 4
    n_in = 4 + len(gates) + 1  # idx, q, k, v, gates..., pool

    def body(*refs):
        parents_ref = None
        if tree:  # parents come right after idx; the rest keeps the chain's positions
            parents_ref, refs = refs[1], refs[:1] + refs[2:]
        idx_ref, q_ref, k_ref, v_ref = refs[:4]
        gate_refs = refs[4 : n_in - 1]
        pool_ref = refs[n_in - 1]
        o_ref = refs[n_in]
        inter_ref = None if write_pool else refs[n_in + 1]
        n_out = 1 if write_pool else 2
        state_smem, q_smem, k_smem, v_smem, o_smem, barrier = refs[n_in + n_out :]

        n = lax.axis_index("n")
        head = lax.axis_index("h")
        cols = pl.ds(lax.axis_index("j") * bv, bv)
        key_head = head // group
        slot = idx_ref[n]
        tile = pool_ref.at[slot, head, :, cols]
        o_tile = o_ref.at[n, :, head, cols]

        @pl.when(slot != 0)
        def _real_row():
            # One barrier, four arrivals: each TMA arrives once with its byte count.
            plgpu.copy_gmem_to_smem(tile, state_smem.at[0], barrier)
            plgpu.copy_gmem_to_smem(q_ref.at[n, :, key_head], q_smem, barrier)
            plgpu.copy_gmem_to_smem(k_ref.at[n, :, key_head], k_smem, barrier)
            plgpu.copy_gmem_to_smem(v_ref.at[n, :, head, cols], v_smem, barrier)
            plgpu.barrier_wait(barrier)
            state = plgpu.load(state_smem.at[0], layout=_STATE)
            for t in range(n_tokens):
                if tree and t > 0:
                    # The root's parent is -1 (tile 0, already in registers); every other
                    # token reloads its parent's tile, which this thread stored itself in
                    # the same layout.
                    parent = parents_ref[n * n_tokens + t]
                    state = plgpu.load(state_smem.at[parent + 1], layout=_STATE)
                q_t = plgpu.load(q_smem.at[t], layout=_ROW).astype(jnp.float32)
                k_t = plgpu.load(k_smem.at[t], layout=_ROW).astype(jnp.float32)
                v_t = plgpu.load(v_smem.at[t], layout=_COL).astype(jnp.float32)
                q_scale = jnp.float32(scale)
                if use_qk_l2norm:
                    q_scale = q_scale * lax.rsqrt(jnp.sum(q_t * q_t) + 1e-6)
                    k_t = k_t * lax.rsqrt(jnp.sum(k_t * k_t) + 1e-6)
                if raw_gating:
                    a_log_ref, a_ref, dt_bias_ref, b_ref = gate_refs
                    x = a_ref[n, t, head].astype(jnp.float32)
                    x = x + dt_bias_ref[head].astype(jnp.float32)
                    decay = jnp.exp(-jnp.exp(a_log_ref[head].astype(jnp.float32)) * _softplus(x))
                    beta_t = 1.0 / (1.0 + jnp.exp(-b_ref[n, t, head].astype(jnp.float32)))
                else:
                    g_ref, beta_ref = gate_refs
                    decay = jnp.exp(g_ref[n, t, head])
                    beta_t = beta_ref[n, t, head]
                state = state * decay
                k_rows = lax.broadcast_in_dim(k_t, state.shape, [0])
                u = (v_t - jnp.sum(k_rows * state, axis=0)) * beta_t
                state = state + k_rows * lax.broadcast_in_dim(u, state.shape, [1])
                o_t = jnp.sum(lax.broadcast_in_dim(q_t, state.shape, [0]) * state, axis=0)
                o_smem[t] = (o_t * q_scale).astype(o_smem.dtype)
                if tree:
                    buf = state_smem.at[t + 1]  # never overwritten: no wait before the store
                    buf[...] = state
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, inter_ref.at[n, t, head, :, cols])
                elif not write_pool:
                    buf = state_smem.at[t % 2]
                    if t >= 2:
                        # The copy of token t-2 out of this buffer must have read it.
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    buf[...] = state
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, inter_ref.at[n, t, head, :, cols])
            if write_pool:
                state_smem[0] = state
            plgpu.commit_smem()
            if write_pool:
                plgpu.copy_smem_to_gmem(state_smem.at[0], tile)
            plgpu.copy_smem_to_gmem(o_smem, o_tile)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(slot == 0)
        def _padded_row():
            # No pool access at all: padded rows of a bucket all name slot 0, and writing it
            # from many programs would race (harmless by contract, but needless traffic).
            zeros = plgpu.layout_cast(jnp.zeros((bv,), jnp.float32), _COL)
            for t in range(n_tokens):
                o_smem[t] = zeros.astype(o_smem.dtype)
            if not write_pool:
                state_smem[0] = plgpu.layout_cast(jnp.zeros((k_dim, bv), jnp.float32), _STATE)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_tile)
            if not write_pool:
                for t in range(n_tokens):
                    plgpu.copy_smem_to_gmem(state_smem.at[0], inter_ref.at[n, t, head, :, cols])
            plgpu.wait_smem_to_gmem(0)

    o_type = jax.ShapeDtypeStruct(v.shape, v.dtype)
    out_type = o_type
    if not write_pool:
        inter_shape = (n_rows, n_tokens, hv, k_dim, v_dim)
        out_type = (o_type, jax.ShapeDtypeStruct(inter_shape, jnp.float32))
    transforms = ()
    if config.swizzle:
        tile_cols = config.swizzle // 4  # fp32: one swizzle row
        transforms = (plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(config.swizzle))
    n_tiles = n_tokens + 1 if tree else 1 if write_pool else 2
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(n_rows, hv, v_dim // bv),
        grid_names=("n", "h", "j"),
        scratch_types=[
            plgpu.SMEM((n_tiles, k_dim, bv), jnp.float32, transforms=transforms),
            plgpu.SMEM((n_tokens, k_dim), q.dtype),
            plgpu.SMEM((n_tokens, k_dim), k.dtype),
            plgpu.SMEM((n_tokens, bv), v.dtype),
            plgpu.SMEM((n_tokens, bv), v.dtype),
            plgpu.Barrier(num_arrivals=4),
        ],
        interpret=_interpret_params(interpret),
    )
    # parents flat [N*D]: a scalar load from a 1-D GMEM ref, as for state_indices.
    tree_args = (parents.reshape(-1),) if tree else ()
    return kernel(state_indices, *tree_args, q, k, v, *gates, ssm_pool)


def _check(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


def unsupported_reason(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> str | None:
    """Why the kernels of this module cannot take this call, in one sentence; None if they can.

    Covers decode and verify alike (same arguments; ``parents`` only for verify); for the
    fused-gating entry pass ``a`` and ``b`` as ``g`` and ``beta`` (only their shapes are
    checked, not their dtype).
    """
    del scale, use_qk_l2norm
    if q.ndim != 4 or k.shape != q.shape:
        return f"q {q.shape} and k {k.shape} must both be [N, D, H, K]"
    n_rows, n_tokens, h, k_dim = q.shape
    if v.ndim != 4 or v.shape[:2] != (n_rows, n_tokens):
        return f"v {v.shape} must be [N, D, HV, V] with N, D = {n_rows}, {n_tokens}"
    hv, v_dim = v.shape[2:]
    if hv % h:
        return f"HV={hv} is not a multiple of H={h}"
    if k_dim not in _HEAD_DIMS or v_dim not in _HEAD_DIMS:
        return f"K={k_dim}, V={v_dim}: the kernel supports head dims {_HEAD_DIMS} only"
    if not 1 <= n_tokens <= MAX_TOKENS:
        return f"D={n_tokens} tokens per row is outside 1..{MAX_TOKENS}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _ACTIVATION_DTYPES:
            return f"{name} is {x.dtype}; the kernel takes bfloat16 or float32 activations"
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (n_rows, n_tokens, hv):
            return f"{name} {x.shape} must be [N, D, HV] = {(n_rows, n_tokens, hv)}"
    want_pool = (hv, k_dim, v_dim)
    if ssm_pool.dtype != jnp.float32 or ssm_pool.ndim != 4 or ssm_pool.shape[1:] != want_pool:
        got = f"{ssm_pool.dtype}{list(ssm_pool.shape)}"
        return f"ssm_pool {got} must be float32 [S, {hv}, {k_dim}, {v_dim}]"
    if state_indices.shape != (n_rows,) or state_indices.dtype != jnp.int32:
        got = f"{state_indices.dtype}{list(state_indices.shape)}"
        return f"state_indices {got} must be int32 [{n_rows}]"
    if parents is not None:
        if parents.shape != (n_rows, n_tokens) or parents.dtype != jnp.int32:
            got = f"{parents.dtype}{list(parents.shape)}"
            return f"parents {got} must be int32 [{n_rows}, {n_tokens}]"
        if (n_tokens + 1) * k_dim * _MIN_BLOCK_V * 4 > TREE_SMEM_BYTES:
            return (
                f"a tree of D={n_tokens} tokens needs D+1 state tiles of [K={k_dim}, "
                f"{_MIN_BLOCK_V}] in SMEM, over the {TREE_SMEM_BYTES // 1024} KiB budget"
            )
    if n_rows == 0:
        return "N=0 rows: nothing to launch"
    return None


def _gate_reason(g: jax.Array, beta: jax.Array) -> str | None:
    if g.dtype != jnp.float32 or beta.dtype != jnp.float32:
        return f"g ({g.dtype}) and beta ({beta.dtype}) must be float32"
    return None


def _scale(q: jax.Array, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def fused_recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    config: RecurrentConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """D tokens per row from ``pool[idx[n]]``; the final state is written back in place.

    q, k ``[N, D, H, K]``; v ``[N, D, HV, V]``; g, beta float32 ``[N, D, HV]``; ssm_pool
    float32 ``[S, HV, K, V]``; state_indices int32 ``[N]`` (0 = padded row). Returns
    (o ``[N, D, HV, V]`` in v's dtype, zeros on padded rows; ssm_pool). Under ``jit`` with
    ``ssm_pool`` donated the pool is updated in place; slot 0 is never touched.
    """
    _check(unsupported_reason(q, k, v, g, beta, ssm_pool, state_indices) or _gate_reason(g, beta))
    config = config or pick_config(q.shape[0], v.shape[2], v.shape[3])
    pool_ref = jax.new_ref(ssm_pool)
    o = _recurrent(
        q, k, v, (g, beta), pool_ref, state_indices,
        scale=_scale(q, scale), use_qk_l2norm=use_qk_l2norm, write_pool=True,
        config=config, interpret=interpret,
    )  # fmt: skip
    return o, jax.freeze(pool_ref)


def fused_gating_recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    A_log: jax.Array,  # noqa: N803 (the model's parameter name)
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    config: RecurrentConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``fused_recurrent_gated_delta_rule`` with the Qwen3-Next gating done in the kernel.

    A_log, dt_bias ``[HV]``; a, b ``[N, D, HV]`` (any float dtype); the kernel computes
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` in float32.
    Other arguments and results as ``fused_recurrent_gated_delta_rule``.
    """
    _check(unsupported_reason(q, k, v, a, b, ssm_pool, state_indices))
    hv = v.shape[2]
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"A_log {A_log.shape} and dt_bias {dt_bias.shape} must be [HV] = [{hv}]")
    config = config or pick_config(q.shape[0], hv, v.shape[3])
    pool_ref = jax.new_ref(ssm_pool)
    o = _recurrent(
        q, k, v, (A_log, a, dt_bias, b), pool_ref, state_indices,
        scale=_scale(q, scale), use_qk_l2norm=use_qk_l2norm, write_pool=True,
        config=config, interpret=interpret,
    )  # fmt: skip
    return o, jax.freeze(pool_ref)


def verify_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    config: RecurrentConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """D draft tokens per row from ``pool[idx[n]]``, pool read-only.

    Arguments as ``fused_recurrent_gated_delta_rule``, plus ``parents``: None (a chain) or
    int32 ``[N, D]`` tree drafts, token t starting from the state after token
    ``parents[n, t]`` (-1 at the root: the slot). Returns (o ``[N, D, HV, V]``;
    intermediates float32 ``[N, D, HV, K, V]``, ``intermediates[n, t]`` = the state after token
    ``t``); both are zeros on padded rows.
    """
    reason = unsupported_reason(q, k, v, g, beta, ssm_pool, state_indices, parents=parents)
    _check(reason or _gate_reason(g, beta))
    config = config or pick_config(q.shape[0], v.shape[2], v.shape[3])
    o, intermediates = _recurrent(
        q, k, v, (g, beta), ssm_pool, state_indices,
        scale=_scale(q, scale), use_qk_l2norm=use_qk_l2norm, write_pool=False,
        config=config, interpret=interpret, parents=parents,
    )  # fmt: skip
    return o, intermediates
