"""Reading a Hugging Face ``config.json`` into a model's config: the error a user fixes, the
fields every hybrid decoder's reader needs, and the Hugging Face conventions they share."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Collection, Iterator, Mapping
from typing import Any

__all__ = [
    "ConfigError",
    "config_errors",
    "hf_dtype",
    "hf_eos_token_ids",
    "read_config_json",
    "require_fields",
]


class ConfigError(ValueError):
    """A model configuration this implementation cannot build, with the field that says so."""


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Re-raises a layer config's ``ValueError`` as ``ConfigError``: the model's ``config.json``
    is what the user fixes, and the layer's message already names the field."""
    try:
        yield
    except ValueError as err:
        raise ConfigError(str(err)) from err


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The contents of a ``config.json`` file."""
    with open(path) as f:
        return json.load(f)


def require_fields(cls: type, config: Mapping[str, Any], derived: Collection[str]) -> None:
    """Raises ``ConfigError`` naming the fields of dataclass ``cls`` without a default that
    ``config`` lacks; names in ``derived`` are filled in by the caller and count as present."""
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.name not in config and f.name not in derived
    ]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")


def hf_eos_token_ids(config: Mapping[str, Any]) -> tuple[int, ...]:
    """``eos_token_id`` as a tuple: Hugging Face writes one id, a list, or null."""
    eos = config.get("eos_token_id")
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


def hf_dtype(config: Mapping[str, Any], override: str | None) -> str:
    """``override``, else the checkpoint's ``dtype`` (``torch_dtype`` in older files), else
    float32."""
    return override or config.get("dtype") or config.get("torch_dtype") or "float32"
