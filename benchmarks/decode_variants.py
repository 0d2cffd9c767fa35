"""The GDN decode kernel (``recurrent_mgpu``) against the variants of ``decode_mgpu``.

On the H200 (about 3 minutes, most of it compiling; run 1 took 144 s for 26 rows)::

    python3 benchmarks/decode_variants.py [--budget SECONDS] [--smoke]

1. Checks every kernel against the jnp reference (float32, on the GPU) at Qwen3-Next shapes
   (H=16, HV=32, K=V=128, bf16 q/k/v, fp32 pool of 1024 slots, random slots, one padded row):
   relative error of ``o`` and of the written slots, NaN-free, padded row zeros, every slot
   no row names bit-identical.
2. Times decode at batch 256, 1, 64, 16 and 256 again (the goals first; the repeat shows
   the run-to-run spread) for each kernel with ``benchmarks/gdn.py``'s ``jax_per_step_us``
   (steps unrolled in one executable, pool donated, fresh random slots each step), all in
   this run, and prints one table: time per step, state bytes moved per second (read +
   write) and the ratio to the current kernel. Batch 1 is meant as device time above an
   empty Mosaic GPU kernel (``bench_batch1``): run 1 showed that the host work of a launch
   (12.2 us per step for an empty kernel) otherwise sets the step time; run 2 showed that
   the method does not yet achieve it (see ``BUSY_FLOATS``).

``--budget``: rows that would start after that many seconds are skipped (the table says so).
``--smoke``: tiny shapes with every kernel under the CPU interpreter (checks the script).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gdn  # noqa: E402 (benchmarks/gdn.py: shapes, inputs, pool holder, timing)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pallas_kernels.gdn import decode_mgpu, recurrent_mgpu  # noqa: E402
from pallas_kernels.gdn import reference as gdn_reference  # noqa: E402

__all__ = ["main"]

CURRENT = "current (recurrent_mgpu)"
# The two goals first (a run cut by --budget keeps them); batch 256 once more at the end, to
# show the run-to-run spread next to the differences between kernels. Batch 1 is device time
# (bench_batch1).
BATCHES = (256, 1, 64, 16, 256)
CHECK_BATCHES = (64,)  # several items per pipelined program (run 1 also checked batch 1)


def _kernels(interpret: bool) -> dict:
    """name -> decode function with the public op's arguments."""
    out = {CURRENT: recurrent_mgpu.fused_recurrent_gated_delta_rule}
    for name in decode_mgpu.VARIANTS:
        out[name] = functools.partial(decode_mgpu.fused_recurrent_gated_delta_rule, variant=name)
    if interpret:
        out = {name: functools.partial(fn, interpret=True) for name, fn in out.items()}
    return out


def _rel(x: jax.Array, ref: jax.Array) -> float:
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def check(name: str, fn, n: int, seed: int) -> str:
    """One call of ``fn`` at batch ``n`` against the reference; returns a one-line verdict."""
    rng = np.random.default_rng(seed)
    inputs = gdn._token_inputs(rng, (n, 1))
    idx = rng.permutation(np.arange(1, gdn.SLOTS))[:n].astype(np.int32)
    if n > 2:
        idx[1] = 0  # a padded row
    pool = jax.random.normal(jax.random.key(seed), (gdn.SLOTS, gdn.HV, gdn.K, gdn.V)) * 0.1
    idx_dev = jnp.asarray(idx)
    o, new = jax.jit(fn)(**inputs, ssm_pool=pool, state_indices=idx_dev)  # pool not donated
    o_ref, pool_ref = jax.jit(gdn_reference.fused_recurrent_gated_delta_rule)(
        **inputs, ssm_pool=pool, state_indices=idx_dev
    )
    real = idx != 0
    named = jnp.asarray(idx[real])
    err_o = _rel(o[np.flatnonzero(real)], o_ref[np.flatnonzero(real)])
    err_s = _rel(new[named], pool_ref[named])
    finite = bool(jnp.isfinite(o.astype(jnp.float32)).all() & jnp.isfinite(new[named]).all())
    pad_zero = bool((o[np.flatnonzero(~real)] == 0).all()) if (~real).any() else True
    is_named = jnp.zeros((gdn.SLOTS,), bool).at[named].set(True)[:, None, None, None]

    @jax.jit
    def untouched(new, pool):
        same = jax.lax.bitcast_convert_type(new, jnp.uint32) == jax.lax.bitcast_convert_type(
            pool, jnp.uint32
        )
        return jnp.all(same | is_named)

    kept = bool(untouched(new, pool))
    ok = err_o < 2e-3 and err_s < 2e-3 and finite and pad_zero and kept
    verdict = (
        f"{'PASS' if ok else 'FAIL'} batch {n}: rel err o {err_o:.1e}, state {err_s:.1e}, "
        f"finite {finite}, padded row zeros {pad_zero}, unnamed slots bit-identical {kept}"
    )
    print(f"  check {name:26s} {verdict}", flush=True)
    return verdict


def _step(fn):
    def step(pool, idx, inputs):
        o, pool = fn(**inputs, ssm_pool=pool, state_indices=idx)
        return pool, o

    return step


def bench(kernels: dict, batches) -> None:
    rng = np.random.default_rng(0)
    pool = gdn._ssm_pool(seed=10)
    for i, n in enumerate(batches):
        if n == 1:
            bench_batch1(kernels, pool, rng)
            continue
        shape = f"batch {n}" + (" again" if n in batches[:i] else "")
        inputs = gdn._token_inputs(rng, (n, 1))
        traffic = 2 * n * gdn.STATE_BYTES
        for name, fn in kernels.items():

            def measure(fn=fn, n=n, inputs=inputs):
                return gdn.jax_per_step_us(_step(fn), pool, gdn._slots_of(rng, n), n_steps=8,
                                           calls=(2, 10), reps=7, operands=inputs)  # fmt: skip

            gdn._record("decode", shape, name, measure, gdn._tbps(traffic))


def _empty_kernel(interpret: bool):
    """A Mosaic GPU kernel that does nothing, with the decode op's arguments and results."""

    def fn(q, k, v, g, beta, ssm_pool, state_indices):
        del q, k, g, beta

        def body(idx_ref, o_ref):
            del idx_ref, o_ref

        o = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(1,),
                         grid_names=("c",),
                         interpret=plgpu.InterpretGPUParams() if interpret else False,
                         )(state_indices)  # fmt: skip
        return o, ssm_pool

    return fn


EMPTY = "empty Mosaic GPU kernel"
# Batch-1 steps are followed by a sum over this many float32 (~35 us of HBM reads on the
# H200) that depends on the step's output, meant to make the device, not the ~12 us of host
# work per Mosaic GPU launch (run 1: an empty kernel timed 12.2 us per step), set the step
# time. Not confirmed: run 2 timed the empty kernel's step at 15.0 us, too short for the sum,
# so XLA most likely hoisted it and the batch-1 rows still read the host floor.
BUSY_FLOATS = 32 * 1024 * 1024


def bench_batch1(kernels: dict, pool: gdn.Pool, rng) -> None:
    """Batch 1 as device time: per-step time of (kernel + a dependent bandwidth-bound sum)
    minus the same with an empty Mosaic GPU kernel, i.e. the kernel's device time above an
    empty launch. Rows: the empty kernel's step (the baseline), then each kernel's difference
    (its raw step time in the note)."""
    inputs = gdn._token_inputs(rng, (1, 1))
    busy = jnp.asarray(rng.standard_normal(BUSY_FLOATS // 1024 if gdn.SMOKE else BUSY_FLOATS),
                       jnp.float32)  # fmt: skip

    def busy_step(fn):
        def step(pool, idx, operands):
            inputs, busy = operands
            o, pool = fn(**inputs, ssm_pool=pool, state_indices=idx)
            return pool, jnp.sum(busy * o[0, 0, 0, 0].astype(jnp.float32))

        return step

    raw: dict[str, float] = {}
    for name, fn in {EMPTY: _empty_kernel(gdn.SMOKE), **kernels}.items():

        def measure(fn=fn, name=name):
            raw[name] = gdn.jax_per_step_us(busy_step(fn), pool, gdn._slots_of(rng, 1),
                                            n_steps=16, calls=(2, 10), reps=7,
                                            operands=(inputs, busy))  # fmt: skip
            return raw[name] if name == EMPTY else raw[name] - raw[EMPTY]

        if name != EMPTY and EMPTY not in raw:
            break  # no baseline: the differences would mean nothing
        gdn._record("decode", "batch 1 (device)", name, measure, lambda us: "")
        if name in raw:
            what = "the baseline" if name == EMPTY else "above the empty kernel"
            gdn.ROWS[-1].note = f"{what}; step with the sum {raw[name]:.1f} us"


def table(checks: dict) -> str:
    lines = ["| batch | kernel | time (us) | state TB/s | vs current | note |",
             "| ---: | --- | ---: | ---: | ---: | --- |"]  # fmt: skip
    current = {row.shape: row.us for row in gdn.ROWS if row.impl == CURRENT and row.us}
    for row in gdn.ROWS:
        base = current.get(row.shape)
        timed = base and row.us and row.impl != EMPTY
        ratio = f"{base / row.us:.3f}x" if timed else ""
        us = f"{row.us:.1f}" if row.us is not None else "-"
        batch = row.shape.removeprefix("batch ")
        lines.append(f"| {batch} | {row.impl} | {us} | {row.rate} | {ratio} | {row.note} |")
    lines += ["", "Checks against the jnp reference (float32 on the device):"]
    lines += [f"* {name}: {verdict}" for name, verdicts in checks.items() for verdict in verdicts]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0, help="seconds; later rows skipped")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    start = time.monotonic()
    if args.budget:
        gdn.DEADLINE = start + args.budget
    batches, check_batches = BATCHES, CHECK_BATCHES
    if args.smoke:
        gdn._smoke_mode()  # tiny shapes; patches recurrent_mgpu to interpret
        batches, check_batches = (2, 1, 2), (3,)
    kernels = _kernels(interpret=args.smoke)
    print(f"device: {jax.devices()[0].device_kind}; H={gdn.H} HV={gdn.HV} K={gdn.K} V={gdn.V} "
          f"slots={gdn.SLOTS}", flush=True)  # fmt: skip
    checks: dict[str, list[str]] = {name: [] for name in kernels}
    for n in check_batches:
        for name, fn in kernels.items():
            if time.monotonic() > gdn.DEADLINE:
                checks[name].append(f"batch {n}: skipped (--budget)")
                continue
            try:
                checks[name].append(check(name, fn, n, seed=n))
            except Exception as err:  # noqa: BLE001 (a failing kernel must not stop the run)
                checks[name].append(f"ERROR batch {n}: {type(err).__name__}: {str(err)[:200]}")
                print(f"  check {name}: {checks[name][-1]}", flush=True)
    bench(kernels, batches)
    print(f"\n{table(checks)}\n\ntotal {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
