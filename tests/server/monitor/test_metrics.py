"""The Prometheus text of server/monitor/metrics.py on its own, rendered from a fixed EngineStats and parsed with
`prometheus_client`'s own parser: every metric of DESIGN.md section 9 under the `localserve_` prefix with
its `model_name` label and type, the engine's gauges and counters as the stats hold them, the latency
histograms as observed, the connection gauge as the server counts; each server's registry its own."""

from __future__ import annotations

import dataclasses
import math

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localserve.engine.snapshot import Counters, EngineStats, Gauges
from localserve.server.monitor.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, ServerMetrics

MODEL = "tiny-chat"
GAUGES = Gauges(num_requests_running=3, num_requests_waiting=5, num_requests_swapped=2, kv_cache_usage_ratio=0.375,
                num_free_blocks=40, num_cached_blocks=8, num_used_blocks=16, num_free_cpu_blocks=4, last_step_s=0.01,
                last_step_tokens=12)
COUNTERS = Counters(num_steps=100, num_preemptions=7, num_preemptions_recompute=4, num_preemptions_swap=3,
                    num_swap_fallbacks=1, prefix_query_tokens=900, prefix_hit_tokens=250, num_prompt_tokens=650,
                    num_generation_tokens=1234, cow_copies=2, cached_block_evictions=6, num_requests_finished=20,
                    num_requests_failed=1, num_images_encoded=5, num_image_cache_hits=3, image_encode_s=0.75)
STATS = EngineStats(GAUGES, COUNTERS)
# DESIGN.md section 9, by name (the sample names of a counter end in _total), with its Prometheus type
DESIGNED = {"localserve_kv_cache_usage_ratio": "gauge", "localserve_num_requests_running": "gauge",
            "localserve_num_requests_waiting": "gauge", "localserve_num_preemptions_total": "counter",
            "localserve_prefix_cache_queries_total": "counter", "localserve_prefix_cache_hits_total": "counter",
            "localserve_prompt_tokens_total": "counter", "localserve_generation_tokens_total": "counter",
            "localserve_time_to_first_token_seconds": "histogram",
            "localserve_inter_token_latency_seconds": "histogram",
            "localserve_e2e_request_latency_seconds": "histogram"}
TTFT_S, ITL_S, E2E_S = (0.03, 0.3), (0.004, 0.004, 0.05), (0.9,)


def rendered(metrics: ServerMetrics, stats: EngineStats = STATS) -> dict[str, list]:
    """Family name -> (type, samples) of the exposition text."""
    return {family.name: (family.type, family.samples)
            for family in text_string_to_metric_families(metrics.render(stats).decode())}


def observed() -> ServerMetrics:
    metrics = ServerMetrics(MODEL)
    for histogram, values in ((metrics.time_to_first_token, TTFT_S), (metrics.inter_token_latency, ITL_S),
                              (metrics.e2e_request_latency, E2E_S)):
        for value in values:
            histogram.observe(value)
    metrics.num_connections.set_function(lambda: 9)
    return metrics


def values(families: dict[str, list]) -> dict[tuple[str, tuple], float]:
    """(sample name, its labels but model_name) -> value, for every sample."""
    return {(sample.name, tuple(sorted((key, value) for key, value in sample.labels.items() if key != "model_name"))):
            sample.value for _, samples in families.values() for sample in samples}


def test_every_designed_metric_is_there_with_its_type_prefix_and_model_name_label():
    families = rendered(observed())
    sample_names = {sample.name: kind for kind, samples in families.values() for sample in samples}
    for name, kind in DESIGNED.items():
        family = name.removesuffix("_total")
        assert families[family][0] == kind, name
        assert (name + "_count" if kind == "histogram" else name) in sample_names, name
    assert all(name.startswith("localserve_") for name in families)
    for _, samples in families.values():
        for sample in samples:
            assert sample.labels["model_name"] == MODEL
            assert set(sample.labels) - {"model_name"} <= {"le", "mode"}, sample  # low cardinality only


def test_the_engine_gauges_and_counters_are_the_stats():
    found = values(rendered(observed()))
    assert found[("localserve_kv_cache_usage_ratio", ())] == 0.375
    assert found[("localserve_num_requests_running", ())] == 3
    assert found[("localserve_num_requests_waiting", ())] == 5 + 2  # preempted by swap wait too
    assert found[("localserve_num_preemptions_total", (("mode", "recompute"),))] == 4
    assert found[("localserve_num_preemptions_total", (("mode", "swap"),))] == 3
    assert found[("localserve_prefix_cache_queries_total", ())] == 900
    assert found[("localserve_prefix_cache_hits_total", ())] == 250
    assert found[("localserve_prompt_tokens_total", ())] == 650
    assert found[("localserve_generation_tokens_total", ())] == 1234
    assert found[("localserve_num_connections", ())] == 9
    assert found[("localserve_images_encoded_total", ())] == 5
    assert found[("localserve_image_cache_hits_total", ())] == 3
    assert found[("localserve_image_encode_seconds_total", ())] == 0.75


@pytest.mark.parametrize("name, buckets, observations", [
    ("localserve_time_to_first_token_seconds", TTFT_BUCKETS, TTFT_S),
    ("localserve_inter_token_latency_seconds", ITL_BUCKETS, ITL_S),
    ("localserve_e2e_request_latency_seconds", E2E_BUCKETS, E2E_S),
])
def test_each_histogram_holds_what_was_observed(name, buckets, observations):
    found = values(rendered(observed()))
    bounds = [*buckets, math.inf]
    counts = {bound: found[(f"{name}_bucket", (("le", prometheus_client.utils.floatToGoString(bound)),))]
              for bound in bounds}
    assert counts == {bound: sum(1 for value in observations if value <= bound) for bound in bounds}
    assert found[(f"{name}_count", ())] == len(observations)
    assert found[(f"{name}_sum", ())] == pytest.approx(sum(observations))


def test_each_scrape_renders_the_stats_it_is_given():
    metrics = ServerMetrics(MODEL)
    assert values(rendered(metrics))[("localserve_generation_tokens_total", ())] == 1234
    later = EngineStats(GAUGES, dataclasses.replace(COUNTERS, num_generation_tokens=1300))
    assert values(rendered(metrics, later))[("localserve_generation_tokens_total", ())] == 1300


def test_each_server_has_its_own_registry():
    first, second = ServerMetrics("one"), ServerMetrics("two")  # a second server registers nothing twice
    first.time_to_first_token.observe(0.5)
    assert values(rendered(second))[("localserve_time_to_first_token_seconds_count", ())] == 0
    assert values(rendered(first))[("localserve_time_to_first_token_seconds_count", ())] == 1
    assert b"localserve_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)
