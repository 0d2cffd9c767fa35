"""Qwen3-Next's Gated DeltaNet block as a Flax NNX module, served over the slot pools.

Weights follow Hugging Face's Qwen3-Next layout so checkpoints load as they are:
``in_proj_qkvz`` packs, per key head, ``[q (K), k (K), v (HV/H*V), z (HV/H*V)]``;
``in_proj_ba`` packs, per key head, ``[b (HV/H), a (HV/H)]``; the depthwise conv (no bias)
runs over the channels ``[q | k | v]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.backend import GDNDims, gdn_mix
from hybrid_jax.backend.linear import LinearLayerOutput
from hybrid_jax.layers.norm import GatedRMSNorm
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.state_pool import LinearStateSpec

__all__ = ["GDNConfig", "GatedDeltaNet"]


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Shape of one Gated DeltaNet layer. ``num_value_heads`` must be a multiple of
    ``num_key_heads`` (value head h reads key head h // (HV // H))."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads={self.num_value_heads} is not a multiple of "
                f"num_key_heads={self.num_key_heads}; GDN value heads share key heads in groups"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")

    @property
    def dims(self) -> GDNDims:
        return GDNDims(self.num_key_heads, self.num_value_heads, self.head_k_dim, self.head_v_dim)

    @property
    def conv_dim(self) -> int:
        return 2 * self.dims.key_dim + self.dims.value_dim

    def state_spec(self) -> LinearStateSpec:
        """Per-slot state of one layer: the conv window and the delta-rule state."""
        return LinearStateSpec(
            conv_channels=self.conv_dim,
            conv_width=self.conv_kernel,
            ssm_shape=(self.num_value_heads, self.head_k_dim, self.head_v_dim),
            conv_dtype=jnp.dtype(self.dtype),
        )


class GatedDeltaNet(nnx.Module):
    """Projections -> causal conv1d (SiLU) -> gating -> delta rule -> gated RMSNorm -> out."""

    def __init__(self, config: GDNConfig, *, rngs: nnx.Rngs):
        c, d = config, config.dims
        dtype = jnp.dtype(c.dtype)
        linear = dict(use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.config = c
        self.in_proj_qkvz = nnx.Linear(c.hidden_size, 2 * d.key_dim + 2 * d.value_dim, **linear)
        self.in_proj_ba = nnx.Linear(c.hidden_size, 2 * d.num_value_heads, **linear)
        bound = 1.0 / np.sqrt(c.conv_kernel)
        self.conv_weight = nnx.Param(
            jax.random.uniform(rngs.params(), (c.conv_dim, c.conv_kernel), dtype, -bound, bound)
        )
        self.dt_bias = nnx.Param(jnp.ones((d.num_value_heads,), jnp.float32))
        decay = jax.random.uniform(rngs.params(), (d.num_value_heads,), jnp.float32, 1.0, 16.0)
        self.A_log = nnx.Param(jnp.log(decay))
        self.norm = GatedRMSNorm(d.head_v_dim, eps=c.rms_norm_eps)
        self.out_proj = nnx.Linear(d.value_dim, c.hidden_size, **linear)

    def _project(self, x: jax.Array):
        d = self.config.dims
        groups = d.num_value_heads // d.num_key_heads
        t = x.shape[0]
        # Explicit sizes everywhere: an IDLE step has t == 0, where -1 cannot be inferred.
        per_head = 2 * d.head_k_dim + 2 * groups * d.head_v_dim
        qkvz = self.in_proj_qkvz(x).reshape(t, d.num_key_heads, per_head)
        q, k, v, z = jnp.split(
            qkvz,
            np.cumsum([d.head_k_dim, d.head_k_dim, groups * d.head_v_dim]),
            axis=-1,
        )
        ba = self.in_proj_ba(x).reshape(t, d.num_key_heads, 2 * groups)
        b, a = jnp.split(ba, 2, axis=-1)
        mixed = jnp.concatenate(
            [q.reshape(t, d.key_dim), k.reshape(t, d.key_dim), v.reshape(t, d.value_dim)], axis=-1
        )
        z = z.reshape(t, d.num_value_heads, d.head_v_dim)
        return mixed, z, b.reshape(t, d.num_value_heads), a.reshape(t, d.num_value_heads)

    def __call__(
        self,
        x: jax.Array,
        conv_state: jax.Array,
        ssm_state: jax.Array,
        meta: ForwardMetadata,
        *,
        impl: str = "auto",
    ) -> LinearLayerOutput:
        """x: ``[T, hidden]`` packed tokens of ``meta``; conv_state ``[S, C, W-1]``;
        ssm_state float32 ``[S, HV, K, V]``."""
        mixed, z, b, a = self._project(x)
        mix = gdn_mix(
            mixed, self.conv_weight[...], self.A_log[...], a, self.dt_bias[...], b,
            conv_state, ssm_state, meta, self.config.dims, impl=impl,
        )  # fmt: skip
        out = self.norm(mix.out, z).reshape(x.shape[0], self.config.dims.value_dim)
        return LinearLayerOutput(self.out_proj(out), mix.conv_state, mix.ssm_state, mix.verify)
