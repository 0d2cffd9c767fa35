"""grouped_matmul: the experts of a MoE block, each multiplying only the rows routed to it.

On an sm_90 GPU the product runs in tokamax's Mosaic GPU ragged dot (``implementation=
"mosaic"``: wgmma tiles over the rows of each group, so an expert with no rows is never read);
``jax.lax.ragged_dot`` is the reference, which XLA's GPU backend runs as a dense product over
every expert. tokamax is an optional dependency (the ``cuda`` extra): without it ``auto`` takes
the reference and ``pallas`` says how to install it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import resolve_impl, round_up
from pallas_kernels.moe import reference

__all__ = ["grouped_matmul", "unsupported_reason"]

_OP = "grouped_matmul"
# The kernel's row tiles are multiples of 8 rows: shorter inputs are padded to it.
_ROW_TILE = 8
_DTYPES = (jnp.bfloat16, jnp.float16)
# Rows per group on average and K from which the 128-row-tile config runs.
_LONG_ROWS = 128
_WIDE_K = 1024


@functools.cache
def _tokamax_ragged_dot():
    try:
        from tokamax import ragged_dot
    except ImportError:
        return None
    return ragged_dot


@functools.cache
def _long_rows_kernel():
    """tokamax's kernel with 128-row tiles, 4 pipeline stages: faster than its heuristic
    config (64-row tiles, 2 stages) once every group holds a full tile of rows and K is wide
    (prefill's gate/up product; benchmarks/moe_variants.py)."""
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as kernel
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as common

    config = common.Config(
        block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=False,
        grid_minor_dim=common.MatmulDimension.M, grid_tile_width=1,
    )  # fmt: skip
    return kernel.PallasMosaicGpuRaggedDot(config=config)


def unsupported_reason(x: jax.Array, w: jax.Array) -> str | None:
    """Why the Mosaic GPU grouped matmul cannot take this call, or None when it can."""
    if _tokamax_ragged_dot() is None:
        return "tokamax is not installed (pip install 'hybrid-jax[cuda]')"
    if x.dtype != w.dtype or x.dtype not in _DTYPES:
        return f"x and w must share a 16-bit float dtype (got {x.dtype} and {w.dtype})"
    if x.shape[1] % 64 or w.shape[2] % 64:
        return f"K={x.shape[1]} and N={w.shape[2]} must be multiples of 64"
    return None


def _check(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"{_OP}: x must be [M, K] and w [G, K, N] with one K; got {x.shape} and {w.shape}"
        )
    if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"{_OP}: group_sizes must be int [G={w.shape[0]}]; got {group_sizes.dtype} "
            f"{group_sizes.shape}"
        )


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, impl: str = "auto"
) -> jax.Array:
    """Rows ``group_sizes[:g].sum() .. group_sizes[:g+1].sum()`` of ``x`` times ``w[g]``.

    Args:
      x: ``[M, K]`` rows sorted by group.
      w: ``[G, K, N]`` one matrix per group (the layout the kernel reads: nothing is
        transposed per call).
      group_sizes: int32 ``[G]`` rows per group; rows past their sum are padding.
      impl: ``"auto" | "pallas" | "reference"`` (the kernel is tokamax's; there is no
        interpreter run of it).

    Returns:
      ``[M, N]`` in x's dtype (float32 accumulation); padding rows are zeros.
    """
    _check(x, w, group_sizes)
    reason = unsupported_reason(x, w) if impl != "reference" else None
    if impl == "interpret":
        reason = reason or "tokamax's kernel has no interpreter run here"
    if resolve_impl(_OP, impl, reason) == "reference":
        return reference.grouped_matmul(x, w, group_sizes)
    rows = x.shape[0]
    padded = round_up(rows, _ROW_TILE)
    xp = jnp.pad(x, ((0, padded - rows), (0, 0)))
    sizes = group_sizes.astype(jnp.int32)
    if padded >= _LONG_ROWS * w.shape[0] and x.shape[1] >= _WIDE_K:
        out = _long_rows_kernel()(xp, w, group_sizes=sizes, preferred_element_type=x.dtype)
    else:
        out = _tokamax_ragged_dot()(
            xp, w, sizes, preferred_element_type=x.dtype, implementation="mosaic"
        )
    # The kernel leaves rows past the groups unwritten; the reference's are zeros.
    valid = jnp.arange(padded) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, 0)[:rows]
