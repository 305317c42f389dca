"""Truncation: the tokens of a rejected speculative draft leave a sequence, with exact expectations.

A verify step appends the drafted tokens, the forward pass writes their KV, and only the accepted ones
stay: `truncate` gives back the blocks past them (to the free queue's tail, holding nothing the prefix
cache could hand out) and no block that held a rejected token is ever registered under a key.
"""

from __future__ import annotations

import pytest

from localserve.kv.block_manager import BlockManager


def prompt(num_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_tokens))


def test_truncate_returns_the_blocks_past_the_kept_tokens_to_the_free_queue_tail():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(30))  # blocks 0, 1
    manager.mark_computed(1, 30)
    for token in prompt(20, 100):  # a draft of 20 tokens: the 31st-50th, blocks 2 and 3
        manager.append_token(1, token)
    assert manager.block_table(1) == [0, 1, 2, 3]
    manager.mark_computed(1, 31)  # the verified token; the draft's KV is written but not yet accepted
    manager.truncate(1, 33)  # two drafted tokens accepted
    assert manager.block_table(1) == [0, 1, 2]
    assert manager.num_tokens(1) == 33 and manager.num_computed_tokens(1) == 31
    assert manager.free_queue_block_ids() == [4, 5, 6, 7, 3]  # the dropped block at the tail
    assert manager.num_cached_blocks == 0
    manager.check_integrity()


def test_a_block_that_held_rejected_tokens_is_never_a_prefix_hit_for_them():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(10))
    manager.mark_computed(1, 10)
    drafted = prompt(6, 200)  # would fill block 0 with prompt(10) + drafted
    for token in drafted:
        manager.append_token(1, token)
    manager.mark_computed(1, 11)
    manager.truncate(1, 11)  # only the first drafted token is accepted
    for token in prompt(5, 300):  # the real continuation fills block 0
        manager.mark_computed(1, manager.num_tokens(1))
        manager.append_token(1, token)
    manager.mark_computed(1, 16)
    manager.free(1)
    assert manager.num_blocks_to_allocate(prompt(10) + drafted + [7]) == 2  # the drafted block: no hit
    assert manager.allocate(2, prompt(10) + [200] + prompt(5, 300) + [7]) == 16  # the real one: a hit
    manager.check_integrity()


def test_truncate_keeps_at_least_the_computed_tokens_and_refuses_swapped_sequences():
    manager = BlockManager(num_blocks=8, num_cpu_blocks=4)
    manager.allocate(1, prompt(20))
    manager.mark_computed(1, 18)
    with pytest.raises(ValueError):
        manager.truncate(1, 17)  # below the computed tokens: their blocks may be in the prefix cache
    with pytest.raises(ValueError):
        manager.truncate(1, 21)  # more tokens than it has
    manager.truncate(1, 18)
    assert manager.block_table(1) == [0, 1] and manager.num_tokens(1) == 18
    manager.swap_out([1])
    with pytest.raises(ValueError):
        manager.truncate(1, 18)
    manager.check_integrity()


def test_truncate_of_a_shared_token_list_leaves_the_list_to_its_owner():
    manager = BlockManager(num_blocks=8)
    tokens = prompt(16)
    manager.allocate(1, tokens, share_token_ids=True)
    manager.mark_computed(1, 16)
    tokens += [50, 51, 52]
    for token in tokens[16:]:
        manager.append_token(1, token)
    manager.truncate(1, 17)
    assert tokens == prompt(16) + [50, 51, 52]  # the owner removes its own rejected tokens
    del tokens[17:]
    assert manager.num_tokens(1) == 17 and manager.block_table(1) == [0, 1]
    manager.check_integrity()
