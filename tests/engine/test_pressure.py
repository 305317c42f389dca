"""The engine in small pools with several samples per request: what used to go wrong, one test each.

Every run here is bounded in steps and checked step by step (tests/helpers/engine_checks.py), and its
outputs are compared with each request run alone in a roomy pool.
"""

from __future__ import annotations

import logging

import pytest

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.events import EventKind
from localserve.engine.sampling_params import SamplingParams
from tests.helpers.engine_checks import StepChecker


def make_engine(model, num_blocks: int, **config) -> LLMEngine:
    config = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "check_integrity": True} | config
    return build_engine(model, None, EngineConfig(num_kv_blocks=num_blocks, **config))


def run_bounded(engine: LLMEngine, max_steps: int) -> dict:
    """Step, checking each step, until every request is done; fails if that takes over max_steps."""
    checker = StepChecker(engine)
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            assert engine.is_idle_and_clean()
            return final
        final.update((o.request_id, o) for o in engine.step() if o.finished)
        checker.after_step()
    raise AssertionError(f"requests still unfinished after {max_steps} steps: {list(engine.requests)}")


def alone(model, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    engine = make_engine(model, 64, enable_prefix_caching=False, check_integrity=False)
    request_id = engine.add_request(prompt, params)
    return [o.token_ids for o in engine.run_to_completion()[request_id].outputs]


OLDER = (list(range(3, 23)), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))


@pytest.mark.parametrize("kind, prefix, mode", [
    ("samples", False, "recompute"),
    ("samples", True, "recompute"),
    ("beams", False, "recompute"),
    ("samples", True, "swap"),  # a 2-block swap pool: falls back to recompute
])
def test_a_preempted_request_with_four_samples_comes_back(tiny64, kind, prefix, mode):
    # Alone, the four samples peak at 9 of the 10 blocks (the prompt's full block shared, 2 blocks
    # each of their own); with the older request running too, they are preempted at 33 tokens each.
    # They used to be planned at 4 x 3 = 12 blocks and never readmitted, the engine stepping empty.
    engine = make_engine(tiny64, 10, enable_prefix_caching=prefix, preemption_mode=mode, num_cpu_blocks=2)
    params = SamplingParams(n=4, max_tokens=20, ignore_eos=True, seed=1, temperature=1.0,
                            beam_search=kind == "beams")
    prompt = list(range(100, 120))
    engine.add_request(*OLDER)
    request_id = engine.add_request(prompt, params)
    final = run_bounded(engine, 200)
    assert request_id in {rid for rid, _ in engine.scheduler.preemption.recent}
    assert [o.token_ids for o in final[request_id].outputs] == alone(tiny64, prompt, params)
    if mode == "swap":
        assert engine.scheduler.preemption.num_swap_fallbacks >= 1


def test_max_num_seqs_counts_the_samples_of_a_request(tiny64):
    # Four requests of n=4 with four slots: one request at a time (they used to run 16 sequences).
    engine = make_engine(tiny64, 64, max_num_seqs=4)
    params = SamplingParams(n=4, max_tokens=6, ignore_eos=True, temperature=0)
    ids = [engine.add_request([5 + i] * 5, params) for i in range(4)]
    final = run_bounded(engine, 100)  # the checker holds every step to max_num_seqs
    assert max(record.num_seqs for record in engine.step_history) == 4
    assert all(len(final[i].outputs) == 4 for i in ids)


def test_admission_leaves_room_for_the_copies_after_a_fork(tiny64):
    # Four samples of an 8-token prompt share its block until they fork; then three of them copy it.
    # The second request used to be admitted into the blocks those copies need, prefilled, and at
    # once preempted; now it waits until the samples are done.
    engine = make_engine(tiny64, 5)
    samples = ([3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(n=4, max_tokens=8, ignore_eos=True, temperature=0))
    second = (list(range(40, 60)), SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    ids = [engine.add_request(*samples), engine.add_request(*second)]
    final = run_bounded(engine, 100)
    assert engine.num_preemptions == 0
    for request_id, (prompt, params) in zip(ids, (samples, second)):
        assert [o.token_ids for o in final[request_id].outputs] == alone(tiny64, prompt, params)


def test_the_fit_check_counts_exactly_the_tokens_written(tiny64):
    # 20 + 13 tokens, but the 13th output is never written: 32 tokens, exactly the 2-block pool.
    engine = make_engine(tiny64, 2)
    prompt, params = list(range(3, 23)), SamplingParams(max_tokens=13, ignore_eos=True, temperature=0)
    request_id = engine.add_request(prompt, params)
    final = run_bounded(engine, 30)
    assert [o.token_ids for o in final[request_id].outputs] == alone(tiny64, prompt, params)
    assert len(final[request_id].token_ids) == 13


def test_samples_that_can_never_fit_together_are_refused_at_once_with_a_reason(tiny64):
    # One sample of 4 + 60 tokens fits the 6 blocks; four need 4 x 4 = 16 (the prompt fills no block).
    engine = make_engine(tiny64, 6)
    with pytest.raises(ValueError, match=r"for n=4 needs 16 blocks, the pool has 6"):
        engine.add_request([5] * 4, SamplingParams(n=4, max_tokens=60, ignore_eos=True))
    assert not engine.has_unfinished_requests() and engine.is_idle_and_clean()
    events, _ = engine.events.since(0)
    assert [event.kind for event in events] == [EventKind.REJECTED]


def test_a_full_swap_pool_falls_back_to_recompute_and_says_so(tiny64, caplog):
    # Three requests start with 2 of the 10 blocks each and grow to 4: one is preempted, its 3 or 4
    # blocks do not fit the 1-block swap pool.
    engine = make_engine(tiny64, 10, preemption_mode="swap", num_cpu_blocks=1)
    work = [(list(range(3 + i, 23 + i)), SamplingParams(temperature=0, max_tokens=44, ignore_eos=True))
            for i in range(3)]
    ids = [engine.add_request(*item) for item in work]
    with caplog.at_level(logging.WARNING, logger="localserve.engine.scheduler"):
        final = run_bounded(engine, 300)
    fallbacks = engine.scheduler.preemption.num_swap_fallbacks
    assert fallbacks >= 1
    assert sum("swap pool full" in record.getMessage() for record in caplog.records) == fallbacks
    counters = engine.stats().counters
    assert counters.num_swap_fallbacks == fallbacks and counters.num_preemptions_recompute >= fallbacks
    events, _ = engine.events.since(0)
    preempted = [event.details for event in events if event.kind is EventKind.PREEMPTED]
    assert sum(details["fallback"] for details in preempted) == fallbacks
    assert all(details["mode"] == "recompute" for details in preempted if details["fallback"])
    for request_id, (prompt, params) in zip(ids, work):
        assert final[request_id].token_ids == alone(tiny64, prompt, params)[0]
