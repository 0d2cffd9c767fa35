"""The serving subcommands of the command line: ``hybrid-jax generate`` and ``hybrid-jax bench``.

``generate`` serves prompts (arguments, or one per line on stdin) with the built-in tiny
model or a checkpoint folder, printing tokens as they arrive. ``bench`` submits a batch of
random prompts at once and reports compile time, tokens/s, time to first token and the time
of a step in each mode, as a table and, when matplotlib is importable, a PNG plot. With
``--speculative ngram`` or ``--speculative mtp`` (the model's multi-token-prediction head;
the tiny model has one) both commands decode speculatively; ``bench`` then also serves the
same prompts without speculation and compares tokens/s, acceptance rate and mean accepted
length, and with MTP drafts times the head's drafting after each step. ``--tree-width K``
(K children of the root, then a chain below the first) or ``--tree-parents=-1,0,0,2`` (one
parent per node; with ``=``, as the value starts with a minus) make the MTP drafts trees of D
nodes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from hybrid_jax.cli.bench_serve import add_serve_bench_arguments, bench_serve
from hybrid_jax.engine.config import DEFAULT_CACHE_DIR, EngineConfig
from hybrid_jax.engine.engine import Engine
from hybrid_jax.engine.requests import Result
from hybrid_jax.engine.sampling import SamplingParams, SamplingParamsError
from hybrid_jax.engine.scheduler import RequestError
from hybrid_jax.engine.speculative import DRAFT_SOURCES, SpeculativeConfig, SpeculativeStats
from hybrid_jax.models.checkpoint import resolve_checkpoint
from hybrid_jax.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from hybrid_jax.modes import ForwardMode

__all__ = ["add_bench_parser", "add_generate_parser", "bench", "generate"]


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="a Hugging Face checkpoint folder, or an org/model id in the local hub cache "
        "(default: the tiny built-in model)",
    )
    parser.add_argument("--max-batch", type=int, default=4, help="requests running at once")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per step")
    # EngineConfig's default: the README's Python example then finds these executables.
    parser.add_argument(
        "--max-context", type=int, default=EngineConfig.max_context, help="positions per request"
    )
    parser.add_argument("--chunk-size", type=int, default=None, help="prefill chunk (tokens)")
    parser.add_argument(
        "--impl", default="auto", choices=["auto", "pallas", "interpret", "reference"]
    )
    parser.add_argument(
        "--cache-dir",
        default=DEFAULT_CACHE_DIR,
        help="persistent compilation cache ('' to disable)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model weights (tiny) and seeds")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's outputs do not depend on what it is batched with (one bucket, no "
        "mixed steps, fixed prompt chunks; a lone request runs as a full batch)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor parallelism: the devices each step is spread over (heads and widths cut "
        "across them)",
    )
    parser.add_argument(
        "--speculative",
        default=None,
        choices=DRAFT_SOURCES,
        help=f"speculative decoding with this draft source ({', '.join(DRAFT_SOURCES)}; "
        "default: off)",
    )
    parser.add_argument(
        "--num-draft-tokens", type=int, default=4, help="D: tokens per verify row (2..8)"
    )
    parser.add_argument(
        "--tree-width",
        type=int,
        default=0,
        metavar="K",
        help="tree drafts (--speculative mtp): K children of the root, then a chain below the "
        "first (default: a chain)",
    )
    parser.add_argument(
        "--tree-parents",
        type=_parents,
        default=(),
        metavar="P0,P1,...",
        help="tree drafts (--speculative mtp): the parent of each of the D nodes, -1 for the "
        "root, e.g. --tree-parents=-1,0,0,2 (with '=': the value starts with a minus)",
    )


def _parents(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints (one parent per node, -1 for the "
            f"root), e.g. --tree-parents=-1,0,0,2"
        ) from None


def _speculative(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The speculative config the flags describe (None: off); raises ValueError."""
    tree = bool(args.tree_width or args.tree_parents)
    if not args.speculative:
        if tree:
            raise ValueError("--tree-width / --tree-parents need --speculative mtp")
        return None
    return SpeculativeConfig(
        args.speculative,
        args.num_draft_tokens,
        tree=tree,
        tree_width=args.tree_width or 2,
        tree_parents=args.tree_parents,
    )


def _label(args: argparse.Namespace) -> str:
    """``mtp D=4`` or ``mtp D=4 tree``: the speculation of a results row."""
    tree = " tree" if args.tree_width or args.tree_parents else ""
    return f"{args.speculative} D={args.num_draft_tokens}{tree}"


def _engine(
    args: argparse.Namespace,
    command: str,
    *,
    speculative: bool = True,
    tokenizer: Tokenizer | None = None,
) -> Engine | None:
    """The engine the flags describe (without speculation when ``speculative`` is False; a
    checkpoint's ``tokenizer`` when it is already loaded), or None after printing why it
    cannot be built."""
    try:
        spec = _speculative(args) if speculative else None
    except ValueError as err:
        print(f"hybrid-jax {command}: {err}", file=sys.stderr)
        return None
    try:
        config = EngineConfig(
            max_batch=args.max_batch,
            max_tokens=args.max_tokens,
            max_context=args.max_context,
            chunk_size=args.chunk_size,
            cache_dir=args.cache_dir or None,
            seed=args.seed,
            impl=args.impl,
            speculative=spec,
            batch_invariant=args.batch_invariant,
            tensor_parallel=args.tp,
        )
        if args.checkpoint:
            return Engine.from_checkpoint(args.checkpoint, config, tokenizer=tokenizer)
        return Engine.from_preset("tiny", config, seed=args.seed)
    # CheckpointError, TokenizerError, ConfigError and MetadataError are ValueErrors too; a
    # kernel that cannot run here (--impl pallas off an sm_90 GPU) is a NotImplementedError.
    except (ValueError, NotImplementedError) as err:
        message = str(err).splitlines()[0] if str(err) else repr(err)
        for field in ("max_batch", "max_tokens", "max_context", "chunk_size", "seed", "impl",
                      "batch_invariant"):  # fmt: skip
            message = message.replace(f"EngineConfig.{field}=", f"--{field.replace('_', '-')}=")
        message = message.replace("EngineConfig.tensor_parallel=", "--tp=")
        message = message.replace("tensor_parallel=", "--tp=")
        print(f"hybrid-jax {command}: {message}", file=sys.stderr)
        return None


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="generate text (built-in tiny model by default)",
    )
    p.add_argument("prompts", nargs="*", help="prompts; none: one per line from stdin")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--sample-seed", type=int, default=None, help="seed of every request")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], help="repeatable")
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="after each completion, a JSON line of its tokens, their log-probabilities and "
        "each step's N most likely tokens (0: the chosen tokens only; default: none)",
    )
    _engine_arguments(p)
    p.set_defaults(func=generate)


def _print_logprobs(index: int, result: Result) -> None:
    """A JSON line of the result's log-probabilities, when its request asked for them."""
    if result.logprobs is None:
        return
    line = {"prompt": index, "token_ids": result.token_ids, "logprobs": result.logprobs}
    if result.top_logprobs is not None:
        line["top_logprobs"] = result.top_logprobs
    print(json.dumps(line))


def _printable(text: str) -> str:
    # The tiny model's random weights emit arbitrary bytes: show control characters escaped
    # rather than letting them drive the terminal.
    return "".join(
        c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text
    )


def _summary(results: Sequence[Result]) -> str:
    tokens = sum(len(r.token_ids) for r in results)
    ttft = statistics.median(r.ttft for r in results)
    rate = statistics.median(r.tokens_per_s for r in results)
    reasons = collections.Counter(str(r.finish_reason) for r in results)
    finished = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
    return (
        f"{len(results)} requests, {tokens} tokens; median time to first token "
        f"{1e3 * ttft:.1f} ms, median decode {rate:.1f} tokens/s per request; finished: "
        f"{finished} (length: --max-new-tokens reached or the context, --max-context, full)"
    )


def _encode_prompts(
    args: argparse.Namespace, prompts: Sequence[str], params: SamplingParams
) -> tuple[Tokenizer, list[list[int]]]:
    """The tokenizer of the flags and the prompts' token ids, checked (empty, longer than
    --max-context, stop ids outside the vocabulary) before the model is built and its steps
    compiled; raises ``ValueError`` saying what is wrong."""
    tokenizer = (
        load_tokenizer(resolve_checkpoint(args.checkpoint)) if args.checkpoint else ByteTokenizer()
    )
    encoded = [tokenizer.encode(text) for text in prompts]
    for i, ids in enumerate(encoded):
        if not ids:
            raise ValueError(f"prompt {i} is empty; give at least one token")
        # A --max-context below 1 is EngineConfig's to refuse, by its own rule.
        if args.max_context is not None and 0 < args.max_context < len(ids):
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens, longer than --max-context="
                f"{args.max_context}; shorten it or raise --max-context"
            )
    vocab = tokenizer.vocab_size
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"--stop-token-id {bad[0]} is outside the vocabulary (ids 0..{vocab - 1})")
    return tokenizer, encoded


def generate(args: argparse.Namespace) -> int:
    if not args.prompts and sys.stdin.isatty():
        print("reading prompts from stdin, one per line (end with Ctrl-D)", file=sys.stderr)
    try:
        prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
        for text in prompts:
            text.encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError) as err:
        print(f"hybrid-jax generate: a prompt is not valid UTF-8 ({err.reason} at byte "
              f"{err.start}); give prompts as UTF-8 text", file=sys.stderr)  # fmt: skip
        return 2
    if not prompts:
        print("hybrid-jax generate: no prompt given (arguments or stdin)", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.sample_seed,
            stop_token_ids=tuple(args.stop_token_id),
            logprobs=args.logprobs,
        )
    except SamplingParamsError as err:
        message = str(err)
        for field in ("logprobs", "max_new_tokens", "temperature", "top_k", "top_p"):
            message = message.replace(f"{field}=", f"--{field.replace('_', '-')}=", 1)
        print(f"hybrid-jax generate: {message}", file=sys.stderr)
        return 2
    try:
        tokenizer, encoded = _encode_prompts(args, prompts, params)
    except ValueError as err:  # TokenizerError too: its first line names the file
        print(f"hybrid-jax generate: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    engine = _engine(args, "generate", tokenizer=tokenizer)
    if engine is None:
        return 2
    results: list[Result] = []
    try:
        stream = engine.stream(encoded, params)
        if len(prompts) == 1:
            print(_printable(prompts[0]), end="", flush=True)
            for _, event in stream:
                print(_printable(event.text), end="", flush=True)
                if event.result is not None:
                    results.append(event.result)
            print()
            _print_logprobs(0, results[-1])
        else:
            # Interleaved tokens of several prompts would be unreadable: print each
            # completion as soon as it finishes.
            for i, event in stream:
                if event.result is not None:
                    results.append(event.result)
                    print(f"[{i}] {_printable(prompts[i])}{_printable(event.result.text)}")
                    _print_logprobs(i, event.result)
    except (RequestError, SamplingParamsError) as err:
        print(f"hybrid-jax generate: {err}", file=sys.stderr)
        return 2
    print(_summary(results), file=sys.stderr)
    if engine.speculative is not None:
        stats = engine.speculative_stats
        print(
            f"speculative {_label(args)}: "
            f"{stats.acceptance_rate:.1%} of drafts accepted, "
            f"{stats.mean_accepted_length:.2f} tokens per verify row",
            file=sys.stderr,
        )
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="throughput, time to first token, step times by mode ('bench serve': of a "
        "running server, over HTTP)",
    )
    p.add_argument(
        "target", nargs="?", choices=("engine", "serve"), default="engine",
        help="engine: an engine built here (default); serve: a running server at --url",
    )  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16, help="random prompts to serve")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument(
        "--plot", default="", metavar="PATH", help="write a PNG plot there (needs matplotlib)"
    )
    _engine_arguments(p)
    add_serve_bench_arguments(p)
    p.set_defaults(func=bench)


def _ms(values: Sequence[float]) -> tuple[float, float, float]:
    if not values:
        return (float("nan"),) * 3
    ms = np.asarray(values) * 1e3
    return float(np.median(ms)), float(np.percentile(ms, 90)), float(ms.mean())


def _plot(path: str, engine: Engine, results: Sequence[Result]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (steps, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    modes = [m for m, times in engine.step_times.items() if times]
    steps.boxplot([np.asarray(engine.step_times[m]) * 1e3 for m in modes])
    steps.set_xticks(range(1, len(modes) + 1), [m.name for m in modes])
    steps.set_ylabel("step time (ms)")
    steps.set_title("time per step by mode")
    ttft.hist([r.ttft * 1e3 for r in results], bins=20)
    ttft.set_xlabel("time to first token (ms)")
    ttft.set_title(f"{len(results)} requests")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _serve(
    engine: Engine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[Result], float]:
    """Serves ``prompts`` after one untimed request that runs every step path once; returns
    the results and the wall time."""
    engine.generate(prompts[:1], dataclasses.replace(params, max_new_tokens=2))
    for times in engine.step_times.values():
        times.clear()
    engine.speculative_stats = SpeculativeStats()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    return results, time.perf_counter() - start


def _rate(results: Sequence[Result], wall: float) -> float:
    return sum(len(r.token_ids) for r in results) / wall


def bench(args: argparse.Namespace) -> int:
    if args.target == "serve":
        return bench_serve(args)
    for flag, value in (("--num-prompts", args.num_prompts), ("--prompt-len", args.prompt_len),
                        ("--new-tokens", args.new_tokens)):  # fmt: skip
        if value < 1:
            print(f"hybrid-jax bench: {flag}={value} must be >= 1", file=sys.stderr)
            return 2
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        print(f"hybrid-jax bench: --plot={args.plot}: its folder does not exist", file=sys.stderr)
        return 2
    engine = _engine(args, "bench")
    if engine is None:
        return 2
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(max_new_tokens=args.new_tokens)
    prompts = rng.integers(0, engine.vocab_size, (args.num_prompts, args.prompt_len)).tolist()
    try:
        results, wall = _serve(engine, prompts, params)
    except (RequestError, SamplingParamsError) as err:
        print(f"hybrid-jax bench: {err}", file=sys.stderr)
        return 2
    generated = sum(len(r.token_ids) for r in results)
    cfg = engine.config
    spec = ""
    if engine.speculative is not None:
        spec = f", speculative {_label(args)}"
        if engine.speculative.tree:
            spec += f" {engine.speculative.parents}"
    print(
        f"hybrid-jax bench: {args.num_prompts} prompts x {args.prompt_len} tokens, "
        f"{args.new_tokens} new each; max_batch {cfg.max_batch}, max_tokens {cfg.max_tokens}, "
        f"impl {cfg.impl}{spec}"
    )
    executables = len(engine.compile_records)
    executables += len(engine.mtp.compile_records) if engine.mtp is not None else 0
    print(
        f"start-up compile and warm-up ({executables} step executables, "
        f"{len(engine.sampler_compile_ms)} samplers): {engine.compile_s:.1f} s; "
        f"retraces after warm-up: {engine.retraces}"
    )
    print(
        f"wall {wall:.2f} s: {generated / wall:.1f} generated tokens/s, "
        f"{(generated + args.num_prompts * args.prompt_len) / wall:.1f} total tokens/s"
    )
    header = f"{'':<26}{'median':>10}{'p90':>10}{'mean':>10}{'count':>8}"
    print(header)
    print("-" * len(header))
    rows = [
        ("time to first token (ms)", [r.ttft for r in results]),
        ("per-token latency (ms)", [t for r in results for t in r.token_latencies]),
    ]
    rows += [
        (f"{mode.name} step (ms)", engine.step_times[mode])
        for mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE)
    ]
    if args.speculative:
        rows.append(("TARGET_VERIFY step (ms)", engine.step_times[ForwardMode.TARGET_VERIFY]))
    if engine.mtp is not None:
        # The head's chain after a step (EXTEND or DRAFT_EXTEND, then DECODE steps).
        rows.append(("MTP drafting (ms)", engine.step_times[ForwardMode.DRAFT_EXTEND]))
    for label, values in rows:
        median, p90, mean = _ms(values)
        print(f"{label:<26}{median:>10.2f}{p90:>10.2f}{mean:>10.2f}{len(values):>8}")
    retraces = engine.retraces
    if args.speculative:
        retraces += _compare(args, engine, prompts, params, _rate(results, wall))
    if args.plot:
        if _plot(args.plot, engine, results):
            print(f"plot: {args.plot}")
        else:
            print("plot skipped: matplotlib is not installed", file=sys.stderr)
    return 0 if retraces == 0 else 1


def _compare(
    args: argparse.Namespace,
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    rate: float,
) -> int:
    """Serves the same prompts without speculation and prints both; returns its retraces."""
    plain = _engine(args, "bench", speculative=False)
    if plain is None:
        return 1
    plain_results, plain_wall = _serve(plain, prompts, params)
    plain_rate = _rate(plain_results, plain_wall)
    stats = engine.speculative_stats
    print(f"{'speculation':<26}{'tokens/s':>10}{'speedup':>10}{'accepted':>10}{'length':>8}")
    print(f"{'off':<26}{plain_rate:>10.1f}{1.0:>10.2f}{'-':>10}{'-':>8}")
    print(
        f"{_label(args):<26}{rate:>10.1f}"
        f"{rate / plain_rate:>10.2f}{stats.acceptance_rate:>10.1%}"
        f"{stats.mean_accepted_length:>8.2f}"
    )
    print(
        "accepted: drafts accepted per draft proposed (a tree proposes D-1 nodes, of which at "
        "most its depth can be accepted); length: tokens per verify row (accepted drafts + 1)"
    )
    if not args.checkpoint:
        print(
            "the built-in model has random weights, which no draft can predict: acceptance "
            "stays near 0 and speculation costs time here; run with --checkpoint DIR to see "
            "what a trained model gives"
        )
    return plain.retraces
