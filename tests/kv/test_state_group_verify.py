"""The block manager's state group under speculative decoding: a verify row's states are written for its kept
tokens only (kv/state_steps.py, `kept_state_slots`), then `truncate` moves the final state's slot back to the
last kept entry (kv/state_group.py, `cut`) and `mark_computed` registers what the kept tokens completed. Fixed
examples of each case (tests/kv/test_block_manager_stateful.py generates them), on the managers of
tests/helpers/state_managers.py."""

from __future__ import annotations

import pytest

from localserve.kv.block_manager import BlockManager
from localserve.kv.state_steps import kept_state_slots, step_state_slots
from tests.helpers.state_managers import STATE, _, decoding, no_prompt_tail, state_table  # noqa: F401 (autouse)


def verify_step(bm: BlockManager, seq_id: int, num_drafted: int, num_accepted: int) -> tuple[list, list, list]:
    """A verify row as the engine runs it: its last real token and `num_drafted` drafted ones appended, the
    step's writes cut to the kept tokens (`kept_state_slots`), truncate, mark_computed. Returns the state
    table before the truncation, the kept writes and the table after."""
    start = bm.num_computed_tokens(seq_id)
    for _token in range(num_drafted + 1):
        bm.append_token(seq_id, 0)
    table = state_table(bm, seq_id)
    read, saves = step_state_slots(table, start, num_drafted + 1, 4)
    writes = kept_state_slots(saves, 1 + num_accepted)
    bm.truncate(seq_id, start + 1 + num_accepted)
    bm.mark_computed(seq_id, start + 1 + num_accepted)
    bm.check_integrity()
    return table, writes, state_table(bm, seq_id)


def test_a_verify_row_inside_its_block_updates_the_running_slot_in_place():
    bm = decoding(checkpoint_blocks=4, num_tokens=9, caching=False)  # 9 computed: tokens 9-11 stay in block 2
    running = state_table(bm, 1)[2]
    table, writes, after = verify_step(bm, 1, num_drafted=2, num_accepted=1)
    assert table == after == [_, _, running] and writes == [(2, running)]


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3, 4])
def test_a_moved_running_slot_goes_back_to_the_last_kept_entry(num_accepted):
    """Without prefix caching the running slot moves ahead to the draft's last block; the state of the kept
    tokens is written into it and it comes back to their last block, the slots between released."""
    bm = decoding(checkpoint_blocks=2, num_tokens=14, caching=False)  # tokens 14-18: blocks 3 and 4
    running = state_table(bm, 1)[3]
    available = bm.group_available_blocks[STATE]
    table, writes, after = verify_step(bm, 1, num_drafted=4, num_accepted=num_accepted)
    assert table == [_, _, _, _, running] and writes == [(1 + num_accepted, running)]
    kept_blocks = -(-(15 + num_accepted) // 4)
    assert after == [_] * (kept_blocks - 1) + [running]
    assert bm.group_available_blocks[STATE] == available


def test_a_registered_running_slot_stays_cached_and_the_kept_state_takes_a_new_slot():
    """The running slot is a registered checkpoint (16 tokens, every 2 blocks): the verify row's final
    state has a slot of its own; keeping 2 tokens puts it at their block, the checkpoint leaves the table
    cached, and the unwritten slot of the rest is released."""
    bm = decoding(checkpoint_blocks=2, num_tokens=16)
    checkpoint = state_table(bm, 1)[3]
    table, writes, after = verify_step(bm, 1, num_drafted=4, num_accepted=1)  # tokens 16-20: blocks 4, 5
    final = table[-1]
    assert table == [_, _, _, checkpoint, _, final] and writes == [(2, final)]
    assert after == [_, _, _, _, final]
    assert bm.books().pools[STATE].block_hashes[checkpoint] is not None and bm.ref_count(checkpoint, STATE) == 0


def test_kept_tokens_ending_on_a_checkpoint_boundary_register_the_final_state_there():
    """14 computed, the running slot at entry 3 (a policy checkpoint, not yet full): a 7-token verify row
    would write the checkpoint at 16 into it; keeping exactly 2 tokens ends on that boundary, so the final
    state's slot is the checkpoint, registered under block 3's key, and the old running slot is released."""
    bm = decoding(checkpoint_blocks=2, num_tokens=14)
    running = state_table(bm, 1)[3]
    table, writes, after = verify_step(bm, 1, num_drafted=6, num_accepted=1)
    final = table[-1]
    assert table == [_, _, _, running, _, final] and writes == [(2, final)]
    assert after == [_, _, _, final] and bm.books().pools[STATE].block_hashes[final] is not None
    assert bm.ref_count(running, STATE) == 0
    # Accepting one more keeps the checkpoint written inside the step and the final state past it.
    bm = decoding(checkpoint_blocks=2, num_tokens=14)
    table, writes, after = verify_step(bm, 1, num_drafted=6, num_accepted=2)
    assert writes == [(2, table[3]), (3, table[-1])] and after == [_, _, _, _, table[-1]]
    assert bm.books().pools[STATE].block_hashes[table[3]] is not None  # the checkpoint at 16, cached


def test_kept_state_slots_keep_checkpoints_inside_the_kept_tokens_only():
    saves = [(2, 7), (6, 8), (9, 3)]
    assert kept_state_slots(saves, 9) == saves
    assert kept_state_slots(saves, 7) == [(2, 7), (6, 8), (7, 3)]
    assert kept_state_slots(saves, 6) == [(2, 7), (6, 3)]  # the boundary itself: the final slot holds it
    assert kept_state_slots(saves, 1) == [(1, 3)]
    for wrong in (0, 10):
        with pytest.raises(ValueError, match=f"a step of 9 tokens keeps 1 to 9 of them, got {wrong}"):
            kept_state_slots(saves, wrong)
