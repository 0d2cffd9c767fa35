"""Causal depthwise conv1d over packed variable-length sequences (prefill, extend) in Mosaic GPU.

Two kernels, both with thread ``i`` of the warpgroup owning channel ``c0 + i`` and every array
in the one-value-per-thread ``WG_STRIDED`` layout (so the convolution is element-wise):

1. ``_outputs``: one program per (block of ``BLOCK_T`` packed tokens, 128 channels). It loads
   the ``BLOCK_T + W - 1`` input rows that the block's taps touch once, then for each token:
   a token at least ``W - 1`` past its sequence's start convolves those rows; one nearer the
   start takes the missing taps from its sequence's saved window (zeros without an initial
   state); a token past ``qsl[N]`` writes zeros. The pool is only read.
2. ``_windows``: one program per (sequence, 128 channels) writes the sequence's new window,
   the last ``W - 1`` inputs of (saved window, sequence), to its slot. It runs after (1) on
   the same pool ref: when the first tokens of a sequence (which read its old window) and
   its last token sit in different blocks, a write from (1) would race with those reads.

The token -> sequence map ``[T]`` is a ``searchsorted`` in the wrapper (T int32s); the kernels
read it with scalar loads. See ``update_mgpu.py`` for why there is no TMA (3-element window
rows are under TMA's 16-byte minimum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import interpret_params

__all__ = ["BLOCK_T", "causal_conv1d", "unsupported_reason"]

BLOCK_C = 128  # one channel per thread of the warpgroup
BLOCK_T = 16  # tokens per program of the output kernel
MAX_WIDTH = 8
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANE = plgpu.Layout.WG_STRIDED((BLOCK_C,), 1)


def unsupported_reason(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    activation: str | None = "silu",
) -> str | None:
    """Why the kernels of this module cannot take this call, in one sentence; None if they can."""
    if x.ndim != 2:
        return f"x {x.shape} must be [T, C]"
    t_total, channels = x.shape
    if weight.ndim != 2 or weight.shape[0] != channels:
        return f"weight {weight.shape} must be [C, W] with C={channels}"
    width = weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        return f"W={width} taps is outside 2..{MAX_WIDTH}"
    if channels % BLOCK_C:
        return f"C={channels} is not a multiple of {BLOCK_C} (one channel per thread)"
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
    n_seq = state_indices.shape[0] if state_indices.ndim == 1 else -1
    if state_indices.dtype != jnp.int32 or n_seq < 1:
        return f"state_indices {state_indices.dtype}{list(state_indices.shape)} must be int32 [N]"
    if qsl.shape != (n_seq + 1,) or qsl.dtype != jnp.int32:
        return f"qsl {qsl.dtype}{list(qsl.shape)} must be int32 [N+1] = [{n_seq + 1}]"
    if has_initial_state.shape != (n_seq,) or has_initial_state.dtype != jnp.bool_:
        got = f"{has_initial_state.dtype}{list(has_initial_state.shape)}"
        return f"has_initial_state {got} must be bool [{n_seq}]"
    if activation not in ("silu", None):
        return f"activation={activation!r} is not 'silu' or None"
    if t_total == 0:
        return "T=0 tokens: nothing to launch"
    return None


def _load(ref) -> jax.Array:
    return plgpu.load(ref, layout=_LANE).astype(jnp.float32)


def _zeros() -> jax.Array:
    return plgpu.layout_cast(jnp.zeros((BLOCK_C,), jnp.float32), _LANE)


def _select(pred: jax.Array, on_true: jax.Array, on_false: jax.Array) -> jax.Array:
    """``where`` with a scalar ``pred``: Mosaic GPU does not broadcast it implicitly, and a
    blend by multiplication would turn a NaN on the unused side into NaN."""
    mask = plgpu.layout_cast(jnp.full((BLOCK_C,), pred), _LANE)
    return jnp.where(mask, on_true, on_false)


def _outputs(x, weight, bias, pool_ref, qsl, idx, init, token_seq, activation, interpret):
    """y ``[T, C]``; reads the pool (a ref shared with ``_windows``, which runs after)."""
    t_total, channels = x.shape
    width = weight.shape[1]
    n_seq = idx.shape[0]
    has_bias = bias is not None

    def body(*refs):
        x_ref, w_ref = refs[:2]
        b_ref = refs[2] if has_bias else None
        qsl_ref, idx_ref, init_ref, seq_ref, pool_ref, y_ref = refs[2 + has_bias :]
        t0 = lax.axis_index("t") * BLOCK_T
        chans = pl.ds(lax.axis_index("c") * BLOCK_C, BLOCK_C)
        n_real = qsl_ref[n_seq]
        # rows[r] = x[t0 - (W-1) + r]; rows outside [0, T) are clamped (every tap that would
        # read them is either before its sequence's start, so replaced, or never stored).
        rows = [
            _load(x_ref.at[jnp.clip(t0 - (width - 1) + r, 0, t_total - 1), chans])
            for r in range(BLOCK_T + width - 1)
        ]
        taps = [_load(w_ref.at[chans, w]) for w in range(width)]
        bias_v = _load(b_ref.at[chans]) if has_bias else None

        def conv(values):
            acc = bias_v
            for w in range(width):
                acc = taps[w] * values[w] if acc is None else acc + taps[w] * values[w]
            if activation == "silu":
                acc = acc / (1.0 + jnp.exp(-acc))
            return acc.astype(y_ref.dtype)

        for i in range(BLOCK_T):
            t = t0 + i
            seq = seq_ref[jnp.minimum(t, t_total - 1)]
            start = qsl_ref[seq]
            real = t < n_real
            near_start = t - start < width - 1

            @pl.when(real & jnp.logical_not(near_start))
            def _inside(i=i, t=t):
                y_ref[t, chans] = conv(rows[i : i + width])

            @pl.when(real & near_start)
            def _from_window(i=i, t=t, seq=seq, start=start):
                slot = idx_ref[seq]
                has_init = init_ref[seq] != 0
                values = []
                for w in range(width):
                    p = t - (width - 1) + w
                    j = jnp.clip(p - start + width - 1, 0, width - 2)
                    saved = _select(has_init, _load(pool_ref.at[slot, chans, j]), _zeros())
                    values.append(_select(p >= start, rows[i + w], saved))
                y_ref[t, chans] = conv(values)

            @pl.when((t < t_total) & jnp.logical_not(real))
            def _padding(t=t):
                y_ref[t, chans] = _zeros().astype(y_ref.dtype)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(t_total, BLOCK_T), channels // BLOCK_C),
        grid_names=("t", "c"),
        interpret=interpret_params(interpret),
        kernel_name="conv1d_prefill",
    )
    operands = (x, weight) + ((bias,) if has_bias else ()) + (qsl, idx, init, token_seq, pool_ref)
    return kernel(*operands)


def _windows(x, pool_ref, qsl, idx, init, width, interpret) -> None:
    """Writes each non-empty sequence's new window to ``pool_ref`` in place."""
    t_total, channels = x.shape
    n_seq = idx.shape[0]

    def body(x_ref, qsl_ref, idx_ref, init_ref, pool_ref):
        n = lax.axis_index("n")
        chans = pl.ds(lax.axis_index("c") * BLOCK_C, BLOCK_C)
        start = qsl_ref[n]
        length = qsl_ref[n + 1] - start
        slot = idx_ref[n]

        @pl.when(length > 0)
        def _write():
            has_init = init_ref[n] != 0
            new = []
            for j in range(width - 1):
                p = length - (width - 1) + j  # relative to the start; < 0: the old window
                from_x = _load(x_ref.at[jnp.clip(start + p, 0, t_total - 1), chans])
                old = _load(pool_ref.at[slot, chans, jnp.clip(p + width - 1, 0, width - 2)])
                new.append(_select(p >= 0, from_x, _select(has_init, old, _zeros())))
            # Every value is read before the first store: this thread's channel is the only
            # one it touches, so the old window it reads is still intact.
            for j in range(width - 1):
                pool_ref[slot, chans, j] = new[j].astype(pool_ref.dtype)

    kernel = plgpu.kernel(
        body,
        out_type=(),
        grid=(n_seq, channels // BLOCK_C),
        grid_names=("n", "c"),
        interpret=interpret_params(interpret),
        kernel_name="conv1d_prefill_state",
    )
    kernel(x, qsl, idx, init, pool_ref)


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    activation: str | None = "silu",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv over N packed sequences, continuing from their saved windows.

    x ``[T, C]``; weight ``[C, W]``; bias ``[C]`` or None; conv_pool ``[S, C, W-1]`` in x's
    dtype; qsl int32 ``[N+1]``; state_indices int32 ``[N]``; has_initial_state bool ``[N]``.
    Returns (y ``[T, C]`` in x's dtype, zeros at ``t >= qsl[N]``; conv_pool with each
    non-empty sequence's last ``W-1`` inputs at its slot). Under ``jit`` with the pool donated
    the update is in place; empty sequences leave their slot as it was.
    """
    reason = unsupported_reason(
        x, weight, bias, conv_pool, qsl, state_indices, has_initial_state, activation=activation
    )
    if reason is not None:
        raise ValueError(reason)
    t_total = x.shape[0]
    n_seq = state_indices.shape[0]
    token = jnp.arange(t_total, dtype=jnp.int32)
    token_seq = jnp.clip(jnp.searchsorted(qsl, token, side="right") - 1, 0, n_seq - 1)
    # Scalar loads of bool from GMEM are not a thing in Mosaic GPU: int32 instead.
    init = has_initial_state.astype(jnp.int32)
    pool_ref = jax.new_ref(conv_pool)
    y = _outputs(
        x, weight, bias, pool_ref, qsl, state_indices, init, token_seq.astype(jnp.int32),
        activation, interpret,
    )  # fmt: skip
    _windows(x, pool_ref, qsl, state_indices, init, weight.shape[1], interpret)
    return y, jax.freeze(pool_ref)
