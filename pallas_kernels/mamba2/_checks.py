"""Trace-time checks of the Mamba2 ops' shapes and dtypes (the contract of docs/DESIGN.md).

Only static facts are checked. Values (slots inside ``1..S-1``, unique slots among real
sequences, ``qsl`` non-decreasing with ``qsl[N] <= T``, ``accepted_steps < Dt``, ``A < 0``) are
the caller's job: the ops assume them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels._checks import (
    check_dtype,
    check_float,
    check_sequences,
    check_state_pool,
    check_vector,
    fail,
    shape,
)

__all__ = ["check_commit", "check_options", "check_rows", "check_varlen"]


def _check_tokens(
    op: str,
    x: jax.Array,
    dt: jax.Array,
    B: jax.Array,  # noqa: N803 (the contract's names)
    C: jax.Array,  # noqa: N803
    z: jax.Array | None,
    lead: int,
) -> tuple[int, int, int, int]:
    """x ``[*lead, H, P]``, dt ``[*lead, H]``, B, C ``[*lead, G, N]``, z like x -> (H, P, G, N)."""
    if x.ndim != lead + 2:
        fail(op, f"x.shape={shape(x)} must have {lead + 2} dims")
    lead_dims = shape(x)[:lead]
    n_heads, p_dim = shape(x)[lead:]
    check_float(op, "x", x)
    if shape(dt) != (*lead_dims, n_heads):
        fail(op, f"dt.shape={shape(dt)} must be {(*lead_dims, n_heads)} (x's token dims, then H)")
    check_float(op, "dt", dt)
    if B.ndim != lead + 2 or shape(B)[:lead] != lead_dims:
        fail(op, f"B.shape={shape(B)} must be [{', '.join(map(str, lead_dims))}, G, N]")
    n_groups, n_dim = shape(B)[lead:]
    if n_groups == 0 or n_heads % n_groups:
        fail(
            op,
            f"H=x.shape[{lead}]={n_heads} must be a multiple of G=B.shape[{lead}]={n_groups} "
            "(head h uses group h // (H // G))",
        )
    if shape(C) != shape(B):
        fail(op, f"C.shape={shape(C)} must equal B.shape={shape(B)}")
    for name, v in (("B", B), ("C", C)):
        if v.dtype != x.dtype:
            fail(op, f"{name}.dtype={v.dtype} must equal x.dtype={x.dtype}")
    if z is not None:
        if shape(z) != shape(x):
            fail(op, f"z.shape={shape(z)} must equal x.shape={shape(x)}")
        if z.dtype != x.dtype:
            fail(op, f"z.dtype={z.dtype} must equal x.dtype={x.dtype}")
    return n_heads, p_dim, n_groups, n_dim


def _check_params(
    op: str,
    A: jax.Array,  # noqa: N803 (the contract's names)
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    n_heads: int,
) -> None:
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if shape(v) != (n_heads,):
            fail(op, f"{name}.shape={shape(v)} must be [H]=({n_heads},), one value per head")
        check_dtype(op, name, v, jnp.float32)


def _check_pool(op: str, ssm_pool: jax.Array, n_heads: int, p_dim: int, n_dim: int) -> None:
    check_state_pool(op, ssm_pool, {"H": n_heads, "P": p_dim, "N": n_dim})


def check_options(op: str, dt_min: float, dt_max: float) -> None:
    """dt limits are static Python floats with ``dt_min <= dt_max``."""
    for name, v in (("dt_min", dt_min), ("dt_max", dt_max)):
        if isinstance(v, jax.Array) or not isinstance(v, (int, float)):
            fail(op, f"{name}={v!r} must be a Python float (it is static), not an array")
        if math.isnan(v):
            fail(op, f"{name}=nan must be a number")
    if dt_min > dt_max:
        fail(op, f"dt_min={dt_min} must be <= dt_max={dt_max}")


def check_varlen(
    op: str,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    z: jax.Array | None,
) -> None:
    """Packed tokens: x ``[T, H, P]``, dt ``[T, H]``, B, C ``[T, G, N]``, qsl ``[N+1]``."""
    n_heads, p_dim, _, n_dim = _check_tokens(op, x, dt, B, C, z, lead=1)
    _check_params(op, A, D, dt_bias, n_heads)
    _check_pool(op, ssm_pool, n_heads, p_dim, n_dim)
    check_sequences(op, qsl, state_indices, has_initial_state)


def check_rows(
    op: str,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    z: jax.Array | None,
) -> None:
    """Rows of Dt tokens: x ``[N, Dt, H, P]``, dt ``[N, Dt, H]``, B, C ``[N, Dt, G, N]``."""
    n_heads, p_dim, _, n_dim = _check_tokens(op, x, dt, B, C, z, lead=2)
    if x.shape[1] < 1:
        fail(op, f"x.shape={shape(x)} has Dt=0 tokens per row; Dt must be at least 1")
    _check_params(op, A, D, dt_bias, n_heads)
    _check_pool(op, ssm_pool, n_heads, p_dim, n_dim)
    check_vector(op, "state_indices", state_indices, x.shape[0], jnp.int32)


def check_commit(
    op: str,
    ssm_pool: jax.Array,
    intermediates: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> None:
    """intermediates ``[N, Dt, H, P, N]`` from verify, pool ``[S, H, P, N]``."""
    if intermediates.ndim != 5 or intermediates.shape[1] < 1:
        fail(op, f"intermediates.shape={shape(intermediates)} must be [N, Dt, H, P, N], Dt >= 1")
    n_rows, _, n_heads, p_dim, n_dim = shape(intermediates)
    _check_pool(op, ssm_pool, n_heads, p_dim, n_dim)
    check_dtype(op, "intermediates", intermediates, ssm_pool.dtype)
    check_vector(op, "state_indices", state_indices, n_rows, jnp.int32)
    check_vector(op, "accepted_steps", accepted_steps, n_rows, jnp.int32)
