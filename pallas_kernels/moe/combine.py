"""combine_pairs: a MoE block's output added to the residual stream, with each new row's sum of
squares (what the next RMS norm reads), in one launch.

``out[r] = residual[r] + (sum_c w[r, c] * y[r, c] + sigmoid(g[r]) * shared[r])`` where
``y[r, c]`` is pair ``(r, c)``'s row of a by-id down launch's ``PairTiles`` (zero for an id out
of range), ``w`` the routing weights (divided by their sum first with ``normalize``: a
softmax's exponentials), ``g`` column 0 of ``shared_gate`` (the shared expert's gate logit,
which a launch may store beside padding columns) and ``shared`` the shared expert's rows.
``square_sums[r] = sum(out[r] ** 2)`` in float32.

Rounding follows the XLA form of the block: the weighted sum in float32 in choice order,
rounded to the rows' dtype; the gate's sigmoid rounded to it; the product and the two adds
in it.

The Mosaic GPU kernel (sm_90): one program a row. Each thread of the warpgroup owns pieces
of up to 8 adjacent columns (``WG_STRIDED``); every array is read straight from GMEM into
registers, so the whole combine is element-wise and the square sums one warpgroup reduction.
Only the residual's load names its layout; every other value's follows from it through the
element-wise ops, which leaves Mosaic GPU's layout inference one unknown to search (a
layout given to each load would be one each). XLA forms the same combine as a fusion and
the next norm's square sums as a reduction of its own: this is one launch where XLA makes
two.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import interpret_params, resolve_impl
from pallas_kernels._mgpu_chunks import ALIGN, F32
from pallas_kernels.moe.expert_matmul import PairTiles
from pallas_kernels.moe.routing import softmax_of_exps

__all__ = ["combine_pairs", "combine_pairs_reference", "unsupported_reason"]

_OP = "combine_pairs"
_THREADS = 128
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_REDUCTION_SCRATCH = 4096


def unsupported_reason(tiles: PairTiles, shared: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call, or None when it can."""
    width = tiles.tiles.shape[2]
    if width % _THREADS:
        return f"N={width} must be a multiple of {_THREADS} (whole columns for each thread)"
    if tiles.dtype not in _DTYPES or shared.dtype != tiles.dtype:
        return f"the rows must share a 16-bit float dtype (got {tiles.dtype} and {shared.dtype})"
    return None


def _check(tiles, weights, shared, shared_gate, residual) -> None:
    rows, choices = tiles.experts.shape
    width = tiles.tiles.shape[2]
    if weights.shape != (rows, choices):
        raise ValueError(f"{_OP}: weights must be [R={rows}, C={choices}]; got {weights.shape}")
    for name, a in (("shared", shared), ("residual", residual)):
        if a.shape != (rows, width):
            raise ValueError(f"{_OP}: {name} must be [R={rows}, N={width}]; got {a.shape}")
    if shared_gate.ndim != 2 or shared_gate.shape[0] != rows or shared_gate.shape[1] < 1:
        raise ValueError(f"{_OP}: shared_gate must be [R={rows}, G >= 1]; got {shared_gate.shape}")
    if residual.dtype != shared.dtype:
        raise ValueError(f"{_OP}: residual is {residual.dtype}, shared {shared.dtype}")


def combine_pairs_reference(
    tiles: PairTiles, weights: jax.Array, shared: jax.Array, shared_gate: jax.Array,
    residual: jax.Array, *, normalize: bool = False,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """The same in XLA: ``(out [R, N]``, float32 ``square_sums [R])``."""
    w = softmax_of_exps(weights.astype(F32)) if normalize else weights.astype(F32)
    ys = tiles.rows().astype(F32)  # [R, C, N], zeros for ids out of range
    routed = functools.reduce(operator.add, (ys[:, c] * w[:, c, None] for c in range(ys.shape[1])))
    scale = jax.nn.sigmoid(shared_gate[:, :1].astype(F32)).astype(shared.dtype)
    out = residual + (routed.astype(shared.dtype) + scale * shared)
    out32 = out.astype(F32)
    return out, jnp.sum(out32 * out32, axis=-1)


@functools.partial(jax.jit, static_argnames=("normalize", "interpret"))
def _kernel(tiles: PairTiles, weights, shared, shared_gate, residual, *, normalize: bool,
            interpret: bool):  # fmt: skip
    rows, choices = tiles.experts.shape
    width = tiles.tiles.shape[2]
    num_experts, per_line = tiles.num_experts, tiles.per_line
    dtype = shared.dtype
    # Each thread loads up to 8 adjacent columns at once (16 bytes of a 16-bit dtype).
    vec = next(v for v in (8, 4, 2, 1) if (width // _THREADS) % v == 0)
    lanes = plgpu.Layout.WG_STRIDED((width,), vec)

    def body(tiles_ref, experts_ref, weights_ref, shared_ref, gate_ref, residual_ref, o_ref,
             sums_ref):  # fmt: skip
        r = lax.axis_index("r")
        w = [weights_ref[r, c].astype(F32) for c in range(choices)]
        if normalize:
            total = functools.reduce(operator.add, w)
            w = [wc / total for wc in w]
        residual_row = plgpu.load(residual_ref.at[r], layout=lanes)
        routed = None
        for c in range(choices):
            pair = r * choices + c
            expert = experts_ref[r, c]
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
        out = residual_row + (routed.astype(dtype) + scale * shared_row)
        o_ref[r] = out
        out32 = out.astype(F32)
        sums_ref[r] = jnp.sum(out32 * out32)

    return plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((rows, width), dtype),
            jax.ShapeDtypeStruct((rows,), F32),
        ),
        grid=(rows,),
        grid_names=("r",),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=_REDUCTION_SCRATCH),
        interpret=interpret_params(interpret),
        kernel_name="combine_pairs",
    )(tiles.tiles, tiles.experts, weights.astype(F32), shared, shared_gate, residual)


def combine_pairs(
    tiles: PairTiles,
    weights: jax.Array,
    shared: jax.Array,
    shared_gate: jax.Array,
    residual: jax.Array,
    *,
    normalize: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """A MoE block's routed and shared rows added to the residual stream, with the new rows'
    float32 sums of squares (see the module docstring).

    Args:
      tiles: a by-id down launch's ``PairTiles`` of R rows' C choices (``[P, 8, N]``).
      weights: ``[R, C]`` the routing weights (with ``normalize``, to be divided by their
        sum in choice order).
      shared: ``[R, N]`` the shared expert's rows, in the rows' dtype.
      shared_gate: ``[R, G]``, the shared expert's gate logit in column 0.
      residual: ``[R, N]`` the residual stream, the shared rows' dtype.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      ``(out [R, N]`` in the residual's dtype, float32 ``square_sums [R])``.
    """
    _check(tiles, weights, shared, shared_gate, residual)
    reason = unsupported_reason(tiles, shared) if impl != "reference" else None
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference":
        return combine_pairs_reference(
            tiles, weights, shared, shared_gate, residual, normalize=normalize
        )
    return _kernel(
        tiles, weights, shared, shared_gate, residual, normalize=normalize,
        interpret=choice == "interpret",
    )  # fmt: skip
