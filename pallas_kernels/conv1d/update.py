"""Causal conv1d on rows of D tokens: decode (``causal_conv1d_update``, writes the pool) and
speculative verification (``causal_conv1d_verify``, returns the window after every token and
leaves the pool alone).

The Mosaic GPU kernels live in ``update_mgpu.py`` (same arguments plus ``interpret``); its
``unsupported_reason`` decides whether ``impl="auto"`` may take them.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels._tree import check_parents
from pallas_kernels.conv1d import reference, update_mgpu
from pallas_kernels.conv1d._checks import check_rows

__all__ = ["causal_conv1d_update", "causal_conv1d_verify"]


def _resolve(op: str, impl: str, args: tuple, activation: str | None, **tree) -> str:
    reason = update_mgpu.unsupported_reason(*args, activation=activation, **tree)
    return resolve_impl(op, impl, reason)


def causal_conv1d_update(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """D tokens per row after the row's saved window; the window moves on by D tokens.

    Args:
      x: ``[N, D, C]`` inputs (decode: D=1).
      weight: ``[C, W]`` taps; bias: ``[C]`` or None.
      conv_pool: ``[S, C, W-1]`` in x's dtype; row n continues ``pool[state_indices[n]]``.
        Donate it under jit for an in-place update.
      state_indices: int32 ``[N]`` slots, distinct among real rows. A row at the pad slot 0
        is a padded row: its outputs are zeros and it writes nothing.
      activation: ``"silu"`` or None.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      y ``[N, D, C]`` in x's dtype, and the pool with each row's window after its last token.
    """
    op = "causal_conv1d_update"
    args = (x, weight, bias, conv_pool, state_indices)
    check_rows(op, *args, activation)
    which = _resolve(op, impl, args, activation)
    if which == "reference":
        return reference.causal_conv1d_update(*args, activation=activation)
    return update_mgpu.causal_conv1d_update(
        *args, activation=activation, interpret=which == "interpret"
    )


def causal_conv1d_verify(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    state_indices: jax.Array,
    *,
    parents: jax.Array | None = None,
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """D draft tokens per row after the row's saved window, keeping every window.

    Arguments as ``causal_conv1d_update``: x ``[N, D, C]``, weight ``[C, W]``, bias ``[C]`` or
    None, conv_pool ``[S, C, W-1]``, state_indices int32 ``[N]``. ``parents``: None for chain
    drafts, or int32 ``[N, D]`` tree drafts in topological order (``-1`` for token 0, the
    root; ``0 <= parents[n, t] < t`` otherwise): token t's window is the one after its
    parent, i.e. its root path's inputs, not the tokens before it in the row.

    Returns:
      y ``[N, D, C]`` in x's dtype, and windows ``[N, D, C, W-1]`` in the pool's dtype:
      ``windows[n, t]`` is row n's window after its token t (zeros on padded rows, slot 0).
      The pool is not written;
      ``commit_windows`` stores the accepted window afterwards.
    """
    op = "causal_conv1d_verify"
    args = (x, weight, bias, conv_pool, state_indices)
    check_rows(op, *args, activation)
    check_parents(op, parents, *x.shape[:2])
    which = _resolve(op, impl, args, activation, parents=parents)
    if which == "reference":
        return reference.causal_conv1d_verify(*args, parents=parents, activation=activation)
    return update_mgpu.causal_conv1d_verify(
        *args, parents=parents, activation=activation, interpret=which == "interpret"
    )
