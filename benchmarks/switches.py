"""Module-level switches set for a block: a benchmark's variants, each traced with its own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

__all__ = ["switches_set"]


@contextlib.contextmanager
def switches_set(values: Mapping[tuple[ModuleType, str], Any]) -> Iterator[None]:
    """Sets module-level settings (``values``: ``(module, name) -> value``, such as the
    switches ``hybrid_jax.engine.startup.tracing_switches`` reads) for the ``with`` block, and
    puts each back as it was when the block ends, raised or not. What is traced inside sees
    the values set."""
    before = {key: getattr(*key) for key in values}
    try:
        for (module, name), value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for (module, name), value in before.items():
            setattr(module, name, value)
