"""What the hybrid decoders (``qwen3_next``, ``nemotron_h``) share: handing the slot pool and
the paged KV cache to their layers, and the forward the step functions and the engine call on
either (``hf_config`` reads their Hugging Face ``config.json``).

A linear layer (GDN or Mamba2) owns the pool entry, and a full-attention layer the cache
entry, at its position among layers of its kind; ``LayerStates`` keeps that count, so a model's
layer loop only says which mixer a layer has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
from flax import nnx

from hybrid_jax.backend import VerifyStates
from hybrid_jax.kv_cache import KVCache, KVCacheSpec
from hybrid_jax.layers.attention import GatedAttention
from hybrid_jax.layers.gdn import GatedDeltaNet
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.models.nemotron_h_blocks import PlainAttention
from hybrid_jax.modes import LayerKind
from hybrid_jax.state_pool import LinearStateSpec, StatePool

__all__ = ["DecoderOutput", "HybridCausalLM", "LayerStates"]


class LayerStates:
    """The slot pool and KV cache of one forward, handed to the layers in order.

    Built once per forward (it checks the layout), called once per stateful layer, read once
    at the end with ``updated``: Python bookkeeping that runs while the forward is traced.
    """

    def __init__(
        self,
        pool: StatePool,
        kv: KVCache,
        *,
        state_specs: Sequence[LinearStateSpec],
        kv_specs: Sequence[KVCacheSpec],
        linear_name: str,
    ):
        """``state_specs``/``kv_specs``: the model's layout; ``linear_name`` names its linear
        layers in the error for a pool or cache of another layout."""
        if len(pool.ssm) != len(state_specs) or len(kv.k) != len(kv_specs):
            raise ValueError(
                f"the pool has {len(pool.ssm)} {linear_name} layers and the KV cache "
                f"{len(kv.k)} attention layers, but the model has {len(state_specs)} "
                f"and {len(kv_specs)}; build them from model.state_specs() and "
                f"model.kv_specs()"
            )
        self._pool, self._kv = pool, kv
        self._conv, self._ssm = list(pool.conv), list(pool.ssm)
        self._keys, self._values = list(kv.k), list(kv.v)
        self._verify: list[VerifyStates] = []
        self._linear = self._attention = 0

    def linear(
        self,
        mixer: GatedDeltaNet | Mamba2Mixer,
        h: jax.Array,
        meta: ForwardMetadata,
        *,
        impl: str,
    ) -> jax.Array:
        """The next linear layer's mixer on normed ``h`` ``[T, hidden]`` and its pool entry;
        returns its output ``[T, hidden]`` and keeps its new states (and verify states)."""
        i, self._linear = self._linear, self._linear + 1
        out = mixer(h, self._conv[i], self._ssm[i], meta, impl=impl)
        self._conv[i], self._ssm[i] = out.conv_state, out.ssm_state
        if out.verify:
            self._verify.append(out.verify)
        return out.y

    def attention(
        self, mixer: GatedAttention | PlainAttention, h: jax.Array, meta: ForwardMetadata
    ) -> jax.Array:
        """The next full-attention layer's mixer on normed ``h`` ``[T, hidden]`` and its cache
        pages; returns its output ``[T, hidden]`` and keeps its new pages."""
        i, self._attention = self._attention, self._attention + 1
        out = mixer(h, self._keys[i], self._values[i], meta)
        self._keys[i], self._values[i] = out.k_pages, out.v_pages
        return out.y

    def updated(self) -> tuple[StatePool, KVCache, tuple[VerifyStates, ...]]:
        """The pool and cache after every layer, and the linear layers' verify states in layer
        order (empty outside TARGET_VERIFY)."""
        pool = dataclasses.replace(self._pool, conv=tuple(self._conv), ssm=tuple(self._ssm))
        kv = dataclasses.replace(self._kv, k=tuple(self._keys), v=tuple(self._values))
        return pool, kv, tuple(self._verify)


class DecoderOutput(NamedTuple):
    """logits: float32 ``[T, vocab]`` (rows at padded tokens mean nothing); the pool and KV
    cache after the step; per-linear-layer verify states (TARGET_VERIFY, for
    ``backend.commit_verified``) or an empty tuple."""

    logits: jax.Array
    pool: StatePool
    kv: KVCache
    verify: tuple[VerifyStates, ...]


class HybridCausalLM(nnx.Module):
    """The forward the step functions and the engine call on a hybrid causal LM, alike for
    every model: embed, run the layers in order over the pool and cache, final norm, logits.

    A subclass builds ``config`` (with ``layer_kinds`` and ``attention_config()``), ``layers``
    (each called as ``layer(x, states, meta, impl=impl) -> x``: the layer says which mixer
    it runs and which residual branches follow) and gives ``state_specs``, ``logits``,
    ``embed``, ``final_norm``, ``linear_name`` (its linear layers in errors) and
    ``output_type``.
    """

    linear_name: str = "linear"
    output_type: type[DecoderOutput] = DecoderOutput

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return self.config.layer_kinds

    def kv_specs(self) -> tuple[KVCacheSpec, ...]:
        """The KV-cache layout: one spec per full-attention layer, in layer order."""
        spec = self.config.attention_config().kv_spec()
        return tuple(spec for kind in self.layer_kinds if kind is LayerKind.FULL_ATTENTION)

    def hidden_states(
        self,
        tokens: jax.Array,
        pool: StatePool,
        kv: KVCache,
        meta: ForwardMetadata,
        *,
        impl: str = "auto",
    ) -> tuple[jax.Array, StatePool, KVCache, tuple[VerifyStates, ...]]:
        """The final-normed hidden states ``[T, hidden]`` and the updated pool and cache."""
        states = LayerStates(
            pool, kv, state_specs=self.state_specs(), kv_specs=self.kv_specs(),
            linear_name=self.linear_name,
        )  # fmt: skip
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, states, meta, impl=impl)
        pool, kv, verify = states.updated()
        return self.final_norm(x), pool, kv, verify

    def __call__(
        self,
        tokens: jax.Array,
        pool: StatePool,
        kv: KVCache,
        meta: ForwardMetadata,
        *,
        impl: str = "auto",
    ) -> DecoderOutput:
        """tokens: int32 ``[T]`` packed as ``meta`` lays them out (any id at padding);
        pool: the linear layers' slot pool; kv: the attention layers' paged cache."""
        hidden, pool, kv, verify = self.hidden_states(tokens, pool, kv, meta, impl=impl)
        return self.output_type(self.logits(hidden), pool, kv, verify)
