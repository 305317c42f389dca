"""The block manager's state group (recurrent layers): fixed examples of each rule of kv/state_group.py at
its bound and one past it, and of the step rule of kv/state_steps.py on the tables the manager makes.

Blocks of 4 tokens throughout; group 0 is a full-attention group of 40 blocks, group 1 the state group.
The examples put a prompt's end checkpoint at its last boundary (`PROMPT_TAIL` 0:
tests/helpers/state_managers.py), which keeps them a few blocks long; where the tail puts it is
tests/kv/test_state_checkpoint_policy.py's. A verify row's cases: tests/kv/test_state_group_verify.py.
"""

from __future__ import annotations

import pytest

from localserve.kv.block_manager import BlockManager
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.layer_groups import RECURRENT, group_label, group_layers
from localserve.kv.out_of_blocks import OutOfBlocksError
from localserve.kv.state_group import CheckpointPolicy
from localserve.kv.state_steps import step_state_slots
from tests.helpers.state_managers import (  # noqa: F401 (an autouse fixture)
    STATE,
    _,
    decoding,
    manager,
    no_prompt_tail,
    run_step,
    state_table,
)


def state_cells(bm: BlockManager) -> str:
    """The state pool's blocks in the snapshot ('.' free, 'c' cached, 'u' used, 's' shared)."""
    return bm.snapshot().block_states[40:]


# ---- the groups and the policy ----
def test_group_layers_puts_the_state_group_last():
    groups = group_layers([RECURRENT, None, 8, RECURRENT, None])
    assert [(g.sliding_window, g.layers, g.recurrent) for g in groups] == [
        (None, (1, 4), False), (8, (2,), False), (None, (0, 3), True)]
    assert [g.label for g in groups] == ["full", "window 8", "state"]
    assert [g.group_window for g in groups] == [None, 8, RECURRENT]
    assert group_label(RECURRENT) == "state"


def test_the_state_group_must_come_last_and_checkpoint_at_least_every_block():
    with pytest.raises(ValueError, match="state group .* must be the last"):
        BlockManager([4, 4], 4, group_windows=(RECURRENT, None))
    with pytest.raises(ValueError, match="state_checkpoint_blocks must be >= 1, got 0"):
        BlockManager([4, 4], 4, group_windows=(None, RECURRENT), state_checkpoint_blocks=0)


def test_policy_checkpoints_every_kth_boundary_and_at_the_prompts_last_boundary():
    policy = CheckpointPolicy(block_size=4, checkpoint_blocks=3, checkpoints=True)
    # Prompt of 22 tokens: its last boundary is after 20 tokens, entry 4.
    assert [index for index in range(10) if policy.is_checkpoint(index, 22)] == [2, 4, 5, 8]
    # A prompt of 23 tokens has the same last boundary; one of 24 has the next one (entry 5, already periodic).
    assert [index for index in range(10) if policy.is_checkpoint(index, 23)] == [2, 4, 5, 8]
    assert [index for index in range(10) if policy.is_checkpoint(index, 24)] == [2, 5, 8]
    assert not any(CheckpointPolicy(4, 3, checkpoints=False).is_checkpoint(index, 22) for index in range(10))


# ---- admission, steps, checkpoints ----
def test_a_prompt_takes_a_slot_per_checkpoint_and_one_for_its_final_state():
    bm = manager()
    assert bm.group_blocks_to_allocate(list(range(22))) == [6, 3]
    assert bm.allocate(1, list(range(22))) == 0
    assert state_table(bm, 1) == [_, _, 0, _, 1, 2]
    # One step over the whole prompt: both checkpoints inside it, the final state last.
    assert run_step(bm, 1, 22) == (-1, [(12, 0), (20, 1), (22, 2)])
    assert state_table(bm, 1) == [_, _, _, _, _, 2]
    assert state_cells(bm) == "ccu" + "." * 9  # the checkpoints stay cached, the running state is used


def test_without_prefix_caching_a_prompt_keeps_no_checkpoint():
    bm = manager(caching=False)
    bm.allocate(1, list(range(22)))
    assert state_table(bm, 1) == [_, _, _, _, _, 0]
    assert run_step(bm, 1, 22) == (-1, [(22, 0)])
    assert state_cells(bm) == "u" + "." * 11


def test_a_step_cut_short_leaves_its_state_in_the_last_entry_until_mark_computed_places_it():
    bm = manager(chunk=8)
    bm.allocate(1, list(range(22)))
    assert state_table(bm, 1) == [_, 0] and bm.num_slotted_tokens(1) == 8
    assert run_step(bm, 1, 3) == (-1, [(3, 0)])  # ends in block 0, writes entry 1's slot
    # Its slot is the running state (held once, unregistered, entry 0 no checkpoint): it moves on to the end
    # of the next chunk, where entry 2 is a checkpoint.
    assert state_table(bm, 1) == [_, _, 0] and bm.num_slotted_tokens(1) == 12
    assert run_step(bm, 1, 9) == (0, [(9, 0)])  # read and written in place
    # Entry 2 is a checkpoint: registered, it stays; the next chunk's final state gets a new slot.
    assert state_table(bm, 1) == [_, _, 0, _, 1] and state_cells(bm) == "uu" + "." * 10
    assert run_step(bm, 1, 8) == (0, [(8, 1)])
    assert state_table(bm, 1) == [_, _, _, _, 1, 2] and state_cells(bm) == "cuu" + "." * 9
    assert run_step(bm, 1, 2) == (1, [(2, 2)])
    assert state_table(bm, 1) == [_, _, _, _, _, 2] and state_cells(bm) == "cc" + "u" + "." * 9


@pytest.mark.parametrize("num_new, reads, saves", [
    (1, 0, [(1, 1)]),  # ends before the checkpoint's boundary (8 tokens)
    (2, 0, [(2, 1)]),  # ends on it: the final state is the checkpoint
    (3, 0, [(2, 0), (3, 1)]),  # one past: the checkpoint is saved inside the step, into the slot it read
])
def test_a_running_slot_at_a_checkpoint_entry_receives_the_checkpoint(num_new, reads, saves):
    bm = manager(chunk=8, checkpoint_blocks=2)
    bm.allocate(1, list(range(20)))
    run_step(bm, 1, 6)  # 6 tokens: the running state sits at entry 1, a checkpoint, partly filled
    assert state_table(bm, 1) == [_, 0, _, 1]
    assert run_step(bm, 1, num_new) == (reads, saves)


def test_saves_are_never_in_a_shared_or_registered_slot():
    bm = manager(chunk=8, checkpoint_blocks=2)
    bm.allocate(1, list(range(20)))
    for num_new in (6, 5, 7, 2):
        table = bm.live_block_table(1, STATE)
        num_computed = bm.num_computed_tokens(1)
        bm.make_slots(1)
        saves = step_state_slots(bm.live_block_table(1, STATE), num_computed, num_new, 4)[1]
        assert all(bm.ref_count(slot, STATE) == 1 for after, slot in saves), table
        bm.mark_computed(1, num_computed + num_new)
        bm.check_integrity()


# ---- prefix hits ----
@pytest.mark.parametrize("checkpoint_blocks, num_shared, num_hit", [
    (1, 15, 12),  # shares part of block 3: resumes from the boundary before it
    (1, 16, 16),  # shares all of it
    (2, 15, 8),  # entry 2 is no checkpoint: rounds down to entry 1
    (2, 16, 16),
    (3, 15, 12),  # entry 2: a checkpoint every 3 blocks
    (3, 16, 16),  # entry 3: the first prompt's last boundary
])
def test_hits_round_down_to_the_last_cached_checkpoint(checkpoint_blocks, num_shared, num_hit):
    bm = manager(checkpoint_blocks=checkpoint_blocks)
    prompt = list(range(17))  # its last boundary, entry 3, is a checkpoint whatever the spacing
    bm.allocate(1, prompt)
    run_step(bm, 1, 17)
    bm.free(1)
    other = prompt[:num_shared] + [99] * (17 - num_shared)
    assert bm.allocate(2, other) == num_hit
    table = state_table(bm, 2)
    running = num_hit // 4 - 1
    assert table[:running] == [_] * running and bm.books().pools[STATE].block_hashes[table[running]] is not None
    assert run_step(bm, 2, 17 - num_hit)[0] == table[running]  # the first step reads the checkpoint
    bm.check_integrity()


def test_a_hit_on_full_blocks_without_a_cached_state_is_refused():
    bm = manager(caching=True, checkpoint_blocks=4)
    bm.allocate(1, list(range(9)))  # last boundary after 8 tokens: entry 1
    run_step(bm, 1, 9)
    bm.free(1)
    # 21 tokens sharing two full blocks, which the full group has, and entry 1's checkpoint: 8.
    assert bm.allocate(2, list(range(12)) + [99] * 9) == 8
    run_step(bm, 2, 13)  # checkpoints at entries 3 and 4 (its last boundary), none at 2
    bm.free(2)
    # The third block has KV in the full group's cache but no state: the hit stays at 8.
    assert bm.allocate(3, list(range(12)) + [77]) == 8


def test_evicted_checkpoints_no_longer_hit():
    bm = manager(num_slots=4, checkpoint_blocks=1)
    prompt = list(range(9))  # checkpoints at entries 0 and 1, then its running state
    bm.allocate(1, prompt)
    run_step(bm, 1, 9)
    bm.free(1)
    assert state_cells(bm) == "cc.." and bm.free_queue_block_ids(STATE) == [3, 0, 1, 2]
    # A 13-token prompt of other tokens takes entries 0..2's checkpoints and a final slot: 4 slots from the
    # free queue's head, evicting both checkpoints on the way.
    bm.allocate(2, [50 + index for index in range(13)])
    assert state_cells(bm) == "uuuu" and bm.cached_block_evictions == 2
    bm.free(2)
    assert bm.allocate(3, prompt) == 0


# ---- the running slot: moved or new ----
def test_the_running_slot_moves_when_held_once_unregistered_and_no_checkpoint():
    bm = decoding(checkpoint_blocks=4, num_tokens=13)  # computed 13: partly filled block 3
    bm.append_token(1, 0)
    run_step(bm, 1, 1)
    bm.append_token(1, 0)
    run_step(bm, 1, 1)
    bm.append_token(1, 0)  # 16 computed: entry 3 is a policy checkpoint (every 4 blocks), registered
    run_step(bm, 1, 1)
    used = bm.group_usage()[STATE].num_used_blocks
    bm.append_token(1, 0)
    run_step(bm, 1, 1)  # 17 tokens: the running state in block 4
    assert bm.group_usage()[STATE].num_used_blocks == used  # the checkpoint left the table, cached
    for _step in range(3):
        bm.append_token(1, 0)
        run_step(bm, 1, 1)
    table = state_table(bm, 1)  # 20 computed: entry 4, no checkpoint
    available = bm.group_available_blocks[STATE]
    assert bm.num_blocks_to_append([1]) == 1  # the full group's new block; the state group moves its slot
    bm.append_token(1, 0)
    assert state_table(bm, 1) == [_] * 5 + [table[4]] and bm.group_available_blocks[STATE] == available


def test_a_checkpoint_or_shared_running_slot_stays_and_the_step_writes_a_new_one():
    bm = decoding(checkpoint_blocks=2, num_tokens=16)  # entry 3: a registered checkpoint
    table = state_table(bm, 1)
    available = bm.group_available_blocks[STATE]
    bm.append_token(1, 0)
    new_table = state_table(bm, 1)
    assert new_table[3] == table[3] and new_table[4] != NO_BLOCK and len(new_table) == 5
    assert bm.group_available_blocks[STATE] == available - 1
    # A shared running slot stays too, for each sequence holding it.
    bm = decoding(checkpoint_blocks=4, num_tokens=12, caching=False)  # entry 2: no checkpoint at all
    bm.fork(1, 2)
    available = bm.group_available_blocks[STATE]
    bm.append_token(1, 0)
    bm.append_token(2, 0)
    assert bm.group_available_blocks[STATE] == available - 2
    assert state_table(bm, 1)[2] == state_table(bm, 2)[2] and bm.ref_count(state_table(bm, 1)[2], STATE) == 2
    # Without prefix caching the same slot of a sequence alone moves.
    bm = decoding(checkpoint_blocks=2, num_tokens=16, caching=False)
    available = bm.group_available_blocks[STATE]
    bm.append_token(1, 0)
    assert state_table(bm, 1)[3] == NO_BLOCK and bm.group_available_blocks[STATE] == available


# ---- fork, swap ----
def test_fork_copies_a_shared_partly_filled_running_slot_on_write():
    bm = decoding(checkpoint_blocks=3, num_tokens=6)
    bm.fork(1, 2)
    running = state_table(bm, 1)[1]
    assert state_table(bm, 2) == [_, running] and bm.ref_count(running, STATE) == 2
    assert bm.num_blocks_to_append([1, 2]) == 1  # one copy per group; the second writer is then alone
    moves = bm.append_token(1, 7)
    copy = state_table(bm, 1)[1]
    assert (running, copy, STATE) in moves and copy != running
    assert bm.append_token(2, 8) == [] and state_table(bm, 2) == [_, running]
    assert run_step(bm, 1, 1) == (copy, [(1, copy)]) and run_step(bm, 2, 1) == (running, [(1, running)])


def test_swap_out_and_in_moves_every_slot_and_keeps_the_layout():
    bm = manager(chunk=8, checkpoint_blocks=2)
    bm.allocate(1, list(range(20)))
    run_step(bm, 1, 6)
    bm.make_slots(1)
    table = state_table(bm, 1)
    assert table == [_, 0, _, 1]
    moves = bm.swap_out([1])
    assert sorted((gpu, group) for gpu, cpu, group in moves if group == STATE) == [(0, STATE), (1, STATE)]
    assert state_cells(bm) == "." * 12
    back = bm.swap_in([1])
    assert len([move for move in back if move[2] == STATE]) == 2
    new_table = state_table(bm, 1)
    assert [slot == NO_BLOCK for slot in new_table] == [slot == NO_BLOCK for slot in table]
    bm.check_integrity()
    assert run_step(bm, 1, 8) == (new_table[1], [(2, new_table[1]), (8, new_table[3])])


def test_swap_in_registers_a_policy_checkpoint_again():
    bm = decoding(checkpoint_blocks=2, num_tokens=8, num_slots=4)  # entry 1: registered
    bm.swap_out([1])
    assert state_cells(bm) == "c..."
    bm.allocate(2, [60 + index for index in range(28)])  # 4 slots: every one, evicting the checkpoint
    assert bm.cached_block_evictions == 1
    bm.free(2)
    bm.swap_in([1])
    running = state_table(bm, 1)[1]
    assert bm.books().pools[STATE].block_hashes[running] is not None
    bm.check_integrity()


# ---- what is refused, what runs out ----
def test_sharing_uncomputed_blocks_is_refused():
    bm = decoding(checkpoint_blocks=2, num_tokens=5)
    bm.append_token(1, 3)
    assert not bm.shares_uncomputed_blocks
    with pytest.raises(ValueError, match="state group shares no uncomputed blocks"):
        bm.allocate_sharing(2, list(range(9)), 1, 1)


@pytest.mark.parametrize("num_slots", [2, 3])
def test_an_allocation_short_of_slots_raises_and_changes_nothing(num_slots):
    bm = manager(num_slots=num_slots)
    prompt = list(range(22))  # two checkpoints and a final slot: 3
    assert bm.group_blocks_to_allocate(prompt) == [6, 3]
    if num_slots == 3:
        bm.allocate(1, prompt)
        assert state_cells(bm) == "uuu"
        return
    before = bm.snapshot()
    assert not bm.can_allocate(prompt)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(1, prompt)
    assert bm.snapshot() == before and bm.group_usage()[0].num_used_blocks == 0


def test_an_append_short_of_slots_raises_and_changes_nothing():
    bm = manager(num_slots=2, checkpoint_blocks=2)
    bm.allocate(1, list(range(8)))  # entry 1: a checkpoint and the final slot at once
    run_step(bm, 1, 8)
    bm.allocate(2, [9])
    before = bm.snapshot()
    assert not bm.can_append([1])
    with pytest.raises(OutOfBlocksError):
        bm.append_token(1, 0)
    assert bm.snapshot() == before and bm.num_tokens(1) == 8
    bm.free(2)
    bm.append_token(1, 0)  # one slot free: enough
    bm.check_integrity()


def test_a_chunk_short_of_slots_is_slotted_as_far_as_the_pool_allows():
    bm = manager(num_slots=3, chunk=8, checkpoint_blocks=1)
    bm.allocate(1, list(range(30)))  # entry 0's checkpoint and the final slot: 2 of 3
    bm.allocate(2, list(range(100, 103)))  # the last
    run_step(bm, 1, 8)
    # The next chunk wants entry 2's checkpoint and a final slot; one is free (entry 0's cached checkpoint):
    # slots for one block, evicting it.
    assert state_table(bm, 1) == [_, 1, 0] and bm.num_slotted_tokens(1) == 12
    assert bm.cached_block_evictions == 1
    bm.free(2)
    assert bm.make_slots(1) == 16
    bm.check_integrity()


@pytest.mark.parametrize("num_slots, fits", [(4, False), (5, True)])
def test_can_ever_hold_counts_the_first_chunks_slots(num_slots, fits):
    bm = manager(num_slots=num_slots, checkpoint_blocks=1, chunk=20)
    # First chunk of 20 tokens: checkpoints at entries 0..3, the final state at entry 4.
    assert bm.can_ever_hold(40, 10) == fits


@pytest.mark.parametrize("bad_table, problem", [
    (lambda t: [t[2], _, _], "real entries before entry 2"),  # a slot before the running state
    (lambda t: [_, _, _], "no slot for the running state"),  # a GPU sequence with computed tokens has its slot
    (lambda t: [_, _, t[2], 5, _], "no slot for the running state"),  # no slot for the final state
    (lambda t: [_, _, t[2], 5, 6], "entry 3 holds a slot and is not a policy checkpoint"),
    (lambda t: [_, _, t[2], _, t[2]], "repeats a slot"),
])
def test_integrity_names_a_bad_state_table(bad_table, problem):
    bm = BlockManager([12], 4, 0, True, (RECURRENT,), None, 3)  # a model of recurrent layers only
    bm.allocate(1, list(range(20)))
    bm.mark_computed(1, 9)  # table [_, _, running, _, final]
    seq = bm._seqs[1]
    seq.block_tables[0] = bad_table(seq.block_tables[0])
    with pytest.raises(AssertionError, match=f"state.*{problem}"):
        bm.check_integrity()


def test_slots_past_the_running_state_must_be_the_sequences_own():
    bm = manager(chunk=8, checkpoint_blocks=2)
    bm.allocate(1, list(range(20)))
    run_step(bm, 1, 6)
    assert state_table(bm, 1) == [_, 0, _, 1]
    bm._pools[STATE].ref_counts[1] += 1  # as if another table held the slot the step's final state goes to
    with pytest.raises(AssertionError, match=r"state.*slots past the running state \[1\] are shared or registered"):
        bm.check_integrity()


def test_the_state_pool_shows_in_the_usage_and_the_snapshot():
    bm = decoding(checkpoint_blocks=3, num_tokens=9)
    usage = bm.group_usage()[STATE]
    assert (usage.label, usage.num_blocks, usage.num_used_blocks, usage.num_cached_blocks) == ("state", 12, 1, 1)
    assert bm.snapshot().group_num_blocks == (40, 12)
    assert bm.state_group == STATE and BlockManager(4).state_group is None


# ---- the step rule ----
def test_step_state_slots_rule():
    # Read the running slot at entry r, write the checkpoints inside the step and the final state last.
    assert step_state_slots([_, 5, _, 6, 7], 7, 11, 4) == (5, [(1, 5), (9, 6), (11, 7)])
    # Moved: entry r is empty, the running slot is the last entry.
    assert step_state_slots([_, _, 3], 7, 2, 4) == (3, [(2, 3)])
    # Cut short: the final state still goes to the last entry.
    assert step_state_slots([_, _, 3, _, 4], 7, 2, 4) == (4, [(2, 4)])
    with pytest.raises(ValueError, match="has no slot for the running state"):
        step_state_slots([_, 3, _], 5, 2, 4)
    with pytest.raises(ValueError, match="has no slot for the running state"):
        step_state_slots([_, 3], 5, 4, 4)
    with pytest.raises(ValueError, match="at least one token"):
        step_state_slots([3], 0, 0, 4)
