"""causal_conv1d: causal depthwise conv1d over packed variable-length sequences (prefill, extend).

The Mosaic GPU kernel lives in ``prefill_mgpu.py`` (same arguments plus ``interpret``); its
``unsupported_reason`` decides whether ``impl="auto"`` may take a call.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels.conv1d import prefill_mgpu, reference
from pallas_kernels.conv1d._checks import check_varlen

__all__ = ["causal_conv1d"]

_OP = "causal_conv1d"


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    conv_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    activation: str | None = "silu",
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv over ``N`` packed sequences, continuing from their saved windows.

    For sequence n with window ``win [C, W-1]`` (``pool[state_indices[n]]`` if
    ``has_initial_state[n]`` else zeros; oldest input first) and ``ext = (win, x_seq)`` along
    time: ``y_t = act(bias + sum_w weight[:, w] * ext[t + w])`` (``weight[:, W-1]`` meets the
    new token), and the last W-1 entries of ``ext`` become the saved window.

    Args:
      x: ``[T, C]`` inputs.
      weight: ``[C, W]`` taps; bias: ``[C]`` or None.
      conv_pool: ``[S, C, W-1]`` in x's dtype; donate it under jit for an in-place update.
      qsl: int32 ``[N+1]`` query_start_loc: sequence n is tokens ``qsl[n]:qsl[n+1]``.
      state_indices: int32 ``[N]`` pool slot of each sequence (padded rows: 0).
      has_initial_state: bool ``[N]``: continue from the saved window, else from zeros.
      activation: ``"silu"`` or None.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      y ``[T, C]`` in x's dtype (zeros at ``t >= qsl[N]``), and the pool where each non-empty
      sequence's window is in its slot; empty sequences and unnamed slots keep their content.

    Assumed, not checked (values, not shapes): ``qsl`` non-decreasing from 0 with
    ``qsl[N] <= T``; slots in ``0..S-1``, distinct among non-empty sequences.
    """
    args = (x, weight, bias, conv_pool, qsl, state_indices, has_initial_state)
    check_varlen(_OP, *args, activation)
    reason = prefill_mgpu.unsupported_reason(*args, activation=activation)
    which = resolve_impl(_OP, impl, reason)
    if which == "reference":
        return reference.causal_conv1d_gathered(*args, activation=activation)
    return prefill_mgpu.causal_conv1d(*args, activation=activation, interpret=which == "interpret")
