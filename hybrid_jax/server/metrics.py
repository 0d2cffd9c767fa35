"""``/metrics``: the server's state and latencies in Prometheus' text format.

Gauges are read from the worker when scraped (requests running and waiting, slots and KV
pages in use, retraces after warm-up, tokens per second over the last scrape interval); the
finished requests' time to first token, inter-token latencies and total time are histograms,
observed as each request finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hybrid_jax.engine.requests import Result
from hybrid_jax.server.worker import WorkerStats

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _StateCollector(Collector):
    def __init__(self, stats: Callable[[], WorkerStats]):
        self._stats = stats
        self._last = (time.monotonic(), 0)

    def collect(self) -> Iterator:
        s = self._stats()
        gauges = {
            "requests_running": ("requests being served", s.running),
            "requests_waiting": ("requests waiting for a slot", s.waiting),
            "slots_used": ("state-pool slots in use", s.slots_used),
            "slots_total": ("state-pool slots", s.slots_total),
            "kv_pages_used": ("KV-cache pages in use", s.pages_used),
            "kv_pages_total": ("KV-cache pages", s.pages_total),
            "retraces": ("steps traced after warm-up (0 unless a shape escaped)", s.retraces),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"hybrid_jax_{name}", doc, value=value)
        yield CounterMetricFamily(
            "hybrid_jax_generated_tokens", "tokens generated since start", value=s.tokens
        )
        now = time.monotonic()
        then, tokens = self._last
        self._last = (now, s.tokens)
        rate = (s.tokens - tokens) / (now - then) if now > then else 0.0
        yield GaugeMetricFamily(
            "hybrid_jax_tokens_per_second", "tokens generated per second since the last scrape",
            value=rate,
        )  # fmt: skip


class ServerMetrics:
    """The registry behind ``/metrics``; ``observe`` records a finished request."""

    def __init__(self, stats: Callable[[], WorkerStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(stats))
        kw = dict(registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram(
            "hybrid_jax_time_to_first_token_seconds", "submission to first token", **kw
        )
        self.itl = Histogram(
            "hybrid_jax_inter_token_latency_seconds", "time between consecutive tokens", **kw
        )
        self.latency = Histogram(
            "hybrid_jax_request_latency_seconds", "submission to the end of a request", **kw
        )
        self.finished = Counter(
            "hybrid_jax_requests_finished", "finished requests by finish reason",
            ["finish_reason"], registry=self.registry,
        )  # fmt: skip

    def observe(self, result: Result) -> None:
        if result.token_ids:
            self.ttft.observe(result.ttft)
        for latency in result.token_latencies:
            self.itl.observe(latency)
        self.latency.observe(result.total)
        self.finished.labels(str(result.finish_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
