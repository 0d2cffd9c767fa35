"""Variants of the Mosaic GPU chunked GDN prefill (pallas_kernels.gdn.chunk_mgpu) on one GPU.

For each Qwen3-Next TP1 shape (H=16, HV=32, K=V=128, bf16) and each kernel configuration:
checks the kernel against the float32 chunked reference (outputs and the written pool
slots), then times the whole op (pool donated) by host step time and by device time (the
kernels' own durations from a profiler trace, ``device_time.py``, with the top kernels), and
the intra-chunk kernel alone. Prints a table last; ``--out DIR`` also writes JSON.

    python benchmarks/prefill_variants.py [--out DIR] [--shapes 1x8192] [--variants auto,dbl]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import device_time  # benchmarks/device_time.py (this script's folder is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _mgpu_chunks
from pallas_kernels.gdn import chunk_mgpu, reference

__all__ = ["main"]

H, HV, K, V = 16, 32, 128, 128
SHAPES = {  # name: (sequence lengths, pooled initial states)
    "1x8192": ([8192], False),
    "1x32768": ([32768], False),
    "4x8192": ([8192] * 4, False),
    "8x2048": ([2048] * 8, False),
    "varlen": ([256] * 64, True),
    # Not a benchmark shape: the GPU paths the shapes above never take (unaligned starts,
    # partial chunks stored row by row, an empty sequence, 13 padding tokens).
    "ragged": ([1000, 0, 37, 3000, 77, 1], True),
}
PADDING = {"ragged": 13}  # tokens after qsl[N] (outputs must be zeros)


def _inputs(lens: list[int], pooled: bool, padding: int = 0, seed: int = 0) -> tuple:
    tokens, n = sum(lens) + padding, len(lens)
    keys = jax.random.split(jax.random.key(seed), 7)
    q = jax.random.normal(keys[0], (tokens, H, K), jnp.bfloat16)
    k = jax.random.normal(keys[1], (tokens, H, K), jnp.bfloat16)
    v = jax.random.normal(keys[2], (tokens, HV, V), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (tokens, HV)) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (tokens, HV)))
    slots = n + 8
    pool = 0.1 * jax.random.normal(keys[5], (slots, HV, K, V), jnp.float32)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    idx = jax.random.permutation(keys[6], jnp.arange(1, slots, dtype=jnp.int32))[:n]
    init = jnp.full((n,), pooled)
    return q, k, v, g, beta, pool, qsl, idx, init


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _time(fn, args: tuple, pool: jax.Array, calls: int = 20, repeats: int = 3) -> float:
    """Median seconds per call; the pool is donated from call to call as in serving."""
    for _ in range(3):
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


def _variant(spec: str) -> chunk_mgpu.Config:
    """``"auto"``: the default config; ``"dbl"``: the default with ``T`` doubled from 2x2
    blocks instead of the substitution of its diagonal blocks; ``"64"``: block_v 64; a
    trailing ``k`` forces K-major B operands (``"64k"``); ``"ws2"``, ``"ws3"``: the
    warp-specialised state pass with 2 or 3 stages, ``"ws2/64"`` with block_v 64."""
    if spec == "auto":
        return chunk_mgpu.Config()
    if spec == "dbl":
        return chunk_mgpu.Config(substitution=False)
    if spec.startswith("ws"):
        stages, _, block_v = spec[2:].partition("/")
        return chunk_mgpu.Config(
            block_v=int(block_v) if block_v else None, state_stages=int(stages)
        )
    kmajor = True if spec.endswith("k") else None
    return chunk_mgpu.Config(block_v=int(spec.rstrip("k")), kmajor=kmajor)


def run_shape(name: str, specs: list[str]) -> list[dict]:
    lens, pooled = SHAPES[name]
    q, k, v, g, beta, pool, qsl, idx, init = _inputs(lens, pooled, PADDING.get(name, 0))
    ref = jax.jit(reference.chunk_gated_delta_rule_chunked)
    ro, rpool = ref(q, k, v, g, beta, pool, qsl, idx, init)
    rows = []
    for spec in specs:
        try:
            row = _run_variant(name, spec, (q, k, v, g, beta, pool, qsl, idx, init), ro, rpool)
        except Exception as e:  # keep the other variants' numbers
            row = {"shape": name, "variant": spec, "error": f"{type(e).__name__}: {e}"[:400]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _run_variant(name: str, spec: str, inputs: tuple, ro: jax.Array, rpool: jax.Array) -> dict:
    q, k, v, g, beta, pool, qsl, idx, init = inputs
    lens = SHAPES[name][0]
    config = _variant(spec)
    tokens = q.shape[0]
    row = {"shape": name, "variant": spec, "tokens": tokens}

    def op(q, k, v, g, beta, qsl, idx, init, pool):
        return chunk_mgpu.chunk_gated_delta_rule(
            q, k, v, g, beta, pool, qsl, idx, init, config=config
        )

    fn = jax.jit(op, donate_argnums=8)
    o, kpool = fn(q, k, v, g, beta, qsl, idx, init, jnp.array(pool))
    touched = np.asarray(idx)
    untouched = np.setdiff1d(np.arange(pool.shape[0]), touched)
    row["rel_o"] = _rel(o.astype(jnp.float32), ro.astype(jnp.float32))
    row["rel_state"] = _rel(kpool[touched], rpool[touched])
    row["untouched_equal"] = bool(
        np.array_equal(np.asarray(kpool[untouched]), np.asarray(pool[untouched]))
    )
    row["finite"] = bool(np.isfinite(np.asarray(o.astype(jnp.float32))).all())
    args = (q, k, v, g, beta, qsl, idx, init)
    seconds = _time(fn, args, jnp.array(pool))
    row["us"] = seconds * 1e6
    row["mtok_s"] = tokens / seconds / 1e6
    held = [jnp.array(pool)]

    def call():
        out, held[0] = fn(*args, held[0])
        return out

    measured = device_time.device_time(call, calls=10)
    row["device_us"] = measured.us
    row["device_mtok_s"] = tokens / measured.us
    row["kernels"] = measured.breakdown(top=6, width=40)

    # The intra-chunk kernel alone (its share of the time).
    padded = tokens
    num_chunks = -(-padded // chunk_mgpu.CHUNK) + 2 * (len(lens) + 1)
    table, first = _mgpu_chunks.chunk_table(qsl, padded, num_chunks)

    @jax.jit
    def intra(q, k, g, beta):
        return chunk_mgpu._intra(
            q, k, g.T, beta.T, table, first, n_seqs=len(lens), scale=K**-0.5,
            solve=config.substitution, interpret=None,
        )  # fmt: skip

    intra(q, k, g, beta)
    t0 = time.perf_counter()
    for _ in range(20):
        res = intra(q, k, g, beta)
    jax.block_until_ready(res)
    row["intra_us"] = (time.perf_counter() - t0) / 20 * 1e6
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "ragged"))
    parser.add_argument("--variants", default="auto,dbl", help="see _variant")
    args = parser.parse_args()
    rows = []
    for name in args.shapes.split(","):
        rows += run_shape(name, args.variants.split(","))
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "prefill_variants.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(
        f"{'shape':9} {'var':>5} {'us':>9} {'Mtok/s':>7} {'dev us':>8} {'dev Mt/s':>8} "
        f"{'intra us':>9} {'rel o':>8} {'rel S':>8} ok"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:9} {r['variant']:>5} ERROR {r['error'][:90]}")
            continue
        ok = r["untouched_equal"] and r["finite"]
        print(
            f"{r['shape']:9} {r['variant']:>5} {r['us']:9.1f} {r['mtok_s']:7.1f} "
            f"{r['device_us']:8.1f} {r['device_mtok_s']:8.1f} {r['intra_us']:9.1f} "
            f"{r['rel_o']:8.1e} {r['rel_state']:8.1e} {ok}"
        )
    for r in rows:
        if "kernels" in r:
            print(f"{r['shape']:9} {r['variant']:>5} {r['kernels']}")


if __name__ == "__main__":
    main()
