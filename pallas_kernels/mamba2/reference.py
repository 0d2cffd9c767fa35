"""Plain-jnp Mamba2 (SSD): the token-by-token oracle and the chunked fallback.

Semantics (per head ``h`` of ``H``, group ``g = h // (H // G)``, state ``S`` in ``[P, N]``)::

    dt_t = softplus(dt_raw_t + dt_bias[h])        (or dt_raw_t + dt_bias[h] without dt_softplus)
    dt_t = clip(dt_t, dt_min, dt_max)
    S = exp(dt_t A[h]) S + dt_t x_t[h] B_t[g]^T;  y_t[h] = S C_t[g] + D[h] x_t[h]
    y_t[h] = y_t[h] silu(z_t[h])                  (only when z is given)

Entries (same arguments and results as the public ops, which validate them; nothing is
checked here):

* ``ssd_chunk_scan_recurrent``: THE oracle. A ``lax.scan`` over the packed tokens, one token per
  step; it carries the running state and the pool, resets the state at each sequence's first
  token and writes the pool at its last one.
* ``ssd_chunk_scan_chunked``: the same contract in chunks of 64 tokens, the
  ``impl="reference"`` path of ``ssd_chunk_scan`` and the plain-jnp baseline of the benchmarks.
* ``selective_state_update`` / ``verify_selective_state_update``: the ``[N, Dt]`` rows layout of
  decode and verify, token by token over ``Dt`` (a Python loop: ``Dt`` is static and small), so
  they are oracles too. A row whose slot is the pad slot 0 is a padded row: its outputs (and
  intermediates) are zeros and it writes nothing. The commit that ends speculation is
  ``pallas_kernels.commit.commit_steps``.

The chunked version uses the tile layout of ``pallas_kernels._varlen`` (masked tokens get
``dt = 0``, which makes them no-ops: no decay and no input). Per tile, with ``c`` the in-chunk
cumulative sum of ``dt A``:

1. every tile at once (batched): ``y_intra[i] = sum_{j <= i} (C_i . B_j) exp(c_i - c_j) dt_j x_j``,
   the tile's own end-state contribution ``sum_j exp(c_last - c_j) dt_j x_j B_j^T`` and its decay
   ``exp(c_last)``;
2. one ``lax.scan`` over the tiles carrying the running state and the pool: a tile that starts
   a sequence loads ``pool[idx[n]]`` (or zeros), a tile that ends one writes its end state; the
   start state's share of the outputs, ``exp(c_i) S0 C_i``, is taken in the loop so that no
   per-tile state is kept.

Computation is in float32, or float64 when an input is float64 (oracles under
``jax_enable_x64``); outputs take ``x``'s dtype, pools keep theirs. Matmuls ask for HIGHEST
precision so that on a GPU the reference is not silently TF32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._tree import start_of_node
from pallas_kernels._varlen import num_tiles, tile_layout, token_segments
from pallas_kernels.commit import write_where

__all__ = [
    "CHUNK",
    "prepare_dt",
    "selective_state_update",
    "ssd_chunk_scan_chunked",
    "ssd_chunk_scan_recurrent",
    "verify_selective_state_update",
]

CHUNK = 64
_PRECISION = lax.Precision.HIGHEST


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=_PRECISION)


def _compute_dtype(*arrays: jax.Array | None) -> jnp.dtype:
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays if a is not None))


def _prepare(args: tuple, z: jax.Array | None) -> tuple[tuple[jax.Array, ...], jax.Array | None]:
    """NumPy inputs become jax arrays: the references are called directly by tests."""
    return tuple(jnp.asarray(a) for a in args), None if z is None else jnp.asarray(z)


def prepare_dt(
    dt: jax.Array,
    dt_bias: jax.Array,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    dtype: jnp.dtype,
) -> jax.Array:
    """``[..., H]`` raw dt -> the dt of the recurrence, in ``dtype`` (bias, softplus, clip)."""
    dt = dt.astype(dtype) + dt_bias.astype(dtype)
    if dt_softplus:
        dt = jnp.logaddexp(dt, 0)
    return jnp.clip(dt, dt_min, dt_max)


def _gate(y: jax.Array, z: jax.Array | None) -> jax.Array:
    if z is None:
        return y
    z = z.astype(y.dtype)
    return y * z * jax.nn.sigmoid(z)


def _heads(bc: jax.Array, n_heads: int) -> jax.Array:
    """``[..., G, N]`` -> ``[..., H, N]``: head h reads group ``h // (H // G)``."""
    return jnp.repeat(bc, n_heads // bc.shape[-2], axis=-2)


def _step(
    state: jax.Array,
    x_t: jax.Array,
    dt_t: jax.Array,
    a: jax.Array,
    b_t: jax.Array,
    c_t: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token, every head. state ``[..., H, P, N]``; x_t ``[..., H, P]``; dt_t ``[..., H]``
    (prepared); a ``[H]``; b_t, c_t ``[..., H, N]`` (heads repeated). Returns (new state,
    ``S C`` ``[..., H, P]``, without the D skip). Broadcast-and-sum, not einsums: exact float32
    on any backend, and fused by XLA into memory-bound loops."""
    decay = jnp.exp(dt_t * a)[..., None, None]
    state = decay * state + (dt_t[..., None] * x_t)[..., :, None] * b_t[..., None, :]
    return state, jnp.sum(state * c_t[..., None, :], axis=-1)


def _initial_state(
    pool: jax.Array, slot: jax.Array, has_initial_state: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    # where, not a multiply: the pad slot may hold NaN, and 0 * NaN is NaN.
    return jnp.where(has_initial_state, pool[slot].astype(dtype), 0)


def ssd_chunk_scan_recurrent(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's name)
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
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token oracle of ``ssd_chunk_scan`` (same arguments and results)."""
    args, z = _prepare(
        (x, dt, A, B, C, D, dt_bias, ssm_pool, qsl, state_indices, has_initial_state), z
    )
    x, dt, A, B, C, D, dt_bias, ssm_pool, qsl, state_indices, has_initial_state = args
    t_total, n_heads = x.shape[:2]
    if t_total == 0 or state_indices.shape[0] == 0:
        return jnp.zeros_like(x), ssm_pool
    dtype = _compute_dtype(x, dt, A, B, C, D, dt_bias, ssm_pool, z)
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, dtype)
    a = A.astype(dtype)
    seq, first, last, valid = token_segments(qsl, t_total)

    def token(carry, xs):
        state, pool = carry
        x_t, dt_t, b_t, c_t, n, first_t, last_t = xs
        slot = state_indices[n]
        init = _initial_state(pool, slot, has_initial_state[n], dtype)
        state = jnp.where(first_t, init, state)
        state, y_t = _step(state, x_t, dt_t, a, b_t, c_t)
        return (state, write_where(pool, slot, state, last_t)), y_t

    state0 = jnp.zeros(ssm_pool.shape[1:], dtype)
    bh, ch = (_heads(m.astype(dtype), n_heads) for m in (B, C))
    xs = (x.astype(dtype), dt, bh, ch, seq, first, last)
    (_, pool), y = lax.scan(token, (state0, ssm_pool), xs)
    y = _gate(y + D.astype(dtype)[:, None] * x.astype(dtype), z)
    return jnp.where(valid[:, None, None], y, 0).astype(x.dtype), pool


def ssd_chunk_scan_chunked(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's name)
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
) -> tuple[jax.Array, jax.Array]:
    """Chunked (64-token tiles) ``ssd_chunk_scan``; same arguments and results."""
    args, z = _prepare(
        (x, dt, A, B, C, D, dt_bias, ssm_pool, qsl, state_indices, has_initial_state), z
    )
    x, dt, A, B, C, D, dt_bias, ssm_pool, qsl, state_indices, has_initial_state = args
    t_total, n_heads, p_dim = x.shape
    n_seq = state_indices.shape[0]
    if t_total == 0 or n_seq == 0:
        return jnp.zeros_like(x), ssm_pool
    n_groups, n_dim = B.shape[1:]
    per_group = n_heads // n_groups
    dtype = _compute_dtype(x, dt, A, B, C, D, dt_bias, ssm_pool, z)
    lay = tile_layout(qsl, t_total, num_tiles(t_total, n_seq, CHUNK), CHUNK)

    def tiles(v: jax.Array) -> jax.Array:
        """``[T, ...]`` -> ``[tiles, CHUNK, ...]``, zero where masked."""
        mask = lay["mask"].reshape(lay["mask"].shape + (1,) * (v.ndim - 1))
        return jnp.where(mask, v.astype(dtype)[lay["token"]], 0)

    # Heads as [G, R]: B and C stay per group (never repeated over the heads of a group).
    xt = tiles(x).reshape(-1, CHUNK, n_groups, per_group, p_dim)
    dtt = tiles(prepare_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, dtype))
    dtt = dtt.reshape(-1, CHUNK, n_groups, per_group)
    bt, ct = tiles(B), tiles(C)
    a = A.astype(dtype).reshape(n_groups, per_group)
    cum = jnp.cumsum(dtt * a, axis=1)  # [tiles, CHUNK, G, R]
    rows = jnp.arange(CHUNK)
    causal = rows[:, None] >= rows[None, :]
    diff = cum[:, :, None] - cum[:, None, :]  # [tiles, i, j, G, R]
    # The masked exponent is zeroed before exp: above the diagonal it is positive and may
    # overflow, and inf * 0 would be NaN.
    mask = causal[None, :, :, None, None]
    decay = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0)), 0)
    scores = _einsum("cigk,cjgk->cijg", ct, bt)[..., None] * decay
    dtx = dtt[..., None] * xt
    y_intra = _einsum("cijgr,cjgrp->cigrp", scores, dtx)
    to_end = jnp.exp(cum[:, -1:] - cum)  # [tiles, CHUNK, G, R]
    tile_state = _einsum("cjgrp,cjgk->cgrpk", to_end[..., None] * dtx, bt)
    tile_decay = jnp.exp(cum[:, -1])  # [tiles, G, R]
    from_start = jnp.exp(cum)

    def chunk(carry, xs):
        state, pool = carry
        tile_state, tile_decay, c_tile, from_start, n, first, last = xs
        slot = state_indices[n]
        init = _initial_state(pool, slot, has_initial_state[n], dtype)
        s0 = jnp.where(first, init, state).reshape(n_groups, per_group, p_dim, n_dim)
        y_state = from_start[..., None] * _einsum("grpk,igk->igrp", s0, c_tile)
        s1 = tile_decay[..., None, None] * s0 + tile_state
        s1 = s1.reshape(n_heads, p_dim, n_dim)
        return (s1, write_where(pool, slot, s1, last)), y_state

    state0 = jnp.zeros(ssm_pool.shape[1:], dtype)
    xs = (tile_state, tile_decay, ct, from_start, lay["seq"], lay["first"], lay["last"])
    (_, pool), y_state = lax.scan(chunk, (state0, ssm_pool), xs)
    y_tiles = (y_intra + y_state).reshape(-1, CHUNK, n_heads, p_dim)
    y = y_tiles[lay["out_tile"], lay["out_row"]]
    y = _gate(y + D.astype(dtype)[:, None] * x.astype(dtype), z)
    return jnp.where(lay["valid"][:, None, None], y, 0).astype(x.dtype), pool


def _rows(
    args: tuple[jax.Array, ...],
    z: jax.Array | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    keep_all: bool,
    parents: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Dt tokens of every row from its slot; padded rows (slot 0) are zeroed.

    Returns y ``[N, Dt, H, P]`` and the states after each token ``[N, Dt, H, P, N]`` (only
    the last one, ``[N, 1, H, P, N]``, unless ``keep_all``), both in the computation dtype.
    With ``parents`` (``[N, Dt]``, a tree per row) token t starts from its parent's state.
    """
    x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices = args
    n_heads = x.shape[2]
    dtype = _compute_dtype(x, dt, A, B, C, D, dt_bias, ssm_pool, z)
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, dtype)
    bh, ch = (_heads(m.astype(dtype), n_heads) for m in (B, C))
    xw, a = x.astype(dtype), A.astype(dtype)
    history = [ssm_pool[state_indices].astype(dtype)]
    outs = []
    for t in range(x.shape[1]):
        state = start_of_node(history, parents, t)
        state, y = _step(state, xw[:, t], dt[:, t], a, bh[:, t], ch[:, t])
        outs.append(y)
        history.append(state)
    states = history[1:]
    y = _gate(jnp.stack(outs, axis=1) + D.astype(dtype)[:, None] * xw, z)
    real = (state_indices != 0)[:, None, None, None]
    kept = jnp.stack(states if keep_all else states[-1:], axis=1)
    return jnp.where(real, y, 0), jnp.where(real[..., None], kept, 0)


def selective_state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's name)
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
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token ``selective_state_update`` (same arguments and results)."""
    args, z = _prepare((x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices), z)
    y, last = _rows(args, z, dt_softplus, dt_min, dt_max, keep_all=False)
    ssm_pool, state_indices = args[7:]
    pool = write_where(ssm_pool, state_indices, last[:, 0], state_indices != 0)
    return y.astype(args[0].dtype), pool


def verify_selective_state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's name)
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
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token ``verify_selective_state_update`` (same arguments and results); with
    ``parents`` each token starts from its parent's state (tree drafts)."""
    args, z = _prepare((x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices), z)
    parents = None if parents is None else jnp.asarray(parents)
    y, states = _rows(args, z, dt_softplus, dt_min, dt_max, keep_all=True, parents=parents)
    return y.astype(args[0].dtype), states.astype(args[7].dtype)
