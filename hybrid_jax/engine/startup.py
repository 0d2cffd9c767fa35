"""Start-up of an engine: JAX's persistent compilation cache."""

from __future__ import annotations

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["use_compilation_cache"]


def use_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at ``path`` and caches every executable."""
    # The cache directory is read once, when the first compile initialises the cache; a
    # different directory needs a reset to take effect.
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    # Our executables are small on CPU: cache every one, however quick to compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
