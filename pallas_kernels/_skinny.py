"""The product of a few rows with one column tile of a weight, streamed through a TMA ring:
what the Mosaic GPU kernels for small-batch products (``moe.expert_matmul``,
``projections``) run per program.

A program's rows (at most 64, a multiple of 8: TMA moves whole 8-row groups of the swizzled
tile) fill the first rows of a 64-row wgmma tile; the weight's ``[K, BLOCK_N]`` column tile
streams through ``stages`` buffers of ``BLOCK_K`` rows, a block refilling its stage as soon as
the tensor cores have read it, so ``stages`` blocks stay in flight while one multiplies.

Variants, each a module switch, all on (at a few rows they read the weights faster:
benchmarks/RESULTS_projections.md, RESULTS_serve.md); a kernel's public function reads the
switches when it is called (``current_variant``) and hands them to its jitted launch as a
static argument, so a changed switch is a new trace:

* ``OVERLAP_PRODUCTS``: a block's product is issued and left running while the next block
  is awaited (at most two products in flight, ``wgmma_wait(1)``); its stage is refilled one
  block later, when the following product has been issued. Without it each product is
  waited for before its stage is refilled, so every block costs a product's latency.
* ``SWAP_OPERANDS``: each block's product is taken transposed, ``(w tile)^T @ rows^T``: the
  weight's ``BLOCK_N`` columns fill the wgmma tile's 64 rows and the program's rows (a
  multiple of 8) are its columns. The ring's row buffers then hold only those rows (8 rows:
  2 KiB a stage instead of 16, a program's shared memory 73 KiB instead of 136, so three
  programs fit on an SM) and a product is rows/64 of a full tile's work. The float32 sum is
  stored transposed into the output tile, which Mosaic GPU does for 16-bit tiles: float32
  outputs keep the plain product.
* ``RING_FILLS_SM``: a launch of at most one program per SM (a MoE block's router and shared
  gate/up: 20 column tiles) gives each program the deepest ring a block's shared memory
  holds (``filling_ring``). Such a program reads its tile at the rate its loads in flight
  allow (bytes in flight over the memory's latency), not at an SM's share of the bandwidth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import NUM_SMS, SMEM_BYTES, round_up
from pallas_kernels._mgpu_chunks import (
    ALIGN,
    COLS,
    F32,
    ROWS,
    SMEM_PER_SM,
    WG,
    along_cols,
    along_rows,
    matmul_into,
    scratch_smem_bytes,
    smem,
)

__all__ = [
    "BLOCK_K",
    "BLOCK_N",
    "DTYPES",
    "OVERLAP_PRODUCTS",
    "PAIRED_UNITS",
    "ROWS_PER_TILE",
    "STAGES",
    "SWAP_OPERANDS",
    "RING_FILLS_SM",
    "ProductVariant",
    "current_variant",
    "check_row_scale",
    "deepest_ring",
    "filling_ring",
    "halves_unsupported_reason",
    "pair_halves",
    "paired_swiglu",
    "rms_row_scale",
    "programs_per_sm",
    "scratch",
    "swapped",
    "tile_product",
    "unpair_halves",
]

BLOCK_K = 128  # K of one ring stage: a 64 x 128 row tile and a 128 x BLOCK_N weight tile
BLOCK_N = 64  # columns of a program's tile: N / 64 programs per product keep the SMs busy
PAIRED_UNITS = BLOCK_N // 2  # hidden units per tile of a weight laid out by ``pair_halves``
STAGES = 4
ROWS_PER_TILE = 64  # the wgmma tile's rows; only a program's own rows are loaded and stored
DTYPES = (jnp.bfloat16, jnp.float16)  # the operands' dtypes the tensor-core product takes
OVERLAP_PRODUCTS = True
"""Whether a block's product runs while the next block is awaited (see the module's doc)."""
SWAP_OPERANDS = True
"""Whether each block's product is taken transposed (see the module's doc)."""
RING_FILLS_SM = True
"""Whether a launch of at most one program per SM takes the deepest ring that fits (see the
module's doc): the 35B-like router and shared gate/up launch ~1.2 us shorter at 8 and 64
rows (benchmarks/RESULTS_serve.md)."""


class ProductVariant(NamedTuple):
    """A launch's static product choices: the ring's depth and the variants.
    ``ProductVariant()`` is the plain product; ``current_variant()`` gives the switches'."""

    stages: int = STAGES
    overlap: bool = False
    swap: bool = False
    fill_sm: bool = False


def current_variant() -> ProductVariant:
    """The switches' values now (``STAGES``, ``OVERLAP_PRODUCTS``, ``SWAP_OPERANDS``,
    ``RING_FILLS_SM``)."""
    return ProductVariant(STAGES, OVERLAP_PRODUCTS, SWAP_OPERANDS, RING_FILLS_SM)


def filling_ring(
    variant: ProductVariant, programs: int, steps: int, dtype, rows: int = ROWS_PER_TILE,
    out_dtype=None, *, row_scale: bool = False, halves: bool = False, smem_bytes=SMEM_BYTES,
) -> ProductVariant:  # fmt: skip
    """The variant a launch of ``programs`` programs of ``steps`` blocks each runs: with
    ``variant.fill_sm`` and at most one program per SM, ``deepest_ring``; otherwise
    ``variant`` itself."""
    if not variant.fill_sm or programs > NUM_SMS:
        return variant
    return deepest_ring(
        variant, steps, dtype, rows, out_dtype, row_scale=row_scale, halves=halves,
        smem_bytes=smem_bytes,
    )  # fmt: skip


def deepest_ring(
    variant: ProductVariant, steps: int, dtype, rows: int = ROWS_PER_TILE, out_dtype=None,
    *, row_scale: bool = False, halves: bool = False, smem_bytes=SMEM_BYTES,
) -> ProductVariant:  # fmt: skip
    """``variant`` with its ring as deep as the ``scratch`` of a block fits in
    ``smem_bytes`` (at most ``steps`` stages, never fewer than ``variant.stages``): for a
    launch of one program per SM."""

    def fits(stages: int) -> bool:
        refs = scratch(steps, dtype, variant._replace(stages=stages), rows, out_dtype,
                       row_scale=row_scale, halves=halves)  # fmt: skip
        return scratch_smem_bytes(refs) <= smem_bytes

    stages = variant.stages
    while stages < steps and fits(stages + 1):
        stages += 1
    return variant._replace(stages=stages)


def swapped(out_dtype, variant: ProductVariant) -> bool:
    """Whether products stored as ``out_dtype`` take the swapped operands: with
    ``variant.swap``, for 16-bit outputs (Mosaic GPU stores a float32 sum transposed into a
    16-bit tile only)."""
    return variant.swap and jnp.dtype(out_dtype).itemsize == 2


def scratch(
    steps: int, dtype, variant: ProductVariant, rows: int = ROWS_PER_TILE, out_dtype=None,
    *, row_scale: bool = False, halves: bool = False, declared_tiling: bool = False,
) -> list:  # fmt: skip
    """The ring (rows and weight tiles), the output tile (``out_dtype``, default ``dtype``)
    and the ring's barriers, for calls of up to ``rows`` rows; with ``row_scale``, a float32
    vector of the rows' scales and its barrier after them (``tile_product(row_scale=)``),
    tiled by 8 with ``declared_tiling`` (a transform Mosaic GPU's layout search need not
    look for: in a launch that also ranks, ``projections.ranked_projections``, that search
    runs out of its budget);
    with ``halves``, the float32 sum and the hidden tile of a SwiGLU over a tile's halves
    (``tile_product(halves=True)``, swapped products of exactly ``rows`` rows)."""
    stages = min(variant.stages, steps)
    held = round_up(rows, ALIGN) if swapped(out_dtype or dtype, variant) else ROWS_PER_TILE
    refs = [
        smem((stages, held, BLOCK_K), dtype),
        smem((stages, BLOCK_K, BLOCK_N), dtype),
        smem((held, BLOCK_N), out_dtype or dtype),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    if row_scale:
        tiled = (plgpu.TilingTransform((ALIGN,)),) if declared_tiling else ()
        refs += [plgpu.SMEM((ROWS_PER_TILE,), F32, transforms=tiled),
                 plgpu.Barrier(num_arrivals=1)]  # fmt: skip
    if halves:
        refs += [plgpu.SMEM((BLOCK_N, held), F32), plgpu.SMEM((held, BLOCK_N // 2), dtype)]
    return refs


def check_row_scale(op: str, rows: int, row_scale, rms_eps: float | None) -> None:
    """A product's ``row_scale`` (``[rows]``) and ``rms_eps`` (which needs a row scale)."""
    if row_scale is not None and tuple(row_scale.shape) != (rows,):
        raise ValueError(f"{op}: row_scale {tuple(row_scale.shape)} must be [R] = [{rows}]")
    if rms_eps is not None and row_scale is None:
        raise ValueError(f"{op}: rms_eps={rms_eps} scales rows by their row_scale; none given")


def rms_row_scale(row_scale, rms_eps: float | None, k: int):
    """What each row's float32 sum is multiplied by (XLA, for the references): ``row_scale``,
    or with ``rms_eps`` the inverse RMS of rows whose square sums over ``k`` it holds; None
    without a row scale."""
    if row_scale is None:
        return None
    row_scale = row_scale.astype(F32)
    return row_scale if rms_eps is None else lax.rsqrt(row_scale / k + rms_eps)


def programs_per_sm(scratch_refs) -> int:
    """Programs with this ``scratch`` list that fit on one SM at once (its shared memory,
    with the 1 KB each resident program also takes)."""
    return max(1, SMEM_PER_SM // (scratch_smem_bytes(scratch_refs) + 1024))


def tile_product(
    x_rows, w_cols, out_rows, x_s, w_s, o_s, bars, *extra, steps: int,
    variant: ProductVariant, interpret: bool, row_scale=None,
    rms: tuple[float, int] | None = None, halves: bool = False, await_rows=None,
):  # fmt: skip
    """``out_rows = x_rows @ w_cols`` (float32 accumulation, stored in out's dtype); with
    ``row_scale`` (a GMEM view ``[R]``, float32) each row's sum times its scale before the
    store, or with ``rms = (eps, width)`` too times ``1 / sqrt(row_scale / width + eps)``
    (``row_scale`` then holds each row's sum of squares over the norm's ``width``: an RMS
    norm's scale, formed here). With ``halves`` the tile holds ``BLOCK_N / 2`` gate columns
    and then as many up columns (a weight laid out by ``pair_halves``), and ``out_rows``
    ``[R, BLOCK_N / 2]`` gets ``silu(gate) * up`` of the scaled sums: the SwiGLU from one
    tile's read.

    ``x_rows``: a GMEM view ``[R, K]`` (R a multiple of 8, at most 64 and at most the rows
    ``scratch`` was given); ``w_cols``: ``[K, BLOCK_N]``; ``out_rows``: ``[R, BLOCK_N]``;
    ``steps = K // BLOCK_K``; the SMEM buffers and barriers from ``scratch`` (with the same
    ``variant``, and ``row_scale=True`` for a scaled call, ``halves=True`` for a SwiGLU over
    the halves: ``extra`` holds what those add). With ``await_rows`` (a function of no
    arguments) the ring's first weight blocks are requested before it is called and its
    rows after it returns: rows that another program of the launch is still forming are
    awaited there while the weights stream in.
    Waits for the previous call's store before reusing ``o_s``; the caller waits for this
    one's (``plgpu.wait_smem_to_gmem(0)``) before the kernel ends."""
    rows = x_rows.shape[0]
    held = round_up(rows, ALIGN)  # the rows TMA moves: whole 8-row groups
    if row_scale is not None:  # in flight with the ring's first blocks
        scale_s, scale_bar = extra[:2]
        plgpu.copy_gmem_to_smem(row_scale, scale_s.at[pl.ds(0, rows)], scale_bar)
    swap = swapped(o_s.dtype, variant)
    if halves and not (swap and extra[-2].shape == (BLOCK_N, held)):
        raise ValueError(f"a SwiGLU over a tile's halves takes swapped products of the "
                         f"scratch's rows; got {rows} rows, swap={swap}")  # fmt: skip
    ring = (x_s, w_s, bars)
    acc = _tile_sum(
        x_rows, w_cols, *ring, steps=steps, variant=variant, swap=swap, interpret=interpret,
        await_rows=await_rows,
    )  # fmt: skip
    if row_scale is not None:
        plgpu.barrier_wait(scale_bar)
        scale = _row_scales(scale_s, held, swap, acc.shape, rms)
        acc = acc * scale
    if halves:
        _store_halves_swiglu(acc, out_rows, *extra[-2:])
        return
    plgpu.wait_smem_to_gmem(0)  # the previous product's store has left o_s
    if swap:
        o_s.at[pl.ds(0, held)].transpose((1, 0))[...] = acc.astype(o_s.dtype)
    else:
        o_s[...] = acc.astype(o_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s.at[pl.ds(0, rows)], out_rows)


def _store_halves_swiglu(acc, out_rows, sums_s, hidden_s) -> None:
    """Stores ``silu(gate) * up`` of a swapped float32 sum ``acc`` ``[BLOCK_N, held]`` whose
    first half of rows are gate columns and second half up columns, as ``out_rows`` ``[R,
    BLOCK_N / 2]``. The halves meet through SMEM (``sums_s``), each read in a strided layout
    of one value a lane-step, and the hidden tile goes out through a transposed view of
    ``hidden_s`` (a transposed store takes no wider vectors)."""
    half, held = BLOCK_N // 2, acc.shape[1]
    sums_s[...] = acc
    strided = plgpu.Layout.WG_STRIDED((half, held), vec_size=1)
    gate = plgpu.load(sums_s.at[pl.ds(0, half)], layout=strided)
    up = plgpu.load(sums_s.at[pl.ds(half, half)], layout=strided)
    hidden = gate / (1.0 + jnp.exp(-gate)) * up
    plgpu.wait_smem_to_gmem(0)  # the previous product's store has left hidden_s
    hidden_s.transpose((1, 0))[...] = hidden.astype(hidden_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(hidden_s.at[pl.ds(0, out_rows.shape[0])], out_rows)


def pair_halves(w: jax.Array) -> jax.Array:
    """A SwiGLU's ``[..., 2I]`` weight (the gate's I columns, then the up projection's) laid
    out for ``tile_product(halves=True)``: each ``BLOCK_N``-column tile holds ``BLOCK_N / 2``
    gate columns and the up columns of the same hidden units (I a multiple of
    ``PAIRED_UNITS``)."""
    half = PAIRED_UNITS
    if w.shape[-1] % (2 * half):
        raise ValueError(f"pair_halves: 2I={w.shape[-1]} must be a multiple of {2 * half}")
    gate, up = jnp.split(w, 2, axis=-1)
    lead = w.shape[:-1]
    tiles = gate.shape[-1] // half
    paired = jnp.stack([gate.reshape(*lead, tiles, half), up.reshape(*lead, tiles, half)], axis=-2)
    return paired.reshape(*lead, 2 * gate.shape[-1])


def paired_swiglu(y: jax.Array) -> jax.Array:
    """``silu(gate) * up`` in XLA of a product ``[..., 2I]`` whose weight ``pair_halves``
    laid out (the references of the launches that form it in their epilogue)."""
    gate, up = jnp.split(unpair_halves(y), 2, axis=-1)
    return jax.nn.silu(gate) * up


def halves_unsupported_reason(dtype) -> str | None:
    """Why a launch of this output dtype cannot form a SwiGLU over a tile's halves
    (``tile_product(halves=True)`` takes swapped products), or None."""
    if not swapped(dtype, current_variant()):
        return "a SwiGLU over a tile's halves takes swapped products (SWAP_OPERANDS)"
    return None


def unpair_halves(w: jax.Array) -> jax.Array:
    """``pair_halves``' inverse: the gate's columns, then the up projection's."""
    half = PAIRED_UNITS
    lead = w.shape[:-1]
    tiles = w.shape[-1] // BLOCK_N
    pairs = w.reshape(*lead, tiles, 2, half)
    gate = pairs[..., 0, :].reshape(*lead, tiles * half)
    up = pairs[..., 1, :].reshape(*lead, tiles * half)
    return jnp.concatenate([gate, up], axis=-1)


def _tile_sum(x_rows, w_cols, x_s, w_s, bars, *, steps: int, variant: ProductVariant,
              swap: bool, interpret: bool, await_rows=None):  # fmt: skip
    """The float32 sum ``x_rows @ w_cols`` through the ring (WGMMA layout): ``[64,
    BLOCK_N]``, or transposed ``[BLOCK_N, rows]`` with ``swap`` (the rows rounded up to the
    8-row groups that TMA moves). The ring is free again when it returns. ``await_rows``:
    see ``tile_product``."""
    rows = x_rows.shape[0]
    stages = min(variant.stages, steps)
    held = round_up(rows, ALIGN)
    shape = (BLOCK_N, held) if swap else (ROWS_PER_TILE, BLOCK_N)

    def operands(stage):
        if swap:
            return w_s.at[stage].transpose((1, 0)), x_s.at[stage, pl.ds(0, held)].transpose((1, 0))
        return x_s.at[stage], w_s.at[stage]

    def fill_rows(j, stage):
        ks = pl.ds(j * BLOCK_K, BLOCK_K)
        plgpu.copy_gmem_to_smem(x_rows.at[:, ks], x_s.at[stage, pl.ds(0, rows)], bars.at[stage])

    def fill_weights(j, stage):
        ks = pl.ds(j * BLOCK_K, BLOCK_K)
        plgpu.copy_gmem_to_smem(w_cols.at[ks], w_s.at[stage], bars.at[stage])

    def fill(j, stage):
        fill_rows(j, stage)
        fill_weights(j, stage)

    if await_rows is None:
        for j in range(stages):
            fill(j, j)
    else:  # a stage's barrier completes once both of its copies have landed
        for j in range(stages):
            fill_weights(j, j)
        await_rows()
        for j in range(stages):
            fill_rows(j, j)

    def step(j, acc):
        stage = lax.rem(j, stages)
        plgpu.barrier_wait(bars.at[stage])
        acc = matmul_into(acc, *operands(stage), interpret=interpret)
        # The product has read this stage: it takes block j + stages.
        pl.when(j + stages < steps)(lambda: fill(j + stages, stage))
        return acc

    if variant.overlap:
        return _overlapped_products(operands, bars, fill, shape, steps=steps, stages=stages)
    init = plgpu.layout_cast(jnp.zeros(shape, F32), WG)
    return lax.fori_loop(0, steps, step, init)


def _row_scales(scale_s, held: int, swap: bool, shape, rms: tuple[float, int] | None):
    """Each row's scale from ``scale_s`` (float32, after its barrier), broadcast over a sum of
    ``shape``: along its columns when swapped (the rows are its columns), else its rows; with
    ``rms = (eps, width)``, ``1 / sqrt(scale / width + eps)``."""
    if swap:
        scale = plgpu.load(scale_s.at[pl.ds(0, held)], layout=COLS)
    else:
        scale = plgpu.load(scale_s, layout=ROWS)
    if rms is not None:
        eps, width = rms
        scale = lax.rsqrt(scale * (1.0 / width) + eps)
    return along_cols(scale, shape) if swap else along_rows(scale, shape)


def _overlapped_products(operands, bars, fill, shape, *, steps: int, stages: int):
    """The ring's products into one accumulator of ``shape``, each left running while the
    next block is awaited; returns the float32 sum (WGMMA layout)."""

    def scope(acc_ref):
        def step(j, carry):
            stage = lax.rem(j, stages)
            plgpu.barrier_wait(bars.at[stage])
            plgpu.wgmma(acc_ref, *operands(stage))
            # At most this product still runs: block j - 1's has read its stage.
            plgpu.wgmma_wait(1)
            previous = j - 1
            pl.when((j > 0) & (previous + stages < steps))(
                lambda: fill(previous + stages, lax.rem(previous, stages))
            )
            return carry

        lax.fori_loop(0, steps, step, None)
        plgpu.wgmma_wait(0)  # the last product is done before its sum is read
        return acc_ref[...]

    # The barrier keeps LLVM from reading the registers before the products' wait.
    return lax.optimization_barrier(pl.run_scoped(scope, plgpu.ACC(shape, F32)))
