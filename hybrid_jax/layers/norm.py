"""RMS norms of the Qwen3-Next family: zero-centred RMSNorm and the gated RMSNorm of GDN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["GatedRMSNorm", "ZeroCenteredRMSNorm"]


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class ZeroCenteredRMSNorm(nnx.Module):
    """``x / rms(x) * (1 + weight)`` with ``weight`` initialised to zeros (Qwen3-Next).

    x: ``[..., dim]`` -> same shape and dtype; the norm is computed in float32.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return (_normalize(x, self.eps) * (1.0 + self.weight[...])).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """``weight * x / rms(x) * silu(gate)``, normalised per head (GDN's output norm).

    x, gate: ``[..., head_dim]`` -> same shape, x's dtype. The normalised x is cast back to its
    dtype before the weight, as the reference implementation does, so bf16 runs round alike.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        normed = self.weight[...] * _normalize(x, self.eps).astype(x.dtype)
        return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
