"""projections: a few rows times several weights in one launch.

``projections(x, (w0, w1, ...)) == (x @ w0, x @ w1, ...)`` for the products a layer takes from
one input (a GDN layer's ``qkv``, ``z`` and ``b|a``; attention's q, k and v; a MoE block's
router and shared expert). At decode a step has few rows, so each product is a read of its
weight, and a launch per weight costs more than its bytes (~5 us for a 1 MB router); one
launch reads every weight in place, no concatenation.

A weight laid out by ``pair_halves`` (a SwiGLU's gate and up columns, 32 of each per tile) may
give its hidden rows ``silu(gate) * up`` instead of its product (``paired``): a shared expert's
SwiGLU formed in the router's launch.

``projection_partials`` splits K too, for products of few column tiles: float32 partial
products over parts of K, summed by the caller where it uses them. ``projection_add`` sums
them in the same launch, added to the residual stream with the new rows' square sums: its
last programs, one a row, wait on a GMEM counter until every partial is stored
(``_counters``). ``projections(splits=)`` does the same for whole products: its row
programs sum the partials, scale them and form a paired weight's SwiGLU, so weights of few
column tiles (a MoE router's launch) take more programs, each reading less.
``ranked_projections`` ranks each row of the first product (a MoE router's logits) too: one
more program a row waits for that weight's tiles, then picks the row's top-k experts (or,
over parts of K, the row program ranks the row it formed; ``moe.routing_mgpu``).

The Mosaic GPU kernel (sm_90): one program per (``BLOCK_N``-column tile of every weight, part
of K) (the weights' tiles numbered one after another); each multiplies the rows by its tile,
streamed through a TMA ring (``_skinny.tile_product``). Rows: at most 64 (one wgmma tile).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _counters
from pallas_kernels._common import NUM_SMS, SMEM_BYTES, interpret_params, resolve_impl, round_up
from pallas_kernels._mgpu_chunks import ALIGN, F32, scratch_smem_bytes, strided
from pallas_kernels._skinny import (
    BLOCK_K,
    BLOCK_N,
    DTYPES,
    ROWS_PER_TILE,
    ProductVariant,
    check_row_scale,
    current_variant,
    filling_ring,
    halves_unsupported_reason,
    paired_swiglu,
    rms_row_scale,
    scratch,
    tile_product,
)
from pallas_kernels.moe import routing, routing_mgpu

__all__ = [
    "COLUMN_TILE",
    "COMBINED_WIDTH",
    "MAX_ROWS",
    "add_unsupported_reason",
    "partial_splits",
    "projection_add",
    "projection_add_reference",
    "projection_partials",
    "projection_partials_reference",
    "projections",
    "projections_reference",
    "ranked_projections",
    "ranked_unsupported_reason",
    "unsupported_reason",
]

_OP = "projections"
MAX_ROWS = ROWS_PER_TILE
COLUMN_TILE = BLOCK_N  # every weight's N is a multiple of it
_ROW_THREADS = 128  # a row program's warpgroup, each thread whole pairs of the row's columns
COMBINED_WIDTH = _ROW_THREADS  # a combined launch's products (hidden rows) are whole multiples
_ROW_SCRATCH = 4096  # the row programs' cross-warp reduction space


def unsupported_reason(
    x: jax.Array, weights: Sequence[jax.Array], paired: Sequence[bool] = ()
) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call, or None when it can."""
    if x.shape[0] > MAX_ROWS:
        return f"x has {x.shape[0]} rows; the kernel takes at most {MAX_ROWS}"
    if x.dtype not in DTYPES or any(w.dtype != x.dtype for w in weights):
        dtypes = sorted({str(w.dtype) for w in weights})
        return f"x and every weight must share a 16-bit float dtype (got {x.dtype} and {dtypes})"
    if x.shape[1] % BLOCK_K:
        return f"K={x.shape[1]} must be a multiple of {BLOCK_K}"
    widths = [w.shape[1] for w in weights if w.shape[1] % BLOCK_N]
    if widths:
        return f"every weight's N must be a multiple of {BLOCK_N} (got {widths})"
    return halves_unsupported_reason(x.dtype) if any(paired) else None


def _check(x: jax.Array, weights: Sequence[jax.Array], row_scale=None, rms_eps=None,
           paired: Sequence[bool] = ()) -> None:  # fmt: skip
    if x.ndim != 2 or not weights or any(w.ndim != 2 or w.shape[0] != x.shape[1] for w in weights):
        raise ValueError(
            f"{_OP}: x must be [R, K] and each weight [K, N] with x's K; got x {x.shape} and "
            f"weights {[w.shape for w in weights]}"
        )
    if paired and len(paired) != len(weights):
        raise ValueError(f"{_OP}: paired has {len(paired)} flags for {len(weights)} weights")
    flags = paired or (False,) * len(weights)
    odd = [w.shape[1] for w, p in zip(weights, flags, strict=True) if p and w.shape[1] % BLOCK_N]
    if odd:
        raise ValueError(f"{_OP}: a paired weight's N must be whole tiles of {BLOCK_N}; got {odd}")
    check_row_scale(_OP, x.shape[0], row_scale, rms_eps)


def projections_reference(
    x: jax.Array,
    weights: Sequence[jax.Array],
    row_scale: jax.Array | None = None,
    rms_eps: float | None = None,
    paired: Sequence[bool] = (),
) -> tuple[jax.Array, ...]:
    """The same products in XLA, one each (a paired weight's SwiGLU from float32 sums)."""
    scale = rms_row_scale(row_scale, rms_eps, x.shape[1])

    def product(w: jax.Array, swiglu: bool) -> jax.Array:
        y = jnp.dot(x, w, preferred_element_type=F32)
        y = y if scale is None else y * scale[:, None]
        return (paired_swiglu(y) if swiglu else y).astype(x.dtype)

    flags = paired or (False,) * len(weights)
    return tuple(product(w, p) for w, p in zip(weights, flags, strict=True))


def _valid_flags(valid: jax.Array | None, rows: int) -> jax.Array:
    """The ranked launches' int32 operand of the rows' validity (every row when None)."""
    return jnp.ones((rows,), jnp.int32) if valid is None else valid.astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("splits", "partial", "variant", "interpret", "rms_eps", "paired", "top_k"),
)
def _kernel(
    x: jax.Array, weights: tuple[jax.Array, ...], row_scale: jax.Array | None = None,
    valid: jax.Array | None = None, counters: jax.Ref | None = None, *, splits: int,
    partial: bool, variant: ProductVariant, interpret: bool, rms_eps: float | None = None,
    paired: tuple[bool, ...] = (), top_k: int | None = None,
):  # fmt: skip
    """Every weight's products over ``splits`` parts of K: ``[splits, R, N_i]`` each, float32
    when ``partial``, else in x's dtype; each row times its ``row_scale`` when given (or
    ``1 / sqrt(row_scale / K + rms_eps)`` with the whole K, ``tile_product``); a ``paired``
    weight's ``[1, R, N_i / 2]`` SwiGLU hidden rows (``tile_product(halves=True)``).

    With ``top_k`` (one split, not partial) also each row of the first product ranked
    (``routing_mgpu.rank_row``): float32 exponentials and int32 ids ``[R, top_k]`` after the
    products. The first weight's programs signal a counter once their tile is stored, and
    one more program a row, launched after every tile's, waits for them, then ranks."""
    rows, k_dim = x.shape
    steps = k_dim // BLOCK_K // splits
    span = steps * BLOCK_K
    held = round_up(rows, ALIGN)
    xp = jnp.pad(x, ((0, held - rows), (0, 0)))
    scaled = row_scale is not None
    ranked = top_k is not None
    operands = [xp, *weights]
    if scaled:
        operands.append(jnp.pad(row_scale.astype(F32), (0, held - rows), constant_values=1))
    out_dtype = F32 if partial else x.dtype
    paired = paired or (False,) * len(weights)
    halves = any(paired)
    tiles = [w.shape[1] // BLOCK_N for w in weights]
    starts = [sum(tiles[:i]) for i in range(len(tiles))]
    entries = weights[0].shape[1]
    rank_scratch = routing_mgpu.scratch(entries, x.dtype) if ranked else []
    smem_bytes = SMEM_BYTES
    if ranked:
        operands.append(_valid_flags(valid, rows))
        if not interpret:  # the interpreter runs the row programs after every tile's
            counters = jax.new_ref(jnp.zeros((1,), jnp.int32)) if counters is None else counters
            operands.append(counters)
        smem_bytes -= routing_mgpu.REDUCTION_SCRATCH_BYTES + scratch_smem_bytes(rank_scratch)
    variant = filling_ring(
        variant, sum(tiles) * splits, steps, x.dtype, held, out_dtype, row_scale=scaled,
        halves=halves, smem_bytes=smem_bytes,
    )  # fmt: skip
    product_scratch = scratch(
        steps, x.dtype, variant, held, out_dtype, row_scale=scaled, halves=halves,
        declared_tiling=ranked,
    )  # fmt: skip

    def body(x_ref, *refs):
        w_refs, refs = refs[: len(weights)], refs[len(weights) :]
        scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
        valid_ref = ready = None
        if ranked:
            valid_ref, refs = refs[0], refs[1:]
            if not interpret:
                ready, refs = refs[0].at[pl.ds(0, 1)], refs[1:]
        o_refs, refs = refs[: len(weights)], refs[len(weights) :]
        if ranked:
            exps_ref, ids_ref, refs = refs[0], refs[1], refs[2:]
        scratch_refs, rank_refs = refs[: len(product_scratch)], refs[len(product_scratch) :]
        tile, split = lax.axis_index("t"), lax.axis_index("s")
        ks = pl.ds(split * span, span)

        def product(w_ref, o_ref, start, swiglu, signal):
            cols = pl.ds((tile - start) * BLOCK_N, BLOCK_N)
            out_n = BLOCK_N // 2 if swiglu else BLOCK_N
            tile_product(
                x_ref.at[:, ks], w_ref.at[ks, cols],
                o_ref.at[split, :, pl.ds((tile - start) * out_n, out_n)], *scratch_refs,
                steps=steps, variant=variant, interpret=interpret, row_scale=scale_ref,
                rms=None if rms_eps is None else (rms_eps, k_dim), halves=swiglu,
            )  # fmt: skip
            if signal and ready is not None:  # the tile has landed in GMEM before its signal
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                _counters.signal(ready)

        if ranked:
            # Traced before the products: Mosaic GPU's layout search then settles the
            # ranking's layouts first and backtracks within the products' alone (after
            # them, beside a paired weight's SwiGLU, it runs out of its budget).

            @pl.when(tile >= sum(tiles))
            def _rank():
                r = tile - sum(tiles)
                if ready is not None:
                    _counters.wait_then_count(ready, tiles[0], tiles[0] + rows)
                routing_mgpu.rank_row(
                    o_refs[0].at[0, r], exps_ref.at[r], ids_ref.at[r], *rank_refs, k=top_k,
                    valid=valid_ref[r] != 0,
                )  # fmt: skip

        mine = zip(w_refs, o_refs, starts, tiles, paired, strict=True)
        for i, (w_ref, o_ref, start, count, swiglu) in enumerate(mine):
            ours = (tile >= start) & (tile < start + count)
            signal = ranked and i == 0  # the ranking waits for the first weight's tiles
            pl.when(ours)(functools.partial(product, w_ref, o_ref, start, swiglu, signal))
        plgpu.wait_smem_to_gmem(0)

    out_type = [
        jax.ShapeDtypeStruct((splits, held, w.shape[1] // (1 + p)), out_dtype)
        for w, p in zip(weights, paired, strict=True)
    ]
    if ranked:
        out_type += _ranking_types(rows, top_k)
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=(*product_scratch, *rank_scratch),
        grid=(sum(tiles) + (rows if ranked else 0), splits),
        grid_names=("t", "s"),
        compiler_params=plgpu.CompilerParams(
            reduction_scratch_bytes=routing_mgpu.REDUCTION_SCRATCH_BYTES if ranked else 0
        ),
        interpret=interpret_params(interpret),
        kernel_name="projections_ranked"
        if ranked
        else ("projection_partials" if partial else "projections"),
    )(*operands)
    products = tuple(out[:, :rows] for out in outs[: len(weights)])
    return (*products, *outs[len(weights) :])


def _ranking_types(rows: int, top_k: int) -> list[jax.ShapeDtypeStruct]:
    """A ranked launch's last outputs: the chosen exponentials and ids ``[R, top_k]``."""
    return [
        jax.ShapeDtypeStruct((rows, top_k), F32),
        jax.ShapeDtypeStruct((rows, top_k), jnp.int32),
    ]


def combined_unsupported_reason(
    x: jax.Array, weights: Sequence[jax.Array], splits: int, paired: Sequence[bool] = ()
) -> str | None:
    """Why the Mosaic GPU kernel cannot take these products over ``splits`` parts of K
    combined in the launch (``projections(splits=)``), or None."""
    flags = paired or (False,) * len(weights)
    for w, p in zip(weights, flags, strict=True):
        width = w.shape[1] // 2 if p else w.shape[1]
        if width % COMBINED_WIDTH:
            return (
                f"a product's {'hidden ' if p else ''}width {width} must be a multiple of "
                f"{COMBINED_WIDTH} (a row program's threads)"
            )
    return unsupported_reason(x, weights, paired) or _split_reason(x, splits)


@functools.partial(
    jax.jit, static_argnames=("splits", "variant", "interpret", "rms_eps", "paired", "top_k")
)
def _combined_kernel(x, weights, row_scale, valid, counters, *, splits: int,
                     variant: ProductVariant, interpret: bool, rms_eps: float | None,
                     paired: tuple[bool, ...], top_k: int | None):  # fmt: skip
    """The launch of ``projections`` over ``splits`` parts of K: one program per (column
    tile, split) stores its float32 partial product and signals, then one program a row
    waits for them all, sums its row's partials in split order, scales the sums, forms a
    paired weight's SwiGLU, stores each product in x's dtype and, with ``top_k``, ranks the
    first (``routing_mgpu.rank_values``)."""
    rows, k_dim = x.shape
    dtype = x.dtype
    steps = k_dim // BLOCK_K // splits
    span = steps * BLOCK_K
    held = round_up(rows, ALIGN)
    tiles = [w.shape[1] // BLOCK_N for w in weights]
    starts = [sum(tiles[:i]) for i in range(len(tiles))]
    partials = sum(tiles) * splits
    paired = paired or (False,) * len(weights)
    scaled, ranked = row_scale is not None, top_k is not None
    rank_scratch = list(routing_mgpu.values_scratch()) if ranked else []
    variant = filling_ring(
        variant, partials, steps, dtype, held, F32,
        smem_bytes=SMEM_BYTES - _ROW_SCRATCH - scratch_smem_bytes(rank_scratch),
    )  # fmt: skip
    operands = [jnp.pad(x, ((0, held - rows), (0, 0))), *weights]
    if scaled:
        operands.append(row_scale.astype(F32))
    if ranked:
        operands.append(_valid_flags(valid, rows))
    if not interpret:
        # The interpreter runs the programs one after another in launch order (and cannot
        # run inline Mosaic GPU): every partial is stored before a row program reads it.
        if counters is None:
            counters = jax.new_ref(jnp.zeros((1,), jnp.int32))
        operands.append(counters)
    # A paired weight's partials keep its tiles apart ([tile, gate columns | up columns]),
    # so a row program reads each half as a strided view in one layout.
    part_shapes = [
        (splits, held, t, BLOCK_N) if p else (splits, held, t * BLOCK_N)
        for t, p in zip(tiles, paired, strict=True)
    ]
    out_shapes = [
        (rows, t, BLOCK_N // 2) if p else (rows, t * BLOCK_N)
        for t, p in zip(tiles, paired, strict=True)
    ]
    n_weights = len(weights)

    def body(x_ref, *refs):
        w_refs, refs = refs[:n_weights], refs[n_weights:]
        scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
        valid_ref, refs = (refs[0], refs[1:]) if ranked else (None, refs)
        ready, refs = (None, refs) if interpret else (refs[0].at[pl.ds(0, 1)], refs[1:])
        part_refs, refs = refs[:n_weights], refs[n_weights:]
        o_refs, refs = refs[:n_weights], refs[n_weights:]
        if ranked:
            exps_ref, ids_ref, refs = refs[0], refs[1], refs[2:]
        product_refs, rank_refs = (
            refs[: len(refs) - len(rank_scratch)],
            refs[len(refs) - len(rank_scratch) :],
        )
        program = lax.axis_index("i")

        def partial(w_ref, part_ref, start, swiglu):
            tile = program // splits - start
            split = lax.rem(program, splits)
            ks = pl.ds(split * span, span)
            if swiglu:
                out = part_ref.at[split, :, tile]
            else:
                out = part_ref.at[split, :, pl.ds(tile * BLOCK_N, BLOCK_N)]
            tile_product(
                x_ref.at[:, ks], w_ref.at[ks, pl.ds(tile * BLOCK_N, BLOCK_N)], out,
                *product_refs, steps=steps, variant=variant, interpret=interpret,
            )  # fmt: skip
            if ready is not None:  # the partial has landed in GMEM before its signal
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                _counters.signal(ready)

        for w_ref, part_ref, start, count, swiglu in zip(
            w_refs, part_refs, starts, tiles, paired, strict=True
        ):
            ours = (program >= start * splits) & (program < (start + count) * splits)
            pl.when(ours)(functools.partial(partial, w_ref, part_ref, start, swiglu))

        @pl.when(program >= partials)
        def _row():
            r = program - partials
            if ready is not None:
                _counters.wait_then_count(ready, partials, partials + rows)
            scale = None
            if scaled:
                scale = scale_ref[r]
                if rms_eps is not None:
                    scale = lax.rsqrt(scale * (1.0 / k_dim) + rms_eps)

            def summed(views):
                """The views' float32 partials summed in split order, times the scale."""
                shape = views[0].shape
                layout = strided(shape)
                total = functools.reduce(
                    operator.add, [plgpu.load(v, layout=layout) for v in views]
                )
                return total if scale is None else total * scale

            for i, (part_ref, o_ref, swiglu) in enumerate(
                zip(part_refs, o_refs, paired, strict=True)
            ):
                if swiglu:
                    half = BLOCK_N // 2
                    gate = summed([part_ref.at[s, r, :, pl.ds(0, half)] for s in range(splits)])
                    up = summed([part_ref.at[s, r, :, pl.ds(half, half)] for s in range(splits)])
                    o_ref[r] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(dtype)
                    continue
                out = summed([part_ref.at[s, r] for s in range(splits)]).astype(dtype)
                o_ref[r] = out
                if ranked and i == 0:
                    routing_mgpu.rank_values(
                        out, exps_ref.at[r], ids_ref.at[r], *rank_refs, k=top_k,
                        valid=valid_ref[r] != 0,
                    )  # fmt: skip

        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct(shape, F32) for shape in part_shapes]
    out_type += [jax.ShapeDtypeStruct(shape, dtype) for shape in out_shapes]
    if ranked:
        out_type += _ranking_types(rows, top_k)
    outs = plgpu.kernel(
        body,
        out_type=tuple(out_type),
        scratch_types=(*scratch(steps, dtype, variant, held, F32), *rank_scratch),
        grid=(partials + rows,),
        grid_names=("i",),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=_ROW_SCRATCH),
        interpret=interpret_params(interpret),
        kernel_name="projections_combined",
    )(*operands)
    products = tuple(out.reshape(rows, -1) for out in outs[n_weights : 2 * n_weights])
    return (*products, *outs[2 * n_weights :])


def combined_reference(
    x: jax.Array, weights: Sequence[jax.Array], splits: int, row_scale=None, rms_eps=None,
    paired: Sequence[bool] = (),
) -> tuple[jax.Array, ...]:  # fmt: skip
    """``projections(splits=)`` in XLA: each weight's float32 partial products over
    ``splits`` parts of K summed in split order, then scaled, a paired weight's SwiGLU
    formed, cast to x's dtype."""
    scale = rms_row_scale(row_scale, rms_eps, x.shape[1])
    flags = paired or (False,) * len(weights)
    partials = projection_partials_reference(x, weights, splits)

    def combined(partial: jax.Array, swiglu: bool) -> jax.Array:
        y = functools.reduce(operator.add, list(partial))
        y = y if scale is None else y * scale[:, None]
        return (paired_swiglu(y) if swiglu else y).astype(x.dtype)

    return tuple(combined(p, f) for p, f in zip(partials, flags, strict=True))


def _eps(rms_eps: float | None) -> float | None:
    return None if rms_eps is None else float(rms_eps)


def projections(
    x: jax.Array,
    weights: Sequence[jax.Array],
    *,
    row_scale: jax.Array | None = None,
    rms_eps: float | None = None,
    paired: Sequence[bool] = (),
    splits: int = 1,
    counters: jax.Ref | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, ...]:
    """``x @ w`` for every ``w`` of ``weights`` (float32 accumulation), each row's sum times
    its ``row_scale`` when given; for a ``paired`` weight, the SwiGLU of its product.

    Args:
      x: ``[R, K]`` rows (the kernel takes up to ``MAX_ROWS``).
      weights: ``[K, N_i]`` each, in x's dtype (read in place).
      row_scale: ``[R]``, applied in float32 before the cast.
      rms_eps: with it, ``row_scale`` holds each row's sum of squares over K (of the
        norm's input) and the rows are scaled by ``1 / sqrt(row_scale / K + rms_eps)``: an
        RMS norm's scale (the norm's weight goes into x, its row scale after the product),
        formed in the launch.
      paired: one flag per weight (default none): a flagged weight holds a SwiGLU's gate
        and up columns laid out by ``pair_halves``, and its entry is ``silu(gate) * up``
        ``[R, N_i / 2]`` of the scaled float32 sums, formed in the launch's epilogue.
      splits: parts of K (K must divide into them): with more than one, a program per
        (column tile, part) stores a float32 partial product, and one more program a row
        waits on a GMEM counter until every partial is stored, then sums, scales and forms
        its row's products (``combined_reference``): more programs for weights of few
        column tiles, each reading less, at the cost of the partials' round trip.
      counters: with ``splits``, optional int32 ``Ref`` ``[n >= 1]`` of zeros that the
        launch counts its stored partials in and leaves at zero (a step's shared buffer);
        without it the launch makes its own. The interpreter and the reference ignore it.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      A tuple of ``[R, N_i]`` (``[R, N_i / 2]`` where paired) in x's dtype.
    """
    weights, paired = tuple(weights), tuple(bool(p) for p in paired)
    _check(x, weights, row_scale, rms_eps, paired)
    splits = _checked_splits(x, weights, splits)
    _counters.check_counters(_OP, counters, 1)
    if splits > 1:
        reason = None
        if impl != "reference":
            reason = combined_unsupported_reason(x, weights, splits, paired)
        choice = resolve_impl(_OP, impl, reason)
        if choice == "reference" or x.shape[0] == 0:
            return combined_reference(x, weights, splits, row_scale, rms_eps, paired)
        return _combined_kernel(
            x, weights, row_scale, None, counters, splits=splits, variant=current_variant(),
            interpret=choice == "interpret", rms_eps=_eps(rms_eps), paired=paired, top_k=None,
        )  # fmt: skip
    reason = unsupported_reason(x, weights, paired) if impl != "reference" else None
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference" or x.shape[0] == 0:
        return projections_reference(x, weights, row_scale, rms_eps, paired)
    outs = _kernel(
        x, weights, row_scale, splits=1, partial=False, variant=current_variant(),
        interpret=choice == "interpret", rms_eps=_eps(rms_eps),
        paired=paired,
    )  # fmt: skip
    return tuple(out[0] for out in outs)


def ranked_unsupported_reason(
    x: jax.Array, weights: Sequence[jax.Array], top_k: int, paired: Sequence[bool] = ()
) -> str | None:
    """Why the Mosaic GPU kernel cannot take this ``ranked_projections`` call, or None."""
    if paired and paired[0]:
        return "the ranked product (the first weight) cannot be paired"
    reason = unsupported_reason(x, weights, paired)
    return reason or routing_mgpu.unsupported_reason(weights[0].shape[1], top_k, x.dtype)


def ranked_projections(
    x: jax.Array,
    weights: Sequence[jax.Array],
    *,
    top_k: int,
    valid: jax.Array | None = None,
    row_scale: jax.Array | None = None,
    rms_eps: float | None = None,
    paired: Sequence[bool] = (),
    splits: int = 1,
    counters: jax.Ref | None = None,
    impl: str = "auto",
) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array]:
    """``projections(x, weights, ...)`` with each row of the first product (a MoE router's
    logits) ranked in the same launch, as ``moe.top_k_exps`` ranks it: the products, then
    each row's ``top_k`` largest entries as ``exp(value - max)`` (float32 ``[R, top_k]``,
    largest first) and their int32 indices ``[R, top_k]``, index ``N_0`` (no entry) in rows
    where ``valid`` (bool ``[R]``, or int32 flags: 0 for False) is False. The ranking reads
    the product as stored, in x's dtype: the launch hands a MoE block's experts their ids
    with no XLA reductions in between.

    ``counters``: optional int32 ``Ref`` ``[n >= 1]`` of zeros that the launch counts the
    first weight's stored tiles (or with ``splits`` every stored partial) in and leaves at
    zero (``moe.expert_mlp``'s, shared by a step's launches); without it the launch makes
    its own. The interpreter and the reference ignore it. The other arguments are
    ``projections``': with ``splits`` the row programs that combine the partials rank
    their row from registers."""
    weights, paired = tuple(weights), tuple(bool(p) for p in paired)
    _check(x, weights, row_scale, rms_eps, paired)
    splits = _checked_splits(x, weights, splits)
    _counters.check_counters(_OP, counters, 1)
    if valid is not None and (
        tuple(valid.shape) != (x.shape[0],) or valid.dtype not in (jnp.bool_, jnp.int32)
    ):
        raise ValueError(
            f"{_OP}: valid {valid.dtype}{list(valid.shape)} must be bool or int32 [R] = "
            f"[{x.shape[0]}]"
        )
    if not 0 < top_k <= weights[0].shape[1]:
        raise ValueError(f"{_OP}: top_k={top_k} must be in 1..{weights[0].shape[1]} (N_0)")
    reason = None
    if impl != "reference":
        reason = ranked_unsupported_reason(x, weights, top_k, paired)
        if splits > 1:
            reason = reason or combined_unsupported_reason(x, weights, splits, paired)
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference" or x.shape[0] == 0:
        if splits > 1:
            products = combined_reference(x, weights, splits, row_scale, rms_eps, paired)
        else:
            products = projections_reference(x, weights, row_scale, rms_eps, paired)
        return (products, *routing.top_k_exps(products[0].astype(F32), top_k, valid))
    if splits > 1:
        *outs, exps, ids = _combined_kernel(
            x, weights, row_scale, valid, counters, splits=splits, variant=current_variant(),
            interpret=choice == "interpret", rms_eps=_eps(rms_eps), paired=paired, top_k=top_k,
        )  # fmt: skip
        return tuple(outs), exps, ids
    *outs, exps, ids = _kernel(
        x, weights, row_scale, valid, counters, splits=1, partial=False,
        variant=current_variant(), interpret=choice == "interpret",
        rms_eps=_eps(rms_eps), paired=paired, top_k=top_k,
    )  # fmt: skip
    return tuple(out[0] for out in outs), exps, ids


def partial_splits(k: int, widths: Sequence[int]) -> int:
    """The splits of K that ``projection_partials`` takes for ``[k, n]`` weights of these
    widths: the most of 1, 2, 4, 8 that keeps one program per (column tile, split) within
    the SMs and each split a whole number of ``BLOCK_K`` blocks."""
    tiles, steps = sum(n // BLOCK_N for n in widths), k // BLOCK_K
    return max(s for s in (1, 2, 4, 8) if s == 1 or (tiles * s <= NUM_SMS and steps % s == 0))


def _checked_splits(x: jax.Array, weights: Sequence[jax.Array], splits: int | None) -> int:
    """``splits`` (default ``partial_splits``), raising unless it divides K."""
    if splits is None:
        splits = partial_splits(x.shape[1], [w.shape[1] for w in weights])
    if splits < 1 or x.shape[1] % splits:
        raise ValueError(f"{_OP}: splits={splits} must be >= 1 and divide K={x.shape[1]}")
    return splits


def _split_reason(x: jax.Array, splits: int) -> str | None:
    """Why the kernel cannot split x's K into ``splits`` parts of whole blocks, or None."""
    if x.shape[1] % (splits * BLOCK_K):
        return f"K={x.shape[1]} must be a multiple of splits x {BLOCK_K}"
    return None


def projection_partials_reference(
    x: jax.Array, weights: Sequence[jax.Array], splits: int
) -> tuple[jax.Array, ...]:
    """The same partial products in XLA: float32 ``[splits, R, N_i]`` each."""
    rows, k_dim = x.shape
    xs = x.reshape(rows, splits, k_dim // splits)
    return tuple(
        jnp.einsum(
            "rsk,skn->srn",
            xs,
            w.reshape(splits, k_dim // splits, w.shape[1]),
            preferred_element_type=F32,
        )
        for w in weights
    )


def projection_partials(
    x: jax.Array, weights: Sequence[jax.Array], *, splits: int | None = None, impl: str = "auto"
) -> tuple[jax.Array, ...]:
    """``x @ w`` for every ``w`` of ``weights`` as float32 partial products over ``splits``
    equal parts of K: the sum of each over its first axis is the product. For products with
    few column tiles (an output projection, a MoE block's router and shared expert), whose
    programs alone leave most SMs idle.

    Args:
      x: ``[R, K]`` rows (the kernel takes up to ``MAX_ROWS``).
      weights: ``[K, N_i]`` each, in x's dtype (read in place).
      splits: parts of K (default ``partial_splits(K, widths)``); K must divide into them.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      A tuple of float32 ``[splits, R, N_i]``.
    """
    weights = tuple(weights)
    _check(x, weights)
    splits = _checked_splits(x, weights, splits)
    reason = None
    if impl != "reference":
        reason = unsupported_reason(x, weights) or _split_reason(x, splits)
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference" or x.shape[0] == 0:
        return projection_partials_reference(x, weights, splits)
    return _kernel(
        x, weights, splits=splits, partial=True, variant=current_variant(),
        interpret=choice == "interpret",
    )  # fmt: skip


def add_unsupported_reason(x: jax.Array, w: jax.Array, residual: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel cannot take this ``projection_add`` call, or None."""
    if residual.dtype != x.dtype:
        return f"the residual's dtype {residual.dtype} must be x's {x.dtype}"
    if w.shape[1] % (_ROW_THREADS * 2):
        return f"N={w.shape[1]} must be a multiple of {_ROW_THREADS * 2} (whole pairs a thread)"
    return unsupported_reason(x, [w])


def projection_add_reference(
    x: jax.Array, w: jax.Array, residual: jax.Array, splits: int
) -> tuple[jax.Array, jax.Array]:
    """The same in XLA: the partial products summed in split order, in x's dtype, added to
    the residual; ``(out [R, N]``, float32 ``square_sums [R])``."""
    (partial,) = projection_partials_reference(x, [w], splits)
    product = functools.reduce(operator.add, list(partial))
    out = residual + product.astype(x.dtype)
    out32 = out.astype(F32)
    return out, jnp.sum(out32 * out32, axis=-1)


@functools.partial(jax.jit, static_argnames=("splits", "variant", "interpret"))
def _add_kernel(x, w, residual, counters, *, splits: int, variant: ProductVariant,
                interpret: bool):  # fmt: skip
    """The launch of ``projection_add``: one program per (column tile, split) stores its
    float32 partial product and signals, then one program a row waits for them all, sums
    its row's partials in split order, adds the residual and stores the row and its square
    sum."""
    rows, k_dim = x.shape
    n = w.shape[1]
    dtype = x.dtype
    steps = k_dim // BLOCK_K // splits
    span = steps * BLOCK_K
    held = round_up(rows, ALIGN)
    tiles = n // BLOCK_N
    partials = tiles * splits
    # The row programs' square sums reduce across warps, through SMEM beside the ring.
    variant = filling_ring(
        variant, partials, steps, dtype, held, F32, smem_bytes=SMEM_BYTES - _ROW_SCRATCH
    )
    # Each thread loads 4 adjacent float32 partials (16 bytes) where the row has them.
    lanes = plgpu.Layout.WG_STRIDED((n,), 4 if (n // _ROW_THREADS) % 4 == 0 else 2)
    operands = [jnp.pad(x, ((0, held - rows), (0, 0))), w, residual]
    if not interpret:
        # The interpreter runs the programs one after another in launch order (and cannot
        # run inline Mosaic GPU): every partial is stored before a row program reads it.
        if counters is None:
            counters = jax.new_ref(jnp.zeros((1,), jnp.int32))
        operands.append(counters)

    def body(x_ref, w_ref, residual_ref, *refs):
        ready, refs = (None, refs) if interpret else (refs[0], refs[1:])
        part_ref, o_ref, sums_ref, scratch_refs = refs[0], refs[1], refs[2], refs[3:]
        program = lax.axis_index("i")

        @pl.when(program < partials)
        def _partial():
            tile, split = program // splits, lax.rem(program, splits)
            cols = pl.ds(tile * BLOCK_N, BLOCK_N)
            ks = pl.ds(split * span, span)
            tile_product(
                x_ref.at[:, ks], w_ref.at[ks, cols], part_ref.at[split, :, cols],
                *scratch_refs, steps=steps, variant=variant, interpret=interpret,
            )  # fmt: skip
            if ready is not None:  # the partial has landed in GMEM before its signal
                plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                _counters.signal(ready.at[pl.ds(0, 1)])

        @pl.when(program >= partials)
        def _row():
            r = program - partials
            if ready is not None:
                _counters.wait_then_count(ready.at[pl.ds(0, 1)], partials, partials + rows)
            product = plgpu.load(part_ref.at[0, r], layout=lanes)
            for split in range(1, splits):
                product = product + plgpu.load(part_ref.at[split, r], layout=lanes)
            out = plgpu.load(residual_ref.at[r], layout=lanes) + product.astype(dtype)
            o_ref[r] = out
            out32 = out.astype(F32)
            sums_ref[r] = jnp.sum(out32 * out32)

        plgpu.wait_smem_to_gmem(0)

    _, out, sums = plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((splits, held, n), F32),
            jax.ShapeDtypeStruct((rows, n), dtype),
            jax.ShapeDtypeStruct((rows,), F32),
        ),
        scratch_types=scratch(steps, dtype, variant, held, F32),
        grid=(partials + rows,),
        grid_names=("i",),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=_ROW_SCRATCH),
        interpret=interpret_params(interpret),
        kernel_name="projection_add",
    )(*operands)
    return out, sums


def projection_add(
    x: jax.Array,
    w: jax.Array,
    residual: jax.Array,
    *,
    splits: int | None = None,
    counters: jax.Ref | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """``residual + x @ w`` with each new row's float32 sum of squares, in one launch: an
    output projection added to the residual stream, the next norm's square sums beside it.
    The product is ``projection_partials``' over ``splits`` parts of K (its programs fill the
    SMs where the weight has few column tiles), and the launch's last programs, one a row,
    wait until every partial is stored, then sum their row's partials in split order, add
    the residual and sum the new row's squares: no kernel of XLA's between the product and
    the next layer's launch.

    Args:
      x: ``[R, K]`` rows (the kernel takes up to ``MAX_ROWS``).
      w: ``[K, N]`` in x's dtype (read in place).
      residual: ``[R, N]`` in x's dtype.
      splits: parts of K (default ``partial_splits(K, [N])``); K must divide into them.
      counters: optional int32 ``Ref`` ``[n >= 1]`` of zeros that the launch counts its
        stored partials in and leaves at zero (``moe.expert_mlp``'s, shared by a step's
        launches); without it the launch makes its own. The interpreter and the reference
        ignore it.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      ``(out [R, N]`` in x's dtype, float32 ``square_sums [R])``.
    """
    _check(x, [w])
    if residual.shape != (x.shape[0], w.shape[1]):
        raise ValueError(
            f"{_OP}: the residual must be [R, N] = {(x.shape[0], w.shape[1])}; got {residual.shape}"
        )
    _counters.check_counters(_OP, counters, 1)
    splits = _checked_splits(x, [w], splits)
    reason = None
    if impl != "reference":
        reason = add_unsupported_reason(x, w, residual) or _split_reason(x, splits)
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference" or x.shape[0] == 0:
        return projection_add_reference(x, w, residual, splits)
    return _add_kernel(
        x, w, residual, counters, splits=splits, variant=current_variant(),
        interpret=choice == "interpret",
    )  # fmt: skip
