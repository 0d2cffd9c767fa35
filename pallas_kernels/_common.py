"""Conventions shared by every op in pallas_kernels, and the choice of implementation.

Layout (the contract of docs/DESIGN.md, stated once here):

* Packed ("varlen") tokens: the sequences of a batch are concatenated along one token axis
  ``T``; ``query_start_loc`` (qsl) int32 ``[N+1]`` marks them. Tokens at ``t >= qsl[N]`` are
  padding: their outputs are zeros.
* Pools are indexed by ``state_indices`` int32 ``[N]``. Slot 0 is the pad slot: padded rows
  (length 0) point at it, and no real state is ever read from it. Real slots are ``1..S-1``.
* State and accumulation are float32 whatever the activations' dtype.

Every public op takes ``impl``: ``"reference"`` (plain jnp), ``"pallas"`` (the Mosaic GPU
kernel, compiled for an sm_90 GPU), ``"interpret"`` (the same kernel under the Mosaic GPU CPU
interpreter) or ``"auto"`` (the kernel when running on an sm_90 GPU and the call is inside
what the kernel supports, else the reference). A kernel's ``unsupported_reason(...)`` says in
one sentence why it cannot take a call; ``None`` means it can.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu

__all__ = [
    "round_up",
    "IMPLS",
    "NUM_SMS",
    "SMEM_BYTES",
    "Impl",
    "interpret_params",
    "on_hopper_gpu",
    "resolve_impl",
]

Impl = Literal["auto", "pallas", "interpret", "reference"]
IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "reference")

NUM_SMS = 132
"""Multiprocessors of an H100/H200 SXM: the kernels' grid heuristics size their launches by it."""

SMEM_BYTES = 227 * 1024
"""Shared memory one sm_90 program may take (the opt-in maximum per thread block)."""


def round_up(n, multiple: int):
    """``n`` rounded up to a multiple of ``multiple`` (an int, or an integer array
    elementwise)."""
    return -(-n // multiple) * multiple


def interpret_params(interpret: bool) -> plgpu.InterpretGPUParams | bool:
    """``plgpu.kernel``'s ``interpret=``: the Mosaic GPU CPU interpreter, or the compiled kernel."""
    return plgpu.InterpretGPUParams() if interpret else False


@functools.cache
def on_hopper_gpu() -> bool:
    """True when JAX's default backend is a GPU of compute capability 9.x (H100/H200)."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9")


def resolve_impl(op: str, impl: str, unsupported: str | None) -> str:
    """Turns ``impl`` into ``"pallas" | "interpret" | "reference"`` for one call of ``op``.

    ``unsupported`` is the kernel's ``unsupported_reason(...)`` for this call (None when the
    kernel can take it, or when the op has no kernel yet it is a fixed sentence saying so).
    Asking explicitly for a kernel that cannot take the call raises: never silently wrong.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl={impl!r} is not one of {IMPLS}")
    if impl == "reference":
        return "reference"
    if impl == "auto":
        usable = unsupported is None and on_hopper_gpu()
        return "pallas" if usable else "reference"
    if unsupported is not None:
        raise NotImplementedError(f"{op}: impl={impl!r} cannot take this call: {unsupported}")
    return impl
