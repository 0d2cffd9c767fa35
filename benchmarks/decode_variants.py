"""The variants of the GDN decode kernel (``decode_mgpu``) against one another.

On the H200 (about 3 minutes, most of it compiling)::

    python3 benchmarks/decode_variants.py [--budget SECONDS] [--smoke]

1. Checks every variant against the jnp reference (float32, on the GPU) at Qwen3-Next shapes
   (H=16, HV=32, K=V=128, bf16 q/k/v, fp32 pool of 1024 slots, random slots, one padded row):
   relative error of ``o`` and of the written slots, NaN-free, padded row zeros, every slot
   no row names bit-identical.
2. Times decode at batch 256, 1, 64, 16 and 256 again (the goals first; the repeat shows
   the run-to-run spread) for each variant, all in this run: the step time of
   ``benchmarks/gdn.py``'s ``jax_per_step_us`` (steps unrolled in one executable, pool
   donated, fresh random slots each step; it has a 12-15 us floor of host launch work) and
   the kernel's device time (``benchmarks/device_time.py``: profiler trace, median over
   calls). Prints one table: both times, state bytes moved per second of device time (read +
   write) and the ratio to the public op's variant (``decode_mgpu.DEFAULT``).

``--budget``: rows that would start after that many seconds are skipped (the table says so).
``--smoke``: tiny shapes with every kernel under the CPU interpreter (checks the script; no
device time on a CPU).
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

from pallas_kernels.gdn import decode_mgpu  # noqa: E402
from pallas_kernels.gdn import reference as gdn_reference  # noqa: E402

__all__ = ["main"]

# The two goals first (a run cut by --budget keeps them); batch 256 once more at the end, to
# show the run-to-run spread next to the differences between kernels.
BATCHES = (256, 1, 64, 16, 256)
CHECK_BATCHES = (64,)  # several items per pipelined program (run 1 also checked batch 1)


def _kernels(interpret: bool) -> dict:
    """name -> decode function with the public op's arguments; the public op's variant first."""
    names = [decode_mgpu.DEFAULT] + [n for n in decode_mgpu.VARIANTS if n != decode_mgpu.DEFAULT]
    out = {
        name: functools.partial(decode_mgpu.fused_recurrent_gated_delta_rule, variant=name)
        for name in names
    }
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
        shape = f"batch {n}" + (" again" if n in batches[:i] else "")
        inputs = gdn._token_inputs(rng, (n, 1))
        traffic = 2 * n * gdn.STATE_BYTES
        for name, fn in kernels.items():

            def measure(fn=fn, n=n, inputs=inputs):
                return gdn.jax_per_step_us(_step(fn), pool, gdn._slots_of(rng, n), n_steps=8,
                                           calls=(2, 10), reps=7, operands=inputs)  # fmt: skip

            def device(fn=fn, n=n, inputs=inputs):
                return gdn.jax_device_time(_step(fn), pool, gdn._slots_of(rng, n), inputs)

            gdn._record("decode", shape, name, measure, gdn._tbps(traffic), device=device)


def table(checks: dict) -> str:
    lines = ["| batch | kernel | step (us) | device (us) | state TB/s | vs default | note |",
             "| ---: | --- | ---: | ---: | ---: | ---: | --- |"]  # fmt: skip
    default = {row.shape: row.best_us for row in gdn.ROWS if row.impl == decode_mgpu.DEFAULT}
    for row in gdn.ROWS:
        base = default.get(row.shape)
        ratio = f"{base / row.best_us:.3f}x" if base and row.best_us else ""
        us = f"{row.us:.1f}" if row.us is not None else "-"
        device_us = f"{row.device_us:.1f}" if row.device_us is not None else "-"
        batch = row.shape.removeprefix("batch ")
        lines.append(f"| {batch} | {row.impl} | {us} | {device_us} | {row.rate} | {ratio} | "
                     f"{row.note} |")  # fmt: skip
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
        gdn._smoke_mode()  # tiny shapes
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
