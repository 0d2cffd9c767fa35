"""Variants of the Mosaic GPU chunked GDN prefill on one GPU: check, then time.

Kernels: ``mgpu`` (pallas_kernels.gdn.chunk_mgpu, two kernels) and ``fused``
(pallas_kernels.gdn.chunk_fused_mgpu, one warp-specialised kernel). For each Qwen3-Next TP1
shape (H=16, HV=32, K=V=128, bf16) and each variant: checks outputs and the written pool
slots against the float32 chunked reference (slots nobody names must stay bit-identical,
outputs finite), then times the whole op with the pool donated (median of 3 x 20 calls).
Prints one JSON line per result as it goes and a table last; ``--out DIR`` writes the JSON.

Variants: ``mgpu[:BV]`` and ``fused[:BV][xP][sS]``; BV = value columns per CTA (32 or 64,
omitted: the kernel's own rule), P = producer warpgroups (1 or 2), S = SMEM slots (2 or 3).
``--budget SECONDS`` skips what would not finish in time; a hung kernel ends the run with a
traceback after ``--hang`` seconds. ``--smoke`` runs tiny shapes under the CPU interpreter (no GPU).

    python benchmarks/prefill_variants.py --budget 220
    python benchmarks/prefill_variants.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import pathlib
import re
import sys
import time

# The CPU interpreter (--smoke) runs each warpgroup's host callbacks on XLA's CPU worker
# pool; with few CPUs a warp-specialised kernel deadlocks there (tests/kernels/conftest.py).
# Read when the CPU client is created; harmless on the GPU machine.
os.environ.setdefault("NPROC", "16")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pallas_kernels import _mgpu_chunks  # noqa: E402
from pallas_kernels.gdn import chunk_fused_mgpu, chunk_mgpu, reference  # noqa: E402

__all__ = ["main"]


@dataclasses.dataclass(frozen=True)
class Dims:
    h: int
    hv: int
    k: int
    v: int


QWEN3_NEXT = Dims(16, 32, 128, 128)
SMOKE = Dims(1, 2, 64, 64)
SHAPES = {  # name: (sequence lengths, pooled initial states, padding tokens after qsl[N])
    # Not a benchmark shape: the GPU paths the shapes below never take (unaligned starts,
    # partial chunks stored row by row, an empty sequence, 13 padding tokens).
    "ragged": ([1000, 0, 37, 3000, 77, 1], True, 13),
    "1x8192": ([8192], False, 0),
    "1x32768": ([32768], False, 0),
    "4x8192": ([8192] * 4, False, 0),
    "8x2048": ([2048] * 8, False, 0),
    "varlen": ([256] * 64, True, 0),
    "smoke": ([30, 0, 70], True, 5),  # --smoke only
}
DEFAULT_SHAPES = "ragged,1x8192,varlen,4x8192,8x2048"
DEFAULT_VARIANTS = "mgpu,fused,fused:x2,fused:32s3,fused:64,fused:32"


def _inputs(dims: Dims, lens: list[int], pooled: bool, padding: int, seed: int = 0) -> tuple:
    tokens, n = sum(lens) + padding, len(lens)
    keys = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(keys[0], (tokens, dims.h, dims.k), jnp.bfloat16)
    k = jax.random.normal(keys[1], (tokens, dims.h, dims.k), jnp.bfloat16)
    v = jax.random.normal(keys[2], (tokens, dims.hv, dims.v), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (tokens, dims.hv)) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (tokens, dims.hv)))
    slots = n + 8
    pool = 0.1 * jax.random.normal(keys[5], (slots, dims.hv, dims.k, dims.v), jnp.float32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jax.random.permutation(keys[6], jnp.arange(1, slots, dtype=jnp.int32))[:n]
    init = jnp.full((n,), pooled)
    return q, k, v, g, beta, pool, qsl, idx, init


def _rel(a: jax.Array, b: jax.Array) -> float:
    """``|a - b| / |b|`` in float32 on the device (no host copies of large outputs)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _time(fn, args: tuple, pool: jax.Array, calls: int, repeats: int) -> float:
    """Median seconds per call; the pool is donated from call to call as in serving."""
    pool = fn(*args, pool)[1]
    jax.block_until_ready(pool)
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out, pool = fn(*args, pool)
        jax.block_until_ready((out, pool))
        per_call.append((time.perf_counter() - t0) / calls)
    return float(np.median(per_call))


def _parse(spec: str):
    """``(module, config)`` of a variant spec (see the module docstring)."""
    kernel, _, rest = spec.partition(":")
    match = re.fullmatch(r"(\d*)(?:x(\d))?(?:s(\d))?", rest)
    if match is None or kernel not in ("mgpu", "fused"):
        raise ValueError(f"variant {spec!r}: expected mgpu[:BV] or fused[:BV][xP][sS]")
    block_v = int(match[1]) if match[1] else None
    if kernel == "mgpu" and not (match[2] or match[3]):
        return chunk_mgpu, chunk_mgpu.Config(block_v=block_v)
    return chunk_fused_mgpu, chunk_fused_mgpu.Config(
        block_v=block_v, producers=int(match[2] or 1), slots=int(match[3] or 2)
    )


def _resolved(spec: str, n_seqs: int, dims: Dims) -> tuple:
    """What a variant compiles to at this shape (two specs may name the same kernel)."""
    module, config = _parse(spec)
    if module is chunk_mgpu:
        return ("mgpu", chunk_mgpu._resolve(config, n_seqs, dims.hv, dims.v).block_v)
    bv = chunk_fused_mgpu._block_v(config, n_seqs, dims.hv, dims.v)
    return ("fused", bv, config.producers, config.slots)


def _op(spec: str, interpret: bool):
    """The prefill op of a variant spec, pool last."""
    module, config = _parse(spec)

    def op(q, k, v, g, beta, qsl, idx, init, pool):
        return module.chunk_gated_delta_rule(
            q, k, v, g, beta, pool, qsl, idx, init, config=config, interpret=interpret
        )

    return op


def _intra_us(inputs: tuple, dims: Dims, n_seqs: int) -> float:
    """The two-kernel version's intra-chunk kernel alone (its share of the time)."""
    q, k, _, g, beta, _, qsl, _, _ = inputs
    tokens = q.shape[0]
    num_chunks = -(-tokens // chunk_mgpu.CHUNK) + 2 * (n_seqs + 1)
    table, first = _mgpu_chunks.chunk_table(qsl, tokens, num_chunks)

    @jax.jit
    def intra(q, k, g, beta):
        return chunk_mgpu._intra(
            q, k, g.T, beta.T, table, first, n_seqs=n_seqs, scale=dims.k**-0.5, interpret=None
        )

    jax.block_until_ready(intra(q, k, g, beta))
    t0 = time.perf_counter()
    for _ in range(20):
        res = intra(q, k, g, beta)
    jax.block_until_ready(res)
    return (time.perf_counter() - t0) / 20 * 1e6


@dataclasses.dataclass
class Case:
    """A shape's inputs and reference outputs, made once and kept for every variant."""

    inputs: tuple
    ref: tuple
    n_seqs: int
    end: int  # qsl[N]
    touched: np.ndarray  # slots of the non-empty sequences
    untouched: np.ndarray


def _case(name: str, dims: Dims) -> Case:
    lens, pooled, padding = SHAPES[name]
    inputs = _inputs(dims, lens, pooled, padding)
    q, k, v, g, beta, pool, qsl, idx, init = inputs
    ref = jax.jit(reference.chunk_gated_delta_rule_chunked)(q, k, v, g, beta, pool, qsl, idx, init)
    touched = np.asarray(idx)[np.asarray(lens) > 0]
    untouched = np.setdiff1d(np.arange(pool.shape[0]), touched)
    return Case(inputs, ref, len(lens), sum(lens), touched, untouched)


def _run_variant(spec: str, case: Case, opts: argparse.Namespace) -> dict:
    q, k, v, g, beta, pool, qsl, idx, init = case.inputs
    ro, rpool = case.ref
    fn = jax.jit(_op(spec, opts.smoke), donate_argnums=8)
    o, kpool = fn(q, k, v, g, beta, qsl, idx, init, jnp.array(pool))
    end = case.end
    row = {
        "rel_o": _rel(o[:end], ro[:end]),
        "rel_state": _rel(kpool[case.touched], rpool[case.touched]),
        "untouched_equal": bool(jnp.array_equal(kpool[case.untouched], pool[case.untouched])),
        "finite": bool(jnp.isfinite(o.astype(jnp.float32)).all()),
        "padding_zero": not bool(o[end:].astype(jnp.float32).any()),
    }
    calls, repeats = (1, 1) if opts.smoke else (20, 3)
    seconds = _time(fn, (q, k, v, g, beta, qsl, idx, init), jnp.array(pool), calls, repeats)
    row["us"] = seconds * 1e6
    row["mtok_s"] = q.shape[0] / seconds / 1e6
    return row


def run(shapes: list[str], specs: list[str], opts: argparse.Namespace, deadline: float) -> list:
    """Variant-major (the budget cuts the last variants, not the last shapes); every kernel
    a spec resolves to runs once per shape."""
    dims = SMOKE if opts.smoke else QWEN3_NEXT
    cases: dict[str, Case] = {}
    seen: dict[tuple, str] = {}
    rows = []
    for spec in specs:
        for name in shapes:
            row = {"shape": name, "variant": spec}
            key = (name, *_resolved(spec, len(SHAPES[name][0]), dims))
            row["resolved"] = list(key[1:])
            if key in seen:
                row["skipped"] = f"same kernel as {seen[key]}"
            elif deadline - time.monotonic() < opts.per_variant:
                row["skipped"] = "budget"
            else:
                seen[key] = spec
                # A deadlocked kernel never returns: end the run with a traceback instead.
                # (The CPU interpreter is slow, not hung.)
                faulthandler.dump_traceback_later(opts.hang * (20 if opts.smoke else 1), exit=True)
                try:
                    if name not in cases:
                        cases[name] = _case(name, dims)
                    row["tokens"] = cases[name].inputs[0].shape[0]
                    row |= _run_variant(spec, cases[name], opts)
                    if opts.intra and spec.startswith("mgpu") and not opts.smoke:
                        row["intra_us"] = _intra_us(cases[name].inputs, dims, cases[name].n_seqs)
                except Exception as e:  # keep the other variants' numbers
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                finally:
                    faulthandler.cancel_dump_traceback_later()
            print(json.dumps(row), flush=True)
            rows.append(row)
            if opts.out is not None:
                opts.out.mkdir(parents=True, exist_ok=True)
                (opts.out / "prefill_variants.json").write_text(json.dumps(rows, indent=1))
    return rows


def _table(rows: list[dict]) -> None:
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        f"{'shape':8} {'variant':11} {'us':>9} {'Mtok/s':>7} {'/mgpu':>6} {'rel o':>8} "
        f"{'rel S':>8} ok"
    )
    base = {r["shape"]: r["us"] for r in rows if r.get("variant") == "mgpu" and "us" in r}
    for r in rows:
        if "skipped" in r or "error" in r:
            what = "SKIPPED " + r["skipped"] if "skipped" in r else "ERROR " + r["error"][:100]
            print(f"{r['shape']:8} {r.get('variant', '-'):11} {what}")
            continue
        ok = r["untouched_equal"] and r["finite"] and r["padding_zero"]
        ok = ok and r["rel_o"] < 2e-2 and r["rel_state"] < 2e-2
        speedup = base.get(r["shape"], math.nan) / r["us"]
        print(
            f"{r['shape']:8} {r['variant']:11} {r['us']:9.1f} {r['mtok_s']:7.1f} "
            f"{speedup:6.2f} {r['rel_o']:8.1e} {r['rel_state']:8.1e} {ok}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--shapes", default=None, help=f"default {DEFAULT_SHAPES}")
    parser.add_argument("--variants", default=None, help=f"default {DEFAULT_VARIANTS}")
    parser.add_argument("--budget", type=float, default=220.0, help="seconds for the whole run")
    parser.add_argument("--per-variant", type=float, default=12.0, help="seconds kept per variant")
    parser.add_argument("--hang", type=float, default=60.0, help="seconds before a hang ends it")
    parser.add_argument("--intra", action="store_true", help="also time mgpu's intra kernel")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    opts = parser.parse_args()
    start = time.monotonic()
    deadline = start + opts.budget
    shapes = opts.shapes or ("smoke" if opts.smoke else DEFAULT_SHAPES)
    variants = opts.variants or ("mgpu,fused:64,fused:32x2" if opts.smoke else DEFAULT_VARIANTS)
    print(f"{jax.devices()[0].device_kind}: shapes {shapes}; variants {variants}", flush=True)
    rows = run(shapes.split(","), variants.split(","), opts, deadline)
    order = {name: i for i, name in enumerate(shapes.split(","))}
    _table(sorted(rows, key=lambda r: order[r["shape"]]))
    print(f"total {time.monotonic() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
