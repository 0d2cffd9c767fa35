"""Start-up of an engine: JAX's persistent compilation cache and the progress bar of the
ahead-of-time compilation."""

from __future__ import annotations

import sys

import jax
from jax.experimental.compilation_cache import compilation_cache

__all__ = ["Progress", "use_compilation_cache"]


def use_compilation_cache(path: str) -> None:
    """Points JAX's persistent compilation cache at ``path`` and caches every executable."""
    # The cache directory is read once, when the first compile initialises the cache; a
    # different directory needs a reset to take effect.
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()
    # Our executables are small on CPU: cache every one, however quick to compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class Progress:
    """A one-line progress bar on stderr (one line per few items when not a terminal)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.interactive = sys.stderr.isatty()

    def __call__(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.interactive:
            bar = "#" * (30 * self.done // self.total)
            end = "\n" if self.done == self.total else ""
            print(
                f"\rcompiling [{bar:<30}] {self.done}/{self.total} {label:<24}",
                end=end,
                file=sys.stderr,
                flush=True,
            )
        elif self.done == self.total or self.done % 8 == 0:
            print(f"compiled {self.done}/{self.total} executables", file=sys.stderr, flush=True)
