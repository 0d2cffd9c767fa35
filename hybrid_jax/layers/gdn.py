"""Qwen3-Next's Gated DeltaNet block as a Flax NNX module, served over the slot pools.

The input projections are stored in the order the step reads them, Qwen3.5's:
``in_proj_qkv`` yields the conv channels ``[Q | K | V]`` (every key head's q, then every k,
then every value head's v), ``in_proj_z`` the output gate ``[Z]``, ``in_proj_ba`` ``[b | a]``
per value head. The depthwise conv (no bias) runs over ``[Q | K | V]``. Qwen3-Next's
checkpoints group both projections per key head (``[q, k, v group, z group]`` and
``[b group, a group]``); ``grouped_qkvz_columns`` / ``grouped_ba_columns`` say where each of
our columns sits there, and the loader reorders once, so no step regroups activations.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.backend import GDNDims, gdn_mix
from hybrid_jax.backend.linear import LinearLayerOutput
from hybrid_jax.layers.linear import project, project_output
from hybrid_jax.layers.norm import GatedRMSNorm
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.state_pool import LinearStateSpec
from pallas_kernels import gdn as gdn_kernels

__all__ = [
    "NORM_IN_DECODE_KERNEL",
    "STATE_DTYPES",
    "GDNConfig",
    "GatedDeltaNet",
    "grouped_ba_columns",
    "grouped_qkvz_columns",
]

STATE_DTYPES = ("float32", "bfloat16", "float16")

NORM_IN_DECODE_KERNEL = True
"""Whether the layer hands its gated output norm to the mix (``gdn_mix(output_norm=)``),
whose decode kernel then forms it as it writes each head's output (items of whole heads):
no norm kernels between the decode kernel and ``out_proj`` (two kernels fewer per GDN layer
a decode step on the H200, and a shorter step at batch 1 and 64:
``benchmarks/RESULTS_serve.md``)."""


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Shape of one Gated DeltaNet layer. ``num_value_heads`` must be a multiple of
    ``num_key_heads`` (value head h reads key head h // (HV // H)). ``state_dtype``: the
    precision of the delta-rule states between steps (``GDNDims.state_dtype``)."""

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"mamba_ssm_dtype={self.state_dtype!r}: the delta-rule states are kept at one "
                f"of {list(STATE_DTYPES)}"
            )
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"num_value_heads={self.num_value_heads} is not a multiple of "
                f"num_key_heads={self.num_key_heads}; GDN value heads share key heads in groups"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"conv_kernel={self.conv_kernel} must be >= 2")

    @property
    def dims(self) -> GDNDims:
        return GDNDims(
            self.num_key_heads, self.num_value_heads, self.head_k_dim, self.head_v_dim,
            self.state_dtype,
        )  # fmt: skip

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


def grouped_qkvz_columns(dims: GDNDims) -> tuple[np.ndarray, np.ndarray]:
    """Where ``[Q | K | V]`` and ``[Z]`` sit in Qwen3-Next's per-key-head
    ``[q (K), k (K), v (g*V), z (g*V)]`` columns (g = HV/H): ``grouped[:, qkv]`` is
    ``in_proj_qkv``, ``grouped[:, z]`` is ``in_proj_z``."""
    group = dims.num_value_heads // dims.num_key_heads
    k, v = dims.head_k_dim, group * dims.head_v_dim
    per_head = 2 * k + 2 * v
    starts = np.arange(dims.num_key_heads)[:, None] * per_head

    def part(offset: int, width: int) -> np.ndarray:
        return (starts + offset + np.arange(width)).reshape(-1)

    qkv = np.concatenate([part(0, k), part(k, k), part(2 * k, v)])
    return qkv, part(2 * k + v, v)


def grouped_ba_columns(dims: GDNDims) -> np.ndarray:
    """Where ``[b | a]`` sits in Qwen3-Next's per-key-head ``[b (g), a (g)]`` columns."""
    group = dims.num_value_heads // dims.num_key_heads
    starts = np.arange(dims.num_key_heads)[:, None] * 2 * group
    b = (starts + np.arange(group)).reshape(-1)
    return np.concatenate([b, b + group])


class GatedDeltaNet(nnx.Module):
    """Projections -> causal conv1d (SiLU) -> gating -> delta rule -> gated RMSNorm -> out."""

    def __init__(self, config: GDNConfig, *, rngs: nnx.Rngs):
        c, d = config, config.dims
        dtype = jnp.dtype(c.dtype)
        self.config = c
        # Drawn as Qwen3-Next's grouped matrices, then reordered: a seed gives the same
        # function in either layout.
        init = nnx.initializers.lecun_normal()
        qkvz = init(rngs.params(), (c.hidden_size, 2 * d.key_dim + 2 * d.value_dim), dtype)
        ba = init(rngs.params(), (c.hidden_size, 2 * d.num_value_heads), dtype)
        qkv_cols, z_cols = grouped_qkvz_columns(d)

        def linear(weight: jax.Array) -> nnx.Linear:
            return nnx.Linear(
                *weight.shape, use_bias=False, dtype=dtype, param_dtype=dtype,
                kernel_init=lambda *_: weight, rngs=nnx.Rngs(0),
            )  # fmt: skip

        self.in_proj_qkv = linear(qkvz[:, qkv_cols])
        self.in_proj_z = linear(qkvz[:, z_cols])
        self.in_proj_ba = linear(ba[:, grouped_ba_columns(d)])
        bound = 1.0 / np.sqrt(c.conv_kernel)
        self.conv_weight = nnx.Param(
            jax.random.uniform(rngs.params(), (c.conv_dim, c.conv_kernel), dtype, -bound, bound)
        )
        decay = jax.random.uniform(rngs.params(), (d.num_value_heads,), jnp.float32, 1.0, 16.0)
        # The checkpoint's A_log and dt_bias as the rows of one array: stacked over the layers
        # for the scan, a layer's slice is then one block the decode kernel reads in place
        # (XLA copies a slice of fewer than 256 bytes out before a custom call reads it).
        self.gate_params = nnx.Param(
            gdn_kernels.stack_gate_params(jnp.log(decay), jnp.ones_like(decay))
        )
        self.norm = GatedRMSNorm(d.head_v_dim, eps=c.rms_norm_eps)
        self.out_proj = nnx.Linear(d.value_dim, c.hidden_size, use_bias=False, dtype=dtype,
                                   param_dtype=dtype, rngs=rngs)  # fmt: skip

    def input_readers(self) -> list[nnx.Param]:
        """The weights of the products that read the layer's input (all of its readers)."""
        return [layer.kernel for layer in (self.in_proj_qkv, self.in_proj_z, self.in_proj_ba)]

    def _project(self, x: jax.Array, *, impl: str = "auto"):
        """``(mixed, z, ba)``: the conv's input ``[Q | K | V]``, the output gate per value
        head and ``[b | a]``, each left whole for the op that reads it."""
        d = self.config.dims
        mixed, z, ba = project(x, [self.in_proj_qkv, self.in_proj_z, self.in_proj_ba], impl=impl)
        # Explicit sizes: an IDLE step has no tokens, where -1 cannot be inferred.
        return mixed, z.reshape(x.shape[0], d.num_value_heads, d.head_v_dim), ba

    def __call__(
        self,
        x: jax.Array,
        conv_state: jax.Array,
        ssm_state: jax.Array,
        meta: ForwardMetadata,
        *,
        impl: str = "auto",
        residual: jax.Array | None = None,
        counters: jax.Ref | None = None,
    ) -> LinearLayerOutput:
        """x: ``[T, hidden]`` packed tokens of ``meta``; conv_state ``[S, C, W-1]``;
        ssm_state float32 ``[S, HV, K, V]``. With ``residual`` ``[T, hidden]`` the output is
        ``residual`` plus the layer's, maybe with its square sums (``project_output``)."""
        mixed, z, ba = self._project(x, impl=impl)
        norm = None
        if NORM_IN_DECODE_KERNEL:
            flat = z.reshape(x.shape[0], self.config.dims.value_dim)
            norm = gdn_kernels.OutputNorm(flat, self.norm.weight[...], self.norm.eps)
        mix = gdn_mix(
            mixed, self.conv_weight[...], self.gate_params[...], ba, conv_state, ssm_state,
            meta, self.config.dims, output_norm=norm, counters=counters, impl=impl,
        )  # fmt: skip
        out = mix.out if norm is not None else self.norm(mix.out, z)
        out = out.reshape(x.shape[0], self.config.dims.value_dim)
        out = project_output(out, self.out_proj, impl=impl, residual=residual, counters=counters)
        return LinearLayerOutput(out, mix.conv_state, mix.ssm_state, mix.verify)
