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
XLA forms the same combine as a fusion and the next norm's square sums as a reduction of its
own: this is one launch where XLA makes two.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import interpret_params, resolve_impl
from pallas_kernels._mgpu_chunks import F32
from pallas_kernels.moe._combine_row import (
    REDUCTION_SCRATCH,
    THREADS,
    combine_row,
    combined_rows_reference,
)
from pallas_kernels.moe.expert_matmul import PairTiles

__all__ = ["combine_pairs", "combine_pairs_reference", "unsupported_reason"]

_OP = "combine_pairs"
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unsupported_reason(tiles: PairTiles, shared: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call, or None when it can."""
    width = tiles.tiles.shape[2]
    if width % THREADS:
        return f"N={width} must be a multiple of {THREADS} (whole columns for each thread)"
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
    return combined_rows_reference(
        tiles.rows(), weights, shared, shared_gate, residual, normalize=normalize
    )


@functools.partial(jax.jit, static_argnames=("normalize", "interpret"))
def _kernel(tiles: PairTiles, weights, shared, shared_gate, residual, *, normalize: bool,
            interpret: bool):  # fmt: skip
    rows, choices = tiles.experts.shape
    width = tiles.tiles.shape[2]
    dtype = shared.dtype

    def body(tiles_ref, experts_ref, weights_ref, shared_ref, gate_ref, residual_ref, o_ref,
             sums_ref):  # fmt: skip
        combine_row(
            lax.axis_index("r"), tiles_ref, experts_ref, weights_ref, shared_ref, gate_ref,
            residual_ref, o_ref, sums_ref, choices=choices, num_experts=tiles.num_experts,
            per_line=tiles.per_line, normalize=normalize,
        )  # fmt: skip

    return plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((rows, width), dtype),
            jax.ShapeDtypeStruct((rows,), F32),
        ),
        grid=(rows,),
        grid_names=("r",),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=REDUCTION_SCRATCH),
        interpret=interpret_params(interpret),
        kernel_name="combine_pairs",
    )(tiles.tiles, tiles.experts.reshape(-1), weights.astype(F32), shared, shared_gate, residual)


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
