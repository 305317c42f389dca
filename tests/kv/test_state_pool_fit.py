"""The state pool on a 24 GB card (kv/group_plan.py): the pool rule's slots, `fit_state_sequences` at its bounds,
and Qwen3.6-35B-A3B / Qwen3.6-27B (their released config.json files) with Q4-sized weights: 16 sequences'
state pool does not fit beside them, so the default runs fewer; 16 given is refused naming the shortfall.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.registry import config_from_hf

from localserve.kv.formats import KVFormatSpec
from localserve.kv.group_plan import (
    STATE_POOL_SHARE,
    fit_state_sequences,
    plan_group_pools,
    state_pool_slots,
    state_slot_bytes,
)
from localserve.kv.memory_plan import kv_budget_bytes

MIB, GIB = 2 ** 20, 2 ** 30
FP16 = KVFormatSpec.parse("fp16")
HELPERS = Path(__file__).parents[1] / "helpers"
# The defaults: 16-token blocks, 512-token chunks, a checkpoint every 32 blocks, Qwen3.6's 262,144-token context.
BLOCK, CHUNK, EVERY, CONTEXT = 16, 512, 32, 262_144


def qwen3_6(name: str):
    return config_from_hf(json.loads((HELPERS / f"{name}_config.json").read_text()))


def test_the_rule_gives_a_running_state_and_a_decodes_headroom_per_sequence_and_one_first_chunk():
    assert state_pool_slots(BLOCK, 16, CONTEXT, CHUNK, EVERY, 16) == 16 * 2 + 1 + 1 + 16 == 50
    assert state_pool_slots(BLOCK, 1, CONTEXT, CHUNK, EVERY, 0) == 2 + 1 + 1  # one sequence's chunk: 4, as before
    assert state_pool_slots(BLOCK, 16, CONTEXT, CHUNK + 1, EVERY, 0) == 16 * 2 + 2 + 1


@pytest.mark.parametrize("over, expected", [(0, 5), (1, 4)])
def test_the_fit_keeps_the_most_sequences_whose_pool_takes_at_most_the_share(over, expected):
    slot = 1000
    budget = 2 * (5 * 2 + 2 + 5) * slot - 2 * over  # 5 sequences' pool, 17 slots, exactly half of it (or 1 over)
    assert fit_state_sequences(slot, budget, BLOCK, 16, CONTEXT, CHUNK, EVERY, None) == expected
    assert fit_state_sequences(slot, budget, BLOCK, 3, CONTEXT, CHUNK, EVERY, None) == 3  # never more than asked
    # Given cache slots stay as given: even one sequence with 20 of them takes 2 + 2 + 20 = 24 slots > 17.
    assert fit_state_sequences(slot, budget, BLOCK, 16, CONTEXT, CHUNK, EVERY, 20) == 1
    assert fit_state_sequences(slot, 0, BLOCK, 16, CONTEXT, CHUNK, EVERY, None) == 1  # at least one


@pytest.mark.parametrize("bad", [dict(slot_bytes=0), dict(kv_budget=-1), dict(share=0), dict(share=1.5),
                                 dict(max_num_seqs=0)])
def test_the_fit_refuses_bad_input_naming_it(bad):
    args = dict(slot_bytes=1000, kv_budget=10 ** 6, block_size=BLOCK, max_num_seqs=16, max_model_len=CONTEXT,
                chunk_tokens=CHUNK, checkpoint_blocks=EVERY, cache_slots=None) | bad
    with pytest.raises(ValueError, match="need slot bytes > 0, a budget >= 0, a share in"):
        fit_state_sequences(**args)


@settings(max_examples=50, deadline=None)
@given(slot=st.integers(1, 10 ** 6), budget=st.integers(0, 10 ** 8), max_num_seqs=st.integers(1, 64),
       chunk=st.sampled_from([None, 64, 512, 2048]), cache=st.sampled_from([None, 0, 3]))
def test_the_fit_is_the_largest_that_fits(slot, budget, max_num_seqs, chunk, cache):
    fitted = fit_state_sequences(slot, budget, BLOCK, max_num_seqs, 4096, chunk, 4, cache)

    def pool(num_seqs: int) -> int:
        return slot * state_pool_slots(BLOCK, num_seqs, 4096, chunk, 4, num_seqs if cache is None else cache)

    assert 1 <= fitted <= max_num_seqs
    assert fitted == 1 or pool(fitted) <= budget * STATE_POOL_SHARE
    assert fitted == max_num_seqs or pool(fitted + 1) > budget * STATE_POOL_SHARE


# Q4-sized weights on a 24 GiB card at the default 0.9 utilization: 2.04 GiB left for 35B-A3B, 6.23 GiB for 27B.
@pytest.mark.parametrize("name, weights, slot_mib, budget_gib, default_gib, fitted, fitted_slots, fitted_gib", [
    ("qwen3_6_35b_a3b", 21.0e9, 61.4, 2.04, 3.00, 5, 17, 1.02),
    ("qwen3_6_27b", 16.5e9, 146.8, 6.23, 7.17, 6, 20, 2.87),
])
def test_a_24_gb_card_runs_fewer_sequences_by_default_and_refuses_16_given(name, weights, slot_mib, budget_gib,
                                                                          default_gib, fitted, fitted_slots,
                                                                          fitted_gib):
    config = qwen3_6(name)
    slot = state_slot_bytes(config, tuple(config.recurrent_layers), 2)  # bf16 convolution inputs
    budget = kv_budget_bytes(24 * GIB, int(weights), 0.9)
    assert (round(slot / MIB, 1), round(budget / GIB, 2)) == (slot_mib, budget_gib)
    default_slots = state_pool_slots(BLOCK, 16, CONTEXT, CHUNK, EVERY, 16)
    assert (default_slots, round(default_slots * slot / GIB, 2)) == (50, default_gib)  # more than half the budget
    assert fit_state_sequences(slot, budget, BLOCK, 16, CONTEXT, CHUNK, EVERY, None) == fitted
    full, state = plan_group_pools(config, FP16, FP16, budget, BLOCK, fitted, CONTEXT, CHUNK, EVERY, fitted, 2)
    assert (state.num_blocks, round(state.pool_bytes(BLOCK) / GIB, 2)) == (fitted_slots, fitted_gib)
    assert state.pool_bytes(BLOCK) <= budget / 2 and full.num_blocks * BLOCK > 50_000  # the rest: KV for 50K+ tokens
    with pytest.raises(ValueError, match=r"50 slots .*16 sequences.* more than the KV budget .* lower -np"):
        plan_group_pools(config, FP16, FP16, budget, BLOCK, 16, CONTEXT, CHUNK, EVERY, 16, 2)
