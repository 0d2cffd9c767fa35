"""top_k_routing: each token's ``k`` experts of largest router logit and the softmax over
them, in one launch. In XLA a few tokens' ranking is two reductions over ``[T, n, n]`` and
``[T, k, n]`` comparisons (every entry's rank, then each choice's entry): two kernels of a
microsecond or two each per MoE block, where the work is a few hundred comparisons a token.

Order: the largest logit first; equal logits by the lower index (``jax.lax.top_k``'s order).
The weights are ``softmax`` over the chosen logits, ``exp(l_j - l_0) / sum_i exp(l_i -
l_0)`` with the sum taken in choice order. A token whose ``valid`` is False gets expert ``n``
(out of range: no expert) for every choice, its weights as the logits give them.

``logits`` is ``[T, n]`` in any float dtype, or float32 partial products ``[S, T, n]`` over
parts of K (``projections.projection_partials``), summed here in float32; ``row_scale``
multiplies each token's logits first (a folded norm's inverse RMS, which the products leave
to their reader).

The Mosaic GPU kernel (sm_90): one program per 4 tokens, a token per warp, its ``n`` logits
across the warp's lanes. Each choice is two reductions along the token's row, within its warp
(no shared memory, no barrier): the largest remaining logit, then the lowest index holding
it, and that entry is struck out. The choices are gathered into one register row (column
``j`` holds choice ``j``) whose first ``k`` columns one TMA stores per token.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import interpret_params, resolve_impl

__all__ = ["ranked_top_k", "top_k_routing", "top_k_softmax", "unsupported_reason"]

_OP = "top_k_routing"
_WIDTHS = (128, 256)  # experts: one TMA box holds at most 256 along a dimension
_TOKENS = 4  # tokens a program routes: one per warp
_F32 = jnp.float32


def unsupported_reason(logits: jax.Array, k: int) -> str | None:
    """Why the kernel cannot take this call (shapes and dtypes only), or None when it can."""
    n = logits.shape[-1]
    if n not in _WIDTHS:
        return f"n={n} experts is not one of {_WIDTHS}"
    if k % 4:
        return (
            f"k={k} is not a multiple of 4 (a token's choices are one TMA store of 16-byte units)"
        )
    if logits.ndim == 3 and logits.dtype != _F32:
        return f"partial products must be float32 (got {logits.dtype})"
    return None


def _check(logits: jax.Array, k: int, valid: jax.Array | None, row_scale: jax.Array | None) -> None:
    if logits.ndim not in (2, 3) or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"{_OP}: logits must be float [T, n] or partials [S, T, n]; got {logits.dtype} "
            f"{logits.shape}"
        )
    tokens, n = logits.shape[-2:]
    if not 1 <= k <= n:
        raise ValueError(f"{_OP}: k={k} must be in 1..n={n}")
    if valid is not None and (valid.shape != (tokens,) or valid.dtype != jnp.bool_):
        raise ValueError(f"{_OP}: valid must be bool [T={tokens}]; got {valid.dtype} {valid.shape}")
    if row_scale is not None and (row_scale.shape != (tokens,) or row_scale.dtype != _F32):
        raise ValueError(
            f"{_OP}: row_scale must be float32 [T={tokens}]; got {row_scale.dtype} "
            f"{row_scale.shape}"
        )


def _ranking(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the indices ``[n]``; ``before`` ``[T, n, n]``: whether entry j comes before entry i,
    larger or equal at a lower index; ``chosen`` ``[T, k, n]``: whether an entry's rank, its
    place in that order, is the choice's) of ``x`` ``[T, n]``."""
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    mine, other = x[..., :, None], x[..., None, :]
    before = (other > mine) | ((other == mine) & (index[None, :] < index[:, None]))
    rank = before.sum(axis=-1, dtype=jnp.int32)  # [T, n]
    return index, before, rank[..., None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]


def _chosen_indices(chosen: jax.Array, index: jax.Array, valid: jax.Array | None) -> jax.Array:
    """The index of each row's chosen entry per choice (``chosen`` ``[T, k, n]``, one entry
    each), or ``n`` in rows where ``valid`` is False."""
    # An invalid row's index inside the sum (one entry is chosen per choice), not after
    # it: XLA then needs no kernel of its own for the mask.
    ids = index if valid is None else jnp.where(valid[:, None, None], index, index.shape[0])
    return jnp.where(chosen, ids, 0).sum(axis=-1, dtype=jnp.int32)


def ranked_top_k(
    x: jax.Array, k: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` along the last axis of ``x`` ``[T, n]`` (int32 indices; rows
    where ``valid`` is False get index ``n``) by counting, for every entry, the entries that
    come before it and picking those of ranks ``0..k-1``: an ``[T, n, n]`` comparison that XLA
    fuses into a reduction, where ``lax.top_k`` on the GPU is a sort of its own per call."""
    index, _, chosen = _ranking(x, k)
    values = jnp.where(chosen, x[..., None, :], 0).sum(axis=-1)
    return values.astype(x.dtype), _chosen_indices(chosen, index, valid)


def top_k_softmax(
    x: jax.Array, k: int, valid: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(the softmax over each row's ``k`` largest entries, float32 ``[T, k]``; their int32
    indices ``[T, k]``) of float32 ``x`` ``[T, n]``, largest first, ranked as ``ranked_top_k``
    ranks (rows where ``valid`` is False get index ``n``): the kernel's reference.

    Two reductions, each over the ``[T, n, n]`` or ``[T, k, n]`` comparisons the ranking
    makes anyway: every entry's rank beside the largest of its own value and those ranked
    before it (the row's max, whatever the entry), then each choice's index beside its
    ``exp(value - max)``. What remains is the sum of ``k`` of those and a division, written as
    adds, which XLA may fuse into the weights' reader."""
    index, before, chosen = _ranking(x, k)
    at_or_before = before | (index[None, :] == index[:, None])
    top = jnp.where(at_or_before, x[..., None, :], -jnp.inf).max(axis=-1)  # the row's max
    exps = jnp.exp(x - top)  # at most 1: the largest entry's is 1
    picked = jnp.where(chosen, exps[..., None, :], 0).sum(axis=-1)  # [T, k]
    total = functools.reduce(operator.add, (picked[:, j] for j in range(k)))  # at least 1
    return picked / total[:, None], _chosen_indices(chosen, index, valid)


def top_k_routing(
    logits: jax.Array,
    k: int,
    valid: jax.Array | None = None,
    *,
    row_scale: jax.Array | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """(float32 weights ``[T, k]``, int32 experts ``[T, k]``) of ``logits`` ``[T, n]`` (or
    float32 partials ``[S, T, n]``), each token's logits first multiplied by its
    ``row_scale`` (float32 ``[T]``: a folded norm's inverse RMS; None: 1): each token's ``k``
    largest and the softmax over them (module docstring); ``valid`` bool ``[T]`` or None
    (every token valid)."""
    _check(logits, k, valid, row_scale)
    impl = resolve_impl(_OP, impl, unsupported_reason(logits, k))
    if impl == "reference":
        wide = logits.astype(_F32)
        wide = wide.sum(axis=0) if wide.ndim == 3 else wide
        if row_scale is not None:
            wide = wide * row_scale[:, None]
        return top_k_softmax(wide, k, valid)
    parts = logits if logits.ndim == 3 else logits[None]
    tokens, n = parts.shape[1:]
    flags = jnp.ones((tokens,), _F32) if valid is None else valid.astype(_F32)
    scales = jnp.ones((tokens,), _F32) if row_scale is None else row_scale
    # Each element's column and token in a program's tile: constants the kernel compares with.
    token, column = jnp.meshgrid(jnp.arange(_TOKENS), jnp.arange(n), indexing="ij")
    place = jnp.stack([column, token]).astype(_F32)
    extra = -tokens % _TOKENS  # padding tokens (none in a decode bucket), routed and dropped
    if extra:
        parts = jnp.pad(parts, ((0, 0), (0, extra), (0, 0)))
        flags, scales = jnp.pad(flags, (0, extra)), jnp.pad(scales, (0, extra))
    weights, ids = _kernel(
        parts, place, flags, scales, k=k, scaled=row_scale is not None,
        interpret=impl == "interpret",
    )  # fmt: skip
    return weights[:tokens], ids[:tokens]


def _tile_layout(n: int) -> plgpu.Layout:
    """The register layout of a ``[_TOKENS, n]`` float32 tile: a token per warp, its ``n``
    columns over the warp's lanes (two side by side in a thread, ``n / 64`` pairs a lane). A
    reduction along a token's columns stays within its warp."""
    # [4, n] -> [token (warp), n / 64, lane, 2]
    tiling = plgpu.Tiling(((_TOKENS, n), (64,), (2,)))
    return plgpu.Layout.TILED(tiling, warp_dims=(-4,), lane_dims=(-2,), vector_dim=-1)


def _kernel(parts, place, flags, scales, *, k, scaled, interpret):
    num_parts, tokens, n = parts.shape
    tile = _tile_layout(n)
    shape = (_TOKENS, n)

    def across(vec: jax.Array) -> jax.Array:
        return lax.broadcast_in_dim(vec, shape, [0])

    def full(value) -> jax.Array:
        return jnp.full(shape, value, _F32)

    def body(parts_ref, place_ref, flags_ref, scales_ref, weights_ref, ids_ref, x_s, c_s, w_s,
             i_s, bar):  # fmt: skip
        first_token = lax.axis_index("t") * _TOKENS
        rows = pl.ds(first_token, _TOKENS)
        for s in range(num_parts):
            plgpu.copy_gmem_to_smem(parts_ref.at[s, rows], x_s.at[s], bar)
        plgpu.copy_gmem_to_smem(place_ref, c_s, bar)
        # The tokens' scalars load while the copies are in flight, not one round trip each
        # after them.
        flags = [flags_ref[first_token + i] for i in range(_TOKENS)]
        scales = [scales_ref[first_token + i] for i in range(_TOKENS)] if scaled else None
        plgpu.barrier_wait(bar)
        x = functools.reduce(
            operator.add,
            [plgpu.load(x_s.at[s], layout=tile).astype(_F32) for s in range(num_parts)],
        )
        idx = plgpu.load(c_s.at[0], layout=tile)  # each element's column
        token = plgpu.load(c_s.at[1], layout=tile)  # and its token in the tile

        def per_token(values) -> jax.Array:
            """Each token's scalar of ``values`` along its row."""
            out = full(0.0)
            for i, value in enumerate(values):
                out = jnp.where(token == full(float(i)), full(value), out)
            return out

        if scaled:
            x = x * per_token(scales)
        # Every operand of a select is a whole tile: the warpgroup lowering broadcasts none.
        none, zeros = full(-jnp.inf), full(0.0)
        left = x  # the logits not yet chosen; a chosen one is -inf and out of the index pick
        taken, weights, chosen = zeros, zeros, zeros
        values = []
        for j in range(k):
            top = jnp.max(left, axis=1)
            at_top = (left == across(top)) & (taken == zeros)
            first = -jnp.max(jnp.where(at_top, -idx, none), axis=1)  # lowest index there
            hit = idx == across(first)
            left = jnp.where(hit, none, left)
            taken = jnp.where(hit, full(1.0), taken)
            chosen = jnp.where(idx == full(float(j)), across(first), chosen)
            values.append(top)
        exps = [jnp.exp(v - values[0]) for v in values]
        total = functools.reduce(operator.add, exps)
        for j, e in enumerate(exps):
            weights = jnp.where(idx == full(float(j)), across(e / total), weights)
        chosen = jnp.where(per_token(flags) != zeros, chosen, full(float(n)))
        w_s[...] = weights
        i_s[...] = chosen.astype(jnp.int32)
        plgpu.commit_smem()
        for i in range(_TOKENS):  # a token's first k columns: one contiguous store each
            at, out = pl.ds(i, 1), pl.ds(first_token + i, 1)
            plgpu.copy_smem_to_gmem(w_s.at[at, pl.ds(0, k)], weights_ref.at[out])
            plgpu.copy_smem_to_gmem(i_s.at[at, pl.ds(0, k)], ids_ref.at[out])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((tokens, k), _F32),
            jax.ShapeDtypeStruct((tokens, k), jnp.int32),
        ),
        grid=(tokens // _TOKENS,),
        grid_names=("t",),
        scratch_types=[
            plgpu.SMEM((num_parts, *shape), parts.dtype),
            plgpu.SMEM((2, *shape), _F32),
            plgpu.SMEM(shape, _F32),
            plgpu.SMEM(shape, jnp.int32),
            plgpu.Barrier(num_arrivals=num_parts + 1),
        ],
        interpret=interpret_params(interpret),
        kernel_name="top_k_routing",
    )
    return kernel(parts, place, flags, scales)
