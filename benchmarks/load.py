"""Checkpoint loading at real dimensions: a Hugging Face folder of random bf16 weights is
written, dropped from the page cache, and loaded back with ``load_checkpoint`` as a user
would, timing the read from disk through the memory map, the one transfer per parameter and
the finite check; the rate gives the time a full-depth checkpoint of the preset would take.

Run on the GPU machine (see benchmarks/README.md), or on any machine for its CPU device::

    python3 benchmarks/load.py --preset qwen3.5-35b-a3b-like --layers 4 [--dir DIR] [--out DIR]
    python3 benchmarks/load.py --smoke            # tiny, on the CPU: keeps the script alive

Rows: the first load in the process (cold; the finite check's and transfers' one-time
compiles included), then ``cold`` (the files' pages dropped from the page cache first,
``posix_fadvise``) and ``warm`` (just read again), each with and without ``check_finite``.
Qwen3-Next-family presets only (the writer is ``qwen3_next_loading.save_checkpoint``).
Writes ``RESULTS_load.md`` to ``--out`` (``RESULTS_load_smoke.md`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import sys
import tempfile
import time

import jax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from serve import _device, _versions  # noqa: E402
from serve_presets import PRESETS  # noqa: E402

from hybrid_jax.models.auto import load_checkpoint  # noqa: E402
from hybrid_jax.models.qwen3_next import Qwen3Next, Qwen3NextConfig  # noqa: E402
from hybrid_jax.models.qwen3_next_loading import save_checkpoint  # noqa: E402

SHARD_BYTES = 4 << 30  # Hugging Face checkpoints come in shards of a few GB


def parameter_bytes(config: Qwen3NextConfig) -> int:
    """Bytes of every parameter of the model ``config`` describes (nothing is allocated)."""
    model = nnx.eval_shape(lambda: Qwen3Next(config, rngs=nnx.Rngs(0)))
    leaves = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return sum(v.get_value().size * v.get_value().dtype.itemsize for _, v in leaves)


def drop_from_page_cache(folder: pathlib.Path) -> None:
    """Asks the kernel to forget the folder's file pages, so the next read comes from disk."""
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def time_load(folder: pathlib.Path, *, cold: bool, check_finite: bool, progress: bool) -> float:
    """Seconds from ``load_checkpoint`` to every parameter on the device."""
    if cold:
        drop_from_page_cache(folder)
    start = time.perf_counter()
    model = load_checkpoint(folder, progress=progress, check_finite=check_finite)
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    qwen = sorted(name for name, (_, make) in PRESETS.items()
                  if isinstance(make(1), Qwen3NextConfig))  # fmt: skip
    parser.add_argument("--preset", default="qwen3.5-35b-a3b-like", choices=qwen)
    parser.add_argument("--layers", type=int, default=4, help="depth of the written checkpoint")
    parser.add_argument("--dir", default=None, help="where to write it (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoint on disk")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset, args.layers = "smoke", 1
    depth, make = PRESETS[args.preset]
    config = dataclasses.replace(make(args.layers), num_nextn_predict_layers=0)
    folder = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="load-bench-"))
    try:
        start = time.perf_counter()
        model = Qwen3Next(config, rngs=nnx.Rngs(0))
        save_checkpoint(model, folder, max_shard_bytes=SHARD_BYTES)
        del model
        on_disk = sum(p.stat().st_size for p in folder.iterdir())
        print(f"wrote {args.preset} x{args.layers}: {on_disk / 1e9:.2f} GB in "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
        full = parameter_bytes(dataclasses.replace(make(depth), num_nextn_predict_layers=0))
        rows = []
        cases = [("first in the process (compiles included)", True, True)]
        cases += [(f"{'cold' if cold else 'warm'}{', check_finite' if check else ''}", cold, check)
                  for cold in (True, False) for check in (True, False)]  # fmt: skip
        for name, cold, check in cases:
            seconds = time_load(folder, cold=cold, check_finite=check, progress=not args.smoke)
            rate = on_disk / seconds
            rows.append(
                f"| {name} | {on_disk / 1e9:.3g} GB | {seconds:.2f} s | {rate / 1e9:.3g} GB/s | "
                f"{full / rate:.0f} s |"
            )
            print(rows[-1], flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    title = f"{args.preset}, {args.layers} of {depth} layers ({full / 1e9:.1f} GB at full depth)"
    lines = [
        f"## {title}", "",
        f"{time.strftime('%Y-%m-%d')}, {_device()}, {_versions()}.", "",
        "| load | bytes | time | rate | full depth at this rate |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows, "",
    ]  # fmt: skip
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("RESULTS_load_smoke.md" if args.smoke else "RESULTS_load.md")
    path.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
