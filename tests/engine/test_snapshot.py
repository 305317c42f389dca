"""The engine's snapshot shows what each request really holds: GPU block tables while it runs, CPU block
tables while it is swapped out, nothing (no blocks, no computed tokens) after a preemption by recompute."""

from __future__ import annotations

import pytest

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.snapshot import RequestSnapshot

PROMPT_LEN = 20


def preempting_engine(model, mode: str) -> tuple[LLMEngine, str]:
    """An older greedy request (4 blocks at its peak) and a newer one of two samples (7 blocks) in a
    10-block pool: the newer is preempted once both have grown. Returns the engine and the newer's id."""
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=10, num_cpu_blocks=10, preemption_mode=mode,
                                                    max_num_seqs=8, max_num_batched_tokens=64, check_integrity=True))
    engine.add_request(list(range(3, 3 + PROMPT_LEN)), SamplingParams(temperature=0, max_tokens=44, ignore_eos=True))
    newer = engine.add_request(list(range(50, 50 + PROMPT_LEN)),
                               SamplingParams(n=2, seed=1, temperature=1.0, max_tokens=44, ignore_eos=True))
    return engine, newer


def entry(engine: LLMEngine, request_id: str) -> RequestSnapshot:
    label = engine.requests[request_id].label
    return next(r for r in engine.snapshot().requests if r.label == label)


def check_entries_match_the_block_manager(engine: LLMEngine) -> None:
    """Every request's entry holds exactly the tables the block manager has for it, in the right pool."""
    bm, queues = engine.block_manager, engine.scheduler.queues
    by_label = {r.label: r for r in engine.snapshot().requests}
    for queue, gpu, cpu in ((queues.running, True, False), (queues.swapped, False, True),
                            (queues.waiting, False, False)):
        for request in queue:
            tables = [bm.block_table(seq.seq_id) for seq in request.live_seqs] if gpu or cpu else []
            snapshot = by_label[request.label]
            assert snapshot.block_tables == (tables if gpu else []), request.label
            assert snapshot.cpu_block_tables == (tables if cpu else []), request.label
            if not gpu and not cpu:  # waiting: nothing computed, whatever it computed before
                assert snapshot.num_computed_prompt_tokens == 0, request.label


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_requests_entry_shows_what_it_holds(tiny64, mode):
    engine, newer = preempting_engine(tiny64, mode)
    request = engine.requests[newer]
    while request.num_preemptions == 0:
        engine.step()
        check_entries_match_the_block_manager(engine)
    preempted = entry(engine, newer)
    if mode == "recompute":
        assert preempted.state == "preempted"
        assert preempted.num_computed_prompt_tokens == 0
        assert preempted.block_tables == [] and preempted.cpu_block_tables == []
    else:
        assert preempted.state == "swapped"
        assert preempted.num_computed_prompt_tokens == PROMPT_LEN  # its KV is in the CPU pool
        assert preempted.block_tables == []
        cpu_tables = [engine.block_manager.block_table(seq.seq_id) for seq in request.live_seqs]
        assert preempted.cpu_block_tables == cpu_tables and len(cpu_tables) == 2
        assert engine.snapshot().cpu_blocks.startswith("w")
    while engine.has_unfinished_requests():  # and it stays true through its return
        engine.step()
        check_entries_match_the_block_manager(engine)
    assert engine.is_idle_and_clean()
