"""A layer's input projections at decode's few rows: ``pallas_kernels.projections`` (one
launch) beside XLA's products (cuBLAS, one per weight), at the shapes of the serving presets.

Run on the GPU machine (see benchmarks/README.md)::

    python3 benchmarks/projections.py [--rows 8,64] [--out DIR]

Each call reads a different copy of its weights (copies adding up to more than the L2
cache), as a step's layers do. Device time from a profiler trace (``device_time``: the
kernels of one call); the limit is the weights' bytes (and the rows') at 4.3e12 B/s.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_time import device_time  # noqa: E402
from switches import switches_set  # noqa: E402

from pallas_kernels import _skinny, projections  # noqa: E402

BANDWIDTH = 4.3e12
L2_BYTES = 50 * 2**20
# name: (K, the weights' widths): the products one input feeds in a decode step.
CASES = {
    "35B GDN qkv|z|b a": (2048, (8192, 4096, 64)),
    "35B attention q|k|v": (2048, (8192, 512, 512)),
    "35B MoE router|shared gate|up": (2048, (256, 512, 512)),
    "35B GDN out_proj": (4096, (2048,)),
    "35B shared expert down": (512, (2048,)),
    "9B GDN qkv|z|b a": (4096, (8192, 4096, 64)),
    "9B attention q|k|v": (4096, (8192, 1024, 1024)),
    "9B MLP gate|up": (4096, (12288, 12288)),
    "9B MLP down": (12288, (4096,)),
    "9B GDN out_proj": (4096, (4096,)),
}


def _copies(k: int, widths: tuple[int, ...]) -> int:
    """Weight copies a run cycles through: together more than twice the L2 cache."""
    return min(64, max(4, -(-4 * L2_BYTES // (k * sum(widths) * 2))))


def _time(fn, x, weight_sets) -> float:
    cycle = itertools.cycle(weight_sets)
    return device_time(lambda: fn(x, next(cycle)), calls=len(weight_sets)).us


def _traced_with(stages: int, overlap: bool, swap: bool, fill: bool):
    """The one launch traced with a ring of ``stages`` buffers and the product variants
    (``_skinny.STAGES``, ``OVERLAP_PRODUCTS``, ``SWAP_OPERANDS``, ``RING_FILLS_SM``, read when
    the launch is traced): the first call's function, which traces and compiles with them,
    and the compiled function for the timed calls."""
    fn = jax.jit(functools.partial(projections.projections, impl="pallas"))
    variant = {(_skinny, "STAGES"): stages, (_skinny, "OVERLAP_PRODUCTS"): overlap,
               (_skinny, "SWAP_OPERANDS"): swap, (_skinny, "RING_FILLS_SM"): fill}  # fmt: skip

    def first_call(x, weights):
        with switches_set(variant):
            return fn(x, weights)

    return first_call, fn


def rows_of(
    name: str,
    rows: int,
    rng: np.random.Generator,
    rings: tuple[tuple[int, bool, bool, bool], ...] = (),
) -> list[str]:
    k, widths = CASES[name]
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    weight_sets = [
        tuple(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16) for n in widths)
        for _ in range(_copies(k, widths))
    ]
    limit_us = (k * sum(widths) + rows * (k + sum(widths))) * 2 / BANDWIDTH * 1e6
    want = [np.asarray(x, np.float64) @ np.asarray(w, np.float64) for w in weight_sets[0]]
    variants = {
        "XLA (one product per weight)": jax.jit(projections.projections_reference),
        "projections (one launch)": jax.jit(
            functools.partial(projections.projections, impl="pallas")
        ),
    }
    if projections.partial_splits(k, widths) > 1:  # few column tiles: K split too
        variants["partials (K split, summed by XLA)"] = jax.jit(
            lambda x, ws: tuple(
                p.sum(0).astype(x.dtype)
                for p in projections.projection_partials(x, ws, impl="pallas")
            )
        )
    firsts = dict(variants)
    for stages, overlap, swap, fill in rings:
        label = (
            f"projections (one launch, {stages} stages{', overlapped' if overlap else ''}"
            f"{', swapped' if swap else ''}{', ring filling the SM' if fill else ''})"
        )
        firsts[label], variants[label] = _traced_with(stages, overlap, swap, fill)
    out = []
    for label, fn in variants.items():
        got = firsts[label](x, weight_sets[0])
        err = max(
            float(np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max())
            for g, w in zip(got, want, strict=True)
        )
        us = _time(fn, x, weight_sets)
        flag = f" err {err:.2g}" if err > 2e-2 else ""
        out.append(
            f"| {name} | {rows} | {label} | {us:.1f} | {limit_us:.1f} | {limit_us / us:.0%} |"
            + flag
        )
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--cases", default="", help="comma-separated names (default: all)")
    parser.add_argument(
        "--stages", default="",
        help=f"also the one launch with these ring depths, comma-separated (default ring: "
        f"{_skinny.STAGES}); a depth followed by 'o' overlaps the products "
        "(_skinny.OVERLAP_PRODUCTS), by 's' swaps their operands (SWAP_OPERANDS), by 'f' "
        "deepens the ring of a launch of one program an SM (RING_FILLS_SM): 4,4o,4os,4osf",
    )  # fmt: skip
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args()
    specs = [v for v in args.stages.split(",") if v]
    bad = [v for v in specs if not re.fullmatch(r"[1-9][0-9]*o?s?f?", v)]
    if bad:
        parser.error(
            f"--stages {args.stages!r}: {bad} are not a depth with optional o, s, f (4osf)"
        )
    rings = tuple((int(v.rstrip("osf")), "o" in v, "s" in v, "f" in v) for v in specs)
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"--cases: {unknown} not among {sorted(CASES)}")
    rng = np.random.default_rng(0)
    lines = [
        f"{datetime.date.today()}, {jax.devices()[0].device_kind}, jax {jax.__version__}",
        "",
        "| product | rows | variant | us | limit us | fraction |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    for name in names:
        for rows in (int(r) for r in args.rows.split(",")):
            lines += rows_of(name, rows, rng, rings)
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "RESULTS_projections.md").write_text(text)


if __name__ == "__main__":
    main()
