"""The Mamba2 mixer's backend: causal conv1d over x|B|C and the SSD scan over the pools.

One function per token layout (``_PATHS``), chosen while tracing from the static mode, as for
GDN (``backend/gdn.py``). The layer projects and gates in its norm; this module runs the conv
and the scan through ``pallas_kernels``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrid_jax.backend.linear import LinearMixResult, VerifyStates, mix_path, rows, tree_args
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind, TokenLayout
from pallas_kernels import conv1d, mamba2

__all__ = ["Mamba2Dims", "mamba2_mix"]


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


def _ragged(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    qsl, slots, has_init = meta.query_start_loc, meta.state_indices, meta.has_initial_state
    xbc, conv_state = conv1d.causal_conv1d(
        xbc, conv_weight, conv_bias, conv_state, qsl, slots, has_init, impl=impl
    )
    x, b, c = _split_xbc(xbc, dims)
    out, ssm_state = mamba2.ssd_chunk_scan(
        x, dt, ssm.A, b, c, ssm.D, ssm.dt_bias, ssm_state, qsl, slots, has_init,
        impl=impl, packing_invariant=meta.batch_invariant, **_dt_limits(dims),
    )  # fmt: skip
    return LinearMixResult(out, conv_state, ssm_state, ())


def _decode(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    xbc, conv_state = conv1d.causal_conv1d_update(
        rows(xbc, meta), conv_weight, conv_bias, conv_state, slots, impl=impl
    )
    x, b, c = _split_xbc(xbc, dims)
    out, ssm_state = mamba2.selective_state_update(
        x, rows(dt, meta), ssm.A, b, c, ssm.D, ssm.dt_bias, ssm_state, slots,
        impl=impl, **_dt_limits(dims),
    )  # fmt: skip
    return LinearMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, ())


def _verify(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    slots = meta.state_indices
    xbc, windows = conv1d.causal_conv1d_verify(
        rows(xbc, meta), conv_weight, conv_bias, conv_state, slots, impl=impl, **tree_args(meta)
    )
    x, b, c = _split_xbc(xbc, dims)
    out, states = mamba2.verify_selective_state_update(
        x, rows(dt, meta), ssm.A, b, c, ssm.D, ssm.dt_bias, ssm_state, slots,
        impl=impl, **_dt_limits(dims), **tree_args(meta),
    )  # fmt: skip
    verify = VerifyStates(windows, states)
    return LinearMixResult(out.reshape(-1, *out.shape[2:]), conv_state, ssm_state, verify)


def _idle(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl):
    out = jnp.zeros((xbc.shape[0], dims.num_heads, dims.head_dim), xbc.dtype)
    return LinearMixResult(out, conv_state, ssm_state, ())


_PATHS: dict[TokenLayout, Callable[..., LinearMixResult]] = {
    TokenLayout.RAGGED: _ragged,
    TokenLayout.ONE_PER_ROW: _decode,
    TokenLayout.DRAFT_PER_ROW: _verify,
    TokenLayout.EMPTY: _idle,
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
) -> LinearMixResult:
    """Causal conv1d (bias, SiLU) over x|B|C, then the Mamba2 scan, for one layer in ``meta.mode``.

    xbc: ``[T, H*P + 2*G*N]`` (x, B, C channels before the conv); dt: ``[T, H]`` raw time steps
    (softplus and ``dt_bias`` are applied by the scan, then the clip of ``dims``); conv_weight
    ``[C, W]``, conv_bias ``[C]`` or None; A (``-exp(A_log)``), D, dt_bias: float32 ``[H]``;
    conv_state ``[S, C, W-1]``; ssm_state float32 ``[S, H, P, N]``. The scan runs without the
    z gate (the layer gates in its norm). Raises ``UnsupportedForwardModeError`` while tracing
    when Mamba2 layers have no path for the mode.
    """
    path = mix_path(LayerKind.MAMBA2, _PATHS, meta)
    ssm = _SSMParams(A, D, dt_bias)
    return path(xbc, dt, conv_weight, conv_bias, ssm, conv_state, ssm_state, meta, dims, impl)
