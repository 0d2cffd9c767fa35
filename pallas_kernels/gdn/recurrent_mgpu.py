"""Gated DeltaNet speculative verify as a Mosaic GPU kernel (sm_90); decode is ``decode_mgpu``.

One program per (row ``n``, value head ``h``, block of ``block_v`` value columns ``j``): it
reads the ``[K, block_v]`` tile of ``pool[idx[n], h]`` through TMA into SMEM, runs the ``D``
draft tokens of the row on it in registers and writes the state after every token to
``intermediates``; the pool is only read. The tile is independent of every other tile: the
delta rule only mixes the K axis, so splitting V costs nothing but re-reading
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
zeros to ``o`` and to ``intermediates``. This is stricter than the contract (which lets
the pad slot be read and written) and avoids every padded row of a bucket racing on slot 0.

Entries: ``verify_gated_delta_rule`` (the public verify op's arguments plus ``interpret`` and
``config``) and ``unsupported_reason`` (the decode kernel's row rules plus the tree's).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import NUM_SMS, interpret_params
from pallas_kernels.gdn import decode_mgpu
from pallas_kernels.gdn._decode_grids import load_token

__all__ = [
    "MAX_TOKENS",
    "RecurrentConfig",
    "pick_config",
    "unsupported_reason",
    "verify_gated_delta_rule",
]

_STATE = plgpu.Layout.WGMMA  # [K, block_v]
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [K]: one value per state row
_COL = plgpu.Layout.WGMMA.reduce(0)  # [block_v]: one value per state column

# The decode kernel's limit, which verify shares: the D tokens of q/k/v/o live in SMEM next
# to the two state tiles of a chain (the tree's D+1 tiles have their own budget below).
MAX_TOKENS = decode_mgpu.MAX_TOKENS
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
    if n_rows * hv * (v_dim // block_v) < 2 * NUM_SMS and v_dim % 32 == 0:
        block_v = 32
    return RecurrentConfig(block_v=block_v)


def _tree_config(config: RecurrentConfig, n_tokens: int, k_dim: int) -> RecurrentConfig:
    """``config`` with ``block_v`` halved until the ``D+1`` state tiles fit the SMEM budget."""
    bv = config.block_v
    while (n_tokens + 1) * k_dim * bv * 4 > TREE_SMEM_BYTES and bv > _MIN_BLOCK_V:
        bv //= 2
    swizzle = min(config.swizzle, bv * 4)  # a swizzle row may not exceed a tile row
    return RecurrentConfig(block_v=bv, swizzle=swizzle)


def _verify(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float,
    use_qk_l2norm: bool,
    config: RecurrentConfig,
    interpret: bool,
    parents: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """The kernel call: ``(o, intermediates)``. ``parents``: None (chain) or int32 ``[N, D]``."""
    n_rows, n_tokens, h, k_dim = q.shape
    hv, v_dim = v.shape[2:]
    group = hv // h
    tree = parents is not None
    if tree:
        config = _tree_config(config, n_tokens, k_dim)
    bv = config.block_v

    def body(*refs):
        parents_ref = None
        if tree:  # parents come right after idx; the rest keeps the chain's positions
            parents_ref, refs = refs[1], refs[:1] + refs[2:]
        idx_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, pool_ref, o_ref, inter_ref = refs[:9]
        state_smem, q_smem, k_smem, v_smem, o_smem, barrier = refs[9:]

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
                q_t, k_t, v_t, q_scale = load_token(
                    q_smem, k_smem, v_smem, t, row=_ROW, col=_COL, scale=scale,
                    use_qk_l2norm=use_qk_l2norm,
                )  # fmt: skip
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
                else:
                    buf = state_smem.at[t % 2]
                    if t >= 2:
                        # The copy of token t-2 out of this buffer must have read it.
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                buf[...] = state
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(buf, inter_ref.at[n, t, head, :, cols])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_tile)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(slot == 0)
        def _padded_row():
            # No pool access at all: padded rows of a bucket all name slot 0, whose state
            # nobody needs (reading it would be needless traffic).
            zeros = plgpu.layout_cast(jnp.zeros((bv,), jnp.float32), _COL)
            for t in range(n_tokens):
                o_smem[t] = zeros.astype(o_smem.dtype)
            state_smem[0] = plgpu.layout_cast(jnp.zeros((k_dim, bv), jnp.float32), _STATE)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_tile)
            for t in range(n_tokens):
                plgpu.copy_smem_to_gmem(state_smem.at[0], inter_ref.at[n, t, head, :, cols])
            plgpu.wait_smem_to_gmem(0)

    inter_shape = (n_rows, n_tokens, hv, k_dim, v_dim)
    out_type = (
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(inter_shape, jnp.float32),
    )
    transforms = ()
    if config.swizzle:
        tile_cols = config.swizzle // 4  # fp32: one swizzle row
        transforms = (plgpu.TilingTransform((8, tile_cols)), plgpu.SwizzleTransform(config.swizzle))
    n_tiles = n_tokens + 1 if tree else 2  # a chain double-buffers its copies out
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
        interpret=interpret_params(interpret),
        kernel_name="gdn_recurrent",
    )
    # parents flat [N*D]: a scalar load from a 1-D GMEM ref, as for state_indices.
    tree_args = (parents.reshape(-1),) if tree else ()
    return kernel(state_indices, *tree_args, q, k, v, g, beta, ssm_pool)


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
    """Why the verify kernel cannot take this call, in one sentence; None if it can.

    The rows must suit the decode kernel (``decode_mgpu.unsupported_reason``: the same
    arguments); ``parents``, when given, must be int32 ``[N, D]`` and its ``D+1`` state
    tiles must fit ``TREE_SMEM_BYTES``.
    """
    args = (q, k, v, g, beta, ssm_pool, state_indices)
    reason = decode_mgpu.unsupported_reason(*args, scale=scale, use_qk_l2norm=use_qk_l2norm)
    if reason is not None or parents is None:
        return reason
    n_rows, n_tokens, _, k_dim = q.shape
    if parents.shape != (n_rows, n_tokens) or parents.dtype != jnp.int32:
        got = f"{parents.dtype}{list(parents.shape)}"
        return f"parents {got} must be int32 [{n_rows}, {n_tokens}]"
    if (n_tokens + 1) * k_dim * _MIN_BLOCK_V * 4 > TREE_SMEM_BYTES:
        return (
            f"a tree of D={n_tokens} tokens needs D+1 state tiles of [K={k_dim}, "
            f"{_MIN_BLOCK_V}] in SMEM, over the {TREE_SMEM_BYTES // 1024} KiB budget"
        )
    return None


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

    q, k ``[N, D, H, K]``; v ``[N, D, HV, V]``; g, beta float32 ``[N, D, HV]``; ssm_pool
    float32 ``[S, HV, K, V]``; state_indices int32 ``[N]`` (0 = padded row); ``parents``: None
    (a chain) or int32 ``[N, D]`` tree drafts, token t starting from the state after token
    ``parents[n, t]`` (-1 at the root: the slot). Returns (o ``[N, D, HV, V]``;
    intermediates float32 ``[N, D, HV, K, V]``, ``intermediates[n, t]`` = the state after token
    ``t``); both are zeros on padded rows.
    """
    reason = unsupported_reason(q, k, v, g, beta, ssm_pool, state_indices, parents=parents)
    if reason is not None:
        raise ValueError(reason)
    config = config or pick_config(q.shape[0], v.shape[2], v.shape[3])
    return _verify(
        q, k, v, g, beta, ssm_pool, state_indices,
        scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
        use_qk_l2norm=use_qk_l2norm, config=config, interpret=interpret, parents=parents,
    )  # fmt: skip
