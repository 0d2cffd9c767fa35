"""``hybrid-jax demo``: the backend alone, on the built-in tiny GDN stack.

It builds the built-in tiny GDN stack with random weights, compiles every
supported (mode, bucket) ahead of time, runs each once on a real batch of that bucket, and
prints a table (mode, bucket, compile ms, run ms), then shows the error an unsupported mode
gives while tracing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.engine.step import CompileRecord, StepFunctions
from hybrid_jax.metadata import BucketPolicy, RowSpec, build_metadata, example_metadata
from hybrid_jax.models.gdn_stack import GDNStack, tiny_gdn_stack_config
from hybrid_jax.modes import (
    CAPABILITIES,
    MODES,
    ForwardMode,
    LayerKind,
    UnsupportedForwardModeError,
)
from hybrid_jax.progress import Progress
from hybrid_jax.state_pool import SlotAllocator, allocate_slots, bytes_per_slot, init_state_pool

__all__ = ["add_demo_parser", "demo"]


def _demo_rows(
    mode: ForwardMode, batch_size: int, num_tokens: int, draft: int, slots: Sequence[int],
    rng: np.random.Generator,
) -> list[RowSpec]:  # fmt: skip
    """A batch that fills the bucket, read off the mode's row of ``MODES``: every row real,
    lengths drawn at random within its bounds."""
    spec = MODES[mode].resolved(draft)
    if not spec.has_rows:
        return []
    if spec.tokens_per_row is None:
        # A token bucket shared by ragged rows: split it among them; every other row continues
        # its context by one token, as a decode inside a prompt step does.
        rows_n = max(1, min(batch_size, num_tokens // 4))
        cuts = np.sort(rng.choice(np.arange(1, num_tokens), rows_n - 1, replace=False))
        lens = np.diff(np.concatenate([[0], cuts, [num_tokens]]))
        return [
            RowSpec(slot, 7, 1) if i % 2 else RowSpec(slot, 0, int(n))
            for i, (slot, n) in enumerate(zip(slots, lens, strict=False))
        ]
    lens = rng.integers(spec.min_row_tokens, spec.max_row_tokens + 1, batch_size)
    return [
        RowSpec(slot, int(rng.integers(1, 100)), int(n))
        for slot, n in zip(slots[:batch_size], lens, strict=True)
    ]


def demo(args: argparse.Namespace) -> int:
    if args.cache_dir:
        # A second run loads the executables instead of compiling them again.
        jax.config.update("jax_compilation_cache_dir", str(args.cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    config = tiny_gdn_stack_config()
    model = GDNStack(config, rngs=nnx.Rngs(args.seed))
    policy = BucketPolicy.default(
        max_batch=args.max_batch, max_tokens=args.max_tokens, num_draft_tokens=args.draft_tokens
    )
    specs = model.state_specs()
    num_slots = policy.max_batch + 1
    pool = init_state_pool(specs, num_slots)
    allocator = SlotAllocator(num_slots, bytes_per_slot(specs))
    slots, pool = allocate_slots(allocator, pool, policy.max_batch)
    steps = StepFunctions(model, impl=args.impl)
    modes = sorted(CAPABILITIES[LayerKind.GDN], key=lambda m: list(ForwardMode).index(m))
    hidden = config.layer.hidden_size
    print(
        f"hybrid_jax demo: {config.num_layers} GDN layers (hidden {hidden}, "
        f"H={config.layer.num_key_heads}, HV={config.layer.num_value_heads}, "
        f"K=V={config.layer.head_k_dim}), pool of {num_slots} slots, impl={args.impl}, "
        f"backend {jax.default_backend()}"
    )
    records: list[CompileRecord] = []
    bar = Progress(sum(len(policy.buckets(m)) for m in modes), every=5)

    def progress(record: CompileRecord) -> None:
        records.append(record)
        bar()

    steps.compile_all(policy, pool, modes, token_shape=(hidden,), progress=progress)
    traces_after_warmup = steps.total_traces

    rng = np.random.default_rng(args.seed)
    header = f"{'mode':<14}{'rows':>6}{'tokens':>8}{'real rows':>11}{'compile ms':>12}{'run ms':>9}"
    print(header)
    print("-" * len(header))
    for record in records:
        mode, bs, t = record.mode, record.batch_size, record.num_tokens
        rows = _demo_rows(mode, bs, t, policy.num_draft_tokens, slots, rng)
        meta = build_metadata(mode, rows, policy, num_slots=num_slots, batch_size=bs, num_tokens=t)
        x = jnp.asarray(rng.standard_normal((t, hidden)), jnp.float32)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = steps(pool, x, meta)
            pool = out.pool  # the step donated the previous pool
            jax.block_until_ready(out.hidden)
            times.append(1e3 * (time.perf_counter() - start))
        run_ms = statistics.median(times)
        print(
            f"{mode.name:<14}{bs:>6}{t:>8}{len(rows):>11}{record.compile_ms:>12.1f}{run_ms:>9.2f}"
        )
    retraced = steps.total_traces - traces_after_warmup
    print(f"\nretraces after warm-up: {retraced}")

    print("\nunsupported modes fail while tracing, before anything runs:")
    meta = example_metadata(ForwardMode.DECODE, 1, 1, policy)
    x = jnp.zeros((1, hidden), jnp.float32)
    for mode in ForwardMode:
        if mode in CAPABILITIES[LayerKind.GDN]:
            continue
        try:
            steps.lower(mode, pool, x, meta)
        except UnsupportedForwardModeError as err:
            print(f"  {mode.name:<16} UnsupportedForwardModeError: {err}")
    return 0 if retraced == 0 else 1


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser(
        "demo",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="every mode and bucket of the built-in tiny GDN stack",
    )
    d.add_argument("--max-batch", type=int, default=8, help="largest batch bucket (rows)")
    d.add_argument("--max-tokens", type=int, default=64, help="largest token bucket")
    d.add_argument("--draft-tokens", type=int, default=4, help="D for TARGET_VERIFY")
    d.add_argument("--impl", default="auto", choices=["auto", "pallas", "interpret", "reference"])
    d.add_argument("--repeats", type=int, default=5, help="timed runs per bucket (median)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "hybrid_jax" / "xla"),
        help="persistent compilation cache ('' to disable)",
    )
    d.set_defaults(func=demo)
