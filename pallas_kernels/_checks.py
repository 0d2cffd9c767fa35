"""The trace-time checks every op folder's ``_checks`` builds on: an error that names the op,
the argument, its value and the rule (``ValueError``, raised before anything is traced)."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

__all__ = [
    "check_dtype",
    "check_float",
    "check_sequences",
    "check_state_pool",
    "check_vector",
    "fail",
    "shape",
]


def fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def shape(x: jax.Array) -> tuple[int, ...]:
    return tuple(x.shape)


def check_dtype(op: str, name: str, x: jax.Array, want: jnp.dtype) -> None:
    if x.dtype != want:
        fail(op, f"{name}.dtype={x.dtype} must be {jnp.dtype(want).name}; cast it before the call")


def check_float(op: str, name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fail(op, f"{name}.dtype={x.dtype} must be a floating dtype")


def check_vector(op: str, name: str, x: jax.Array, length: int, dtype: jnp.dtype) -> None:
    if shape(x) != (length,):
        fail(op, f"{name}.shape={shape(x)} must be ({length},)")
    check_dtype(op, name, x, dtype)


def check_sequences(
    op: str, qsl: jax.Array, state_indices: jax.Array, has_initial_state: jax.Array
) -> int:
    """The packed layout's per-sequence vectors: qsl int32 ``[N+1]``, state_indices int32
    ``[N]``, has_initial_state bool ``[N]``. Returns N."""
    if state_indices.ndim != 1:
        fail(op, f"state_indices.shape={shape(state_indices)} must be [N]")
    n_seq = state_indices.shape[0]
    if shape(qsl) != (n_seq + 1,):
        fail(op, f"qsl.shape={shape(qsl)} must be [N+1]=({n_seq + 1},) for N={n_seq} sequences")
    check_dtype(op, "qsl", qsl, jnp.int32)
    check_vector(op, "state_indices", state_indices, n_seq, jnp.int32)
    check_vector(op, "has_initial_state", has_initial_state, n_seq, jnp.bool_)
    return n_seq


def check_state_pool(op: str, ssm_pool: jax.Array, dims: Mapping[str, int]) -> None:
    """A float32 state pool ``[S, *dims]`` with S >= 1; the error names ``dims`` by their keys
    (``{"HV": 32, "K": 128, "V": 128}``)."""
    want = tuple(dims.values())
    if ssm_pool.ndim != 1 + len(want) or shape(ssm_pool)[1:] != want or ssm_pool.shape[0] < 1:
        names, sizes = ", ".join(dims), ", ".join(map(str, want))
        fail(op, f"ssm_pool.shape={shape(ssm_pool)} must be [S, {names}] = [S, {sizes}]")
    check_dtype(op, "ssm_pool", ssm_pool, jnp.float32)
