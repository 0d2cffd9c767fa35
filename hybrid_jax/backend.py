"""The hybrid linear-attention backend: one forward path per token layout, for GDN and Mamba2.

The CUDA engines choose a path with an if/elif chain on the forward mode, repeated in their
eager, capture and replay code. Here the mode is static: ``modes.token_layout(mode)`` names
the layout, and ``_GDN_PATHS`` (``_MAMBA2_PATHS``) maps each layout to the one function that
runs it, on every call and in every ahead-of-time compilation. A layout without a path cannot
be traced.

Data flows layer -> backend -> kernel: the layer projects, the backend gates and runs the
causal conv1d and the delta rule (or the SSD scan) over the pools through ``pallas_kernels``,
and the layer finishes with its norm and output projection. The GDN gating is the backend's
because where it runs depends on the path: the decode kernel gates inside (no g, beta arrays,
no separate op), the other paths call ``gdn_gating`` before their op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind, TokenLayout, check_supported, token_layout
from pallas_kernels import conv1d, gdn, mamba2

__all__ = [
    "GDNDims",
    "GDNMixResult",
    "Mamba2Dims",
    "Mamba2MixResult",
    "VerifyStates",
    "gdn_mix",
    "mamba2_mix",
]


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
    ssm: ``[bs, D, HV, K, V]`` (GDN) or ``[bs, D, H, P, N]`` (Mamba2) float32 state after each
    draft token. In a tree step (``meta.tree``) "after token t" means after t's root path:
    each token starts from its parent's state and window, so committing node t is the same
    index lookup as committing a chain's step t.
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


class _Gating(NamedTuple):
    """The gating inputs of one GDN layer, in ``gdn_gating``'s order."""

    A_log: jax.Array
    a: jax.Array
    dt_bias: jax.Array
    b: jax.Array


def _split_qkv(mixed: jax.Array, dims: GDNDims) -> tuple[jax.Array, jax.Array, jax.Array]:
    lead = mixed.shape[:-1]
    q, k, v = jnp.split(mixed, [dims.key_dim, 2 * dims.key_dim], axis=-1)
    return (
        q.reshape(*lead, dims.num_key_heads, dims.head_k_dim),
        k.reshape(*lead, dims.num_key_heads, dims.head_k_dim),
        v.reshape(*lead, dims.num_value_heads, dims.head_v_dim),
    )


def _ragged(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl):
    g, beta = gdn.gdn_gating(*gating)
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


def _tree(meta: ForwardMetadata) -> dict[str, jax.Array]:
    """The verify ops' ``parents`` for a tree step; none for a chain-only step, which keeps
    the kernels' chain path."""
    return {"parents": meta.parents} if meta.tree else {}


def _decode(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    mixed, conv_state = conv1d.causal_conv1d_update(
        _rows(mixed, meta), conv_weight, None, conv_state, slots, impl=impl
    )
    q, k, v = _split_qkv(mixed, dims)
    a_log, a, dt_bias, b = gating
    out, ssm_state = gdn.fused_gating_recurrent_gated_delta_rule(
        q, k, v, a_log, _rows(a, meta), dt_bias, _rows(b, meta), ssm_state, slots, impl=impl
    )
    return GDNMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, ())


def _verify(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl):
    g, beta = gdn.gdn_gating(*gating)
    slots = meta.state_indices
    mixed, windows = conv1d.causal_conv1d_verify(
        _rows(mixed, meta), conv_weight, None, conv_state, slots, impl=impl, **_tree(meta)
    )
    q, k, v = _split_qkv(mixed, dims)
    out, states = gdn.verify_gated_delta_rule(
        q, k, v, _rows(g, meta), _rows(beta, meta), ssm_state, slots, impl=impl, **_tree(meta)
    )
    verify = VerifyStates(windows, states)
    return GDNMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, verify)


def _idle(mixed, conv_weight, gating, conv_state, ssm_state, meta, dims, impl):
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
    A_log: jax.Array,
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    conv_state: jax.Array,
    ssm_state: jax.Array,
    meta: ForwardMetadata,
    dims: GDNDims,
    *,
    impl: str = "auto",
) -> GDNMixResult:
    """Causal conv1d + SiLU, the gating, then the gated delta rule, for one GDN layer in
    ``meta.mode``.

    mixed_qkv: ``[T, 2*H*K + HV*V]`` (q, k, v channels before the conv); conv_weight
    ``[C, W]``; A_log, dt_bias ``[HV]`` and a, b ``[T, HV]``: the inputs of ``gdn_gating``
    (gated inside the decode kernel in DECODE, by ``gdn_gating`` otherwise); conv_state
    ``[S, C, W-1]``; ssm_state float32 ``[S, HV, K, V]``. Raises
    ``UnsupportedForwardModeError`` while tracing when GDN layers have no path for the mode.
    """
    check_supported(LayerKind.GDN, meta.mode)
    path = _GDN_PATHS[token_layout(meta.mode)]
    gating = _Gating(A_log, a, dt_bias, b)
    return path(mixed_qkv, conv_weight, gating, conv_state, ssm_state, meta, dims, impl)


# ---------------------------------------------------------------------------------- Mamba2


class Mamba2Dims(NamedTuple):
    """Heads, head dim, B/C groups and state size of one Mamba2 layer (static); the time-step
    clip ``[dt_min, dt_max]`` applied after the softplus."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x (H*P), then B and C (G*N each)."""
        return self.inner_dim + 2 * self.n_groups * self.state_size


class Mamba2MixResult(NamedTuple):
    """out: ``[T, H, P]`` scan output (D skip included, no gate); the layer's pools after the
    step; for TARGET_VERIFY the per-token states (the pools are then returned unchanged),
    else ()."""

    out: jax.Array
    conv_state: jax.Array
    ssm_state: jax.Array
    verify: VerifyStates | tuple[()]


class _SSMParams(NamedTuple):
    """The per-layer constants of the scan: ``A = -exp(A_log)``, D, dt_bias, all ``[H]``."""

    A: jax.Array
    D: jax.Array
    dt_bias: jax.Array


def _split_xbc(xbc: jax.Array, dims: Mamba2Dims) -> tuple[jax.Array, jax.Array, jax.Array]:
    lead = xbc.shape[:-1]
    bc = dims.n_groups * dims.state_size
    x, b, c = jnp.split(xbc, [dims.inner_dim, dims.inner_dim + bc], axis=-1)
    return (
        x.reshape(*lead, dims.num_heads, dims.head_dim),
        b.reshape(*lead, dims.n_groups, dims.state_size),
        c.reshape(*lead, dims.n_groups, dims.state_size),
    )


def _dt_limits(dims: Mamba2Dims) -> dict[str, float]:
    return dict(dt_softplus=True, dt_min=dims.dt_min, dt_max=dims.dt_max)


def _m2_ragged(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    qsl, slots, has_init = meta.query_start_loc, meta.state_indices, meta.has_initial_state
    xbc, conv_state = conv1d.causal_conv1d(
        xbc, conv_weight, conv_bias, conv_state, qsl, slots, has_init, impl=impl
    )
    x, b, c = _split_xbc(xbc, dims)
    out, ssm_state = mamba2.ssd_chunk_scan(
        x, dt, ssm.A, b, c, ssm.D, ssm.dt_bias, ssm_state, qsl, slots, has_init,
        impl=impl, **_dt_limits(dims),
    )  # fmt: skip
    return Mamba2MixResult(out, conv_state, ssm_state, ())


def _m2_decode(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    xbc, conv_state = conv1d.causal_conv1d_update(
        _rows(xbc, meta), conv_weight, conv_bias, conv_state, slots, impl=impl
    )
    x, b, c = _split_xbc(xbc, dims)
    out, ssm_state = mamba2.selective_state_update(
        x, _rows(dt, meta), ssm.A, b, c, ssm.D, ssm.dt_bias, ssm_state, slots,
        impl=impl, **_dt_limits(dims),
    )  # fmt: skip
    return Mamba2MixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, ())


def _m2_verify(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    xbc, windows = conv1d.causal_conv1d_verify(
        _rows(xbc, meta), conv_weight, conv_bias, conv_state, slots, impl=impl, **_tree(meta)
    )
    x, b, c = _split_xbc(xbc, dims)
    out, states = mamba2.verify_selective_state_update(
        x, _rows(dt, meta), ssm.A, b, c, ssm.D, ssm.dt_bias, ssm_state, slots,
        impl=impl, **_dt_limits(dims), **_tree(meta),
    )  # fmt: skip
    verify = VerifyStates(windows, states)
    return Mamba2MixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, verify)


def _m2_idle(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    out = jnp.zeros((xbc.shape[0], dims.num_heads, dims.head_dim), xbc.dtype)
    return Mamba2MixResult(out, conv_state, ssm_state, ())


_MAMBA2_PATHS: dict[TokenLayout, Callable[..., Mamba2MixResult]] = {
    TokenLayout.RAGGED: _m2_ragged,
    TokenLayout.ONE_PER_ROW: _m2_decode,
    TokenLayout.DRAFT_PER_ROW: _m2_verify,
    TokenLayout.EMPTY: _m2_idle,
}


def mamba2_mix(
    xbc: jax.Array,
    dt: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    A: jax.Array,
    D: jax.Array,
    dt_bias: jax.Array,
    conv_state: jax.Array,
    ssm_state: jax.Array,
    meta: ForwardMetadata,
    dims: Mamba2Dims,
    *,
    impl: str = "auto",
) -> Mamba2MixResult:
    """Causal conv1d (bias, SiLU) over x|B|C, then the Mamba2 scan, for one layer in ``meta.mode``.

    xbc: ``[T, H*P + 2*G*N]`` (x, B, C channels before the conv); dt: ``[T, H]`` raw time steps
    (softplus and ``dt_bias`` are applied by the scan, then the clip of ``dims``); conv_weight
    ``[C, W]``, conv_bias ``[C]`` or None; A (``-exp(A_log)``), D, dt_bias: float32 ``[H]``;
    conv_state ``[S, C, W-1]``; ssm_state float32 ``[S, H, P, N]``. The scan runs without the
    z gate (the layer gates in its norm). Raises ``UnsupportedForwardModeError`` while tracing
    when Mamba2 layers have no path for the mode.
    """
    check_supported(LayerKind.MAMBA2, meta.mode)
    path = _MAMBA2_PATHS[token_layout(meta.mode)]
    ssm = _SSMParams(A, D, dt_bias)
    return path(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl)
