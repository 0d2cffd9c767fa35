"""Mamba2 on an H200: this project's kernels against jax-linear-attention and jnp.

Run on the GPU machine (peers as wheels, as for ``benchmarks/gdn.py``, see README.md)::

    python3 benchmarks/mamba2.py [--out DIR] [--only decode,verify,prefill] [--budget S]

Prints ONE table (every row measured in this run) and writes ``RESULTS_mamba2.md`` to ``--out``
(default: this folder; with ``--smoke`` only when ``--out`` is given). Shapes: Nemotron-H 8B-like
(H=128 heads of P=64, G=8 groups of N=128), bf16 activations, a float32 ssm pool of 512 slots
(4 MiB each); every step reads fresh random slots, so the state comes from HBM, not L2.

Rows: decode (batch 1, 64, 256) and verify (Dt=4, batch 16, 64) with this project's Mosaic GPU
kernels (``pallas_kernels/mamba2/state_update_mgpu.py``) and the jnp reference; prefill (1x8192,
4x8192, varlen 64x256) with this project's Mosaic GPU SSD kernel
(``pallas_kernels/mamba2/ssd_mgpu.py``), the chunked jnp reference and jax-linear-attention's
Mamba-2 SSD (``jla.layers.ssm.mamba2_ssd``, Mosaic GPU, plus the pool gather/scatter a pooled
step needs; it has no pooled decode op). Timing and the table come from ``benchmarks/gdn.py``
(``jax_per_step_us``: R steps unrolled in one executable, the pool donated from step to step).

Floors to compare the first run with (state 4 MiB per slot, copy rate 4.3 TB/s): decode batch
256 moves 2 x 256 x 4 MiB = 2.1 GB, 500 us at the copy rate, 632 us at the 3.4 TB/s goal; batch
64, 125 us; verify Dt=4 batch 64 moves 5 x 64 x 4 MiB, 312 us. Prefill reads x, B, C, dt and
writes y, about 36 KB per token in bf16 (1x8192: 70 us of bytes); its four 64-token wgmmas per
chunk and head are about 7.3 MFLOP per token (1x8192: 76 us at 790 TFLOP/s), so the in-order
walk over chunks (1x8192: 128 chunks in 128 CTAs of 128 heads) is what will bound it.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gdn as timing  # noqa: E402 (benchmarks/gdn.py: the timing loop and the table)

from pallas_kernels import mamba2  # noqa: E402
from pallas_kernels.mamba2 import reference as mamba2_reference  # noqa: E402
from pallas_kernels.mamba2 import ssd_mgpu, state_update_mgpu  # noqa: E402

H, G, P, N = 128, 8, 64, 128
SLOTS = 512
STATE_BYTES = H * P * N * 4
DECODE_BATCHES = (1, 64, 256)
VERIFY = ((16, 4), (64, 4))
PREFILL = (("1x8192", 1, 8192), ("4x8192", 4, 8192), ("varlen 64x256", 64, 256))


def _params(rng) -> dict[str, jax.Array]:
    return dict(
        A=jnp.asarray(-np.exp(rng.uniform(-1.0, 1.0, H)), jnp.float32),
        D=jnp.asarray(rng.standard_normal(H), jnp.float32),
        dt_bias=jnp.asarray(rng.uniform(-4.0, -2.0, H), jnp.float32),
    )


def _tokens(rng, lead: tuple[int, ...]) -> dict[str, jax.Array]:
    bf16 = jnp.bfloat16
    return dict(
        x=jnp.asarray(rng.standard_normal((*lead, H, P)), bf16),
        dt=jnp.asarray(rng.standard_normal((*lead, H)), bf16),
        B=jnp.asarray(rng.standard_normal((*lead, G, N)), bf16),
        C=jnp.asarray(rng.standard_normal((*lead, G, N)), bf16),
    )


def _pool() -> timing.Pool:
    return timing.Pool((SLOTS, H, P, N), jnp.float32, seed=10)


def _slots_of(rng, n):
    def xs_of(n_steps):
        sets = [rng.permutation(np.arange(1, SLOTS))[:n] for _ in range(n_steps)]
        return tuple(jnp.asarray(s, jnp.int32) for s in sets)

    return xs_of


def bench_rows(group: str, shapes) -> None:
    """decode: (batch, 1) rows writing the pool; verify: (batch, Dt) rows returning states."""
    rng = np.random.default_rng(0)
    pool = _pool()
    params = _params(rng)
    for n, d in shapes:
        shape = f"batch {n}" + (f" Dt={d}" if group == "verify" else "")
        inputs = {**_tokens(rng, (n, d)), **params}
        traffic = (2 if group == "decode" else 1 + d) * n * STATE_BYTES
        if group == "decode":
            impls = (("ours (Mosaic GPU)", state_update_mgpu.selective_state_update),
                     ("jnp reference", mamba2_reference.selective_state_update))  # fmt: skip
        else:
            impls = (("ours (Mosaic GPU)", state_update_mgpu.verify_selective_state_update),
                     ("jnp reference", mamba2_reference.verify_selective_state_update))  # fmt: skip
        for impl, fn in impls:

            def step(pool, idx, inputs, fn=fn):
                y, out = fn(**inputs, ssm_pool=pool, state_indices=idx)
                return (out, y) if group == "decode" else (pool, (y, out))

            def measure(step=step, n=n, inputs=inputs):
                return timing.jax_per_step_us(step, pool, _slots_of(rng, n), operands=inputs)

            timing._record(group, shape, impl, measure, timing._tbps(traffic))


def bench_prefill(jla_ssm) -> None:
    rng = np.random.default_rng(3)
    pool = _pool()
    params = _params(rng)
    for shape, n_seq, length in PREFILL:
        t_total = n_seq * length
        inputs = {**_tokens(rng, (t_total,)), **params}
        qsl = jnp.arange(0, t_total + 1, length, dtype=jnp.int32)
        has_init = jnp.ones((n_seq,), bool)

        reference = functools.partial(mamba2.ssd_chunk_scan, impl="reference")
        for impl, fn in (("ours (Mosaic GPU SSD)", ssd_mgpu.ssd_chunk_scan),
                         ("jnp reference (chunked)", reference)):  # fmt: skip

            def step(pool, idx, inputs, fn=fn, qsl=qsl, has_init=has_init):
                y, pool = fn(**inputs, ssm_pool=pool, qsl=qsl, state_indices=idx,
                             has_initial_state=has_init)  # fmt: skip
                return pool, y

            def measure(step=step, n_seq=n_seq, inputs=inputs):
                return timing.jax_per_step_us(step, pool, _slots_of(rng, n_seq), n_steps=2,
                                              calls=(1, 3), reps=3, operands=inputs)  # fmt: skip

            timing._record("prefill", shape, impl, measure, timing._mtoks(t_total))
        if jla_ssm is not None:
            _jla_prefill(jla_ssm, rng, pool, params, shape, n_seq, length)


def _jla_prefill(jla_ssm, rng, pool, params, shape, n_seq, length) -> None:
    """jla's SSD on dense ``[n_seq, length]`` batches; its state is ``[B, H, N, P]`` (ours is
    ``[P, N]``) and its dt is taken after softplus, so both are done outside its call."""
    dense = _tokens(rng, (n_seq, length))
    dt = jax.nn.softplus(dense["dt"].astype(jnp.float32) + params["dt_bias"])

    def step(pool, idx, operands):
        dense, dt = operands
        y, final = jla_ssm.mamba2_ssd(
            dense["x"], dt, params["A"], dense["B"], dense["C"], d=params["D"],
            initial_state=jnp.swapaxes(pool[idx], -1, -2), output_final_state=True, impl="auto",
        )  # fmt: skip
        return pool.at[idx].set(jnp.swapaxes(final, -1, -2)), y

    timing._record("prefill", shape, "jla 0.1.0 mamba2_ssd (+ pool gather/scatter)",
                   lambda: timing.jax_per_step_us(step, pool, _slots_of(rng, n_seq), n_steps=2,
                                                  calls=(1, 3), reps=3, operands=(dense, dt)),
                   timing._mtoks(n_seq * length))  # fmt: skip


def _smoke_mode() -> None:
    """Tiny shapes and the kernels under the Mosaic GPU interpreter: runs the whole script on
    a CPU (no timing worth reading)."""
    global H, G, P, N, SLOTS, STATE_BYTES, DECODE_BATCHES, VERIFY, PREFILL
    timing.SMOKE = True
    H, G, P, N, SLOTS = 2, 1, 64, 64, 8
    STATE_BYTES = H * P * N * 4
    DECODE_BATCHES, VERIFY, PREFILL = (1, 2), ((2, 2),), (("2x64", 2, 64), ("varlen 3x20", 3, 20))
    for module, name in ((state_update_mgpu, "selective_state_update"),
                         (state_update_mgpu, "verify_selective_state_update"),
                         (ssd_mgpu, "ssd_chunk_scan")):  # fmt: skip
        setattr(module, name, functools.partial(getattr(module, name), interpret=True))


def _write_report(out: Path, device_kind: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in timing._versions().items())
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    table = timing._table()
    report = (
        "# Mamba2 benchmark results\n\n"
        f"Measured {stamp} on {device_kind} by `benchmarks/mamba2.py` (one run, every row "
        f"measured in it).\n\nVersions: {versions}.\n\n"
        f"Shapes: H={H}, P={P}, G={G}, N={N}, bf16 activations, fp32 ssm pool of {SLOTS} slots, "
        "fresh random slots every step. Decode/verify rates are state bytes moved (decode: "
        "read + write the state; verify: read it once and write Dt states) per second "
        "(goal: 3.4 TB/s at decode batch 256); prefill rates are tokens per second.\n\n"
        f"{table}\n"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS_mamba2.md").write_text(report)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default="decode,verify,prefill")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget", type=float, default=0, help="seconds; later rows skipped")
    args = parser.parse_args()
    if args.budget:
        timing.DEADLINE = time.monotonic() + args.budget
    if args.smoke:
        _smoke_mode()
    out = args.out or (None if args.smoke else str(Path(__file__).resolve().parent))
    jla_ssm = timing._optional("jla.layers.ssm")
    device_kind = jax.devices()[0].device_kind
    print(f"device: {device_kind}", flush=True)
    runs = {
        "decode": lambda: bench_rows("decode", [(n, 1) for n in DECODE_BATCHES]),
        "verify": lambda: bench_rows("verify", VERIFY),
        "prefill": lambda: bench_prefill(jla_ssm),
    }
    for group in args.only.split(","):
        runs[group]()
        if out:  # written after every group: a run cut short still leaves its rows
            _write_report(Path(out), device_kind)
    print("\n" + timing._table(), flush=True)


if __name__ == "__main__":
    main()
