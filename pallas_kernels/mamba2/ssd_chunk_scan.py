"""ssd_chunk_scan: Mamba2 (SSD) over packed variable-length sequences (prefill, extend).

The Mosaic GPU kernel lives in ``ssd_mgpu.py`` (same arguments plus ``interpret``); its
``unsupported_reason`` decides whether ``impl="auto"`` may take a call. It multiplies with bf16
operands and float32 accumulation, so float32 inputs get bf16-level error (about 3e-3
relative); ``impl="reference"`` (the chunked jnp SSD of ``reference.py``) keeps float32
accuracy. Checked on an H200 by ``pytest -m gpu tests/kernels/test_mamba2_gpu.py``.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels.mamba2 import reference, ssd_mgpu
from pallas_kernels.mamba2._checks import check_options, check_varlen

__all__ = ["ssd_chunk_scan"]

_OP = "ssd_chunk_scan"


def ssd_chunk_scan(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    qsl: jax.Array,
    state_indices: jax.Array,
    has_initial_state: jax.Array,
    *,
    z: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    impl: str = "auto",
    packing_invariant: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Mamba2 SSD over ``N`` packed sequences, reading and writing their pool slots.

    Per head h (group ``g = h // (H // G)``), state ``S [P, N]`` float32::

        dt_t = clip(softplus(dt_t + dt_bias[h]), dt_min, dt_max)
        S = exp(dt_t A[h]) S + dt_t x_t[h] B_t[g]^T;  y_t[h] = S C_t[g] + D[h] x_t[h]
        y_t[h] = y_t[h] silu(z_t[h])                                   (when z is given)

    Args:
      x: ``[T, H, P]`` inputs (bf16 or f32).
      dt: ``[T, H]`` raw time steps (float32 or x's dtype), before bias and softplus.
      A: float32 ``[H]``, negative (``-exp(A_log)``, the caller's job).
      B, C: ``[T, G, N]`` in x's dtype, ``H % G == 0``.
      D, dt_bias: float32 ``[H]``.
      ssm_pool: float32 ``[S, H, P, N]``; donate it under jit for an in-place update.
      qsl: int32 ``[N+1]`` query_start_loc: sequence n is tokens ``qsl[n]:qsl[n+1]``.
      state_indices: int32 ``[N]`` pool slot of each sequence (padded rows: 0).
      has_initial_state: bool ``[N]``: start from ``pool[state_indices[n]]``, else from zeros.
      z: optional ``[T, H, P]`` gate in x's dtype.
      dt_softplus: apply softplus to ``dt + dt_bias`` (Mamba2: True).
      dt_min, dt_max: static clip of the time step after softplus.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.
      packing_invariant: a sequence's outputs and final state are the same bits whatever
        else the call packs and wherever it sits (the kernel re-lays the tokens out, a
        gather of inputs and outputs; the reference always is: its tiles start at each
        sequence's first token).

    Returns:
      y ``[T, H, P]`` in x's dtype (zeros at ``t >= qsl[N]``), and the pool where each
      non-empty sequence's final state is in its slot; empty sequences and unnamed slots keep
      their content.

    Assumed, not checked (values, not shapes): ``qsl`` non-decreasing from 0 with
    ``qsl[N] <= T``; slots in ``0..S-1``, distinct among non-empty sequences.
    """
    args = (x, dt, A, B, C, D, dt_bias, ssm_pool, qsl, state_indices, has_initial_state)
    check_varlen(_OP, *args, z)
    check_options(_OP, dt_min, dt_max)
    options = {"z": z, "dt_softplus": dt_softplus, "dt_min": dt_min, "dt_max": dt_max}
    which = resolve_impl(
        _OP,
        impl,
        ssd_mgpu.unsupported_reason(*args, **options),
    )
    if which == "reference":
        return reference.ssd_chunk_scan_chunked(*args, **options)
    return ssd_mgpu.ssd_chunk_scan(
        *args, **options, interpret=which == "interpret", packing_invariant=packing_invariant
    )
