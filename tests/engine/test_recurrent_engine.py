"""Recurrent states through the engine, on the toy hybrid model of tests/helpers/recurrent_toy.py (an
attention layer over the paged KV and a recurrent layer whose output depends on the whole prefix through
its state), against its plain-torch reference: greedy tokens alone and batched with prefill chunks that do
not line up with blocks, preemption by recompute and by swap (the states go to the CPU and back),
parallel samples (forks copy the running state: each sample's log-probabilities are the reference's over
its own tokens) and beams, prefix reuse (a request sharing part of a block resumes from the checkpoint
before it and answers as with the cache off; a ten-turn conversation resumes each turn from the previous
prompt's end checkpoint, its last block boundary at least PROMPT_TAIL tokens before its end), the state
flags, speculative decoding (a verify row's states written for its kept tokens only; a draft model with
recurrent layers refused), and the engine idle with every block and slot back after each
run (the integrity check after every step)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.state_group import PROMPT_TAIL
from tests.helpers.engine_checks import StepChecker, run_requests
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.recurrent_toy import STATE, VOCAB, make_toy_model, reference_greedy, reference_logits
from tests.helpers.spec_costs import FixedStepCost

CHECKPOINT = 32  # tokens between checkpoints in these tests: two blocks


@pytest.fixture(scope="module")
def model():
    return make_toy_model(seed=1)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def requests(seed: int, count: int, max_len: int = 70) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    base = [rng.randrange(3, VOCAB) for _ in range(max_len)]
    out = []
    for index in range(count):  # every other prompt shares a prefix of `base`
        length = rng.randint(1, max_len)
        prompt = base[:length] if index % 2 else [rng.randrange(3, VOCAB) for _ in range(length)]
        out.append((prompt, greedy(rng.randint(4, 12))))
    return out


def run(model, reqs, **config):
    """(outputs, engine) of an engine with `config` (every step checked), ending idle and clean; the engine's
    `state_moves` counts the state group's block moves of each kind ("swap_out", "swap_in", "block_copies")."""
    config = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
              "state_checkpoint_tokens": CHECKPOINT, "check_integrity": True} | config
    engine = build_engine(model, None, EngineConfig(**config))
    engine.state_moves = dict.fromkeys(("swap_out", "swap_in", "block_copies"), 0)
    execute = engine.runner.execute

    def counting_execute(step):
        for kind in engine.state_moves:
            engine.state_moves[kind] += sum(group == engine.runner.state_group for *_, group in getattr(step, kind))
        return execute(step)

    engine.runner.execute = counting_execute
    results = run_requests(engine, reqs, check=True)
    assert engine.block_manager.num_used_blocks == 0  # every KV block and state slot back
    return results, engine


class Turns:
    """Requests run to the end turn after turn on one engine, every step checked by one step checker (so it
    knows what the cached blocks of earlier turns hold); the engine idle and clean after each turn."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.checker = StepChecker(engine)

    def run(self, reqs) -> list:
        ids = [self.engine.add_request(prompt, params) for prompt, params in reqs]
        done = {}
        while self.engine.has_unfinished_requests():
            done.update((output.request_id, output) for output in self.engine.step() if output.finished)
            self.checker.after_step()
        assert self.engine.is_idle_and_clean()
        return [done[request_id] for request_id in ids]


def tokens_of(results) -> list[list[int]]:
    return [list(result.outputs[0].token_ids) for result in results]


def test_the_engine_has_a_state_group_of_the_recurrent_layer(model):
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                                    state_checkpoint_tokens=CHECKPOINT, state_cache_slots=5))
    kv_cache = engine.runner.kv_cache
    assert kv_cache.layer_groups == [0, 1] and kv_cache.state_group == 1
    assert kv_cache.states.layers == (1,) and kv_cache.key_stores[1] == {}
    assert engine.block_manager.group_num_blocks[0] == 64
    # The state pool: 4 sequences x 2 slots, ceil(64 / 32) + 1 for a first chunk, and 5 for cached checkpoints.
    assert engine.block_manager.group_num_blocks[1] == kv_cache.states.num_slots == 4 * 2 + 2 + 1 + 5
    assert engine.runner.decode_graphs is None
    # Swap space: the KV's as asked, the states' at most as many slots as their GPU pool.
    swapping = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                                      state_checkpoint_tokens=CHECKPOINT, state_cache_slots=5,
                                                      preemption_mode="swap", num_cpu_blocks=100))
    assert swapping.runner.kv_cache.states.cpu_matrix[1].shape[0] == 16
    assert swapping.block_manager.num_cpu_blocks == 100 + 16


def test_the_facts_show_the_state_pool(model):
    from localserve.engine.facts import read_facts

    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                                                    state_checkpoint_tokens=CHECKPOINT, state_cache_slots=5))
    facts = read_facts(engine)
    kv_cache = engine.runner.kv_cache
    full, state = facts.kv_groups
    assert (full.label, full.num_layers, full.num_blocks, full.slot_bytes) == ("full", 1, 64, 0)
    assert (state.label, state.num_layers, state.num_blocks, state.bytes_per_token) == ("state", 1, 16, 0)
    assert state.slot_bytes == kv_cache.states.slot_bytes == STATE.nbytes(8, 4)  # conv float64, matrices float32
    assert facts.kv_cache_bytes == 64 * 16 * full.bytes_per_token + kv_cache.state_bytes()


def test_greedy_alone_and_batched_in_unaligned_chunks_equals_the_reference(model):
    reqs = requests(seed=0, count=6)
    expected = [reference_greedy(model, prompt, params.max_tokens) for prompt, params in reqs]
    alone = [tokens_of(run(model, [req], max_num_seqs=1)[0])[0] for req in reqs]
    assert alone == expected
    # Chunks of 13 tokens: they start and end inside blocks and across checkpoints.
    batched, engine = run(model, reqs, max_num_batched_tokens=13)
    assert tokens_of(batched) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_output(model, mode):
    rng = random.Random(1)
    reqs = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(10, 40))], greedy(rng.randint(25, 40)))
            for _ in range(6)]
    expected = tokens_of(run(model, reqs, num_kv_blocks=128, max_num_seqs=6)[0])
    results, engine = run(model, reqs, num_kv_blocks=9, num_cpu_blocks=32, max_num_seqs=6,
                          max_num_batched_tokens=24, preemption_mode=mode)
    assert engine.num_preemptions > 0
    if mode == "swap":  # the states went to the CPU and came back
        assert engine.state_moves["swap_out"] > 0 and engine.state_moves["swap_in"] > 0
    assert tokens_of(results) == expected


def test_a_second_request_resumes_from_the_last_checkpoint_and_answers_as_without_the_cache(model):
    rng = random.Random(2)
    first = [rng.randrange(3, VOCAB) for _ in range(75)]
    second = first[:70] + [rng.randrange(3, VOCAB) for _ in range(9)]  # shares 70 tokens: 4 blocks and 6 tokens
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
                                                    state_checkpoint_tokens=CHECKPOINT, check_integrity=True))
    turns = Turns(engine)
    turns.run([(first, greedy(5))])
    [reused] = turns.run([(second, greedy(8))])
    # Checkpoints after 32 and 64 tokens (every 32 tokens; 64 is also the first prompt's end checkpoint, the
    # last boundary 8 tokens before its end): the shared 70 tokens resume from 64.
    assert reused.num_cached_tokens == 64
    without, _ = run(model, [(second, greedy(8))], enable_prefix_caching=False)
    assert without[0].num_cached_tokens == 0
    assert list(reused.outputs[0].token_ids) == tokens_of(without)[0] == reference_greedy(model, second, 8)


def test_a_conversation_turn_resumes_from_the_previous_prompts_end_checkpoint(model):
    rng = random.Random(3)
    turn = [rng.randrange(3, VOCAB) for _ in range(40)]
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
                                                    state_checkpoint_tokens=512, check_integrity=True))
    turns = Turns(engine)
    [answer] = turns.run([(turn, greedy(6))])
    history = turn + list(answer.outputs[0].token_ids) + [rng.randrange(3, VOCAB) for _ in range(5)]
    [next_turn] = turns.run([(history, greedy(6))])
    assert next_turn.num_cached_tokens == 32  # (40 - 8) // 16 * 16: the prompt's end checkpoint, no periodic one
    assert list(next_turn.outputs[0].token_ids) == reference_greedy(model, history, 6)


def test_a_ten_turn_conversation_prefills_each_turn_from_the_last_prompts_end_checkpoint(model):
    rng = random.Random(4)
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
                                                    check_integrity=True))  # default checkpoints: every 512 tokens
    turns = Turns(engine)
    history, previous_prompt = [rng.randrange(3, VOCAB) for _ in range(19)], 0
    for turn in range(10):
        [result] = turns.run([(history, greedy(4))])
        # Every turn resumes from the checkpoint at the previous prompt's last boundary PROMPT_TAIL tokens or
        # more before its end, though it renders that prompt's last 2 tokens anew (as a chat template does).
        assert result.num_cached_tokens == max(0, previous_prompt - PROMPT_TAIL) // 16 * 16, f"turn {turn}"
        assert list(result.outputs[0].token_ids) == reference_greedy(model, history, 4), f"turn {turn}"
        previous_prompt = len(history)
        re_rendered = [3 + (token - 2) % (VOCAB - 3) for token in history[-2:]]  # other tokens than these
        history = history[:-2] + re_rendered + list(result.outputs[0].token_ids) + [
            rng.randrange(3, VOCAB) for _ in range(7)]


def test_parallel_samples_fork_the_state(model):
    prompt = [5 + i % 40 for i in range(37)]
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=10, ignore_eos=True, logprobs=0)
    [result], engine = run(model, [(prompt, params)], max_num_batched_tokens=16)
    assert engine.state_moves["block_copies"] > 0  # the samples' shared running state, copied on write
    assert len(result.outputs) == 3 and len({tuple(out.token_ids) for out in result.outputs}) > 1
    for out in result.outputs:  # each sample's log-probabilities are the reference's over its own tokens
        tokens = prompt + list(out.token_ids)
        expected = torch.log_softmax(reference_logits(model, tokens)[len(prompt) - 1:-1].float(), dim=-1)
        chosen = expected[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=1e-4, rtol=0)


def test_beam_search_runs_and_ends_clean(model):
    prompt = [9 + i % 30 for i in range(21)]
    params = SamplingParams(temperature=0, n=2, beam_search=True, max_tokens=6, ignore_eos=True)
    [result], _ = run(model, [(prompt, params)])
    for out in result.outputs:  # a beam's score is the reference's log-probability of its tokens
        tokens = prompt + list(out.token_ids)
        logprobs = torch.log_softmax(reference_logits(model, tokens)[len(prompt) - 1:-1].float(), dim=-1)
        score = logprobs[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)].sum()
        assert out.cumulative_logprob == pytest.approx(float(score), abs=1e-3)


def speculating(model, expected: list[list[int]], seed: int, guess=None, **config):
    """An engine (as `run` builds) whose drafter drafts the known continuations with planted wrong tokens
    (tests/helpers/oracle_drafter.py), drafting whatever this machine's speed."""
    config = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64, "spec_type": "ngram",
              "spec_tokens": 4, "state_checkpoint_tokens": CHECKPOINT, "check_integrity": True} | config
    engine = build_engine(model, None, EngineConfig(**config))
    engine.scheduler.speculation.drafter = OracleDrafter(expected, VOCAB, seed=seed, guess=guess)
    engine.scheduler.speculation.cost = FixedStepCost()
    return engine


@pytest.mark.parametrize("budget", [64, 13])
def test_verified_drafts_leave_no_trace_in_the_state(model, budget):
    """Speculative decoding over the recurrent layer: each verify row's states are written after its
    verification, for its kept tokens only, so greedy tokens are the reference's with drafts kept whole,
    cut and rejected; and a later request resending a prompt and its speculated reply resumes from a
    checkpoint inside that reply (written by a verification) and still answers as the reference."""
    work = [(prompt, greedy(30)) for prompt, _ in requests(seed=11, count=4)]
    expected = [reference_greedy(model, prompt, 30) for prompt, _ in work]
    engine = speculating(model, [prompt + tokens for (prompt, _), tokens in zip(work, expected)], seed=budget,
                         max_num_batched_tokens=budget, enable_prefix_caching=True)
    turns = Turns(engine)
    assert tokens_of(turns.run(work)) == expected
    totals = engine.scheduler.speculation.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    prompt = max((prompt + tokens for (prompt, _), tokens in zip(work, expected)), key=len)
    [result] = turns.run([(prompt, greedy(8))])
    assert result.num_cached_tokens >= CHECKPOINT * ((len(prompt) - 30) // CHECKPOINT)  # a checkpoint in the reply
    assert tokens_of([result]) == [reference_greedy(model, prompt, 8)]


def test_sampled_verifications_keep_each_samples_own_state(model):
    """Sampling with drafts (the reference's greedy tokens, kept or not by the point-mass rejection rule),
    three samples forked from one prompt: each
    sample's log-probabilities are the reference's over its own tokens, so no rejected token stayed in the
    state of any of them."""
    prompt = [5 + i % 23 for i in range(27)]
    params = SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=24, ignore_eos=True, logprobs=0)
    engine = speculating(model, [], seed=1, max_num_batched_tokens=16,
                         guess=lambda tokens, count: reference_greedy(model, tokens, count))
    [result] = run_requests(engine, [(prompt, params)], check=True)
    totals = engine.scheduler.speculation.totals
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    for out in result.outputs:
        tokens = prompt + list(out.token_ids)
        expected = torch.log_softmax(reference_logits(model, tokens)[len(prompt) - 1:-1].float(), dim=-1)
        chosen = expected[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.logprobs), chosen, atol=1e-4, rtol=0)


def test_a_draft_model_with_recurrent_layers_is_refused(model):
    target = make_toy_model(seed=2, name="plain-target")
    # A target without recurrent layers (its config says so; the check reads only configs, before any pool).
    target.config = dataclasses.replace(target.config, layer_attention=())
    with pytest.raises(ValueError, match=r"recurrent-toy has recurrent \(linear-attention\) layers \[1\]: it "
                                         r"cannot be the draft model \(--spec-type draft / -md\)"):
        build_engine(target, None, EngineConfig(spec_type="draft"), draft_model=model)


def test_state_flags_reach_the_config_and_are_checked():
    from localserve.cli import build_parser, engine_config

    def config(*flags: str) -> EngineConfig:
        return engine_config(build_parser().parse_args(["serve", *flags]))

    default = config()
    assert (default.state_checkpoint_tokens, default.state_cache_slots) == (512, None)
    assert default.num_state_cache_slots == default.max_num_seqs
    given = config("--state-checkpoint-tokens", "64", "--state-cache-slots", "0", "--block-size", "32", "-np", "3")
    assert (given.state_checkpoint_blocks, given.num_state_cache_slots) == (2, 0)
    assert config("-np", "3").num_state_cache_slots == 3
    with pytest.raises(ValueError, match=r"state_checkpoint_tokens \(--state-checkpoint-tokens\) must be a "
                                         "positive multiple of the block size 16, got 40"):
        config("--state-checkpoint-tokens", "40")
    with pytest.raises(ValueError, match="multiple of the block size 16, got 0"):
        EngineConfig(state_checkpoint_tokens=0)
    with pytest.raises(ValueError, match=r"state_cache_slots \(--state-cache-slots\) must be >= 0, got -1"):
        config("--state-cache-slots", "-1")


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=3), budget=st.integers(4, 40),
       checkpoint_blocks=st.integers(1, 3), pressure=st.sampled_from([None, "recompute", "swap"]),
       seed=st.integers(0, 1000))
def test_any_prompts_chunk_budget_and_pressure_give_the_reference(model, lengths, budget, checkpoint_blocks, pressure,
                                                                  seed):
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(60)]
    reqs = [(shared[:length] if index % 2 else [rng.randrange(3, VOCAB) for _ in range(length)], greedy(4))
            for index, length in enumerate(lengths)]
    # Under pressure a pool of 8 blocks holds two of the longest sequences (64 tokens, 4 blocks) at most.
    pool = {"num_kv_blocks": 8, "num_cpu_blocks": 16, "preemption_mode": pressure} if pressure else {}
    results, _ = run(model, reqs, max_num_batched_tokens=budget, max_num_seqs=3,
                     state_checkpoint_tokens=16 * checkpoint_blocks, **pool)
    assert tokens_of(results) == [reference_greedy(model, prompt, 4) for prompt, _ in reqs]


def test_the_monitor_frame_of_a_state_group_is_json(model):
    """The monitor's snapshot frame (json over /v1/monitor) names the state group's pool by its kind: the
    block manager's `RECURRENT` marker is no JSON value."""
    import json

    from localserve.engine.snapshot import read_snapshot

    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=2,
                                                    state_checkpoint_tokens=CHECKPOINT, state_cache_slots=5))
    engine.add_request(list(range(3, 40)), greedy(4))
    engine.step()
    frame = json.loads(json.dumps(read_snapshot(engine).to_json()))
    full, state = frame["gauges"]["kv_groups"]
    assert (full["sliding_window"], state["sliding_window"]) == (None, "state")
    assert state["num_blocks"] == engine.block_manager.group_num_blocks[-1] and state["num_used_blocks"] == 1
