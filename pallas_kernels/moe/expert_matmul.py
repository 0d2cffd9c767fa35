"""expert_matmul: each row of ``x`` times the matrices of its own experts, read by expert id.

``out[r, c] = x[r] @ w[experts[r, c]]``: the products of a MoE block when it routes only a few
tokens (decode at small batch), with no sort of the (token, choice) pairs, no gather of their
rows and no groups. An expert id outside ``0 .. E - 1`` (a padding row's) gives a zero row and
reads nothing.

The Mosaic GPU kernel (sm_90): a program owns a ``BLOCK_N``-column tile of some (row, choice)
pairs (``programs_per_tile``: one wave of programs). For each pair it reads the expert id and
multiplies the 8-row group of ``x`` that holds its row (TMA moves whole 8-row groups) by that
expert's ``[K, BLOCK_N]`` tile, streamed through a TMA ring (``_skinny.tile_product``); a
padding pair costs the read of its id. It stores all 8 rows and XLA keeps its row.
A step reads each pair's expert tile once, so it costs about its experts' bytes while few
pairs share an expert; the sort-based ``grouped_matmul`` is for many rows per expert. A
``dense`` product of the same width (a MoE block's shared expert down projection) takes one
more program per column tile of the same launch.

``expert_hidden`` is the same launch for a SwiGLU's first half over weights laid out by
``pair_halves`` (each 64-column tile the gate and up columns of 32 hidden units): each
program multiplies its pair's rows by one tile and stores ``silu(gate) * up``, the hidden
rows the down projection reads, so no XLA kernel forms them between the two launches.

``expert_mlp`` runs both launches' programs as one grid: in launch order the dense product's
programs (they wait for nothing), the hidden programs, then the pairs' down programs. A hidden
program adds 1 to its pair's GMEM counter once its tile is stored; a down program requests
its weight blocks, waits until all of its pair's hidden tiles are signalled, then requests
their rows (``tile_product(await_rows=)``). The down weights then stream while the hidden
programs read theirs, where a down launch of its own starts reading only when the hidden
launch has ended. The counters are an int32 operand the launch updates in place, and leaves
at zero: each down program adds 1 once its wait is over, and the add that completes a pair's
count sets it back to zero. So a caller may hand one buffer to every launch of a step
(``counters``), which a layer scan carries, and no launch zero-fills its own; without one, a
launch computes its zeros from its own ids (``_counters.own_zeros``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _counters
from pallas_kernels._common import NUM_SMS, interpret_params, resolve_impl, round_up
from pallas_kernels._mgpu_chunks import ALIGN, F32
from pallas_kernels._skinny import (
    BLOCK_K,
    BLOCK_N,
    DTYPES,
    PAIRED_UNITS,
    ROWS_PER_TILE,
    ProductVariant,
    check_row_scale,
    current_variant,
    halves_unsupported_reason,
    pair_halves,
    paired_swiglu,
    programs_per_sm,
    rms_row_scale,
    scratch,
    tile_product,
    unpair_halves,
)

__all__ = [
    "BLOCK_K",
    "BLOCK_N",
    "PAIRED_UNITS",
    "PairTiles",
    "expert_hidden",
    "expert_hidden_reference",
    "expert_matmul",
    "expert_matmul_reference",
    "hidden_unsupported_reason",
    "pair_halves",
    "paired_swiglu",
    "programs_per_tile",
    "unpair_halves",
    "unsupported_reason",
]

_OP = "expert_matmul"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairTiles:
    """A by-id launch's output as the launch stores it: ``tiles`` ``[P, 8, N]`` (P at least
    the pairs of ``experts``, int32 ``[R, C]``), pair p's tile the 8-row group of its row
    times its expert, the pair's own row at line ``(p // per_line) % 8``; a pair whose id is
    outside ``0 .. num_experts - 1`` never wrote its tile. A down launch reads each pair's
    tile in place (``expert_matmul(PairTiles, ...)``), so XLA never gathers the rows
    between the two launches."""

    tiles: jax.Array
    experts: jax.Array
    num_experts: int = dataclasses.field(metadata=dict(static=True))
    per_line: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """``[pairs, N]``: the rows a down launch takes."""
        return (self.experts.size, self.tiles.shape[2])

    @property
    def dtype(self):
        return self.tiles.dtype

    ndim = 2

    def rows(self) -> jax.Array:
        """``[R, C, N]``: each pair's own row, zeros for ids out of range."""
        pair = jnp.arange(self.experts.size)
        out = self.tiles[pair, (pair // self.per_line) % ALIGN]
        flat = self.experts.reshape(-1)
        valid = (flat >= 0) & (flat < self.num_experts)
        return jnp.where(valid[:, None], out, 0).reshape(*self.experts.shape, -1)


def unsupported_reason(
    x: jax.Array, w: jax.Array, dense: tuple[jax.Array, jax.Array] | None = None
) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call, or None when it can."""
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        return f"x and w must share a 16-bit float dtype (got {x.dtype} and {w.dtype})"
    if x.shape[1] % BLOCK_K or w.shape[2] % BLOCK_N:
        return (
            f"K={x.shape[1]} must be a multiple of {BLOCK_K} and N={w.shape[2]} a multiple "
            f"of {BLOCK_N}"
        )
    if dense is not None:
        xd, wd = dense
        if xd.dtype != x.dtype or wd.dtype != x.dtype:
            return f"dense operands must be {x.dtype} (got {xd.dtype} and {wd.dtype})"
        if xd.shape[1] % BLOCK_K:
            return f"the dense product's K={xd.shape[1]} must be a multiple of {BLOCK_K}"
        if xd.shape[0] > ROWS_PER_TILE:
            return f"the dense product has {xd.shape[0]} rows; the kernel takes {ROWS_PER_TILE}"
    return None


def _check(x, w, experts, dense=None) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"{_OP}: x must be [R, K] and w [E, K, N] with one K; got {x.shape} and {w.shape}"
        )
    if experts.ndim != 2 or experts.shape[0] != x.shape[0] or experts.dtype != jnp.int32:
        raise ValueError(
            f"{_OP}: experts must be int32 [R={x.shape[0]}, C]; got {experts.dtype} {experts.shape}"
        )
    if dense is not None:
        xd, wd = dense
        if xd.ndim != 2 or wd.ndim != 2 or xd.shape[1] != wd.shape[0] or wd.shape[1] != w.shape[2]:
            raise ValueError(
                f"{_OP}: dense must be (xd [Rd, Kd], wd [Kd, N={w.shape[2]}]); got "
                f"{xd.shape} and {wd.shape}"
            )


def expert_matmul_reference(x: jax.Array, w: jax.Array, experts: jax.Array) -> jax.Array:
    """The same product in XLA: each (row, choice) gathers its expert's whole matrix."""
    return _sums_reference(x, w, experts).astype(x.dtype)


def _sums_reference(x: jax.Array, w: jax.Array, experts: jax.Array) -> jax.Array:
    """The float32 products ``[R, C, N]``, zero for ids out of range."""
    num_experts = w.shape[0]
    valid = (experts >= 0) & (experts < num_experts)
    mats = w[jnp.clip(experts, 0, num_experts - 1)]  # [R, C, K, N]
    out = jnp.einsum("rk,rckn->rcn", x, mats, preferred_element_type=F32)
    return jnp.where(valid[..., None], out, 0)


def expert_hidden_reference(
    x: jax.Array, w: jax.Array, experts: jax.Array, *, row_scale=None,
    rms_eps: float | None = None,
) -> jax.Array:  # fmt: skip
    """The same hidden rows in XLA (float32 products, scaled, then ``silu(gate) * up``) of
    ``w`` ``[E, K, 2I]`` laid out by ``pair_halves``."""
    scale = rms_row_scale(row_scale, rms_eps, x.shape[1])
    sums = _sums_reference(x, w, experts)
    if scale is not None:
        sums = sums * scale[:, None, None]
    return paired_swiglu(sums).astype(x.dtype)


def programs_per_tile(pairs: int, col_tiles: int, per_sm: int = 1, reserved: int = 0) -> int:
    """Programs that share one column tile's pairs: the grid, with ``reserved`` programs
    more (a dense product's), stays within one wave of the SMs (``per_sm`` programs fit on
    an SM at once), so a program whose pairs are all padding never delays one that has
    work."""
    return max(1, min(pairs, (NUM_SMS * per_sm - reserved) // col_tiles))


def _each_place(experts_ref, first, *, programs: int, per_program: int, pairs: int,
                num_experts: int, run) -> None:  # fmt: skip
    """Calls ``run(pair, expert)`` for each of program ``first``'s pairs ``first, first +
    programs, ...`` whose expert id is in range. With the real rows first (a bucket's
    padding last), the real pairs spread over all programs. A loop, not unrolled places:
    each unrolled product is a copy of the ring for Mosaic GPU's layout inference and
    ptxas, which took most of a step's compile. The ids load together before the loop, and
    each pass selects its own (a load inside the loop would wait on memory every pass)."""
    ids = [experts_ref[jnp.minimum(first + i * programs, pairs - 1)] for i in range(per_program)]

    def expert_of(i):
        return functools.reduce(
            lambda chosen, j: jnp.where(i == j, ids[j], chosen), range(1, per_program), ids[0]
        )

    def place_product(i, carry):
        place = first + i * programs
        expert = expert_of(i)
        valid = (place < pairs) & (expert >= 0) & (expert < num_experts)
        pl.when(valid)(functools.partial(run, place, expert))
        return carry

    lax.fori_loop(0, per_program, place_product, None)


def _dense_shape(dense) -> tuple[int, int]:
    """(the rows a launch's ``dense`` product's input is padded to, its K blocks); ``(ALIGN,
    0)`` without one."""
    if dense is None:
        return ALIGN, 0
    return round_up(dense[0].shape[0], ALIGN), dense[0].shape[1] // BLOCK_K


def _padded_rows(a: jax.Array, rows: int, value=0) -> jax.Array:
    """``a`` with rows of ``value`` appended along its first axis up to ``rows``."""
    widths = ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1)
    return jnp.pad(a, widths, constant_values=value)


@functools.partial(jax.jit, static_argnames=("variant", "interpret", "gated", "rms_eps"))
def _kernel(x, w, experts, dense=None, row_scale=None, *, variant: ProductVariant,
            interpret: bool, gated: bool = False, rms_eps: float | None = None):  # fmt: skip
    """The launch of ``expert_matmul`` or, ``gated``, of ``expert_hidden``: then ``w`` is
    laid out by ``pair_halves`` (each program's one tile holds the gate and up columns of
    half a tile of hidden units) and each product is scaled by ``row_scale`` (or the
    inverse RMS it gives with ``rms_eps``) before ``silu(gate) * up``. ``x`` may be an
    earlier launch's ``PairTiles``: row r's rows are then its tile r. Returns the launch's
    ``PairTiles`` (and the ``dense`` product's rows)."""
    tiled = isinstance(x, PairTiles)
    rows, k_dim = x.shape
    num_experts, _, w_cols = w.shape
    n_dim = w_cols // 2 if gated else w_cols
    choices = experts.shape[1]
    pairs = rows * choices
    steps = k_dim // BLOCK_K
    col_tiles = w_cols // BLOCK_N
    out_n = BLOCK_N // 2 if gated else BLOCK_N  # a program's output columns
    dtype = x.dtype
    padded = round_up(rows, ALIGN)
    dense_rows, dense_steps = _dense_shape(dense)
    scaled = row_scale is not None
    ring_steps = max(steps, dense_steps)
    scratch_types = scratch(ring_steps, dtype, variant, dense_rows, row_scale=scaled, halves=gated)
    programs = programs_per_tile(
        pairs, col_tiles, programs_per_sm(scratch_types), col_tiles if dense is not None else 0
    )
    per_program = -(-pairs // programs)
    xp = x.tiles if tiled else _padded_rows(x, padded)
    out_types = [jax.ShapeDtypeStruct((programs * per_program, ALIGN, n_dim), dtype)]
    # Unpadded: a program reads past the last pair as no pair (no pad op ahead of the launch).
    operands = [experts.reshape(-1), xp, w]
    if dense is not None:
        dense_x, dense_w = dense
        operands += [_padded_rows(dense_x, dense_rows), dense_w]
        out_types.append(jax.ShapeDtypeStruct((dense_rows, n_dim), dtype))
    if scaled:
        operands.append(_padded_rows(row_scale.astype(F32), padded, 1))
    rms = None if rms_eps is None else (rms_eps, k_dim)
    n_dense = 0 if dense is None else len(dense)

    def body(*refs):
        experts_ref, x_ref, w_ref, refs = refs[0], refs[1], refs[2], refs[3:]
        dense_in, refs = refs[:n_dense], refs[n_dense:]
        scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
        o_ref, refs = refs[0], refs[1:]
        dense_o_ref, refs = (refs[0], refs[1:]) if dense is not None else (None, refs)
        scratch_refs = refs
        col, first = lax.axis_index("n"), lax.axis_index("p")
        cols = pl.ds(col * BLOCK_N, BLOCK_N)
        out_cols = pl.ds(col * out_n, out_n)

        def product(x_rows, w_tile, o_rows, *, scale=None, k_steps=steps):
            tile_product(
                x_rows, w_tile, o_rows, *scratch_refs, steps=k_steps, variant=variant,
                interpret=interpret, row_scale=scale, rms=rms if scale is not None else None,
                halves=gated,
            )  # fmt: skip

        def pair_product(pair, expert):
            """Pair ``pair``'s column tile: its row's 8-row group (or tile) times
            ``w[expert]``."""
            row = pair // choices
            group = row if tiled else pl.ds((row // ALIGN) * ALIGN, ALIGN)
            product(
                x_ref.at[group], w_ref.at[expert, :, cols], o_ref.at[pair, :, out_cols],
                scale=None if scale_ref is None else scale_ref.at[group],
            )  # fmt: skip

        def pairs_of_this_program():
            _each_place(
                experts_ref, first, programs=programs, per_program=per_program, pairs=pairs,
                num_experts=num_experts, run=pair_product,
            )  # fmt: skip

        if dense is None:
            pairs_of_this_program()
        else:
            # One more program per column tile takes the dense product's tile.
            pl.when(first < programs)(pairs_of_this_program)

            @pl.when(first == programs)
            def _dense():
                d_x, d_w = dense_in
                product(d_x, d_w.at[:, cols], dense_o_ref.at[:, cols], k_steps=dense_steps)

        plgpu.wait_smem_to_gmem(0)

    outs = plgpu.kernel(
        body,
        out_type=tuple(out_types),
        scratch_types=scratch_types,
        grid=(col_tiles, programs + (dense is not None)),
        grid_names=("n", "p"),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
        interpret=interpret_params(interpret),
        kernel_name="expert_hidden" if gated else "expert_matmul",
    )(*operands)
    # Pair p's program stored the 8-row group of its row r = p // C: r is at the line the
    # group's input held it (r % 8, or the input tiles' line of r).
    per_line = choices * (x.per_line if tiled else 1)
    out = PairTiles(outs[0], experts, num_experts, per_line)
    if dense is None:
        return out
    return out, outs[1][: dense[0].shape[0]]


def expert_matmul(
    x: jax.Array | PairTiles,
    w: jax.Array,
    experts: jax.Array,
    *,
    dense: tuple[jax.Array, jax.Array] | None = None,
    tiles: bool = False,
    impl: str = "auto",
):
    """``out[r, c] = x[r] @ w[experts[r, c]]`` (float32 accumulation).

    Args:
      x: ``[R, K]`` rows, or an earlier launch's ``PairTiles`` of R pairs (each pair's tile
        read in place).
      w: ``[E, K, N]`` one matrix per expert, in the layout the kernel reads.
      experts: int32 ``[R, C]`` each row's experts; an id outside ``0 .. E - 1`` gives a zero
        row and reads no expert.
      dense: optional ``(xd [Rd, Kd], wd [Kd, N])``, a plain product with the experts' N
        (a MoE block's shared expert) run in the same launch: one more program per column
        tile instead of a launch of its own.
      tiles: give the products as the launch stored them (``PairTiles``, which
        ``combine_pairs`` reads in place); only where the kernel runs.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      ``[R, C, N]`` in x's dtype (see ``tiles``); with ``dense``, ``(that, xd @ wd)``.
    """
    _check(x, w, experts, dense)
    reason = unsupported_reason(x, w, dense) if impl != "reference" else None
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference" and tiles:
        raise ValueError(f"{_OP}: tiles=True needs the kernel; this call resolved to the reference")
    if choice == "reference":
        rows = x.rows().reshape(x.shape) if isinstance(x, PairTiles) else x
        out = expert_matmul_reference(rows, w, experts)
        if dense is None:
            return out
        xd, wd = dense
        return out, jnp.dot(xd, wd, preferred_element_type=F32).astype(xd.dtype)
    out = _kernel(
        x, w, experts, dense, variant=current_variant(), interpret=choice == "interpret",
    )  # fmt: skip
    if tiles:
        return out
    return out.rows() if dense is None else (out[0].rows(), out[1])


def hidden_unsupported_reason(x: jax.Array, w: jax.Array) -> str | None:
    """Why the Mosaic GPU kernel cannot take this ``expert_hidden`` call, or None."""
    return unsupported_reason(x, w) or halves_unsupported_reason(x.dtype)


def _check_hidden(x, w, experts, row_scale, rms_eps) -> None:
    _check(x, w, experts)
    if w.shape[2] % BLOCK_N:
        raise ValueError(
            f"{_OP}: a paired w's 2I={w.shape[2]} must be whole tiles of {BLOCK_N} columns"
        )
    check_row_scale(_OP, x.shape[0], row_scale, rms_eps)


def expert_hidden(
    x: jax.Array,
    w: jax.Array,
    experts: jax.Array,
    *,
    row_scale: jax.Array | None = None,
    rms_eps: float | None = None,
    tiles: bool = False,
    impl: str = "auto",
):
    """A SwiGLU's hidden rows by expert id: ``silu(g) * u`` with ``g | u = x[r] @
    w[experts[r, c]]`` (float32 sums, each row's times its ``row_scale`` first).

    Args:
      x: ``[R, K]`` rows.
      w: ``[E, K, 2I]``, each expert's gate and up columns laid out by ``pair_halves``
        (each 64-column tile the gate and up columns of 32 hidden units: a program reads
        one tile).
      experts: int32 ``[R, C]``; an id outside ``0 .. E - 1`` gives a zero row.
      row_scale: ``[R]``; with ``rms_eps`` each row's sum of squares over K, the rows then
        scaled by ``1 / sqrt(row_scale / K + rms_eps)`` (an RMS norm's scale).
      tiles: give the rows as the launch stored them (``PairTiles``, which a down launch
        reads in place), or ``[R * C, I]`` where XLA formed them (the reference).
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      ``[R, C, I]`` in x's dtype (see ``tiles``).
    """
    _check_hidden(x, w, experts, row_scale, rms_eps)
    reason = hidden_unsupported_reason(x, w) if impl != "reference" else None
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference":
        out = expert_hidden_reference(x, w, experts, row_scale=row_scale, rms_eps=rms_eps)
        return out.reshape(-1, out.shape[-1]) if tiles else out
    out = _kernel(
        x, w, experts, None, row_scale, variant=current_variant(),
        interpret=choice == "interpret", gated=True,
        rms_eps=None if rms_eps is None else float(rms_eps),
    )  # fmt: skip
    return out if tiles else out.rows()


def mlp_unsupported_reason(
    x: jax.Array, w_up: jax.Array, w_down: jax.Array, dense=None
) -> str | None:
    """Why the Mosaic GPU kernel cannot take this ``expert_mlp`` call, or None."""
    hidden = jax.ShapeDtypeStruct((x.shape[0], w_down.shape[1]), x.dtype)
    return hidden_unsupported_reason(x, w_up) or unsupported_reason(hidden, w_down, dense)


@functools.partial(jax.jit, static_argnames=("variant", "interpret", "rms_eps"))
def _mlp_kernel(x, w_up, w_down, experts, dense=None, row_scale=None, counters=None, *,
                variant: ProductVariant, interpret: bool, rms_eps=None):  # fmt: skip
    """The launch of ``expert_mlp``: the ``dense`` product's programs, ``expert_hidden``'s,
    then the down launch's pair programs (``expert_matmul`` over the hidden tiles), one
    grid. Each hidden program adds 1 to its pair's counter once its tile is stored; a down
    program requests its weight blocks, then waits until all of its pair's hidden tiles are
    signalled before requesting their rows. The down programs come after every hidden
    program in launch order, so a waiting program never holds an SM that a hidden program
    still needs; the dense programs, which wait for nothing, come first, so none starts
    last. Returns (the hidden ``PairTiles``, the down ``PairTiles``, the dense rows)."""
    rows, k_dim = x.shape
    num_experts, _, up_cols = w_up.shape
    hidden_n, down_n = up_cols // 2, w_down.shape[2]
    choices = experts.shape[1]
    pairs = rows * choices
    up_steps, down_steps = k_dim // BLOCK_K, hidden_n // BLOCK_K
    up_tiles, down_tiles = up_cols // BLOCK_N, down_n // BLOCK_N
    dtype = x.dtype
    padded = round_up(rows, ALIGN)
    dense_rows, dense_steps = _dense_shape(dense)
    scaled = row_scale is not None
    ring_steps = max(up_steps, down_steps, dense_steps)
    scratch_types = scratch(ring_steps, dtype, variant, dense_rows, row_scale=scaled, halves=True)
    # Each phase spreads its pairs over the programs its own launch would: at batch 1 every
    # real pair's column tile has a program of its own in both phases.
    up_programs = programs_per_tile(pairs, up_tiles, programs_per_sm(scratch_types))
    down_alone = scratch(max(down_steps, dense_steps), dtype, variant, dense_rows)
    down_programs = programs_per_tile(
        pairs, down_tiles, programs_per_sm(down_alone), down_tiles if dense is not None else 0
    )
    up_per_program, down_per_program = -(-pairs // up_programs), -(-pairs // down_programs)
    dense_grid = down_tiles if dense is not None else 0
    up_grid, down_grid = up_tiles * up_programs, down_tiles * down_programs
    out_types = [
        jax.ShapeDtypeStruct((up_programs * up_per_program, ALIGN, hidden_n), dtype),
        jax.ShapeDtypeStruct((down_programs * down_per_program, ALIGN, down_n), dtype),
    ]
    operands = [experts.reshape(-1), _padded_rows(x, padded), w_up, w_down]
    if dense is not None:
        dense_x, dense_w = dense
        operands += [_padded_rows(dense_x, dense_rows), dense_w]
        out_types.append(jax.ShapeDtypeStruct((dense_rows, down_n), dtype))
    if scaled:
        operands.append(_padded_rows(row_scale.astype(F32), padded, 1))
    if not interpret:
        # The interpreter runs the programs one after another in launch order (and cannot
        # run inline Mosaic GPU): every hidden tile is stored before a down program reads it.
        if counters is None:
            counters = _counters.own_zeros(experts.reshape(-1))
        operands.append(counters)
    rms = None if rms_eps is None else (rms_eps, k_dim)
    n_dense = 0 if dense is None else len(dense)

    def body(*refs):
        experts_ref, x_ref, up_ref, down_ref, refs = refs[0], refs[1], refs[2], refs[3], refs[4:]
        dense_in, refs = refs[:n_dense], refs[n_dense:]
        scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
        ready, refs = (None, refs) if interpret else (refs[0], refs[1:])
        hidden_ref, out_ref, refs = refs[0], refs[1], refs[2:]
        dense_o_ref, refs = (refs[0], refs[1:]) if dense is not None else (None, refs)
        scratch_refs = refs
        program = lax.axis_index("i")

        def product(x_rows, w_tile, o_rows, *, steps, scale=None, halves=False, await_rows=None):
            tile_product(
                x_rows, w_tile, o_rows, *scratch_refs, steps=steps, variant=variant,
                interpret=interpret, row_scale=scale, rms=rms if scale is not None else None,
                halves=halves, await_rows=await_rows,
            )  # fmt: skip

        if dense is not None:  # first in launch order: they wait for nothing

            @pl.when(program < dense_grid)
            def _dense():
                d_x, d_w = dense_in
                cols = pl.ds(program * BLOCK_N, BLOCK_N)
                product(d_x, d_w.at[:, cols], dense_o_ref.at[:, cols], steps=dense_steps)

        @pl.when((program >= dense_grid) & (program < dense_grid + up_grid))
        def _hidden():
            first, col = (program - dense_grid) // up_tiles, lax.rem(program - dense_grid, up_tiles)

            def pair_hidden(pair, expert):
                group = pl.ds((pair // choices // ALIGN) * ALIGN, ALIGN)
                product(
                    x_ref.at[group], up_ref.at[expert, :, pl.ds(col * BLOCK_N, BLOCK_N)],
                    hidden_ref.at[pair, :, pl.ds(col * PAIRED_UNITS, PAIRED_UNITS)],
                    steps=up_steps, scale=None if scale_ref is None else scale_ref.at[group],
                    halves=True,
                )  # fmt: skip
                if ready is not None:  # the tile has landed in GMEM before its signal
                    plgpu.wait_smem_to_gmem(0, wait_read_only=False)
                    _counters.signal(ready.at[pl.ds(pair, 1)])

            _each_place(
                experts_ref, first, programs=up_programs, per_program=up_per_program,
                pairs=pairs, num_experts=num_experts, run=pair_hidden,
            )  # fmt: skip

        @pl.when(program >= dense_grid + up_grid)
        def _down():
            place = program - dense_grid - up_grid
            first, col = place // down_tiles, lax.rem(place, down_tiles)
            cols = pl.ds(col * BLOCK_N, BLOCK_N)

            def pair_down(pair, expert):
                def await_rows():
                    if ready is not None:
                        _counters.wait_then_count(
                            ready.at[pl.ds(pair, 1)], up_tiles, up_tiles + down_tiles
                        )

                product(
                    hidden_ref.at[pair], down_ref.at[expert, :, cols], out_ref.at[pair, :, cols],
                    steps=down_steps, await_rows=await_rows,
                )  # fmt: skip

            _each_place(
                experts_ref, first, programs=down_programs, per_program=down_per_program,
                pairs=pairs, num_experts=num_experts, run=pair_down,
            )  # fmt: skip

        plgpu.wait_smem_to_gmem(0)

    outs = plgpu.kernel(
        body,
        out_type=tuple(out_types),
        scratch_types=scratch_types,
        grid=(dense_grid + up_grid + down_grid,),
        grid_names=("i",),
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
        interpret=interpret_params(interpret),
        kernel_name="expert_mlp",
    )(*operands)
    hidden = PairTiles(outs[0], experts, num_experts, 1)
    out = PairTiles(outs[1], experts.reshape(-1, 1), num_experts, choices)
    return hidden, out, (outs[2][: dense[0].shape[0]] if dense is not None else None)


def expert_mlp(
    x: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    experts: jax.Array,
    *,
    dense: tuple[jax.Array, jax.Array] | None = None,
    row_scale: jax.Array | None = None,
    rms_eps: float | None = None,
    tiles: bool = False,
    counters: jax.Ref | None = None,
    impl: str = "auto",
):
    """A SwiGLU MLP by expert id in one launch: ``expert_hidden`` then the down
    ``expert_matmul`` over its tiles, each pair's down programs reading its hidden tiles as
    soon as the launch's hidden programs have stored them, their weights already streaming
    in. The pairs' products are those of the two launches, bit for bit.

    Args:
      x: ``[R, K]`` rows.
      w_up: ``[E, K, 2I]`` laid out by ``pair_halves``.
      w_down: ``[E, I, N]``.
      experts: int32 ``[R, C]``; an id outside ``0 .. E - 1`` gives a zero row.
      dense: optional ``(xd [Rd, Kd], wd [Kd, N])``, a plain product with the down
        projection's N run in the same launch (a MoE block's shared expert down).
      row_scale, rms_eps: as ``expert_hidden``'s, for the hidden rows.
      tiles: give the down products as the launch stored them (``PairTiles`` of the
        ``R * C`` pairs, which ``combine_pairs`` reads in place); only where the kernel runs.
      counters: optional int32 ``Ref`` ``[n >= R * C]`` of zeros, the per-pair counters
        through which the down programs wait for the hidden tiles; the launch leaves them
        at zero, so one buffer serves every launch of a step (a layer scan carries it) and
        no launch zero-fills its own. Without it the launch makes its own. The interpreter
        and the reference ignore it.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      The pairs' down products ``[R * C, 1, N]`` in x's dtype (see ``tiles``); with
      ``dense``, ``(that, xd @ wd)``.
    """
    _check_hidden(x, w_up, experts, row_scale, rms_eps)
    _counters.check_counters(_OP, counters, experts.size)
    hidden_shape = (x.shape[0] * experts.shape[1], w_up.shape[2] // 2)
    _check(jax.ShapeDtypeStruct(hidden_shape, x.dtype), w_down, experts.reshape(-1, 1), dense)
    reason = mlp_unsupported_reason(x, w_up, w_down, dense) if impl != "reference" else None
    choice = resolve_impl(_OP, impl, reason)
    if choice == "reference":
        if tiles:
            raise ValueError(
                f"{_OP}: tiles=True needs the kernel; this call resolved to the reference"
            )
        hidden = expert_hidden_reference(x, w_up, experts, row_scale=row_scale, rms_eps=rms_eps)
        return expert_matmul(
            hidden.reshape(hidden_shape), w_down, experts.reshape(-1, 1), dense=dense,
            impl="reference",
        )  # fmt: skip
    _, out, dense_out = _mlp_kernel(
        x, w_up, w_down, experts, dense, row_scale, counters, variant=current_variant(),
        interpret=choice == "interpret", rms_eps=None if rms_eps is None else float(rms_eps),
    )  # fmt: skip
    out = out if tiles else out.rows()
    return out if dense is None else (out, dense_out)
