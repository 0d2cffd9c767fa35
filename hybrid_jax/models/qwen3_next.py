"""The Qwen3-Next hybrid decoder: GDN and gated full-attention layers, MoE feed-forward blocks.

``Qwen3NextConfig`` reads a Hugging Face ``config.json`` (field names as there; the layer
pattern from ``layer_types`` or ``full_attention_interval``). ``Qwen3Next`` is the causal LM:
token embedding, ``num_hidden_layers`` pre-norm residual blocks (token mixer, then MLP or
sparse MoE), final norm and LM head (tied to the embedding or not). Linear (GDN) layers keep
their state in the slot pool (``state_pool.StatePool``), full-attention layers in the paged
KV cache (``kv_cache.KVCache``); both are indexed by the layer's position among layers of
its kind. ``tiny_qwen3_next_config`` is the built-in model that needs no download.

The multi-token-prediction head (``MTPHead``, the checkpoint's ``mtp.*`` tensors, built when
``num_nextn_predict_layers`` is 1) predicts the token after next: at position p it reads the
target's final-normed hidden state ``h_p`` and the embedding of the next token ``t_{p+1}``,
``x = fc([pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)])`` (embedding
first), runs one full-attention decoder layer (with the feed-forward block layer index 0
would have) and ``mtp.norm``, and shares the embedding and LM head with the model. Every
norm is the zero-centred ``(1 + w)`` RMSNorm. Its attention layer keeps its own KV cache
(``mtp_kv_specs``) on the same pages as the model's: it writes position p of a request where
the model does.

Qwen3.5 and Qwen3.6 checkpoints build this model too (``qwen3_5_loading``): their text model
is the same computation with other tensor names and layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from hybrid_jax.kv_cache import KVCache, KVCacheSpec
from hybrid_jax.layers import linear as linear_layer
from hybrid_jax.layers import moe as moe_layer
from hybrid_jax.layers.attention import Attention, AttentionConfig
from hybrid_jax.layers.gdn import GatedDeltaNet, GDNConfig
from hybrid_jax.layers.moe import MLP, MoEConfig, SparseMoE
from hybrid_jax.layers.norm import NormedRows, SummedRows, ZeroCenteredRMSNorm, rows_of
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
from hybrid_jax.modes import LayerKind
from hybrid_jax.parallel import run_block, tp_size
from hybrid_jax.state_pool import LinearStateSpec

__all__ = [
    "ConfigError",
    "DecoderLayer",
    "MTPHead",
    "Qwen3Next",
    "Qwen3NextConfig",
    "Qwen3NextOutput",
    "tiny_qwen3_next",
    "tiny_qwen3_next_config",
]

_LAYER_TYPES = {"linear_attention": LayerKind.GDN, "full_attention": LayerKind.FULL_ATTENTION}


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(HFConfig):
    """Qwen3-Next hyper-parameters, named as in Hugging Face's ``config.json``.

    ``dtype`` is the dtype of weights and activations here (norms and recurrent states stay
    float32). ``layer_types[i]`` is ``"linear_attention"`` (GDN) or ``"full_attention"``.
    Layer i has a sparse MoE block when ``num_experts > 0``, ``i`` is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, else a dense MLP of
    ``intermediate_size``. ``num_nextn_predict_layers``: 1 builds the multi-token-prediction
    head (``MTPHead``), 0 leaves it out. ``vision_token_ids``: the image and video placeholder
    ids of a vision-language checkpoint (Qwen3.5), which this text-only model refuses in a
    prompt. ``mamba_ssm_dtype``: the precision the GDN states keep between steps (Qwen3.5's
    field; ``GDNDims.state_dtype``: the pools stay float32, the states written are rounded).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    vision_token_ids: tuple[int, ...] = ()
    mamba_ssm_dtype: str = "float32"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "vision_token_ids", tuple(self.vision_token_ids))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers="
                f"{self.num_hidden_layers}; give one type per layer"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in _LAYER_TYPES:
                raise ConfigError(
                    f"layer_types[{i}]={kind!r} is not a Qwen3-Next layer type; use one of "
                    f"{sorted(_LAYER_TYPES)}"
                )
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ConfigError(
                f"num_experts={self.num_experts} needs moe_intermediate_size >= 1, got "
                f"{self.moe_intermediate_size}"
            )
        if self.num_experts and self.shared_expert_intermediate_size < 1:
            raise ConfigError(
                "Qwen3-Next MoE blocks have a shared expert: shared_expert_intermediate_size "
                f"must be >= 1, got {self.shared_expert_intermediate_size}"
            )
        if self.num_nextn_predict_layers not in (0, 1):
            raise ConfigError(
                f"num_nextn_predict_layers={self.num_nextn_predict_layers}: Qwen3-Next has one "
                f"multi-token-prediction layer (1) or none (0)"
            )
        check_eos_in_vocabulary(self.eos_token_id, self.vocab_size)
        for layer in self.mlp_only_layers:
            if not 0 <= layer < self.num_hidden_layers:
                raise ConfigError(
                    f"mlp_only_layers names layer {layer}, outside 0..{self.num_hidden_layers - 1}"
                )
        # Building the per-layer configs validates heads, groups and the rotary part.
        self.attention_config()
        self.gdn_config()
        if self.num_experts:
            self.moe_config()

    @classmethod
    def from_hf_dict(
        cls, config: Mapping[str, Any], *, dtype: str | None = None
    ) -> Qwen3NextConfig:
        """From a Hugging Face Qwen3-Next ``config.json`` as a dict; unknown keys are ignored.

        ``dtype`` overrides the checkpoint's (``dtype`` / ``torch_dtype``, else float32).
        Raises ``ConfigError`` naming the field for a model type, activation or rotary
        scaling this implementation does not have.
        """
        check_model_type(config, "qwen3_next", "Qwen3-Next")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r}: Qwen3-Next blocks are built with 'silu'")
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"rope type {rope_type!r}: only the default rotary embedding is implemented; "
                f"remove the rope scaling or serve a shorter context"
            )
        require_fields(cls, config, derived=("layer_types", "head_dim"))  # filled in below
        layers = config["num_hidden_layers"]
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = config.get("full_attention_interval", 4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ]
        fields = {f.name for f in dataclasses.fields(cls)} - {
            "layer_types", "eos_token_id", "dtype", "rope_theta", "partial_rotary_factor",
            "vision_token_ids",
        }  # fmt: skip
        values = {key: config[key] for key in fields if key in config}
        check_field_types(cls, {k: v for k, v in values.items() if v is not None})
        if values.get("head_dim") is None:
            values["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        if values.get("mlp_only_layers") is None:
            values.pop("mlp_only_layers", None)
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        check_field_types(cls, {"rope_theta": theta, "partial_rotary_factor": factor})
        if not isinstance(layer_types, list | tuple):
            raise ConfigError(f"config.json: layer_types={layer_types!r} must be a list")
        return cls(
            **values,
            layer_types=tuple(layer_types),
            eos_token_id=hf_eos_token_ids(config),
            rope_theta=float(theta),
            partial_rotary_factor=float(factor),
            dtype=hf_dtype(config, dtype),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents of this configuration (Hugging Face field names)."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("dtype",)}
        out["layer_types"] = list(self.layer_types)
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        out["eos_token_id"] = list(self.eos_token_id) or None
        out.pop("vision_token_ids")
        out.update(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])
        out.update(hidden_act="silu", dtype=self.dtype)
        return out

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(_LAYER_TYPES[kind] for kind in self.layer_types)

    @property
    def block_kinds(self) -> tuple[LayerKind, ...]:
        """Per decoder layer, the kind of its mixer's state: every layer keeps one."""
        return self.layer_kinds

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def mtp_is_moe(self) -> bool:
        """The MTP layer's feed-forward block follows layer index 0's rule (its index in
        ``mtp.layers``), as the peers build it: sparse for the released checkpoints."""
        return self.is_moe_layer(0)

    def attention_config(self) -> AttentionConfig:
        with config_errors():
            return AttentionConfig(
                hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
                num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
                rope_theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor,
                rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias,
                dtype=self.dtype,
            )  # fmt: skip

    def gdn_config(self) -> GDNConfig:
        with config_errors():
            return GDNConfig(
                hidden_size=self.hidden_size, num_key_heads=self.linear_num_key_heads,
                num_value_heads=self.linear_num_value_heads, head_k_dim=self.linear_key_head_dim,
                head_v_dim=self.linear_value_head_dim, conv_kernel=self.linear_conv_kernel_dim,
                rms_norm_eps=self.rms_norm_eps, dtype=self.dtype,
                state_dtype=self.mamba_ssm_dtype,
            )  # fmt: skip

    def moe_config(self) -> MoEConfig:
        with config_errors():
            return MoEConfig(
                hidden_size=self.hidden_size, num_experts=self.num_experts,
                top_k=self.num_experts_per_tok, intermediate_size=self.moe_intermediate_size,
                shared_intermediate_size=self.shared_expert_intermediate_size,
                norm_topk_prob=self.norm_topk_prob, dtype=self.dtype,
            )  # fmt: skip


def tiny_qwen3_next_config(dtype: str = "float32") -> Qwen3NextConfig:
    """The built-in model: byte vocabulary (256), hidden 64, four layers alternating GDN and
    full attention, MoE of 4 experts (top 2) with a shared expert, a dense MLP in layer 2,
    and the multi-token-prediction head."""
    return Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=("linear_attention", "full_attention") * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mlp_only_layers=(2,), partial_rotary_factor=0.5,
        max_position_embeddings=1024, num_nextn_predict_layers=1, dtype=dtype,
    )  # fmt: skip


class Qwen3NextOutput(DecoderOutput):
    """logits: float32 ``[T, vocab]`` (rows at padded tokens mean nothing); the pool and KV
    cache after the step; per-GDN-layer verify states (TARGET_VERIFY, for
    ``backend.commit_verified``) or an empty tuple."""

    __slots__ = ()  # a plain tuple like its base: no per-instance __dict__


class DecoderLayer(nnx.Module):
    """``x + mixer(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``; the
    mixer is GDN or gated attention (``kind``), the MLP sparse (``moe``) or dense."""

    reads_square_sums = True
    """Its input norm reads the square sums of ``SummedRows`` given for ``x``."""

    def __init__(self, config: Qwen3NextConfig, kind: LayerKind, moe: bool, *, rngs: nnx.Rngs):
        c = config
        self.kind = kind
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if self.kind is LayerKind.GDN:
            self.linear_attn = GatedDeltaNet(c.gdn_config(), rngs=rngs)
        else:
            self.self_attn = Attention(c.attention_config(), rngs=rngs)
        if moe:
            self.mlp = SparseMoE(c.moe_config(), rngs=rngs)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype=c.dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array | SummedRows, states: LayerStates, meta: ForwardMetadata, *, impl: str
    ) -> jax.Array | SummedRows:
        """x: ``[T, hidden]`` -> the same after both residual branches; the mixer takes its
        turn of ``states``. A MoE block may give the rows with their square sums
        (``SparseMoE.add_to``), which the next layer's input norm then reads."""
        # The norms' outputs are read by products only: with ``NORMS_IN_LAUNCH`` each is
        # left to its products' launch to form (``NormedRows``).
        h = self._normed(self.input_layernorm, x)
        x = rows_of(x)
        if self.kind is LayerKind.GDN:
            x = states.linear(self.linear_attn, h, meta, impl=impl, residual=x)
        else:
            x = states.attention(self.self_attn, h, meta, impl=impl, residual=x)
        h = self._normed(self.post_attention_layernorm, x)
        x = rows_of(x)
        if isinstance(self.mlp, SparseMoE) and tp_size() == 1:
            real = meta.real_tokens if states.real_flags is None else states.real_flags
            return self.mlp.add_to(x, h, real, impl=impl, counters=states.counters)
        return x + run_block(self.mlp, h, meta.real_tokens, impl=impl)

    @staticmethod
    def _normed(norm: ZeroCenteredRMSNorm, x: jax.Array | SummedRows) -> jax.Array | NormedRows:
        return norm.deferred(x) if linear_layer.NORMS_IN_LAUNCH else norm(x)

    def fold_norm_weights(self) -> None:
        """Both norms' weights into the products that read them, in place
        (``ZeroCenteredRMSNorm.fold_into``; a MoE block's shared gate then joins the router's
        launch). The layer's outputs are unchanged up to rounding; its weights are no longer
        the checkpoint's, so only a copy the caller owns is folded (an engine's stacked
        layers)."""
        mixer = self.linear_attn if self.kind is LayerKind.GDN else self.self_attn
        self.input_layernorm.fold_into(mixer.input_readers())
        self.post_attention_layernorm.fold_into(self.mlp.input_readers())
        if isinstance(self.mlp, SparseMoE):
            self.mlp.widen_shared_gate()

    def pair_swiglu_halves(self) -> None:
        """The block's gate/up weights laid out for the launch that forms its hidden rows
        (``pair_halves``), in place: a MoE block's with ``HIDDEN_IN_EXPERT_LAUNCH``, a dense
        MLP's with ``PAIR_DENSE_SWIGLU``; like ``fold_norm_weights``, for a copy the caller
        owns."""
        if isinstance(self.mlp, SparseMoE) and moe_layer.HIDDEN_IN_EXPERT_LAUNCH:
            self.mlp.pair_halves()
        elif isinstance(self.mlp, MLP) and moe_layer.PAIR_DENSE_SWIGLU:
            self.mlp.pair_halves()


class MTPHead(nnx.Module):
    """Qwen3-Next's multi-token-prediction layer (see the module docstring); the embedding and
    LM head are the model's, so the head takes embeddings and returns normed hidden states."""

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.fc = nnx.Linear(
            2 * c.hidden_size, c.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
            rngs=rngs,
        )  # fmt: skip
        layer = DecoderLayer(c, LayerKind.FULL_ATTENTION, c.mtp_is_moe, rngs=rngs)
        self.layers = nnx.List([layer])
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def __call__(
        self,
        embeds: jax.Array,
        hidden: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        meta: ForwardMetadata,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """embeds: ``[T, hidden]`` embeddings of the next tokens ``t_{p+1}``; hidden: ``[T,
        hidden]`` the target's final-normed hidden states ``h_p`` (or the head's own output
        one position back, when drafting further); k_pages, v_pages: the head's
        ``[P, page_size, KVH, head_dim]`` cache. Returns the normed ``[T, hidden]`` (feed it
        to ``Qwen3Next.logits``) and the pages after the step."""
        x = jnp.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        layer = self.layers[0]
        out = run_block(layer.self_attn, layer.input_layernorm(x), k_pages, v_pages, meta)
        x = x + out.y
        x = x + run_block(layer.mlp, layer.post_attention_layernorm(x), meta.real_tokens)
        return self.norm(x), out.k_pages, out.v_pages


class Qwen3Next(HybridCausalLM):
    """The Qwen3-Next causal LM over packed tokens, every forward mode through ``meta``."""

    output_type = Qwen3NextOutput

    @property
    def counters_per_token(self) -> int:
        """The most a launch counts per token: a MoE block's (token, expert) pairs, a GDN
        decode kernel's key heads (its conv), a paged decode kernel's KV heads (its splits'
        merge), at least 1 (an output projection's launch)."""
        c = self.config
        experts = c.num_experts_per_tok if c.num_experts else 0
        return max(experts, c.linear_num_key_heads, c.num_key_value_heads, 1)

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs):
        c = config
        dtype = jnp.dtype(c.dtype)
        self.config = c
        self.embed_tokens = nnx.Embed(
            c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [
                DecoderLayer(c, kind, c.is_moe_layer(i), rngs=rngs)
                for i, kind in enumerate(c.layer_kinds)
            ]
        )
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        if not c.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                c.hidden_size, c.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                rngs=rngs,
            )  # fmt: skip
        # Built last, so that the other parameters draw the same initial values with or
        # without it.
        if c.num_nextn_predict_layers:
            self.mtp = MTPHead(c, rngs=rngs)

    @property
    def has_mtp(self) -> bool:
        """The model carries the multi-token-prediction head."""
        return self.config.num_nextn_predict_layers > 0

    def state_specs(self) -> tuple[LinearStateSpec, ...]:
        """The slot-pool layout: one spec per GDN layer, in layer order."""
        spec = self.config.gdn_config().state_spec()
        return tuple(spec for kind in self.layer_kinds if kind is LayerKind.GDN)

    def mtp_kv_specs(self) -> tuple[KVCacheSpec, ...]:
        """The MTP head's KV-cache layout: one spec (its attention layer), or none."""
        return (self.config.attention_config().kv_spec(),) if self.has_mtp else ()

    def mtp_hidden_states(
        self, next_tokens: jax.Array, hidden: jax.Array, kv: KVCache, meta: ForwardMetadata
    ) -> tuple[jax.Array, KVCache]:
        """The MTP head over packed positions: next_tokens int32 ``[T]`` (``t_{p+1}``), hidden
        ``[T, hidden]`` (``h_p``), kv the head's cache (``mtp_kv_specs``). Returns its normed
        hidden states ``[T, hidden]`` (``logits`` of them predict ``t_{p+2}``) and the cache."""
        if not self.has_mtp:
            raise ValueError(
                "this model has no multi-token-prediction head (num_nextn_predict_layers=0); "
                "load a checkpoint with mtp.* tensors or use another draft source"
            )
        if kv.num_layers != 1:
            raise ValueError(
                f"the MTP head has one attention layer but its KV cache has {kv.num_layers}; "
                f"build it from model.mtp_kv_specs()"
            )
        out, k, v = self.mtp(self.embed_tokens(next_tokens), hidden, kv.k[0], kv.v[0], meta)
        return out, dataclasses.replace(kv, k=k[None], v=v[None])

    def embed(self, tokens: jax.Array) -> jax.Array:
        """int32 ``[T]`` -> ``[T, hidden]``."""
        return self.embed_tokens(tokens)

    def final_norm(self, x: jax.Array | SummedRows) -> jax.Array:
        """``[T, hidden]`` -> the same (of ``SummedRows``, their square sums read, not
        reduced again); the module keeps its checkpoint name (``model.norm``)."""
        return self.norm(x)

    def logits(self, hidden: jax.Array, dtype: DTypeLike | None = jnp.float32) -> jax.Array:
        """``[T, vocab]`` logits of final hidden states ``[T, hidden]`` in ``dtype`` (None:
        the LM head's product as it is, in the weights' dtype)."""
        if self.config.tie_word_embeddings:
            return as_logits(self.embed_tokens.attend(hidden), dtype)
        return as_logits(self.lm_head(hidden), dtype)


def _seeded_value(path: tuple, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """One parameter of the built-in model: matrices ~ N(0, 1/fan_in), norm weights near
    their identity, GDN decay and time-step bias in their usual ranges."""
    name = path[-1]
    if name == "A_log":
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name == "dt_bias":
        return rng.uniform(0.5, 1.5, shape)
    if name == "conv_weight":
        bound = shape[-1] ** -0.5
        return rng.uniform(-bound, bound, shape)
    if len(shape) == 1:  # norm weights: zero-centred ones around 0, GDN's gated one around 1
        centre = 1.0 if path[-3:-1] == ("linear_attn", "norm") else 0.0
        return centre + 0.1 * rng.standard_normal(shape)
    fan_in = shape[-1] if name == "embedding" else shape[-2]
    return rng.standard_normal(shape) * fan_in**-0.5


def seed_weights(model: nnx.Module, rng_for: Callable[[tuple], np.random.Generator]) -> None:
    """Fills ``model``'s parameters (abstract shapes will do) with numpy draws in the built-in
    model's ranges, each tensor from ``rng_for(its path)``, in the order of the checkpoint's
    tensors' paths: a GDN layer's ``gate_params`` is drawn as its rows ``A_log`` and
    ``dt_bias`` in their own places, so a seed's weights follow the checkpoint's tensors, not
    how a layer stores them."""
    draws = []
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "gate_params":
            draws += [((*path[:-1], "A_log"), param, 0), ((*path[:-1], "dt_bias"), param, 1)]
        else:
            draws.append((path, param, None))
    draws.sort(key=lambda draw: [(isinstance(key, str), key) for key in draw[0]])
    stacked: dict[int, tuple[nnx.Variable, list]] = {}
    for path, param, row in draws:
        abstract = param.get_value()
        if row is None:
            value = _seeded_value(path, abstract.shape, rng_for(path))
            param.set_value(jnp.asarray(value, abstract.dtype))
        else:
            rows = stacked.setdefault(id(param), (param, [None, None]))[1]
            rows[row] = _seeded_value(path, abstract.shape[1:], rng_for(path))
    for param, rows in stacked.values():
        param.set_value(jnp.asarray(np.stack(rows), param.get_value().dtype))


def tiny_qwen3_next(seed: int = 0, dtype: str = "float32") -> Qwen3Next:
    """The built-in model with seeded random weights (pair it with ``ByteTokenizer``).

    Weights come from numpy's generator seeded with ``seed``, filled into the model's
    abstract shapes: no per-parameter device random calls, so it builds in milliseconds.
    """
    model = nnx.eval_shape(lambda: Qwen3Next(tiny_qwen3_next_config(dtype), rngs=nnx.Rngs(0)))
    # The MTP head draws from its own stream, so the other weights of a seed are the same as
    # they were before the preset had the head.
    streams = {"model": np.random.default_rng(seed), "mtp": np.random.default_rng([seed, 1])}
    seed_weights(model, lambda path: streams["mtp" if path[0] == "mtp" else "model"])
    return model
