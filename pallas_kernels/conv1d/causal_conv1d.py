"""causal_conv1d: causal depthwise conv1d over packed variable-length sequences (prefill, extend).

Kernel plug-in point: the Mosaic GPU kernel lives in ``prefill_mgpu.py`` and exposes
``unsupported_reason(x, weight, bias, conv_pool, qsl, state_indices, has_initial_state, *,
activation) -> str | None`` and ``causal_conv1d(<same>, interpret: bool)`` (inputs already
checked). Plugging it in is replacing ``_kernel = None`` below with
``from pallas_kernels.conv1d import prefill_mgpu as _kernel``.
"""

from __future__ import annotations

from types import ModuleType

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels.conv1d import reference
from pallas_kernels.conv1d._checks import check_varlen

__all__ = ["causal_conv1d"]

_OP = "causal_conv1d"
_kernel: ModuleType | None = None


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
    if _kernel is None:
        reason = f"no Pallas kernel for {_OP} yet"
    else:
        reason = _kernel.unsupported_reason(*args, activation=activation)
    which = resolve_impl(_OP, impl, reason)
    if which == "reference":
        return reference.causal_conv1d_gathered(*args, activation=activation)
    return _kernel.causal_conv1d(*args, activation=activation, interpret=which == "interpret")
