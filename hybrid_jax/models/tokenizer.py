"""Tokenizers: the built-in byte-level one, and a checkpoint's ``tokenizer.json``.

Both offer ``encode(text) -> list[int]``, ``decode(ids) -> str`` and ``vocab_size``. A
``tokenizer.json`` is read with Hugging Face's ``tokenizers`` package, imported only when
such a file is loaded, so the byte-level default needs nothing beyond the project. The
checkpoint's chat template (``chat_template`` of ``tokenizer_config.json``, or a
``chat_template.jinja`` file) comes with it and renders conversations
(``HFTokenizer.apply_chat_template``, in a sandboxed Jinja environment as Hugging Face's).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "TextStream",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]


class TokenizerError(ValueError):
    """A missing or unreadable tokenizer, or ids a tokenizer cannot decode."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TextStream:
    """The text of a growing token sequence, decoded a few tokens at a time.

    Each ``extend`` decodes only the tokens since the last text it returned plus the new ones
    (a window of a few tokens), so a long generation costs O(1) per token instead of
    re-decoding the whole output. Text that ends in a partial character (U+FFFD: a
    multi-byte character whose last bytes are still to come) is held back until a later token
    completes it, or until ``final``.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._start = 0  # the window: tokens [start, end) produced the text returned last
        self._end = 0

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def extend(self, ids: Sequence[int], *, final: bool = False) -> str:
        """The new text that ``ids`` (the tokens after those seen so far) complete."""
        self._ids.extend(int(i) for i in ids)
        shown = self._tokenizer.decode(self._ids[self._start : self._end])
        text = self._tokenizer.decode(self._ids[self._start :])
        if len(text) <= len(shown) or (text.endswith("\ufffd") and not final):
            return ""
        self._start, self._end = self._end, len(self._ids)
        return text[len(shown) :]


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

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a token may hold part of a character)."""
        self.decode([token_id])  # the range check
        return bytes([int(token_id)])

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the ``Tokenizer`` protocol, with the checkpoint's
    chat template (None when it has none) and the special tokens the template may name.

    ``add_bos`` (``add_bos_token`` of ``tokenizer_config.json``): ``encode`` starts a text
    with the BOS token unless it already does (a chat template writes its own); the
    tokenizer's post-processor is never applied on top."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str] | None = None,
        *,
        add_bos: bool = False,
    ):
        self._tokenizer = tokenizer
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.bos_token_id: int | None = None
        if add_bos:
            bos = self.special_tokens.get("bos_token")
            self.bos_token_id = None if bos is None else tokenizer.token_to_id(bos)
            if self.bos_token_id is None:
                raise TokenizerError(
                    f"tokenizer_config.json: add_bos_token is true but bos_token={bos!r} is "
                    f"not a token of tokenizer.json"
                )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> str:
        """The prompt text of a conversation (``[{"role": ..., "content": ...}, ...]``) under
        the checkpoint's template; ``variables`` are the template's own switches (Qwen3.5:
        ``enable_thinking=False`` opens the answer with an empty ``<think>`` block)."""
        if self.chat_template is None:
            raise TokenizerError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "and no chat_template.jinja); pass the prompt as text instead"
            )
        try:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError as err:
            raise TokenizerError("chat templates need jinja2: pip install jinja2") from err

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"the chat template refused the conversation: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **variables,
            )
        except TemplateError as err:
            raise TokenizerError(f"the chat template does not render: {err}") from err

    def encode(self, text: str) -> list[int]:
        ids = list(self._tokenizer.encode(text, add_special_tokens=False).ids)
        if self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

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
        tokenizer = tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises its own exception type
        raise TokenizerError(f"{path} is not a readable tokenizer.json: {err}") from err
    template, special, add_bos = _chat_template(pathlib.Path(folder))
    return HFTokenizer(tokenizer, template, special, add_bos=add_bos)


def _chat_template(folder: pathlib.Path) -> tuple[str | None, dict[str, str], bool]:
    """The folder's chat template (``chat_template.jinja``, else ``chat_template`` of
    ``tokenizer_config.json``; of a list of named templates, the ``default`` one), the
    special tokens ``tokenizer_config.json`` names (``bos_token``, ``eos_token``, ...) and
    its ``add_bos_token`` (False when absent)."""
    config_path = folder / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as err:
            raise TokenizerError(f"{config_path} is not valid JSON: {err}") from err
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(key)
        value = value.get("content") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            special[key] = value
    add_bos = config.get("add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise TokenizerError(f"{config_path}: add_bos_token={add_bos!r} must be true or false")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), special, add_bos
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return (template if isinstance(template, str) else None), special, add_bos
