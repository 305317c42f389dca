"""The CPU swap pool's books: a reference count per block and a free list (no prefix cache here)."""

from __future__ import annotations


class CpuBlockPool:
    """Blocks of the swap space; a block is free exactly when no swapped-out block table points at it."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def take(self) -> int:
        """A free block, with no reference yet (`add_refs` counts the tables that point at it)."""
        return self.free_block_ids.pop()

    def add_refs(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """One reference fewer on each block; blocks reaching 0 are free again."""
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
