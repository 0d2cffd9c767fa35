"""Reading a Hugging Face ``config.json`` into a model's config: the error a user fixes, the
fields every hybrid decoder's reader needs, and the Hugging Face conventions they share."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import typing
from collections.abc import Collection, Iterator, Mapping
from typing import Any

__all__ = [
    "ConfigError",
    "HFConfig",
    "check_model_type",
    "check_eos_in_vocabulary",
    "check_field_types",
    "config_errors",
    "hf_dtype",
    "hf_eos_token_ids",
    "read_config_json",
    "read_generation_config",
    "require_fields",
]


class ConfigError(ValueError):
    """A model configuration this implementation cannot build, with the field that says so."""


class HFConfig:
    """A model family's config, read from Hugging Face's ``config.json``: the family gives
    ``from_hf_dict(config, *, dtype)``, ``from_json`` reads the file for it."""

    @classmethod
    def from_json(cls, path: str | os.PathLike, *, dtype: str | None = None) -> typing.Self:
        """From a ``config.json`` file (see the family's ``from_hf_dict``)."""
        return cls.from_hf_dict(read_config_json(path), dtype=dtype)


def check_model_type(config: Mapping[str, Any], model_type: str, family: str) -> None:
    """Raises ``ConfigError`` unless ``config``'s ``model_type`` (``model_type`` when absent)
    is ``model_type``, the one the ``family``'s loader builds."""
    got = config.get("model_type", model_type)
    if got != model_type:
        raise ConfigError(
            f"model_type={got!r}: this loader builds {family} ({model_type!r}) models"
        )


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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _matches(value: object, hint: Any) -> bool:
    """Whether a JSON value is of the field type ``hint`` (int, float, bool, str, optional,
    or a tuple of one of those)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is_int(value)
    if hint is float:
        return _is_int(value) or isinstance(value, float)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        return isinstance(value, list | tuple) and all(_matches(v, args[0]) for v in value)
    if args and type(None) in args:  # X | None
        return value is None or any(_matches(value, a) for a in args if a is not type(None))
    return True  # a type this check does not know: the config's own checks decide


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_PLURALS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def check_field_types(cls: type, values: Mapping[str, Any]) -> None:
    """Raises ``ConfigError`` naming the first field of ``values`` (config.json's) whose JSON
    type does not fit dataclass ``cls``'s field: a string for a number, ``"false"`` for a
    boolean, a number for a list."""
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        hint = hints.get(name)
        if hint is not None and not _matches(value, hint):
            args = typing.get_args(hint)
            want = _NAMES.get(hint) or (
                f"a list of {_PLURALS.get(args[0], args[0])}" if typing.get_origin(hint) is tuple
                else str(hint)
            )  # fmt: skip
            raise ConfigError(f"config.json: {name}={value!r} must be {want}")


def hf_eos_token_ids(config: Mapping[str, Any], where: str = "config.json") -> tuple[int, ...]:
    """``eos_token_id`` as a tuple: Hugging Face writes one id, a list, or null. Raises
    ``ConfigError`` (naming the file ``where``) for anything else (a string, a boolean, a
    negative id)."""
    eos = config.get("eos_token_id")
    ids = () if eos is None else (eos,) if not isinstance(eos, list) else tuple(eos)
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError(
            f"{where}: eos_token_id={eos!r} must be a token id (an integer >= 0), a list "
            f"of them, or null"
        )
    return ids


def read_generation_config(folder: str | os.PathLike) -> tuple[dict[str, Any], tuple[int, ...]]:
    """A checkpoint's ``generation_config.json``: the sampling defaults it sets, as
    ``SamplingParams`` fields (``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``;
    ``do_sample: false`` is greedy), and its ``eos_token_id``s. ``({}, ())`` when the folder
    has none. Raises ``ConfigError`` naming a field of the wrong type."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.exists(path):
        return {}, ()
    where = "generation_config.json"
    try:
        raw = read_config_json(path)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} holds {type(raw).__name__}, not a JSON object")
    fields: dict[str, Any] = {}
    for name, kind, want in (
        ("temperature", (int, float), "a number"),
        ("top_p", (int, float), "a number"),
        ("top_k", (int,), "an integer"),
        ("max_new_tokens", (int,), "an integer"),
        ("do_sample", (bool,), "true or false"),
    ):
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kind):
            raise ConfigError(f"{where}: {name}={value!r} must be {want}")
        fields[name] = value
    if fields.pop("do_sample", True) is False:
        fields["temperature"] = 0.0
    return fields, hf_eos_token_ids(raw, where)


def hf_dtype(config: Mapping[str, Any], override: str | None) -> str:
    """``override``, else the checkpoint's ``dtype`` (``torch_dtype`` in older files), else
    float32."""
    return override or config.get("dtype") or config.get("torch_dtype") or "float32"


def check_eos_in_vocabulary(eos_token_id: tuple[int, ...], vocab_size: int) -> None:
    """Raises ``ConfigError`` for an end-of-sequence id that no token can take."""
    bad = [i for i in eos_token_id if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"eos_token_id {bad} is outside the vocabulary (ids 0..{vocab_size - 1})")
