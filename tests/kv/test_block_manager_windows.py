"""Layer groups in the block manager, fixed examples: a window group gives back the blocks leaving the
window (bounded memory, still cached), a prefix hit is one every group accepts, and the integrity check
holds the window bound and names one past it."""

from __future__ import annotations

import pytest

from localserve.kv.block_manager import BlockManager
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.layer_groups import group_layers, max_blocks_in_window, num_blocks_out_of_window, window_start

FULL, WINDOW = 0, 1


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def decode(manager: BlockManager, seq_id: int, num_tokens: int) -> None:
    """Compute what is pending, then append and compute one token at a time, checking after each."""
    manager.mark_computed(seq_id, manager.num_tokens(seq_id))
    for _ in range(num_tokens):
        manager.append_token(seq_id, 7)
        manager.check_integrity()
        manager.mark_computed(seq_id, manager.num_tokens(seq_id))
        manager.check_integrity()


def test_group_layers_puts_the_full_layers_first_and_each_window_in_its_own_group():
    groups = group_layers([128, None, 128, None, 1024])
    assert [(g.sliding_window, g.layers, g.label) for g in groups] == [
        (None, (1, 3), "full"), (128, (0, 2), "window 128"), (1024, (4,), "window 1024")]
    assert [g.sliding_window for g in group_layers([16, 16])] == [16]
    with pytest.raises(ValueError, match="layer 1: sliding window must be >= 1, got 0"):
        group_layers([None, 0])


def test_window_arithmetic_follows_the_query_that_sees_its_last_w_keys():
    # A query at position p sees keys p - W + 1 .. p (transformers' sliding-window mask).
    assert window_start(16, 16) == 1 and window_start(15, 16) == 0 and window_start(40, None) == 0
    assert num_blocks_out_of_window(32, 16, 16) == 1  # keys 17..32: block 0 (0..15) is out
    assert num_blocks_out_of_window(31, 16, 16) == 1  # keys 16..31
    assert num_blocks_out_of_window(30, 16, 16) == 0  # keys 15..30: block 0 holds key 15
    assert max_blocks_in_window(16, 16) == 2 and max_blocks_in_window(128, 16) == 9


def test_a_window_group_holds_at_most_its_window_while_decoding_and_the_full_group_everything():
    manager = BlockManager([64, 8], block_size=4, group_windows=(None, 8))
    manager.allocate(1, prompt(5))
    decode(manager, 1, 100)
    num_blocks = -(-105 // 4)
    assert len(manager.block_table(1, FULL)) == num_blocks and NO_BLOCK not in manager.block_table(1, FULL)
    window_table = manager.block_table(1, WINDOW)
    held = [block_id for block_id in window_table if block_id != NO_BLOCK]
    assert len(window_table) == num_blocks
    assert len(held) <= max_blocks_in_window(8, 4) == 3
    assert window_table[:num_blocks - len(held)] == [NO_BLOCK] * (num_blocks - len(held))
    usage = manager.group_usage()
    assert [(u.label, u.num_used_blocks) for u in usage] == [("full", num_blocks), ("window 8", len(held))]


def test_the_integrity_check_names_a_window_group_holding_one_block_past_its_window():
    manager = BlockManager([16, 16], block_size=4, group_windows=(None, 4))
    manager.allocate(1, prompt(12))
    manager.mark_computed(1, 12)  # the next query (12) sees 9..12: blocks 0 and 1 are out
    assert manager.block_table(1, WINDOW)[:2] == [NO_BLOCK, NO_BLOCK]
    manager.check_integrity()
    seq = manager._seqs[1]
    pool = manager._pools[WINDOW]
    given_back = manager.block_table(1, WINDOW)
    block_id = pool.free_queue.popleft()  # one past the window: keep block 1 as if it were never given back
    pool.ref_counts[block_id] = 1
    seq.block_tables[WINDOW][1] = block_id
    with pytest.raises(AssertionError, match=r"group 1, seq 1: table .* should give back exactly its first 2"):
        manager.check_integrity()
    assert given_back[1] == NO_BLOCK


def test_blocks_leaving_the_window_stay_cached_and_a_later_prompt_hits_them():
    manager = BlockManager([16, 16], block_size=4, group_windows=(None, 4))
    manager.allocate(1, prompt(20))
    manager.mark_computed(1, 20)
    window_pool = manager.group_usage()[WINDOW]
    # The next query (20) sees keys 17..20: blocks 0-3 are out, cached; block 4 is held.
    assert window_pool.num_used_blocks == 1 and window_pool.num_cached_blocks == 4
    manager.free(1)
    # The same 20 tokens and one more: a hit of all 20 in both groups; the window group holds only the
    # block its window at 20 covers (keys 17..19: block 4).
    assert manager.allocate(2, prompt(20) + [99]) == 20
    assert manager.block_table(2, WINDOW)[:4] == [NO_BLOCK] * 4
    assert manager.block_table(2, WINDOW)[4] != NO_BLOCK
    manager.check_integrity()


def test_a_hit_the_window_group_cannot_serve_is_cut_back_to_one_it_can():
    manager = BlockManager([16, 16], block_size=4, group_windows=(None, 4))
    manager.allocate(1, prompt(20))
    manager.mark_computed(1, 20)
    block_4_key = manager._seqs[1].block_hashes[4]
    manager.free(1)
    window_pool = manager._pools[WINDOW]
    block_id = window_pool.hash_to_block.pop(block_4_key)  # the window group's copy of keys 16..19 is evicted
    window_pool.block_hashes[block_id] = window_pool.block_contents[block_id] = None
    window_pool.num_cached_blocks -= 1
    manager.check_integrity()
    # A hit of 20 would need block 4 in the window group; one of 16 needs only block 3 (keys 13..15).
    # The full group takes its 4 cached hits and 2 new blocks, the window group 1 cached hit and 2 new.
    assert manager.num_blocks_to_allocate(prompt(20) + [99]) == 6
    assert manager.allocate(2, prompt(20) + [99]) == 16
    assert manager.block_table(2, WINDOW)[:3] == [NO_BLOCK] * 3
    manager.check_integrity()


def test_only_window_groups_find_a_hit_past_an_evicted_first_block():
    # A model whose every layer has a window (Mistral's model-wide window): the first blocks of a long
    # conversation may be evicted, and a hit still needs only the window's blocks.
    manager = BlockManager(8, block_size=4, group_windows=(4,))
    manager.allocate(1, prompt(24))
    manager.mark_computed(1, 24)
    manager.free(1)
    manager.allocate(2, prompt(8, 500))  # evicts the oldest cached blocks (0 and 1 of the first prompt)
    manager.mark_computed(2, 8)
    assert manager.allocate(3, prompt(24) + [9]) == 24
    manager.check_integrity()


def test_fork_swap_and_truncate_keep_the_given_back_entries():
    manager = BlockManager([32, 32], block_size=4, num_cpu_blocks=32, group_windows=(None, 4))
    manager.allocate(1, prompt(18))
    manager.mark_computed(1, 18)
    manager.fork(1, 2)
    for seq_id in (1, 2):
        manager.append_token(seq_id, 5)
    manager.check_integrity()
    moves = manager.swap_out([1, 2])
    assert {group for _, _, group in moves} == {FULL, WINDOW}
    manager.check_integrity()
    manager.swap_in([1, 2])
    manager.check_integrity()
    assert manager.block_table(1, WINDOW)[:3] == [NO_BLOCK] * 3
    manager.append_token(1, 6)
    manager.truncate(1, 19)
    manager.check_integrity()
