"""The sizes of an engine (``EngineConfig``) and where it keeps compiled executables."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from jax.sharding import Mesh

from hybrid_jax.engine.speculative import SpeculativeConfig
from hybrid_jax.engine.startup import ProgramStore
from hybrid_jax.metadata import BucketPolicy
from hybrid_jax.parallel import make_mesh
from pallas_kernels import IMPLS

__all__ = ["DEFAULT_CACHE_DIR", "EngineConfig"]

DEFAULT_CACHE_DIR = str(pathlib.Path.home() / ".cache" / "hybrid_jax" / "xla")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of the engine.

    ``max_batch``: requests running at once (the largest batch bucket). ``max_tokens``: tokens
    of one step (the largest token bucket; longer prompts are prefilled in chunks of
    ``chunk_size``, default ``max_tokens``). ``max_context``: positions of one request (prompt
    plus generated tokens, a multiple of ``page_size``; None: the model's
    ``max_position_embeddings`` rounded down to whole pages). ``num_pages``: KV
    pages of ``page_size`` tokens (None: enough for ``max_batch`` requests at full context).
    ``batch_buckets`` / ``token_buckets`` override the default ladders. ``cache_dir``: JAX's
    persistent compilation cache (None: off). ``seed``: draws the seeds of requests that give
    none. ``impl``: the kernels' implementation choice. ``overlap``: dispatch each step
    before reading the previous one back (False: read every step back at once).
    ``speculative``: speculative decoding of decoding requests (None: off); it reads every
    step back at once whatever ``overlap`` says. ``scan_layers``: the steps run each run of
    repeated layers under ``lax.scan`` over stacked weights (``models.layer_scan``), so a
    step compiles in about the time of one repeated block whatever the depth (False: every
    layer unrolled, as the model's own forward). ``program_store``: keep each step's lowered
    program under ``cache_dir`` (``startup.ProgramStore``), so that a warm start-up neither
    traces nor lowers it; its key covers the package's source but not code patched at run
    time, so turn it off while monkeypatching. ``batch_invariant``: a request's logits do not
    depend on what it is batched with: every step runs the one bucket ``(max_batch,
    max_tokens)``, decodes and prompt chunks never share a step (no MIXED), and a prompt is
    cut into chunks of ``chunk_size`` from its start whatever else is served. It costs the
    bucket ladder: a step of one request runs as a full batch. ``tensor_parallel``: the GPUs
    (JAX devices) each step is spread over (``hybrid_jax.parallel``: heads and widths cut
    across them, one all-reduce per block, the MTP head's included); above 1 the program
    store is off.
    """

    max_batch: int = 8
    max_tokens: int = 128
    chunk_size: int | None = None
    max_context: int | None = 512
    page_size: int = 16
    num_pages: int | None = None
    batch_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    cache_dir: str | None = DEFAULT_CACHE_DIR
    seed: int = 0
    impl: str = "auto"
    overlap: bool = True
    speculative: SpeculativeConfig | None = None
    scan_layers: bool = True
    program_store: bool = True
    batch_invariant: bool = False
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        def positive(name: str, value, *, optional: bool = False, least: int = 1) -> None:
            if optional and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                none = " or None" if optional else ""
                raise ValueError(f"EngineConfig.{name}={value!r} must be an int >= {least}{none}")

        positive("max_batch", self.max_batch)
        positive("max_tokens", self.max_tokens)
        positive("chunk_size", self.chunk_size, optional=True)
        positive("page_size", self.page_size)
        positive("max_context", self.max_context, optional=True)
        # Page 0 is the pad page: a cache needs it and one page to hold anything.
        positive("num_pages", self.num_pages, optional=True, least=2)
        positive("tensor_parallel", self.tensor_parallel)
        if self.max_context is not None and self.max_context % self.page_size:
            raise ValueError(
                f"EngineConfig.max_context={self.max_context} is not a multiple of "
                f"page_size={self.page_size}; use whole pages"
            )
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"EngineConfig.seed={seed!r} must be an int in 0..{2**32 - 1}")
        if self.impl not in IMPLS:
            raise ValueError(f"EngineConfig.impl={self.impl!r} is not one of {list(IMPLS)}")
        if self.batch_invariant:
            pinned = (("batch_buckets", self.max_batch), ("token_buckets", self.max_tokens))
            for name, want in pinned:
                value = getattr(self, name)
                if value is not None and tuple(value) != (want,):
                    raise ValueError(
                        f"EngineConfig.{name}={value!r}: batch_invariant=True runs the one "
                        f"bucket ({want},); leave {name} unset"
                    )
            if self.speculative is not None:
                raise ValueError(
                    "EngineConfig.batch_invariant=True with speculative decoding is not built; "
                    "turn one of them off"
                )

    def store(self) -> ProgramStore | None:
        """The program store of these settings (None: off, no cache, interpret mode or
        tensor parallelism, whose programs are not exported)."""
        if not self.program_store or self.cache_dir is None or self.impl == "interpret":
            return None
        if self.tensor_parallel > 1:
            return None
        return ProgramStore(os.path.join(self.cache_dir, "programs"))

    def mesh(self) -> Mesh | None:
        """The devices of tensor parallelism (None at ``tensor_parallel=1``); raises
        ``ValueError`` naming the count when fewer devices are visible."""
        return make_mesh(self.tensor_parallel) if self.tensor_parallel > 1 else None

    def context(self, model_context: int) -> int:
        """Positions of one request, for a model with ``model_context`` positions."""
        if self.max_context is None:
            # Whole pages only, and never past what the model was trained for.
            context = model_context // self.page_size * self.page_size
        else:
            context = self.max_context
        if context > model_context:
            raise ValueError(
                f"max_context={context} exceeds the model's max_position_embeddings="
                f"{model_context}; lower max_context"
            )
        return context

    @property
    def lookahead(self) -> int:
        """Positions a verify row may run past a request's last useful one (D-1; 0 without
        speculation)."""
        return 0 if self.speculative is None else self.speculative.num_draft_tokens - 1

    def policy(self, model_context: int) -> BucketPolicy:
        """The bucket policy of these sizes, for a model with ``model_context`` positions.

        Under speculation its ``max_context`` holds ``lookahead`` more positions, in whole
        pages: only drafts past a request's budget land there, and they are never kept.
        """
        context = self.context(model_context)
        extra = -(-self.lookahead // self.page_size) * self.page_size
        spec = self.speculative
        draft = 4 if spec is None else spec.num_draft_tokens
        policy = BucketPolicy.default(
            self.max_batch, self.max_tokens, draft, page_size=self.page_size,
            max_context=context + extra, tree_drafts=spec is not None and spec.tree,
        )  # fmt: skip
        buckets = {}
        if self.batch_invariant:
            buckets = dict(
                batch_buckets=(self.max_batch,), token_buckets=(self.max_tokens,),
                batch_invariant=True,
            )  # fmt: skip
        if self.batch_buckets is not None:
            buckets["batch_buckets"] = tuple(self.batch_buckets)
        if self.token_buckets is not None:
            buckets["token_buckets"] = tuple(self.token_buckets)
        return dataclasses.replace(policy, **buckets)
