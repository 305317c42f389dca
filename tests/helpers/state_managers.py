"""Block managers with a state group, as the fixed examples of tests/kv/ build them: blocks of 4 tokens, group
0 a full-attention group of 40 blocks, group 1 the state group; one sequence prefilled and stepped as the model
runner steps it. The prompt's end checkpoint sits at its last boundary (`no_prompt_tail`, an autouse fixture
for the modules that import it), which keeps the examples a few blocks long."""

from __future__ import annotations

import pytest

from localserve.kv import state_group
from localserve.kv.block_manager import BlockManager
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.layer_groups import RECURRENT
from localserve.kv.state_steps import step_state_slots

STATE = 1
_ = NO_BLOCK


@pytest.fixture(autouse=True)
def no_prompt_tail(monkeypatch):
    """The prompt's end checkpoint at its last boundary: these examples' tables stay short."""
    monkeypatch.setattr(state_group, "PROMPT_TAIL", 0)


def manager(num_slots: int = 12, checkpoint_blocks: int = 3, chunk: int | None = None, caching: bool = True,
            num_cpu_blocks: int = 8) -> BlockManager:
    return BlockManager([40, num_slots], 4, num_cpu_blocks, caching, (None, RECURRENT), chunk, checkpoint_blocks)


def state_table(bm: BlockManager, seq_id: int) -> list[int]:
    return bm.block_table(seq_id, STATE)


def run_step(bm: BlockManager, seq_id: int, num_new: int) -> tuple[int, list[tuple[int, int]]]:
    """One step of `num_new` tokens as the runner makes it: slots, the step's reads and writes, mark_computed."""
    start = bm.num_computed_tokens(seq_id)
    assert start + num_new <= bm.make_slots(seq_id)
    slots = step_state_slots(bm.live_block_table(seq_id, STATE), start, num_new, 4)
    bm.mark_computed(seq_id, start + num_new)
    bm.check_integrity()
    return slots


def decoding(checkpoint_blocks: int, num_tokens: int, caching: bool = True, num_slots: int = 12) -> BlockManager:
    """A manager whose sequence 1 has its prompt of `num_tokens` computed."""
    bm = manager(num_slots=num_slots, checkpoint_blocks=checkpoint_blocks, caching=caching)
    bm.allocate(1, list(range(num_tokens)))
    run_step(bm, 1, num_tokens)
    return bm
