"""What the hybrid decoders (``qwen3_next``, ``nemotron_h``) share: handing the slot pool and
the paged KV cache to their layers, and the forward the step functions and the engine call on
either (``hf_config`` reads their Hugging Face ``config.json``).

A linear layer (GDN or Mamba2) owns the pool entry, and a full-attention layer the cache
entry, at its position among layers of its kind; ``LayerStates`` keeps that count, so a model's
layer loop only says which mixer a layer has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from hybrid_jax.backend import VerifyStack, VerifyStates
from hybrid_jax.kv_cache import KVCache, KVCacheSpec
from hybrid_jax.layers.attention import Attention
from hybrid_jax.layers.gdn import GatedDeltaNet
from hybrid_jax.layers.mamba2 import Mamba2Mixer
from hybrid_jax.layers.norm import SummedRows
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind
from hybrid_jax.parallel import run_block, tp_size
from hybrid_jax.state_pool import StatePool

__all__ = ["DecoderOutput", "HybridCausalLM", "LayerStates", "as_logits"]


def as_logits(product: jax.Array, dtype: DTypeLike | None) -> jax.Array:
    """The LM head's ``product`` as logits in ``dtype``, or as it is where ``dtype`` is None:
    a serving step keeps a 16-bit product's dtype, since a float32 copy of ``[B, vocab]``
    logits costs a write of twice the product's bytes every step and holds the same values."""
    return product if dtype is None else product.astype(dtype)


@jax.tree_util.register_pytree_node_class
class _RepeatMetadata:
    """One repeat's linear layers' pool slots ``[n_linear, bs]`` and attention layers' page
    tables ``[n_attention, bs, max_pages]``, each shifted to its layer's rows of the flat
    pool and cache (``ForwardMetadata.at_linear_layer`` / ``at_attention_layer``); stacked on a
    leading ``repeats`` axis before a scan (``_every_repeat``), one repeat's inside it, handed
    out in layer order."""

    def __init__(self, slots: jax.Array | None, tables: jax.Array | None):
        self.slots, self.tables = slots, tables
        self._linear = self._attention = 0

    def tree_flatten(self):
        return (self.slots, self.tables), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    def next_slots(self) -> jax.Array:
        self._linear += 1
        return self.slots[self._linear - 1]

    def next_table(self) -> jax.Array:
        self._attention += 1
        return self.tables[self._attention - 1]

    def check_used(self, linear: int, attention: int) -> None:
        """Raises unless the repeat's block ran exactly its ``linear`` and ``attention``
        layers (a count the caller gave wrong would shift every later layer)."""
        if (self._linear, self._attention) != (linear, attention):
            raise ValueError(
                f"a repeat ran {self._linear} linear and {self._attention} attention layers; "
                f"the scan was told {linear} and {attention}"
            )


def _every_repeat(
    repeats: int, first: jax.Array | int, per_repeat: int, shifted: Callable[[jax.Array], jax.Array]
) -> jax.Array | None:
    """``shifted(i)`` for each of ``repeats * per_repeat`` layers of one kind from layer
    ``first`` on, stacked ``[repeats, per_repeat, ...]``; None when a repeat has none."""
    if not per_repeat:
        return None
    layers = first + jnp.arange(repeats * per_repeat, dtype=jnp.int32)
    out = jax.vmap(shifted)(layers)
    return out.reshape(repeats, per_repeat, *out.shape[1:])


class LayerStates:
    """The slot pool and KV cache of one forward, handed to the layers in order.

    Built once per forward (it checks the layout), called once per stateful layer, read once
    at the end with ``updated``: Python bookkeeping that runs while the forward is traced.
    Each layer reads the flat ``[L*S, ...]`` pool and ``[L*P, ...]`` cache through metadata
    shifted to its rows (``ForwardMetadata.at_linear_layer`` / ``at_attention_layer``), so a
    layer's index may be traced: ``scan`` runs a block of layers over stacked weights with
    the whole pool and cache as its carry.
    """

    def __init__(
        self,
        pool: StatePool,
        kv: KVCache | None,
        *,
        num_linear: int,
        num_attention: int,
        linear_name: str,
        counters: int = 0,
        real_tokens: jax.Array | None = None,
    ):
        """``num_linear``/``num_attention``: the model's stateful layers; ``linear_name``
        names its linear layers in the error for a pool or cache of another layout. ``kv`` is
        None for a model without attention layers. ``counters``: how many int32 zeros
        ``self.counters`` holds (none: no buffer). ``real_tokens``: the forward's
        ``ForwardMetadata.real_tokens``, for ``self.real_flags``."""
        kv_layers = 0 if kv is None else kv.num_layers
        if pool.num_layers != num_linear or kv_layers != num_attention:
            raise ValueError(
                f"the pool has {pool.num_layers} {linear_name} layers and the KV cache "
                f"{kv_layers} attention layers, but the model has {num_linear} and "
                f"{num_attention}; build them from model.state_specs() and model.kv_specs()"
            )
        self._pool, self._kv = pool, kv
        pages = () if kv is None else (kv.k, kv.v)
        self._arrays = tuple(a.reshape(-1, *a.shape[2:]) for a in (pool.conv, pool.ssm, *pages))
        self._verify: list[tuple[jax.Array | int, VerifyStates]] = []
        self._stacks: list[VerifyStack] = []
        self._linear: jax.Array | int = 0
        self._attention: jax.Array | int = 0
        self._repeat: _RepeatMetadata | None = None
        self.counters: jax.Ref | None = None
        """int32 zeros shared by the forward's launches that count their programs' progress
        in GMEM and leave the counts at zero (``moe.expert_mlp``,
        ``projections.projection_add``; one launch runs after another, so each may count in
        any of them): made once here, before any scan, which then carries it, so no launch
        zero-fills a buffer of its own."""
        if counters:
            self.counters = jax.new_ref(jnp.zeros((counters,), jnp.int32))
        self.real_flags: jax.Array | None = None
        """int32 ``[T]``, 1 at the tokens of real rows, 0 at padding, for the blocks whose
        launches read them as int32 (a MoE block's ranked router launch): made once here,
        before any scan, where a conversion inside a scan's body would be a launch of its
        own every repeat (XLA does not hoist it)."""
        if real_tokens is not None:
            self.real_flags = real_tokens.astype(jnp.int32)

    def linear(
        self,
        mixer: GatedDeltaNet | Mamba2Mixer,
        h: jax.Array,
        meta: ForwardMetadata,
        *,
        impl: str,
        residual: jax.Array | None = None,
    ) -> jax.Array | SummedRows:
        """The next linear layer's mixer on normed ``h`` ``[T, hidden]`` and its pool rows;
        returns its output ``[T, hidden]`` and keeps its new states (and verify states). With
        ``residual`` it returns ``residual`` plus the output: on one GPU the mixer adds it
        itself (a mixer that takes ``residual`` and ``counters``, as GDN's does), maybe giving
        the new rows' square sums too (``SummedRows``)."""
        i, self._linear = self._linear, self._linear + 1
        conv, ssm, *pages = self._arrays
        if self._repeat is None:
            meta = meta.at_linear_layer(i, self._pool.num_slots)
        else:  # in a scan: this repeat's slots, shifted before the scan
            meta = dataclasses.replace(meta, state_indices=self._repeat.next_slots())
        adding = self._adding(residual)
        out = run_block(mixer, h, conv, ssm, meta, impl=impl, **adding)
        self._arrays = (out.conv_state, out.ssm_state, *pages)
        if out.verify:
            self._verify.append((i, out.verify))
        return out.y if adding or residual is None else residual + out.y

    def attention(
        self,
        mixer: Attention,
        h: jax.Array,
        meta: ForwardMetadata,
        *,
        impl: str,
        residual: jax.Array | None = None,
    ) -> jax.Array | SummedRows:
        """The next full-attention layer's mixer on normed ``h`` ``[T, hidden]`` and its cache
        pages; returns its output ``[T, hidden]`` and keeps its new pages. ``residual``: as
        ``linear``'s."""
        i, self._attention = self._attention, self._attention + 1
        conv, ssm, k, v = self._arrays
        if self._repeat is None:
            meta = meta.at_attention_layer(i, self._kv.num_pages)
        else:  # in a scan: this repeat's page table, shifted before the scan
            table = self._repeat.next_table()
            meta = dataclasses.replace(meta, pages=dataclasses.replace(meta.pages, table=table))
        adding = self._adding(residual)
        out = run_block(mixer, h, k, v, meta, impl=impl, **adding)
        self._arrays = (conv, ssm, out.k_pages, out.v_pages)
        return out.y if adding or residual is None else residual + out.y

    def _adding(self, residual: jax.Array | None) -> dict[str, Any]:
        """The mixer's arguments that have it add its output to ``residual`` itself: none
        without one, or under tensor parallelism (each GPU's output is a partial sum)."""
        if residual is None or tp_size() > 1:
            return {}
        return dict(residual=residual, counters=self.counters)

    def _stack_verify(self) -> None:
        for i, states in self._verify:  # outside a scan: static indices, one layer each
            self._stacks.append(VerifyStack(states.windows[None], states.ssm[None], (i,)))
        self._verify = []

    def scan(
        self,
        block: Callable[[Any, Any], Any],
        x: Any,
        weights: Any,
        meta: ForwardMetadata,
        *,
        repeats: int,
        linear_per_repeat: int,
        attention_per_repeat: int,
        unroll: bool = False,
    ) -> Any:
        """``x = block(x, weights[r])`` for r in ``range(repeats)`` under ``lax.scan``, the
        pool and cache carried (``x`` the rows, or a pytree of arrays such as ``SummedRows``);
        ``weights``: a pytree of arrays stacked on a leading ``repeats`` axis. Each repeat
        runs ``linear_per_repeat`` linear and ``attention_per_repeat`` attention layers (in
        that count, any order), on ``meta`` shifted to their pool rows and cache pages before
        the scan (``_RepeatMetadata``): the loop body holds no index arithmetic of its own.
        ``unroll``: the repeats unrolled, no loop (``lax.scan(unroll=True)``)."""
        self._stack_verify()
        linear0, attention0 = self._linear, self._attention
        shifted = _RepeatMetadata(
            _every_repeat(
                repeats, linear0, linear_per_repeat,
                lambda i: meta.at_linear_layer(i, self._pool.num_slots).state_indices,
            ),
            _every_repeat(
                repeats, attention0, attention_per_repeat,
                lambda i: meta.at_attention_layer(i, self._kv.num_pages).pages.table,
            ),
        )  # fmt: skip

        def step(carry, xs):
            x, self._arrays = carry
            r, w, self._repeat = xs
            self._linear = linear0 + r * linear_per_repeat
            self._attention = attention0 + r * attention_per_repeat
            x = block(x, w)
            self._repeat.check_used(linear_per_repeat, attention_per_repeat)
            self._repeat = None
            verify, self._verify = [states for _, states in self._verify], []
            return (x, self._arrays), verify

        (x, self._arrays), verify = jax.lax.scan(
            step,
            (x, self._arrays),
            (jnp.arange(repeats, dtype=jnp.int32), weights, shifted),
            unroll=unroll,
        )
        self._linear = linear0 + repeats * linear_per_repeat
        self._attention = attention0 + repeats * attention_per_repeat
        for q, states in enumerate(verify):  # [repeats, bs, D, ...] per linear position
            layers = tuple(linear0 + r * linear_per_repeat + q for r in range(repeats))
            self._stacks.append(VerifyStack(states.windows, states.ssm, layers))
        return x

    def updated(self) -> tuple[StatePool, KVCache | None, tuple[VerifyStack, ...]]:
        """The pool and cache after every layer, and the linear layers' verify states
        (empty outside TARGET_VERIFY)."""
        self._stack_verify()
        conv, ssm, *pages = self._arrays
        pool = dataclasses.replace(
            self._pool, conv=conv.reshape(self._pool.conv.shape),
            ssm=ssm.reshape(self._pool.ssm.shape),
        )  # fmt: skip
        kv = self._kv
        if kv is not None:
            k, v = pages
            kv = dataclasses.replace(kv, k=k.reshape(kv.k.shape), v=v.reshape(kv.v.shape))
        return pool, kv, tuple(self._stacks)


class DecoderOutput(NamedTuple):
    """logits: float32 ``[T, vocab]`` (rows at padded tokens mean nothing); the pool and KV
    cache after the step; per-linear-layer verify states (TARGET_VERIFY, for
    ``backend.commit_verified``) or an empty tuple."""

    logits: jax.Array
    pool: StatePool
    kv: KVCache
    verify: tuple[VerifyStack, ...]


class HybridCausalLM(nnx.Module):
    """The forward the step functions and the engine call on a hybrid causal LM, alike for
    every model: embed, run the layers in order over the pool and cache, final norm, logits.

    A subclass builds ``config`` (with ``layer_kinds`` and ``attention_config()``), ``layers``
    (each called as ``layer(x, states, meta, impl=impl) -> x``: the layer says which mixer
    it runs and which residual branches follow; ``x`` may come as ``SummedRows``, the rows
    with their square sums, from the layer before) and gives ``state_specs``, ``logits``,
    ``embed``, ``final_norm`` (of what the last layer gives), ``linear_name`` (its linear
    layers in errors) and ``output_type``.
    """

    linear_name: str = "linear"
    output_type: type[DecoderOutput] = DecoderOutput
    counters_per_token: int = 0
    """How many of ``LayerStates.counters`` each token needs (a MoE block's choices; 1 for
    a model whose launches count in them at all)."""

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The kinds of the stateful layers (their mixers), in order."""
        return self.config.layer_kinds

    @property
    def block_kinds(self) -> tuple[LayerKind | None, ...]:
        """Per entry of ``layers``, the kind of state it keeps, None for a block that keeps
        none (``models.layer_scan`` counts each repeated block's stateful layers with it)."""
        return self.config.block_kinds

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
    ) -> tuple[jax.Array, StatePool, KVCache, tuple[VerifyStack, ...]]:
        """The final-normed hidden states ``[T, hidden]`` and the updated pool and cache."""
        states = LayerStates(
            pool, kv, num_linear=len(self.state_specs()), num_attention=len(self.kv_specs()),
            linear_name=self.linear_name,
            counters=tokens.shape[0] * self.counters_per_token, real_tokens=meta.real_tokens,
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
