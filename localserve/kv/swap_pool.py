"""The CPU swap pool's books: where the block manager keeps the blocks of requests preempted by swap."""

from __future__ import annotations

from collections.abc import Sequence

from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.out_of_blocks import OutOfBlocksError


class CpuSwapPool:
    """A `BlockTier` (kv/block_tier.py) of `capacity` CPU blocks, with no prefix cache: a block is free
    exactly when no swapped-out block table points at it. A table's `NO_BLOCK` entries (a window group's
    given-back blocks) stay `NO_BLOCK`. Free blocks are handed out low ids first, the
    most recently freed first after that."""

    __slots__ = ("_capacity", "_holder_counts", "_free_block_ids")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"need capacity >= 0, got {capacity}")
        self._capacity = capacity
        self._holder_counts = [0] * capacity
        self._free_block_ids = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def holder_counts(self) -> Sequence[int]:
        return self._holder_counts

    def store(self, tables: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
        gpu_block_ids = list(dict.fromkeys(block_id for table in tables for block_id in table if block_id >= 0))
        if len(gpu_block_ids) > len(self._free_block_ids):
            raise OutOfBlocksError(f"storing {len(gpu_block_ids)} blocks in the swap pool, "
                                   f"{len(self._free_block_ids)} free")
        free_block_ids, holder_counts = self._free_block_ids, self._holder_counts
        to_tier = {block_id: free_block_ids.pop() for block_id in gpu_block_ids}
        copies = list(to_tier.items())
        to_tier[NO_BLOCK] = NO_BLOCK
        tier_tables = []
        for table in tables:
            tier_table = [to_tier[block_id] for block_id in table]
            for block_id in tier_table:
                if block_id != NO_BLOCK:
                    holder_counts[block_id] += 1
            tier_tables.append(tier_table)
        return tier_tables, copies

    def release(self, table: Sequence[int]) -> None:
        holder_counts = self._holder_counts
        for block_id in reversed(table):
            if block_id == NO_BLOCK:
                continue
            holder_counts[block_id] -= 1
            if holder_counts[block_id] == 0:
                self._free_block_ids.append(block_id)

    def check_integrity(self) -> None:
        unheld = [block_id for block_id, count in enumerate(self._holder_counts) if count == 0]
        # Not `assert`: the checks must also run under `python -O`.
        if sorted(self._free_block_ids) != unheld:
            raise AssertionError(f"swap pool: free blocks {sorted(self._free_block_ids)}, blocks no table "
                                 f"holds {unheld}")
