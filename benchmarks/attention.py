"""Ragged prefill attention on an H200: this project's paged attention against cuDNN, tokamax
and PyTorch's FlashAttention, at Qwen3-Next / Qwen3.5 attention shapes.

Run on the GPU machine (see benchmarks/README.md)::

    python3 benchmarks/attention.py [--cases 1x8192,4x8192,64x256,4x2048+6144] [--out DIR]

A case ``NxL`` is N rows of L new tokens each, fresh (no cached prefix); ``NxL+P`` gives every
row a cached prefix of P tokens. Shapes: 16 query heads on 2 KV heads of 256, bf16 queries,
keys, values and cache, pages of 16 tokens scattered over the cache (every page outside the
rows poisoned with NaN). Rows:

* ``ours``: ``paged_attention`` as the engine runs it (``impl="auto"``: writes the step's keys
  and values into the pages, the new tokens in the segment kernel, the cached prefix in the
  paged prefix kernel, merged), on the packed layout; device time from a profiler trace
  (``device_time.py``).
* ``ours jnp QxC``: the same with ``impl="reference"`` (every key from the pages, online
  softmax in jnp) in query blocks of Q tokens and key chunks of C positions.
* ``cudnn``, ``tokamax``: ``jax.nn.dot_product_attention(implementation="cudnn")`` and
  tokamax's Mosaic GPU flash attention on the padded ``[N, L, heads, 256]`` batch, causal; fresh
  cases only (neither reads pages); device time likewise. No page write.
* ``torch flash``: ``scaled_dot_product_attention`` with the FlashAttention backend, GQA,
  causal; ``triton.testing.do_bench`` (median, L2 flushed). Fresh cases only.

Each row prints its FLOP limit (QK^T and PV of the causal positions, each row's new tokens
against its prefix and themselves, at ``--flops``) and the fraction reached, and checks its
output against a float32 softmax of the same inputs (max abs error).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_time import device_time  # noqa: E402 (benchmarks/device_time.py)

from hybrid_jax.backend import attention as attention_backend  # noqa: E402
from hybrid_jax.metadata import BucketPolicy, ForwardMode, RowSpec, build_metadata  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 2, 256, 16


@dataclasses.dataclass(frozen=True)
class Case:
    rows: int
    new: int
    prefix: int = 0

    @classmethod
    def parse(cls, text: str) -> Case:
        shape, _, prefix = text.partition("+")
        rows, _, new = shape.partition("x")
        return cls(int(rows), int(new), int(prefix or 0))

    @property
    def name(self) -> str:
        return f"{self.rows}x{self.new}" + (f"+{self.prefix}" if self.prefix else "")

    @property
    def flops(self) -> float:
        # Per row: each new token t (0-based) sees prefix + t + 1 keys; QK^T and PV, 2 FLOPs
        # per multiply-add each.
        seen = self.new * self.prefix + self.new * (self.new + 1) / 2
        return self.rows * 4.0 * seen * HEADS * HEAD_DIM


@dataclasses.dataclass
class Inputs:
    q: jax.Array  # [N, L, H, hd]
    k: jax.Array  # [N, prefix + L, KVH, hd]: prefix then new
    v: jax.Array


def make_inputs(case: Case, seed: int = 0) -> Inputs:
    keys = jax.random.split(jax.random.key(seed), 3)
    total = case.prefix + case.new
    q = jax.random.normal(keys[0], (case.rows, case.new, HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(keys[1], (case.rows, total, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(keys[2], (case.rows, total, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    return Inputs(q, k, v)


def reference_rows(x: Inputs, case: Case, rows: int = 1, queries: int = 256) -> np.ndarray:
    """Float32 causal softmax attention of the last ``queries`` new tokens of the first
    ``rows`` rows: ``[rows, queries, H, hd]`` (the check compares those)."""
    queries = min(queries, case.new)
    q = x.q[:rows, -queries:].astype(jnp.float32)
    k = x.k[:rows].astype(jnp.float32)
    v = x.v[:rows].astype(jnp.float32)
    group = HEADS // KV_HEADS
    k = jnp.repeat(k, group, axis=2)
    v = jnp.repeat(v, group, axis=2)
    total = case.prefix + case.new
    pos = total - queries + jnp.arange(queries)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM**-0.5
    scores = jnp.where(jnp.arange(total)[None, :] <= pos[:, None], scores, -jnp.inf)
    return np.asarray(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v))


def ours(case: Case, x: Inputs, impl: str, block: int, chunk: int):
    """(device time, output ``[N, L, H, hd]``) of the engine's paged attention."""
    total = case.prefix + case.new
    per_row = -(-total // PAGE)
    num_pages = case.rows * per_row + 1
    rng = np.random.default_rng(1)
    pages = rng.permutation(np.arange(1, num_pages)).reshape(case.rows, per_row)
    policy = BucketPolicy(
        batch_buckets=(case.rows,),
        token_buckets=(case.rows * case.new,),
        page_size=PAGE,
        max_context=per_row * PAGE,
    )
    specs = [RowSpec(r + 1, case.prefix, case.new, tuple(pages[r])) for r in range(case.rows)]
    meta = build_metadata(
        ForwardMode.EXTEND, specs, policy, num_slots=case.rows + 1, num_pages=num_pages
    )
    # The prefix in its pages, NaN everywhere else (pages outside the rows must never count).
    flat_index = (pages[:, :, None] * PAGE + np.arange(PAGE)).reshape(case.rows, -1)
    shape = (num_pages * PAGE, KV_HEADS, HEAD_DIM)
    k_cache = jnp.full(shape, jnp.nan, jnp.bfloat16)
    v_cache = jnp.full(shape, jnp.nan, jnp.bfloat16)
    if case.prefix:
        where = jnp.asarray(flat_index[:, : case.prefix].reshape(-1))
        k_cache = k_cache.at[where].set(x.k[:, : case.prefix].reshape(-1, KV_HEADS, HEAD_DIM))
        v_cache = v_cache.at[where].set(x.v[:, : case.prefix].reshape(-1, KV_HEADS, HEAD_DIM))
    k_cache = k_cache.reshape(num_pages, PAGE, KV_HEADS, HEAD_DIM)
    v_cache = v_cache.reshape(num_pages, PAGE, KV_HEADS, HEAD_DIM)
    packed = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    q, k, v = packed(x.q), packed(x.k[:, case.prefix :]), packed(x.v[:, case.prefix :])

    attention_backend.QUERY_BLOCK, attention_backend.KEY_CHUNK = block, chunk
    step = jax.jit(
        lambda q, k, v, kp, vp, meta: attention_backend.paged_attention(
            q, k, v, kp, vp, meta, scale=HEAD_DIM**-0.5, impl=impl
        ),
        donate_argnums=(3, 4),
    )
    meta = jax.device_put(meta)
    state = {"pages": (k_cache, v_cache)}

    def call():
        out, kp, vp = step(q, k, v, *state["pages"], meta)
        state["pages"] = (kp, vp)
        return out

    timing = device_time(call, calls=5)
    out = call()
    return timing, out.reshape(case.rows, case.new, HEADS, HEAD_DIM)


def padded(case: Case, x: Inputs, attend):
    step = jax.jit(attend)
    timing = device_time(lambda: step(x.q, x.k, x.v), calls=5)
    return timing, step(x.q, x.k, x.v)


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def tokamax_mosaic(q, k, v):
    import tokamax

    return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")


def torch_flash(case: Case, x: Inputs):
    import torch
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def to_torch(a):
        return torch.from_dlpack(a).transpose(1, 2).contiguous()  # [N, H, L, hd]

    q, k, v = map(to_torch, (x.q, x.k, x.v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        run = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, enable_gqa=True
        )
        out = run()
        ms = triton.testing.do_bench(run, return_mode="median")
    return ms * 1e3, np.asarray(out.transpose(1, 2).float().cpu().numpy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="1x8192,4x8192,64x256,4x2048+6144")
    parser.add_argument("--ours", default="1024x1024,2048x1024,1024x2048,512x512",
                        help="QxC query-block x key-chunk variants of ours")  # fmt: skip
    parser.add_argument("--flops", type=float, default=7.9e14)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = parser.parse_args()
    versions = f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {platform.python_version()}"
    lines = [
        f"# Ragged prefill attention ({datetime.date.today()}, {versions})",
        "",
        f"16 q / 2 kv heads of 256, bf16, pages of {PAGE}; limit at {args.flops:.2g} FLOP/s.",
        "",
        "| case | variant | device ms | limit ms | fraction | max abs err |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    print("\n".join(lines), flush=True)
    for case in map(Case.parse, args.cases.split(",")):
        x = make_inputs(case)
        want = reference_rows(x, case)
        limit_ms = case.flops / args.flops * 1e3
        variants = [("ours", "auto 1024x1024")]
        variants += [(f"ours jnp {v}", f"reference {v}") for v in args.ours.split(",")]
        if not case.prefix:
            variants += [("cudnn", cudnn), ("tokamax", tokamax_mosaic), ("torch flash", None)]
        for name, variant in variants:
            try:
                if name.startswith("ours"):
                    impl, blocks = variant.split()
                    block, chunk = map(int, blocks.split("x"))
                    timing, out = ours(case, x, impl, block, chunk)
                    us = timing.us
                elif name == "torch flash":
                    us, out = torch_flash(case, x)
                else:
                    timing, out = padded(case, x, variant)
                    us = timing.us
                got = np.asarray(jnp.asarray(out)[:1, -want.shape[1] :].astype(jnp.float32))
                err = float(np.abs(got - want).max())
                row = (
                    f"| {case.name} | {name} | {us / 1e3:.3f} | {limit_ms:.3f} | "
                    f"{limit_ms * 1e3 / us:.0%} | {err:.2e} |"
                )
            except Exception as exc:  # noqa: BLE001 (a failing variant is a row, not the end)
                traceback.print_exc()
                why = f"{type(exc).__name__}: {str(exc)[:90]}"
                row = f"| {case.name} | {name} | failed: {why} | | | |"
            print(row, flush=True)
            lines.append(row)
    out = Path(args.out) / "RESULTS_attention.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
