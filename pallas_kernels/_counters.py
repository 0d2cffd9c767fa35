"""Counters in GMEM through which a launch's programs wait for each other's stores.

A program that stores what others read adds 1 to a counter once the store has landed
(``signal``); a reader waits until the counter holds all of its writers' adds
(``wait_then_count``), then adds 1 itself, and the add that completes the count sets the
counter back to zero. A launch thus leaves its counters as it found them, so launches that
run one after another may share one zeroed int32 buffer (a step makes it once and a layer
scan carries it), and none zero-fills its own. Readers come after their writers in launch
order, so a waiting program never holds an SM a writer still needs.

Signal and wait are Mosaic GPU's semaphore PTX (``SemaphoreRef``) on an int32 operand the
launch updates in place.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu

__all__ = ["check_counters", "own_zeros", "signal", "wait_then_count"]


def own_zeros(like: jax.Array) -> jax.Array:
    """An int32 Ref of zeros, one per element of ``like`` (int32), computed from it (no element
    is the least int32): XLA can neither merge them with another launch's zeros nor fold them
    into a constant, so a launch without a shared buffer writes its own in place, with no
    copy of a shared one before it."""
    return jax.new_ref((like == jnp.iinfo(jnp.int32).min).astype(jnp.int32))


def check_counters(op: str, counters, needed: int) -> None:
    """Raises unless ``counters`` is None or an int32 Ref ``[n >= needed]``."""
    if counters is None:
        return
    if not isinstance(counters, jax.Ref):
        raise TypeError(f"{op}: counters must be a jax.Ref (jax.new_ref), got {type(counters)}")
    if counters.dtype != jnp.int32 or counters.ndim != 1 or counters.shape[0] < needed:
        raise ValueError(
            f"{op}: counters must be int32 [n >= {needed}]; got {counters.dtype} {counters.shape}"
        )


def signal(counter) -> None:
    """Adds 1 to the GMEM int32 ``counter`` ``[1]`` (one lane, after the warpgroup's earlier
    work: a release at GPU scope)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def add_one(ctx, ref):
        del ctx
        mgpu.utils.warpgroup_barrier()
        mgpu.utils.SemaphoreRef(mgpu.utils.memref_ptr(ref)).signal(1, memory_scope="gpu")

    add_one(counter)


def wait_then_count(counter, ready: int, total: int) -> None:
    """Waits until the GMEM int32 ``counter`` ``[1]`` is at least ``ready`` (an acquire at GPU
    scope), then adds 1 to it; the add that makes it ``total`` (the last of the counter's
    waiters, every signal and add in) sets it back to zero."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def wait_and_count(ctx, ref):
        del ctx
        ptr = mgpu.utils.memref_ptr(ref)
        mgpu.utils.SemaphoreRef(ptr).wait(ready, decrement=False, memory_scope="gpu")
        with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
            mgpu.utils.inline_ptx(
                f"""{{
                .reg .pred last;
                .reg .b32 old, zero;
                atom.relaxed.gpu.global.add.u32 old, [$0], 1;
                setp.eq.u32 last, old, {total - 1};
                mov.b32 zero, 0;
                @last st.relaxed.gpu.global.u32 [$0], zero;
                }}""",
                ptr, has_side_effects=True,
            )  # fmt: skip

    wait_and_count(counter)
