"""tokamax's Mosaic GPU ragged dot at the MoE shapes of the Qwen3.5-35B-A3B-like preset, per
kernel config, beside the heuristic config tokamax picks without an autotuning cache.

Run on the GPU machine (see benchmarks/README.md)::

    python3 benchmarks/moe_variants.py [--out DIR]

Shapes: 256 experts of width 512 on hidden 2048, top 8; ``prefill``: 8192 tokens (65536 routed
rows), ``decode B``: B tokens; the gate/up product (K=2048, N=512), gate and up fused (N=1024)
and the down product (K=512, N=2048). Rows are spread over the experts at random (multinomial).
Device time from a profiler trace; the limit is the larger of the FLOP time (7.9e14 FLOP/s)
and the byte time of the experts touched (4.3e12 B/s).

At up to 64 routed rows (``BY_ID_MAX_PAIRS``) the fused gate/up and down products also run
in ``moe.expert_matmul`` (each token's experts read by id, ``by id`` rows; each token takes 8
distinct experts), and ``--bucket N`` adds ``by id, T of N`` rows: T real tokens in a decode
bucket of N rows, the rest padding (ids out of range), as the engine runs batch 1. Each
fused gate/up row is followed by the hidden rows formed in the launch from paired weight
tiles (``moe.expert_hidden``). The by-id rows re-read the same few experts
every call, which fit in the H200's 50 MB L2: they are warm-cache times, below what a step
whose layers each read new experts takes (``benchmarks/RESULTS_serve.md``, session 31).
``--mlp-layers L`` (with ``--tokens "" --configs ""`` alone) times a batch-1 bucket's hidden
and down launches against both in one launch (``moe.expert_mlp``) over L layers of their own
experts, and checks that the two give the same bits.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_time import device_time  # noqa: E402

from hybrid_jax.layers.moe import BY_ID_MAX_PAIRS  # noqa: E402
from pallas_kernels import moe  # noqa: E402

EXPERTS, HIDDEN, WIDTH, TOP_K = 256, 2048, 512, 8
CONFIGS = {
    # name: (block_m, block_n, block_k, num_stages, persistent, grid_minor_dim, tile_width)
    "m128 k128 s4": (128, 64, 128, 4, False, "M", 1),
    "m128 k256 s4": (128, 64, 256, 4, False, "M", 1),
    "m128 k128 s4 N4 pers": (128, 64, 128, 4, True, "N", 4),
    "m128 k256 s2 M8 pers": (128, 64, 256, 2, True, "M", 8),
    "m64 k256 s4": (64, 64, 256, 4, False, "M", 1),
    "m32 k512 s4": (32, 64, 512, 4, False, "M", 1),
    "m16 k512 s4": (16, 64, 512, 4, False, "M", 1),
}


def _by_id_rows(tokens: int, bucket: int, rng: np.random.Generator) -> list[str]:
    """``moe.expert_matmul`` for the fused gate/up and the down product of ``tokens`` tokens,
    alone and as the real rows of a decode bucket of ``bucket`` rows."""
    out = []
    cases = [(tokens, tokens)] + ([(tokens, bucket)] if bucket > tokens else [])
    for real, rows in cases:
        chosen = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(rows)])
        chosen[real:] = EXPERTS  # padding rows: out of range, read nothing
        touched = len(np.unique(chosen[:real]))
        label = "by id" if real == rows else f"by id, {real} of {rows}"
        for product, k, n in (("gate+up fused", HIDDEN, 2 * WIDTH), ("down", WIDTH, HIDDEN)):
            keys = jax.random.split(jax.random.key(k * n + rows), 2)
            pairs = chosen if product != "down" else chosen.reshape(-1, 1)
            x = jax.random.normal(keys[0], (pairs.shape[0], k), jnp.bfloat16)
            w = jax.random.normal(keys[1], (EXPERTS, k, n), jnp.bfloat16) * k**-0.5
            ids = jnp.asarray(pairs, jnp.int32)
            f = jax.jit(lambda x, w, e: moe.expert_matmul(x, w, e, impl="pallas"))
            got = np.asarray(f(x, w, ids), np.float32)
            want = np.asarray(moe.expert_matmul_reference(x, w, ids), np.float32)
            err = float(np.abs(got - want).max())
            us = device_time(lambda f=f, a=(x, w, ids): f(*a), calls=5).us
            limit_us = (touched * k * n * 2 + real * TOP_K * (k + n) * 2) / 4.3e12 * 1e6
            out.append(
                f"| {real} | {product} | {label} | {us:.1f} | {limit_us:.1f} | "
                f"{limit_us / us:.0%} |" + (f" err {err:.2g}" if err > 0.05 else "")
            )
            if product != "down":
                out.append(_paired_hidden_row(x, w, ids, real, label, limit_us))
    return out


def _paired_hidden_row(x, w, ids, real: int, label: str, limit_us: float) -> str:
    """``moe.expert_hidden``: the same products with the SwiGLU formed in the launch, each
    program reading one tile of 32 gate and 32 up columns (the weights laid out by
    ``moe.pair_halves``), against the reference's SwiGLU."""
    paired = moe.pair_halves(w)
    f = jax.jit(lambda x, w, e: moe.expert_hidden(x, w, e, impl="pallas"))
    got = np.asarray(f(x, paired, ids), np.float32)
    want = np.asarray(moe.expert_hidden(x, paired, ids, impl="reference"), np.float32)
    err = float(np.abs(got - want).max())
    us = device_time(lambda a=(x, paired, ids): f(*a), calls=5).us
    return (
        f"| {real} | gate+up fused | hidden rows in the launch (paired tiles), {label} | "
        f"{us:.1f} | {limit_us:.1f} | {limit_us / us:.0%} |"
        + (f" err {err:.2g}" if err > 0.05 else "")
    )


def _one_launch_rows(bucket: int, layers: int, rng: np.random.Generator) -> list[str]:
    """A batch-1 decode bucket's experts over ``layers`` layers in one program (each layer
    its own random experts, so few are in L2 from the layer before), as the hidden launch
    and the down launch (with the shared expert's down product) against both in one
    launch (``moe.expert_mlp``): device us a layer, kernels summed and first start to last
    end, and whether the two forms give the same bits."""
    keys = jax.random.split(jax.random.key(bucket * layers), 6)
    up = moe.pair_halves(
        jax.random.normal(keys[0], (EXPERTS, HIDDEN, 2 * WIDTH), jnp.bfloat16) * HIDDEN**-0.5
    )
    down = jax.random.normal(keys[1], (EXPERTS, WIDTH, HIDDEN), jnp.bfloat16) * WIDTH**-0.5
    shared_down = jax.random.normal(keys[2], (WIDTH, HIDDEN), jnp.bfloat16) * WIDTH**-0.5
    x = jax.random.normal(keys[3], (bucket, HIDDEN), jnp.bfloat16)
    shared = jax.random.normal(keys[4], (bucket, WIDTH), jnp.bfloat16)
    square_sum = jnp.full((bucket,), float(HIDDEN), jnp.float32)
    ids = np.full((layers, bucket, TOP_K), EXPERTS, np.int32)
    ids[:, 0] = [rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(layers)]
    ids = jnp.asarray(ids)
    kw = dict(row_scale=square_sum, rms_eps=1e-6, impl="pallas")

    def two_launches(up, down, ids):
        tiles = moe.expert_hidden(x, up, ids, tiles=True, **kw)
        return moe.expert_matmul(
            tiles, down, ids.reshape(-1, 1), dense=(shared, shared_down), impl="pallas"
        )

    def one_launch(up, down, ids):
        return moe.expert_mlp(x, up, down, ids, dense=(shared, shared_down), **kw)

    limit_us = (TOP_K * 3 * HIDDEN * WIDTH + WIDTH * HIDDEN) * 2 / 4.3e12 * 1e6
    out, results = [], []
    forms = [("hidden launch, then down launch", two_launches),
             ("one launch (expert_mlp)", one_launch)]  # fmt: skip
    for label, form in forms:
        f = jax.jit(lambda up, down, ids, form=form: [form(up, down, i) for i in ids])
        results.append(jax.device_get(f(up, down, ids)))
        t = device_time(lambda f=f: f(up, down, ids), calls=5)
        out.append(
            f"| 1 of {bucket} | hidden + down, {layers} layers | {label} | "
            f"{t.us / layers:.1f} (span {t.span_us / layers:.1f}) | {limit_us:.1f} | "
            f"{limit_us * layers / t.span_us:.0%} | {t.breakdown(top=4)}"
        )
    same = all(
        np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
        for other in results[1:]
        for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(other), strict=True)
    )
    out.append(f"| | | the two forms' outputs {'bit for bit equal' if same else 'DIFFER'} | | | |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="8192,64,1")
    parser.add_argument(
        "--configs", default=",".join(["heuristic", *CONFIGS]),
        help="tokamax configs to time, comma-separated",
    )  # fmt: skip
    parser.add_argument("--bucket", type=int, default=8, help="decode bucket of the by-id rows")
    parser.add_argument(
        "--mlp-layers", type=int, default=0,
        help="also time a batch-1 bucket's hidden and down launches against one launch "
        "(moe.expert_mlp) over this many layers; 0: not",
    )  # fmt: skip
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args()
    chosen = [c for c in args.configs.split(",") if c]
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as rd
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu_common as rd_common

    lines = [
        f"# tokamax ragged dot configs ({datetime.date.today()}, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind})",
        "",
        "| tokens | product | config | device us | limit us | fraction |",
        "| ---: | --- | --- | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    rng = np.random.default_rng(0)
    if args.mlp_layers:
        for row in _one_launch_rows(args.bucket, args.mlp_layers, rng):
            print(row, flush=True)
            lines.append(row)
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        rows = tokens * TOP_K
        sizes = rng.multinomial(rows, np.ones(EXPERTS) / EXPERTS).astype(np.int32)
        touched = int((sizes > 0).sum())
        group_sizes = jnp.asarray(sizes)
        for product, k, n in (("gate/up", HIDDEN, WIDTH), ("gate+up fused", HIDDEN, 2 * WIDTH),
                              ("down", WIDTH, HIDDEN)):  # fmt: skip
            keys = jax.random.split(jax.random.key(k * n + rows), 2)
            x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
            w = jax.random.normal(keys[1], (EXPERTS, k, n), jnp.bfloat16) * k**-0.5
            flops = 2.0 * rows * k * n
            moved = touched * k * n * 2 + rows * (k + n) * 2
            limit_us = max(flops / 7.9e14, moved / 4.3e12) * 1e6
            want = None
            for name, cfg in [("heuristic", None), *CONFIGS.items()]:
                if name not in chosen:
                    continue
                try:
                    if cfg is None:
                        op = rd.PallasMosaicGpuRaggedDot()
                    else:
                        bm, bn, bk, stages, persistent, minor, width = cfg
                        op = rd.PallasMosaicGpuRaggedDot(
                            config=rd_common.Config(
                                block_m=bm, block_n=bn, block_k=bk, num_stages=stages,
                                split_k=1, persistent=persistent,
                                grid_minor_dim=getattr(rd_common.MatmulDimension, minor),
                                grid_tile_width=width,
                            )
                        )  # fmt: skip
                    f = jax.jit(
                        lambda x, w, g, op=op: op(
                            x, w, group_sizes=g, preferred_element_type=jnp.bfloat16
                        )
                    )
                    out = f(x, w, group_sizes)
                    if want is None:
                        want = out
                    err = float(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)).max())
                    us = device_time(lambda f=f, a=(x, w, group_sizes): f(*a), calls=5).us
                    row = (
                        f"| {tokens} | {product} | {name} | {us:.1f} | {limit_us:.1f} | "
                        f"{limit_us / us:.0%} |" + (f" err {err:.2g}" if err > 0.05 else "")
                    )
                except Exception as exc:  # noqa: BLE001 (a failing config is a row)
                    traceback.print_exc(limit=1)
                    row = f"| {tokens} | {product} | {name} | failed: {str(exc)[:80]} | | |"
                print(row, flush=True)
                lines.append(row)
        if rows <= BY_ID_MAX_PAIRS:
            for row in _by_id_rows(tokens, args.bucket, rng):
                print(row, flush=True)
                lines.append(row)
    if not any(args.tokens.split(",")):  # the --mlp-layers rows alone: not the configs' table
        print("no --tokens: RESULTS_moe_variants.md left as it is", flush=True)
        return
    (Path(args.out) / "RESULTS_moe_variants.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
