"""The hybrid linear-attention backend: one forward path per token layout, for GDN layers.

The CUDA engines choose a path with an if/elif chain on the forward mode, repeated in their
eager, capture and replay code. Here the mode is static: ``modes.token_layout(mode)`` names
the layout, and ``_GDN_PATHS`` maps each layout to the one function that runs it, on every
call and in every ahead-of-time compilation. A layout without a path cannot be traced.

Data flows layer -> backend -> kernel: the layer projects and gates, the backend runs the
causal conv1d and the delta rule over the pools through ``pallas_kernels``, and the layer
finishes with its norm and output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind, TokenLayout, check_supported, token_layout
from pallas_kernels import conv1d, gdn

__all__ = ["GDNDims", "GDNMixResult", "VerifyStates", "gdn_mix"]


class GDNDims(NamedTuple):
    """Head counts and head dims of one GDN layer (static)."""

    num_key_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.head_v_dim


class VerifyStates(NamedTuple):
    """What TARGET_VERIFY hands to the commit after acceptance (one linear layer).

    windows: ``[bs, D, C, W-1]`` conv window after each draft token;
    ssm: ``[bs, D, HV, K, V]`` float32 state after each draft token.
    """

    windows: jax.Array
    ssm: jax.Array


class GDNMixResult(NamedTuple):
    """out: ``[T, HV, V]`` delta-rule output; the layer's pools after the step; for
    TARGET_VERIFY the per-token states (the pools are then returned unchanged), else ()."""

    out: jax.Array
    conv_state: jax.Array
    ssm_state: jax.Array
    verify: VerifyStates | tuple[()]


def _split_qkv(mixed: jax.Array, dims: GDNDims) -> tuple[jax.Array, jax.Array, jax.Array]:
    lead = mixed.shape[:-1]
    q, k, v = jnp.split(mixed, [dims.key_dim, 2 * dims.key_dim], axis=-1)
    return (
        q.reshape(*lead, dims.num_key_heads, dims.head_k_dim),
        k.reshape(*lead, dims.num_key_heads, dims.head_k_dim),
        v.reshape(*lead, dims.num_value_heads, dims.head_v_dim),
    )


def _ragged(mixed, conv_weight, g, beta, conv_state, ssm_state, meta, dims, impl):
    qsl, slots, has_init = meta.query_start_loc, meta.state_indices, meta.has_initial_state
    mixed, conv_state = conv1d.causal_conv1d(
        mixed, conv_weight, None, conv_state, qsl, slots, has_init, impl=impl
    )
    q, k, v = _split_qkv(mixed, dims)
    out, ssm_state = gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, ssm_state, qsl, slots, has_init, impl=impl
    )
    return GDNMixResult(out, conv_state, ssm_state, ())


def _rows(x: jax.Array, meta: ForwardMetadata) -> jax.Array:
    """Packed tokens ``[bs*D, ...]`` -> ``[bs, D, ...]`` (fixed tokens-per-row layouts)."""
    return x.reshape(meta.batch_size, -1, *x.shape[1:])


def _decode(mixed, conv_weight, g, beta, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    mixed, conv_state = conv1d.causal_conv1d_update(
        _rows(mixed, meta), conv_weight, None, conv_state, slots, impl=impl
    )
    q, k, v = _split_qkv(mixed, dims)
    out, ssm_state = gdn.fused_recurrent_gated_delta_rule(
        q, k, v, _rows(g, meta), _rows(beta, meta), ssm_state, slots, impl=impl
    )
    return GDNMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, ())


def _verify(mixed, conv_weight, g, beta, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    mixed, windows = conv1d.causal_conv1d_verify(
        _rows(mixed, meta), conv_weight, None, conv_state, slots, impl=impl
    )
    q, k, v = _split_qkv(mixed, dims)
    out, states = gdn.verify_gated_delta_rule(
        q, k, v, _rows(g, meta), _rows(beta, meta), ssm_state, slots, impl=impl
    )
    verify = VerifyStates(windows, states)
    return GDNMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, verify)


def _idle(mixed, conv_weight, g, beta, conv_state, ssm_state, meta, dims, impl):
    out = jnp.zeros((mixed.shape[0], dims.num_value_heads, dims.head_v_dim), mixed.dtype)
    return GDNMixResult(out, conv_state, ssm_state, ())


_GDN_PATHS: dict[TokenLayout, Callable[..., GDNMixResult]] = {
    TokenLayout.RAGGED: _ragged,
    TokenLayout.ONE_PER_ROW: _decode,
    TokenLayout.DRAFT_PER_ROW: _verify,
    TokenLayout.EMPTY: _idle,
}


def gdn_mix(
    mixed_qkv: jax.Array,
    conv_weight: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    conv_state: jax.Array,
    ssm_state: jax.Array,
    meta: ForwardMetadata,
    dims: GDNDims,
    *,
    impl: str = "auto",
) -> GDNMixResult:
    """Causal conv1d + SiLU, then the gated delta rule, for one GDN layer in ``meta.mode``.

    mixed_qkv: ``[T, 2*H*K + HV*V]`` (q, k, v channels before the conv); conv_weight
    ``[C, W]``; g, beta: float32 ``[T, HV]``; conv_state ``[S, C, W-1]``; ssm_state float32
    ``[S, HV, K, V]``. Raises ``UnsupportedForwardModeError`` while tracing when GDN layers
    have no path for the mode.
    """
    check_supported(LayerKind.GDN, meta.mode)
    path = _GDN_PATHS[token_layout(meta.mode)]
    return path(mixed_qkv, conv_weight, g, beta, conv_state, ssm_state, meta, dims, impl)
