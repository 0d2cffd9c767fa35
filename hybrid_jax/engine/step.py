"""Jitted step functions: one executable per (mode, bucket), the mode a static argument.

``StepFunctions`` wraps a model (an NNX module with ``layer_kinds`` and
``__call__(x, pool, meta, impl=...)``; ``x`` is an array or a pytree of arrays whose first
leaf has one entry per token). ``lower`` checks every layer kind against the
capability table while tracing, so an unsupported mode fails at ``.lower()`` and nothing
runs. ``compile_all`` compiles every (mode, bucket) of a ``BucketPolicy`` ahead of time from
the same metadata builder the real calls use; after that, ``__call__`` only looks executables
up, and ``trace_count`` tells whether anything was traced again. Modes that share a program
(``modes.program_mode``: MIXED runs EXTEND's) share one executable per bucket. An executable
takes a step's metadata as one int32 vector (``metadata.pack_metadata``), its token ids with
it when ``x`` is one int32 array, and unpacks it where it is traced: a step of token ids
copies one array to the device.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from hybrid_jax import xla_flags
from hybrid_jax.engine.startup import ProgramStore
from hybrid_jax.metadata import (
    BucketPolicy,
    ForwardMetadata,
    MetadataLayout,
    example_metadata,
    pack_metadata,
)
from hybrid_jax.modes import ForwardMode, check_supported, program_mode
from hybrid_jax.parallel import on_mesh, spec_of
from hybrid_jax.state_pool import StatePool

__all__ = ["GRAPHED_PROGRAMS", "CompileRecord", "StepFunctions"]

GRAPHED_PROGRAMS = frozenset({ForwardMode.DECODE, ForwardMode.TARGET_VERIFY})
"""The programs whose executables may run whole as CUDA graphs (``xla_flags.STEP_GRAPHS``,
``step_compiler_options``): a few rows a token, so a step is hundreds of short kernels whose
launches the graphs would take over."""


class CompileRecord(NamedTuple):
    """One (mode, bucket)'s executable: ``compile_ms`` in all, of which ``lower_ms`` before
    XLA's compile (tracing and lowering, where Mosaic GPU lowers the kernels, or reading a
    stored program); ``lower_ms`` is 0 for a bucket whose program another bucket compiled."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    compile_ms: float
    lower_ms: float = 0.0


class StepFunctions:
    """The jitted forward step of ``model`` for every mode (a verify step's commit runs in
    ``speculative.Verifier``, with its acceptance)."""

    def __init__(
        self,
        model: nnx.Module,
        *,
        impl: str = "auto",
        store: ProgramStore | None = None,
        mesh: Mesh | None = None,
    ):
        """``mesh``: the devices of tensor parallelism (``hybrid_jax.parallel``; ``model``'s
        weights already placed on it), under which every step is traced and compiled."""
        self.mesh = mesh
        self.graphdef, params = nnx.split(model)
        # The weights travel as a flat list of arrays: every call flattens its arguments,
        # and a list of arrays flattens in C++, where nnx Variables call back into Python.
        self.params, self._params_tree = jax.tree.flatten(params)
        self.layer_kinds = tuple(model.layer_kinds)
        self.impl = impl
        self.store = store
        self.trace_count: collections.Counter[ForwardMode] = collections.Counter()
        # (program mode, batch bucket, token bucket) -> executable; the (mode, buckets) that
        # compile_all has compiled, each with its record.
        self._compiled: dict[tuple[ForwardMode, int, int], Any] = {}
        self._compiled_buckets: set[tuple[ForwardMode, int, int]] = set()
        self._compiled_shapes: dict[tuple[ForwardMode, int, int], tuple] = {}
        # The metadata travels as one int32 vector (``_pack``), its layout static.
        self._jitted = jax.jit(self._forward_packed, static_argnums=(0, 1), donate_argnums=3)

    def _forward(self, mode: ForwardMode, params, pool: StatePool, x, meta: ForwardMetadata):
        self.trace_count[mode] += 1
        for kind in dict.fromkeys(self.layer_kinds):
            check_supported(kind, mode)
        if meta.mode is not mode:
            raise ValueError(f"metadata built for {meta.mode.name} passed to a {mode.name} step")
        num_tokens = jax.tree.leaves(x)[0].shape[0]
        if num_tokens != meta.num_tokens:
            raise ValueError(
                f"x has {num_tokens} tokens but the {mode.name} bucket has {meta.num_tokens}; "
                "pad x to meta.num_tokens"
            )
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._params_tree, params))
        return model(x, pool, meta, impl=self.impl)

    def _forward_packed(
        self, mode: ForwardMode, layout: MetadataLayout, params, pool: StatePool, x, packed
    ):
        x, meta = layout.unpack(packed) if x is None else (x, layout.unpack(packed))
        return self._forward(mode, params, pool, x, meta)

    def lower(
        self, mode: ForwardMode, pool: StatePool, x: jax.Array, meta: ForwardMetadata,
        *, platforms: tuple[str, ...] | None = None,
    ):  # fmt: skip
        """Traces and lowers the step of ``mode`` (raises UnsupportedForwardModeError here);
        for ``platforms`` (such as ``("cuda",)`` on a machine without a GPU) where given."""
        mode = ForwardMode(mode)
        program, meta = self._as_program(mode, meta)
        layout, x, packed = _pack(x, meta)
        with on_mesh(self.mesh):
            traced = self._jitted.trace(program, layout, self.params, pool, x, packed)
            return traced.lower(lowering_platforms=platforms)

    def _as_program(
        self, mode: ForwardMode, meta: ForwardMetadata
    ) -> tuple[ForwardMode, ForwardMetadata]:
        """The program that runs ``mode`` and ``meta`` relabelled for it; the layers'
        capabilities are checked for ``mode`` itself first."""
        program = program_mode(mode)
        if program is mode:
            return mode, meta
        for kind in dict.fromkeys(self.layer_kinds):
            check_supported(kind, mode)
        if meta.mode is mode:
            meta = dataclasses.replace(meta, mode=program)
        return program, meta

    def compile_all(
        self,
        policy: BucketPolicy,
        pool: StatePool,
        modes: Iterable[ForwardMode],
        *,
        token_shape: tuple[int, ...] = (),
        dtype: Any = jnp.float32,
        inputs: Callable[[int], Any] | None = None,
        progress: Callable[[CompileRecord], None] | None = None,
    ) -> list[CompileRecord]:
        """Compiles every (mode, bucket) of ``policy`` for ``modes`` ahead of time, from
        all-padding metadata of each bucket. ``x`` is compiled as ``[T, *token_shape]`` of
        ``dtype``: ``(hidden,)`` for hidden states, ``()`` for token ids; or, when ``inputs``
        is given, as ``inputs(T)``, a pytree of ShapeDtypeStructs for a T-token bucket.
        Calls ``progress`` after each executable."""
        records = []
        for mode in modes:
            mode = ForwardMode(mode)
            for batch_size, num_tokens in policy.buckets(mode):
                if (mode, batch_size, num_tokens) in self._compiled_buckets:
                    continue
                meta = example_metadata(mode, batch_size, num_tokens, policy)
                start = time.perf_counter()
                program, meta = self._as_program(mode, meta)
                key = (program, batch_size, num_tokens)
                lower_s = 0.0
                if key not in self._compiled:
                    if inputs is None:
                        x = jax.ShapeDtypeStruct((num_tokens, *token_shape), dtype)
                    else:
                        x = inputs(num_tokens)
                    pool_shape = jax.tree.map(spec_of, pool)
                    self._compiled[key], lower_s = self._compile(program, pool_shape, x, meta)
                    self._compiled_shapes[key] = _shapes((pool_shape, x))
                self._compiled_buckets.add((mode, batch_size, num_tokens))
                record = CompileRecord(
                    mode, batch_size, num_tokens, 1e3 * (time.perf_counter() - start),
                    1e3 * lower_s,
                )  # fmt: skip
                records.append(record)
                if progress is not None:
                    progress(record)
        return records

    def _compile(self, program: ForwardMode, pool, x, meta: ForwardMetadata) -> tuple[Any, float]:
        """The executable of ``program`` for these argument shapes, and the seconds before
        XLA's compile (``CompileRecord.lower_ms``): through the program store when there is
        one (a stored program is neither traced nor lowered again)."""
        layout, x, packed = _pack(x, meta)
        packed = jax.ShapeDtypeStruct(packed.shape, packed.dtype)
        options = xla_flags.step_compiler_options(program in GRAPHED_PROGRAMS)
        if self.store is not None:
            params = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in self.params]
            key = ("step", program.value, self.impl, self.graphdef, self._params_tree, layout)
            stored = self.store.compile(
                functools.partial(self._forward_packed, program, layout),
                (params, pool, x, packed),
                key_parts=key,
                donate_argnums=(1,),
                compiler_options=options,
            )
            if stored is not None:
                return stored, stored.lower_s
        with on_mesh(self.mesh):
            start = time.perf_counter()
            lowered = self._jitted.lower(program, layout, self.params, pool, x, packed)
            lower_s = time.perf_counter() - start
            return lowered.compile(compiler_options=options), lower_s

    def executables(self) -> dict[tuple[ForwardMode, int, int], Any]:
        """The step executables compiled so far by (program, batch size, tokens)."""
        return dict(self._compiled)

    def __call__(self, pool: StatePool, x: jax.Array, meta: ForwardMetadata):
        """Runs one step; ``pool`` is donated (do not use it afterwards). Uses the executable
        compiled ahead of time for (mode, bucket) when there is one, else jit (a trace)."""
        program, meta = self._as_program(meta.mode, meta)
        key = (program, meta.batch_size, meta.num_tokens)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._check_shapes(key, pool, x)
        layout, x, packed = _pack(x, meta)
        if compiled is not None:
            return compiled(self.params, pool, x, packed)
        with on_mesh(self.mesh):
            return self._jitted(program, layout, self.params, pool, x, packed)

    def _check_shapes(self, key, pool, x) -> None:
        """Raises ``ValueError`` naming the first array of ``pool`` or ``x`` whose shape or
        dtype differs from what the executable of ``key`` was compiled for (the jit path's
        own checks, for the compiled path)."""
        got = _shapes((pool, x))
        want = self._compiled_shapes[key]
        if got == want:
            return
        mode, _, num_tokens = key
        leaves = jax.tree_util.tree_flatten_with_path((pool, x))[0]
        for (path, leaf), expected in zip(leaves, want[1], strict=False):
            if (leaf.shape, jnp.dtype(leaf.dtype)) != expected:
                where = "x" if path[0].idx == 1 else "pool" + jax.tree_util.keystr(path[1:])
                hint = f"; pad x to meta.num_tokens={num_tokens}" if where == "x" else ""
                raise ValueError(
                    f"{where} is {jnp.dtype(leaf.dtype).name}{list(leaf.shape)}, but the "
                    f"{mode.name} executable was compiled for "
                    f"{expected[1].name}{list(expected[0])}{hint}"
                )
        raise ValueError(
            f"the pool or x has another structure than the {mode.name} executable was "
            f"compiled for: {got[0]} vs {want[0]}"
        )

    @property
    def total_traces(self) -> int:
        return sum(self.trace_count.values())


def _pack(x: Any, meta: ForwardMetadata) -> tuple[MetadataLayout, Any, Any]:
    """(layout, x, vector) of a step's inputs: token ids (``x`` one int32 array, or its
    ShapeDtypeStruct) go into the metadata's vector, and ``x`` becomes None; any other ``x``
    (hidden states, a pytree) stays an operand of its own."""
    if getattr(x, "dtype", None) != jnp.int32:
        layout, packed = pack_metadata(meta)
        return layout, x, packed
    if isinstance(x, jax.ShapeDtypeStruct):
        x = np.zeros(x.shape, np.int32)  # a stand-in of its shape: only the layout is kept
    layout, packed = pack_metadata((x, meta))
    return layout, None, packed


def _shapes(tree: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    """The structure of ``tree`` and each leaf's (shape, dtype)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype)) for a in leaves)
