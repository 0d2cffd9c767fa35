"""Forward modes, layer kinds, and the two tables that describe them.

A forward mode is a static argument of every jitted step. ``MODES`` holds one row per mode
that is built: its token layout, what a row of it may carry, and which engine roles compile
it (read by the metadata builder, the backend's path tables and the engine).
``CAPABILITIES`` says which layer kind runs which mode; ``check_supported`` is called while
tracing, so an unsupported (layer kind, mode) pair fails at ``.lower()`` / ``eval_shape`` /
engine construction with a message naming the pair and what is supported, before anything
runs on a device.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType

__all__ = [
    "CAPABILITIES",
    "DRAFT",
    "MODES",
    "EngineRole",
    "TOKEN_LAYOUTS",
    "ForwardMode",
    "LayerKind",
    "ModeSpec",
    "TokenLayout",
    "UnsupportedForwardModeError",
    "check_supported",
    "modes_for",
    "program_mode",
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


class EngineRole(enum.Enum):
    """What an engine's model does, which decides the modes it compiles (``modes_for``)."""

    SERVING = "serving"  # a plain engine: prompts (EXTEND), decodes (DECODE), both (MIXED)
    VERIFYING = "verifying"  # a speculative engine's model: prompts, and verifying drafts
    DRAFTING = "drafting"  # a draft model (the MTP head): prompts, accepted tokens, decodes


DRAFT = "D"
"""In a ``ModeSpec``: the policy's draft tokens per row (``BucketPolicy.num_draft_tokens``)."""

type RowTokens = int | str | None  # a count, DRAFT, or None (bounded by the token bucket)


@dataclasses.dataclass(frozen=True)
class ModeSpec:
    """One mode's row: how it lays its tokens out and what each of its rows may carry.

    ``min_row_tokens`` / ``max_row_tokens``: the new tokens of one row (``None``: bounded
    only by the token bucket); ``tokens_per_row``: the token axis is ``bs * tokens_per_row``
    (``None``: a token bucket); ``num_draft_tokens``: ``ForwardMetadata.num_draft_tokens``.
    Each may be ``DRAFT``. ``hint``: the fix for a row that breaks the bounds; ``roles``: the
    engine roles that compile the mode. Two rows compare equal when they compute the same
    function: ``hint`` and ``roles`` take no part (``program_mode``).
    """

    layout: TokenLayout
    min_row_tokens: RowTokens
    max_row_tokens: RowTokens
    tokens_per_row: RowTokens
    num_draft_tokens: RowTokens
    hint: str = dataclasses.field(compare=False)
    roles: frozenset[EngineRole] = dataclasses.field(default=frozenset(), compare=False)

    @property
    def has_rows(self) -> bool:
        """False for the empty layout: the mode's single bucket is (0, 0)."""
        return self.layout is not TokenLayout.EMPTY

    def resolved(self, num_draft_tokens: int) -> ModeSpec:
        """This row with every ``DRAFT`` replaced by ``num_draft_tokens``."""

        def count(value: RowTokens) -> RowTokens:
            return num_draft_tokens if value == DRAFT else value

        return dataclasses.replace(
            self, min_row_tokens=count(self.min_row_tokens),
            max_row_tokens=count(self.max_row_tokens), tokens_per_row=count(self.tokens_per_row),
            num_draft_tokens=count(self.num_draft_tokens),
        )  # fmt: skip


_ROLES = frozenset(EngineRole)
_RAGGED_HINT = "leave requests without new tokens out of the batch"

# fmt: off
MODES: Mapping[ForwardMode, ModeSpec] = MappingProxyType(
    {
        ForwardMode.EXTEND: ModeSpec(TokenLayout.RAGGED, 1, None, None, 0, _RAGGED_HINT, _ROLES),
        ForwardMode.MIXED: ModeSpec(
            TokenLayout.RAGGED, 1, None, None, 0, _RAGGED_HINT, frozenset({EngineRole.SERVING})
        ),
        ForwardMode.DECODE: ModeSpec(
            TokenLayout.ONE_PER_ROW, 1, 1, 1, 1, "send longer rows as EXTEND or MIXED",
            frozenset({EngineRole.SERVING, EngineRole.DRAFTING}),
        ),
        ForwardMode.TARGET_VERIFY: ModeSpec(
            TokenLayout.DRAFT_PER_ROW, DRAFT, DRAFT, DRAFT, DRAFT,
            "pad every draft to D tokens (BucketPolicy.num_draft_tokens)",
            frozenset({EngineRole.VERIFYING}),
        ),
        # A fixed bs*D token axis, ragged within it: the draft model catching up on accepted
        # tokens, 1..D per row.
        ForwardMode.DRAFT_EXTEND: ModeSpec(
            TokenLayout.RAGGED, 1, DRAFT, DRAFT, DRAFT,
            "a draft-extend row carries the accepted drafts plus one token",
            frozenset({EngineRole.DRAFTING}),
        ),
        # No role compiles IDLE: it is the step of a data-parallel rank with no work.
        ForwardMode.IDLE: ModeSpec(TokenLayout.EMPTY, 0, 0, 0, 0, ""),
    }
)
# fmt: on
"""One row per built mode; a mode missing here has no metadata, no layout and no path."""

TOKEN_LAYOUTS: Mapping[ForwardMode, TokenLayout] = MappingProxyType(
    {mode: spec.layout for mode, spec in MODES.items()}
)
"""The token layout of every built mode (a view of ``MODES``)."""

_BUILT = frozenset(MODES)

CAPABILITIES: Mapping[LayerKind, frozenset[ForwardMode]] = MappingProxyType(
    {
        LayerKind.GDN: _BUILT,
        LayerKind.FULL_ATTENTION: _BUILT,
        LayerKind.MAMBA2: _BUILT,
    }
)
"""The one capability table: the forward modes each layer kind can be traced in."""


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


def program_mode(mode: ForwardMode | str) -> ForwardMode:
    """The mode whose step program runs ``mode``: the first mode of ``MODES`` with an equal row.

    The layers read a mode only through its row (its token layout and bounds) and the
    capability table, so modes with equal rows compute the same function of the same
    metadata: MIXED runs EXTEND's program (the scheduler tells them apart, the layers do not)
    and needs no executable of its own. Capabilities stay per mode: check them for ``mode``.
    """
    mode = ForwardMode(mode)
    if mode not in MODES:
        return mode  # no row, no program: tracing it raises UnsupportedForwardModeError
    return next(m for m, spec in MODES.items() if spec == MODES[mode])


def modes_for(role: EngineRole) -> tuple[ForwardMode, ...]:
    """The modes an engine in ``role`` compiles, in the order of ``MODES``."""
    return tuple(mode for mode, spec in MODES.items() if role in spec.roles)


def token_layout(mode: ForwardMode | str) -> TokenLayout:
    """The token layout of ``mode``; raises ``UnsupportedForwardModeError`` if it has none."""
    mode = ForwardMode(mode)
    if mode not in TOKEN_LAYOUTS:
        raise UnsupportedForwardModeError(
            mode, TOKEN_LAYOUTS, what=f"no token layout for forward mode {mode.name}"
        )
    return TOKEN_LAYOUTS[mode]
