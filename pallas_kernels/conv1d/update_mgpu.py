"""Causal depthwise conv1d on rows of D tokens (decode and verify) as Mosaic GPU kernels (sm_90).

One program per (``rows_per_program`` rows from ``n``, block of 128 channels): thread ``i`` of
the warpgroup owns channel ``c0 + i``. It loads each row's saved window ``pool[idx[n], c,
:]`` and its D inputs, and the W taps and the bias once, straight from GMEM into registers
(every array in the same one-value-per-thread ``WG_STRIDED`` layout, so the whole convolution
is element-wise), all before the first sum waits on them; then per row it computes the D
outputs and stores them, and stores the shifted window back into the pool (update) or every
window to ``windows`` (verify).

Why no TMA here: the window axis is innermost and only ``W-1`` (3) elements long, so a
channel block of the pool is a ``[128, 3]`` box whose rows are 6 bytes, under TMA's 16-byte
minimum. Strided register loads (stride ``W-1``) hit the same few cache sectors for all taps,
and the whole op moves only ``~4 (W-1) C`` bytes per row.

Tree drafts (verify with ``parents``): token ``t``'s window is the one its parent left,
``windows[n, parents[n, t]]``, which the same thread stored a moment before (a thread owns
its channel in every array, so it reads back only its own writes); the root's is the pool's.

Padded rows (``state_indices[n] == 0``) read the pad slot and write no pool memory; their
outputs (and windows) are zeros, as the reference does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import interpret_params

__all__ = [
    "LANE",
    "ROWS_PER_PROGRAM",
    "causal_conv1d_update",
    "causal_conv1d_verify",
    "finish_outputs",
    "load_lane",
    "outputs_of_window",
    "unsupported_reason",
    "window_sums",
]

BLOCK_C = 128  # one channel per thread of the warpgroup
MAX_TOKENS = 16
MAX_WIDTH = 8
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Rows a program takes: each of its rows' loads in flight at once, the taps read once. More
# than one moved a launch by under 7% either way (benchmarks/RESULTS.md).
ROWS_PER_PROGRAM = 1
LANE = plgpu.Layout.WG_STRIDED((BLOCK_C,), 1)
"""One channel per thread of the warpgroup: the layout every array of the convolution takes."""


def load_lane(ref) -> jax.Array:
    """``ref`` ``[BLOCK_C]`` (GMEM or SMEM, any stride) in float32, one channel a thread."""
    return plgpu.load(ref, layout=LANE).astype(jnp.float32)


def window_sums(window, taps, bias, n_tokens: int) -> list[jax.Array | None]:
    """Per token, ``bias`` plus its taps on the saved window's entries (None where neither):
    the part of each output that needs none of the tokens' inputs, summed in the conv's
    order (``outputs_of_window``). ``window``: the ``W-1`` entries, oldest first; ``taps``
    the ``W`` weights; all float32 ``[BLOCK_C]`` in ``LANE``."""
    sums = []
    for t in range(n_tokens):
        acc = bias
        for w in range(len(taps) - 1 - t):  # entries window[t + w], t + w < W-1
            term = taps[w] * window[t + w]
            acc = term if acc is None else acc + term
        sums.append(acc)
    return sums


def finish_outputs(sums, inputs, taps, activation: str | None) -> list[jax.Array]:
    """The tokens' outputs from their ``window_sums`` and their ``inputs`` (oldest first)."""
    width, outs = len(taps), []
    for t, acc in enumerate(sums):
        for w in range(max(0, width - 1 - t), width):
            term = taps[w] * inputs[t + w - (width - 1)]
            acc = term if acc is None else acc + term
        if activation == "silu":
            acc = acc / (1.0 + jnp.exp(-acc))
        outs.append(acc)
    return outs


def outputs_of_window(ext, taps, bias, activation: str | None) -> list[jax.Array]:
    """The outputs of the tokens after a saved window, one channel a thread: ``ext`` the
    ``W-1`` window entries then the tokens' inputs (oldest first), ``taps`` the ``W`` weights,
    ``bias`` one value or None, all float32 ``[BLOCK_C]`` in ``LANE``."""
    width = len(taps)
    sums = window_sums(ext[: width - 1], taps, bias, len(ext) - width + 1)
    return finish_outputs(sums, ext[width - 1 :], taps, activation)


def unsupported_reason(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    activation: str | None = "silu",
) -> str | None:
    """Why the kernels of this module cannot take this call, in one sentence; None if they can.

    Covers update and verify alike (same arguments; ``parents`` only for verify).
    """
    if x.ndim != 3:
        return f"x {x.shape} must be [N, D, C]"
    n_rows, n_tokens, channels = x.shape
    if weight.ndim != 2 or weight.shape[0] != channels:
        return f"weight {weight.shape} must be [C, W] with C={channels}"
    width = weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        return f"W={width} taps is outside 2..{MAX_WIDTH}"
    if channels % BLOCK_C:
        return f"C={channels} is not a multiple of {BLOCK_C} (one channel per thread)"
    if not 1 <= n_tokens <= MAX_TOKENS:
        return f"D={n_tokens} tokens per row is outside 1..{MAX_TOKENS}"
    if x.dtype not in _DTYPES:
        return f"x is {x.dtype}; the kernel takes bfloat16 or float32"
    if not jnp.issubdtype(weight.dtype, jnp.floating) or (
        bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating)
    ):
        return "weight and bias must be floating point"
    if bias is not None and bias.shape != (channels,):
        return f"bias {bias.shape} must be [C] = [{channels}]"
    if conv_pool.shape[1:] != (channels, width - 1) or conv_pool.dtype != x.dtype:
        got = f"{conv_pool.dtype}{list(conv_pool.shape)}"
        return f"conv_pool {got} must be {x.dtype} [S, {channels}, {width - 1}]"
    if state_indices.shape != (n_rows,) or state_indices.dtype != jnp.int32:
        got = f"{state_indices.dtype}{list(state_indices.shape)}"
        return f"state_indices {got} must be int32 [{n_rows}]"
    if activation not in ("silu", None):
        return f"activation={activation!r} is not 'silu' or None"
    if parents is not None and (parents.shape != (n_rows, n_tokens) or parents.dtype != jnp.int32):
        got = f"{parents.dtype}{list(parents.shape)}"
        return f"parents {got} must be int32 [{n_rows}, {n_tokens}]"
    if n_rows == 0:
        return "N=0 rows: nothing to launch"
    return None


def _check(reason: str | None) -> None:
    if reason is not None:
        raise ValueError(reason)


def _rows(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array | jax.Ref,
    state_indices: jax.Array,
    *,
    activation: str | None,
    write_pool: bool,
    interpret: bool,
    rows_per_program: int,
    parents: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The kernel call: ``y`` (update; the pool is a mutable ref written in place) or
    ``(y, windows)`` (verify; the pool is only read; ``parents`` int32 ``[N, D]`` for tree
    drafts, one row a program)."""
    n_rows, n_tokens, channels = x.shape
    rows_per_program = 1 if parents is not None else rows_per_program
    width = weight.shape[1]
    has_bias = bias is not None
    tree = parents is not None

    load = load_lane

    def body(*refs):
        parents_ref = None
        if tree:  # parents come right after idx; the rest keeps the chain's positions
            parents_ref, refs = refs[1], refs[:1] + refs[2:]
        idx_ref, x_ref, w_ref = refs[:3]
        refs = refs[3:]
        b_ref = refs[0] if has_bias else None
        refs = refs[1:] if has_bias else refs
        pool_ref, y_ref = refs[:2]
        win_ref = None if write_pool else refs[2]

        first = lax.axis_index("n") * rows_per_program
        chans = pl.ds(lax.axis_index("c") * BLOCK_C, BLOCK_C)

        def store_windows(n, ext):
            """Row n's windows after its tokens into ``windows`` (verify); ext: the W-1+D
            inputs of the row, oldest first (the window, then x)."""
            for t in range(n_tokens):
                for w in range(width - 1):
                    win_ref[n, t, chans, w] = ext[t + 1 + w].astype(win_ref.dtype)

        def chain_rows():
            """The program's rows, every load issued before any row's sums wait on it (a
            padded row reads the pad slot and stores zeros; a row past the call is skipped)."""
            rows = [jnp.minimum(first + r, n_rows - 1) for r in range(rows_per_program)]
            slots = [idx_ref[row] for row in rows]
            exts = [
                [load(pool_ref.at[slot, chans, w]) for w in range(width - 1)]
                + [load(x_ref.at[row, t, chans]) for t in range(n_tokens)]
                for row, slot in zip(rows, slots, strict=True)
            ]
            taps = [load(w_ref.at[chans, w]) for w in range(width)]
            bias_t = load(b_ref.at[chans]) if has_bias else None
            for r, (row, slot, ext) in enumerate(zip(rows, slots, exts, strict=True)):
                ys = outputs_of_window(ext, taps, bias_t, activation)
                in_call = first + r < n_rows

                @pl.when(in_call & (slot != 0))
                def _real_row(row=row, slot=slot, ext=ext, ys=ys):
                    for t, y_t in enumerate(ys):
                        y_ref[row, t, chans] = y_t.astype(y_ref.dtype)
                    if not write_pool:
                        store_windows(row, ext)
                        return
                    for w in range(width - 1):
                        pool_ref[slot, chans, w] = ext[n_tokens + w].astype(pool_ref.dtype)

                # Padded rows all name slot 0: no pool write, zeros out (no race on slot 0).
                pl.when(in_call & (slot == 0))(functools.partial(padded_row, row))

        def padded_row(n):
            zeros = plgpu.layout_cast(jnp.zeros((BLOCK_C,), jnp.float32), LANE)
            for t in range(n_tokens):
                y_ref[n, t, chans] = zeros.astype(y_ref.dtype)
            if not write_pool:
                store_windows(n, [zeros] * (width - 1 + n_tokens))

        def tree_row(n, slot):
            taps = [load(w_ref.at[chans, w]) for w in range(width)]
            bias_t = load(b_ref.at[chans]) if has_bias else None
            window = [load(pool_ref.at[slot, chans, w]) for w in range(width - 1)]
            for t in range(n_tokens):
                if t > 0:  # the root (t = 0) continues the pool's window
                    parent = parents_ref[n * n_tokens + t]
                    window = [load(win_ref.at[n, parent, chans, w]) for w in range(width - 1)]
                x_t = load(x_ref.at[n, t, chans])
                (y_t,) = outputs_of_window([*window, x_t], taps, bias_t, activation)
                y_ref[n, t, chans] = y_t.astype(y_ref.dtype)
                window = [*window[1:], x_t]
                for w in range(width - 1):
                    win_ref[n, t, chans, w] = window[w].astype(win_ref.dtype)

        if not tree:
            chain_rows()
            return
        slot = idx_ref[first]  # one row a program
        pl.when(slot != 0)(functools.partial(tree_row, first, slot))
        pl.when(slot == 0)(functools.partial(padded_row, first))

    y_type = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out_type = y_type
    if not write_pool:
        windows_shape = (n_rows, n_tokens, channels, width - 1)
        out_type = (y_type, jax.ShapeDtypeStruct(windows_shape, conv_pool.dtype))
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(-(-n_rows // rows_per_program), channels // BLOCK_C),
        grid_names=("n", "c"),
        interpret=interpret_params(interpret),
        kernel_name="conv1d_update",
    )
    # parents flat [N*D]: a scalar load from a 1-D GMEM ref, as for state_indices.
    tree_args = (parents.reshape(-1),) if tree else ()
    operands = (state_indices, *tree_args, x, weight) + ((bias,) if has_bias else ())
    return kernel(*operands, conv_pool)


def causal_conv1d_update(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    activation: str | None = "silu",
    interpret: bool = False,
    rows_per_program: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """D tokens per row after the row's saved window; the window moves on by D tokens.

    x ``[N, D, C]``; weight ``[C, W]``; bias ``[C]`` or None; conv_pool ``[S, C, W-1]`` in x's
    dtype; state_indices int32 ``[N]`` (0 = padded row). Returns (y ``[N, D, C]`` in x's
    dtype, zeros on padded rows; conv_pool). Under ``jit`` with the pool donated the update is
    in place; slot 0 is never written. ``rows_per_program``: rows a program takes (None:
    ``ROWS_PER_PROGRAM``).
    """
    _check(unsupported_reason(x, weight, bias, conv_pool, state_indices, activation=activation))
    rows_per_program = _rows_per_program(rows_per_program)
    pool_ref = jax.new_ref(conv_pool)
    y = _rows(
        x, weight, bias, pool_ref, state_indices, activation=activation, write_pool=True,
        interpret=interpret, rows_per_program=rows_per_program,
    )  # fmt: skip
    return y, jax.freeze(pool_ref)


def causal_conv1d_verify(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    activation: str | None = "silu",
    interpret: bool = False,
    rows_per_program: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """D draft tokens per row, pool read-only.

    Arguments as ``causal_conv1d_update``, plus ``parents``: None (a chain) or int32
    ``[N, D]`` tree drafts (one row a program), token t continuing the window after token
    ``parents[n, t]``.
    Returns (y ``[N, D, C]``; windows ``[N, D, C, W-1]`` in the pool's dtype,
    ``windows[n, t]`` = the window after token ``t``); both zeros on padded rows.
    """
    reason = unsupported_reason(
        x, weight, bias, conv_pool, state_indices, parents=parents, activation=activation
    )
    _check(reason)
    return _rows(
        x, weight, bias, conv_pool, state_indices,
        activation=activation, write_pool=False, interpret=interpret, parents=parents,
        rows_per_program=_rows_per_program(rows_per_program),
    )  # fmt: skip


def _rows_per_program(rows_per_program: int | None) -> int:
    if rows_per_program is None:
        return ROWS_PER_PROGRAM
    if rows_per_program < 1:
        raise ValueError(f"rows_per_program={rows_per_program} must be at least 1")
    return int(rows_per_program)
