"""Start-up of an engine: JAX's persistent compilation cache, and a store of exported programs.

JAX's persistent cache keys an executable on its lowered module, so a warm start still traces
and lowers every step; lowering the Pallas Mosaic GPU kernels (their layout inference) is most
of that time. ``ProgramStore`` keeps each step's lowered program on disk (``jax.export``),
found by a key of what determines it other than the trace, so that a warm start reads the
program back, lowers only the thin call around it and finds the executable in the cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pathlib
import pickle
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = [
    "ProgramStore",
    "StoredProgram",
    "code_fingerprint",
    "tracing_switches",
    "use_compilation_cache",
]

log = logging.getLogger(__name__)

# Custom calls that the step programs contain: Pallas Mosaic GPU kernels (ours and tokamax's)
# and the buffers they allocate. Their lowered form is valid for the jax version that wrote
# it, which the key holds.
_CUSTOM_CALLS = ("mosaic_gpu_v2", "AllocateBuffer")
_PACKAGES = ("hybrid_jax", "pallas_kernels")
_VERSIONED = ("jax", "jaxlib", "flax", "tokamax")
# Module-level settings that the layers read while tracing a step: a program traced with
# other values is another program (a user or a benchmark may set them at run time).
_SWITCHES = {
    "hybrid_jax.layers.linear": (
        "ADD_IN_OUTPUT_LAUNCH",
        "ADDS_FOR_SHORT_SUMS",
        "FEW_ROWS",
        "MIN_SPLITS",
        "NORMS_IN_LAUNCH",
        "RESIDUAL_IN_PRODUCT",
        "SPLIT_OUTPUT_PROJECTIONS",
    ),
    "hybrid_jax.layers.gdn": ("NORM_IN_DECODE_KERNEL",),
    "hybrid_jax.models.layer_scan": ("CARRY_SQUARE_SUMS", "DECODE_SCAN_UNROLLED"),
    "hybrid_jax.layers.moe": (
        "BY_ID_MAX_PAIRS",
        "COMBINE_IN_LAUNCH",
        "EXPERTS_IN_ONE_LAUNCH",
        "HIDDEN_IN_EXPERT_LAUNCH",
        "PAIR_DENSE_SWIGLU",
        "RANKED_TOP_K_TOKENS",
        "RANKING_IN_ROUTER_LAUNCH",
        "SHARED_DOWN_WITH_EXPERTS",
        "SHARED_HIDDEN_WITH_EXPERTS",
        "SOFTMAX_IN_RANKING",
        "SPLIT_ROUTER_LAUNCH",
    ),
    "hybrid_jax.backend.attention": (
        "MERGE_IN_LAUNCH",
        "ROWS_IN_KERNEL",
        "TOKEN_BLOCK",
        "QUERY_BLOCK",
        "KEY_CHUNK",
    ),
    "hybrid_jax.backend.gdn": ("CONV_IN_DECODE_KERNEL", "CONV_IN_DECODE_KERNEL_MAX_ROWS"),
    "hybrid_jax.engine.sampling": ("ONE_PASS_GREEDY",),
    "pallas_kernels._skinny": ("STAGES", "OVERLAP_PRODUCTS", "SWAP_OPERANDS", "RING_FILLS_SM"),
}


def use_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at ``path`` and caches every executable."""
    # The cache directory is read once, when the first compile initialises the cache; a
    # different directory needs a reset to take effect.
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    # Our executables are small on CPU: cache every one, however quick to compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@functools.cache
def code_fingerprint() -> str:
    """A digest of what shapes a traced program besides its arguments: the source files of
    hybrid_jax and pallas_kernels, the versions of jax, jaxlib, flax and tokamax, the
    backend and its device, ``XLA_FLAGS`` and JAX's configuration."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    for name in _VERSIONED:
        try:
            version = importlib.import_module(name).__version__
        except ImportError:
            version = "absent"
        digest.update(f"{name}={version};".encode())
    device = jax.devices()[0]
    digest.update(f"{device.platform};{getattr(device, 'device_kind', '')};".encode())
    digest.update(device.client.platform_version.encode())
    digest.update(os.environ.get("XLA_FLAGS", "").encode())
    config = {k: v for k, v in jax.config.values.items() if "cache" not in k}
    digest.update(repr(sorted(config.items(), key=lambda kv: kv[0])).encode())
    return digest.hexdigest()


def tracing_switches() -> dict[str, Any]:
    """The current values of the module-level settings read while tracing a step
    (``layers.linear.FEW_ROWS``, ``layers.moe.SHARED_DOWN_WITH_EXPERTS`` and the like), by
    qualified name."""
    return {
        f"{module}.{name}": getattr(importlib.import_module(module), name)
        for module, names in _SWITCHES.items()
        for name in names
    }


def _stable_repr(value: Any) -> str:
    """``repr`` without object addresses (a graph definition names functions by address)."""
    return re.sub(r" at 0x[0-9a-f]+", "", repr(value))


class StoredProgram:
    """A compiled program over flat arguments: call it with the pytree arguments it was
    exported for; it returns the pytree the traced function returned."""

    def __init__(self, compiled: jax.stages.Compiled, out_tree: Any, lower_s: float = 0.0):
        """``lower_s``: the seconds before XLA's compile (exporting the program, or reading
        it, and lowering the exported call)."""
        self._compiled = compiled
        self._out_tree = out_tree
        self.lower_s = lower_s

    def __call__(self, *args: Any) -> Any:
        return jax.tree.unflatten(self._out_tree, self._compiled(*jax.tree.leaves(args)))

    def memory_analysis(self) -> Any:
        """The compiled program's memory use (``jax.stages.Compiled.memory_analysis``)."""
        return self._compiled.memory_analysis()

    def as_text(self) -> str:
        """The compiled program's optimised HLO (``jax.stages.Compiled.as_text``)."""
        return self._compiled.as_text()


class ProgramStore:
    """Lowered programs in ``directory``, one file per key.

    The key covers ``code_fingerprint()``, ``tracing_switches()`` and what the caller names
    (the model's graph definition, the arguments' structure, shapes and dtypes, the static
    choices). Code changed
    at run time (a monkeypatched function) is not part of it: build engines with
    ``EngineConfig(program_store=False)`` while doing that.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)

    def key(self, *parts: Any) -> str:
        digest = hashlib.sha256(code_fingerprint().encode())
        for part in (tracing_switches(), *parts):
            digest.update(_stable_repr(part).encode())
            digest.update(b"\0")
        return digest.hexdigest()

    def compile(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any],
        *,
        key_parts: Sequence[Any],
        donate_argnums: Sequence[int] = (),
        compiler_options: dict[str, Any] | None = None,
    ) -> StoredProgram | None:
        """``fn(*args)`` compiled from the stored program of its key, exported and stored
        first when there is none (``args``: pytrees of arrays or ShapeDtypeStructs), with XLA's
        ``compiler_options`` (not part of the key: they do not change the program).
        Returns None, with a log line, when the program cannot be exported; errors raised
        while tracing ``fn`` propagate."""
        start = time.perf_counter()
        leaves, in_tree = jax.tree.flatten(tuple(args))
        avals = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in leaves]
        key = self.key(*key_parts, in_tree, [(a.shape, a.dtype) for a in avals])
        path = self.directory / f"{key}.program"
        stored = self._read(path)
        if stored is None:
            out_trees = []

            def flat(*flat_args):
                out = fn(*jax.tree.unflatten(in_tree, flat_args))
                out_leaves, out_tree = jax.tree.flatten(out)
                out_trees.append(out_tree)
                return out_leaves

            checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in _CUSTOM_CALLS]
            try:
                exported = jax.export.export(jax.jit(flat), disabled_checks=checks)(*avals)
            except ValueError as err:
                if "custom call" not in str(err).lower():
                    raise
                log.info("not storing a program (%s): %s", key_parts[:1], err)
                return None
            stored = exported, out_trees[0]
            self._write(path, (bytes(exported.serialize()), out_trees[0]))
        exported, out_tree = stored
        donated = _leaf_indices(args, donate_argnums)
        lowered = jax.jit(exported.call, donate_argnums=donated).lower(*avals)
        lower_s = time.perf_counter() - start
        return StoredProgram(lowered.compile(compiler_options=compiler_options), out_tree, lower_s)

    def _read(self, path: pathlib.Path) -> tuple[Any, Any] | None:
        try:
            payload, out_tree = pickle.loads(path.read_bytes())
            return jax.export.deserialize(bytearray(payload)), out_tree
        except FileNotFoundError:
            return None
        except Exception as err:  # a partial or foreign file: export the program again
            log.warning("ignoring the unreadable stored program %s (%s)", path, err)
            return None

    def _write(self, path: pathlib.Path, value: Any) -> None:
        # Written whole, then renamed: processes sharing the store never read half a file.
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(value, f)
        os.replace(tmp, path)


def _leaf_indices(args: Sequence[Any], argnums: Sequence[int]) -> tuple[int, ...]:
    """The flat positions of the leaves of ``args[i]`` for every ``i`` in ``argnums``."""
    indices, start = [], 0
    for i, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if i in argnums:
            indices.extend(range(start, start + count))
        start += count
    return tuple(indices)
