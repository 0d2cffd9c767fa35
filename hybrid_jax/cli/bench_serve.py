"""``hybrid-jax bench serve``: a client-side benchmark of a running OpenAI-compatible server.

Sends ``--num-prompts`` streamed completions of ``--random-input-len`` random token ids (ids
below 256, valid in every served vocabulary) asking for ``--random-output-len`` tokens,
arriving as a Poisson process of ``--request-rate`` per second (``inf``: all at once), at most
``--max-concurrency`` in flight. Reports, as ``vllm bench serve`` does, time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency between streamed
chunks (ITL): mean, median and p99 in ms; request and output-token throughput. ``--save-result
PATH`` writes them, with every request's numbers, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time

import numpy as np

__all__ = ["add_serve_bench_arguments", "bench_serve"]


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("bench serve (a running server, over HTTP)")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    g.add_argument("--model", default=None, help="model id to send (default: the server's)")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf)")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    g.add_argument("--random-input-len", type=int, default=128, help="prompt tokens")
    g.add_argument("--random-output-len", type=int, default=64, help="tokens to generate")
    g.add_argument("--save-result", default=None, metavar="PATH", help="write the results as JSON")


@dataclasses.dataclass
class RequestStats:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = math.nan
    latency: float = math.nan
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


async def _one(client, url: str, body: dict) -> RequestStats:
    start = time.perf_counter()
    stats, last = RequestStats(ok=False), None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                stats.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return stats
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    stats.error = event["error"].get("message", "error")
                    return stats
                now = time.perf_counter()
                if event.get("choices"):
                    if last is None:
                        stats.ttft = now - start
                    else:
                        stats.itl.append(now - last)
                    last = now
                if event.get("usage"):
                    stats.prompt_tokens = event["usage"]["prompt_tokens"]
                    stats.output_tokens = event["usage"]["completion_tokens"]
        stats.latency = time.perf_counter() - start
        stats.ok = True
    except Exception as err:  # a refused connection, a reset: counted as a failure
        stats.error = repr(err)
    return stats


async def _run(args: argparse.Namespace, model: str) -> tuple[list[RequestStats], float]:
    import httpx

    rng = np.random.default_rng(args.seed)
    limit = args.max_concurrency or args.num_prompts
    gate = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(None, connect=30.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def send(prompt: list[int]) -> RequestStats:
            async with gate:
                body = {
                    "model": model, "prompt": prompt, "max_tokens": args.random_output_len,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                }  # fmt: skip
                return await _one(client, args.url, body)

        tasks, start = [], time.perf_counter()
        for _ in range(args.num_prompts):
            prompt = rng.integers(0, 256, args.random_input_len).tolist()
            tasks.append(asyncio.create_task(send(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1 / args.request_rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _summary(values: list[float]) -> dict[str, float]:
    v = np.asarray([x for x in values if math.isfinite(x)]) * 1e3
    if not v.size:
        return {"mean_ms": math.nan, "median_ms": math.nan, "p99_ms": math.nan}
    return {
        "mean_ms": float(v.mean()),
        "median_ms": float(np.median(v)),
        "p99_ms": float(np.percentile(v, 99)),
    }


def bench_serve(args: argparse.Namespace) -> int:
    checks = {
        "--num-prompts": (args.num_prompts, args.num_prompts >= 1, ">= 1"),
        "--random-input-len": (args.random_input_len, args.random_input_len >= 1, ">= 1"),
        "--random-output-len": (args.random_output_len, args.random_output_len >= 1, ">= 1"),
        "--request-rate": (args.request_rate, args.request_rate > 0, "> 0 (inf: all at once)"),
        "--max-concurrency": (
            args.max_concurrency, args.max_concurrency is None or args.max_concurrency >= 1,
            ">= 1",
        ),
    }  # fmt: skip
    for flag, (value, ok, rule) in checks.items():
        if not ok:
            print(f"hybrid-jax bench serve: {flag}={value} must be {rule}", file=sys.stderr)
            return 2
    try:
        import httpx
    except ImportError:
        print("hybrid-jax bench serve: needs httpx (pip install httpx)", file=sys.stderr)
        return 2
    try:
        models = httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as err:
        print(f"hybrid-jax bench serve: no server at --url={args.url} ({err})", file=sys.stderr)
        return 2
    model = args.model or models[0]["id"]
    results, duration = asyncio.run(_run(args, model))
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    report = {
        "url": args.url,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": output / duration,
        "total_output_tokens": output,
        "ttft": _summary([r.ttft for r in done]),
        "tpot": _summary([r.tpot for r in done]),
        "itl": _summary([x for r in done for x in r.itl]),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "requests": [dataclasses.asdict(r) for r in results],
    }
    print(f"completed {len(done)} / {len(results)} in {duration:.2f} s: "
          f"{report['request_throughput']:.2f} req/s, {report['output_throughput']:.1f} "
          f"output tok/s")  # fmt: skip
    print(f"{'':8} {'mean':>10} {'median':>10} {'p99':>10}  (ms)")
    for name in ("ttft", "tpot", "itl"):
        s = report[name]
        print(f"{name.upper():8} {s['mean_ms']:10.2f} {s['median_ms']:10.2f} {s['p99_ms']:10.2f}")
    for error in report["errors"]:
        print(f"failed: {error}", file=sys.stderr)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if done else 1
