"""gdn_gating: Qwen3-Next's per-token decay and write strength of Gated DeltaNet."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import resolve_impl
from pallas_kernels.gdn._checks import check_gating

__all__ = ["gdn_gating"]

_OP = "gdn_gating"
# Elementwise: XLA fuses it into its neighbours, a kernel would only add a launch.
_NO_KERNEL = "no Pallas kernel for gdn_gating (XLA fuses this elementwise op)"


def gdn_gating(
    A_log: jax.Array,
    a: jax.Array,
    dt_bias: jax.Array,
    b: jax.Array,
    *,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Log-space decay and delta-rule strength, float32, computed in float32.

    Args:
      A_log: ``[HV]`` log of the per-head decay rate.
      a: ``[T, HV]`` decay input (projected activations).
      dt_bias: ``[HV]`` bias added to ``a``.
      b: ``[T, HV]`` write-strength logits.
      impl: ``"auto" | "reference"``; there is no kernel (``"pallas"`` raises).

    Returns:
      g ``[T, HV]`` = ``-exp(A_log) * softplus(a + dt_bias)`` (<= 0) and
      beta ``[T, HV]`` = ``sigmoid(b)`` (in (0, 1)), both float32.
    """
    check_gating(_OP, A_log, a, dt_bias, b)
    resolve_impl(_OP, impl, _NO_KERNEL)
    f32 = jnp.float32
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, jax.nn.sigmoid(b.astype(f32))
