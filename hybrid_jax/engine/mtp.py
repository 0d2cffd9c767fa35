"""Drafts from Qwen3-Next's multi-token-prediction head: its compiled steps and their chaining.

Positions. The head's entry at position p reads the target's hidden state ``h_p`` and the
token ``t_{p+1}``; its logits there guess ``t_{p+2}``. So once the target has folded the
positions below n and sampled the root ``t_n``, the head can fill its cache up to n-1, and its
output there is the first draft (for ``t_{n+1}``). Each further draft is one DECODE step of the
head at the next position, reading the head's own previous output in place of the target's
hidden state and the previous draft as the token. A row gets D-1 drafts: the extend's, then
D-2 DECODE steps.

* After an EXTEND step of the target (a prompt chunk, or a whole prompt), the head runs EXTEND
  on the same metadata with each token replaced by the one after it: a chunk's last position
  reads the next prompt token, or the sampled token when the chunk ends the prompt (that row
  drafts; an earlier chunk only fills the cache).
* After a TARGET_VERIFY step that accepted ``a`` drafts of a row starting at position n, the
  head runs DRAFT_EXTEND over positions n..n+a (a+1 <= D tokens) with the verify's hidden
  states there and, as next tokens, the row's emitted tokens (the accepted drafts, then the
  bonus). That overwrites what the previous draft steps wrote at those positions from guesses.

Tree drafts (``SpeculativeConfig(tree=True)``): the head drafts along the tree's spine (the
nodes with children, one root path; ``speculative.tree_spine``). Its first step's output is
the root's candidates, each DECODE step's the next spine node's: a node takes the head's
``candidate_ranks``-th best guess at its parent (0, the argmax, for the spine child), so the
head runs one step per spine node, as many as a chain of that depth. After a tree verify,
DRAFT_EXTEND runs over the accepted path, whose positions ``commit_tree_verified`` made
contiguous: its tokens are the emitted ones and its hidden states those of the path's nodes
(``MTPInput.hidden_source``). A chain is the tree whose spine is every node but the last.

The head's cache needs no rollback: like the target's attention layers, an entry past the
accepted context is rewritten before any query reads it (every step writes before it attends,
and the next one starts where the accepted context ends). It lives in its own ``KVCache`` of
one layer, on the same page numbers as the target's cache: a request's pages hold its positions
for both, so page bookkeeping is the scheduler's as before.

Every step of the head is a (mode, bucket) executable compiled ahead of time (EXTEND on token
buckets, DRAFT_EXTEND and DECODE on batch buckets). A step reads its inputs through index
arrays (``MTPInput.source``) from the arrays the previous step left on the device, so a chain
is dispatched without host round trips; the drafts are read back once at its end. The chain
keeps the batch bucket of the target step it follows, so every input shape is a compiled one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.engine.scheduler import Request, ScheduledStep
from hybrid_jax.engine.speculative import SpeculativeConfigError, candidate_ranks, tree_spine
from hybrid_jax.engine.startup import ProgramStore
from hybrid_jax.engine.step import CompileRecord, StepFunctions
from hybrid_jax.kv_cache import KVCache, init_kv_cache
from hybrid_jax.metadata import (
    BucketPolicy,
    ForwardMetadata,
    RowSpec,
    build_metadata,
    chain_parents,
    example_metadata,
    tree_depths,
)
from hybrid_jax.modes import EngineRole, ForwardMode, LayerKind, modes_for
from hybrid_jax.parallel import shard_kv_cache

__all__ = ["MTP_MODES", "MTPDrafter", "MTPInput", "MTPOutput"]

MTP_MODES = modes_for(EngineRole.DRAFTING)
"""The modes the head runs in (compiled for every bucket of each)."""


class MTPInput(NamedTuple):
    """One step's inputs, T = the bucket's tokens: token i of the step is
    ``tokens[source[i]]`` (int32, ``t_{p+1}``) with hidden state ``hidden[hidden_source[i]]``
    (``[T, hidden]``, ``h_p``); ``source`` and ``hidden_source`` int32 ``[T]`` (they differ
    after a tree verify, whose accepted nodes are not the first ones of their row)."""

    tokens: jax.Array
    hidden: jax.Array
    source: jax.Array
    hidden_source: jax.Array


class MTPOutput(NamedTuple):
    """drafts: int32 ``[bs]``, the head's argmax at each row's last token; candidates: int32
    ``[bs, W]``, its W best guesses there, best first (``drafts`` is the first); hidden:
    ``[bs, hidden]``, its normed output there (the next DECODE step's hidden input); the
    cache."""

    drafts: jax.Array
    candidates: jax.Array
    hidden: jax.Array
    kv: KVCache


class _HeadStep(nnx.Module):
    """The head in the shape ``StepFunctions`` drives: ``(MTPInput, kv, meta) -> MTPOutput``;
    ``width``: the guesses kept per row (W)."""

    def __init__(self, model: nnx.Module, width: int = 1):
        self.model = model
        self.width = width

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return (LayerKind.FULL_ATTENTION,)

    def __call__(
        self, x: MTPInput, kv: KVCache, meta: ForwardMetadata, *, impl: str = "auto"
    ) -> MTPOutput:
        tokens, hidden_in = x.tokens[x.source], x.hidden[x.hidden_source]
        hidden, kv = self.model.mtp_hidden_states(tokens, hidden_in, kv, meta)
        # A padded row repeats the previous boundary; clipping keeps its index in range.
        last = jnp.clip(meta.query_start_loc[1:] - 1, 0, hidden.shape[0] - 1)
        out = hidden[last]
        logits = self.model.logits(out)
        drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if self.width == 1:
            return MTPOutput(drafts, drafts[:, None], out, kv)
        # top_k puts the lower index first among equal values, as argmax does: its first
        # column is ``drafts``.
        candidates = jax.lax.top_k(logits, self.width)[1].astype(jnp.int32)
        return MTPOutput(drafts, candidates, out, kv)


def _live(request: Request) -> bool:
    """The request will be verified again (not finished, aborted or out of budget)."""
    return request.finish_reason is None and not request.scheduled_out


class MTPDrafter:
    """The head's compiled steps, its KV cache, and the drafts it proposed per request.

    ``model`` must carry the head (``Qwen3Next.has_mtp``). ``parents``: the verify rows'
    topology (default: the chain of ``policy.num_draft_tokens`` nodes). ``after_extend`` /
    ``after_verify`` run a chain after the target's step was read back; ``propose`` hands a
    request's drafts (the D-1 nodes after the root, in node order) to the scheduler.
    ``steps.trace_count`` counts traces (none after ``compile``).
    """

    def __init__(
        self,
        model: nnx.Module,
        policy: BucketPolicy,
        *,
        num_slots: int,
        num_pages: int,
        parents: tuple[int, ...] | None = None,
        impl: str = "auto",
        store: ProgramStore | None = None,
        mesh: Mesh | None = None,
    ):
        """``mesh``: the devices of tensor parallelism, ``model``'s weights already placed on
        it; the head's KV cache is cut by KV head as the target's is."""
        if not getattr(model, "has_mtp", False):
            raise SpeculativeConfigError(
                f"source='mtp' needs a model with the multi-token-prediction head, and this "
                f"{type(model).__name__} has none (a checkpoint without mtp.* tensors, or "
                f"num_nextn_predict_layers=0); use source='ngram'"
            )
        self.policy = policy
        self.parents = chain_parents(policy.num_draft_tokens) if parents is None else parents
        if len(self.parents) != policy.num_draft_tokens:
            raise SpeculativeConfigError(
                f"parents={self.parents!r} has {len(self.parents)} nodes, but the bucket policy "
                f"verifies D={policy.num_draft_tokens} tokens per row"
            )
        # Head steps per chain (one per spine node); where each node's token comes from.
        self.num_head_steps = len(tree_spine(self.parents))
        depths = tree_depths(self.parents)
        self._level = [depths[p] for p in self.parents[1:]]
        self._rank = list(candidate_ranks(self.parents)[1:])
        width = max(self._rank) + 1
        self.num_slots, self.num_pages = num_slots, num_pages
        self.hidden_size = model.config.hidden_size
        self.dtype = jnp.dtype(model.config.dtype)
        self.steps = StepFunctions(_HeadStep(model, width), impl=impl, store=store, mesh=mesh)
        self.kv = init_kv_cache(model.mtp_kv_specs(), num_pages, policy.page_size)
        if mesh is not None:
            self.kv = shard_kv_cache(self.kv, mesh)
        self.drafts: dict[int, tuple[int, ...]] = {}
        self.compile_records: list[CompileRecord] = []

    def num_executables(self) -> int:
        return sum(len(self.policy.buckets(mode)) for mode in MTP_MODES)

    def _inputs(self, num_tokens: int) -> MTPInput:
        spec = jax.ShapeDtypeStruct
        return MTPInput(
            spec((num_tokens,), jnp.int32),
            spec((num_tokens, self.hidden_size), self.dtype),
            spec((num_tokens,), jnp.int32),
            spec((num_tokens,), jnp.int32),
        )

    def compile(self, progress: Callable[[CompileRecord], None] | None = None) -> None:
        """Compiles every (mode, bucket) of the head, then runs each once on padding (it
        writes only the pad page), so that no request pays a first run."""
        self.compile_records += self.steps.compile_all(
            self.policy, self.kv, MTP_MODES, inputs=self._inputs, progress=progress
        )
        for record in self.compile_records:
            meta = example_metadata(record.mode, record.batch_size, record.num_tokens, self.policy)
            x = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._inputs(meta.num_tokens))
            self._run(meta, x)
        jax.block_until_ready(self.kv)

    def _run(self, meta: ForwardMetadata, x: MTPInput) -> MTPOutput:
        out = self.steps(self.kv, x, meta)
        self.kv = out.kv
        return out

    def _metadata(self, mode: ForwardMode, rows: list[RowSpec], batch_size: int):
        return build_metadata(
            mode, rows, self.policy, num_slots=self.num_slots, num_pages=self.num_pages,
            batch_size=batch_size,
        )  # fmt: skip

    def after_extend(self, step: ScheduledStep, meta: ForwardMetadata, hidden: jax.Array) -> None:
        """Runs the head over the target's EXTEND ``step`` (its metadata ``meta`` and hidden
        states ``[T, hidden]``), read back already, and drafts for the rows that sampled."""
        tokens = np.zeros(meta.num_tokens, np.int32)
        chain, offset = [], 0
        for r, row in enumerate(step.rows):
            req, n = row.request, len(row.token_ids)
            # The sampled token ends a last chunk (absent when the request was aborted).
            following = req.token_ids[row.start + 1 : row.start + n + 1]
            tokens[offset : offset + len(following)] = following
            offset += n
            if row.samples and _live(req):
                chain.append((r, req, row.start + n))
        source = jnp.arange(meta.num_tokens, dtype=jnp.int32)
        first = self._run(meta, MTPInput(jnp.asarray(tokens), hidden, source, source))
        self._chain(first, chain, meta.batch_size)

    def after_verify(
        self,
        step: ScheduledStep,
        meta: ForwardMetadata,
        emitted: jax.Array,
        hidden: jax.Array,
        paths: Sequence[Sequence[int]],
    ) -> None:
        """Runs the head over the accepted part of the target's TARGET_VERIFY ``step``:
        ``emitted`` int32 ``[bs, D]`` (accepted drafts, bonus, -1 after) and ``hidden``
        ``[bs*D, hidden]`` on the device; ``paths[i]``, row i's accepted path of nodes, root
        first (read back; ``range(a + 1)`` in a chain that accepted a drafts)."""
        d = meta.num_draft_tokens
        rows, chain = [], []
        source = np.zeros(meta.num_tokens, np.int32)
        hidden_source = np.zeros(meta.num_tokens, np.int32)
        offset = 0
        for r, (row, path) in enumerate(zip(step.rows, paths, strict=True)):
            req, n = row.request, len(path)
            if not _live(req):
                continue
            chain.append((len(rows), req, row.start + n))
            rows.append(RowSpec(req.slot, row.start, n, req.pages))
            source[offset : offset + n] = r * d + np.arange(n)
            hidden_source[offset : offset + n] = r * d + np.asarray(path)
            offset += n
        if not rows:
            return
        extend = self._metadata(ForwardMode.DRAFT_EXTEND, rows, meta.batch_size)
        x = MTPInput(emitted.reshape(-1), hidden, jnp.asarray(source), jnp.asarray(hidden_source))
        self._chain(self._run(extend, x), chain, meta.batch_size)

    def _chain(
        self, first: MTPOutput, chain: list[tuple[int, Request, int]], batch_size: int
    ) -> None:
        """The DECODE steps after ``first`` along the spine (D-2 in a chain) for ``chain``:
        (row of ``first``, request, position of its first DECODE step); records each
        request's D-1 drafts."""
        if not chain:
            return
        outs, prev = [first], first
        source = np.zeros(batch_size, np.int32)
        source[: len(chain)] = [r for r, _, _ in chain]
        for k in range(self.num_head_steps - 1):
            rows = [RowSpec(req.slot, pos + k, 1, req.pages) for _, req, pos in chain]
            meta = self._metadata(ForwardMode.DECODE, rows, batch_size)
            index = jnp.asarray(source)
            prev = self._run(meta, MTPInput(prev.drafts, prev.hidden, index, index))
            outs.append(prev)
            source = np.arange(batch_size, dtype=np.int32)  # later steps keep their rows
        host = jax.device_get([out.candidates for out in outs])
        for i, (r, req, _) in enumerate(chain):
            rows_of = [r] + [i] * (len(host) - 1)  # the first step keeps the target's rows
            self.drafts[req.request_id] = tuple(
                int(host[level][rows_of[level], rank])
                for level, rank in zip(self._level, self._rank, strict=True)
            )

    def propose(self, request: Request) -> tuple[int, ...]:
        """The D-1 drafts the head proposed for ``request`` after its last step (once)."""
        drafts = self.drafts.pop(request.request_id, None)
        if drafts is None:
            raise RuntimeError(
                f"the MTP head has no drafts for request {request.request_id}: it drafts after "
                f"every step that samples for a request, so that step was not followed by "
                f"after_extend / after_verify"
            )
        return drafts
