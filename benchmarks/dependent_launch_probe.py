"""Whether a programmatic dependent launch of a Mosaic GPU kernel overlaps the kernel before it
when XLA runs them (H200; `benchmarks/RESULTS_serve.md`, session 28).

Kernel one spins ``n1`` iterations on 4 programs (calling ``griddepcontrol.launch_dependents``
first when dependent) and writes its rows; kernel two spins ``n2`` iterations on an input of
its own, then (dependent: after ``griddepcontrol.wait``) reads kernel one's rows. A jitted
chain of 20 pairs is timed by wall clock: with overlap a pair costs about the longer kernel,
without it their sum. Usage: ``python3 benchmarks/dependent_launch_probe.py``.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

PROGRAMS, WIDTH, PAIRS = 4, 256, 20
MODES = ("first alone", "second alone", "plain", "dependent")


def _spin(n, v):
    return lax.fori_loop(0, n, lambda i, u: u * 0.9999 + 1e-4, v)


def _kernel(body, n_buffers: int, name: str):
    scratch = [plgpu.SMEM((WIDTH,), jnp.float32) for _ in range(n_buffers)]
    scratch += [plgpu.Barrier(num_arrivals=1) for _ in range(n_buffers)]
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((PROGRAMS, WIDTH), jnp.float32), grid=(PROGRAMS,),
        grid_names=("p",), scratch_types=scratch, kernel_name=name,
    )  # fmt: skip


def first(n, x, dependent: bool):
    def body(n_ref, x_ref, o_ref, x_s, bar):
        if dependent:
            plgpu.griddepcontrol_launch_dependents()
        p = lax.axis_index("p")
        plgpu.copy_gmem_to_smem(x_ref.at[p], x_s, bar)
        plgpu.barrier_wait(bar)
        x_s[...] = _spin(n_ref[0], x_s[...])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_s, o_ref.at[p])
        plgpu.wait_smem_to_gmem(0)

    return _kernel(body, 1, "probe_first")(n, x)


def second(n, a, y, dependent: bool):
    def body(n_ref, a_ref, y_ref, o_ref, y_s, a_s, y_bar, a_bar):
        p = lax.axis_index("p")
        if dependent:
            plgpu.griddepcontrol_launch_dependents()
        plgpu.copy_gmem_to_smem(y_ref.at[p], y_s, y_bar)  # not written by the first kernel
        plgpu.barrier_wait(y_bar)
        v = _spin(n_ref[0], y_s[...])
        if dependent:
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(a_ref.at[p], a_s, a_bar)
        plgpu.barrier_wait(a_bar)
        y_s[...] = v + a_s[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(y_s, o_ref.at[p])
        plgpu.wait_smem_to_gmem(0)

    return _kernel(body, 2, "probe_second")(n, a, y)


@functools.partial(jax.jit, static_argnames=("mode",))
def chain(x, y, n1, n2, *, mode: str):
    dependent = mode == "dependent"
    for _ in range(PAIRS):
        a = x if mode == "second alone" else first(n1, x, dependent)
        x = a if mode == "first alone" else second(n2, a, y, dependent)
    return x


def main() -> None:
    x = jax.random.uniform(jax.random.key(0), (PROGRAMS, WIDTH))
    y = jax.random.uniform(jax.random.key(1), (PROGRAMS, WIDTH))
    print("| spins | " + " | ".join(MODES) + " | same result |")
    for n1, n2 in ((4000, 4000), (4000, 0), (8000, 4000)):
        spins = jnp.array([n1], jnp.int32), jnp.array([n2], jnp.int32)
        per_pair = {}
        for mode in MODES:
            run = lambda: chain(x, y, *spins, mode=mode).block_until_ready()  # noqa: B023, E731
            run()
            times = []
            for _ in range(7):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            per_pair[mode] = sorted(times)[3] / PAIRS * 1e6
        same = bool(jnp.allclose(chain(x, y, *spins, mode="plain"),
                                 chain(x, y, *spins, mode="dependent")))  # fmt: skip
        cells = " | ".join(f"{per_pair[m]:.1f} us" for m in MODES)
        print(f"| {n1} / {n2} | {cells} | {same} |")


if __name__ == "__main__":
    main()
