"""A tier: a place outside the GPU pool that keeps copies of GPU blocks for the block manager.

A tier keeps books only, like the block manager: which of its blocks hold something and for how many
holders. The bytes move in the KV pool (`kv/cache.py`), which makes the (GPU block, tier block) copies
the manager hands on. The CPU swap pool (`kv/swap_pool.py`, whole requests preempted by swap) is one;
a disk tier for the prefix cache (cached blocks the GPU pool evicts, found again by their keys) would
be a sibling behind the same interface, a holder there being the prefix cache's entry of a block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class BlockTier(Protocol):
    """Stores the blocks of block tables (each distinct block once) and gives them back table by table."""

    @property
    def capacity(self) -> int:
        """Blocks the tier can hold."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks it can take now."""
        ...

    @property
    def holder_counts(self) -> Sequence[int]:
        """What it holds: per tier block, the number of tables pointing at it (0: free). Read-only."""
        ...

    def store(self, tables: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Take a tier block for each distinct GPU block of these tables; returns the tables in tier
        block ids, each a holder of its blocks, and the (GPU block, tier block) copies to make. Raises
        `OutOfBlocksError`, changing nothing, when the tables have more distinct blocks than are free."""
        ...

    def release(self, table: Sequence[int]) -> None:
        """Give back a table's hold on its tier blocks (after copying them back, or dropping them): a
        block no table holds any more is free again."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, unless the tier's own books agree."""
        ...
