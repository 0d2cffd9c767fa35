"""Mamba2 token path (decode and speculative verify) as Mosaic GPU kernels (sm_90).

One program per (row ``n``, head ``h``, block of ``block_p`` state rows ``j``): it reads the
``[block_p, N]`` tile of ``pool[idx[n], h]`` (contiguous: whole state rows) through TMA into
SMEM, runs the ``Dt`` tokens of the row on it in registers and writes the tile back (decode)
or writes the state after every token to ``intermediates`` (verify). Tiles are independent:
the recurrence is elementwise in ``P`` (each state row only sees its own ``x``), so splitting
``P`` costs nothing but re-reading ``B``/``C``. The layout follows ``gdn/recurrent_mgpu.py``
(read its docstring and ``benchmarks/notes.md`` for what works in Mosaic GPU 0.11.2).

Register layouts: the state tile is a WGMMA-layout array ``[block_p, N]``; ``x_t``, ``z_t``
and ``y_t`` are ``[block_p]`` in ``WGMMA.reduce(1)`` (one value per state row); ``B_t`` and
``C_t`` are ``[N]`` in ``WGMMA.reduce(0)`` (one value per state column), so ``S C`` is a row
sum. ``dt``, ``A``, ``D`` and ``dt_bias`` are scalars read from GMEM.

Tree drafts (verify with ``parents``): the program keeps the state after every token in its
own SMEM tile (``Dt+1`` tiles: the root, then one per token, each copied out to
``intermediates`` and never overwritten); token ``t`` starts from its parent's tile,
``parents[n, t] + 1``. The tiles must fit ``TREE_SMEM_BYTES``: with ``block_p`` = 64 and
N = 128 (32 KiB a tile) that is Dt <= 4, with N = 64 Dt <= 9; larger trees are refused by
``unsupported_reason`` (``impl="auto"`` then takes the reference).

Padded rows (``state_indices[n] == 0``): the program touches no pool memory and writes zeros
to ``y`` (and to ``intermediates``), so the padded rows of a bucket never race on slot 0.

Checked in the Mosaic GPU interpreter (values), by lowering for ``cuda`` on the CPU (layouts,
TMA shapes) and on an H200 (``tests/kernels/test_mamba2_gpu.py``); timings in
``benchmarks/RESULTS.md``.

Entries: ``selective_state_update`` (pool updated in place under ``jit`` with the pool
donated), ``verify_selective_state_update`` (pool read-only) and ``unsupported_reason``. Each
takes the public op's arguments plus ``interpret`` and an optional ``config``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import interpret_params

__all__ = [
    "MAX_TOKENS",
    "TREE_SMEM_BYTES",
    "StateUpdateConfig",
    "selective_state_update",
    "unsupported_reason",
    "verify_selective_state_update",
]

_STATE = plgpu.Layout.WGMMA  # [block_p, N]
_ROW = plgpu.Layout.WGMMA.reduce(1)  # [block_p]: one value per state row
_COL = plgpu.Layout.WGMMA.reduce(0)  # [N]: one value per state column

_HEAD_DIMS = (64, 128)  # P
_STATE_DIMS = (64, 128)  # N
_ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Dt tokens of x/B/C/z/y live in SMEM next to the state tiles; 16 covers every speculative
# depth in use and keeps the program far under the SMEM limit.
MAX_TOKENS = 16
# SMEM for the Dt+1 state tiles of a tree verify; the rest of an sm_90 block's SMEM_BYTES
# (pallas_kernels._common) holds the x/B/C/z/y tiles.
TREE_SMEM_BYTES = 160 * 1024


@dataclasses.dataclass(frozen=True)
class StateUpdateConfig:
    """Static tiling of one call: ``block_p`` state rows per program (64: a WGMMA-layout
    array has a multiple of 64 rows; with P=64, N=128 one program holds a contiguous 32 KiB
    tile, the size the Gated DeltaNet decode kernel streams at near the copy bandwidth)."""

    block_p: int = 64


def _softplus(x: jax.Array) -> jax.Array:
    # max(x, 0) + log(1 + exp(-|x|)): overflow-free, and only exp/log/abs, which lower for
    # scalars in Mosaic GPU (log1p does not).
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def _state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    z: jax.Array | None,
    ssm_pool: jax.Array | jax.Ref,
    state_indices: jax.Array,
    *,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    write_pool: bool,
    config: StateUpdateConfig,
    interpret: bool,
    parents: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The kernel call. With ``write_pool`` the pool must be a mutable ref and the result is
    ``y``; without it the pool is only read and the result is ``(y, intermediates)``.
    ``parents`` (verify only): int32 ``[N, Dt]`` tree of every row."""
    n_rows, n_tokens, n_heads, p_dim = x.shape
    n_groups, n_dim = B.shape[2:]
    per_group = n_heads // n_groups
    bp = config.block_p
    has_z = z is not None
    tree = parents is not None
    n_in = 9 + has_z  # idx, x, dt, A, B, C, D, dt_bias, [z], pool

    def body(*refs):
        parents_ref = None
        if tree:  # parents come right after idx; the rest keeps the chain's positions
            parents_ref, refs = refs[1], refs[:1] + refs[2:]
        idx_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, bias_ref = refs[:8]
        z_ref = refs[8] if has_z else None
        pool_ref = refs[n_in - 1]
        y_ref = refs[n_in]
        inter_ref = None if write_pool else refs[n_in + 1]
        n_out = 1 if write_pool else 2
        scratch = list(refs[n_in + n_out :])
        state_smem, x_smem, b_smem, c_smem = scratch[:4]
        z_smem = scratch[4] if has_z else None
        y_smem, barrier = scratch[-2:]

        n = lax.axis_index("n")
        head = lax.axis_index("h")
        rows = pl.ds(lax.axis_index("j") * bp, bp)
        group = head // per_group
        slot = idx_ref[n]
        tile = pool_ref.at[slot, head, rows, :]
        y_tile = y_ref.at[n, :, head, rows]

        @pl.when(slot != 0)
        def _real_row():
            # One barrier, one arrival per TMA with its byte count.
            plgpu.copy_gmem_to_smem(tile, state_smem.at[0], barrier)
            plgpu.copy_gmem_to_smem(x_ref.at[n, :, head, rows], x_smem, barrier)
            plgpu.copy_gmem_to_smem(b_ref.at[n, :, group], b_smem, barrier)
            plgpu.copy_gmem_to_smem(c_ref.at[n, :, group], c_smem, barrier)
            if has_z:
                plgpu.copy_gmem_to_smem(z_ref.at[n, :, head, rows], z_smem, barrier)
            plgpu.barrier_wait(barrier)
            a = a_ref[head]
            d = d_ref[head]
            bias = bias_ref[head]
            state = plgpu.load(state_smem.at[0], layout=_STATE)
            for t in range(n_tokens):
                if tree and t > 0:
                    # The root's parent is -1 (tile 0, already in registers); every other
                    # token reloads its parent's tile, stored by this thread in this layout.
                    parent = parents_ref[n * n_tokens + t]
                    state = plgpu.load(state_smem.at[parent + 1], layout=_STATE)
                x_t = plgpu.load(x_smem.at[t], layout=_ROW).astype(jnp.float32)
                b_t = plgpu.load(b_smem.at[t], layout=_COL).astype(jnp.float32)
                c_t = plgpu.load(c_smem.at[t], layout=_COL).astype(jnp.float32)
                dt_t = dt_ref[n, t, head].astype(jnp.float32) + bias
                if dt_softplus:
                    dt_t = _softplus(dt_t)
                # Infinite limits are left out rather than lowered as inf constants.
                if math.isfinite(dt_min):
                    dt_t = jnp.maximum(dt_t, jnp.float32(dt_min))
                if math.isfinite(dt_max):
                    dt_t = jnp.minimum(dt_t, jnp.float32(dt_max))
                decay = jnp.exp(dt_t * a)
                x_rows = lax.broadcast_in_dim(x_t * dt_t, state.shape, [0])
                state = state * decay + x_rows * lax.broadcast_in_dim(b_t, state.shape, [1])
                y_t = jnp.sum(state * lax.broadcast_in_dim(c_t, state.shape, [1]), axis=1)
                y_t = y_t + x_t * d
                if has_z:
                    z_t = plgpu.load(z_smem.at[t], layout=_ROW).astype(jnp.float32)
                    y_t = y_t * z_t / (1.0 + jnp.exp(-z_t))
                y_smem[t] = y_t.astype(y_smem.dtype)
                if tree:
                    buf = state_smem.at[t + 1]  # never overwritten: no wait before the store
                    buf[...] = state
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, inter_ref.at[n, t, head, rows, :])
                elif not write_pool:
                    buf = state_smem.at[t % 2]
                    if t >= 2:
                        # The copy of token t-2 out of this buffer must have read it.
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    buf[...] = state
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(buf, inter_ref.at[n, t, head, rows, :])
            if write_pool:
                state_smem[0] = state
            plgpu.commit_smem()
            if write_pool:
                plgpu.copy_smem_to_gmem(state_smem.at[0], tile)
            plgpu.copy_smem_to_gmem(y_smem, y_tile)
            plgpu.wait_smem_to_gmem(0)

        @pl.when(slot == 0)
        def _padded_row():
            # No pool access at all: padded rows of a bucket all name slot 0.
            zeros = plgpu.layout_cast(jnp.zeros((bp,), jnp.float32), _ROW)
            for t in range(n_tokens):
                y_smem[t] = zeros.astype(y_smem.dtype)
            if not write_pool:
                state_smem[0] = plgpu.layout_cast(jnp.zeros((bp, n_dim), jnp.float32), _STATE)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_smem, y_tile)
            if not write_pool:
                for t in range(n_tokens):
                    plgpu.copy_smem_to_gmem(state_smem.at[0], inter_ref.at[n, t, head, rows, :])
            plgpu.wait_smem_to_gmem(0)

    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out_type = y_type
    if not write_pool:
        inter_shape = (n_rows, n_tokens, n_heads, p_dim, n_dim)
        out_type = (y_type, jax.ShapeDtypeStruct(inter_shape, jnp.float32))
    n_tiles = n_tokens + 1 if tree else 1 if write_pool else 2
    scratch_types = [
        plgpu.SMEM((n_tiles, bp, n_dim), jnp.float32),
        plgpu.SMEM((n_tokens, bp), x.dtype),
        plgpu.SMEM((n_tokens, n_dim), B.dtype),
        plgpu.SMEM((n_tokens, n_dim), C.dtype),
    ]
    if has_z:
        scratch_types.append(plgpu.SMEM((n_tokens, bp), z.dtype))
    scratch_types += [
        plgpu.SMEM((n_tokens, bp), x.dtype),
        plgpu.Barrier(num_arrivals=4 + has_z),
    ]
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(n_rows, n_heads, p_dim // bp),
        grid_names=("n", "h", "j"),
        scratch_types=scratch_types,
        interpret=interpret_params(interpret),
        kernel_name="mamba2_state_update",
    )
    operands = (x, dt, A, B, C, D, dt_bias, *((z,) if has_z else ()), ssm_pool)
    # parents flat [N*Dt]: a scalar load from a 1-D GMEM ref, as for state_indices.
    tree_args = (parents.reshape(-1),) if tree else ()
    return kernel(state_indices, *tree_args, *operands)


def unsupported_reason(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    z: jax.Array | None = None,
    parents: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
) -> str | None:
    """Why the kernels of this module cannot take this call, in one sentence; None if they can.

    Covers decode and verify alike (same arguments; ``parents`` only for verify).
    """
    del dt_softplus, dt_min, dt_max
    if x.ndim != 4:
        return f"x {x.shape} must be [N, Dt, H, P]"
    n_rows, n_tokens, n_heads, p_dim = x.shape
    if B.ndim != 4 or B.shape[:2] != (n_rows, n_tokens) or C.shape != B.shape:
        return f"B {B.shape} and C {C.shape} must both be [N, Dt, G, N] with N, Dt = {x.shape[:2]}"
    n_groups, n_dim = B.shape[2:]
    if n_groups == 0 or n_heads % n_groups:
        return f"H={n_heads} is not a multiple of G={n_groups}"
    if p_dim not in _HEAD_DIMS:
        return f"P={p_dim}: the kernel supports head dims {_HEAD_DIMS} only"
    if n_dim not in _STATE_DIMS:
        return f"N={n_dim}: the kernel supports state sizes {_STATE_DIMS} only"
    if not 1 <= n_tokens <= MAX_TOKENS:
        return f"Dt={n_tokens} tokens per row is outside 1..{MAX_TOKENS}"
    if x.dtype not in _ACTIVATION_DTYPES:
        return f"x is {x.dtype}; the kernel takes bfloat16 or float32 activations"
    for name, v in (("B", B), ("C", C), ("z", z)):
        if v is not None and v.dtype != x.dtype:
            return f"{name} is {v.dtype}; it must be x's dtype {x.dtype}"
    if z is not None and z.shape != x.shape:
        return f"z {z.shape} must be x's shape {x.shape}"
    if dt.shape != (n_rows, n_tokens, n_heads) or dt.dtype not in _ACTIVATION_DTYPES:
        return f"dt {dt.dtype}{list(dt.shape)} must be float32 or bfloat16 [N, Dt, H]"
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if v.shape != (n_heads,) or v.dtype != jnp.float32:
            return f"{name} {v.dtype}{list(v.shape)} must be float32 [{n_heads}]"
    want_pool = (n_heads, p_dim, n_dim)
    if ssm_pool.dtype != jnp.float32 or ssm_pool.ndim != 4 or ssm_pool.shape[1:] != want_pool:
        got = f"{ssm_pool.dtype}{list(ssm_pool.shape)}"
        return f"ssm_pool {got} must be float32 [S, {n_heads}, {p_dim}, {n_dim}]"
    if state_indices.shape != (n_rows,) or state_indices.dtype != jnp.int32:
        got = f"{state_indices.dtype}{list(state_indices.shape)}"
        return f"state_indices {got} must be int32 [{n_rows}]"
    if parents is not None:
        if parents.shape != (n_rows, n_tokens) or parents.dtype != jnp.int32:
            got = f"{parents.dtype}{list(parents.shape)}"
            return f"parents {got} must be int32 [{n_rows}, {n_tokens}]"
        tile = StateUpdateConfig().block_p * n_dim * 4
        if (n_tokens + 1) * tile > TREE_SMEM_BYTES:
            return (
                f"a tree of Dt={n_tokens} tokens needs Dt+1 state tiles of {tile // 1024} KiB "
                f"in SMEM, over the {TREE_SMEM_BYTES // 1024} KiB budget (at most "
                f"Dt={TREE_SMEM_BYTES // tile - 1} with N={n_dim})"
            )
    if n_rows == 0:
        return "N=0 rows: nothing to launch"
    return None


def _check(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


def selective_state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    z: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    interpret: bool = False,
    config: StateUpdateConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dt tokens per row from ``pool[idx[n]]``; the final state is written back in place.

    x ``[N, Dt, H, P]``; dt ``[N, Dt, H]``; A, D, dt_bias float32 ``[H]``; B, C
    ``[N, Dt, G, N]``; ssm_pool float32 ``[S, H, P, N]``; state_indices int32 ``[N]`` (0 =
    padded row); z optional like x. Returns (y ``[N, Dt, H, P]`` in x's dtype, zeros on padded
    rows; ssm_pool). Under ``jit`` with ``ssm_pool`` donated the pool is updated in place;
    slot 0 is never touched.
    """
    args = (x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices)
    _check(unsupported_reason(*args, z=z))
    pool_ref = jax.new_ref(ssm_pool)
    y = _state_update(
        x, dt, A, B, C, D, dt_bias, z, pool_ref, state_indices,
        dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max, write_pool=True,
        config=config or StateUpdateConfig(), interpret=interpret,
    )  # fmt: skip
    return y, jax.freeze(pool_ref)


def verify_selective_state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    z: jax.Array | None = None,
    parents: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    interpret: bool = False,
    config: StateUpdateConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dt draft tokens per row from ``pool[idx[n]]``, pool read-only.

    Arguments as ``selective_state_update``, plus ``parents``: None (a chain) or int32
    ``[N, Dt]`` tree drafts, token t starting from the state after token ``parents[n, t]``.
    Returns (y ``[N, Dt, H, P]``; intermediates float32 ``[N, Dt, H, P, N]``,
    ``intermediates[n, t]`` = the state after token ``t``); both are zeros on padded rows.
    """
    args = (x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices)
    _check(unsupported_reason(*args, z=z, parents=parents))
    return _state_update(
        x, dt, A, B, C, D, dt_bias, z, ssm_pool, state_indices,
        dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max, write_pool=False,
        config=config or StateUpdateConfig(), interpret=interpret, parents=parents,
    )  # fmt: skip
