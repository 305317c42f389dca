"""The CPU swap pool as a block tier (kv/block_tier.py): it stores the blocks of block tables, each distinct
block once, gives them back table by table, and says its capacity and what it holds. At its bounds:
exactly full is accepted, one block more is refused and changes nothing."""

from __future__ import annotations

import pytest

from localserve.kv.block_manager import BlockManager
from localserve.kv.out_of_blocks import OutOfBlocksError
from localserve.kv.swap_pool import CpuSwapPool


def test_an_empty_tier_holds_nothing():
    tier = CpuSwapPool(3)
    assert tier.capacity == 3 and tier.num_free_blocks == 3
    assert list(tier.holder_counts) == [0, 0, 0]
    tier.check_integrity()


def test_storing_exactly_its_capacity_fills_it():
    tier = CpuSwapPool(3)
    tables, copies = tier.store([[7, 4, 9]])
    assert tables == [[0, 1, 2]] and copies == [(7, 0), (4, 1), (9, 2)]  # low tier blocks first
    assert tier.num_free_blocks == 0 and list(tier.holder_counts) == [1, 1, 1]
    tier.check_integrity()


def test_one_block_past_its_capacity_is_refused_and_changes_nothing():
    tier = CpuSwapPool(3)
    tier.store([[5]])
    with pytest.raises(OutOfBlocksError):
        tier.store([[7, 4, 9]])  # 3 blocks, 2 free
    assert tier.num_free_blocks == 2 and list(tier.holder_counts) == [1, 0, 0]
    tier.check_integrity()
    assert tier.store([[7, 4]]) == ([[1, 2]], [(7, 1), (4, 2)])  # exactly the 2 left


def test_shared_blocks_are_stored_once_and_held_by_each_table():
    tier = CpuSwapPool(3)
    tables, copies = tier.store([[5, 6], [5, 7]])  # 3 distinct blocks: exactly full
    assert tables == [[0, 1], [0, 2]] and copies == [(5, 0), (6, 1), (7, 2)]
    assert list(tier.holder_counts) == [2, 1, 1] and tier.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        tier.store([[8]])  # one past
    tier.check_integrity()


def test_giving_blocks_back_frees_those_no_table_holds_any_more():
    tier = CpuSwapPool(3)
    (first, second), _ = tier.store([[5, 6], [5, 7]])
    tier.release(second)
    assert list(tier.holder_counts) == [1, 1, 0] and tier.num_free_blocks == 1
    tier.release(first)
    assert list(tier.holder_counts) == [0, 0, 0] and tier.num_free_blocks == 3
    tier.check_integrity()
    tables, _ = tier.store([[1, 2, 3]])  # exactly full again
    assert sorted(tables[0]) == [0, 1, 2]


def test_a_tier_of_no_blocks_refuses_one():
    tier = CpuSwapPool(0)
    assert tier.store([]) == ([], [])
    with pytest.raises(OutOfBlocksError):
        tier.store([[0]])
    tier.check_integrity()


def test_the_integrity_check_reports_a_free_block_that_is_held():
    tier = CpuSwapPool(2)
    tier.store([[3]])
    tier._holder_counts[1] += 1  # as if a table pointed at a block the tier still hands out
    with pytest.raises(AssertionError, match="free"):
        tier.check_integrity()


def prompt(n: int) -> list[int]:
    return list(range(10, 10 + n))


def test_swapping_out_exactly_into_a_full_swap_pool_and_one_block_past_it():
    manager = BlockManager(num_blocks=8, block_size=16, num_cpu_blocks=3)
    manager.allocate(1, prompt(40))  # 3 blocks: exactly the swap pool
    manager.allocate(2, prompt(1))
    assert manager.can_swap_out([1]) and not manager.can_swap_out([1, 2])
    with pytest.raises(OutOfBlocksError):
        manager.swap_out([1, 2])  # one block past
    assert not manager.is_swapped(1) and manager.num_free_cpu_blocks == 3
    manager.check_integrity()
    assert len(manager.swap_out([1])) == 3
    assert manager.num_free_cpu_blocks == 0 and not manager.can_swap_out([2])
    assert manager.snapshot().cpu_block_states == "uuu"
    manager.check_integrity()
