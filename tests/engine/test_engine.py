"""The engine: continuous batching, chunked prefill, prefix caching and preemption change nothing a
greedy request produces; budgets, sharing and clean-up hold."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.sequence import Request, Sequence


def make_engine(model, num_blocks=512, max_num_seqs=64, budget=256, chunked=True, prefix=True,
                mode="recompute", check_integrity=True) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=num_blocks, enable_prefix_caching=prefix, check_integrity=check_integrity,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                          preemption_mode=mode)
    return build_engine(model, None, config)


def mixed_workload(num_requests=64, seed=0, max_output=40):
    """Prompts of 3-80 tokens (a third share a 40-token prefix) and outputs of 1-`max_output` tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(40)]
    work = []
    for i in range(num_requests):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 41))]
        if i % 3 == 0:
            prompt = shared + prompt
        work.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, max_output + 1),
                                                    ignore_eos=True)))
    return work


def run_all(engine: LLMEngine, work) -> list[list[int]]:
    ids = [engine.add_request(prompt, params) for prompt, params in work]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[i].token_ids for i in ids]


@pytest.fixture(scope="module")
def expected_alone(tiny64):
    """Each request of a workload run alone: expected_alone(max_output) -> token ids per request."""
    cache: dict[int, list[list[int]]] = {}

    def outputs(max_output: int) -> list[list[int]]:
        if max_output not in cache:
            engine = make_engine(tiny64, prefix=False, check_integrity=False)  # the reference: kept quick
            cache[max_output] = [run_all(engine, [item])[0] for item in mixed_workload(max_output=max_output)]
        return cache[max_output]

    return outputs


@pytest.mark.parametrize("chunked, prefix, num_blocks, mode", [
    (True, True, 512, "recompute"),
    (False, True, 512, "recompute"),
    (True, False, 512, "recompute"),
    (False, False, 512, "recompute"),
    (True, True, 12, "recompute"),
    (True, True, 12, "swap"),
    (False, False, 12, "swap"),
])
def test_64_concurrent_greedy_requests_equal_running_alone(tiny64, expected_alone, chunked, prefix,
                                                           num_blocks, mode):
    # Under pressure the outputs are longer, so that running requests outgrow the pool.
    max_output = 40 if num_blocks > 100 else 90
    engine = make_engine(tiny64, num_blocks=num_blocks, budget=96, chunked=chunked, prefix=prefix, mode=mode)
    outputs = run_all(engine, mixed_workload(max_output=max_output))
    assert outputs == expected_alone(max_output)
    if num_blocks < 100:  # the pool holds a fraction of the work: preemption must have happened
        assert engine.num_preemptions >= 10
        # No thrashing: a request is preempted again only after it generated something since.
        last_seen: dict[str, int] = {}
        for request_id, num_output_tokens in engine.scheduler.preemption.recent:
            assert num_output_tokens > last_seen.get(request_id, -1)
            last_seen[request_id] = num_output_tokens
    # Really batched (under pressure the small pool itself limits the batch).
    assert max(r.num_seqs for r in engine.step_history) > (8 if num_blocks > 100 else 2)


def test_every_step_within_budget_while_a_long_prompt_prefills_in_chunks(tiny64):
    engine = make_engine(tiny64, budget=32, max_num_seqs=16)
    for i in range(8):
        engine.add_request([5 + i] * 10, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(12):  # the decodes are under way
        engine.step()
    long_id = engine.add_request(list(range(3, 253)) + list(range(3, 53)), SamplingParams(temperature=0, max_tokens=2))
    first = len(engine.step_history)
    final = engine.run_to_completion()
    steps = list(engine.step_history)[first:]
    assert all(step.num_tokens <= 32 for step in engine.step_history)
    chunked_steps = [s for s in steps if s.num_prefill_tokens > 0]
    assert len(chunked_steps) >= 300 // 32  # the 300-token prompt was split across steps...
    assert all(s.num_seqs - 1 >= 8 for s in chunked_steps[:-1])  # ...each also carrying the 8 decodes
    assert final[long_id].finished and engine.is_idle_and_clean()


def test_a_lone_long_prompt_prefills_in_chunks_without_logits_in_between(tiny64):
    engine = make_engine(tiny64, budget=64, max_num_seqs=8)
    prompt = list(range(3, 203))  # 200 tokens: 4 steps with no token to sample, then the first token
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3))
    final = engine.run_to_completion()[request_id]
    assert [s.num_tokens for s in list(engine.step_history)[:4]] == [64, 64, 64, 8]
    assert len(final.token_ids) == 3 and engine.is_idle_and_clean()


def test_second_request_with_same_system_prompt_prefills_only_its_tail(tiny64):
    engine = make_engine(tiny64, budget=1024)
    system = [random.Random(1).randrange(3, 256) for _ in range(500)]
    run_all(engine, [(system + [7, 8, 9] * 7, SamplingParams(temperature=0, max_tokens=4))])
    before = engine.num_prompt_tokens
    second = system + [11, 12] * 15
    request_id = engine.add_request(second, SamplingParams(temperature=0, max_tokens=4))
    final = engine.run_to_completion()
    cached = 500 // 16 * 16  # 31 full blocks of the system prompt
    assert final[request_id].num_cached_tokens == cached
    assert engine.num_prompt_tokens - before == len(second) - cached
    assert engine.is_idle_and_clean()


def peak_used_blocks(engine: LLMEngine) -> int:
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.block_manager.num_used_blocks)
    return peak


def test_parallel_sampling_shares_prompt_blocks(tiny64):
    prompt = list(range(3, 43))  # 40 tokens: 2 full blocks + 8 tokens
    params = SamplingParams(temperature=1.0, max_tokens=20, n=4, seed=3, ignore_eos=True)
    shared = make_engine(tiny64, prefix=False)
    request_id = shared.add_request(prompt, params)
    shared_peak = 0
    while shared.has_unfinished_requests():
        outputs = shared.step()
        shared_peak = max(shared_peak, shared.block_manager.num_used_blocks)
    # Every sample comes back with its cumulative log-probability.
    assert len(outputs[0].outputs) == 4
    for sample in outputs[0].outputs:
        assert len(sample.token_ids) == 20 and len(sample.logprobs) == 20
        assert sample.cumulative_logprob == pytest.approx(sum(sample.logprobs)) and sample.cumulative_logprob < 0
    independent = make_engine(tiny64, prefix=False)
    for i in range(4):
        independent.add_request(prompt, SamplingParams(temperature=1.0, max_tokens=20, seed=3 + i, ignore_eos=True))
    independent_peak = peak_used_blocks(independent)
    # Forked samples share the 2 full prompt blocks and copy only the partly filled third.
    assert shared_peak == independent_peak - 2 * 3 == 4 * 4 - 6
    assert shared.is_idle_and_clean() and independent.is_idle_and_clean()
    assert shared.block_manager.cow_copies == 3 and request_id


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny64):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_tokens=16, seed=42, ignore_eos=True)
    alone = make_engine(tiny64)
    expected = run_all(alone, [([4, 5, 6], params)])[0]
    crowd = make_engine(tiny64)
    work = [([4, 5, 6], params)] + [([9, i + 3], SamplingParams(temperature=1.0, max_tokens=16)) for i in range(10)]
    assert run_all(crowd, work)[0] == expected


def reference_beam_search(model, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """Beam search by recomputing every sequence from scratch with plain torch (no cache, no sharing)."""
    from localserve.attention.torch_backend import TorchAttentionBackend
    from localserve.engine.model_runner import ModelRunner
    from localserve.kv.cache import PagedKVCache

    config = model.config
    runner = ModelRunner(model, PagedKVCache(config.num_layers, 16, 16, config.num_kv_heads, config.head_dim,
                                             torch.float64), TorchAttentionBackend())
    beams = [([], 0.0)]
    for _ in range(steps):
        candidates = []
        for tokens, score in beams:
            logits = runner.prompt_logits(prompt + tokens, list(range(16)))[-1]
            logprobs = torch.log_softmax(logits.double(), -1)
            values, ids = logprobs.topk(2 * width)
            candidates += [(tokens + [t], score + v) for v, t in zip(values.tolist(), ids.tolist())]
        candidates.sort(key=lambda c: -c[1])
        beams = candidates[:width]
    return beams


def test_beam_search_equals_plain_torch_reference(tiny64):
    prompt = [17, 23, 99, 4, 150]
    engine = make_engine(tiny64)
    request_id = engine.add_request(prompt, SamplingParams(n=4, beam_search=True, max_tokens=6, ignore_eos=True))
    beams_shared_root = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        tables = [engine.block_manager.block_table(s.seq_id) for s in engine.requests[request_id].live_seqs] \
            if request_id in engine.requests else []
        if len(tables) == 4 and len({t[0] for t in tables}) == 1:
            beams_shared_root = True
    final = outputs[0]
    expected = reference_beam_search(tiny64, prompt, 4, 6)
    assert [o.token_ids for o in final.outputs] == [tokens for tokens, _ in expected]
    for output, (_, score) in zip(final.outputs, expected):
        assert output.cumulative_logprob == pytest.approx(score, abs=1e-9)
    assert beams_shared_root and engine.is_idle_and_clean()


def test_beam_search_preempted_by_recompute_still_equals_the_reference(tiny64):
    prompt = [17, 23, 99, 4, 150, 8, 61]
    # Older greedy requests fill a small pool, so the beam request (newest) is preempted, and its four
    # beams are prefilled again under a small budget: they finish their re-prefill in different steps.
    engine = make_engine(tiny64, num_blocks=16, budget=24, max_num_seqs=8)
    for i in range(3):
        engine.add_request([30 + i] * 20, SamplingParams(temperature=0, max_tokens=90, ignore_eos=True))
    request_id = engine.add_request(prompt, SamplingParams(n=4, beam_search=True, max_tokens=30, ignore_eos=True))
    final = engine.run_to_completion()[request_id]
    assert request_id in {rid for rid, _ in engine.scheduler.preemption.recent}
    expected = reference_beam_search(tiny64, prompt, 4, 30)
    assert [o.token_ids for o in final.outputs] == [tokens for tokens, _ in expected]
    assert engine.is_idle_and_clean()


def test_requests_that_can_never_fit_are_refused_before_taking_blocks(tiny64):
    engine = make_engine(tiny64, num_blocks=8)
    free_before = engine.block_manager.num_free_blocks
    with pytest.raises(ValueError, match="context length of 2048"):
        engine.add_request([5] * 2000, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="needs 13 blocks, the pool has 8"):
        engine.add_request(list(range(3, 103)), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 9999], SamplingParams(max_tokens=1))
    assert engine.block_manager.num_free_blocks == free_before and not engine.has_unfinished_requests()


def test_abort_returns_blocks_at_once(tiny64):
    engine = make_engine(tiny64)
    keep = engine.add_request([5, 6, 7] * 20, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    drop = engine.add_request([8, 9] * 40, SamplingParams(temperature=0, max_tokens=30, n=3, ignore_eos=True))
    for _ in range(5):
        engine.step()
    used = engine.block_manager.num_used_blocks
    engine.abort_request(drop)
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_used_blocks < used
    final = engine.run_to_completion()
    assert len(final[keep].token_ids) == 30 and engine.is_idle_and_clean()


def test_finished_requests_leave_no_reference_cycle(tiny64):
    """A finished request's objects go when its last reference does: none waits for the cyclic collector,
    which meets long-lived objects only in the rare full collections."""
    engine = make_engine(tiny64, num_blocks=10, budget=32, max_num_seqs=8)  # small: preemptions too
    gc.collect()
    gc.disable()
    try:
        for i in range(3):
            engine.add_request([5 + i] * 21, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        engine.add_request([8, 9] * 9, SamplingParams(temperature=1.0, max_tokens=20, n=3, seed=1, ignore_eos=True))
        engine.add_request([17, 23, 99, 4], SamplingParams(n=3, beam_search=True, max_tokens=8, ignore_eos=True))
        engine.run_to_completion()
        assert engine.num_preemptions > 0 and engine.is_idle_and_clean()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        in_cycles = [type(obj).__name__ for obj in gc.garbage if isinstance(obj, (Request, Sequence))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not in_cycles
