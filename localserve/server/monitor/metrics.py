"""Prometheus metrics of DESIGN.md section 9, in a private registry (never the process-global one).

The engine's own counters (tokens, preemptions, prefix-cache lookups) and gauges (running, waiting,
KV usage) are read from an `EngineStats` taken on the engine thread at scrape time; the latency
histograms are observed by the server as it streams, and the connection figures are read from the
server's connection book (server/wire/connection_phases.py) at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from localserve.engine.snapshot import EngineStats
from localserve.server.wire.connection_phases import UNFINISHED_PHASES, CloseReason, ConnectionCounts

PREFIX = "localserve"
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        gauges, counters = stats.gauges, stats.counters
        for name, documentation, value in (
                ("kv_cache_usage_ratio", "KV-cache usage: fraction of GPU blocks in use (0-1).",
                 gauges.kv_cache_usage_ratio),
                ("num_requests_running", "Requests in the running batch.", gauges.num_requests_running),
                ("num_requests_waiting", "Requests waiting for admission (preempted ones included).",
                 gauges.num_requests_waiting + gauges.num_requests_swapped),
                ("spec_decode_acceptance_rate", "Speculative decoding: drafted tokens accepted over drafted tokens, "
                 "since the server started (0 without speculation).", gauges.spec_acceptance_rate),
                ("spec_decode_mean_accepted_length", "Speculative decoding: tokens one verification yields on "
                 "average, the accepted drafted ones and the model's own (0 without speculation).",
                 gauges.spec_mean_accepted_length)):
            family = GaugeMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        if gauges.kv_groups:  # layer groups (kv/layer_groups.py): each pool's blocks by state
            blocks = GaugeMetricFamily(f"{PREFIX}_kv_group_blocks", "KV blocks of each layer group's pool by state "
                                       "(used, cached, free); group: full or window W.",
                                       labels=["model_name", "group", "state"])
            for usage in gauges.kv_groups:
                for state, count in (("used", usage.num_used_blocks), ("cached", usage.num_cached_blocks),
                                     ("free", usage.num_free_blocks)):
                    blocks.add_metric([self.model_name, usage.label, state], count)
            yield blocks
        preemptions = CounterMetricFamily(f"{PREFIX}_num_preemptions", "Requests preempted because the KV "
                                          "pool was full, by how they come back (swap falls back to "
                                          "recompute when the swap pool is full).", labels=["model_name", "mode"])
        preemptions.add_metric([self.model_name, "recompute"], counters.num_preemptions_recompute)
        preemptions.add_metric([self.model_name, "swap"], counters.num_preemptions_swap)
        yield preemptions
        for name, documentation, value in (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", counters.prefix_query_tokens),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", counters.prefix_hit_tokens),
                ("prompt_tokens", "Prompt tokens computed (prefilled).", counters.num_prompt_tokens),
                ("generation_tokens", "Tokens generated.", counters.num_generation_tokens),
                ("images_encoded", "Images run through the vision encoder (not found in the embeddings cache).",
                 counters.num_images_encoded),
                ("image_cache_hits", "Images whose embeddings the cache held (not encoded again).",
                 counters.num_image_cache_hits),
                ("image_encode_seconds", "Seconds spent in the vision encoder.", counters.image_encode_s)):
            family = CounterMetricFamily(f"{PREFIX}_{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class _ConnectionCollector(Collector):
    """The connection book's figures: served connections, unfinished ones by phase, those closed unfinished."""

    def __init__(self, model_name: str, read: Callable[[], ConnectionCounts]) -> None:
        self.model_name, self.read = model_name, read

    def collect(self) -> Iterator[Metric]:
        counts = self.read()
        served = GaugeMetricFamily(f"{PREFIX}_num_served_connections", "Connections with a request in progress "
                                   "or idle between two, and websockets that have spoken (what "
                                   "--max-connections bounds).", labels=["model_name"])
        served.add_metric([self.model_name], counts.num_served)
        yield served
        unfinished = GaugeMetricFamily(f"{PREFIX}_num_unfinished_connections", "Connections that have not "
                                       "sent a whole request yet, by phase (what --max-unfinished-connections "
                                       "bounds).", labels=["model_name", "phase"])
        closed = CounterMetricFamily(f"{PREFIX}_unfinished_connections_closed", "Connections closed before "
                                     "they sent a whole request, by phase: past the phase's time bound "
                                     "(reason timeout) or as the oldest when one more came (reason evicted).",
                                     labels=["model_name", "phase", "reason"])
        for phase in UNFINISHED_PHASES:
            unfinished.add_metric([self.model_name, phase.value], counts.unfinished[phase])
            for reason in CloseReason:
                closed.add_metric([self.model_name, phase.value, reason.value], counts.closed[phase, reason])
        yield unfinished
        yield closed


class ServerMetrics:
    """The server's Prometheus registry: engine statistics plus streaming-latency histograms."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._engine_collector = _EngineStatsCollector(model_name)
        self.registry.register(self._engine_collector)
        labels = ["model_name"]
        self.num_connections = Gauge(
            f"{PREFIX}_num_connections", "Open connections, HTTP and websocket, in every phase.", labels,
            registry=self.registry).labels(model_name)
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time from request arrival to its first token.", labels,
            registry=self.registry, buckets=TTFT_BUCKETS).labels(model_name)
        self.inter_token_latency = Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between successive tokens of a request.", labels,
            registry=self.registry, buckets=ITL_BUCKETS).labels(model_name)
        self.e2e_request_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds", "Time from request arrival to its last token.", labels,
            registry=self.registry, buckets=E2E_BUCKETS).labels(model_name)

    def watch_connections(self, read: Callable[[], ConnectionCounts]) -> None:
        """Report the figures `read` returns at every scrape: the open connections and the book's counts."""
        self.num_connections.set_function(lambda: read().num_open)
        self.registry.register(_ConnectionCollector(self.model_name, read))

    def render(self, stats: EngineStats | None) -> bytes:
        """The Prometheus text exposition, with the engine figures of `stats` (None: no engine loaded)."""
        self._engine_collector.stats = stats
        return generate_latest(self.registry)
