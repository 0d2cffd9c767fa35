"""The Gated DeltaNet mixer's backend: gating, causal conv1d and the delta rule over the pools.

The CUDA engines choose a path with an if/elif chain on the forward mode, repeated in their
eager, capture and replay code. Here the mode is static: ``_PATHS`` maps each token layout to
the one function that runs it, on every call and in every ahead-of-time compilation, and a
layout without a path cannot be traced.

The layer projects; this module gates and runs the conv and the delta rule through
``pallas_kernels``; the layer finishes with its norm and output projection. The gating is the
backend's because where it runs depends on the path: the decode kernel gates inside (no g,
beta arrays, no separate op), the other paths call ``gdn_gating`` before their op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.backend.linear import LinearMixResult, VerifyStates, mix_path, rows, tree_args
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind, TokenLayout
from pallas_kernels import conv1d, gdn
from pallas_kernels.gdn import decode_mgpu
from pallas_kernels.gdn import reference as gdn_reference

__all__ = ["CONV_IN_DECODE_KERNEL", "CONV_IN_DECODE_KERNEL_MAX_ROWS", "GDNDims", "gdn_mix"]

CONV_IN_DECODE_KERNEL = True
"""Whether a DECODE step of up to ``CONV_IN_DECODE_KERNEL_MAX_ROWS`` rows forms the conv in
the decode kernel (``packed_gating_...(conv=)``) where the kernel can take it, instead of a
conv launch of its own before it (one launch fewer a GDN layer, for the same device time:
``benchmarks/RESULTS_serve.md``)."""

CONV_IN_DECODE_KERNEL_MAX_ROWS = 8
"""Rows up to which ``CONV_IN_DECODE_KERNEL`` applies: at a batch-1 bucket of 8 the conv in
the kernel saves a launch and its gap, but at 64 and 256 rows the kernel's per-item conv
costs more than the conv launch (the 9B-like decode step 4-6% slower on the H100:
``benchmarks/RESULTS_serve.md``, session 45)."""


class GDNDims(NamedTuple):
    """Head counts and head dims of one GDN layer (static), and ``state_dtype``, the
    precision the model keeps its delta-rule states at between steps (Qwen3.5's
    ``mamba_ssm_dtype``). The pools are float32 whatever it is: a narrower precision rounds
    every state a step writes (the slots of its rows, and a verify step's per-token states,
    which the commit writes), which gives what storing them narrow would, not its memory."""

    num_key_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    state_dtype: str = "float32"

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.head_v_dim


class _Gating(NamedTuple):
    """The gating inputs of one GDN layer: ``params`` ``[2, HV]`` is ``[A_log; dt_bias]``,
    ``ba`` ``[T, 2 HV]`` is ``[b | a]`` per token."""

    params: jax.Array
    ba: jax.Array

    def gates(self) -> tuple[jax.Array, jax.Array]:
        """``(g, beta)`` of ``gdn_gating``."""
        b, a = gdn.split_ba(self.ba)
        return gdn.gdn_gating(self.params[0], a, self.params[1], b)


def _split_qkv(mixed: jax.Array, dims: GDNDims) -> tuple[jax.Array, jax.Array, jax.Array]:
    return gdn.split_qkv(mixed, dims.num_key_heads, dims.head_k_dim, dims.head_v_dim)


def _stored(states: jax.Array, dims: GDNDims) -> jax.Array:
    """``states`` at the precision the model keeps them at (``GDNDims.state_dtype``)."""
    if jnp.dtype(dims.state_dtype) == states.dtype:
        return states
    return states.astype(dims.state_dtype).astype(states.dtype)


def _stored_slots(pool: jax.Array, slots: jax.Array, dims: GDNDims) -> jax.Array:
    """``pool`` with the rows' slots (never the pad slot 0) at the stored precision."""
    if jnp.dtype(dims.state_dtype) == pool.dtype:
        return pool
    target = jnp.where(slots != 0, slots, pool.shape[0])
    return pool.at[target].set(_stored(pool[slots], dims), mode="drop")


def _normed(mix: LinearMixResult, norm: gdn.OutputNorm | None) -> LinearMixResult:
    """``mix`` with its output gated-normed by ``norm`` (z ``[T, HV*V]``), if given: the paths
    whose op does not form the norm."""
    if norm is None:
        return mix
    z = norm.z.reshape(mix.out.shape)
    return mix._replace(out=gdn_reference.gated_output_norm(mix.out, z, norm.weight, norm.eps))


def _ragged(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl, norm,
            counters):  # fmt: skip
    del counters  # only the decode kernel's conv counts
    g, beta = gating.gates()
    qsl, slots, has_init = meta.query_start_loc, meta.state_indices, meta.has_initial_state
    mixed, conv_state = conv1d.causal_conv1d(
        mixed, conv_weight, None, conv_state, qsl, slots, has_init, impl=impl
    )
    q, k, v = _split_qkv(mixed, dims)
    out, ssm_state = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_state, qsl, slots, has_init, impl=impl,
        packing_invariant=meta.batch_invariant,
    )  # fmt: skip
    # Rows without tokens keep their slot, already at the stored precision.
    ssm_state = _stored_slots(ssm_state, slots, dims)
    return _normed(LinearMixResult(out, conv_state, ssm_state, ()), norm)


def _conv_in_kernel(mixed, conv_weight, conv_state, ssm_state, slots) -> bool:
    """Whether the decode kernel forms the conv on these rows (``CONV_IN_DECODE_KERNEL`` at up
    to ``CONV_IN_DECODE_KERNEL_MAX_ROWS`` rows, and the kernel takes them; the reference
    forms it either way)."""
    if not CONV_IN_DECODE_KERNEL or mixed.shape[0] > CONV_IN_DECODE_KERNEL_MAX_ROWS:
        return False
    reason = decode_mgpu.conv_unsupported_reason(mixed, ssm_state, slots, conv_weight, conv_state)
    return reason is None


def _decode(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl, norm,
            counters):  # fmt: skip
    slots = meta.state_indices
    mixed = rows(mixed, meta)
    conv = None
    if _conv_in_kernel(mixed, conv_weight, conv_state, ssm_state, slots):
        conv = gdn.InputConv(conv_weight, conv_state)
    else:
        mixed, conv_state = conv1d.causal_conv1d_update(
            mixed, conv_weight, None, conv_state, slots, impl=impl
        )
    # The kernel reads q, k, v and b, a where the projection (or the conv) put them, and forms
    # the conv and the output norm when it is given them.
    if norm is not None:
        norm = dataclasses.replace(norm, z=rows(norm.z, meta))
    out, ssm_state, *conv_pool = gdn.packed_gating_recurrent_gated_delta_rule(
        mixed, rows(gating.ba, meta), gating.params, ssm_state, slots, output_norm=norm,
        conv=conv, counters=counters, impl=impl,
    )  # fmt: skip
    if conv is not None:
        (conv_state,) = conv_pool
    ssm_state = _stored_slots(ssm_state, slots, dims)
    return LinearMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, ())


def _verify(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl, norm,
            counters):  # fmt: skip
    del counters
    g, beta = gating.gates()
    slots = meta.state_indices
    mixed, windows = conv1d.causal_conv1d_verify(
        rows(mixed, meta), conv_weight, None, conv_state, slots, impl=impl, **tree_args(meta)
    )
    q, k, v = _split_qkv(mixed, dims)
    out, states = gdn.verify_gated_delta_rule(
        q, k, v, rows(g, meta), rows(beta, meta), ssm_state, slots, impl=impl, **tree_args(meta)
    )
    verify = VerifyStates(windows, _stored(states, dims))
    out = out.reshape(-1, *out.shape[2:])
    return _normed(LinearMixResult(out, conv_state, ssm_state, verify), norm)


def _idle(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl, norm,
          counters):  # fmt: skip
    del norm, counters  # no tokens: zeros either way
    out = jnp.zeros((mixed.shape[0], dims.num_value_heads, dims.head_v_dim), mixed.dtype)
    return LinearMixResult(out, conv_state, ssm_state, ())


_PATHS: dict[TokenLayout, Callable[..., LinearMixResult]] = {
    TokenLayout.RAGGED: _ragged,
    TokenLayout.ONE_PER_ROW: _decode,
    TokenLayout.DRAFT_PER_ROW: _verify,
    TokenLayout.EMPTY: _idle,
}


def gdn_mix(
    mixed_qkv: jax.Array,
    conv_weight: jax.Array,
    gate_params: jax.Array,
    ba: jax.Array,
    conv_state: jax.Array,
    ssm_state: jax.Array,
    meta: ForwardMetadata,
    dims: GDNDims,
    *,
    output_norm: gdn.OutputNorm | None = None,
    counters: jax.Ref | None = None,
    impl: str = "auto",
) -> LinearMixResult:
    """Causal conv1d + SiLU, the gating, then the gated delta rule, for one GDN layer in
    ``meta.mode``; with ``output_norm`` (its gate ``z`` ``[T, HV*V]``) the output comes
    gated-normed (``gdn.reference.gated_output_norm``), formed by the decode kernel in DECODE.

    mixed_qkv: ``[T, 2*H*K + HV*V]`` (q, k, v channels before the conv); conv_weight
    ``[C, W]``; gate_params ``[2, HV]`` (``[A_log; dt_bias]``) and ba ``[T, 2*HV]``
    (``[b | a]`` per token): the inputs of ``gdn_gating`` (gated inside the decode kernel in
    DECODE, by ``gdn_gating`` otherwise); conv_state ``[S, C, W-1]``; ssm_state float32
    ``[S, HV, K, V]`` (states written at ``dims.state_dtype``'s precision). Returns the
    delta rule's output ``[T, HV, V]`` and the pools (see ``LinearMixResult``). Raises
    ``UnsupportedForwardModeError`` while tracing when GDN layers have no path for the mode.
    ``counters``: int32 zeros the decode kernel's conv may count in
    (``packed_gating_recurrent_gated_delta_rule``'s), shared by a forward's launches.
    """
    path = mix_path(LayerKind.GDN, _PATHS, meta)
    gating = _Gating(gate_params, ba)
    return path(
        mixed_qkv, conv_weight, gating, conv_state, ssm_state, meta, dims, impl, output_norm,
        counters,
    )  # fmt: skip
