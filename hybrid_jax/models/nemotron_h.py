"""The Nemotron-H hybrid decoder: Mamba2, attention, MLP and MoE blocks by the config's pattern.

``NemotronHConfig`` reads a Hugging Face ``config.json`` (field names as there). The block
pattern comes from ``layers_block_type`` (or ``layer_types``) or from the older
``hybrid_override_pattern`` string: ``M`` Mamba2, ``*`` attention, ``-`` MLP, ``E`` MoE.
Every block is ``x + mixer(norm(x))`` with one RMSNorm and one mixer; there is no separate
feed-forward sub-block. ``NemotronH`` is the causal LM: embeddings, the blocks, ``norm_f`` and
``lm_head``; its ``__call__``/``hidden_states`` are ``Qwen3Next``'s (``HybridCausalLM``),
so the step functions and the engine drive both alike. Mamba2 layers keep their state in the
slot pool, attention layers in the paged KV cache, each indexed by the layer's position among
layers of its kind.

Semantics follow transformers' ``NemotronHForCausalLM``: the Mamba2 time step is clipped to
``[time_step_min, inf)`` (its mixer's limit; here in every mode, where transformers skips the
clip on its single-token decode path); the residual stream stays in the activations' dtype
(``residual_in_fp32`` is read but, as there, not applied); attention has no rotary embedding
and no biases whatever ``attention_bias`` says; the LM head is never tied to the embedding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from hybrid_jax.layers.attention import Attention, AttentionConfig
from hybrid_jax.layers.mamba2 import Mamba2Config, Mamba2Mixer
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.models.decoder import DecoderOutput, HybridCausalLM, LayerStates, as_logits
from hybrid_jax.models.hf_config import (
    ConfigError,
    HFConfig,
    check_eos_in_vocabulary,
    check_field_types,
    check_model_type,
    config_errors,
    hf_dtype,
    hf_eos_token_ids,
    require_fields,
)
from hybrid_jax.models.nemotron_h_blocks import (
    ReLU2MLP,
    RoutedMoE,
    RoutedMoEConfig,
)
from hybrid_jax.modes import LayerKind
from hybrid_jax.parallel import run_block
from hybrid_jax.state_pool import LinearStateSpec

__all__ = [
    "BLOCK_TYPES",
    "ConfigError",
    "NemotronH",
    "NemotronHConfig",
    "NemotronHOutput",
    "RMSNorm",
]

BLOCK_TYPES: Mapping[str, str] = {
    "M": "linear_attention",
    "*": "full_attention",
    "-": "mlp",
    "E": "moe",
}
"""``hybrid_override_pattern`` characters and the block types they name."""

_KINDS = {"linear_attention": LayerKind.MAMBA2, "full_attention": LayerKind.FULL_ATTENTION}
# Older config.json files spell some Mamba fields with a prefix.
_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_min": "time_step_min",
    "mamba_conv_bias": "use_conv_bias",
}


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(HFConfig):
    """Nemotron-H hyper-parameters, named as in Hugging Face's ``config.json``.

    ``layers_block_type[i]`` is ``"linear_attention"`` (Mamba2), ``"full_attention"``,
    ``"mlp"`` or ``"moe"``. ``dtype`` is the dtype of weights and activations (recurrent states
    and the MoE router stay float32). MoE fields matter only when a block is ``"moe"``.
    """

    vocab_size: int
    hidden_size: int
    layers_block_type: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    time_step_min: float = 0.001
    layer_norm_epsilon: float = 1e-5
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 4096
    eos_token_id: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers_block_type", tuple(self.layers_block_type))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if not self.layers_block_type:
            raise ConfigError("layers_block_type is empty; the model needs at least one block")
        for i, kind in enumerate(self.layers_block_type):
            if kind not in BLOCK_TYPES.values():
                raise ConfigError(
                    f"layers_block_type[{i}]={kind!r} is not a Nemotron-H block type; use one of "
                    f"{sorted(BLOCK_TYPES.values())}"
                )
        check_eos_in_vocabulary(self.eos_token_id, self.vocab_size)
        # Building the per-block configs validates heads, groups and routing.
        self.mamba2_config()
        self.attention_config()
        if "moe" in self.layers_block_type:
            self.moe_config()

    @classmethod
    def from_hf_dict(
        cls, config: Mapping[str, Any], *, dtype: str | None = None
    ) -> NemotronHConfig:
        """From a Hugging Face Nemotron-H ``config.json`` as a dict; unknown keys are ignored.

        ``dtype`` overrides the checkpoint's (``dtype`` / ``torch_dtype``, else float32).
        Raises ``ConfigError`` naming the field for a model type, activation or pattern this
        implementation does not have.
        """
        config = dict(config)
        for old, new in _ALIASES.items():
            if old in config and new not in config:
                config[new] = config.pop(old)
        check_model_type(config, "nemotron_h", "Nemotron-H")
        for field, want in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
            got = config.get(field, want)
            if got != want:
                raise ConfigError(f"{field}={got!r}: Nemotron-H blocks are built with {want!r}")
        blocks = config.get("layers_block_type") or config.get("layer_types")
        if blocks is None:
            pattern = config.get("hybrid_override_pattern")
            if pattern is None:
                raise ConfigError(
                    "config.json has neither layers_block_type nor hybrid_override_pattern; "
                    "one of them gives the block pattern"
                )
            bad = sorted(set(pattern) - set(BLOCK_TYPES))
            if bad:
                raise ConfigError(
                    f"hybrid_override_pattern={pattern!r} has characters {bad}; use M (Mamba2), "
                    f"* (attention), - (MLP) or E (MoE)"
                )
            blocks = [BLOCK_TYPES[ch] for ch in pattern]
        heads = config.get("num_attention_heads")
        head_dim = config.get("head_dim") or config.get("attention_head_dim")
        if head_dim is None and heads and "hidden_size" in config:
            head_dim = config["hidden_size"] // heads
        derived = {"layers_block_type": list(blocks), "head_dim": head_dim}
        require_fields(cls, config, derived=[k for k, v in derived.items() if v is not None])
        names = {f.name for f in dataclasses.fields(cls)} - {"eos_token_id", "dtype", *derived}
        values = {key: config[key] for key in names if config.get(key) is not None}
        check_field_types(cls, values)
        return cls(
            **values,
            **derived,
            eos_token_id=hf_eos_token_ids(config),
            dtype=hf_dtype(config, dtype),
        )

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The sequence-mixing blocks' kinds, in block order (MLP and MoE blocks mix nothing)."""
        return tuple(kind for kind in self.block_kinds if kind is not None)

    @property
    def block_kinds(self) -> tuple[LayerKind | None, ...]:
        """Per block, the kind of its mixer's state; None for MLP and MoE blocks (no state)."""
        return tuple(_KINDS.get(b) for b in self.layers_block_type)

    def mamba2_config(self) -> Mamba2Config:
        with config_errors():
            return Mamba2Config(
                hidden_size=self.hidden_size, num_heads=self.mamba_num_heads,
                head_dim=self.mamba_head_dim, n_groups=self.n_groups,
                state_size=self.ssm_state_size, conv_kernel=self.conv_kernel,
                use_conv_bias=self.use_conv_bias, use_bias=self.use_bias,
                time_step_limit=(self.time_step_min, float("inf")),
                rms_norm_eps=self.layer_norm_epsilon, dtype=self.dtype,
            )  # fmt: skip

    def attention_config(self) -> AttentionConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; query heads share key/value "
                f"heads in equal groups"
            )
        with config_errors():
            return AttentionConfig.plain(
                self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                self.head_dim, dtype=self.dtype,
            )  # fmt: skip

    def moe_config(self) -> RoutedMoEConfig:
        if self.n_routed_experts < 1 or self.moe_intermediate_size < 1:
            raise ConfigError(
                f"a 'moe' block needs n_routed_experts >= 1 and moe_intermediate_size >= 1, got "
                f"{self.n_routed_experts} and {self.moe_intermediate_size}"
            )
        if self.moe_shared_expert_intermediate_size < 1:
            raise ConfigError(
                "Nemotron-H MoE blocks have a shared expert: moe_shared_expert_intermediate_size "
                f"must be >= 1, got {self.moe_shared_expert_intermediate_size}"
            )
        with config_errors():
            return RoutedMoEConfig(
                hidden_size=self.hidden_size, num_experts=self.n_routed_experts,
                top_k=self.num_experts_per_tok, intermediate_size=self.moe_intermediate_size,
                shared_intermediate_size=self.moe_shared_expert_intermediate_size,
                n_group=self.n_group, topk_group=self.topk_group,
                norm_topk_prob=self.norm_topk_prob,
                routed_scaling_factor=float(self.routed_scaling_factor),
                latent_size=self.moe_latent_size, mlp_bias=self.mlp_bias, dtype=self.dtype,
            )  # fmt: skip


class RMSNorm(nnx.Module):
    """``weight * x / rms(x)`` in float32, cast back to x's dtype (weight initialised to ones).

    x: ``[..., dim]`` -> same shape and dtype.
    """

    def __init__(self, dim: int, *, eps: float, dtype: str = "float32"):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.dtype(dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)


class NemotronHOutput(DecoderOutput):
    """logits: float32 ``[T, vocab]`` (rows at padded tokens mean nothing); the pool and KV
    cache after the step; per-Mamba2-layer verify states (TARGET_VERIFY, for
    ``backend.commit_verified``) or an empty tuple."""

    __slots__ = ()  # a plain tuple like its base: no per-instance __dict__


class Block(nnx.Module):
    """``x + mixer(norm(x))``; ``block_type`` says which mixer."""

    def __init__(self, config: NemotronHConfig, index: int, *, rngs: nnx.Rngs):
        c = config
        self.block_type = c.layers_block_type[index]
        self.norm = RMSNorm(c.hidden_size, eps=c.layer_norm_epsilon, dtype=c.dtype)
        if self.block_type == "linear_attention":
            self.mixer = Mamba2Mixer(c.mamba2_config(), rngs=rngs)
        elif self.block_type == "full_attention":
            self.mixer = Attention(c.attention_config(), rngs=rngs)
        elif self.block_type == "mlp":
            self.mixer = ReLU2MLP(
                c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=c.dtype, rngs=rngs
            )
        else:
            self.mixer = RoutedMoE(c.moe_config(), rngs=rngs)

    def __call__(
        self, x: jax.Array, states: LayerStates, meta: ForwardMetadata, *, impl: str
    ) -> jax.Array:
        """x: ``[T, hidden]`` -> the same after the block; a Mamba2 or attention mixer takes
        its turn of ``states``."""
        h = self.norm(x)
        if self.block_type == "linear_attention":
            return x + states.linear(self.mixer, h, meta, impl=impl)
        if self.block_type == "full_attention":
            return x + states.attention(self.mixer, h, meta, impl=impl)
        # MLP and MoE: no tokens mixed, no state.
        return x + run_block(self.mixer, h, meta.real_tokens, impl=impl)


class NemotronH(HybridCausalLM):
    """The Nemotron-H causal LM over packed tokens, every forward mode through ``meta``."""

    linear_name = "Mamba2"
    output_type = NemotronHOutput

    def __init__(self, config: NemotronHConfig, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.config = c
        self.embeddings = nnx.Embed(
            c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List([Block(c, i, rngs=rngs) for i in range(c.num_hidden_layers)])
        self.norm_f = RMSNorm(c.hidden_size, eps=c.layer_norm_epsilon, dtype=c.dtype)
        self.lm_head = nnx.Linear(
            c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs
        )

    def state_specs(self) -> tuple[LinearStateSpec, ...]:
        """The slot-pool layout: one spec per Mamba2 layer, in layer order."""
        spec = self.config.mamba2_config().state_spec()
        return tuple(spec for kind in self.layer_kinds if kind is LayerKind.MAMBA2)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """int32 ``[T]`` -> ``[T, hidden]``."""
        return self.embeddings(tokens)

    def final_norm(self, x: jax.Array) -> jax.Array:
        """``[T, hidden]`` -> the same; the module keeps its checkpoint name (``norm_f``)."""
        return self.norm_f(x)

    def logits(self, hidden: jax.Array, dtype: DTypeLike | None = jnp.float32) -> jax.Array:
        """``[T, vocab]`` logits of final hidden states ``[T, hidden]`` in ``dtype`` (None:
        the LM head's product as it is, in the weights' dtype)."""
        return as_logits(self.lm_head(hidden), dtype)
