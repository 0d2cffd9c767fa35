"""Mosaic GPU decode kernel of Gated DeltaNet: the public decode op's kernel and its variants.

``DEFAULT`` ("pipe3-cols") is what ``fused_recurrent.fused_recurrent_gated_delta_rule`` runs:
the fastest of the variants below, which ``benchmarks/decode_variants.py`` times against one
another (numbers in benchmarks/RESULTS.md and benchmarks/notes.md).

Contract: rows of D tokens, the pool updated in place through ``state_indices`` under ``jit``
with the pool donated; slot 0 = padded row, never touched, zeros in ``o``. The kernel's two
grids and their switchable parts (``DecodeVariant``) are in ``_decode_grids.py``.

Entries: ``fused_recurrent_gated_delta_rule`` (the public op's arguments plus ``interpret``
and ``variant``), ``fused_gating_recurrent_gated_delta_rule`` (the same with the raw
Qwen3-Next gating inputs, gated inside the kernel: the public
``fused_gating_recurrent_gated_delta_rule``'s kernel, checked on the H200 against the oracle),
``packed_gating_recurrent_gated_delta_rule`` (the same reading q, k, v and b, a where the
conv and the projection wrote them) and their ``unsupported_reason`` /
``fused_gating_unsupported_reason`` / ``packed_gating_unsupported_reason`` (which
``impl="auto"`` consults; the verify kernel checks its rows with the first too).
``VARIANTS`` names the configurations the benchmark times.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _counters
from pallas_kernels._common import NUM_SMS
from pallas_kernels.conv1d import update_mgpu as conv_kernels
from pallas_kernels.gdn._checks import check_gated_rows, check_packed_rows, packed_stand_ins
from pallas_kernels.gdn._decode_grids import (
    VEC,
    Columns,
    DecodeVariant,
    Heads,
    conv_lanes,
    normed_variant,
    one_item_per_program,
    pipelined,
)

__all__ = [
    "DEFAULT",
    "MAX_TOKENS",
    "VARIANTS",
    "DecodeVariant",
    "conv_unsupported_reason",
    "fused_gating_recurrent_gated_delta_rule",
    "fused_gating_unsupported_reason",
    "fused_recurrent_gated_delta_rule",
    "packed_gating_recurrent_gated_delta_rule",
    "packed_gating_unsupported_reason",
    "pick_block_v",
    "unsupported_reason",
]

_HEAD_DIMS = (64, 128)
_ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# The D tokens' q/k/v/o tiles sit in SMEM next to the state tile of every ring stage; at 16
# tokens, three stages of float32 activations with K = 128 and 64 columns take 172 KiB, under
# the 227 KiB an sm_90 block may use. 16 covers every speculative depth in use.
MAX_TOKENS = 16
_GATING_OP = "decode_mgpu.fused_gating_recurrent_gated_delta_rule"
_PACKED_OP = "decode_mgpu.packed_gating_recurrent_gated_delta_rule"


DEFAULT = "pipe3-cols"
VARIANTS = {
    "wgmma": DecodeVariant("wgmma", one_pass=False),
    "cols": DecodeVariant("cols"),
    "cols-bv32": DecodeVariant("cols", block_v=32),
    "pipe3-cols": DecodeVariant("cols", stages=3),
}


def pick_block_v(n_rows: int, hv: int, v_dim: int) -> int:
    """64 columns per item; halved (down to 16) while the grid would give an SM fewer than
    two programs: at batch 1 latency, not bandwidth, decides, and more programs share it."""
    block_v = min(64, v_dim)
    while block_v > 16 and n_rows * hv * (v_dim // block_v) < 2 * NUM_SMS:
        block_v //= 2
    return block_v


def unsupported_reason(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> str | None:
    """Why the kernel cannot take this call, in one sentence; None if it can.

    Shapes and dtypes only (the arguments of ``fused_recurrent_gated_delta_rule``); the verify
    kernel (``recurrent_mgpu``) takes the same rows and adds its own rules.
    """
    del scale, use_qk_l2norm
    if q.ndim != 4 or k.shape != q.shape:
        return f"q {q.shape} and k {k.shape} must both be [N, D, H, K]"
    n_rows, n_tokens, h, k_dim = q.shape
    if v.ndim != 4 or v.shape[:2] != (n_rows, n_tokens):
        return f"v {v.shape} must be [N, D, HV, V] with N, D = {n_rows}, {n_tokens}"
    hv, v_dim = v.shape[2:]
    if hv % h:
        return f"HV={hv} is not a multiple of H={h}"
    if k_dim not in _HEAD_DIMS or v_dim not in _HEAD_DIMS:
        return f"K={k_dim}, V={v_dim}: the kernel supports head dims {_HEAD_DIMS} only"
    if not 1 <= n_tokens <= MAX_TOKENS:
        return f"D={n_tokens} tokens per row is outside 1..{MAX_TOKENS}"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _ACTIVATION_DTYPES:
            return f"{name} is {x.dtype}; the kernel takes bfloat16 or float32 activations"
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (n_rows, n_tokens, hv) or x.dtype != jnp.float32:
            got = f"{x.dtype}{list(x.shape)}"
            return f"{name} {got} must be float32 [N, D, HV] = {[n_rows, n_tokens, hv]}"
    want_pool = (hv, k_dim, v_dim)
    if ssm_pool.dtype != jnp.float32 or ssm_pool.ndim != 4 or ssm_pool.shape[1:] != want_pool:
        got = f"{ssm_pool.dtype}{list(ssm_pool.shape)}"
        return f"ssm_pool {got} must be float32 [S, {hv}, {k_dim}, {v_dim}]"
    if state_indices.shape != (n_rows,) or state_indices.dtype != jnp.int32:
        got = f"{state_indices.dtype}{list(state_indices.shape)}"
        return f"state_indices {got} must be int32 [{n_rows}]"
    if n_rows == 0:
        return "N=0 rows: nothing to launch"
    return None


def fused_gating_unsupported_reason(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    A_log: jax.Array,  # noqa: N803 (the model's parameter name)
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> str | None:
    """``unsupported_reason`` of ``fused_gating_recurrent_gated_delta_rule``'s arguments.

    The kernel gates in float32 from the scalars it reads, so it takes these rows exactly when
    it takes them with float32 g, beta ``[N, D, HV]``; A_log and dt_bias follow the gating op's
    rules (``_checks.check_gated_rows``), not the kernel's.
    """
    del A_log, dt_bias
    as_gate = lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32)  # noqa: E731 (checks only)
    return unsupported_reason(
        q, k, v, as_gate(a), as_gate(b), ssm_pool, state_indices,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def fused_recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    variant: DecodeVariant | str = DEFAULT,
) -> tuple[jax.Array, jax.Array]:
    """D tokens per row from ``pool[idx[n]]``; the final state is written back in place.

    q, k ``[N, D, H, K]``; v ``[N, D, HV, V]``; g, beta float32 ``[N, D, HV]``; ssm_pool
    float32 ``[S, HV, K, V]``; state_indices int32 ``[N]`` (0 = padded row). Returns
    (o ``[N, D, HV, V]`` in v's dtype, zeros on padded rows; ssm_pool). Under ``jit`` with
    ``ssm_pool`` donated the pool is updated in place; slot 0 is never touched. ``variant``:
    a ``DecodeVariant`` or a key of ``VARIANTS``.
    """
    reason = unsupported_reason(q, k, v, g, beta, ssm_pool, state_indices)
    if reason is not None:
        raise ValueError(reason)
    return _launch_separate(
        q, k, v, (g, beta), ssm_pool, state_indices, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret, variant=variant,
    )  # fmt: skip


def fused_gating_recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    A_log: jax.Array,  # noqa: N803 (the model's parameter name)
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    variant: DecodeVariant | str = DEFAULT,
) -> tuple[jax.Array, jax.Array]:
    """``fused_recurrent_gated_delta_rule`` with the Qwen3-Next gating done in the kernel.

    A_log, dt_bias ``[HV]``; a, b ``[N, D, HV]`` (any float dtype); the kernel computes
    ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` in float32 from the
    scalars it reads (no g/beta arrays, no separate gating op). Other arguments and results
    as ``fused_recurrent_gated_delta_rule``.
    """
    gating = (A_log, a, dt_bias, b)
    check_gated_rows(_GATING_OP, q, k, v, *gating, ssm_pool, state_indices)
    reason = fused_gating_unsupported_reason(q, k, v, *gating, ssm_pool, state_indices)
    if reason is not None:
        raise ValueError(reason)
    return _launch_separate(
        q, k, v, gating, ssm_pool, state_indices, scale=scale,
        use_qk_l2norm=use_qk_l2norm, interpret=interpret, variant=variant,
    )  # fmt: skip


def packed_gating_unsupported_reason(
    qkv: jax.Array,
    ba: jax.Array,
    gate_params: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> str | None:
    """``fused_gating_unsupported_reason`` of the heads ``packed_gating_...`` reads (its
    arguments as ``check_packed_rows`` accepted them)."""
    q, k, v, a, b = packed_stand_ins(qkv, ba, ssm_pool)
    row = jax.ShapeDtypeStruct(gate_params.shape[1:], gate_params.dtype)  # A_log, dt_bias
    return fused_gating_unsupported_reason(
        q, k, v, row, a, row, b, ssm_pool, state_indices,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


def conv_unsupported_reason(
    qkv: jax.Array, ssm_pool: jax.Array, state_indices: jax.Array, weight: jax.Array,
    conv_pool: jax.Array,
) -> str | None:  # fmt: skip
    """Why ``packed_gating_recurrent_gated_delta_rule`` cannot form the layer's causal conv1d
    (``conv=``) on these inputs, or None: the conv kernel's rules for ``qkv`` as its input
    (no bias, SiLU) and heads of ``conv_lanes()`` dims, one channel a thread."""
    lanes = conv_lanes()
    if ssm_pool.ndim == 4 and ssm_pool.shape[2:] != (lanes, lanes):
        return f"K, V = {ssm_pool.shape[2:]}: the conv in the decode kernel takes K = V = {lanes}"
    return conv_kernels.unsupported_reason(qkv, weight, None, conv_pool, state_indices)


def packed_gating_recurrent_gated_delta_rule(
    qkv: jax.Array,
    ba: jax.Array,
    gate_params: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    interpret: bool = False,
    variant: DecodeVariant | str = DEFAULT,
    output_norm: tuple[jax.Array, jax.Array, float] | None = None,
    conv: tuple[jax.Array, jax.Array] | None = None,
    counters: jax.Ref | None = None,
) -> tuple[jax.Array, ...]:
    """``fused_gating_recurrent_gated_delta_rule`` reading q, k, v from the conv's output
    ``qkv`` ``[N, D, H K + H K + HV V]`` (``[Q | K | V]``) and b, a from ``ba``
    ``[N, D, 2 HV]`` (``[b | a]``) where they sit: no slice of either is written first. A_log
    and dt_bias come as one operand, ``gate_params`` ``[2, HV]``. With ``output_norm``
    ``(z [N, D, HV V], weight float32 [V], eps)`` the output is
    ``reference.gated_output_norm(o, z, weight, eps)``, formed in the kernel (its items are
    then whole heads, in the pipelined grid); the caller checks it
    (``_checks.check_output_norm``). With ``conv`` ``(weight [C, W], conv_pool [S, C, W-1])``
    ``qkv`` is the conv's input and the kernel forms the conv (``causal_conv1d_update``
    with SiLU, no bias) on it; the result is then ``(o, ssm_pool, conv_pool)``, the conv pool
    updated in place under ``jit`` when donated (``conv_unsupported_reason``). The conv's
    items count on ``counters`` (an int32 ``Ref`` of at least ``N H`` zeros, left at zero,
    which launches may share; without it the launch makes its own)."""
    check_packed_rows(_PACKED_OP, qkv, ba, gate_params, ssm_pool, state_indices)
    reason = packed_gating_unsupported_reason(qkv, ba, gate_params, ssm_pool, state_indices)
    if reason is None and conv is not None:
        reason = conv_unsupported_reason(qkv, ssm_pool, state_indices, *conv)
    if reason is not None:
        raise ValueError(reason)
    q, _, v, _, _ = packed_stand_ins(qkv, ba, ssm_pool)
    heads = Heads(*q.shape[2:], *v.shape[2:])
    if conv is not None:
        _counters.check_counters(_PACKED_OP, counters, qkv.shape[0] * heads.h)
    key_dim = heads.h * heads.k_dim
    cols = Columns(q=0, k=key_dim, v=2 * key_dim, gate_first=heads.hv, gate_second=0)
    return _launch(
        qkv, qkv, qkv, (gate_params, ba, ba), ssm_pool, state_indices, heads=heads,
        cols=cols, scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=interpret,
        variant=variant, out_norm=output_norm,
        conv=None if conv is None else (*conv, counters),
    )  # fmt: skip


def _launch_separate(q, k, v, gates_in, ssm_pool, state_indices, **options):
    """``_launch`` for separate q, k ``[N, D, H, K]`` and v ``[N, D, HV, V]``: each flattened
    to ``[N, D, heads * dim]`` (a free reshape), its heads from offset 0."""
    heads = Heads(*q.shape[2:], *v.shape[2:])
    flat = (x.reshape(*x.shape[:2], -1) for x in (q, k, v))
    return _launch(*flat, gates_in, ssm_pool, state_indices, heads=heads, cols=Columns(), **options)


def _launch(q, k, v, gates_in, ssm_pool, state_indices, *, heads, cols, scale, use_qk_l2norm,
            interpret, variant, out_norm=None, conv=None):  # fmt: skip
    """The entries' launch, after their checks: variant, block and scale, then the kernel.
    q, k, v ``[N, D, width]`` with their heads at ``cols``; with ``conv`` (weight, pool,
    counters or None) the conv pool is a third result."""
    if isinstance(variant, str):
        if variant not in VARIANTS:
            raise ValueError(f"variant {variant!r} is not one of {sorted(VARIANTS)}")
        variant = VARIANTS[variant]
    n_rows = q.shape[0]
    bv = variant.block_v or pick_block_v(n_rows, heads.hv, heads.v_dim)
    options = {}
    if out_norm is not None or conv is not None:
        if not variant.stages:
            what = "the output norm" if out_norm is not None else "the conv"
            raise ValueError(f"{what} runs in the pipelined grid (variant.stages >= 2)")
        # The norm reads a whole head, and so does the conv (one channel a thread).
        variant = normed_variant(variant, q.shape[1], heads, q.dtype)
        bv = variant.block_v
    if out_norm is not None:
        options["out_norm"] = out_norm
    if heads.v_dim % bv or bv < 4 * VEC:
        raise ValueError(f"block_v={bv} must divide V={heads.v_dim} and be at least {4 * VEC}")
    scale = heads.k_dim**-0.5 if scale is None else float(scale)
    if variant.stages:
        run = pipelined
    else:
        run = one_item_per_program
    pool_ref = jax.new_ref(ssm_pool)
    conv_ref = None
    if conv is not None:
        weight, conv_pool, counters = conv
        conv_ref = jax.new_ref(conv_pool)
        if counters is None:
            counters = jax.new_ref(jnp.zeros((q.shape[0] * heads.h,), jnp.int32))
        options["conv"] = (weight, conv_ref, counters)
    o = run(
        q, k, v, gates_in, pool_ref, state_indices, heads=heads, cols=cols,
        bv=bv, variant=variant, scale=scale, l2=use_qk_l2norm, interpret=interpret, **options,
    )  # fmt: skip
    if conv_ref is None:
        return o, jax.freeze(pool_ref)
    return o, jax.freeze(pool_ref), jax.freeze(conv_ref)
