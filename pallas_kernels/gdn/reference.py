"""Plain-jnp Gated DeltaNet: the token-by-token oracle and the chunked fallback.

Semantics (per value head ``h``, key head ``h // (HV // H)``, state ``S`` in ``[K, V]``)::

    q, k <- x / sqrt(|x|^2 + 1e-6)                     (when use_qk_l2norm)
    S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T (scale q_t)

Entries (same arguments and results as the public ops, which validate them; nothing is
checked here):

* ``chunk_gated_delta_rule_recurrent``: THE oracle. A ``lax.scan`` over the packed tokens, one
  token per step; it carries the running state and the pool, resets the state at each
  sequence's first token and writes the pool at its last one.
* ``chunk_gated_delta_rule_chunked``: the same contract in chunks of 64 tokens, the
  ``impl="reference"`` path of ``chunk_gated_delta_rule`` and the plain-jnp baseline of the
  benchmarks.
* ``fused_recurrent_gated_delta_rule`` / ``verify_gated_delta_rule``: the ``[N, D]`` rows
  layout of decode and verify, token by token over ``D`` (a Python loop: ``D`` is static and
  small), so they are oracles too (the commit that ends speculation is
  ``pallas_kernels.commit.commit_steps``, every op's). A row whose slot is the pad slot 0
  is a padded row: its outputs (and intermediates) are zeros and it writes nothing, so the
  padded rows of a bucket cannot race on slot 0.

How the chunked version is laid out (static shapes, ``qsl`` dynamic): each sequence is cut
into chunks of 64 aligned to its own first token, and the chunks of all sequences are
numbered one after the other. ``sum_n ceil(L_n / 64) <= (T + 63 N) // 64`` whatever the
lengths, so that many ``[64]`` token tiles (also at most ``T``) is a static bound; tokens
are gathered into the tiles with a mask (masked tokens get ``k = v = q = beta = g = 0``,
which makes them no-ops), unused tiles at the end are all masked. Then

1. every tile at once (batched): the WY/UT form of the delta rule inside a chunk. With
   ``G`` the in-chunk cumulative sum of ``g`` and ``A[i, j] = beta_i (k_i . k_j)
   exp(G_i - G_j)`` for ``j < i``, a chunk that starts from state ``S0`` has corrected
   values ``U = u - w S0`` where ``(I + A) [w | u] = [beta exp(G) k | beta v]``; outputs
   ``o = (exp(G) q) S0 + (tril(q k^T exp(G_i - G_j))) U`` and end state
   ``exp(G_last) S0 + (k exp(G_last - G))^T U``. ``(I + A)^-1`` comes from block doubling
   (``_unit_lower_inverse``).
2. one ``lax.scan`` over the tiles carrying the running state and the pool: a tile that
   starts a sequence loads ``pool[idx[n]]`` (or zeros), a tile that ends one writes its end
   state to ``pool[idx[n]]``. Only ``U`` and the end state are in the loop, which returns
   every tile's ``S0`` and ``U``.
3. every tile's outputs at once; each token reads its own back from its (tile, position).

Runs of short sequences waste tile rows (a length-1 sequence still takes a 64-row tile);
this is a reference, not a kernel.

Computation is in float32, or float64 when an input is float64 (oracles under
``jax_enable_x64``); outputs take ``v``'s dtype, pools keep theirs. Matmuls ask for HIGHEST
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
    "chunk_gated_delta_rule_chunked",
    "chunk_gated_delta_rule_recurrent",
    "fused_recurrent_gated_delta_rule",
    "gated_output_norm",
    "verify_gated_delta_rule",
]

CHUNK = 64
_PRECISION = lax.Precision.HIGHEST


def _as_arrays(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """NumPy inputs become jax arrays: the references are called directly by tests."""
    return tuple(jnp.asarray(x) for x in xs)


def _compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays))


def _einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=_PRECISION)


def _l2norm(x: jax.Array) -> jax.Array:
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def _heads_qk(
    q: jax.Array, k: jax.Array, hv: int, scale: float, use_qk_l2norm: bool, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """``[..., H, K]`` -> ``[..., HV, K]`` in ``dtype``: normalized, q scaled, heads repeated."""
    q, k = q.astype(dtype), k.astype(dtype)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    groups = hv // q.shape[-2]
    return jnp.repeat(q * scale, groups, axis=-2), jnp.repeat(k, groups, axis=-2)


def _step(
    state: jax.Array,
    q_t: jax.Array,
    k_t: jax.Array,
    v_t: jax.Array,
    g_t: jax.Array,
    beta_t: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One token, every head. state ``[..., HV, K, V]``; q_t, k_t ``[..., HV, K]`` (prepared);
    v_t ``[..., HV, V]``; g_t, beta_t ``[..., HV]``. Returns (new state, o_t ``[..., HV, V]``).

    ``o_t = S_new^T q`` is taken as ``S^T q + u (k . q)`` with ``S`` the decayed state, so both
    products read the old state in one pass and the new state is only written. The products
    are broadcast-and-sum, not einsums: exact float32 on any backend, and XLA fuses them into
    memory-bound loops instead of launching batched matrix-vector products.
    """
    state = jnp.exp(g_t)[..., None, None] * state
    k_state = jnp.sum(k_t[..., :, None] * state, axis=-2)
    q_state = jnp.sum(q_t[..., :, None] * state, axis=-2)
    u = beta_t[..., None] * (v_t - k_state)
    o = q_state + u * jnp.sum(k_t * q_t, axis=-1, keepdims=True)
    return state + k_t[..., :, None] * u[..., None, :], o


def _initial_state(
    pool: jax.Array, slot: jax.Array, has_initial_state: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    # where, not a multiply: the pad slot may hold NaN, and 0 * NaN is NaN.
    return jnp.where(has_initial_state, pool[slot].astype(dtype), 0)


def _empty_call(v: jax.Array, ssm_pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.zeros_like(v), ssm_pool


def chunk_gated_delta_rule_recurrent(
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
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token oracle of ``chunk_gated_delta_rule`` (same arguments and results)."""
    q, k, v, g, beta, ssm_pool, qsl, state_indices, has_initial_state = _as_arrays(
        q, k, v, g, beta, ssm_pool, qsl, state_indices, has_initial_state
    )
    t_total, hv = v.shape[:2]
    if t_total == 0 or state_indices.shape[0] == 0:
        return _empty_call(v, ssm_pool)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta, ssm_pool)
    qh, kh = _heads_qk(q, k, hv, scale, use_qk_l2norm, dtype)
    seq, first, last, valid = token_segments(qsl, t_total)

    def token(carry, xs):
        state, pool = carry
        q_t, k_t, v_t, g_t, beta_t, n, first_t, last_t = xs
        slot = state_indices[n]
        init = _initial_state(pool, slot, has_initial_state[n], dtype)
        state = jnp.where(first_t, init, state)
        state, o_t = _step(state, q_t, k_t, v_t, g_t, beta_t)
        return (state, write_where(pool, slot, state, last_t)), o_t

    state0 = jnp.zeros(ssm_pool.shape[1:], dtype)
    xs = (qh, kh, v.astype(dtype), g.astype(dtype), beta.astype(dtype), seq, first, last)
    (_, pool), o = lax.scan(token, (state0, ssm_pool), xs)
    return jnp.where(valid[:, None, None], o, 0).astype(v.dtype), pool


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + a)^-1`` for strictly lower-triangular ``a [..., C, C]``, C a power of two.

    Block doubling: with ``D`` the inverse of the diagonal blocks of size b and ``E`` the
    blocks of ``a`` that join two of them into one of size 2b, the inverse of the 2b blocks
    is ``D - D E D`` (exact, since ``(D E)^2 = 0`` inside a 2b block). log2(C) levels of
    batched matmuls; XLA's triangular solve is far slower on the CPU, and row-by-row
    substitution would be C dependent steps.
    """
    size = a.shape[-1]
    rows = jnp.arange(size)
    inverse = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), a.shape)
    block = 1
    while block < size:
        same_pair = rows[:, None] // (2 * block) == rows[None, :] // (2 * block)
        joining = same_pair & (rows[:, None] // block != rows[None, :] // block)
        e = jnp.where(joining, a, 0)
        inverse = inverse - _einsum(
            "...ij,...jk->...ik", inverse, _einsum("...ij,...jk->...ik", e, inverse)
        )
        block *= 2
    return inverse


def _intra_chunk(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, ...]:
    """The state-independent part of every tile, batched over ``[..., HV]``.

    q, k ``[..., C, K]`` (prepared), v ``[..., C, V]``, g, beta ``[..., C]``, masked rows zero.
    Returns w ``[..., C, K]``, u ``[..., C, V]``, q_decayed ``[..., C, K]``, qk ``[..., C, C]``,
    k_to_end ``[..., C, K]``, decay_to_end ``[...]`` (see the module docstring).
    """
    cum = jnp.cumsum(g, axis=-1)
    diff = cum[..., :, None] - cum[..., None, :]
    rows = jnp.arange(CHUNK)
    strict = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    # The masked exponent is zeroed before exp: above the diagonal it is positive and may
    # overflow, and inf * 0 would be NaN.
    strict_decay = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0)), 0)
    causal_decay = jnp.where(causal, jnp.exp(jnp.where(causal, diff, 0)), 0)
    a = beta[..., :, None] * _einsum("...ik,...jk->...ij", k, k) * strict_decay
    rhs = jnp.concatenate([(beta * jnp.exp(cum))[..., None] * k, beta[..., None] * v], axis=-1)
    wu = _einsum("...ij,...jk->...ik", _unit_lower_inverse(a), rhs)
    w, u = wu[..., : k.shape[-1]], wu[..., k.shape[-1] :]
    q_decayed = jnp.exp(cum)[..., None] * q
    qk = _einsum("...ik,...jk->...ij", q, k) * causal_decay
    k_to_end = jnp.exp(cum[..., -1:] - cum)[..., None] * k
    return w, u, q_decayed, qk, k_to_end, jnp.exp(cum[..., -1])


def chunk_gated_delta_rule_chunked(
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
) -> tuple[jax.Array, jax.Array]:
    """Chunked (WY form, 64-token tiles) ``chunk_gated_delta_rule``; same arguments and results."""
    q, k, v, g, beta, ssm_pool, qsl, state_indices, has_initial_state = _as_arrays(
        q, k, v, g, beta, ssm_pool, qsl, state_indices, has_initial_state
    )
    t_total, hv = v.shape[:2]
    n_seq = state_indices.shape[0]
    if t_total == 0 or n_seq == 0:
        return _empty_call(v, ssm_pool)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta, ssm_pool)
    qh, kh = _heads_qk(q, k, hv, scale, use_qk_l2norm, dtype)
    lay = tile_layout(qsl, t_total, num_tiles(t_total, n_seq, CHUNK), CHUNK)

    def tiles(x: jax.Array) -> jax.Array:
        """``[T, HV, ...]`` -> ``[tiles, HV, C, ...]``, zero where masked."""
        mask = lay["mask"].reshape(lay["mask"].shape + (1,) * (x.ndim - 1))
        x = jnp.where(mask, x.astype(dtype)[lay["token"]], 0)
        return jnp.moveaxis(x, 1, 2)

    w, u, q_decayed, qk, k_to_end, decay_to_end = _intra_chunk(
        tiles(qh), tiles(kh), tiles(v), tiles(g), tiles(beta)
    )

    # Only what the next chunk needs is in the sequential loop; the outputs, which need the
    # chunk's start state and corrected values, are computed for all tiles afterwards.
    def chunk(carry, xs):
        state, pool = carry
        w, u, k_to_end, decay_to_end, n, first, last = xs
        slot = state_indices[n]
        init = _initial_state(pool, slot, has_initial_state[n], dtype)
        s0 = jnp.where(first, init, state)
        u = u - _einsum("hck,hkv->hcv", w, s0)
        s1 = decay_to_end[:, None, None] * s0 + _einsum("hck,hcv->hkv", k_to_end, u)
        return (s1, write_where(pool, slot, s1, last)), (s0, u)

    state0 = jnp.zeros(ssm_pool.shape[1:], dtype)
    xs = (w, u, k_to_end, decay_to_end, lay["seq"], lay["first"], lay["last"])
    (_, pool), (s0, u) = lax.scan(chunk, (state0, ssm_pool), xs)
    o_tiles = _einsum("nhck,nhkv->nhcv", q_decayed, s0) + _einsum("nhcj,nhjv->nhcv", qk, u)
    o = o_tiles[lay["out_tile"], :, lay["out_row"]]
    return jnp.where(lay["valid"][:, None, None], o, 0).astype(v.dtype), pool


def _rows(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    scale: float | None,
    use_qk_l2norm: bool,
    keep_all: bool,
    parents: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """D tokens of every row from its slot; padded rows (slot 0) are zeroed.

    Returns o ``[N, D, HV, V]`` and the states after each token ``[N, D, HV, K, V]`` (only
    the last one, ``[N, 1, HV, K, V]``, unless ``keep_all``), both in the computation dtype.
    With ``parents`` (``[N, D]``, a tree per row) token t starts from its parent's state.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q, k, v, g, beta, ssm_pool)
    qh, kh = _heads_qk(q, k, v.shape[2], scale, use_qk_l2norm, dtype)
    v, g, beta = v.astype(dtype), g.astype(dtype), beta.astype(dtype)
    history = [ssm_pool[state_indices].astype(dtype)]
    outs = []
    for d in range(v.shape[1]):
        state = start_of_node(history, parents, d)
        state, o = _step(state, qh[:, d], kh[:, d], v[:, d], g[:, d], beta[:, d])
        outs.append(o)
        history.append(state)
    states = history[1:]
    real = (state_indices != 0)[:, None, None, None]
    kept = jnp.stack(states if keep_all else states[-1:], axis=1)
    return jnp.where(real, jnp.stack(outs, axis=1), 0), jnp.where(real[..., None], kept, 0)


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
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token ``fused_recurrent_gated_delta_rule`` (same arguments and results)."""
    args = _as_arrays(q, k, v, g, beta, ssm_pool, state_indices)
    o, last = _rows(*args, scale, use_qk_l2norm, keep_all=False)
    ssm_pool, state_indices = args[5:]
    pool = write_where(ssm_pool, state_indices, last[:, 0], state_indices != 0)
    return o.astype(v.dtype), pool


def gated_output_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Gated DeltaNet's output norm: ``weight * o / rms(o) * silu(z)`` over the last axis (a
    head), in o's dtype. ``o / rms(o)`` is computed in float32 and rounded to o's dtype
    before the weight, as the reference implementation does (bf16 runs round alike)."""
    x = o.astype(jnp.float32)
    normed = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    normed = weight * normed.astype(o.dtype)
    return (normed * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


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
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token ``verify_gated_delta_rule`` (same arguments and results); with
    ``parents`` each token starts from its parent's state (tree drafts)."""
    args = _as_arrays(q, k, v, g, beta, ssm_pool, state_indices)
    parents = None if parents is None else jnp.asarray(parents)
    o, states = _rows(*args, scale, use_qk_l2norm, keep_all=True, parents=parents)
    return o.astype(v.dtype), states.astype(ssm_pool.dtype)
