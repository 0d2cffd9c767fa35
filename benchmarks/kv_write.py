"""Writing a step's keys and values into the paged KV cache, as the model does it: a
``lax.scan`` over the attention layers with the flat ``[L*P, page_size, KVH, hd]`` cache as
its carry, each layer writing K and V of every token at its page and offset.

Rows: the backend's ``write_pages`` (``WRITERS`` holds variants to compare), device time per
step and per layer write, beside the bytes limit (the written tokens' K and V, read once and
written once). The step's cache is donated, as in the engine, so a write that is not in place
shows as a copy.

    python benchmarks/kv_write.py --batches 1,64,256 --context 8192 --layers 10

``--smoke``: tiny shapes on the CPU, timed by the host clock (the check still counts).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_time import device_time  # noqa: E402

from hybrid_jax.backend import attention as attention_backend  # noqa: E402
from hybrid_jax.metadata import BucketPolicy, ForwardMode, RowSpec, build_metadata  # noqa: E402

WRITERS = {"write_pages": attention_backend.write_pages}


def _step(writer, layers, num_pages):
    def step(k_cache, v_cache, k_new, v_new, meta):
        def layer(carry, i):  # as backend.attention.paged_attention reads a layer's pages
            k_cache, v_cache = carry
            layer_meta = meta.at_attention_layer(i, num_pages)
            token_pages = attention_backend._token_pages(layer_meta)
            k_cache = writer(k_cache, k_new[i], layer_meta, token_pages)
            v_cache = writer(v_cache, v_new[i], layer_meta, token_pages)
            return (k_cache, v_cache), None

        (k_cache, v_cache), _ = jax.lax.scan(
            layer, (k_cache, v_cache), jnp.arange(layers, dtype=jnp.int32)
        )
        return k_cache, v_cache

    return jax.jit(step, donate_argnums=(0, 1))


def _time_us(call, *, on_gpu: bool) -> tuple[float, float, str]:
    """(step us, copy us, the longest kernels): profiler device time on a GPU, else the
    host clock's median over ten calls (no breakdown)."""
    if on_gpu:
        t = device_time(call, calls=10)
        return t.us, t.copy_us, t.breakdown(3)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return sorted(times)[5] * 1e6, 0.0, "host clock"


def _rows(batch, args) -> bool:
    """Prints a row per writer; True when every writer left the step's keys where they go."""
    size, layers = args.page_size, args.layers
    per_row = -(-(args.context + 1) // size)
    num_pages = batch * per_row + 1
    rng = np.random.default_rng(0)
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, per_row)
    policy = BucketPolicy(batch_buckets=(batch,), token_buckets=(batch,), page_size=size,
                          max_context=per_row * size)  # fmt: skip
    specs = [RowSpec(b + 1, args.context, 1, tuple(int(p) for p in table[b])) for b in range(batch)]
    meta = jax.device_put(build_metadata(ForwardMode.DECODE, specs, policy, num_slots=batch + 1,
                                         num_pages=num_pages))  # fmt: skip
    shape = (layers * num_pages, size, args.kv_heads, args.head_dim)
    new_shape = (layers, batch, args.kv_heads, args.head_dim)
    keys = jax.random.split(jax.random.key(1), 2)
    k_new = jax.random.normal(keys[0], new_shape, jnp.bfloat16)
    v_new = jax.random.normal(keys[1], new_shape, jnp.bfloat16)
    # What each layer's write must leave at the step's position.
    where = table[np.arange(batch), args.context // size] + num_pages * np.arange(layers)[:, None]
    gb = 2 * layers * num_pages * size * args.kv_heads * args.head_dim * 2 / 1e9
    label = f"B={batch} ctx={args.context} L={layers}"
    step_args = (k_new, v_new, meta)
    all_ok = True
    for name, writer in WRITERS.items():
        try:
            fn = _step(writer, layers, num_pages)
            ok = _writer_row(f"{label} ({gb:.1f} GB)", name, fn, shape, step_args, where, args)
        except Exception as err:  # a failed row is reported, the rest still runs
            print(f"| {label} | {name} | failed: {str(err)[:300]} |")
            ok = False
        all_ok &= ok
    return all_ok


def _writer_row(label, name, fn, shape, step_args, where, args) -> bool:
    """Checks and times one writer's step on a NaN-filled cache; prints its row."""
    cache = [jnp.full(shape, jnp.nan, jnp.bfloat16) for _ in range(2)]
    cache[:] = fn(*cache, *step_args)
    k_new = step_args[0]
    got = np.asarray(cache[0][where, args.context % args.page_size], np.float32)
    ok = np.array_equal(got, np.asarray(k_new, np.float32))

    def call():
        cache[:] = fn(*cache, *step_args)
        return cache

    us, copy_us, longest = _time_us(call, on_gpu=jax.default_backend() == "gpu")
    writes = 2 * args.layers
    limit_us = 2 * 2 * k_new.size * 2 / args.bandwidth * 1e6
    print(
        f"| {label} | {name} | {us:.1f} us | {us / writes:.1f} us | {copy_us:.1f} us | "
        f"{limit_us:.1f} us | {'ok' if ok else 'WRONG'} | {longest} |",
        flush=True,
    )
    if args.hlo:
        text = fn.lower(*cache, *step_args).compile().as_text()
        Path(args.hlo).mkdir(parents=True, exist_ok=True)
        stem = f"kv_write_{label.split()[0]}_{name.replace(' ', '_')}.txt"
        (Path(args.hlo) / stem).write_text(text)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the limit")
    parser.add_argument("--hlo", default="", help="folder for the compiled HLO of each row")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.context, args.layers, args.head_dim = "1,3", 40, 3, 8
    print(f"# {datetime.date.today()} {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"python {platform.python_version()}")  # fmt: skip
    print("| shape | writer | step | per write | copies | bytes limit | check | longest |")
    print("|---|---|---|---|---|---|---|---|")
    results = [_rows(int(b), args) for b in args.batches.split(",")]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
