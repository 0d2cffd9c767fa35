"""Tokenizers: the built-in byte-level one, and a checkpoint's ``tokenizer.json``.

Both offer ``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``vocab_size``. A
``tokenizer.json`` is read with Hugging Face's ``tokenizers`` package, imported only when
such a file is loaded, so the byte-level default needs nothing beyond the project.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]


class TokenizerError(ValueError):
    """A missing or unreadable tokenizer, or ids a tokenizer cannot decode."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Token i is byte i (vocabulary 256); decoding replaces invalid UTF-8 with U+FFFD."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise TokenizerError(
                f"token ids {bad[:5]} are outside the byte vocabulary 0..255; the byte "
                f"tokenizer decodes only ids of the built-in model"
            )
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the ``Tokenizer`` protocol."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size})"


def load_tokenizer(folder: str | os.PathLike) -> HFTokenizer:
    """The ``tokenizer.json`` of a checkpoint folder (needs the ``tokenizers`` package)."""
    path = pathlib.Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"{path} does not exist; copy the checkpoint's tokenizer.json there, or use "
            f"ByteTokenizer() with the built-in model"
        )
    try:
        import tokenizers
    except ImportError as err:
        raise TokenizerError(
            f"reading {path} needs the 'tokenizers' package: pip install tokenizers"
        ) from err
    try:
        return HFTokenizer(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as err:  # the Rust side raises its own exception type
        raise TokenizerError(f"{path} is not a readable tokenizer.json: {err}") from err
