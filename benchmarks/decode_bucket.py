"""The GDN decode kernel inside a decode bucket: ``N`` rows of which ``R`` are real, the rest
padding rows (slot 0, which the kernel skips), at each column block ``block_v``.

A serving step of one request runs in the engine's smallest batch bucket
(``metadata.MIN_BATCH_BUCKET`` rows), so the kernel's grid is sized for ``N`` rows while only
``R`` of them carry work: the block that suits ``N`` full rows (bandwidth) is not the one that
suits one row (latency). This times ``decode_mgpu.packed_gating_recurrent_gated_delta_rule``
(the op a GDN layer's DECODE step runs) at Qwen3-Next shapes (H=16, HV=32, K=V=128, bf16
activations, float32 pool) for each ``(N, R, block_v)``, device time from a profiler trace.

On the H200 (see benchmarks/README.md; about a minute)::

    python3 benchmarks/decode_bucket.py [--rows 8:1,8:8,16:1,16:16] [--blocks 16,32,64]
        [--output-norm]

``--output-norm`` adds a row per ``(N, R)``: the op forming the gated output norm
(``output_norm=``: whole-head items), checked against the norm formed after the default op.

Prints one table (device us per call, state bytes of the real rows per second) and checks each
configuration's output against the default block's first.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from device_time import device_time  # noqa: E402

from pallas_kernels.gdn import decode_mgpu, reference, stack_gate_params  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
SLOTS = 1024
# Each timed call takes the next of CYCLE slot sets: as in a step, where each layer's states
# are read from HBM, not from the L2 cache a repeated slot would leave them in.
CYCLE = 32


def _inputs(n: int, real: int, rng: np.random.Generator):
    qkv = jnp.asarray(rng.standard_normal((n, 1, 2 * H * K + HV * V)), jnp.bfloat16)
    ba = jnp.asarray(rng.standard_normal((n, 1, 2 * HV)), jnp.bfloat16)
    a_log = jnp.asarray(rng.uniform(0.0, 2.7, HV), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(HV), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((SLOTS, HV, K, V)) * 0.1, jnp.float32)
    slots = np.zeros((CYCLE, n), np.int32)
    for row in slots:
        row[:real] = rng.choice(np.arange(1, SLOTS), real, replace=False)
    return qkv, ba, a_log, dt_bias, pool, jnp.asarray(slots)


def _state_rate(real: int, us: float) -> float:
    """TB/s of the real rows' float32 states, each read and written once, in ``us``."""
    return 2 * real * HV * K * V * 4 / (us * 1e-6) / 1e12


def measure(
    n: int, real: int, block_v: int, rng: np.random.Generator, *, output_norm: bool = False
) -> tuple[float, float]:
    """(device us per call, largest |o - o at the default block| of the real rows); with
    ``output_norm`` the op forms the gated output norm, compared with the norm formed after
    the default op."""
    qkv, ba, a_log, dt_bias, pool, slots = _inputs(n, real, rng)
    base = dataclasses.replace(decode_mgpu.VARIANTS[decode_mgpu.DEFAULT], block_v=0)
    variant = dataclasses.replace(base, block_v=block_v)
    z = jnp.asarray(rng.standard_normal((n, 1, HV * V)), jnp.bfloat16)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, V), jnp.float32)
    norm = (z, weight, 1e-6) if output_norm else None

    def op(pool, slots, variant, norm=None):
        return decode_mgpu.packed_gating_recurrent_gated_delta_rule(
            qkv, ba, stack_gate_params(a_log, dt_bias), pool, slots, variant=variant,
            output_norm=norm,
        )  # fmt: skip

    o_ref, _ = jax.jit(lambda p: op(p, slots[0], base))(pool)
    if output_norm:
        o_ref = reference.gated_output_norm(o_ref, z.reshape(o_ref.shape), weight, 1e-6)
    o, _ = jax.jit(lambda p: op(p, slots[0], variant, norm))(pool)
    err = float(jnp.max(jnp.abs(o[:real].astype(jnp.float32) - o_ref[:real].astype(jnp.float32))))
    step = jax.jit(lambda p, s: op(p, s, variant, norm)[1], donate_argnums=0)
    held = [pool, 0]

    def call():
        held[1] = (held[1] + 1) % CYCLE
        held[0] = step(held[0], slots[held[1]])
        return held[0]

    return device_time(call, calls=20).us, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8:1,8:8,16:1,16:16", help="N:R pairs, comma-separated")
    parser.add_argument("--blocks", default="16,32,64", help="block_v values, comma-separated")
    parser.add_argument(
        "--output-norm", action="store_true",
        help="add a row per N:R with the op forming the gated output norm (whole heads)",
    )  # fmt: skip
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| rows N | real R | block_v | picked | device us | TB/s (real rows) "
          "| max abs o - o_default |")  # fmt: skip
    print("| ---: | ---: | ---: | :---: | ---: | ---: | ---: |")
    for pair in args.rows.split(","):
        n, real = (int(x) for x in pair.split(":"))
        picked = decode_mgpu.pick_block_v(n, HV, V)
        for block_v in (int(b) for b in args.blocks.split(",")):
            us, err = measure(n, real, block_v, rng)
            rate = _state_rate(real, us)
            mark = "*" if block_v == picked else ""
            print(f"| {n} | {real} | {block_v} | {mark} | {us:.1f} | {rate:.2f} | {err:.2e} |",
                  flush=True)  # fmt: skip
        if args.output_norm:
            us, err = measure(n, real, V, rng, output_norm=True)
            rate = _state_rate(real, us)
            print(f"| {n} | {real} | {V}, output norm | | {us:.1f} | {rate:.2f} | {err:.2e} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
