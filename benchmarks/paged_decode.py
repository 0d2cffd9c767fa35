"""Decode attention over the paged KV cache on an H200: the Mosaic GPU kernel
(``pallas_kernels.attention.paged_decode_attention``) against the engine's jnp path and the
gathered-page reference, at Qwen3-Next / Qwen3.5 attention shapes.

Run on the GPU machine (see benchmarks/README.md)::

    python3 benchmarks/paged_decode.py [--batches 1,16,64,256] [--contexts 1024,8192,32768]

Shapes: 16 query heads on 2 KV heads of 256 (``--heads``, ``--kv-heads``, ``--head-dim``),
bf16 queries and cache, pages of ``--page-size`` tokens scattered over the cache, every entry
outside the rows poisoned with NaN. Rows per (batch, context):

* ``kernel``: the Mosaic GPU kernel (``impl="pallas"``, splits from ``pick_num_splits``, its
  ring of ``STAGES`` buffers); ``kernel, N stages``: the same with ``--stages`` rings,
  ``kernel, N splits``: with ``--splits`` programs a row;
* ``jnp``: ``backend.attention.paged_attention`` in DECODE with ``impl="reference"`` (the
  engine's path off the GPU and where the kernel cannot take a step: key chunks up to each
  row's length, online softmax);
* ``reference``: the op's jnp reference (every page of the table gathered);
* ``--flashinfer``: FlashInfer's paged decode wrapper on the same cache (a CUDA graph of
  its launches, timed with CUDA events; it JIT-compiles its kernel on first use);
* ``--tree D``: verify rows, the kernel over a chain of D draft tokens and over a random tree
  of D nodes per row (D x query heads per KV head <= 64).

Device time from a profiler trace (``device_time.py``); the limit is the KV bytes the rows
hold (keys and values of ``context`` positions per row and KV head) at ``--bandwidth``;
each row checks its output against a float32 softmax of the same inputs (max abs error).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_time import device_time  # noqa: E402

from hybrid_jax.backend import attention as attention_backend  # noqa: E402
from hybrid_jax.metadata import BucketPolicy, ForwardMode, RowSpec, build_metadata  # noqa: E402
from pallas_kernels.attention import paged_decode as pd  # noqa: E402


@functools.partial(jax.jit, static_argnums=(1, 2))
def _poisoned_pages(key, shape, tail, last_pages):
    """Random bf16 pages ``shape`` with NaN past every row's length (the tail of each page in
    ``last_pages`` from position ``tail``) and in the pad page, made in one pass: the cache
    of 256 rows x 128k positions is 34 GB a tensor, too large to copy while poisoning."""
    pages = jax.random.normal(key, shape, jnp.bfloat16)
    is_last = jnp.zeros(shape[0], bool).at[last_pages].set(True)
    page = jnp.arange(shape[0])[:, None]
    poison = (is_last[:, None] & (jnp.arange(shape[1])[None, :] >= tail)) | (page == 0)
    return jnp.where(poison[:, :, None, None], jnp.nan, pages)


def _case(batch, context, args, seed=0):
    rng = np.random.default_rng(seed)
    size = args.page_size
    per_row = -(-context // size)
    num_pages = batch * per_row + 1
    table = rng.permutation(np.arange(1, num_pages)).reshape(batch, per_row).astype(np.int32)
    shape = (num_pages, size, args.kv_heads, args.head_dim)
    keys = jax.random.split(jax.random.key(seed), 3)
    tail = context - (per_row - 1) * size
    last = jnp.asarray(table[:, -1])
    k = _poisoned_pages(keys[0], shape, tail, last)
    v = _poisoned_pages(keys[1], shape, tail, last)
    q = jax.random.normal(keys[2], (batch, args.heads, args.head_dim), jnp.bfloat16)
    lens = np.full(batch, context, np.int32)
    return q, k, v, table, lens


def _rows(batch, context, args):
    q, k, v, table, lens = _case(batch, context, args)
    scale = args.head_dim**-0.5
    table_j, lens_j = jnp.asarray(table), jnp.asarray(lens)

    def kernel_with(stages, splits=None):
        return jax.jit(lambda q, k, v: pd.paged_decode_attention(
            q, k, v, table_j, lens_j, scale=scale, stages=stages, num_splits=splits,
            impl="pallas"))  # fmt: skip

    reference = jax.jit(lambda q, k, v: pd.paged_decode_attention(
        q, k, v, table_j, lens_j, scale=scale, impl="reference"))  # fmt: skip

    def want():
        return reference(q, k, v)

    policy = BucketPolicy(batch_buckets=(batch,), token_buckets=(batch,), page_size=args.page_size,
                          max_context=table.shape[1] * args.page_size)  # fmt: skip
    specs = [RowSpec(b + 1, context - 1, 1, tuple(table[b])) for b in range(batch)]
    meta = jax.device_put(build_metadata(ForwardMode.DECODE, specs, policy, num_slots=batch + 1,
                                         num_pages=k.shape[0]))  # fmt: skip
    # The step's own key and value are the last cached position's: the write changes nothing.
    k_new = k[table[:, -1], (context - 1) % args.page_size]
    v_new = v[table[:, -1], (context - 1) % args.page_size]
    engine_jnp = jax.jit(lambda q, k, v: attention_backend.paged_attention(
        q, k_new, v_new, k, v, meta, scale=scale, impl="reference")[0])  # fmt: skip
    limit_s = 2 * batch * context * args.kv_heads * args.head_dim * 2 / args.bandwidth
    rows = [("kernel", kernel_with(pd.STAGES))]
    rows += [(f"kernel, {n} stages", kernel_with(n)) for n in args.stages]
    rows += [(f"kernel, {n} splits", kernel_with(pd.STAGES, n)) for n in args.splits]
    rows += [("jnp", engine_jnp), ("reference", reference)][: 2 if args.peers else 0]
    for name, fn in rows:
        _time_row(batch, context, name, fn, (q, k, v), want, limit_s, args.breakdown)
    if args.flashinfer:
        _flashinfer_row(batch, context, (q, k, v, table, lens), want, limit_s, args)
    if args.tree:  # verify steps: a chain of D drafts, and a random tree of D nodes
        nodes = args.tree
        rng = np.random.default_rng(1)
        parents = np.full((batch, nodes), -1, np.int32)
        for t in range(1, nodes):
            parents[:, t] = rng.integers(0, t, batch)
        q_d = jax.random.normal(jax.random.key(5), (batch, nodes, args.heads, args.head_dim))
        q_d = q_d.astype(jnp.bfloat16)
        for name, tree in ((f"chain of {nodes}", None), (f"tree of {nodes}", jnp.asarray(parents))):
            call = functools.partial(
                pd.paged_decode_attention, page_table=table_j, context_lens=lens_j, scale=scale,
                parents=tree,
            )  # fmt: skip
            fn = jax.jit(functools.partial(call, impl="pallas"))
            want_d = functools.partial(call, q_d, k, v, impl="reference")
            _time_row(
                batch, context, f"kernel, {name}", fn, (q_d, k, v), want_d, limit_s, args.breakdown
            )


def _max_error(out: np.ndarray, want) -> str:
    """Max abs difference from ``want()`` (the jnp reference): "nan" where ``out`` is not
    finite, "n/a" where the reference does not fit the device."""
    try:
        expected = np.asarray(want(), np.float32)
    except jax.errors.JaxRuntimeError:  # the gathered pages of long rows run out of memory
        return "n/a"
    return f"{np.nanmax(np.abs(out - expected)):.1e}" if np.isfinite(out).all() else "nan"


def _time_row(batch, context, name, fn, inputs, want, limit_s, top=0) -> None:
    """Prints a row: device time, the KV-byte limit and fraction, max abs error against
    ``want()`` (the jnp reference; "n/a" where it does not fit the device); then the ``top``
    longest kernels of the call, if any."""
    try:
        out = np.asarray(fn(*inputs), np.float32)
        timed = device_time(lambda: fn(*inputs), calls=10)
        us = timed.us
        err = _max_error(out, want)
        print(
            f"| B={batch} ctx={context} | {name} | {us:.1f} us | {limit_s * 1e6:.1f} us | "
            f"{limit_s * 1e6 / us:.0%} | {err} |",
            flush=True,
        )
        if top:
            print(f"|   kernels: {timed.breakdown(top)} | | | | | |", flush=True)
    except Exception as err:  # a failed row is reported, the rest still runs
        print(f"| B={batch} ctx={context} | {name} | failed: {str(err)[:200]} | | | |")


def _flashinfer_row(batch, context, case, want, limit_s, args) -> None:
    """FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD pages, tensor
    cores for grouped heads) on the same cache, read in place through DLPack; device time
    from a CUDA graph of ``calls`` launches, timed with CUDA events."""
    calls = 20
    try:
        import flashinfer
        import torch

        q, k, v, table, lens = case
        as_torch = torch.utils.dlpack.from_dlpack
        q_t, k_t, v_t = as_torch(q), as_torch(k), as_torch(v)
        per_row = table.shape[1]
        indptr = torch.arange(0, batch * per_row + 1, per_row, dtype=torch.int32, device="cuda")
        indices = torch.as_tensor(table.reshape(-1), dtype=torch.int32, device="cuda")
        last = torch.as_tensor((lens - 1) % args.page_size + 1, dtype=torch.int32, device="cuda")
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last,
        )  # fmt: skip
        wrapper.plan(
            indptr, indices, last, args.heads, args.kv_heads, args.head_dim, args.page_size,
            q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
        )  # fmt: skip
        out = torch.empty_like(q_t)
        wrapper.run(q_t, (k_t, v_t), out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                wrapper.run(q_t, (k_t, v_t), out=out)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        us = float(np.median(times))
        err = _max_error(out.float().cpu().numpy(), want)
        print(
            f"| B={batch} ctx={context} | FlashInfer {flashinfer.__version__} | {us:.1f} us | "
            f"{limit_s * 1e6:.1f} us | {limit_s * 1e6 / us:.0%} | {err} |",
            flush=True,
        )
    except Exception as err:  # a peer that does not build or run is reported, not fatal
        # The end of a failed JIT build's log names the cause.
        print(f"| B={batch} ctx={context} | FlashInfer | failed: {str(err)[-1500:]} | | | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--bandwidth", type=float, default=4.3e12)
    parser.add_argument("--stages", default="", help="more kernel rows: rings of N buffers")
    parser.add_argument("--splits", default="", help="more kernel rows: N splits a row")
    parser.add_argument("--breakdown", type=int, default=0,
                        help="after each kernel row, its N longest kernels")  # fmt: skip
    parser.add_argument("--tree", type=int, default=0, help="verify rows of D drafts (0: none)")
    parser.add_argument("--flashinfer", action="store_true",
                        help="a FlashInfer row (needs flashinfer-python and torch)")  # fmt: skip
    parser.add_argument("--no-peers", dest="peers", action="store_false",
                        help="kernel rows only (no jnp and reference rows)")  # fmt: skip
    args = parser.parse_args()
    args.stages = [int(n) for n in args.stages.split(",") if n]
    args.splits = [int(n) for n in args.splits.split(",") if n]
    versions = ", ".join(
        f"{m} {importlib.import_module(m).__version__}" for m in ("jax", "jaxlib", "flax")
    )
    print(f"{datetime.date.today()}, {jax.devices()[0].device_kind}, {versions}, python "
          f"{platform.python_version()}")  # fmt: skip
    print("| case | row | device time | KV-byte limit | fraction | max abs error |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            if batch * context > 2**25:  # 256 x 128k: 69 GB of pages at Qwen's heads
                continue
            _rows(batch, context, args)


if __name__ == "__main__":
    main()
