"""Trace-time checks of the conv1d ops' shapes and dtypes (the contract of docs/DESIGN.md).

Only static facts are checked. Values (slots inside ``1..S-1``, unique slots among real
sequences, ``qsl`` non-decreasing with ``qsl[N] <= T``, ``accepted_steps < D``) are the host
metadata builder's job: the ops assume them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._checks import check_sequences, check_vector, fail, shape

__all__ = ["check_commit", "check_rows", "check_varlen"]

ACTIVATIONS = ("silu", None)


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
        fail(op, f"x.dtype={x.dtype} must be a floating dtype")
    channels = x.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        fail(
            op,
            f"weight.shape={shape(weight)} must be [C, W]=[{channels}, W] with W >= 2 "
            f"(C from x.shape={shape(x)})",
        )
    if bias is not None and shape(bias) != (channels,):
        fail(op, f"bias.shape={shape(bias)} must be [C]=({channels},) or bias=None")
    want = (channels, weight.shape[1] - 1)
    if conv_pool.ndim != 3 or shape(conv_pool)[1:] != want or conv_pool.shape[0] < 1:
        fail(
            op, f"conv_pool.shape={shape(conv_pool)} must be [S, C, W-1]=[S, {want[0]}, {want[1]}]"
        )
    if conv_pool.dtype != x.dtype:
        fail(
            op,
            f"conv_pool.dtype={conv_pool.dtype} must equal x.dtype={x.dtype} "
            "(the pool holds raw inputs); allocate the pool in the activations' dtype",
        )
    if activation not in ACTIVATIONS:
        fail(op, f"activation={activation!r} must be one of {ACTIVATIONS}")


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
        fail(op, f"x.shape={shape(x)} must be [T, C]")
    _check_conv(op, x, weight, bias, conv_pool, activation)
    check_sequences(op, qsl, state_indices, has_initial_state)


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
        fail(op, f"x.shape={shape(x)} must be [N, D, C] with D >= 1")
    _check_conv(op, x, weight, bias, conv_pool, activation)
    check_vector(op, "state_indices", state_indices, x.shape[0], jnp.int32)


def check_commit(
    op: str,
    conv_pool: jax.Array,
    windows: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> None:
    """windows ``[N, D, C, W-1]`` from verify, pool ``[S, C, W-1]`` of the same dtype."""
    if windows.ndim != 4 or windows.shape[1] < 1:
        fail(op, f"windows.shape={shape(windows)} must be [N, D, C, W-1] with D >= 1")
    if conv_pool.ndim != 3 or shape(conv_pool)[1:] != shape(windows)[2:]:
        fail(
            op,
            f"conv_pool.shape={shape(conv_pool)} must be [S, C, W-1] with [C, W-1] = "
            f"windows.shape[2:]={shape(windows)[2:]}",
        )
    if windows.dtype != conv_pool.dtype:
        fail(op, f"windows.dtype={windows.dtype} must equal conv_pool.dtype={conv_pool.dtype}")
    check_vector(op, "state_indices", state_indices, windows.shape[0], jnp.int32)
    check_vector(op, "accepted_steps", accepted_steps, windows.shape[0], jnp.int32)
