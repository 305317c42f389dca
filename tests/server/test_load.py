"""The server under heavy load over loopback (tiny model), in both preemption modes: 256 clients at once
(a quarter stream chat completions over HTTP keep-alive, the others are websocket clients), multi-turn
conversations with previous_response_id, lanes, random sampling, 10% cancelling and 10% disconnecting
mid-stream, a KV pool small enough to preempt. It must end with no
lost response, greedy answers equal to the same requests sent alone, the block manager's books
balanced with every block free or cached, no open connection, and (recompute: a first round, then
two more) a flat RSS.

CI-sized: a sample of the greedy answers replayed, one round in swap mode; scripts/load_test.py runs the
full version and prints the figures of docs/BENCHMARKS.md ("Reliability").
"""

from __future__ import annotations

import asyncio
import gc
import random
import time
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from localserve.engine.config import EngineConfig
from localserve.llm import LLM
from tests.helpers.load import LoadConfig, replay_alone, run_load
from tests.helpers.server import running_server, wait_until_idle

NUM_KV_BLOCKS = 12  # 192 tokens for 32 slots: every round preempts (7-11 times in trial runs, either mode)
LOAD = LoadConfig(num_clients=256, min_turns=2, max_turns=3, min_output_tokens=4, max_output_tokens=32)
NUM_REPLAYED = 64  # greedy answers sent again alone, per mode


def rss_kib() -> int:
    """The process's resident memory once garbage is collected (the engine collects the old generation
    rarely on purpose: uncollected garbage is not a leak)."""
    gc.collect()
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        for family in text_string_to_metric_families(response.read().decode()):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
    raise AssertionError(f"no {name} in /metrics")


def wait_for_no_connections(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(port, "localserve_num_connections") > 1:  # the scrape's own HTTP connection counts
        assert time.monotonic() < deadline, "connections still open after the load"
        time.sleep(0.1)


@pytest.mark.parametrize("mode, rounds", [("recompute", 1 + 2), ("swap", 1)])
def test_256_clients_lose_nothing_and_leave_nothing_behind(tiny_chat_model_dir, mode, rounds):
    llm = LLM(str(tiny_chat_model_dir), device="cpu", engine_config=EngineConfig(
        num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=32, max_num_batched_tokens=256, preemption_mode=mode,
        max_model_len=512))
    with running_server(llm, max_connections=LOAD.num_clients) as server:
        engine_thread = server.server.models.serving_now().engine
        rss, greedy = [], []
        for round_index in range(rounds):
            report = asyncio.run(run_load(server.port, LoadConfig(**{**LOAD.__dict__, "seed": round_index})))
            outcomes = report.outcomes()
            assert not report.lost, report.lost[:3]
            assert set(outcomes) <= {"completed", "incomplete", "cancelled", "abandoned"}, outcomes
            assert outcomes["cancelled"] >= LOAD.num_clients // 20 and outcomes["abandoned"] >= LOAD.num_clients // 20
            wait_until_idle(engine_thread)  # check_integrity(), and every block free or cached
            wait_for_no_connections(server.port)
            rss.append(rss_kib())
            greedy += [turn for turn in report.turns if turn.greedy and turn.outcome in ("completed", "incomplete")]
            over_http = Counter(turn.outcome for turn in report.turns if turn.lane == "http")
            assert over_http["completed"] + over_http["incomplete"] >= 20 and over_http["abandoned"] >= 5, over_http
        counters = engine_thread.call(lambda engine: engine.stats().counters).result(30)
        mismatches = asyncio.run(replay_alone(server.port, random.Random(0).sample(greedy, NUM_REPLAYED)))
    assert not mismatches, [(turn.text, alone) for turn, alone in mismatches[:3]]
    assert getattr(counters, f"num_preemptions_{mode}") > 0, counters
    # the first round fills what is bounded but starts empty (the event log, stored conversations, the
    # allocator's arenas); after it, memory stays flat
    measured = rss[1:]
    assert not measured or max(measured) <= 1.05 * min(measured), rss
