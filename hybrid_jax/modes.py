"""Forward modes, layer kinds and the one table that says which layer kind runs which mode.

A forward mode is a static argument of every jitted step. Whether a layer kind can run a
mode is looked up in ``CAPABILITIES`` and nowhere else: ``check_supported`` is called while
tracing, so an unsupported (layer kind, mode) pair fails at ``.lower()`` / ``eval_shape`` /
engine construction with a message naming the pair and what is supported, before anything
runs on a device.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType

__all__ = [
    "CAPABILITIES",
    "TOKEN_LAYOUTS",
    "ForwardMode",
    "LayerKind",
    "TokenLayout",
    "UnsupportedForwardModeError",
    "check_supported",
    "supported_modes",
    "token_layout",
]


class ForwardMode(enum.Enum):
    """Every forward mode the CUDA engines know, supported here or not (see ``CAPABILITIES``)."""

    EXTEND = "extend"
    DECODE = "decode"
    MIXED = "mixed"
    IDLE = "idle"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    DRAFT_EXTEND_V2 = "draft_extend_v2"
    SPLIT_PREFILL = "split_prefill"
    DLLM_EXTEND = "dllm_extend"
    PREBUILT = "prebuilt"

    @classmethod
    def _missing_(cls, value: object) -> ForwardMode | None:
        # Accept member names too ("DECODE"), as command lines and configs spell them.
        return cls.__members__.get(value.upper()) if isinstance(value, str) else None

    def is_extend(self) -> bool:
        """Ragged token layouts: rows of any length packed along one token axis."""
        return self in _EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in _DECODE_OR_IDLE

    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        """Both draft-extend variants (the draft model catching up on accepted tokens)."""
        return self in _DRAFT_EXTEND

    def is_speculative(self) -> bool:
        """Modes that exist only under speculative decoding: target verify and draft extend."""
        return self in _SPECULATIVE

    def is_split_prefill(self) -> bool:
        return self is ForwardMode.SPLIT_PREFILL

    def is_dllm_extend(self) -> bool:
        return self is ForwardMode.DLLM_EXTEND

    def is_prebuilt(self) -> bool:
        return self is ForwardMode.PREBUILT


# Module-level sets: an enum body would turn these into members.
_EXTEND = frozenset(
    {
        ForwardMode.EXTEND,
        ForwardMode.MIXED,
        ForwardMode.DRAFT_EXTEND,
        ForwardMode.DRAFT_EXTEND_V2,
        ForwardMode.SPLIT_PREFILL,
        ForwardMode.DLLM_EXTEND,
    }
)
_DECODE_OR_IDLE = frozenset({ForwardMode.DECODE, ForwardMode.IDLE})
_DRAFT_EXTEND = frozenset({ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2})
_SPECULATIVE = frozenset({ForwardMode.TARGET_VERIFY}) | _DRAFT_EXTEND


class LayerKind(enum.Enum):
    """The kinds of sequence-mixing layer a hybrid model stacks."""

    GDN = "gdn"
    FULL_ATTENTION = "full_attention"
    MAMBA2 = "mamba2"


class TokenLayout(enum.StrEnum):
    """How a mode lays its tokens out along the packed token axis (see docs/DESIGN.md)."""

    RAGGED = "ragged"  # rows of any length, marked by query_start_loc
    ONE_PER_ROW = "one_per_row"  # one token per row: token i belongs to row i
    DRAFT_PER_ROW = "draft_per_row"  # D tokens per row: tokens [i*D, (i+1)*D) belong to row i
    EMPTY = "empty"  # no rows and no tokens


_BUILT = frozenset(
    {
        ForwardMode.EXTEND,
        ForwardMode.DECODE,
        ForwardMode.MIXED,
        ForwardMode.IDLE,
        ForwardMode.TARGET_VERIFY,
        ForwardMode.DRAFT_EXTEND,
    }
)

CAPABILITIES: Mapping[LayerKind, frozenset[ForwardMode]] = MappingProxyType(
    {
        LayerKind.GDN: _BUILT,
        LayerKind.FULL_ATTENTION: _BUILT,
        LayerKind.MAMBA2: _BUILT,
    }
)
"""The one capability table: the forward modes each layer kind can be traced in."""

TOKEN_LAYOUTS: Mapping[ForwardMode, TokenLayout] = MappingProxyType(
    {
        ForwardMode.EXTEND: TokenLayout.RAGGED,
        ForwardMode.MIXED: TokenLayout.RAGGED,
        ForwardMode.DRAFT_EXTEND: TokenLayout.RAGGED,
        ForwardMode.DECODE: TokenLayout.ONE_PER_ROW,
        ForwardMode.TARGET_VERIFY: TokenLayout.DRAFT_PER_ROW,
        ForwardMode.IDLE: TokenLayout.EMPTY,
    }
)
"""The token layout of every mode that some layer kind supports."""


def _names(modes: Iterable[ForwardMode]) -> str:
    names = sorted(mode.name for mode in modes)
    return ", ".join(names) if names else "none"


class UnsupportedForwardModeError(NotImplementedError):
    """A forward mode reached code that has no path for it (raised while tracing).

    Attributes: ``mode``; ``supported``, the modes that code does have a path for;
    ``layer_kind``, the layer kind that refused, or None when the refusal is not a layer's
    (metadata, token layouts).
    """

    def __init__(
        self,
        mode: ForwardMode,
        supported: Iterable[ForwardMode],
        layer_kind: LayerKind | None = None,
        *,
        what: str | None = None,
    ) -> None:
        self.mode = mode
        self.supported = frozenset(supported)
        self.layer_kind = layer_kind
        if what is None:
            if layer_kind is None:
                raise TypeError("UnsupportedForwardModeError needs a layer_kind or a `what`")
            what = f"{layer_kind.value} layers do not support forward mode {mode.name}"
        super().__init__(f"{what}; supported: {_names(self.supported)}")


def supported_modes(kind: LayerKind | str) -> frozenset[ForwardMode]:
    """The forward modes layers of ``kind`` can run (a view of ``CAPABILITIES``)."""
    return CAPABILITIES[LayerKind(kind)]


def check_supported(kind: LayerKind | str, mode: ForwardMode | str) -> None:
    """Raises ``UnsupportedForwardModeError`` unless layers of ``kind`` can run ``mode``.

    Call it while tracing (it is plain Python on static values), so the failure surfaces at
    ``.lower()`` or engine construction instead of on a device.
    """
    kind, mode = LayerKind(kind), ForwardMode(mode)
    if mode not in CAPABILITIES[kind]:
        raise UnsupportedForwardModeError(mode, CAPABILITIES[kind], kind)


def token_layout(mode: ForwardMode | str) -> TokenLayout:
    """The token layout of ``mode``; raises ``UnsupportedForwardModeError`` if it has none."""
    mode = ForwardMode(mode)
    if mode not in TOKEN_LAYOUTS:
        raise UnsupportedForwardModeError(
            mode, TOKEN_LAYOUTS, what=f"no token layout for forward mode {mode.name}"
        )
    return TOKEN_LAYOUTS[mode]
