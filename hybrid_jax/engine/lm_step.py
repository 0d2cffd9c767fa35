"""What the engine needs of a model, and the model in the shape of one serving step.

``HybridLM`` is the protocol every hybrid causal LM here meets (``models.decoder``'s
``HybridCausalLM`` and its subclasses): the engine is typed against it, not against one model.
``LastTokenLogits`` wraps one into the step that ``StepFunctions`` compiles, over a
``ServingState`` (pool, KV cache, each slot's last token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from hybrid_jax.backend.linear import VerifyStates
from hybrid_jax.engine.sampling import greedy_tokens
from hybrid_jax.engine.scheduler import PENDING
from hybrid_jax.kv_cache import KVCache, KVCacheSpec
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import ForwardMode, LayerKind
from hybrid_jax.parallel import replicated
from hybrid_jax.state_pool import LinearStateSpec, StatePool

__all__ = ["HybridLM", "HybridLMConfig", "LastTokenLogits", "ServingState", "StepOutput"]


class HybridLMConfig(Protocol):
    """The configuration fields the engine reads."""

    vocab_size: int
    eos_token_id: tuple[int, ...]
    max_position_embeddings: int
    dtype: str  # of the weights, the activations and the LM head's product


class HybridLM(Protocol):
    """A hybrid causal LM as the engine drives it: its layer kinds, the layouts of its pool and
    KV cache, the final-normed hidden states of a step and the logits of hidden states."""

    config: HybridLMConfig

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]: ...

    def state_specs(self) -> Sequence[LinearStateSpec]: ...

    def kv_specs(self) -> Sequence[KVCacheSpec]: ...

    def hidden_states(
        self, tokens: jax.Array, pool: StatePool, kv: KVCache, meta: ForwardMetadata, *,
        impl: str = "auto",
    ) -> tuple[jax.Array, StatePool, KVCache, tuple[VerifyStates, ...]]: ...  # fmt: skip

    def logits(self, hidden: jax.Array, dtype: DTypeLike | None = jnp.float32) -> jax.Array: ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ServingState:
    """Everything a step updates in place: the GDN slot pool, the attention KV cache, and
    ``last_tokens`` int32 ``[num_slots]``, each slot's last sampled token (slot 0: padding)."""

    pool: StatePool
    kv: KVCache
    last_tokens: jax.Array


class StepOutput(NamedTuple):
    """logits: ``[bs, vocab]`` at each row's last token, or ``[bs, D, vocab]`` at every token
    for TARGET_VERIFY (padded rows: garbage), in the model's dtype (the LM head's product,
    ``decoder.as_logits``; their readers widen them to float32); verify: the per-layer verify
    states of TARGET_VERIFY (else empty); hidden: the final-normed hidden states ``[T,
    hidden]`` of every token when the step keeps them (for the MTP head), else empty;
    greedy: what ``Sampler`` returns for these logits when every row is greedy (tokens and
    log-probabilities ``[bs]``, ``sampling.greedy_tokens``), those tokens already in
    ``state.last_tokens`` (empty for TARGET_VERIFY, whose acceptance draws its tokens)."""

    logits: jax.Array
    state: ServingState
    verify: tuple = ()
    hidden: jax.Array | tuple = ()
    greedy: tuple = ()


class LastTokenLogits(nnx.Module):
    """A ``HybridLM`` in the shape ``StepFunctions`` drives: ``(x, state, meta) -> output``.

    Only each row's last token reaches the LM head, so a prefill step computes ``[bs, vocab]``
    logits, not ``[T, vocab]`` (TARGET_VERIFY needs them at all D tokens of every row).
    Tokens arrive as int32 ``[T]`` (``compile_all(token_shape=())``); a token ``PENDING`` is
    read from ``state.last_tokens`` at its row's slot. With ``keep_hidden`` the step also
    returns the hidden states of every token (the MTP head's input).
    """

    def __init__(self, model: HybridLM, keep_hidden: bool = False):
        self.model = model
        self.keep_hidden = keep_hidden

    @property
    def layer_kinds(self):
        return self.model.layer_kinds

    def __call__(
        self, x: jax.Array, state: ServingState, meta: ForwardMetadata, *, impl: str = "auto"
    ) -> StepOutput:
        slots = jnp.take(meta.state_indices, meta.token_rows, mode="clip")
        tokens = jnp.where(x == PENDING, state.last_tokens[slots], x)
        hidden, pool, kv, verify = self.model.hidden_states(
            tokens, state.pool, state.kv, meta, impl=impl
        )
        kept = hidden if self.keep_hidden else ()
        # Under tensor parallelism the sampler reads the logits whole on every GPU.
        last_tokens = replicated(state.last_tokens)
        if meta.mode is ForwardMode.TARGET_VERIFY:
            logits = self.model.logits(hidden, dtype=None)
            logits = logits.reshape(meta.batch_size, meta.num_draft_tokens, -1)
            return StepOutput(replicated(logits), ServingState(pool, kv, last_tokens), verify, kept)
        # A padded row repeats the previous boundary; clipping keeps its index in range.
        last = jnp.clip(meta.query_start_loc[1:] - 1, 0, hidden.shape[0] - 1)
        logits = replicated(self.model.logits(hidden[last], dtype=None))
        # Every row's argmax costs one pass over the logits here, and saves a batch of
        # greedy rows the sampler's own executable and its launch.
        tokens, logprobs, last_tokens = greedy_tokens(logits, last_tokens, meta.state_indices)
        state = ServingState(pool, kv, last_tokens)
        return StepOutput(logits, state, hidden=kept, greedy=(tokens, logprobs))
