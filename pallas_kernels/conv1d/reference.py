"""Plain-jnp causal depthwise conv1d: the token-by-token oracle and the vectorized fallback.

Semantics, per channel c, for a sequence whose saved window is ``win [C, W-1]`` (oldest input
first; zeros without an initial state)::

    ext = concat(win, x_seq)            along time, length W-1+L
    y_t = act(bias + sum_w weight[c, w] * ext[t + w])     (weight[:, W-1] meets the new token)
    new window = the last W-1 entries of ext

Entries (same arguments and results as the public ops, which validate them; nothing is
checked here):

* ``causal_conv1d_recurrent``: THE oracle. A ``lax.scan`` over the packed tokens that carries
  the window and the pool, loads the window at a sequence's first token and writes it back at
  its last one.
* ``causal_conv1d_gathered``: the ``impl="reference"`` path of ``causal_conv1d``. For each of
  the W taps one gather fetches, for every token at once, its input ``t - (W-1) + w``: from x
  when it lies inside the token's own sequence, else from the sequence's saved window. The
  new windows are gathered the same way from the end of each sequence. No loop over tokens.
* ``causal_conv1d_update`` / ``causal_conv1d_verify``: ``[N, D]`` rows (decode, verify),
  the commit that ends speculation is ``pallas_kernels.commit.commit_steps``. A row whose
  slot is the pad slot 0 is a padded row: its outputs (and windows) are zeros and it writes
  nothing, so the padded rows of a bucket cannot race on slot 0.

Computation is in float32 (float64 when an input is float64); outputs take x's dtype,
windows the pool's (the activations' dtype: windows hold raw inputs, so nothing is rounded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._tree import start_of_node
from pallas_kernels._varlen import token_segments
from pallas_kernels.commit import write_where

__all__ = [
    "causal_conv1d_gathered",
    "causal_conv1d_recurrent",
    "causal_conv1d_update",
    "causal_conv1d_verify",
]


def _as_arrays(*xs: jax.Array | None) -> tuple[jax.Array | None, ...]:
    """NumPy inputs become jax arrays (None stays None): the references are called directly
    by tests."""
    return tuple(None if x is None else jnp.asarray(x) for x in xs)


def _compute_dtype(*arrays: jax.Array | None) -> jnp.dtype:
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays if a is not None))


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    return y * jax.nn.sigmoid(y) if activation == "silu" else y


def _conv(taps: jax.Array, weight: jax.Array, bias: jax.Array | None, activation: str | None):
    """taps ``[..., C, W]`` (oldest first) -> ``[..., C]``."""
    y = jnp.sum(taps * weight.astype(taps.dtype), axis=-1)
    if bias is not None:
        y = y + bias.astype(taps.dtype)
    return _activate(y, activation)


def _initial_window(
    pool: jax.Array, slots: jax.Array, has_initial_state: jax.Array, dtype: jnp.dtype
) -> jax.Array:
    # where, not a multiply: the pad slot may hold NaN, and 0 * NaN is NaN.
    return jnp.where(has_initial_state[..., None, None], pool[slots].astype(dtype), 0)


def causal_conv1d_recurrent(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """Token-by-token oracle of ``causal_conv1d`` (same arguments and results)."""
    x, weight, bias, conv_pool, qsl, state_indices, has_initial_state = _as_arrays(
        x, weight, bias, conv_pool, qsl, state_indices, has_initial_state
    )
    t_total = x.shape[0]
    if t_total == 0 or state_indices.shape[0] == 0:
        return jnp.zeros_like(x), conv_pool
    dtype = _compute_dtype(x, weight, bias)
    seq, first, last, valid = token_segments(qsl, t_total)

    def token(carry, xs):
        window, pool = carry
        x_t, n, first_t, last_t = xs
        slot = state_indices[n]
        init = _initial_window(pool, slot, has_initial_state[n], dtype)
        window = jnp.where(first_t, init, window)
        taps = jnp.concatenate([window, x_t[:, None]], axis=-1)
        window = taps[:, 1:]
        return (window, write_where(pool, slot, window, last_t)), _conv(
            taps, weight, bias, activation
        )

    window0 = jnp.zeros(conv_pool.shape[1:], dtype)
    (_, pool), y = lax.scan(token, (window0, conv_pool), (x.astype(dtype), seq, first, last))
    return jnp.where(valid[:, None], y, 0).astype(x.dtype), pool


def causal_conv1d_gathered(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """Vectorized ``causal_conv1d`` (one gather per tap); same arguments and results."""
    x, weight, bias, conv_pool, qsl, state_indices, has_initial_state = _as_arrays(
        x, weight, bias, conv_pool, qsl, state_indices, has_initial_state
    )
    t_total = x.shape[0]
    n_seq = state_indices.shape[0]
    if t_total == 0 or n_seq == 0:
        return jnp.zeros_like(x), conv_pool
    width = weight.shape[1]
    dtype = _compute_dtype(x, weight, bias)
    xc = x.astype(dtype)
    windows = _initial_window(conv_pool, state_indices, has_initial_state, dtype)  # [N, C, W-1]
    seq, _, _, valid = token_segments(qsl, t_total)
    start = qsl[seq]
    t = jnp.arange(t_total, dtype=qsl.dtype)
    taps = []
    for w in range(width):
        src = t - (width - 1) + w
        from_window = windows[seq, :, jnp.clip(src - start + width - 1, 0, width - 2)]
        from_x = xc[jnp.clip(src, 0, t_total - 1)]
        taps.append(jnp.where((src >= start)[:, None], from_x, from_window))
    y = _conv(jnp.stack(taps, axis=-1), weight, bias, activation)
    y = jnp.where(valid[:, None], y, 0).astype(x.dtype)

    # The new window of sequence n is entries L_n .. L_n+W-2 of ext = (window, x_seq).
    lengths = qsl[1:] - qsl[:-1]
    ext_pos = lengths[:, None] + jnp.arange(width - 1, dtype=qsl.dtype)  # [N, W-1]
    from_x = xc[jnp.clip(qsl[:-1, None] + ext_pos - (width - 1), 0, t_total - 1)]  # [N, W-1, C]
    from_window = jnp.take_along_axis(windows, jnp.clip(ext_pos, 0, width - 2)[:, None, :], axis=2)
    new = jnp.where((ext_pos >= width - 1)[:, None, :], jnp.swapaxes(from_x, 1, 2), from_window)
    return y, write_where(conv_pool, state_indices, new, lengths > 0)


def _rows(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    """D tokens of every row after its slot's window; padded rows (slot 0) are zeroed.

    Returns y ``[N, D, C]`` in x's dtype and ext ``[N, C, W-1+D]`` = (window, x) along time.
    """
    width = weight.shape[1]
    n_steps = x.shape[1]
    dtype = _compute_dtype(x, weight, bias)
    ext = jnp.concatenate(
        [conv_pool[state_indices].astype(dtype), jnp.swapaxes(x.astype(dtype), 1, 2)], axis=-1
    )
    real = (state_indices != 0)[:, None, None]
    ext = jnp.where(real, ext, 0)
    taps = jnp.stack([ext[:, :, d : d + width] for d in range(n_steps)], axis=1)  # [N,D,C,W]
    y = jnp.where(real, _conv(taps, weight, bias, activation), 0)
    return y.astype(x.dtype), ext


def _tree_rows(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    activation: str | None,
    parents: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Verify of tree rows: token t's taps are its parent's window followed by its own input,
    so a node sees its root path, not the tokens before it in the row. Returns y and the
    windows ``[N, D, C, W-1]`` (zeros on padded rows)."""
    dtype = _compute_dtype(x, weight, bias)
    real = (state_indices != 0)[:, None, None]
    history = [jnp.where(real, conv_pool[state_indices].astype(dtype), 0)]
    taps = []
    for d in range(x.shape[1]):
        window = start_of_node(history, parents, d)
        ext = jnp.concatenate([window, x[:, d, :, None].astype(dtype)], axis=-1)  # [N, C, W]
        taps.append(ext)
        history.append(jnp.where(real, ext[:, :, 1:], 0))
    y = jnp.where(real, _conv(jnp.stack(taps, axis=1), weight, bias, activation), 0)
    windows = jnp.stack(history[1:], axis=1)
    return y.astype(x.dtype), windows.astype(conv_pool.dtype)


def causal_conv1d_update(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """``causal_conv1d_update`` (same arguments and results)."""
    x, weight, bias, conv_pool, state_indices = _as_arrays(
        x, weight, bias, conv_pool, state_indices
    )
    y, ext = _rows(x, weight, bias, conv_pool, state_indices, activation)
    window = ext[:, :, x.shape[1] :]
    return y, write_where(conv_pool, state_indices, window, state_indices != 0)


def causal_conv1d_verify(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """``causal_conv1d_verify`` (same arguments and results); with ``parents`` each token's
    window is its parent's (tree drafts)."""
    x, weight, bias, conv_pool, state_indices, parents = _as_arrays(
        x, weight, bias, conv_pool, state_indices, parents
    )
    if parents is not None:
        return _tree_rows(x, weight, bias, conv_pool, state_indices, activation, parents)
    y, ext = _rows(x, weight, bias, conv_pool, state_indices, activation)
    width = weight.shape[1]
    windows = jnp.stack([ext[:, :, d + 1 : d + width] for d in range(x.shape[1])], axis=1)
    return y, windows.astype(conv_pool.dtype)
