"""The trace-time checks every op folder's ``_checks`` builds on: an error that names the op,
the argument, its value and the rule (``ValueError``, raised before anything is traced)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_dtype", "check_float", "check_vector", "fail", "shape"]


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
