"""The engine's speculative steps: TARGET_VERIFY rows of D tokens, the acceptance and the
commit, and the drafts (n-gram, or the model's MTP head) for the next verify.

``SpeculativeServing`` is the part of ``Engine`` that runs them; it uses the engine's state
(``_steps``, ``_state``, ``_verifier``, ``scheduler``, ``mtp``, ``drafter``...) and is not
used alone. A verify row's tokens depend on the previous step's, so every speculative step is
read back before the next is scheduled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from hybrid_jax.engine.requests import StepEvent
from hybrid_jax.engine.sampling import SamplingBatch
from hybrid_jax.engine.scheduler import Request, ScheduledStep
from hybrid_jax.engine.speculative import TreeVerifier
from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import ForwardMode

__all__ = ["SpeculativeServing"]


class SpeculativeServing:
    """``Engine``'s speculative steps (see the module docstring)."""

    def _dispatch_verify(
        self,
        meta: ForwardMetadata,
        tokens: np.ndarray,
        batch: SamplingBatch,
        *,
        compile_first: bool = False,
    ) -> tuple[jax.Array, jax.Array, jax.Array | tuple]:
        """Dispatches a TARGET_VERIFY step, then its acceptance and commit (one executable);
        no wait. tokens: int32 ``[bs, D]`` (root then drafts, or the nodes of a tree). Returns
        the emitted tokens ``[bs, D]``, the last accepted node of each row ``[bs]`` (a chain's
        accepted count) and the step's kept hidden states."""
        out = self._steps(self._state, tokens.reshape(-1), meta)
        state, verifier = out.state, self._verifier
        if isinstance(verifier, TreeVerifier):
            if compile_first:
                verifier.compile(out.logits, state.pool, state.kv, out.verify, meta)
            acc, pool, kv = verifier(
                out.logits, tokens, batch, meta, state.pool, state.kv, out.verify
            )
            self._state = dataclasses.replace(state, pool=pool, kv=kv)
            return acc.emitted, acc.nodes, out.hidden
        if compile_first:
            verifier.compile(out.logits, state.pool, out.verify)
        acc, pool = verifier(out.logits, tokens, batch, meta.state_indices, state.pool, out.verify)
        self._state = dataclasses.replace(state, pool=pool)
        return acc.emitted, acc.num_accepted, out.hidden

    def _verify(self, step: ScheduledStep) -> list[StepEvent]:
        """Runs a TARGET_VERIFY step, reads it back and turns it into events (one per token
        kept; the row's new text comes with its last one)."""
        begun = time.perf_counter()
        meta, batch = self._metadata_and_sampling(step)
        tokens = np.zeros((meta.batch_size, meta.num_draft_tokens), np.int32)
        tokens[: len(step.rows)] = [row.token_ids for row in step.rows]
        start = time.perf_counter()
        emitted_device, nodes, hidden = self._dispatch_verify(meta, tokens, batch)
        self.launch_times[step.mode].append(time.perf_counter() - begun)
        emitted, nodes = (a[: len(step.rows)] for a in jax.device_get((emitted_device, nodes)))
        now = time.perf_counter()
        self.step_times[step.mode].append(now - start)
        self._last_resolved = now
        rows = [row[: int((row != -1).sum())].tolist() for row in emitted]
        stats = self.speculative_stats
        stats.steps += 1
        stats.rows += len(rows)
        stats.proposed += len(rows) * (meta.num_draft_tokens - 1)
        stats.accepted += sum(len(r) - 1 for r in rows)
        stats.emitted += sum(len(r) for r in rows)
        kept_rows = self.scheduler.resolve_verify(step, rows)
        if self.mtp is not None:
            paths = [self._path(int(node)) for node in nodes]
            self._draft(lambda: self.mtp.after_verify(step, meta, emitted_device, hidden, paths))
        events = []
        for req, kept in kept_rows:
            rid = req.request_id
            if rid not in self._tracked:
                continue
            tracked = self._tracked[rid]
            done = req.finish_reason is not None
            tracked.token_times += [now] * len(kept)
            text = self._new_text(tracked, done)
            result = self._result(self._tracked.pop(rid), now) if done else None
            for i, token in enumerate(kept):
                last = i == len(kept) - 1
                events.append(StepEvent(rid, token, text if last else "", result if last else None))
            if not kept:  # ended without a token (non-finite logits at the root)
                events.append(StepEvent(rid, -1, text, result))
        return events

    def _path(self, node: int) -> list[int]:
        """The verify row's nodes from the root to ``node`` (a chain's 0..node)."""
        parents = self.speculative.parents
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        return path

    def _propose(self, request: Request) -> Sequence[int]:
        if self.drafter is None:
            return self.mtp.propose(request)
        if self.mtp is not None:
            self.mtp.drafts.pop(request.request_id, None)
        return self.drafter.propose(request.token_ids)

    def _draft(self, chain: Callable[[], None]) -> None:
        """Runs an MTP drafting chain (it reads its drafts back) and times it."""
        start = time.perf_counter()
        chain()
        self.step_times[ForwardMode.DRAFT_EXTEND].append(time.perf_counter() - start)

    def _speculative_step(self) -> list[StepEvent]:
        step = self.scheduler.schedule_speculative(self._propose)
        if step.mode is ForwardMode.IDLE:
            return []
        if step.mode is ForwardMode.TARGET_VERIFY:
            events = self._verify(step)
        else:
            inflight = self._launch(step)
            events = self._land(inflight)
            if self.mtp is not None:
                self._draft(lambda: self.mtp.after_extend(step, inflight.meta, inflight.hidden))
        self._warn_on_retrace(step)
        return events
