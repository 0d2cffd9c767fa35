"""Trace-time checks of the GDN ops' shapes and dtypes (the contract of docs/DESIGN.md).

Only static facts are checked. Values (slots inside ``1..S-1``, unique slots among real
sequences, ``qsl`` non-decreasing with ``qsl[N] <= T``, ``accepted_steps < D``) are the host
metadata builder's job: the ops assume them.
"""

from __future__ import annotations

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

__all__ = [
    "check_commit",
    "check_gated_rows",
    "check_gating",
    "check_packed_rows",
    "check_rows",
    "check_varlen",
    "default_scale",
    "packed_stand_ins",
]


def _check_heads(op: str, q: jax.Array, k: jax.Array, v: jax.Array, lead: int) -> tuple[int, ...]:
    """q, k ``[*lead, H, K]``, v ``[*lead, HV, V]`` -> (H, K, HV, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != lead + 2:
            fail(op, f"{name}.shape={shape(x)} must have {lead + 2} dims")
        check_float(op, name, x)
    if shape(q) != shape(k):
        fail(op, f"q.shape={shape(q)} and k.shape={shape(k)} must be equal")
    if q.dtype != k.dtype:
        fail(op, f"q.dtype={q.dtype} and k.dtype={k.dtype} must be equal")
    if shape(v)[:lead] != shape(q)[:lead]:
        fail(op, f"v.shape={shape(v)} and q.shape={shape(q)} must share the leading {lead} dims")
    h, kd = shape(q)[lead:]
    hv, vd = shape(v)[lead:]
    if h == 0 or hv % h:
        fail(
            op,
            f"HV=v.shape[{lead}]={hv} must be a multiple of H=q.shape[{lead}]={h} "
            "(value head h uses key head h // (HV // H))",
        )
    return h, kd, hv, vd


def _check_gates(op: str, g: jax.Array, beta: jax.Array, want: tuple[int, ...]) -> None:
    for name, x in (("g", g), ("beta", beta)):
        if shape(x) != want:
            fail(op, f"{name}.shape={shape(x)} must be {want} (the token dims of v, then HV)")
        check_dtype(op, name, x, jnp.float32)


def _check_pool(op: str, ssm_pool: jax.Array, hv: int, kd: int, vd: int) -> None:
    check_state_pool(op, ssm_pool, {"HV": hv, "K": kd, "V": vd})


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
    check_sequences(op, qsl, state_indices, has_initial_state)


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
        fail(op, f"v.shape={shape(v)} has D=0 tokens per row; D must be at least 1")
    _check_pool(op, ssm_pool, hv, kd, vd)
    check_vector(op, "state_indices", state_indices, n_rows, jnp.int32)
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
        if shape(x) != want:
            fail(op, f"{name}.shape={shape(x)} must be {want} (the token dims of v, then HV)")
    # The gating op's own rules, on the [N * D, HV] tokens it gates (shape stand-ins: a reshape
    # here would leave an op in the caller's jaxpr).
    tokens = lambda x: jax.ShapeDtypeStruct((want[0] * want[1], want[2]), x.dtype)  # noqa: E731
    check_gating(op, a_log, tokens(a), dt_bias, tokens(b))


def packed_stand_ins(
    qkv: jax.Array, ba: jax.Array, ssm_pool: jax.Array
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Shape stand-ins ``(q, k, v, a, b)`` for the heads of a conv output ``qkv``
    ``[N, D, H K + H K + HV V]`` and ``ba`` ``[N, D, 2 HV]``; HV, K and V are the pool's,
    H what is left of qkv's width. Assumes ``check_packed_rows`` accepted them."""
    hv, kd, vd = shape(ssm_pool)[1:]
    n_rows, n_steps, width = shape(qkv)
    h = (width - hv * vd) // (2 * kd)
    keys = jax.ShapeDtypeStruct((n_rows, n_steps, h, kd), qkv.dtype)
    values = jax.ShapeDtypeStruct((n_rows, n_steps, hv, vd), qkv.dtype)
    gate = jax.ShapeDtypeStruct((n_rows, n_steps, hv), ba.dtype)
    return keys, keys, values, gate, gate


def check_packed_rows(
    op: str,
    qkv: jax.Array,
    ba: jax.Array,
    gate_params: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
) -> None:
    """``check_gated_rows`` for rows whose q, k, v come as one conv output ``qkv``
    ``[N, D, H K + H K + HV V]``, whose b, a come as ``ba`` ``[N, D, 2 HV]`` and whose A_log
    and dt_bias come as the rows of ``gate_params`` ``[2, HV]``."""
    if ssm_pool.ndim != 4:
        fail(op, f"ssm_pool.shape={shape(ssm_pool)} must be [S, HV, K, V]")
    hv, kd, vd = shape(ssm_pool)[1:]
    if qkv.ndim != 3:
        fail(op, f"qkv.shape={shape(qkv)} must be [N, D, H*K + H*K + HV*V]")
    keys = qkv.shape[-1] - hv * vd
    if keys <= 0 or keys % (2 * kd):
        fail(
            op,
            f"qkv.shape[-1]={qkv.shape[-1]} must be 2*H*K + HV*V with the pool's HV={hv}, "
            f"K={kd}, V={vd} and some H >= 1",
        )
    if shape(ba) != (*shape(qkv)[:2], 2 * hv):
        fail(op, f"ba.shape={shape(ba)} must be {(*shape(qkv)[:2], 2 * hv)} ([b | a] per token)")
    if shape(gate_params) != (2, hv):
        fail(op, f"gate_params.shape={shape(gate_params)} must be (2, {hv}): [A_log; dt_bias]")
    row = jax.ShapeDtypeStruct((hv,), gate_params.dtype)
    q, k, v, a, b = packed_stand_ins(qkv, ba, ssm_pool)
    check_gated_rows(op, q, k, v, row, a, row, b, ssm_pool, state_indices)


def check_commit(
    op: str,
    ssm_pool: jax.Array,
    intermediates: jax.Array,
    state_indices: jax.Array,
    accepted_steps: jax.Array,
) -> None:
    """intermediates ``[N, D, HV, K, V]`` from verify, pool ``[S, HV, K, V]``."""
    if intermediates.ndim != 5 or intermediates.shape[1] < 1:
        fail(op, f"intermediates.shape={shape(intermediates)} must be [N, D, HV, K, V], D >= 1")
    n_rows, _, hv, kd, vd = shape(intermediates)
    _check_pool(op, ssm_pool, hv, kd, vd)
    check_dtype(op, "intermediates", intermediates, ssm_pool.dtype)
    check_vector(op, "state_indices", state_indices, n_rows, jnp.int32)
    check_vector(op, "accepted_steps", accepted_steps, n_rows, jnp.int32)


def check_gating(op: str, a_log: jax.Array, a: jax.Array, dt_bias: jax.Array, b: jax.Array) -> None:
    """A_log, dt_bias ``[HV]``; a, b ``[T, HV]``."""
    if a.ndim != 2:
        fail(op, f"a.shape={shape(a)} must be [T, HV]")
    hv = a.shape[1]
    if shape(b) != shape(a):
        fail(op, f"b.shape={shape(b)} must equal a.shape={shape(a)}")
    for name, x in (("A_log", a_log), ("dt_bias", dt_bias)):
        if shape(x) != (hv,):
            fail(op, f"{name}.shape={shape(x)} must be [HV]=({hv},), one value per value head")
    for name, x in (("A_log", a_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        check_float(op, name, x)


def default_scale(op: str, head_dim: int, scale: float | None) -> float:
    """``scale`` as a Python float: ``K ** -0.5`` when None."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, jax.Array):
        fail(op, f"scale={scale!r} must be a Python float (it is static), not an array")
    return float(scale)


def check_output_norm(op: str, qkv: jax.Array, ssm_pool: jax.Array, z: jax.Array,
                      weight: jax.Array) -> None:  # fmt: skip
    """The output norm's gate ``z`` ``[N, D, HV V]`` (qkv's rows and dtype) and float32
    ``weight`` ``[V]``, for a packed call whose pool is ``[S, HV, K, V]``."""
    hv, _, vd = shape(ssm_pool)[1:]
    want = (*shape(qkv)[:2], hv * vd)
    if shape(z) != want or z.dtype != qkv.dtype:
        fail(op, f"z {z.dtype}{list(shape(z))} must be {qkv.dtype.name}{list(want)} (the gate of "
                 "every value head)")  # fmt: skip
    if shape(weight) != (vd,) or weight.dtype != jnp.float32:
        fail(op, f"weight {weight.dtype}{list(shape(weight))} must be float32[{vd}] (one head)")
