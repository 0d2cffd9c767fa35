"""chunk_gated_delta_rule: Gated DeltaNet over packed variable-length sequences (prefill, extend).

The Mosaic GPU kernel lives in ``chunk_mgpu.py`` (same arguments plus ``interpret``); its
``unsupported_reason`` decides whether ``impl="auto"`` may take a call. It multiplies with bf16
operands and float32 accumulation, so float32 inputs get bf16-level error (about 4e-3
relative); ``impl="reference"`` keeps float32 accuracy.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels.gdn import chunk_mgpu, reference
from pallas_kernels.gdn._checks import check_varlen, default_scale

__all__ = ["chunk_gated_delta_rule"]

_OP = "chunk_gated_delta_rule"


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    impl: str = "auto",
    packing_invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Gated delta rule over ``N`` packed sequences, reading and writing their pool slots.

    Per value head h (key head ``h // (HV // H)``), state ``S [K, V]`` float32::

        S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T (scale q_t)

    Args:
      q, k: ``[T, H, K]`` queries and keys, L2-normalized inside when ``use_qk_l2norm``.
      v: ``[T, HV, V]`` values, ``HV % H == 0``.
      g: float32 ``[T, HV]`` log-space decay (<= 0); beta: float32 ``[T, HV]`` in (0, 1).
      ssm_pool: float32 ``[S, HV, K, V]``; donate it under jit for an in-place update.
      qsl: int32 ``[N+1]`` query_start_loc: sequence n is tokens ``qsl[n]:qsl[n+1]``.
      state_indices: int32 ``[N]`` pool slot of each sequence (padded rows: 0).
      has_initial_state: bool ``[N]``: start from ``pool[state_indices[n]]``, else from zeros.
      scale: query scale, default ``K ** -0.5``.
      use_qk_l2norm: normalize q and k per head (Qwen3-Next: True).
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.
      packing_invariant: a sequence's outputs and final state are the same bits whatever
        else the call packs and wherever it sits (the kernel re-lays the tokens out, a
        gather of inputs and outputs; the reference always is: its tiles start at each
        sequence's first token).

    Returns:
      o ``[T, HV, V]`` in v's dtype (zeros at ``t >= qsl[N]``), and the pool where each
      non-empty sequence's final state is in its slot; empty sequences and unnamed slots keep
      their content.

    Assumed, not checked (values, not shapes): ``qsl`` non-decreasing from 0 with
    ``qsl[N] <= T``; slots in ``0..S-1``, distinct among non-empty sequences.
    """
    check_varlen(_OP, q, k, v, g, beta, ssm_pool, qsl, state_indices, has_initial_state)
    scale = default_scale(_OP, q.shape[-1], scale)
    args = (q, k, v, g, beta, ssm_pool, qsl, state_indices, has_initial_state)
    options = {"scale": scale, "use_qk_l2norm": use_qk_l2norm}
    reason = chunk_mgpu.unsupported_reason(*args, **options)
    which = resolve_impl(_OP, impl, reason)
    if which == "reference":
        return reference.chunk_gated_delta_rule_chunked(*args, **options)
    return chunk_mgpu.chunk_gated_delta_rule(
        *args, **options, interpret=which == "interpret", packing_invariant=packing_invariant
    )
