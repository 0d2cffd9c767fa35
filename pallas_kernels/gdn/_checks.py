"""Trace-time checks of the GDN ops' shapes and dtypes (the contract of docs/DESIGN.md).

Only static facts are checked. Values (slots inside ``1..S-1``, unique slots among real
sequences, ``qsl`` non-decreasing with ``qsl[N] <= T``, ``accepted_steps < D``) are the host
metadata builder's job: the ops assume them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "check_commit",
    "check_gated_rows",
    "check_gating",
    "check_rows",
    "check_varlen",
    "default_scale",
]


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _shape(x: jax.Array) -> tuple[int, ...]:
    return tuple(x.shape)


def _check_dtype(op: str, name: str, x: jax.Array, want: jnp.dtype) -> None:
    if x.dtype != want:
        _fail(op, f"{name}.dtype={x.dtype} must be {jnp.dtype(want).name}; cast it before the call")


def _check_float(op: str, name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        _fail(op, f"{name}.dtype={x.dtype} must be a floating dtype")


def _check_heads(op: str, q: jax.Array, k: jax.Array, v: jax.Array, lead: int) -> tuple[int, ...]:
    """q, k ``[*lead, H, K]``, v ``[*lead, HV, V]`` -> (H, K, HV, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != lead + 2:
            _fail(op, f"{name}.shape={_shape(x)} must have {lead + 2} dims")
        _check_float(op, name, x)
    if _shape(q) != _shape(k):
        _fail(op, f"q.shape={_shape(q)} and k.shape={_shape(k)} must be equal")
    if q.dtype != k.dtype:
        _fail(op, f"q.dtype={q.dtype} and k.dtype={k.dtype} must be equal")
    if _shape(v)[:lead] != _shape(q)[:lead]:
        _fail(op, f"v.shape={_shape(v)} and q.shape={_shape(q)} must share the leading {lead} dims")
    h, kd = _shape(q)[lead:]
    hv, vd = _shape(v)[lead:]
    if h == 0 or hv % h:
        _fail(
            op,
            f"HV=v.shape[{lead}]={hv} must be a multiple of H=q.shape[{lead}]={h} "
            "(value head h uses key head h // (HV // H))",
        )
    return h, kd, hv, vd


def _check_gates(op: str, g: jax.Array, beta: jax.Array, want: tuple[int, ...]) -> None:
    for name, x in (("g", g), ("beta", beta)):
        if _shape(x) != want:
            _fail(op, f"{name}.shape={_shape(x)} must be {want} (the token dims of v, then HV)")
        _check_dtype(op, name, x, jnp.float32)


def _check_pool(op: str, ssm_pool: jax.Array, hv: int, kd: int, vd: int) -> None:
    if ssm_pool.ndim != 4 or _shape(ssm_pool)[1:] != (hv, kd, vd) or ssm_pool.shape[0] < 1:
        _fail(
            op, f"ssm_pool.shape={_shape(ssm_pool)} must be [S, HV, K, V] = [S, {hv}, {kd}, {vd}]"
        )
    _check_dtype(op, "ssm_pool", ssm_pool, jnp.float32)


def _check_vector(op: str, name: str, x: jax.Array, length: int, dtype: jnp.dtype) -> None:
    if _shape(x) != (length,):
        _fail(op, f"{name}.shape={_shape(x)} must be ({length},)")
    _check_dtype(op, name, x, dtype)


def check_varlen(
    op: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
) -> None:
    """Packed tokens: q, k ``[T, H, K]``, v ``[T, HV, V]``, g, beta ``[T, HV]``, qsl ``[N+1]``."""
    _, kd, hv, vd = _check_heads(op, q, k, v, lead=1)
    _check_gates(op, g, beta, (v.shape[0], hv))
    _check_pool(op, ssm_pool, hv, kd, vd)
    if state_indices.ndim != 1:
        _fail(op, f"state_indices.shape={_shape(state_indices)} must be [N]")
    n_seq = state_indices.shape[0]
    if _shape(qsl) != (n_seq + 1,):
        _fail(op, f"qsl.shape={_shape(qsl)} must be [N+1]=({n_seq + 1},) for N={n_seq} sequences")
    _check_dtype(op, "qsl", qsl, jnp.int32)
    _check_vector(op, "state_indices", state_indices, n_seq, jnp.int32)
    _check_vector(op, "has_initial_state", has_initial_state, n_seq, jnp.bool_)


def _check_row_layout(
    op: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
) -> tuple[int, int, int]:
    """Rows of D >= 1 tokens without their gates -> the gates' shape ``(N, D, HV)``."""
    _, kd, hv, vd = _check_heads(op, q, k, v, lead=2)
    n_rows, n_steps = v.shape[:2]
    if n_steps < 1:
        _fail(op, f"v.shape={_shape(v)} has D=0 tokens per row; D must be at least 1")
    _check_pool(op, ssm_pool, hv, kd, vd)
    _check_vector(op, "state_indices", state_indices, n_rows, jnp.int32)
    return n_rows, n_steps, hv


def check_rows(
    op: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
) -> None:
    """Rows of D tokens: q, k ``[N, D, H, K]``, v ``[N, D, HV, V]``, g, beta ``[N, D, HV]``."""
    _check_gates(op, g, beta, _check_row_layout(op, q, k, v, ssm_pool, state_indices))


def check_gated_rows(
    op: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    a_log: jax.Array,
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
) -> None:
    """``check_rows`` with ``gdn_gating``'s inputs in place of g, beta: a, b ``[N, D, HV]``
    (any float dtype), A_log, dt_bias ``[HV]``."""
    want = _check_row_layout(op, q, k, v, ssm_pool, state_indices)
    for name, x in (("a", a), ("b", b)):
        if _shape(x) != want:
            _fail(op, f"{name}.shape={_shape(x)} must be {want} (the token dims of v, then HV)")
    # The gating op's own rules, on the [N * D, HV] tokens it gates (shape stand-ins: a reshape
    # here would leave an op in the caller's jaxpr).
    tokens = lambda x: jax.ShapeDtypeStruct((want[0] * want[1], want[2]), x.dtype)  # noqa: E731
    check_gating(op, a_log, tokens(a), dt_bias, tokens(b))


def check_commit(
    op: str,
    ssm_pool: jax.Array,
    intermediates: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> None:
    """intermediates ``[N, D, HV, K, V]`` from verify, pool ``[S, HV, K, V]``."""
    if intermediates.ndim != 5 or intermediates.shape[1] < 1:
        _fail(op, f"intermediates.shape={_shape(intermediates)} must be [N, D, HV, K, V], D >= 1")
    n_rows, _, hv, kd, vd = _shape(intermediates)
    _check_pool(op, ssm_pool, hv, kd, vd)
    _check_dtype(op, "intermediates", intermediates, ssm_pool.dtype)
    _check_vector(op, "state_indices", state_indices, n_rows, jnp.int32)
    _check_vector(op, "accepted_steps", accepted_steps, n_rows, jnp.int32)


def check_gating(op: str, a_log: jax.Array, a: jax.Array, dt_bias: jax.Array, b: jax.Array) -> None:
    """A_log, dt_bias ``[HV]``; a, b ``[T, HV]``."""
    if a.ndim != 2:
        _fail(op, f"a.shape={_shape(a)} must be [T, HV]")
    hv = a.shape[1]
    if _shape(b) != _shape(a):
        _fail(op, f"b.shape={_shape(b)} must equal a.shape={_shape(a)}")
    for name, x in (("A_log", a_log), ("dt_bias", dt_bias)):
        if _shape(x) != (hv,):
            _fail(op, f"{name}.shape={_shape(x)} must be [HV]=({hv},), one value per value head")
    for name, x in (("A_log", a_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        _check_float(op, name, x)


def default_scale(op: str, head_dim: int, scale: float | None) -> float:
    """``scale`` as a Python float: ``K ** -0.5`` when None."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, jax.Array):
        _fail(op, f"scale={scale!r} must be a Python float (it is static), not an array")
    return float(scale)
