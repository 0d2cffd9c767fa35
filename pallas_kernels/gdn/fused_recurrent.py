"""Gated DeltaNet on rows of D tokens: decode (``fused_recurrent_gated_delta_rule``, writes the
pool; ``fused_gating_recurrent_gated_delta_rule``, the same with the Qwen3-Next gating done
in the kernel; ``packed_gating_recurrent_gated_delta_rule``, the same reading its inputs from
the layer's conv output and ``[b | a]`` projection) and speculative verification
(``verify_gated_delta_rule``, returns the state after every token and leaves the pool alone).

The Mosaic GPU kernels live in ``decode_mgpu.py`` (decode: its default variant, the persistent
TMA-pipelined kernel, with or without the gating) and ``recurrent_mgpu.py`` (verify), same
arguments plus ``interpret``; each entry's ``unsupported_reason`` decides whether
``impl="auto"`` may take its op's call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels._common import resolve_impl
from pallas_kernels._tree import check_parents
from pallas_kernels.conv1d import reference as conv1d_reference
from pallas_kernels.conv1d._checks import check_rows as check_conv_rows
from pallas_kernels.gdn import decode_mgpu, recurrent_mgpu, reference
from pallas_kernels.gdn._checks import (
    check_gated_rows,
    check_output_norm,
    check_packed_rows,
    check_rows,
    default_scale,
    packed_stand_ins,
)
from pallas_kernels.gdn.gating import gdn_gating

__all__ = [
    "InputConv",
    "OutputNorm",
    "fused_gating_recurrent_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "packed_gating_recurrent_gated_delta_rule",
    "split_qkv",
    "stack_gate_params",
    "verify_gated_delta_rule",
]


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
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """D tokens per row from the row's slot; the state after the last one is written back.

    Args:
      q, k: ``[N, D, H, K]`` queries and keys (decode: D=1), L2-normalized inside when
        ``use_qk_l2norm``.
      v: ``[N, D, HV, V]`` values, ``HV % H == 0``.
      g: float32 ``[N, D, HV]`` log-space decay (<= 0); beta: float32 ``[N, D, HV]`` in (0, 1).
      ssm_pool: float32 ``[S, HV, K, V]``; row n starts from ``pool[state_indices[n]]``.
        Donate it under jit for an in-place update.
      state_indices: int32 ``[N]`` slots, distinct among real rows. A row at the pad slot 0
        is a padded row: its outputs are zeros and it writes nothing.
      scale: query scale, default ``K ** -0.5``.
      use_qk_l2norm: normalize q and k per head (Qwen3-Next: True).
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      o ``[N, D, HV, V]`` in v's dtype, and the pool with each row's final state in its slot.
    """
    op = "fused_recurrent_gated_delta_rule"
    args = (q, k, v, g, beta, ssm_pool, state_indices)
    check_rows(op, *args)
    options = {"scale": default_scale(op, q.shape[-1], scale), "use_qk_l2norm": use_qk_l2norm}
    which = resolve_impl(op, impl, decode_mgpu.unsupported_reason(*args, **options))
    if which == "reference":
        return reference.fused_recurrent_gated_delta_rule(*args, **options)
    return decode_mgpu.fused_recurrent_gated_delta_rule(
        *args, **options, interpret=which == "interpret"
    )


def fused_gating_recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    A_log: jax.Array,
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """``fused_recurrent_gated_delta_rule`` with ``(g, beta) = gdn_gating(A_log, a, dt_bias, b)``.

    The kernel gates the scalars it reads, so decode neither writes g and beta to memory nor
    runs a separate gating op; the reference gates with ``gdn_gating`` first.

    Args:
      q, k, v, ssm_pool, state_indices, scale, use_qk_l2norm, impl: as
        ``fused_recurrent_gated_delta_rule``.
      A_log: ``[HV]`` log of the per-head decay rate.
      a: ``[N, D, HV]`` decay input (any float dtype).
      dt_bias: ``[HV]`` bias added to ``a``.
      b: ``[N, D, HV]`` write-strength logits (any float dtype).

    Returns:
      o ``[N, D, HV, V]`` in v's dtype, and the pool with each row's final state in its slot.
    """
    op = "fused_gating_recurrent_gated_delta_rule"
    gating = (A_log, a, dt_bias, b)
    check_gated_rows(op, q, k, v, *gating, ssm_pool, state_indices)
    options = {"scale": default_scale(op, q.shape[-1], scale), "use_qk_l2norm": use_qk_l2norm}
    reason = decode_mgpu.fused_gating_unsupported_reason(
        q, k, v, *gating, ssm_pool, state_indices, **options
    )
    which = resolve_impl(op, impl, reason)
    if which != "reference":
        return decode_mgpu.fused_gating_recurrent_gated_delta_rule(
            q, k, v, *gating, ssm_pool, state_indices, **options, interpret=which == "interpret"
        )
    rows, hv = a.shape, a.shape[-1]
    g, beta = gdn_gating(A_log, a.reshape(-1, hv), dt_bias, b.reshape(-1, hv), impl="reference")
    return reference.fused_recurrent_gated_delta_rule(
        q, k, v, g.reshape(rows), beta.reshape(rows), ssm_pool, state_indices, **options
    )


def split_qkv(
    qkv: jax.Array, num_key_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The heads of a conv output ``[..., H K + H K + HV V]`` (``[Q | K | V]``): q, k
    ``[..., H, K]`` and v ``[..., HV, V]``."""
    lead = qkv.shape[:-1]
    key_dim = num_key_heads * head_k_dim
    # Explicit sizes everywhere: an IDLE step has no tokens, where -1 cannot be inferred.
    num_value_heads = (qkv.shape[-1] - 2 * key_dim) // head_v_dim
    q, k, v = jnp.split(qkv, [key_dim, 2 * key_dim], axis=-1)
    return (
        q.reshape(*lead, num_key_heads, head_k_dim),
        k.reshape(*lead, num_key_heads, head_k_dim),
        v.reshape(*lead, num_value_heads, head_v_dim),
    )


def split_ba(ba: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(b, a)`` ``[..., HV]`` each of a gating projection ``[..., 2 HV]`` (``[b | a]``)."""
    b, a = jnp.split(ba, 2, axis=-1)
    return b, a


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OutputNorm:
    """Gated DeltaNet's output norm for the packed decode op to form
    (``reference.gated_output_norm``): ``z`` ``[N, D, HV V]`` the gate of every value head,
    ``weight`` float32 ``[V]``, ``eps`` (static: it is a constant of the kernel)."""

    z: jax.Array
    weight: jax.Array
    eps: float = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InputConv:
    """A GDN layer's causal conv1d for the packed decode op to form on its input
    (``conv1d.causal_conv1d_update`` with SiLU and no bias): ``weight`` ``[C, W]`` and the
    rows' windows ``pool`` ``[S, C, W-1]`` in the input's dtype, C the input's width."""

    weight: jax.Array
    pool: jax.Array


def packed_gating_recurrent_gated_delta_rule(
    qkv: jax.Array,
    ba: jax.Array,
    gate_params: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    output_norm: OutputNorm | None = None,
    conv: InputConv | None = None,
    counters: jax.Ref | None = None,
    impl: str = "auto",
) -> tuple[jax.Array, ...]:
    """``fused_gating_recurrent_gated_delta_rule`` on the inputs as a GDN layer keeps them:
    the kernel reads each head where it sits, so no slice of q, k, v, a or b is written
    before it, and takes A_log and dt_bias as one array (a layer's slice of scanned weights
    is then one block the kernel reads in place, where two 128-byte rows would each be
    copied out first).

    Args:
      qkv: ``[N, D, H*K + H*K + HV*V]``, the conv's output channels ``[Q | K | V]``
        (``split_qkv``); HV, K and V are the pool's, H is what the width leaves.
      ba: ``[N, D, 2*HV]``, ``[b | a]`` per token (any float dtype).
      gate_params: ``[2, HV]``, ``[A_log; dt_bias]`` (``stack_gate_params``).
      ssm_pool, state_indices, scale, use_qk_l2norm, impl: as
        ``fused_gating_recurrent_gated_delta_rule``.
      output_norm: optional ``OutputNorm``: o comes out gated-normed
        (``reference.gated_output_norm`` of each head), formed in the kernel, where the
        layer's norm would be a kernel (or two) of its own after it.
      conv: optional ``InputConv``: ``qkv`` is then the conv's input (the projection's
        output), convolved in the kernel, where the conv would be a launch of its own
        before it.
      counters: optional int32 ``Ref`` ``[n >= N H]`` of zeros for the kernel's conv to
        count in (a key head's value heads share its windows), left at zero, so launches
        may share it; without it the launch makes its own. The reference does not use it.

    Returns:
      o ``[N, D, HV, V]`` in qkv's dtype, and the pool with each row's final state in its
      slot; with ``conv`` also the conv pool with each row's window after its last token.
    """
    op = "packed_gating_recurrent_gated_delta_rule"
    check_packed_rows(op, qkv, ba, gate_params, ssm_pool, state_indices)
    if output_norm is not None:
        check_output_norm(op, qkv, ssm_pool, output_norm.z, output_norm.weight)
    if conv is not None:
        check_conv_rows(op, qkv, conv.weight, None, conv.pool, state_indices, "silu")
    _, kd, vd = ssm_pool.shape[1:]
    options = {"scale": default_scale(op, kd, scale), "use_qk_l2norm": use_qk_l2norm}
    args = (qkv, ba, gate_params, ssm_pool, state_indices)
    reason = decode_mgpu.packed_gating_unsupported_reason(*args, **options)
    if reason is None and conv is not None:
        reason = decode_mgpu.conv_unsupported_reason(qkv, ssm_pool, state_indices, conv.weight,
                                                     conv.pool)  # fmt: skip
    which = resolve_impl(op, impl, reason)
    if which != "reference":
        return decode_mgpu.packed_gating_recurrent_gated_delta_rule(
            *args, **options, interpret=which == "interpret",
            output_norm=None if output_norm is None else dataclasses.astuple(output_norm),
            conv=None if conv is None else dataclasses.astuple(conv), counters=counters,
        )  # fmt: skip
    if conv is not None:
        qkv, conv_pool = conv1d_reference.causal_conv1d_update(
            qkv, conv.weight, None, conv.pool, state_indices, activation="silu"
        )
        o, pool = packed_gating_recurrent_gated_delta_rule(
            qkv, *args[1:], **options, output_norm=output_norm, impl="reference"
        )
        return o, pool, conv_pool
    h = packed_stand_ins(qkv, ba, ssm_pool)[0].shape[2]
    q, k, v = split_qkv(qkv, h, kd, vd)
    b, a = split_ba(ba)
    A_log, dt_bias = gate_params  # noqa: N806 (the model's parameter name)
    o, pool = fused_gating_recurrent_gated_delta_rule(
        q, k, v, A_log, a, dt_bias, b, ssm_pool, state_indices, **options, impl="reference"
    )
    if output_norm is None:
        return o, pool
    z = output_norm.z.reshape(o.shape)  # padded rows' o is zeros, and so is their norm
    return reference.gated_output_norm(o, z, output_norm.weight, output_norm.eps), pool


def stack_gate_params(A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:  # noqa: N803
    """``[2, HV]`` ``[A_log; dt_bias]``, as ``packed_gating_recurrent_gated_delta_rule`` takes
    them (float32)."""
    return jnp.stack([A_log, dt_bias]).astype(jnp.float32)


def verify_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """D draft tokens per row from the row's slot, keeping every intermediate state.

    Arguments as ``fused_recurrent_gated_delta_rule``: q, k ``[N, D, H, K]``, v
    ``[N, D, HV, V]``, g, beta float32 ``[N, D, HV]``, ssm_pool float32 ``[S, HV, K, V]``,
    state_indices int32 ``[N]``. ``parents``: None for chain drafts, or int32 ``[N, D]``
    tree drafts in topological order: token t starts from the state after token
    ``parents[n, t]`` (``-1`` for token 0, the root, which starts from the slot;
    ``0 <= parents[n, t] < t`` for the others). Example: ``[-1, 0, 0, 1]`` verifies two
    candidates for the first draft (tokens 1 and 2) and one continuation of token 1.

    Returns:
      o ``[N, D, HV, V]`` in v's dtype, and intermediates float32 ``[N, D, HV, K, V]``:
      ``intermediates[n, t]`` is row n's state after its token t (zeros on padded rows, slot
      0). The pool is not written;
      ``commit_states`` stores the accepted state afterwards.
    """
    op = "verify_gated_delta_rule"
    args = (q, k, v, g, beta, ssm_pool, state_indices)
    check_rows(op, *args)
    check_parents(op, parents, *v.shape[:2])
    options = {
        "parents": parents,
        "scale": default_scale(op, q.shape[-1], scale),
        "use_qk_l2norm": use_qk_l2norm,
    }
    which = resolve_impl(op, impl, recurrent_mgpu.unsupported_reason(*args, **options))
    if which == "reference":
        return reference.verify_gated_delta_rule(*args, **options)
    return recurrent_mgpu.verify_gated_delta_rule(*args, **options, interpret=which == "interpret")
