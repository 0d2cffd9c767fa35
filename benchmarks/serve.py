"""The Engine end to end at real model dimensions (random weights), against the hardware's limit.

Run on the GPU machine (see benchmarks/README.md)::

    python3 benchmarks/serve.py --preset qwen3-next-80b-a3b --layers 4 [--out DIR]
    python3 benchmarks/serve.py --smoke            # tiny, on the CPU: keeps the script alive

Every row builds an ``Engine`` as a user would (``impl="auto"``, bucket ladders cut to the
row's shapes so that start-up compiles only what the row runs) and serves requests through
``Engine.generate``:

* ``decode B``: B requests of ``--prompt-len`` tokens, ``--decode-steps`` new tokens each;
  the row's time is the median DECODE step (dispatch-ahead serving loop, ``Engine.step_times``).
  ``--decode-long B@L`` adds rows whose prompts are L tokens long (prefilled in chunks of
  8192), so the attention layers read an L-token context every step.
* ``prefill N x L``: N prompts of L tokens, one output token each; tokens/s over the wall time
  of ``generate`` (prefill chunks of L tokens; ``--prefill-rows R`` prompts per step, one by
  default).
* ``verify B x D`` (``--verify``): B requests decoding by speculation, every step verifying D
  tokens a row (n-gram drafts, padded to D): the median verify step and the tokens kept.

Each row prints its limit and the fraction reached. Decode: the bytes a step must move (every
weight it touches once: attention, GDN and dense projections, the router and shared expert,
the expected number of distinct experts the batch routes to, the LM head; the recurrent
states read and written; the KV entries read) at ``--bandwidth`` (4.3e12 B/s, the measured
copy rate). Prefill: 2 x active parameters x tokens (plus causal attention's FLOPs) at
``--flops`` (7.9e14, the measured bf16 matmul rate). Decode rows also print a device-kernel
breakdown by category from a profiler trace of ``--profile-steps`` steps, and the share of
wall time the GPU is idle.

``--moe both`` runs the MoE rows twice: with the experts' grouped matmul in tokamax's Mosaic GPU
kernel (``auto`` when tokamax is installed) and in ``jax.lax.ragged_dot`` (the reference).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import importlib
import logging
import math
import os
import pathlib
import platform
import pstats
import re
import statistics
import sys
import tempfile
import time
from typing import NamedTuple

# A full-depth preset holds ~65 GB of weights and stacks each repeated parameter once more while
# it builds; JAX's default 75% of the card leaves too little beside them.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from device_time import call_events  # noqa: E402
from hlo_census import census  # noqa: E402
from serve_presets import (  # noqa: E402
    PRESETS,
    decode_roofline_s,
    limit_bytes,
    limit_flops,
    row_bytes,
)
from switches import switches_set  # noqa: E402

from hybrid_jax import Engine, EngineConfig, ForwardMode, SamplingParams, xla_flags  # noqa: E402
from hybrid_jax.backend import attention as attention_backend  # noqa: E402
from hybrid_jax.backend import gdn as gdn_backend  # noqa: E402
from hybrid_jax.engine import sampling  # noqa: E402
from hybrid_jax.engine.speculative import SpeculativeConfig  # noqa: E402
from hybrid_jax.layers import gdn as gdn_layer  # noqa: E402
from hybrid_jax.layers import linear as linear_layer  # noqa: E402
from hybrid_jax.layers import moe as moe_layer  # noqa: E402
from hybrid_jax.metadata import MIN_BATCH_BUCKET  # noqa: E402
from hybrid_jax.models import layer_scan  # noqa: E402
from hybrid_jax.models.layer_scan import (  # noqa: E402
    fold_scanned_norms,
    pair_scanned_swiglu,
    scan_layers,
)
from hybrid_jax.models.nemotron_h import NemotronH, NemotronHConfig  # noqa: E402
from hybrid_jax.models.qwen3_next import Qwen3Next, Qwen3NextConfig  # noqa: E402
from pallas_kernels import _skinny  # noqa: E402

_GROUPED_MATMUL = importlib.import_module("pallas_kernels.moe.grouped_matmul")
# Switches a run can flip, each a module attribute read while tracing: flag -> (module,
# attribute, the value the flag sets, what that does). A run sets those it is given and
# restores them at the end.
TRIAL_SWITCHES = {
    "--step-graphs": (
        xla_flags, "STEP_GRAPHS", True,
        "decode steps compile to run whole as CUDA graphs (xla_flags.STEP_GRAPH_OPTIONS), not "
        "as XLA chooses",
    ),
    "--no-rows-in-kernel": (
        attention_backend, "ROWS_IN_KERNEL", False,
        "a decode step's attention rows (q/k norms, rotary, page writes) formed by XLA's "
        "fusions and scatters, not in one launch",
    ),
    "--no-shared-down-with-experts": (
        moe_layer, "SHARED_DOWN_WITH_EXPERTS", False,
        "a MoE block whose experts run by id takes the shared expert's down product in a "
        "launch of its own, not in the experts' down launch",
    ),
    "--no-experts-in-one-launch": (
        moe_layer, "EXPERTS_IN_ONE_LAUNCH", False,
        "a MoE block whose experts run by id forms its hidden rows and their down products in "
        "a hidden launch and a down launch, not one launch (moe.expert_mlp)",
    ),
    "--no-combine-in-launch": (
        moe_layer, "COMBINE_IN_LAUNCH", False,
        "a MoE block whose hidden rows come from the experts' launches adds its output to the "
        "residual stream in XLA, the next norm's square sums a reduction of their own, not in "
        "one launch",
    ),
    "--decode-scan-unrolled": (
        layer_scan, "DECODE_SCAN_UNROLLED", True,
        "a decode step's layer scan unrolled whole (lax.scan(unroll=True)): no loop, its "
        "counter and input slices gone, every repeat's block in the executable",
    ),
    "--no-carry-square-sums": (
        layer_scan, "CARRY_SQUARE_SUMS", False,
        "a scan of Qwen3-Next blocks carries the rows alone: each repeat's first norm reduces "
        "its rows again (a kernel of its own)",
    ),
    "--no-shared-hidden-with-experts": (
        moe_layer, "SHARED_HIDDEN_WITH_EXPERTS", False,
        "a MoE block whose experts run by id forms its shared expert's SiLU product apart "
        "from its experts' (a fusion each)",
    ),
    "--no-conv-in-decode-kernel": (
        gdn_backend, "CONV_IN_DECODE_KERNEL", False,
        "a GDN layer's decode step forms its causal conv1d in a conv launch of its own "
        "before the decode kernel, not in the decode kernel",
    ),
    "--no-norm-in-decode-kernel": (
        gdn_layer, "NORM_IN_DECODE_KERNEL", False,
        "a GDN layer's gated output norm formed by XLA after the decode kernel",
    ),
    "--no-adds-for-short-sums": (
        linear_layer, "ADDS_FOR_SHORT_SUMS", False,
        "sums over a short axis (partial products, a MoE token's choices and their softmax) "
        "as reduces instead of chains of adds",
    ),
    "--no-ring-fills-sm": (
        _skinny, "RING_FILLS_SM", False,
        "a small-batch product launch of at most one program per SM (a MoE block's router "
        "and shared gate/up) keeps the default ring depth",
    ),
    "--no-hidden-in-expert-launch": (
        moe_layer, "HIDDEN_IN_EXPERT_LAUNCH", False,
        "a MoE block whose experts run by id takes gate/up products and forms the SwiGLU in "
        "XLA; the gate/up weights are not paired by moe.pair_halves unless an earlier row of "
        "the run paired them (those rows split the paired products in XLA)",
    ),
    "--no-pair-dense-swiglu": (
        moe_layer, "PAIR_DENSE_SWIGLU", False,
        "a dense MLP keeps its gate and up weights apart (two products, the SwiGLU in XLA), "
        "unless an earlier row of the run paired them",
    ),
    "--no-residual-in-product": (
        linear_layer, "RESIDUAL_IN_PRODUCT", False,
        "an output projection XLA runs (above 64 rows) stores its product and adds the "
        "residual in a fusion of its own, not in cuBLAS's epilogue",
    ),
    "--no-one-pass-greedy": (
        sampling, "ONE_PASS_GREEDY", False,
        "a step's greedy rows take an argmax and a log-sum-exp, two reads of the logits, not "
        "one reduction (sampling.logit_stats)",
    ),
    "--merge-attention-in-launch": (
        attention_backend, "MERGE_IN_LAUNCH", True,
        "a decode step's paged attention kernel merges its splits and applies the output gate "
        "itself (the last of a (row, KV head)'s programs), not in an XLA fusion after it",
    ),
    "--no-split-router-launch": (
        moe_layer, "SPLIT_ROUTER_LAUNCH", False,
        "a MoE block's router launch streams a whole K a program, not parts of K combined by "
        "one program a token (projections(splits=))",
    ),
    "--no-ranking-in-router-launch": (
        moe_layer, "RANKING_IN_ROUTER_LAUNCH", False,
        "a MoE block that ranks its experts ranks them in two XLA reductions after the "
        "router's launch, not in that launch (projections.ranked_projections)",
    ),
    "--no-softmax-in-ranking": (
        moe_layer, "SOFTMAX_IN_RANKING", False,
        "a MoE block that ranks its experts forms the chosen experts' softmax after the "
        "ranking's reductions (a kernel of its own)",
    ),
    "--no-norms-in-launch": (
        linear_layer, "NORMS_IN_LAUNCH", False,
        "a decoder layer's norms run as their own kernels before the projections' launch",
    ),
    "--no-add-in-output-launch": (
        linear_layer, "ADD_IN_OUTPUT_LAUNCH", False,
        "a split output projection that a layer adds to the residual stream leaves its "
        "partials, the residual add and the next norm's square sums to an XLA kernel after "
        "it, not to its own launch (projections.projection_add)",
    ),
    "--no-split-output-projections": (
        linear_layer, "SPLIT_OUTPUT_PROJECTIONS", False,
        "output projections at few rows as the layers' own products, not float32 partial "
        "products over parts of K",
    ),
    "--no-overlap-products": (
        _skinny, "OVERLAP_PRODUCTS", False,
        "the small-batch product kernels (projections, experts by id) wait for each block's "
        "product before the next block",
    ),
    "--no-swap-operands": (
        _skinny, "SWAP_OPERANDS", False,
        "the small-batch product kernels take each block's product untransposed",
    ),
}  # fmt: skip


# ----------------------------------------------------------------------- device breakdown

# A kernel's category is the first whose needles its name holds: our own Pallas kernels
# (named by their ``kernel_name``) before the XLA and cuBLAS names they might share a word with
# (``expert_matmul`` is MoE, not a dense matmul).
_CATEGORIES = (
    (
        "GDN/Mamba2 kernels",
        ("gdn", "delta", "chunk", "recurrent", "conv1d", "ssd", "mamba", "state"),
    ),
    ("attention", ("attention",)),
    ("MoE (routed experts, combine)", ("ragged", "grouped", "gmm", "expert_", "combine_pairs")),
    ("projections (Pallas)", ("projection",)),
    ("matmuls (XLA/cuBLAS)", ("gemm", "xmma", "cutlass", "nvjet", "dot", "matmul", "cublas")),
    ("sort/top-k", ("sort", "cub::", "topk", "top_k")),
    ("copies/transposes", ("memcpy", "memset", "copy", "transpose")),
)


def _category(name: str) -> str:
    low = name.lower()
    for label, needles in _CATEGORIES:
        if any(n in low for n in needles):
            return label
    return "other fusions"


_Events = list[tuple[str, float, float]]  # (name, start or offset, duration)


HOST_PLANE = "/host:CPU"


def host_table(profile, steps: int) -> list[tuple[str, str, float, float]]:
    """Where the host's threads spend ``steps`` profiled steps: (thread, event name, calls per
    step, us per step) of every event on the host plane, longest first. Events nest (a
    dispatch holds its argument handling), so these are inclusive times, not a partition;
    threads of one pool are one row (their numeric suffix dropped)."""
    plane = profile.find_plane_with_name(HOST_PLANE)
    totals: dict[tuple[str, str], list[float]] = {}
    for line in [] if plane is None else plane.lines:
        thread = re.sub(r"[/:_-]?\d+$", "", line.name)
        for event in line.events:
            calls_us = totals.setdefault((thread, event.name), [0.0, 0.0])
            calls_us[0] += 1 / steps
            calls_us[1] += event.duration_ns / 1e3 / steps
    rows = [(thread, name, calls, us) for (thread, name), (calls, us) in totals.items()]
    return sorted(rows, key=lambda row: -row[3])


class StepProfile(NamedTuple):
    """What ``profile_steps`` saw of a few steps, per step: device us by category, every
    kernel (name, calls, us; longest first), the wall us, the last step's launches in order
    (name, us since that step's first start, duration us) and the host's events
    (``host_table``)."""

    categories: dict[str, float]
    kernels: list[tuple[str, float, float]]
    wall_us: float
    sequence: _Events
    host: list[tuple[str, str, float, float]]


def profile_steps(engine: Engine, steps: int) -> StepProfile:
    """Runs ``steps`` engine steps under the profiler (``StepProfile``)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, profiler_options=options):
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            jax.block_until_ready(engine.state)
            wall = (time.perf_counter() - start) / steps * 1e6
        files = sorted(pathlib.Path(log_dir).rglob("*.xplane.pb"))
        profile = jax.profiler.ProfileData.from_file(str(files[0]))
        events = call_events(profile)
        host = host_table(profile, steps)
    by_category: dict[str, float] = {}
    by_kernel: dict[str, list[float]] = {}
    for name, _, duration_ns in events:
        us = duration_ns / 1e3 / steps
        by_category[_category(name)] = by_category.get(_category(name), 0.0) + us
        calls_us = by_kernel.setdefault(name, [0.0, 0.0])
        calls_us[0] += 1 / steps
        calls_us[1] += us
    kernels = sorted(((n, c, us) for n, (c, us) in by_kernel.items()), key=lambda k: -k[2])
    return StepProfile(by_category, kernels, wall, _last_step(events, steps), host)


def _last_step(events: _Events, steps: int) -> _Events:
    """The launches of the last of ``steps`` equal steps (its share of the sorted events), as
    (name, us since its first start, duration us): which launch of a layer takes how long,
    where the kernel table sums a name over all of them."""
    last = events[len(events) - len(events) // steps :]
    if not last:
        return []
    first = last[0][1]
    return [(name, (start - first) / 1e3, duration / 1e3) for name, start, duration in last]


HOST_GAP_US = 5.0
"""A pause between two launches of a step longer than this is the host behind, not the
device: a launch's own gap is under a microsecond."""


def device_bound_us(sequence: _Events) -> tuple[float, float]:
    """(the step's launches back to back: their durations plus the gaps between them up to
    ``HOST_GAP_US``; the longer gaps, where the device waited for the host) of one step's
    launches in order (``_last_step``). The first is what the step would take with the host
    always ahead, the measure to compare a batch-1 step's variants on: its median between
    processes moves with the host."""
    busy = sum(us for _, _, us in sequence)
    ends = [at + us for _, at, us in sequence[:-1]]
    gaps = [max(0.0, at - end) for (_, at, _), end in zip(sequence[1:], ends, strict=True)]
    short = sum(g for g in gaps if g <= HOST_GAP_US)
    return busy + short, sum(gaps) - short


def write_tables(profile: StepProfile, table: pathlib.Path) -> None:
    """A profile's kernels (``table``), its last step's launches (``*.sequence.tsv``) and the
    host's events (``*.host.tsv``), tab-separated."""
    lines = [f"{us:.1f}\t{calls:g}\t{name}" for name, calls, us in profile.kernels]
    table.write_text("us_per_step\tcalls_per_step\tkernel\n" + "\n".join(lines) + "\n")
    lines = [f"{at:.2f}\t{us:.2f}\t{name}" for name, at, us in profile.sequence]
    table.with_suffix(".sequence.tsv").write_text(
        "start_us\tus\tkernel\n" + "\n".join(lines) + "\n"
    )
    lines = [f"{us:.1f}\t{calls:g}\t{thread}\t{name}" for thread, name, calls, us in profile.host]
    table.with_suffix(".host.tsv").write_text(
        "us_per_step\tcalls_per_step\tthread\tevent\n" + "\n".join(lines) + "\n"
    )


def breakdown_note(profile: StepProfile) -> str:
    """A profile as a row's note: kernels a step, launches back to back beside the host's
    stalls, device time by category, idle share, the longest kernels and host events."""
    top = [(name, us) for name, _, us in profile.kernels[:12]]
    busy = sum(profile.categories.values())
    ranked = sorted(profile.categories.items(), key=lambda kv: -kv[1])
    launches = sum(calls for _, calls, _ in profile.kernels)
    bound, stalls = device_bound_us(profile.sequence)
    host = profile.host[:6]
    return (
        f"{launches:.0f} kernels/step; its launches back to back {bound:.0f} us (host "
        f"stalls {stalls:.0f} us in the last profiled step); device us/step: "
        + ", ".join(f"{k} {v:.0f}" for k, v in ranked)
        + f"; idle {max(0.0, 1 - busy / profile.wall_us):.0%} of {profile.wall_us:.0f} us; "
        + "top: " + "; ".join(f"{n[:60]} {us:.0f}" for n, us in top)
        + "; host us/step (inclusive): "
        + "; ".join(f"{thread} {name[:50]} {us:.0f}" for thread, name, _, us in host)
    )  # fmt: skip


def _breakdown(engine: Engine, steps: int, table: pathlib.Path | None = None) -> str:
    """The device breakdown of the engine's next ``steps`` steps, as a row's note (GPU only;
    ``breakdown_note``); the tables go next to ``table`` when given (``write_tables``).
    ``steps == 0``: no breakdown (no profiled steps)."""
    if jax.default_backend() != "gpu" or steps == 0:
        return ""
    profile = profile_steps(engine, steps)
    if table is not None:
        write_tables(profile, table)
    return breakdown_note(profile)


# -------------------------------------------------------------------------------- rows


@dataclasses.dataclass
class Row:
    name: str
    value: str
    limit: str
    fraction: float
    compile_s: float  # the engine's whole start-up compile
    slowest_s: float = 0.0  # its slowest step executable
    slowest_lower_s: float = 0.0  # of that, tracing and lowering (before XLA's compile)
    note: str = ""


def _host_profile(engine: Engine, steps: int, title: str) -> None:
    """Prints where the host spends a serving step (cProfile, by own time)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    jax.block_until_ready(engine.state)
    profiler.disable()
    print(f"host profile of {steps} steps, {title}:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


class _IdsOnly:
    """A tokenizer for a model with random weights and any vocabulary: the rows send token
    ids, and there is no text to read back."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError("benchmark rows send token ids")

    def decode(self, ids) -> str:
        return ""


def _engine(
    model, args, *, batch: int, tokens: int, context: int,
    speculative: SpeculativeConfig | None = None,
) -> Engine:  # fmt: skip
    """An engine of one batch and one token bucket; ``args.program_store`` is off while the
    reference rows hide tokamax by patching the grouped matmul (the program store's key sees
    the source, not a patch)."""
    config = EngineConfig(
        max_batch=batch, max_tokens=tokens, max_context=context, batch_buckets=(batch,),
        token_buckets=(tokens,), cache_dir=args.cache_dir, program_store=args.program_store,
        scan_layers=not args.unrolled, speculative=speculative,
    )  # fmt: skip
    return Engine(model, _IdsOnly(model.config.vocab_size), config, progress=False)


def _kernel_table(args, row: str) -> pathlib.Path | None:
    """Where ``--kernel-tables`` puts a row's kernel table, or None."""
    if not args.kernel_tables:
        return None
    return pathlib.Path(args.out) / f"kernels_{args.preset}_{row}.tsv"


def _decode_census(engine: Engine) -> str:
    """The kernels of the engine's DECODE executables, counted in their optimised HLO
    (``hlo_census``): the model's step, without the sampler's program."""
    return "; ".join(
        f"HLO census {batch}x{tokens}: {census(executable.as_text()).describe()}"
        for (program, batch, tokens), executable in engine.executables.items()
        if program is ForwardMode.DECODE
    )


def _write_hlo(engine: Engine, args, row: str) -> None:
    """With ``--hlo``, the row's DECODE executable as XLA optimised it (the fusions the
    kernel tables name), to --out as ``hlo_*.txt``."""
    if not args.hlo:
        return
    for (program, batch, tokens), executable in engine.executables.items():
        if program is ForwardMode.DECODE:
            path = pathlib.Path(args.out) / f"hlo_{args.preset}_{row}_{batch}x{tokens}.txt"
            path.write_text(executable.as_text())


def _memory(engine: Engine) -> str:
    """What the row's engine holds on the device, in GiB."""
    m = {k: v / 2**30 for k, v in engine.memory.items()}
    return (
        f"memory GiB: weights {m['weights']:.1f}, states {m['states']:.2f}, KV "
        f"{m['kv_cache']:.2f}, step scratch {m['step_temp']:.2f}"
    )


def _slowest(engine: Engine) -> tuple[float, float]:
    """Seconds of the engine's slowest step executable to compile, and of those its tracing
    and lowering (the rest is XLA's compile)."""
    slowest = max(engine.compile_records, key=lambda r: r.compile_ms, default=None)
    return (0.0, 0.0) if slowest is None else (slowest.compile_ms / 1e3, slowest.lower_ms / 1e3)


def _prompts(rng: np.random.Generator, n: int, length: int) -> list[list[int]]:
    return [rng.integers(1, 256, length).tolist() for _ in range(n)]


def _file_row(kind: str, label: str) -> str:
    """A row's file name stem: its kind and shape, then its label (rows of several variants
    share an --out)."""
    return f"{kind}_{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')}"


def _step_spread(engine: Engine, mode: ForwardMode) -> tuple[float, str]:
    """The median step of ``mode`` (the first two, warming up, left out) and a note of its
    spread and of how long the host took to launch a step."""
    times = engine.step_times[mode][2:]
    launches = engine.launch_times[mode][2:]
    p10, p90 = np.percentile(times, [10, 90]) * 1e3
    note = (
        f"{len(times)} steps, 10th-90th percentile {p10:.3f}-{p90:.3f} ms; the host launched a "
        f"step in {statistics.median(launches) * 1e3:.3f} ms (median)"
    )
    return statistics.median(times), note


def decode_row(model, c, batch, prompt, args, rng, label) -> Row:
    steps = args.decode_steps
    budget = steps + 2 * args.profile_steps + 4  # measured, host-profiled, traced steps
    context = -(-(prompt + budget + 4) // 16) * 16
    # Long prompts prefill in chunks of at most 8192 tokens: one EXTEND executable.
    tokens = min(batch * prompt, max(prompt, 8192))
    bucket = max(batch, args.decode_bucket)
    engine = _engine(model, args, batch=bucket, tokens=tokens, context=context)
    at = f" at {prompt // 1024}k" if prompt >= 1024 else ""
    at += f" in a bucket of {bucket}" if bucket > batch else ""
    name = f"decode B={batch}{at} ({label})"
    file_row = _file_row(f"decode_b{batch}_{prompt}", label)
    if args.compile_only:
        _write_hlo(engine, args, file_row)
        note = _decode_census(engine)
        return Row(name, "compiled", "", 0.0, engine.compile_s, *_slowest(engine), note)
    params = SamplingParams(max_new_tokens=budget)
    ids = [engine.add_request(p, params) for p in _prompts(rng, batch, prompt)]
    while len(engine.step_times[ForwardMode.DECODE]) < steps:
        engine.step()
    step_s, spread = _step_spread(engine, ForwardMode.DECODE)
    if args.host_profile:
        _host_profile(engine, args.profile_steps, f"decode B={batch}")
    table = _kernel_table(args, file_row)
    parts = (spread, _breakdown(engine, args.profile_steps, table), _memory(engine))
    note = "; ".join(part for part in parts if part)
    if args.census:
        note = f"{note}; {_decode_census(engine)}"
    _write_hlo(engine, args, file_row)
    for rid in ids:
        engine.abort(rid)
    limit_s = limit_bytes(model, c, batch, prompt + steps) / args.bandwidth
    if isinstance(c, Qwen3NextConfig):
        roof_s = decode_roofline_s(c, batch, prompt + steps, args.bandwidth, args.flops)
        note = (
            f"roofline (each product's bytes or FLOPs, the longer) {roof_s * 1e3:.3f} ms: "
            f"{roof_s / step_s:.0%}; {note}"
        )
    return Row(
        name, f"{step_s * 1e3:.3f} ms", f"{limit_s * 1e3:.3f} ms", limit_s / step_s,
        engine.compile_s, *_slowest(engine), note,
    )  # fmt: skip


def verify_specs(text: str) -> list[tuple[int, int]]:
    """``--verify``'s rows, ``(B, D)`` each, from ``BxD`` comma-separated; raises
    ``ValueError`` naming a spec that is not B >= 1 requests of a D the engine verifies."""
    specs = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        parts = spec.split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) < 1:
            raise ValueError(f"{spec!r} is not BxD with B >= 1 requests (e.g. 1x4)")
        try:
            SpeculativeConfig("ngram", num_draft_tokens=int(parts[1]))
        except ValueError as err:
            raise ValueError(f"{spec!r}: {err}") from None
        specs.append((int(parts[0]), int(parts[1])))
    return specs


def verify_row(model, c, batch, draft, args, rng, label) -> Row:
    """``batch`` requests decoding by speculation, every step a TARGET_VERIFY of ``draft``
    tokens a row: n-gram drafts, padded by repeating the last token where the lookup finds
    nothing (random prompts rarely repeat), so each step verifies ``draft`` tokens whatever
    it accepts. The row's time is the median verify step (dispatch, acceptance and read back:
    a verify step waits for its tokens); its limit, that step's bytes (the weights its
    ``batch * draft`` tokens touch, the rows' states and KV entries). The note gives the
    tokens a row kept a step and the time per kept token."""
    steps = args.decode_steps
    budget = draft * (steps + 2 * args.profile_steps + 4)
    context = -(-(args.prompt_len + budget + draft + 4) // 16) * 16
    bucket = max(batch, args.decode_bucket)
    speculative = SpeculativeConfig("ngram", num_draft_tokens=draft)
    engine = _engine(
        model, args, batch=bucket, tokens=bucket * args.prompt_len, context=context,
        speculative=speculative,
    )  # fmt: skip
    name = f"verify B={batch} D={draft}" + (f" in a bucket of {bucket}" if bucket > batch else "")
    name += f" ({label})"
    params = SamplingParams(max_new_tokens=budget)
    ids = [engine.add_request(p, params) for p in _prompts(rng, batch, args.prompt_len)]
    verify = engine.step_times[ForwardMode.TARGET_VERIFY]
    while len(verify) < steps + 2:
        before = engine.speculative_stats.steps
        engine.step()
        if before == engine.speculative_stats.steps and not engine.has_work:
            raise RuntimeError(f"{name}: the requests ended after {len(verify)} verify steps")
    stats = engine.speculative_stats
    kept = stats.emitted / max(stats.rows, 1)
    step_s, spread = _step_spread(engine, ForwardMode.TARGET_VERIFY)
    table = _kernel_table(args, _file_row(f"verify_b{batch}_d{draft}", label))
    parts = (
        f"{spread}; {kept:.2f} tokens kept a row a step ({step_s / kept * 1e3:.3f} ms a kept "
        "token)",
        _breakdown(engine, args.profile_steps, table),
        _memory(engine),
    )
    for rid in ids:
        engine.abort(rid)
    positions = args.prompt_len + steps * draft
    if isinstance(c, Qwen3NextConfig):
        # The weights as ``batch * draft`` tokens touch them; states and KV once per row.
        bw = args.bandwidth
        tokens_s = decode_roofline_s(c, batch * draft, positions, bw, math.inf)
        limit_s = tokens_s - row_bytes(c, batch * draft, positions) / bw
        limit_s += row_bytes(c, batch, positions) / bw
    else:
        limit_s = limit_bytes(model, c, batch, positions) / args.bandwidth
    note = "; ".join(part for part in parts if part)
    return Row(
        name, f"{step_s * 1e3:.3f} ms", f"{limit_s * 1e3:.3f} ms", limit_s / step_s,
        engine.compile_s, *_slowest(engine), note,
    )  # fmt: skip


def prefill_row(model, c, prompts, length, args, rng, label) -> Row:
    rows = args.prefill_rows
    engine = _engine(model, args, batch=rows, tokens=rows * length, context=length + 16)
    engine.generate(_prompts(rng, 1, length), SamplingParams(max_new_tokens=1))  # warm
    start = time.perf_counter()
    engine.generate(_prompts(rng, prompts, length), SamplingParams(max_new_tokens=1))
    wall = time.perf_counter() - start
    rate = prompts * length / wall
    limit = prompts * length / (limit_flops(model, c, prompts, length) / args.flops)
    # Two more steps' prompts, profiled.
    for prompt in _prompts(rng, 2 * rows, length):
        engine.add_request(prompt, SamplingParams(max_new_tokens=1))
    note = f"{_breakdown(engine, 2, _kernel_table(args, f'prefill_{length}'))}; {_memory(engine)}"
    per_step = f", {rows} prompts a step" if rows > 1 else ""
    return Row(
        f"prefill {prompts}x{length}{per_step} ({label})", f"{rate / 1e3:.1f}k tok/s",
        f"{limit / 1e3:.0f}k tok/s", rate / limit, engine.compile_s, *_slowest(engine), note,
    )  # fmt: skip


def stream_row(model, c, requests, rate, args, rng, label) -> Row:
    """``requests`` requests arriving as a Poisson stream of ``rate`` per second (prompts of
    ``--prompt-len``, ``--output-len`` tokens each), served by an engine of ``--stream-batch``
    rows: TTFT and inter-token latency percentiles. Its limit is the decode step at that
    batch: the best inter-token latency a full batch allows."""
    batch, prompt, output = args.stream_batch, args.prompt_len, args.output_len
    context = -(-(prompt + output + 4) // 16) * 16
    engine = _engine(model, args, batch=batch, tokens=batch * prompt, context=context)
    params = SamplingParams(max_new_tokens=output)
    engine.generate(_prompts(rng, 1, prompt), SamplingParams(max_new_tokens=2))  # warm
    arrivals = np.cumsum(rng.exponential(1 / rate, requests))
    prompts = _prompts(rng, requests, prompt)
    results, sent, start = [], 0, time.perf_counter()
    while len(results) < requests:
        now = time.perf_counter() - start
        while sent < requests and arrivals[sent] <= now:
            engine.add_request(prompts[sent], params)
            sent += 1
        if not engine.has_work:
            if sent < requests:
                time.sleep(max(0.0, arrivals[sent] - now))
            continue
        results += [e.result for e in engine.step() if e.result is not None]
    ttft = np.asarray([r.ttft for r in results]) * 1e3
    itl = np.concatenate([r.token_latencies for r in results]) * 1e3
    limit_s = limit_bytes(model, c, batch, prompt + output) / args.bandwidth
    pct = lambda a: "/".join(f"{np.percentile(a, q):.1f}" for q in (50, 90, 99))  # noqa: E731
    return Row(
        f"stream {requests} req at {rate:g}/s, B<={batch} ({label})",
        f"ITL p50/p90/p99 {pct(itl)} ms", f"{limit_s * 1e3:.3f} ms/token at B={batch}",
        float(limit_s / (np.median(itl) / 1e3)), engine.compile_s, *_slowest(engine),
        f"TTFT p50/p90/p99 {pct(ttft)} ms; {requests * output / (time.perf_counter() - start):.0f}"
        " output tok/s",
    )  # fmt: skip


def _failed(name: str, err: Exception) -> Row:
    return Row(name, "failed", "", 0.0, 0.0, note=repr(err)[:300])


def _versions() -> str:
    names = ("jax", "jaxlib", "flax", "tokamax")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.import_module(name).__version__}")
        except ImportError:
            found.append(f"{name} absent")
    return ", ".join(found + [f"python {platform.python_version()}"])


def _device() -> str:
    d = jax.devices()[0]
    return getattr(d, "device_kind", d.platform)


def write_results(path: pathlib.Path, title: str, rows: list[Row]) -> None:
    lines = [
        f"## {title}", "",
        f"{datetime.date.today()}, {_device()}, {_versions()}; "
        f"XLA_FLAGS `{os.environ.get('XLA_FLAGS', '')}`; decode steps as whole CUDA graphs: "
        f"{'yes' if xla_flags.step_compiler_options(True) else 'no'} (unless a row says "
        "otherwise).", "",
        "| row | measured | limit | fraction | compile: start-up (s) "
        "| slowest step (s; lowering) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r.name} | {r.value} | {r.limit} | {r.fraction:.0%} | {r.compile_s:.0f} "
            f"| {r.slowest_s:.0f}; {r.slowest_lower_s:.0f} |"
        )
    notes = [f"* {r.name}: {r.note}" for r in rows if r.note]
    text = "\n".join(lines + [""] + notes) + "\n"
    with path.open("a") as f:
        f.write(text + "\n")
    print(text)


def _plot(path: pathlib.Path, rows: list[Row]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.4 * len(rows)))
    ax.barh([r.name for r in rows], [100 * r.fraction for r in rows])
    ax.set_xlabel("% of the hardware limit (bytes for decode, FLOPs for prefill)")
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)


def variant_rows(model, c, args, rng, label: str) -> list[Row]:
    """The decode, prefill and stream rows the arguments ask for, each measured (a failed row
    is reported as such, the rest still run; ``--smoke`` raises instead)."""
    rows: list[Row] = []

    def measure(name: str, row) -> None:
        try:
            rows.append(row())
        except Exception as err:
            if args.smoke:
                raise
            rows.append(_failed(f"{name} ({label})", err))
        print(rows[-1], flush=True)

    decode_rows = [(int(b), args.prompt_len) for b in args.decode.split(",") if b]
    decode_rows += [
        tuple(int(v) for v in spec.split("@")) for spec in args.decode_long.split(",") if spec
    ]
    for batch, prompt in decode_rows:
        measure(
            f"decode B={batch}",
            lambda b=batch, p=prompt: decode_row(model, c, b, p, args, rng, label),
        )
    if args.compile_only:  # a census of the decode executables only
        return rows
    for batch, draft in verify_specs(args.verify):
        measure(
            f"verify {batch}x{draft}",
            lambda b=batch, d=draft: verify_row(model, c, b, d, args, rng, label),
        )
    for spec in (s for s in args.prefill.split(",") if s):
        n, length = (int(v) for v in spec.split("x"))
        measure(
            f"prefill {spec}",
            lambda n=n, length=length: prefill_row(model, c, n, length, args, rng, label),
        )
    for spec in (s for s in args.stream.split(",") if s):
        n, rate = spec.split("x")
        measure(
            f"stream {spec}",
            lambda n=n, rate=rate: stream_row(model, c, int(n), float(rate), args, rng, label),
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-next-80b-a3b", choices=sorted(PRESETS))
    parser.add_argument("--layers", type=int, default=None, help="depth (default: the preset's)")
    parser.add_argument("--decode", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--prefill", default="8x4096", help="NxL prefill rows, comma-separated")
    parser.add_argument(
        "--stream", default="", help="request-stream rows as NxRATE (requests x per second)"
    )
    parser.add_argument(
        "--verify", default="", help="speculative rows as BxD: B requests verifying D tokens "
        "a row every step (n-gram drafts), comma-separated (e.g. 1x4)",
    )  # fmt: skip
    parser.add_argument("--stream-batch", type=int, default=16, help="rows of the stream engine")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per stream request")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument(
        "--prefill-rows", type=int, default=1, help="prompts per prefill step (rows x L tokens)"
    )
    parser.add_argument(
        "--decode-long", default="", help="decode rows at long contexts, BATCH@PROMPT_LEN, "
        "comma-separated (e.g. 1@8192,64@8192)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-steps", type=int, default=64,
        help="DECODE steps a decode row times (their median is the row's time; the note gives "
        "their 10th-90th percentile spread)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-bucket", type=int, default=MIN_BATCH_BUCKET,
        help="decode rows run in a batch bucket of at least this many rows (the rest padding; "
        "the engine's smallest default bucket)",
    )  # fmt: skip
    parser.add_argument(
        "--profile-steps", type=int, default=6,
        help="steps traced for each row's device breakdown (0: none)",
    )  # fmt: skip
    parser.add_argument("--host-profile", action="store_true", help="cProfile decode steps")
    parser.add_argument(
        "--kernel-tables", action="store_true",
        help="write each row's kernels (calls and us per step) to --out as kernels_*.tsv, and "
        "its last profiled step's launches in order as kernels_*.sequence.tsv, and the "
        "host threads' events (inclusive us per step) as kernels_*.host.tsv",
    )  # fmt: skip
    parser.add_argument(
        "--hlo", action="store_true",
        help="write each decode row's optimised HLO (its fusions by name) to --out as hlo_*.txt",
    )  # fmt: skip
    parser.add_argument(
        "--census", action="store_true",
        help="add each decode row's kernel census (its DECODE executable's launches, counted "
        "in the optimised HLO by kind: benchmarks/hlo_census.py) to its note",
    )  # fmt: skip
    parser.add_argument(
        "--compile-only", action="store_true",
        help="decode rows compile their engine and report the kernel census, without running "
        "a step (prefill and stream rows are skipped): a quick count of what a variant launches",
    )  # fmt: skip
    parser.add_argument(
        "--moe", default="auto",
        help="MoE variants, comma-separated: auto (the engine's choice), sorted (tokamax's "
        "grouped matmul at every batch: no experts by id), reference (ragged_dot); both = "
        "auto,reference",
    )  # fmt: skip
    parser.add_argument(
        "--projection-rows", type=int, default=None,
        help="steps of up to this many rows run a layer's input projections in one launch "
        f"(default: layers.linear.FEW_ROWS = {linear_layer.FEW_ROWS}; 0: never)",
    )  # fmt: skip
    parser.add_argument(
        "--ranked-top-k-tokens", type=int, default=None,
        help="steps of up to this many tokens route by ranking, not sorting (default: "
        f"layers.moe.RANKED_TOP_K_TOKENS = {moe_layer.RANKED_TOP_K_TOKENS}; 0: always sort)",
    )  # fmt: skip
    for flag, (module, name, value, what) in TRIAL_SWITCHES.items():
        parser.add_argument(
            flag, action="store_true",
            help=f"{what} ({module.__name__}.{name} = {value}; {getattr(module, name)} by default)",
        )  # fmt: skip
    parser.add_argument(
        "--no-fold-norm-weights", action="store_true",
        help="leave each decoder layer's norm weights with the norm "
        "(layers.norm.FOLD_NORM_WEIGHTS = False): the layers are stacked, and folded, once "
        "for every row of a run, so this is a run's setting, not a trial switch",
    )  # fmt: skip
    parser.add_argument(
        "--each-switch", default="",
        help="trial switches (flag names without the dashes, comma-separated) to run the rows "
        "with one at a time, after the rows with none, in one process (one model build); "
        "switches joined by '+' make one trial",
    )  # fmt: skip
    parser.add_argument("--bandwidth", type=float, default=4.3e12)
    parser.add_argument("--flops", type=float, default=7.9e14)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    parser.add_argument(
        "--unrolled", action="store_true",
        help="every layer in the step, no lax.scan over repeated layers (compile time grows)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-dir", default=None,
        help="JAX's persistent compilation cache (default: a new empty folder, a cold start)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent))
    args = parser.parse_args(argv)
    # tokamax logs every autotuning-cache miss as a warning; its heuristics choose the config.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        verify_specs(args.verify)
    except ValueError as err:
        parser.error(f"--verify {args.verify!r}: {err}")
    if args.smoke:
        args.preset = args.preset if args.preset.endswith("smoke") else "smoke"
        args.decode, args.prefill, args.verify = "2", "2x64", "2x3"
        args.prompt_len, args.decode_steps, args.profile_steps = 8, 4, 2
        args.stream, args.stream_batch, args.output_len = "3x200", 2, 3
    for flag, value in (("--profile-steps", args.profile_steps),
                        ("--projection-rows", args.projection_rows),
                        ("--ranked-top-k-tokens", args.ranked_top_k_tokens)):  # fmt: skip
        if value is not None and value < 0:
            parser.error(f"{flag} {value}: must be >= 0")
    settings = {
        (module, name): value
        for flag, (module, name, value, _) in TRIAL_SWITCHES.items()
        if getattr(args, flag[2:].replace("-", "_"))
    }
    each = [
        tuple(f"--{name.strip()}" for name in trial.split("+"))
        for trial in args.each_switch.split(",")
        if trial.strip()
    ]
    unknown = [flag for trial in each for flag in trial if flag not in TRIAL_SWITCHES]
    if unknown:
        parser.error(
            f"--each-switch {args.each_switch!r}: {unknown} are not trial switches "
            f"({', '.join(sorted(f[2:] for f in TRIAL_SWITCHES))})"
        )
    if args.projection_rows is not None:
        settings[linear_layer, "FEW_ROWS"] = args.projection_rows
    if args.ranked_top_k_tokens is not None:
        settings[moe_layer, "RANKED_TOP_K_TOKENS"] = args.ranked_top_k_tokens
    if args.cache_dir is None:
        # Cold, as a first start is; within the run the rows share it, as an engine's own
        # executables do (EXTEND and MIXED lower to the same program).
        args.cache_dir = tempfile.mkdtemp(prefix="serve-xla-")
    depth, make = PRESETS[args.preset]
    c = make(args.layers or depth)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = (NemotronH if isinstance(c, NemotronHConfig) else Qwen3Next)(c, rngs=nnx.Rngs(0))
    if not args.unrolled:
        # Stacked once for every row's engine (each would otherwise stack its own copy), and
        # folded here: an engine folds only the layers it stacks itself.
        model = scan_layers(model, donate=True)
        if not args.no_fold_norm_weights:
            fold_scanned_norms(model)
    jax.block_until_ready(nnx.state(model))
    print(
        f"built {args.preset} x{c.num_hidden_layers} in {time.perf_counter() - start:.0f} s",
        flush=True,
    )
    rng = np.random.default_rng(0)
    kernel = _GROUPED_MATMUL._tokamax_ragged_dot
    both = ["auto", "reference"] if kernel() is not None else ["reference"]
    chosen = both if args.moe == "both" else [v for v in args.moe.split(",") if v]
    unknown = sorted(set(chosen) - {"auto", "sorted", "reference"})
    if unknown:
        parser.error(f"--moe {args.moe!r}: {unknown} not among auto, sorted, reference, both")
    rows: list[Row] = []
    for variant in chosen:
        # The reference rows hide tokamax from the grouped matmul, so auto takes ragged_dot;
        # the sorted rows never run experts by id.
        variant_settings = dict(settings)
        if variant == "reference":
            variant_settings[_GROUPED_MATMUL, "_tokamax_ragged_dot"] = lambda: None
        if variant == "sorted":
            variant_settings[moe_layer, "BY_ID_MAX_PAIRS"] = 0
        args.program_store = variant == "auto"
        tokamax = variant != "reference" and kernel() is not None
        label = (
            "MoE "
            + ("tokamax" if tokamax else "ragged_dot")
            + (", no experts by id" if variant == "sorted" else "")
        )
        if not getattr(c, "num_experts", 0):
            label = "dense"
        if args.no_fold_norm_weights:
            label += ", norm weights not folded"
        for trial in [None, *each]:
            trial_settings = dict(variant_settings)
            for flag in trial or ():
                module, name, value, _ = TRIAL_SWITCHES[flag]
                trial_settings[module, name] = value
            with switches_set(trial_settings):
                if not args.unrolled:
                    # As an engine does with the layers it stacks (each layer as its switch
                    # says); the layout stays for any later rows, which split the paired
                    # products in XLA.
                    pair_scanned_swiglu(model)
                row_label = f"{label}, {' '.join(trial)}" if trial else label
                rows += variant_rows(model, c, args, rng, row_label)
        if not getattr(c, "num_experts", 0):
            break
    title = f"{args.preset}, {c.num_hidden_layers} layers"
    name = "RESULTS_serve_smoke.md" if args.smoke else "RESULTS_serve.md"
    write_results(out / name, title, rows)
    _plot(out / f"serve_{args.preset}.png", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
