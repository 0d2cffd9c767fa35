"""A stack of pre-norm residual GDN blocks over packed hidden states (the backend's test bed).

The full Qwen3-Next model (embeddings, attention, MoE) builds on the same blocks; this stack is
what the demo and the mode-equivalence tests run: hidden states in, hidden states out, one
conv window and one delta-rule state per layer and slot.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
from flax import nnx

from hybrid_jax.backend import VerifyStack
from hybrid_jax.layers.gdn import GatedDeltaNet, GDNConfig
from hybrid_jax.layers.norm import ZeroCenteredRMSNorm
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.models.decoder import LayerStates
from hybrid_jax.modes import LayerKind
from hybrid_jax.state_pool import LinearStateSpec, StatePool

__all__ = ["GDNStack", "GDNStackConfig", "StackOutput", "tiny_gdn_stack_config"]


@dataclasses.dataclass(frozen=True)
class GDNStackConfig:
    num_layers: int
    layer: GDNConfig


def tiny_gdn_stack_config(dtype: str = "float32") -> GDNStackConfig:
    """The built-in default: 2 layers, hidden 64, GVA with 2 key and 4 value heads of 16."""
    layer = GDNConfig(
        hidden_size=64, num_key_heads=2, num_value_heads=4, head_k_dim=16, head_v_dim=16,
        conv_kernel=4, dtype=dtype,
    )  # fmt: skip
    return GDNStackConfig(num_layers=2, layer=layer)


class StackOutput(NamedTuple):
    """hidden: ``[T, hidden]``; the pool after the step; the verify states (TARGET_VERIFY, one
    stack per layer) or an empty tuple."""

    hidden: jax.Array
    pool: StatePool
    verify: tuple[VerifyStack, ...]


class _Block(nnx.Module):
    def __init__(self, config: GDNConfig, *, rngs: nnx.Rngs):
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mixer = GatedDeltaNet(config, rngs=rngs)


class GDNStack(nnx.Module):
    """``num_layers`` blocks ``x + GDN(norm(x))``; every layer is a linear (GDN) layer."""

    def __init__(self, config: GDNStackConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.blocks = nnx.List([_Block(config.layer, rngs=rngs) for _ in range(config.num_layers)])

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return (LayerKind.GDN,) * self.config.num_layers

    def state_specs(self) -> tuple[LinearStateSpec, ...]:
        return (self.config.layer.state_spec(),) * self.config.num_layers

    def __call__(
        self, x: jax.Array, pool: StatePool, meta: ForwardMetadata, *, impl: str = "auto"
    ) -> StackOutput:
        """x: ``[T, hidden]`` packed tokens laid out as ``meta`` says."""
        states = LayerStates(
            pool, None, num_linear=self.config.num_layers, num_attention=0, linear_name="GDN"
        )
        for block in self.blocks:
            x = x + states.linear(block.mixer, block.norm(x), meta, impl=impl)
        pool, _, verify = states.updated()
        return StackOutput(x, pool, verify)
