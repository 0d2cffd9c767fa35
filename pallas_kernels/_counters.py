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
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import memref

__all__ = ["check_counters", "count_arrival", "own_zeros", "signal", "wait_then_count"]


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


def count_arrival(counter, total: int, before_smem, *, interpret: bool) -> jax.Array:
    """Adds 1 to the GMEM int32 ``counter`` ``[1]`` once the warpgroup's earlier work is done
    (an acquire-release at GPU scope) and returns the count before the add, the same for
    every thread: the arrival that returns ``total - 1`` is the last of ``total`` and sets
    the counter back to zero. ``before_smem``: an SMEM int32 ``[1]`` through which the count
    reaches the warpgroup. No waiting: the last arrival acts for all (a program that reads
    what the others' programs read writes it only once every one of them has read it).

    The interpreter runs a launch's programs one after another and cannot run inline Mosaic
    GPU: there the count is a plain read and write of the counter."""
    if interpret:
        before = counter[0]
        counter[0] = jnp.where(before == total - 1, 0, before + 1)
        return before

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def arrive(ctx, ref, smem):
        del ctx
        mgpu_utils.warpgroup_barrier()
        i32 = ir.IntegerType.get_signless(32)
        with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
            before = mgpu_utils.inline_ptx(
                f"""{{
                .reg .pred last;
                .reg .b32 zero;
                atom.acq_rel.gpu.global.add.u32 $0, [$1], 1;
                setp.eq.u32 last, $0, {total - 1};
                mov.b32 zero, 0;
                @last st.relaxed.gpu.global.u32 [$1], zero;
                }}""",
                mgpu_utils.memref_ptr(ref), result_types=i32, has_side_effects=True,
            )  # fmt: skip
            memref.store(before, smem, [mgpu_utils.c(0, ir.IndexType.get())])
        mgpu_utils.warpgroup_barrier()

    arrive(counter, before_smem)
    return before_smem[0]
