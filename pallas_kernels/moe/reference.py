"""The grouped matmul in plain XLA (``jax.lax.ragged_dot``) and a float64 oracle."""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["grouped_matmul", "grouped_matmul_oracle"]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot``: rows of group g multiply ``w[g]``; rows past the groups are 0."""
    return jax.lax.ragged_dot(x, w, group_sizes)


def grouped_matmul_oracle(x: np.ndarray, w: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """The same product in float64 with NumPy, group by group."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start : start + size] = x[start : start + size] @ w[g]
        start += size
    return out
