"""Prometheus metrics of DESIGN.md section 9, in a private registry (never the process-global one).

The engine's own counters (tokens, preemptions, prefix-cache lookups) and gauges (running, waiting,
KV usage) are read from an `EngineStats` taken on the engine thread at scrape time; the latency
histograms are observed by the server as it streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "localserve"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters and gauges at one moment (read on the engine thread)."""

    num_requests_running: int
    num_requests_waiting: int  # waiting to be admitted, or preempted (recompute or swapped out)
    kv_cache_usage_ratio: float
    num_preemptions: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int

    @classmethod
    def read(cls, engine) -> EngineStats:
        """Call on the engine thread (EngineThread.call(EngineStats.read))."""
        scheduler, block_manager = engine.scheduler, engine.block_manager
        return cls(len(scheduler.running), len(scheduler.waiting) + len(scheduler.swapped),
                   block_manager.usage_ratio, engine.num_preemptions, block_manager.prefix_query_tokens,
                   block_manager.prefix_hit_tokens, engine.num_prompt_tokens, engine.num_generation_tokens)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        gauges = [("kv_cache_usage_ratio", "KV-cache usage: fraction of GPU blocks in use (0-1).",
                   stats.kv_cache_usage_ratio),
                  ("num_requests_running", "Requests in the running batch.", stats.num_requests_running),
                  ("num_requests_waiting", "Requests waiting for admission (preempted ones included).",
                   stats.num_requests_waiting)]
        counters = [("num_preemptions", "Requests preempted because the KV pool was full.",
                     stats.num_preemptions),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     stats.prefix_query_tokens),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     stats.prefix_hit_tokens),
                    ("prompt_tokens", "Prompt tokens computed (prefilled).", stats.num_prompt_tokens),
                    ("generation_tokens", "Tokens generated.", stats.num_generation_tokens)]
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, documentation, value in counters:
            family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """The server's Prometheus registry: engine statistics plus streaming-latency histograms."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineStatsCollector(model_name)
        self.registry.register(self._engine_collector)
        labels = ["model_name"]
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time from request arrival to its first token.", labels,
            registry=self.registry, buckets=TTFT_BUCKETS).labels(model_name)
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between successive tokens of a request.", labels,
            registry=self.registry, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Time from request arrival to its last token.", labels,
            registry=self.registry, buckets=E2E_BUCKETS).labels(model_name)

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, with the engine figures of `stats`."""
        self._engine_collector.stats = stats
        return generate_latest(self.registry)
