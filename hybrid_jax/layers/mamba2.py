"""The Mamba2 mixer (Nemotron-H / Hugging Face Mamba2 layout) as a Flax NNX module, over the pools.

``in_proj`` yields, per token, ``[z (H*P) | xBC (H*P + 2*G*N) | dt (H)]``; the depthwise conv
(with bias) and SiLU run over xBC, which then splits into x ``[H, P]``, B and C ``[G, N]``;
the scan (``A = -exp(A_log)``, softplus time step with ``dt_bias``, D skip, no z) runs in the
backend; the output is gated and normalised by ``GroupedGatedRMSNorm`` (gate first, then an
RMS norm within each of ``n_groups`` groups of channels) and projected by ``out_proj``.
Parameter names follow Hugging Face's (``conv_weight``/``conv_bias`` hold ``conv1d.weight``
without its singleton axis and ``conv1d.bias``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.backend import Mamba2Dims, mamba2_mix
from hybrid_jax.backend.linear import LinearLayerOutput
from hybrid_jax.layers.linear import project_output
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.state_pool import LinearStateSpec

__all__ = ["GroupedGatedRMSNorm", "Mamba2Config", "Mamba2Mixer"]


@dataclasses.dataclass(frozen=True)
class Mamba2Config:
    """Shape of one Mamba2 mixer: ``num_heads`` heads of ``head_dim``, B/C in ``n_groups``
    groups of ``state_size`` (head h reads group ``h // (num_heads // n_groups)``).

    ``time_step_limit``: the time step is clipped to it after the softplus, in every mode.
    ``use_bias``: biases on in_proj and out_proj; ``use_conv_bias``: on the conv.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_step_limit", tuple(float(v) for v in self.time_step_limit))
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads={self.num_heads} is not a multiple of n_groups={self.n_groups}; "
                f"heads share B/C in equal groups"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")
        lo, hi = self.time_step_limit
        if not 0.0 <= lo <= hi:
            raise ValueError(
                f"time_step_limit={self.time_step_limit} must be (min, max) with 0 <= min <= max"
            )

    @property
    def dims(self) -> Mamba2Dims:
        lo, hi = self.time_step_limit
        return Mamba2Dims(self.num_heads, self.head_dim, self.n_groups, self.state_size, lo, hi)

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.dims.conv_dim

    def state_spec(self) -> LinearStateSpec:
        """Per-slot state of one layer: the conv window over xBC and the ``(H, P, N)`` state."""
        return LinearStateSpec(
            conv_channels=self.conv_dim,
            conv_width=self.conv_kernel,
            ssm_shape=(self.num_heads, self.head_dim, self.state_size),
            conv_dtype=jnp.dtype(self.dtype),
        )


class GroupedGatedRMSNorm(nnx.Module):
    """``weight * rmsnorm_per_group(x * silu(gate))`` (the norm after the gate).

    x, gate: ``[..., dim]`` -> same shape, x's dtype; the RMS is taken over each of ``groups``
    consecutive blocks of ``dim // groups`` channels, in float32; the normalised value is cast
    back to x's dtype before the weight, as the reference implementation does.
    """

    def __init__(self, dim: int, groups: int, *, eps: float = 1e-5, dtype: str = "float32"):
        if dim % groups:
            raise ValueError(f"norm width {dim} does not split into n_groups={groups} groups")
        self.weight = nnx.Param(jnp.ones((dim,), jnp.dtype(dtype)))
        self.groups = groups
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        grouped = h.reshape(*h.shape[:-1], self.groups, h.shape[-1] // self.groups)
        var = jnp.mean(grouped * grouped, axis=-1, keepdims=True)
        normed = (grouped * jax.lax.rsqrt(var + self.eps)).reshape(h.shape)
        return (self.weight[...] * normed.astype(x.dtype)).astype(x.dtype)


class Mamba2Mixer(nnx.Module):
    """in_proj -> causal conv1d (bias, SiLU) -> SSD scan -> grouped gated RMSNorm -> out_proj."""

    def __init__(self, config: Mamba2Config, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        linear = dict(use_bias=c.use_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.config = c
        self.in_proj = nnx.Linear(c.hidden_size, c.inner_dim + c.conv_dim + c.num_heads, **linear)
        bound = 1.0 / np.sqrt(c.conv_kernel)
        self.conv_weight = nnx.Param(
            jax.random.uniform(rngs.params(), (c.conv_dim, c.conv_kernel), dtype, -bound, bound)
        )
        self.conv_bias = (
            nnx.Param(jax.random.uniform(rngs.params(), (c.conv_dim,), dtype, -bound, bound))
            if c.use_conv_bias
            else None
        )
        self.dt_bias = nnx.Param(jnp.ones((c.num_heads,), jnp.float32))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, c.num_heads + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((c.num_heads,), jnp.float32))
        self.norm = GroupedGatedRMSNorm(c.inner_dim, c.n_groups, eps=c.rms_norm_eps, dtype=c.dtype)
        self.out_proj = nnx.Linear(c.inner_dim, c.hidden_size, **linear)

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
        ssm_state float32 ``[S, H, P, N]``."""
        c = self.config
        t = x.shape[0]
        z, xbc, dt = jnp.split(self.in_proj(x), [c.inner_dim, c.inner_dim + c.conv_dim], axis=-1)
        conv_bias = None if self.conv_bias is None else self.conv_bias[...]
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        mix = mamba2_mix(
            xbc, dt, self.conv_weight[...], conv_bias, A, self.D[...].astype(jnp.float32),
            self.dt_bias[...].astype(jnp.float32), conv_state, ssm_state, meta, c.dims, impl=impl,
        )  # fmt: skip
        # Explicit sizes: an IDLE step has t == 0, where -1 cannot be inferred.
        y = self.norm(mix.out.reshape(t, c.inner_dim), z)
        y = project_output(y, self.out_proj, impl=impl)
        return LinearLayerOutput(y, mix.conv_state, mix.ssm_state, mix.verify)
