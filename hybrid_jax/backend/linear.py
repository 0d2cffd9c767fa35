"""What the linear mixers (GDN, Mamba2) share: their result type, the verify states they hand
to the commit, and the reshapes of the fixed tokens-per-row layouts.

A linear mixer has one path per token layout (``modes.TokenLayout``): ragged (EXTEND, MIXED,
DRAFT_EXTEND) runs the chunked scan over ``query_start_loc``; one token per row (DECODE) and
D tokens per row (TARGET_VERIFY) run the recurrent kernels on ``[bs, D, ...]`` rows; the empty
layout (IDLE) touches nothing. ``mix_path`` picks the path for the step's mode while tracing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax

from hybrid_jax.metadata import ForwardMetadata
from hybrid_jax.modes import LayerKind, TokenLayout, check_supported, token_layout

__all__ = [
    "LinearLayerOutput",
    "LinearMixResult",
    "VerifyStack",
    "VerifyStates",
    "mix_path",
    "rows",
    "tree_args",
]


class VerifyStates(NamedTuple):
    """What TARGET_VERIFY hands to the commit after acceptance (one linear layer).

    windows: ``[bs, D, C, W-1]`` conv window after each draft token;
    ssm: ``[bs, D, HV, K, V]`` (GDN) or ``[bs, D, H, P, N]`` (Mamba2) float32 state after each
    draft token. In a tree step (``meta.tree``) "after token t" means after t's root path:
    each token starts from its parent's state and window, so committing node t is the same
    index lookup as committing a chain's step t.
    """

    windows: jax.Array
    ssm: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyStack:
    """The verify states of the linear layers ``layers`` (static: their indices in the pool,
    in the order of the leading axis), as a model's forward returns them: one stack per layer
    outside a scan, one per position of a scanned block inside one.

    windows: ``[n, bs, D, C, W-1]``; ssm: ``[n, bs, D, *ssm_shape]`` (see ``VerifyStates``).
    """

    windows: jax.Array
    ssm: jax.Array
    layers: tuple[int, ...] = dataclasses.field(metadata={"static": True})


class LinearMixResult(NamedTuple):
    """out: the scan's output per token (``[T, HV, V]`` for GDN, ``[T, H, P]`` for Mamba2);
    the layer's pools after the step; for TARGET_VERIFY the per-token states (the pools are
    then returned unchanged), else ()."""

    out: jax.Array
    conv_state: jax.Array
    ssm_state: jax.Array
    verify: VerifyStates | tuple[()]


def rows(x: jax.Array, meta: ForwardMetadata) -> jax.Array:
    """Packed tokens ``[bs*D, ...]`` -> ``[bs, D, ...]`` (fixed tokens-per-row layouts)."""
    return x.reshape(meta.batch_size, -1, *x.shape[1:])


def tree_args(meta: ForwardMetadata) -> dict[str, jax.Array]:
    """The verify ops' ``parents`` for a tree step; none for a chain-only step, which keeps
    the kernels' chain path."""
    return {"parents": meta.parents} if meta.tree else {}


def mix_path[Path: Callable[..., LinearMixResult]](
    kind: LayerKind, paths: Mapping[TokenLayout, Path], meta: ForwardMetadata
) -> Path:
    """The path of ``paths`` for ``meta.mode``; raises ``UnsupportedForwardModeError`` while
    tracing when layers of ``kind`` cannot run the mode."""
    check_supported(kind, meta.mode)
    return paths[token_layout(meta.mode)]


class LinearLayerOutput(NamedTuple):
    """What a linear layer (GDN, Mamba2) returns: y ``[T, hidden]``; its pools after the
    step; verify states or ()."""

    y: jax.Array
    conv_state: jax.Array
    ssm_state: jax.Array
    verify: VerifyStates | tuple[()]
