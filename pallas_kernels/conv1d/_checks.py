"""Trace-time checks of the conv1d ops' shapes and dtypes (the contract of docs/DESIGN.md).

Only static facts are checked. Values (slots inside ``1..S-1``, unique slots among real
sequences, ``qsl`` non-decreasing with ``qsl[N] <= T``, ``accepted_steps < D``) are the host
metadata builder's job: the ops assume them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_commit", "check_rows", "check_varlen"]

ACTIVATIONS = ("silu", None)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _shape(x: jax.Array) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_vector(op: str, name: str, x: jax.Array, length: int, dtype: jnp.dtype) -> None:
    if _shape(x) != (length,):
        _fail(op, f"{name}.shape={_shape(x)} must be ({length},)")
    if x.dtype != dtype:
        _fail(
            op, f"{name}.dtype={x.dtype} must be {jnp.dtype(dtype).name}; cast it before the call"
        )


def _check_conv(
    op: str,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    activation: str | None,
) -> None:
    """x ``[..., C]``; weight ``[C, W]``; bias ``[C]`` or None; pool ``[S, C, W-1]``, x's dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        _fail(op, f"x.dtype={x.dtype} must be a floating dtype")
    channels = x.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        _fail(
            op,
            f"weight.shape={_shape(weight)} must be [C, W]=[{channels}, W] with W >= 2 "
            f"(C from x.shape={_shape(x)})",
        )
    if bias is not None and _shape(bias) != (channels,):
        _fail(op, f"bias.shape={_shape(bias)} must be [C]=({channels},) or bias=None")
    want = (channels, weight.shape[1] - 1)
    if conv_pool.ndim != 3 or _shape(conv_pool)[1:] != want or conv_pool.shape[0] < 1:
        _fail(
            op, f"conv_pool.shape={_shape(conv_pool)} must be [S, C, W-1]=[S, {want[0]}, {want[1]}]"
        )
    if conv_pool.dtype != x.dtype:
        _fail(
            op,
            f"conv_pool.dtype={conv_pool.dtype} must equal x.dtype={x.dtype} "
            "(the pool holds raw inputs); allocate the pool in the activations' dtype",
        )
    if activation not in ACTIVATIONS:
        _fail(op, f"activation={activation!r} must be one of {ACTIVATIONS}")


def check_varlen(
    op: str,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    activation: str | None,
) -> None:
    """Packed tokens: x ``[T, C]``, qsl int32 ``[N+1]``, state_indices int32 ``[N]``."""
    if x.ndim != 2:
        _fail(op, f"x.shape={_shape(x)} must be [T, C]")
    _check_conv(op, x, weight, bias, conv_pool, activation)
    if state_indices.ndim != 1:
        _fail(op, f"state_indices.shape={_shape(state_indices)} must be [N]")
    n_seq = state_indices.shape[0]
    if _shape(qsl) != (n_seq + 1,):
        _fail(op, f"qsl.shape={_shape(qsl)} must be [N+1]=({n_seq + 1},) for N={n_seq} sequences")
    _check_vector(op, "qsl", qsl, n_seq + 1, jnp.int32)
    _check_vector(op, "state_indices", state_indices, n_seq, jnp.int32)
    _check_vector(op, "has_initial_state", has_initial_state, n_seq, jnp.bool_)


def check_rows(
    op: str,
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    activation: str | None,
) -> None:
    """Rows of D tokens: x ``[N, D, C]``, state_indices int32 ``[N]``."""
    if x.ndim != 3 or x.shape[1] < 1:
        _fail(op, f"x.shape={_shape(x)} must be [N, D, C] with D >= 1")
    _check_conv(op, x, weight, bias, conv_pool, activation)
    _check_vector(op, "state_indices", state_indices, x.shape[0], jnp.int32)


def check_commit(
    op: str,
    conv_pool: jax.Array,
    windows: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> None:
    """windows ``[N, D, C, W-1]`` from verify, pool ``[S, C, W-1]`` of the same dtype."""
    if windows.ndim != 4 or windows.shape[1] < 1:
        _fail(op, f"windows.shape={_shape(windows)} must be [N, D, C, W-1] with D >= 1")
    if conv_pool.ndim != 3 or _shape(conv_pool)[1:] != _shape(windows)[2:]:
        _fail(
            op,
            f"conv_pool.shape={_shape(conv_pool)} must be [S, C, W-1] with [C, W-1] = "
            f"windows.shape[2:]={_shape(windows)[2:]}",
        )
    if windows.dtype != conv_pool.dtype:
        _fail(op, f"windows.dtype={windows.dtype} must equal conv_pool.dtype={conv_pool.dtype}")
    _check_vector(op, "state_indices", state_indices, windows.shape[0], jnp.int32)
    _check_vector(op, "accepted_steps", accepted_steps, windows.shape[0], jnp.int32)
