"""The state pool through the builder, on the toy hybrid model of tests/helpers/recurrent_toy.py: without a
given max_num_seqs, a state pool that would take more than half the KV budget runs fewer sequences (one log
line); a given one that does not fit is refused naming the shortfall and what to lower; and a pool of the
rule's slots, with no cache slots, still runs max_num_seqs sequences at once and gives the reference's
tokens (fewer slots than a sequence's whole need cost concurrency only).
"""

from __future__ import annotations

import logging
import random

import pytest

from localserve.cli import build_parser, engine_config
from localserve.engine.builder import build_engine
from localserve.engine.config import DEFAULT_MAX_NUM_SEQS, EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.group_plan import state_pool_slots
from tests.helpers.engine_checks import StepChecker
from tests.helpers.recurrent_toy import STATE, VOCAB, make_toy_model, reference_greedy

SLOT = STATE.nbytes(8, 4)  # the toy's one recurrent layer: conv inputs in float64, matrices in float32
# 64-token steps and a checkpoint every 32 tokens: n sequences' pool is 2n + 2 + 1 slots and n cache slots.
SETTINGS = {"max_num_batched_tokens": 64, "state_checkpoint_tokens": 32}


@pytest.fixture(scope="module")
def model():
    return make_toy_model(seed=1)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_the_config_knows_a_given_max_num_seqs_from_the_default():
    default = EngineConfig()
    assert (default.max_num_seqs, default.max_num_seqs_given) == (DEFAULT_MAX_NUM_SEQS, False)
    assert EngineConfig(max_num_seqs=16).max_num_seqs_given
    parse = build_parser().parse_args
    assert not engine_config(parse(["serve"])).max_num_seqs_given
    assert engine_config(parse(["serve", "-np", "16"])).max_num_seqs_given


def test_the_default_runs_fewer_sequences_where_the_state_pool_would_take_over_half_the_budget(model, caplog):
    budget = 2 * SLOT * (3 * 4 + 3)  # half: 4 sequences' pool of 15 slots exactly
    with caplog.at_level(logging.INFO, logger="localserve.engine.builder"):
        engine = build_engine(model, None, EngineConfig(kv_cache_memory_bytes=budget, **SETTINGS))
    assert engine.scheduler.config.max_num_seqs == 4
    assert engine.block_manager.group_num_blocks[1] == state_pool_slots(16, 4, 4096, 64, 2, 4) == 15
    [line] = [record.getMessage() for record in caplog.records if "lowered" in record.getMessage()]
    assert line.startswith("recurrent-toy: a recurrent state takes ") and "16 sequences' state pool (51 slots" in line
    assert "-np lowered to 4 (15 slots" in line
    # One slot less than half: 3 sequences.
    engine = build_engine(model, None, EngineConfig(kv_cache_memory_bytes=budget - 2, **SETTINGS))
    assert engine.scheduler.config.max_num_seqs == 3


def test_a_given_max_num_seqs_stays_or_is_refused_naming_the_shortfall(model, caplog):
    budget = 2 * SLOT * (3 * 4 + 3)  # 5 given: 18 slots, over half of it but within it, beside a KV block
    with caplog.at_level(logging.INFO, logger="localserve.engine.builder"):
        engine = build_engine(model, None, EngineConfig(kv_cache_memory_bytes=budget, max_num_seqs=5, **SETTINGS))
    assert engine.scheduler.config.max_num_seqs == 5 and not any("lowered" in r.getMessage() for r in caplog.records)
    shortfall = (16 * 2 + 3 + 16) * SLOT - budget
    with pytest.raises(ValueError, match=rf"51 slots .*16 sequences.*: {shortfall:,} bytes .* lower -np"):
        build_engine(model, None, EngineConfig(kv_cache_memory_bytes=budget, max_num_seqs=16, **SETTINGS))


def test_without_a_budget_the_default_stays(model):
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, **SETTINGS))
    assert engine.scheduler.config.max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_the_rules_pool_without_cache_slots_runs_max_num_seqs_at_once_and_gives_the_reference(model):
    rng = random.Random(5)
    shared = [rng.randrange(3, VOCAB) for _ in range(70)]
    lengths = [rng.randint(20, 70) for _ in range(10)]
    reqs = [(shared[:length] if index % 2 else [rng.randrange(3, VOCAB) for _ in range(length)],
             greedy(rng.randint(10, 20))) for index, length in enumerate(lengths)]
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=128, max_num_seqs=4, state_cache_slots=0,
                                                    check_integrity=True, **SETTINGS))
    assert engine.block_manager.group_num_blocks[1] == 4 * 2 + 2 + 1  # no slot for cached checkpoints
    checker = StepChecker(engine)  # also: a request that fits never waits
    ids = [engine.add_request(prompt, params) for prompt, params in reqs]
    done, most_running = {}, 0
    while engine.has_unfinished_requests():
        done.update((output.request_id, output) for output in engine.step() if output.finished)
        checker.after_step()
        most_running = max(most_running, len(engine.scheduler.queues.running))
    assert engine.is_idle_and_clean() and most_running == 4
    assert [list(done[i].outputs[0].token_ids) for i in ids] == [reference_greedy(model, p, s.max_tokens)
                                                                  for p, s in reqs]
