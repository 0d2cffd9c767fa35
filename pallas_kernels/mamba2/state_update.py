"""Mamba2 on rows of Dt tokens: decode (``selective_state_update``, writes the pool) and
speculative verification (``verify_selective_state_update``, returns the state after every
token and leaves the pool alone).

The Mosaic GPU kernels live in ``state_update_mgpu.py`` (same arguments plus ``interpret``);
its ``unsupported_reason`` decides whether ``impl="auto"`` may take them.
"""

from __future__ import annotations

import jax

from pallas_kernels._common import resolve_impl
from pallas_kernels._tree import check_parents
from pallas_kernels.mamba2 import reference, state_update_mgpu
from pallas_kernels.mamba2._checks import check_options, check_rows

__all__ = ["selective_state_update", "verify_selective_state_update"]


def _call(op: str, args: tuple, options: dict, impl: str, verify: bool):
    check_rows(op, *args, options["z"])
    check_options(op, options["dt_min"], options["dt_max"])
    check_parents(op, options.get("parents"), *args[0].shape[:2])
    which = resolve_impl(
        op,
        impl,
        state_update_mgpu.unsupported_reason(*args, **options),
    )
    if which == "reference":
        ref = (
            reference.verify_selective_state_update if verify else reference.selective_state_update
        )
        return ref(*args, **options)
    kernel = (
        state_update_mgpu.verify_selective_state_update
        if verify
        else state_update_mgpu.selective_state_update
    )
    return kernel(*args, **options, interpret=which == "interpret")


def selective_state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    z: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Dt tokens per row from the row's slot; the state after the last one is written back.

    Per head h (group ``g = h // (H // G)``), state ``S [P, N]`` float32, as ``ssd_chunk_scan``::

        dt_t = clip(softplus(dt_t + dt_bias[h]), dt_min, dt_max)
        S = exp(dt_t A[h]) S + dt_t x_t[h] B_t[g]^T;  y_t[h] = S C_t[g] + D[h] x_t[h]
        y_t[h] = y_t[h] silu(z_t[h])                                   (when z is given)

    Args:
      x: ``[N, Dt, H, P]`` inputs (decode: Dt=1).
      dt: ``[N, Dt, H]`` raw time steps (float32 or x's dtype).
      A: float32 ``[H]`` (negative); D, dt_bias: float32 ``[H]``.
      B, C: ``[N, Dt, G, N]`` in x's dtype, ``H % G == 0``.
      ssm_pool: float32 ``[S, H, P, N]``; row n starts from ``pool[state_indices[n]]``.
        Donate it under jit for an in-place update.
      state_indices: int32 ``[N]`` slots, distinct among real rows. A row at the pad slot 0
        is a padded row: its outputs are zeros and it writes nothing.
      z: optional ``[N, Dt, H, P]`` gate in x's dtype.
      dt_softplus, dt_min, dt_max: as ``ssd_chunk_scan``.
      impl: ``"auto" | "pallas" | "interpret" | "reference"``.

    Returns:
      y ``[N, Dt, H, P]`` in x's dtype, and the pool with each row's final state in its slot.
    """
    args = (x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices)
    options = {"z": z, "dt_softplus": dt_softplus, "dt_min": dt_min, "dt_max": dt_max}
    return _call("selective_state_update", args, options, impl, verify=False)


def verify_selective_state_update(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,  # noqa: N803 (the contract's names)
    B: jax.Array,  # noqa: N803
    C: jax.Array,  # noqa: N803
    D: jax.Array,  # noqa: N803
    dt_bias: jax.Array,
    ssm_pool: jax.Array,
    state_indices: jax.Array,
    *,
    z: jax.Array | None = None,
    parents: jax.Array | None = None,
    dt_softplus: bool = True,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Dt draft tokens per row from the row's slot, keeping every intermediate state.

    Arguments as ``selective_state_update``: x ``[N, Dt, H, P]``, dt ``[N, Dt, H]``, B, C
    ``[N, Dt, G, N]``, ssm_pool float32 ``[S, H, P, N]``, state_indices int32 ``[N]``.
    ``parents``: None for chain drafts, or int32 ``[N, Dt]`` tree drafts in topological
    order: token t starts from the state after token ``parents[n, t]`` (``-1`` for token 0,
    the root, which starts from the slot; ``0 <= parents[n, t] < t`` otherwise).

    Returns:
      y ``[N, Dt, H, P]`` in x's dtype, and intermediates float32 ``[N, Dt, H, P, N]``:
      ``intermediates[n, t]`` is row n's state after its token t (zeros on padded rows, slot
      0). The pool is not written; ``commit_states`` stores the accepted state afterwards.
    """
    args = (x, dt, A, B, C, D, dt_bias, ssm_pool, state_indices)
    options = {"z": z, "dt_softplus": dt_softplus, "dt_min": dt_min, "dt_max": dt_max}
    options["parents"] = parents
    return _call("verify_selective_state_update", args, options, impl, verify=True)
