"""The serving loop: requests in, tokens out, every step a precompiled (mode, bucket) executable.

``Engine`` owns a hybrid LM (``lm_step.HybridLM``: Qwen3-Next, Nemotron-H), its tokenizer, the
linear layers' slot pool and the attention layers' paged KV cache. At construction it
compiles, ahead of time, the forward step of every (mode, bucket) the scheduler can produce
(EXTEND, DECODE and MIXED on the bucket policy) and the sampler for every batch bucket,
through JAX's persistent compilation cache, so that a second start loads them, and runs each
once on padding. After that warm-up nothing is traced
again (``retraces`` counts it; a retrace also warns).

A step: the scheduler picks the rows, ``build_metadata`` pads them to their bucket, the step
executable returns the logits of each row's last token and records each row's argmax in a
per-slot buffer on the device; when a row of the batch samples, the sampler's executable
draws one token per row from those logits and records them instead. The next step is
scheduled and dispatched before this one's tokens are read back: its DECODE rows read their
input token from that buffer (``scheduler.PENDING``), so reading back step n (the one host
synchronisation per step) overlaps the device's work on step n+1.

Requests are checked before anything is queued (``RequestError``, ``SamplingParamsError``),
so a bad one never disturbs the requests already being served.

With ``EngineConfig(speculative=SpeculativeConfig(...))`` decoding requests run in
TARGET_VERIFY steps of D tokens per row instead of DECODE (``engine/speculative.py``): the
forward step returns the logits of all D tokens, ``Verifier`` accepts drafts and commits
every linear layer's state after the last accepted token (one executable), and the scheduler
advances each request by the accepted drafts plus one. TARGET_VERIFY and the acceptance
with its commit are compiled at start for every batch bucket like the other steps (DECODE
and MIXED are not compiled: speculative serving never runs them). A verify row's tokens
depend on the previous step's, so this path reads every step back before scheduling the
next (no overlap). ``speculative_stats`` counts acceptance.

With ``source="mtp"`` the target's steps also return their hidden states, and after every
EXTEND or TARGET_VERIFY step is read back the model's multi-token-prediction head drafts for
the next verify (``engine/mtp.py``: EXTEND or DRAFT_EXTEND over the positions just folded,
then D-2 DECODE steps); its steps are compiled at start too, and its KV cache sits on the same
pages as the target's.

With ``SpeculativeConfig(source="mtp", tree=True)`` the verify rows are trees of D nodes
(``SpeculativeConfig.parents``, carried as metadata data, so every verify bucket compiles
once): the head drafts along the tree's spine (``engine/mtp.py``), ``TreeVerifier`` walks
the tree (``speculative.accept_tree``) and commits the accepted node's states, windows and
the keys and values of its root path, moved to contiguous positions
(``backend.commit.commit_tree_verified``); the head then extends over that path as after a chain.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax.engine.config import EngineConfig
from hybrid_jax.engine.lm_step import HybridLM, LastTokenLogits, ServingState
from hybrid_jax.engine.mtp import MTPDrafter
from hybrid_jax.engine.requests import InFlight, Result, StepEvent, Tracked
from hybrid_jax.engine.sampling import Sampler, SamplingBatch, SamplingParams, SamplingParamsError
from hybrid_jax.engine.scheduler import (
    Request,
    RequestError,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)
from hybrid_jax.engine.speculative import (
    NgramDrafter,
    SpeculativeStats,
    TreeVerifier,
    Verifier,
)
from hybrid_jax.engine.speculative_serving import SpeculativeServing
from hybrid_jax.engine.startup import use_compilation_cache
from hybrid_jax.engine.step import CompileRecord, StepFunctions
from hybrid_jax.kv_cache import PageAllocator, init_kv_cache
from hybrid_jax.layers import norm as norm_layer
from hybrid_jax.metadata import ForwardMetadata, build_metadata, example_metadata
from hybrid_jax.models.auto import load_checkpoint
from hybrid_jax.models.checkpoint import resolve_checkpoint
from hybrid_jax.models.hf_config import ConfigError, check_eos_in_vocabulary, read_generation_config
from hybrid_jax.models.layer_scan import fold_scanned_norms, pair_scanned_swiglu, scan_layers
from hybrid_jax.models.qwen3_next import Qwen3Next, tiny_qwen3_next_config
from hybrid_jax.models.tokenizer import ByteTokenizer, TextStream, Tokenizer, load_tokenizer
from hybrid_jax.modes import EngineRole, ForwardMode, modes_for
from hybrid_jax.parallel import (
    on_mesh,
    replicate,
    shard_kv_cache,
    shard_model,
    shard_pool,
)
from hybrid_jax.progress import Progress
from hybrid_jax.state_pool import SlotAllocator, bytes_per_slot, init_state_pool

__all__ = ["Engine", "model_for_steps"]

PRESETS = {"tiny": tiny_qwen3_next_config}


def model_for_steps(
    model: HybridLM, config: EngineConfig, mesh: Mesh | None, *, donate_weights: bool = False
) -> HybridLM:
    """The model an engine's steps run: ``model``'s weights placed on ``mesh``, and under
    ``config.scan_layers`` its repeated layers stacked (``donate_weights``: moved, not copied)
    with the norms' weights folded and the experts' gate/up halves paired, as the switches
    say. ``model`` itself is returned where nothing applies."""
    step_model = model
    if mesh is not None:
        step_model = shard_model(model, mesh, donate=donate_weights)
    if not config.scan_layers:
        return step_model
    # A copy made here for the mesh is ours to donate.
    own = donate_weights or step_model is not model
    scanned = scan_layers(step_model, donate=own)
    if scanned is not step_model:
        # Only layers stacked here are ours to fold or lay out: a model scanned before it
        # came keeps its weights.
        if norm_layer.FOLD_NORM_WEIGHTS:
            fold_scanned_norms(scanned)
        if mesh is None:  # each layer pairs as its switch says
            pair_scanned_swiglu(scanned)
    return scanned


def _device_memory(device: jax.Device) -> tuple[int, int] | None:
    """(bytes ``device`` may hold, bytes in use), or None where it does not say (the CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"], stats.get("bytes_in_use", 0)


def _check_device_memory(
    state_bytes: int, kv_bytes: int, num_slots: int, num_pages: int, mesh: Mesh | None
):
    """Raises ``ValueError`` before allocating when the slot pool and the KV cache cannot fit
    beside what the devices already hold (the weights), naming the settings that size them.
    Under tensor parallelism each device holds 1/N of both, and the fullest device decides."""
    devices = [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)
    share = len(devices)
    for device in devices:
        memory = _device_memory(device)
        if memory is None:
            continue
        limit, in_use = memory
        free = limit - in_use
        if (state_bytes + kv_bytes) / share <= free:
            continue
        gib = 2**30
        each = f" (1/{share} of each on every device)" if share > 1 else ""
        raise ValueError(
            f"the linear layers' state pool ({num_slots} slots: EngineConfig.max_batch plus "
            f"the pad slot) needs {state_bytes / gib:.1f} GiB and the KV cache ({num_pages} "
            f"pages) {kv_bytes / gib:.1f} GiB{each}, but device {device.id} has "
            f"{free / gib:.1f} GiB free of {limit / gib:.1f} GiB ({in_use / gib:.1f} GiB in "
            f"use, the weights among them); lower max_batch, or num_pages / max_context"
        )


class Engine(SpeculativeServing):
    """Continuous-batching generation with a hybrid LM (see the module docstring).

    ``Engine.from_preset("tiny")`` needs no download; ``Engine.from_checkpoint(folder)`` loads
    a Hugging Face folder. ``generate`` returns finished ``Result``s; ``stream`` yields
    ``StepEvent``s as tokens arrive; ``add_request`` / ``step`` / ``abort`` drive it by hand.
    The model's ``eos_token_id``s stop every request, besides its own stop tokens (a
    checkpoint's ``generation_config.json`` may add more). ``generation_config``: the
    sampling defaults a checkpoint's ``generation_config.json`` sets (``SamplingParams``
    fields; empty for a preset); ``default_params``, the sampling of calls that give none, is
    ``SamplingParams`` with them. ``logits_dtype``: the dtype a step gives its logits in (the
    model's: the LM head's product as it is), which the samplers are compiled for.
    ``compile_records`` (one per step executable),
    ``sampler_compile_ms``, ``compile_s``, ``step_times`` (seconds per step, by mode;
    under MTP drafts, DRAFT_EXTEND holds the head's whole drafting chain after each step) and
    ``launch_times`` (the host's seconds to launch each step, by mode: its metadata and its
    executables' dispatch, no wait for the device; a step is the host's when they come near
    its ``step_times``) describe where time went;
    ``speculative_stats`` counts draft acceptance under speculative decoding; ``drafter``
    proposes the drafts (any object with ``propose(token_ids) -> D-1 token ids`` may
    replace it: acceptance never trusts a draft, so tokens stay those of the target; under
    tree drafts they are the tokens of the nodes after the root, in node order). Under
    ``source="mtp"`` it is None and ``mtp`` (an ``MTPDrafter``) proposes; a drafter set
    there takes precedence while the head keeps running (its cache stays in step).
    """

    def __init__(
        self,
        model: HybridLM,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        *,
        progress: bool = True,
        donate_weights: bool = False,
    ):
        """``donate_weights``: under ``config.scan_layers`` the repeated layers' weights move
        into the engine's stacked copy (``layer_scan.scan_layers(donate=True)``): memory
        for one model, not two, and ``model``'s repeated layers are deleted (``engine.model``
        is then the scanned model). The built-in constructors donate the model they build."""
        self.mesh = config.mesh()
        step_model = model_for_steps(model, config, self.mesh, donate_weights=donate_weights)
        self.model = step_model if donate_weights else model
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = model.config.vocab_size
        self.logits_dtype = jnp.dtype(model.config.dtype)
        self.eos_token_ids = frozenset(model.config.eos_token_id)
        self.generation_config: dict[str, float | int] = {}
        # A vision-language checkpoint's image and video placeholders: text only here.
        self.vision_token_ids = frozenset(getattr(model.config, "vision_token_ids", ()))
        self.max_context = config.context(model.config.max_position_embeddings)
        self.policy = config.policy(model.config.max_position_embeddings)
        self.speculative = config.speculative
        sched_config = SchedulerConfig.for_policy(
            self.policy, config.max_batch, config.max_tokens, config.chunk_size,
            batch_invariant=config.batch_invariant,
        )  # fmt: skip
        specs, kv_specs = model.state_specs(), model.kv_specs()
        num_slots = sched_config.max_running + 1
        num_pages = config.num_pages
        if num_pages is None:
            num_pages = sched_config.max_running * self.policy.max_pages + 1
        slot_bytes = bytes_per_slot(specs)
        _check_device_memory(
            num_slots * slot_bytes,
            num_pages * sum(s.page_bytes(self.policy.page_size) for s in kv_specs),
            num_slots, num_pages, self.mesh,
        )  # fmt: skip
        self.slots = SlotAllocator(num_slots, slot_bytes)
        self.pages = PageAllocator(num_pages, self.policy.page_size)
        self.scheduler = Scheduler(
            sched_config,
            self.slots,
            self.pages,
            max_context=self.max_context,
            lookahead=config.lookahead,
        )
        self._state = ServingState(
            init_state_pool(specs, num_slots),
            init_kv_cache(kv_specs, num_pages, self.policy.page_size),
            jnp.zeros(num_slots, jnp.int32),
        )
        if self.mesh is not None:
            self._state = ServingState(
                shard_pool(self._state.pool, self.mesh),
                shard_kv_cache(self._state.kv, self.mesh),
                replicate(self._state.last_tokens, self.mesh),
            )
        use_mtp = self.speculative is not None and self.speculative.source == "mtp"
        store = config.store()
        self.mtp: MTPDrafter | None = None
        if use_mtp:
            self.mtp = MTPDrafter(
                step_model, self.policy, num_slots=num_slots, num_pages=num_pages,
                parents=self.speculative.parents, impl=config.impl, store=store, mesh=self.mesh,
            )  # fmt: skip
        self._steps = StepFunctions(
            LastTokenLogits(step_model, use_mtp), impl=config.impl, store=store, mesh=self.mesh
        )
        self._sampler = Sampler()
        self.tree = self.speculative is not None and self.speculative.tree
        self._verifier: Verifier | TreeVerifier = TreeVerifier() if self.tree else Verifier()
        # Speculative serving never runs DECODE or MIXED: decoding rows verify, prefill extends.
        role = EngineRole.SERVING if self.speculative is None else EngineRole.VERIFYING
        self._modes = modes_for(role)
        self.drafter: NgramDrafter | None = None
        if self.speculative is not None:
            spec = self.speculative
            if not use_mtp:
                self.drafter = NgramDrafter(
                    spec.num_draft_tokens - 1, spec.max_ngram, spec.min_ngram
                )
        self.speculative_stats = SpeculativeStats()
        self._rng = np.random.default_rng(config.seed)
        self._tracked: dict[int, Tracked] = {}
        self._inflight: InFlight | None = None
        self.overlap = config.overlap
        # Events read back for requests that a stream other than the one stepping follows.
        self._followed: dict[int, list[StepEvent]] = {}
        self._last_resolved = 0.0
        self._next_id = 0
        self.compile_records: list[CompileRecord] = []
        self.sampler_compile_ms: dict[int, float] = {}
        # Under MTP drafts, DRAFT_EXTEND times the head's whole chain after a step.
        drafting = (ForwardMode.DRAFT_EXTEND,) if use_mtp else ()
        self.step_times: dict[ForwardMode, list[float]] = {
            m: [] for m in dict.fromkeys((*modes_for(EngineRole.SERVING), *self._modes, *drafting))
        }
        self.launch_times: dict[ForwardMode, list[float]] = {m: [] for m in self.step_times}
        if config.cache_dir is not None:
            use_compilation_cache(config.cache_dir)
        start = time.perf_counter()
        with on_mesh(self.mesh):
            self._compile(progress)
        self.compile_s = time.perf_counter() - start
        self._warm_traces = self._traces()
        self._warned = False

    @classmethod
    def from_preset(
        cls,
        name: str = "tiny",
        config: EngineConfig = EngineConfig(),
        *,
        seed: int = 0,
        dtype: str = "float32",
        progress: bool = True,
    ) -> Engine:
        """A built-in model with seeded random weights and the byte-level tokenizer."""
        if name not in PRESETS:
            raise ValueError(f"preset {name!r} does not exist; choose one of {sorted(PRESETS)}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an int >= 0 (it seeds the random weights)")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={dtype!r} is not one of 'float32', 'bfloat16', 'float16'")
        model_config = PRESETS[name](dtype)
        config.policy(model_config.max_position_embeddings)  # bad sizes fail before the build
        config.mesh()  # so do missing devices
        if config.cache_dir is not None:
            # Before the model: its random initialisation compiles a few dozen small programs.
            use_compilation_cache(config.cache_dir)
        model = Qwen3Next(model_config, rngs=nnx.Rngs(seed))
        return cls(model, ByteTokenizer(), config, progress=progress, donate_weights=True)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike,
        config: EngineConfig = EngineConfig(),
        *,
        tokenizer: Tokenizer | None = None,
        dtype: str | None = None,
        progress: bool = True,
        check_finite: bool = True,
    ) -> Engine:
        """A Hugging Face checkpoint (a folder, or an ``org/model`` id already in the local
        hub cache: ``models.checkpoint.resolve_checkpoint``) of a supported ``model_type``
        (Qwen3-Next, Qwen3.5/3.6, Nemotron-H: ``models.auto.MODEL_LOADERS``; config.json,
        safetensors and, unless ``tokenizer`` is given, tokenizer.json). A missing,
        misshapen or non-float tensor, or one holding inf or NaN (``check_finite=False`` skips
        that check), raises ``CheckpointError`` before anything is compiled."""
        path = resolve_checkpoint(path)
        mesh = config.mesh()  # missing devices fail before the load
        if config.cache_dir is not None:
            use_compilation_cache(config.cache_dir)
        fields, eos = read_generation_config(path)
        try:
            SamplingParams(**fields)
        except SamplingParamsError as err:
            raise ConfigError(f"generation_config.json: {err}") from None
        model = load_checkpoint(
            path, dtype=dtype, progress=progress, check_finite=check_finite, mesh=mesh
        )
        check_eos_in_vocabulary(eos, model.config.vocab_size)
        tokenizer = load_tokenizer(path) if tokenizer is None else tokenizer
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                f"is {model.config.vocab_size}; load the tokenizer of this checkpoint"
            )
        engine = cls(model, tokenizer, config, progress=progress, donate_weights=True)
        engine.eos_token_ids |= frozenset(eos)
        engine.generation_config = fields
        return engine

    def _compile(self, progress: bool) -> None:
        sampled = [m for m in self._modes if m is not ForwardMode.TARGET_VERIFY]
        batch_sizes = sorted({bs for m in sampled for bs, _ in self.policy.buckets(m)})
        total = sum(len(self.policy.buckets(m)) for m in self._modes) + len(batch_sizes)
        if self.speculative is not None:
            total += len(self.policy.buckets(ForwardMode.TARGET_VERIFY))
        if self.mtp is not None:
            total += self.mtp.num_executables()
        bar = Progress(total, progress)

        def on_step(record: CompileRecord) -> None:
            self.compile_records.append(record)
            bar(f"{record.mode.name} {record.batch_size}x{record.num_tokens}")

        self._steps.compile_all(
            self.policy,
            self._state,
            self._modes,
            token_shape=(),
            dtype=jnp.int32,
            progress=on_step,
        )
        for bs in batch_sizes:
            # A greedy batch's tokens come from its step: no greedy sampler variant.
            self.sampler_compile_ms[bs] = self._sampler.compile(
                bs, self.vocab_size, self.slots.num_slots, greedy=False, dtype=self.logits_dtype
            )
            bar(f"sampler {bs}")
        # Run every executable once on all-padding metadata (it writes only the pad slot and
        # the pad page): a first run costs more than later ones, and no request should pay it.
        # A verify step's acceptance and commit compile here, from its outputs' shapes.
        for record in self.compile_records:
            meta = example_metadata(record.mode, record.batch_size, record.num_tokens, self.policy)
            batch = SamplingBatch.pack([], [], [], record.batch_size)
            if record.mode is ForwardMode.TARGET_VERIFY:
                tokens = np.zeros((record.batch_size, meta.num_draft_tokens), np.int32)
                self._dispatch_verify(meta, tokens, batch, compile_first=True)
                bar(f"verify commit {record.batch_size}")
            else:
                tokens = np.zeros((record.num_tokens,), np.int32)
                self._dispatch(meta, tokens, batch, top_logprobs=True)
        jax.block_until_ready(self._state)
        if self.mtp is not None:
            self.mtp.compile(lambda r: bar(f"MTP {r.mode.name} {r.batch_size}x{r.num_tokens}"))

    @property
    def state(self) -> ServingState:
        """The device state after the last dispatched step, for inspection (the next step
        donates it: read it before stepping again)."""
        return self._state

    def _traces(self) -> int:
        traces = self._steps.total_traces + self._sampler.trace_count
        traces += self._verifier.trace_count
        return traces + (self.mtp.steps.total_traces if self.mtp is not None else 0)

    @property
    def retraces(self) -> int:
        """Traces since the warm-up compiled everything (0 unless a shape escaped the buckets)."""
        return self._traces() - self._warm_traces

    @property
    def executables(self) -> dict[tuple[ForwardMode, int, int], Any]:
        """The step executables compiled so far by (program, batch size, tokens); each has
        ``as_text()`` (its optimised HLO) and ``memory_analysis()``."""
        return self._steps.executables()

    @property
    def memory(self) -> dict[str, int]:
        """Bytes the engine holds on the device: ``weights``, ``states`` (the linear layers'
        slot pool), ``kv_cache``, and ``step_temp``, the largest scratch any compiled step
        needs while it runs."""

        def nbytes(tree) -> int:
            return sum(a.nbytes for a in jax.tree.leaves(tree))

        temps = [ex.memory_analysis() for ex in self.executables.values()]
        return {
            "weights": nbytes(self._steps.params),
            "states": nbytes(self._state.pool),
            "kv_cache": nbytes(self._state.kv),
            "step_temp": max((m.temp_size_in_bytes for m in temps if m is not None), default=0),
        }

    @property
    def default_params(self) -> SamplingParams:
        """The sampling of calls that give none: ``generation_config`` over the defaults."""
        return SamplingParams(**self.generation_config)

    @property
    def has_work(self) -> bool:
        """Requests are waiting or running, or a step's tokens are still to be read back."""
        return self.scheduler.has_work or self._inflight is not None

    def _prompt_ids(self, prompt: str | Sequence[int], what: str) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence | np.ndarray):
            ids = list(prompt)
        else:
            raise RequestError(
                f"{what}={prompt!r} is neither text nor a sequence of token ids; pass a str "
                f"or a list of ints"
            )
        if not ids:
            raise RequestError(f"{what} is empty; give at least one token")
        for i, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int | np.integer):
                raise RequestError(f"{what} token_ids[{i}]={token!r} is not an int token id")
            if not 0 <= token < self.vocab_size:
                raise RequestError(
                    f"{what} token_ids[{i}]={token} is outside the vocabulary "
                    f"(ids 0..{self.vocab_size - 1})"
                )
            if token in self.vision_token_ids:
                raise RequestError(
                    f"{what} token_ids[{i}]={token} is an image or video placeholder of this "
                    f"vision-language checkpoint; only text is served here, so give a prompt "
                    f"without image or video input"
                )
        context = self.max_context
        if len(ids) > context:
            raise RequestError(
                f"{what} has {len(ids)} tokens, longer than the context of {context} positions; "
                f"shorten the prompt or build the engine with a larger max_context"
            )
        return [int(t) for t in ids]

    def _check(self, prompt, params, what: str) -> tuple[list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params for {what} are {params!r}, not SamplingParams")
        ids = self._prompt_ids(prompt, what)
        params.check_vocab(self.vocab_size)
        if params.logprobs is not None and self.speculative is not None:
            raise RequestError(
                f"logprobs={params.logprobs} for {what}: a speculative engine does not report "
                "log-probabilities; leave logprobs None or serve without speculative decoding"
            )
        return ids, params

    def _request(self, request_id: int, ids: list[int], params: SamplingParams) -> Request:
        # Capped so that prompt + new tokens - 1 (the last token is never fed) fits the context.
        room = self.max_context - len(ids) + 1
        return Request(
            request_id,
            ids,
            min(params.max_new_tokens, room),
            frozenset(params.stop_token_ids) | self.eos_token_ids,
        )

    def _submit(self, request: Request, params: SamplingParams) -> int:
        """Queues ``request`` (built by ``_request`` with the next id) and tracks it."""
        self.scheduler.add(request)
        self._next_id += 1
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**32))
        self._tracked[request.request_id] = Tracked(
            request, params, seed, time.perf_counter(), TextStream(self.tokenizer)
        )
        return request.request_id

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queues one request (text or token ids) and returns its id. Raises ``RequestError``
        or ``SamplingParamsError`` naming the problem, with nothing queued.

        Its tokens are reported by the ``step()`` calls that read them back; a ``stream`` or
        ``generate`` running meanwhile serves it but keeps only its own requests' events.
        """
        ids, params = self._check(prompt, params or SamplingParams(), "prompt")
        return self._submit(self._request(self._next_id, ids, params), params)

    def abort(self, request_id: int) -> Result | None:
        """Stops a request and frees its slot and pages; its result so far (None if unknown)."""
        request = self.scheduler.abort(request_id)
        if self.mtp is not None:
            self.mtp.drafts.pop(request_id, None)
        if request is None:
            return None
        result = self._result(self._tracked.pop(request_id), time.perf_counter())
        if request_id in self._followed:
            # The stream that follows it ends it with this event (no token).
            self._followed[request_id].append(StepEvent(request_id, -1, "", result))
        return result

    def _result(self, tracked: Tracked, now: float) -> Result:
        req, times = tracked.request, tracked.token_times
        return Result(
            request_id=req.request_id,
            prompt_token_ids=req.token_ids[: req.prompt_len],
            token_ids=req.output_ids,
            text=self.tokenizer.decode(req.output_ids),
            finish_reason=req.finish_reason,
            ttft=times[0] - tracked.submitted if times else math.nan,
            token_latencies=[b - a for a, b in zip(times, times[1:], strict=False)],
            total=now - tracked.submitted,
            logprobs=tracked.logprobs if tracked.params.logprobs is not None else None,
            top_logprobs=tracked.top_logprobs if tracked.params.logprobs else None,
        )

    def _new_text(self, tracked: Tracked, finished: bool) -> str:
        req, stream = tracked.request, tracked.text
        return stream.extend(req.token_ids[req.prompt_len + stream.num_tokens :], final=finished)

    def _dispatch(
        self,
        meta: ForwardMetadata,
        tokens: np.ndarray | jax.Array,
        batch: SamplingBatch,
        top_logprobs: bool = False,
    ) -> tuple[jax.Array, jax.Array, tuple, jax.Array | tuple]:
        """Dispatches the step and the sampler (no wait); the sampled tokens ``[bs]``, their
        log-probabilities, each row's most likely tokens when ``top_logprobs`` (else ``()``)
        and the step's kept hidden states (see ``StepOutput``)."""
        out = self._steps(self._state, tokens, meta)
        self._state = out.state
        if batch.filters.draws:
            sampled, logprobs, last_tokens = self._sampler(
                out.logits, batch, out.state.last_tokens, meta.state_indices
            )
            self._state = dataclasses.replace(out.state, last_tokens=last_tokens)
        else:
            sampled, logprobs = out.greedy  # the step drew them
        top = self._sampler.top_logprobs(out.logits) if top_logprobs else ()
        return sampled, logprobs, top, out.hidden

    def _metadata_and_sampling(self, step: ScheduledStep) -> tuple[ForwardMetadata, SamplingBatch]:
        """The padded metadata of a scheduled step and its rows' sampling parameters."""
        rows = step.row_specs
        if self.tree and step.mode is ForwardMode.TARGET_VERIFY:
            rows = [dataclasses.replace(row, parents=self.speculative.parents) for row in rows]
        meta = build_metadata(
            step.mode,
            rows,
            self.policy,
            num_slots=self.slots.num_slots,
            num_pages=self.pages.num_pages,
        )
        tracked = [self._tracked[row.request.request_id] for row in step.rows]
        batch = SamplingBatch.pack(
            [t.params for t in tracked],
            [t.seed for t in tracked],
            [t.request.num_drawn for t in tracked],
            meta.batch_size,
        )
        return meta, batch

    def _launch(self, step: ScheduledStep) -> InFlight:
        begun = time.perf_counter()
        meta, batch = self._metadata_and_sampling(step)
        tokens = np.zeros((meta.num_tokens,), np.int32)
        tokens[: step.num_tokens] = step.token_ids
        start = time.perf_counter()
        asked = [self._tracked[row.request.request_id].params.logprobs for row in step.rows]
        # The host array goes as it is: the step copies it to the device in the metadata's
        # vector.
        sampled, logprobs, top, hidden = self._dispatch(meta, tokens, batch, any(asked))
        self.scheduler.advance(step)
        self.launch_times[step.mode].append(time.perf_counter() - begun)
        # Read back only when a row of the step reports them.
        reported = logprobs if any(a is not None for a in asked) else None
        return InFlight(step, sampled, start, meta, hidden, reported, top)

    def _land(self, inflight: InFlight) -> list[StepEvent]:
        """Reads a dispatched step's tokens back and turns them into events."""
        step = inflight.step
        n = len(step.rows)
        sampled = np.asarray(inflight.sampled)[:n].tolist()
        logprobs = [None] * n
        if inflight.logprobs is not None:
            logprobs = np.asarray(inflight.logprobs)[:n].tolist()
        top = [np.asarray(a)[:n].tolist() for a in inflight.top_logprobs]
        now = time.perf_counter()
        # The device ran this step after the previous one landed or after its own dispatch,
        # whichever came later: that span is this step's time.
        self.step_times[step.mode].append(now - max(inflight.dispatched, self._last_resolved))
        self._last_resolved = now
        finished = {r.request_id for r in self.scheduler.resolve(step, sampled)}
        events = []
        for i, (row, token) in enumerate(zip(step.rows, sampled, strict=True)):
            rid = row.request.request_id
            if not row.samples or rid not in self._tracked:
                continue  # an earlier prompt chunk, or a request already finished or aborted
            tracked = self._tracked[rid]
            tracked.token_times.append(now)
            logprob, alternatives = self._logprobs(tracked, token, logprobs[i], top, i)
            done = rid in finished
            text = self._new_text(tracked, done)
            result = self._result(self._tracked.pop(rid), now) if done else None
            events.append(StepEvent(rid, int(token), text, result, logprob, alternatives))
        return events

    @staticmethod
    def _logprobs(tracked: Tracked, token: int, logprob: float | None, top: list, row: int):
        """The event's log-probabilities for ``tracked`` (recorded on it too): its token's,
        and its ``params.logprobs`` most likely tokens'."""
        asked = tracked.params.logprobs
        if asked is None:
            return None, None
        alternatives = None
        if asked:
            values, ids = top
            # The token's own value and the alternatives' come from two executables whose
            # reductions may round apart by an ulp: one number is reported for the token.
            if token in ids[row]:
                logprob = values[row][ids[row].index(token)]
            alternatives = tuple(zip(ids[row][:asked], values[row][:asked], strict=True))
            tracked.top_logprobs.append(list(alternatives))
        tracked.logprobs.append(logprob)
        return logprob, alternatives

    def step(self) -> list[StepEvent]:
        """Schedules and dispatches one step, then reads back the step dispatched before it
        (this one too when ``overlap`` is False); returns one event per token read back.
        Under speculative decoding every step is read back at once. Events of requests that
        a stream follows are also kept for that stream."""
        events = self._step()
        for event in events:
            if event.request_id in self._followed:
                self._followed[event.request_id].append(event)
        return events

    def _step(self) -> list[StepEvent]:
        if self.speculative is not None:
            return self._speculative_step()
        step = self.scheduler.schedule()
        launched = None if step.mode is ForwardMode.IDLE else self._launch(step)
        events = []
        if self._inflight is not None:
            events += self._land(self._inflight)
        self._inflight = launched
        if launched is not None and not self.overlap:
            events += self._land(launched)
            self._inflight = None
        self._warn_on_retrace(step)
        return events

    def _warn_on_retrace(self, step: ScheduledStep) -> None:
        if self.retraces and not self._warned:
            self._warned = True
            warnings.warn(
                f"the engine traced a step after warm-up ({step.mode.name}, {len(step.rows)} "
                f"rows, {step.num_tokens} tokens): a shape escaped the compiled buckets",
                RuntimeWarning,
                stacklevel=4,
            )

    def _submit_all(self, prompts, params) -> list[int]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence | np.ndarray)
            and len(prompts)
            and isinstance(prompts[0], int | np.integer)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.default_params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise RequestError(
                f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one "
                f"per prompt"
            )
        # Every prompt is checked before any is queued, the scheduler's capacity checks
        # included: a bad one rejects the call whole and leaves no request, id or page behind.
        checked = [
            self._check(p, s, f"prompts[{i}]")
            for i, (p, s) in enumerate(zip(prompts, params, strict=True))
        ]
        requests = [self._request(self._next_id + i, ids, p) for i, (ids, p) in enumerate(checked)]
        for i, request in enumerate(requests):
            try:
                self.scheduler.check(request)
            except RequestError as err:
                raise RequestError(f"prompts[{i}]: {err}") from None
        return [self._submit(r, p) for r, (_, p) in zip(requests, checked, strict=True)]

    def stream(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, StepEvent]]:
        """Yields ``(index of the prompt, event)`` as tokens arrive, until all are finished.

        The prompts are checked and queued by this call (a bad one raises here, with nothing
        queued); the iterator then drives the engine. Other requests keep being served
        alongside: events of requests another stream follows are kept for it. Closing the
        iterator early aborts the prompts that had not finished.
        """
        ids = self._submit_all(prompts, params)
        # Followed from now on, not from the first next(): another stream or step() may read
        # their tokens back before this iterator starts.
        for rid in ids:
            self._followed[rid] = []
        return self._follow(ids)

    def _follow(self, ids: list[int]) -> Iterator[tuple[int, StepEvent]]:
        index = {rid: i for i, rid in enumerate(ids)}
        pending = set(ids)
        try:
            while pending:
                mine = [e for rid in ids for e in self._followed.get(rid, ())]
                for rid in ids:
                    self._followed[rid] = []
                if not mine:
                    if not self.has_work:
                        raise RuntimeError(
                            f"requests {sorted(pending)} ended without a result while this "
                            f"stream followed them"
                        )
                    # Every event of the step is handed out before any is yielded: another
                    # stream stepping while this one waits at a yield must find its earlier
                    # tokens already kept, ahead of its later ones.
                    for event in self._step():
                        if event.request_id in index:
                            mine.append(event)
                        elif event.request_id in self._followed:
                            self._followed[event.request_id].append(event)
                for event in mine:
                    if event.result is not None:
                        pending.discard(event.request_id)
                    yield index[event.request_id], event
        finally:
            for rid in ids:
                self._followed.pop(rid, None)
            for rid in pending:
                self.abort(rid)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Result]:
        """Generates for every prompt (text or token ids) and returns their results in order."""
        results: dict[int, Result] = {}
        for i, event in self.stream(prompts, params):
            if event.result is not None:
                results[i] = event.result
        return [results[i] for i in range(len(results))]
