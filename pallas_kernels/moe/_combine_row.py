"""One row of a MoE block's combine: the body of ``combine_pairs``' programs and of
``expert_mlp``'s row programs (``combine.py`` says what a row is and how it rounds).

Each thread of the warpgroup owns pieces of up to 8 adjacent columns (``WG_STRIDED``), and
every array is read straight from GMEM into registers: the combine is element-wise and the
square sum one warpgroup reduction. One layout is given, the residual's; every other
value's follows from it through the element-wise ops. Mosaic GPU's layout inference
searches each value cast to a layout of its own as one more unknown, and inside
``expert_mlp`` (whose SwiGLU epilogue sends that search back) a dozen such unknowns
exhaust it."""

from __future__ import annotations

import functools
import operator

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mgpu_chunks import ALIGN, F32
from pallas_kernels.moe.routing import softmax_of_exps

THREADS = 128
REDUCTION_SCRATCH = 4096


def combined_rows_reference(ys, weights, shared, shared_gate, residual, *, normalize=False):
    """``(out [R, N]``, float32 ``square_sums [R])`` in XLA of the pairs' rows ``ys``
    ``[R, C, N]`` (zeros for ids out of range)."""
    w = softmax_of_exps(weights.astype(F32)) if normalize else weights.astype(F32)
    ys = ys.astype(F32)
    routed = functools.reduce(operator.add, (ys[:, c] * w[:, c, None] for c in range(ys.shape[1])))
    scale = jax.nn.sigmoid(shared_gate[:, :1].astype(F32)).astype(shared.dtype)
    out = residual + (routed.astype(shared.dtype) + scale * shared)
    out32 = out.astype(F32)
    return out, jnp.sum(out32 * out32, axis=-1)


def combine_row(r, tiles_ref, experts_ref, weights_ref, shared_ref, gate_ref, residual_ref,
                o_ref, sums_ref, *, choices: int, num_experts: int, per_line: int,
                normalize: bool) -> None:  # fmt: skip
    """Stores row ``r`` of the combine and its square sum: pair ``(r, c)``'s row is line
    ``(p // per_line) % 8`` of tile ``p = r * choices + c`` of ``tiles_ref``, its expert
    ``experts_ref[p]`` (the ids flat, ``[R * C]``)."""
    width = tiles_ref.shape[2]
    dtype = shared_ref.dtype
    # Up to 8 adjacent columns a thread (16 bytes of a 16-bit dtype).
    vec = next(v for v in (8, 4, 2, 1) if (width // THREADS) % v == 0)
    lanes = plgpu.Layout.WG_STRIDED((width,), vec)
    w = [weights_ref[r, c].astype(F32) for c in range(choices)]
    if normalize:
        total = functools.reduce(operator.add, w)
        w = [wc / total for wc in w]
    residual = plgpu.load(residual_ref.at[r], layout=lanes)
    routed = None
    for c in range(choices):
        pair = r * choices + c
        expert = experts_ref[pair]
        valid = (expert >= 0) & (expert < num_experts)
        # Every pair's row loads (no load waits behind a branch); an out-of-range pair's
        # tile was never written, so its row is selected away, never scaled (its bits may
        # be a NaN's).
        row = plgpu.load(tiles_ref.at[pair, (pair // per_line) % ALIGN])
        keep = lax.broadcast_in_dim(valid, (width,), ())
        weight = lax.broadcast_in_dim(w[c], (width,), ())
        term = jnp.where(keep, row.astype(F32) * weight, 0.0)
        routed = term if routed is None else routed + term
    gate = gate_ref[r, 0].astype(F32)
    scale = (1.0 / (1.0 + jnp.exp(-gate))).astype(dtype)
    shared_row = plgpu.load(shared_ref.at[r])
    out = residual + (routed.astype(dtype) + scale * shared_row)
    o_ref[r] = out
    out32 = out.astype(F32)
    sums_ref[r] = jnp.sum(out32 * out32)
