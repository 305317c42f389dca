"""Speculative decoding in what the engine reports: the snapshot's counters, gauges and request entries,
their JSON for the monitor, and the two Prometheus gauges, against the speculation's own totals."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.speculation import Draft
from localserve.server.monitor.metrics import ServerMetrics
from tests.helpers.spec_costs import FixedStepCost

PROMPT = [5, 6, 7, 8, 9]


class HalfRight:
    """Drafts the target's next two tokens, then two wrong ones: 2 of 4 accepted, 3 tokens a verification."""

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth

    def propose(self, queries):
        drafts = []
        for query in queries:
            done = len(query.token_ids) - len(PROMPT)
            drafts.append(Draft((self.truth[done:done + 2] + [1, 1])[:query.max_tokens]))
        return drafts

    def release(self, seq_id):
        pass


def test_the_snapshot_and_the_metrics_show_the_acceptance(tiny64):
    plain = build_engine(tiny64, None, EngineConfig(num_kv_blocks=32))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    request_id = plain.add_request(PROMPT, params)
    truth = list(plain.run_to_completion()[request_id].token_ids)
    engine = build_engine(tiny64, None, EngineConfig(num_kv_blocks=32, spec_type="ngram", spec_tokens=4,
                                                    max_step_ms="auto"))
    speculation = engine.scheduler.speculation
    speculation.drafter, speculation.cost = HalfRight(truth), FixedStepCost(step_s=1.0)
    engine.add_request(PROMPT, params)
    for _ in range(5):  # the prompt, then four verifications of 4 drafted tokens, 2 kept
        engine.step()
    snapshot = engine.snapshot()
    counters, gauges = snapshot.stats.counters, snapshot.stats.gauges
    assert (counters.spec_num_drafts, counters.spec_num_draft_tokens, counters.spec_num_accepted_tokens) == (4, 16, 8)
    assert gauges.spec_acceptance_rate == pytest.approx(0.5) and gauges.spec_mean_accepted_length == pytest.approx(3.0)
    [request] = snapshot.requests
    assert request.num_output_tokens == 1 + 4 * 3
    assert request.spec_acceptance_rate == pytest.approx(0.5) and request.spec_mean_accepted_length == 3.0
    frame = snapshot.to_json()
    assert frame["requests"][0]["spec_acceptance_rate"] == pytest.approx(0.5)
    assert frame["counters"]["spec_num_accepted_tokens"] == 8 and frame["gauges"]["spec_mean_accepted_length"] == 3.0
    assert "step_limit_s" in frame["gauges"]
    metrics = ServerMetrics("tiny")
    text = metrics.render(snapshot.stats).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["localserve_spec_decode_acceptance_rate"].type == "gauge"
    assert families["localserve_spec_decode_acceptance_rate"].samples[0].value == pytest.approx(0.5)
    assert families["localserve_spec_decode_mean_accepted_length"].samples[0].value == pytest.approx(3.0)


def test_without_speculation_the_fields_are_zero(tiny64):
    engine = build_engine(tiny64, None, EngineConfig(num_kv_blocks=32))
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    snapshot = engine.snapshot()
    assert snapshot.stats.gauges.spec_acceptance_rate == 0.0 and snapshot.stats.counters.spec_num_drafts == 0
    assert snapshot.requests[0].spec_mean_accepted_length == 0.0 and snapshot.stats.gauges.step_limit_s == 0.0
