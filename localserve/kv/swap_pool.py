"""Preemption by swap: the CPU swap pool's books (a reference count per block and a free list, no
prefix cache) and the block manager's moves between its GPU pool and this CPU pool."""

from __future__ import annotations

from collections.abc import Sequence


class OutOfBlocksError(RuntimeError):
    """An operation needed more free blocks than its pool has; nothing was changed."""


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


class SwapMixin:
    """The block manager's swap operations (mixed into BlockManager; they use its books)."""

    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """True when the CPU pool has room for the distinct blocks of these GPU sequences."""
        return len(self._distinct_blocks(seq_ids, swapped=False)) <= self._cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move these sequences (all of one request's samples or beams) to the CPU pool.

        Returns the (gpu_block, cpu_block) copies to make, one per distinct block, so shared blocks are
        copied once and stay shared. The GPU blocks are released as by `free`.
        """
        gpu_block_ids = self._distinct_blocks(seq_ids, swapped=False)
        if len(gpu_block_ids) > self._cpu_pool.num_free_blocks:
            raise OutOfBlocksError(f"swap out needs {len(gpu_block_ids)} CPU blocks, "
                                   f"{self._cpu_pool.num_free_blocks} free")
        gpu_to_cpu = {block_id: self._cpu_pool.take() for block_id in gpu_block_ids}
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            self._release_blocks(seq.block_table)
            seq.block_table = [gpu_to_cpu[block_id] for block_id in seq.block_table]
            self._cpu_pool.add_refs(seq.block_table)
            seq.is_swapped = True
        return list(gpu_to_cpu.items())

    def num_blocks_to_swap_in(self, seq_ids: Sequence[int]) -> int:
        """GPU blocks that swapping these sequences back in would take (shared blocks count once)."""
        return len(self._distinct_blocks(seq_ids, swapped=True))

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """True when the free queue has room for the distinct blocks of these swapped sequences."""
        return self.num_blocks_to_swap_in(seq_ids) <= len(self._free_queue)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back to the GPU; returns the (cpu_block, gpu_block) copies to make.

        Their full computed blocks are registered in the prefix cache again where their keys are free.
        """
        cpu_block_ids = self._distinct_blocks(seq_ids, swapped=True)
        if len(cpu_block_ids) > len(self._free_queue):
            raise OutOfBlocksError(f"swap in needs {len(cpu_block_ids)} blocks, {len(self._free_queue)} free")
        cpu_to_gpu = {cpu_block_id: self._take_free_block() for cpu_block_id in cpu_block_ids}
        for block_id in cpu_to_gpu.values():
            self._ref_counts[block_id] = 0  # counted below, once per table pointing at it
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            self._cpu_pool.release(seq.block_table)
            seq.block_table = [cpu_to_gpu[cpu_block_id] for cpu_block_id in seq.block_table]
            for block_id in seq.block_table:
                self._ref_counts[block_id] += 1
            seq.is_swapped = False
            for index, block_hash in enumerate(seq.block_hashes):
                self._register(seq.block_table[index], block_hash, self._block_content(seq, index))
        return list(cpu_to_gpu.items())

    def _distinct_blocks(self, seq_ids: Sequence[int], swapped: bool) -> list[int]:
        """Block ids of these sequences' tables, each once; all must be in the pool named by `swapped`."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids repeated: {list(seq_ids)}")
        block_ids: dict[int, None] = {}
        for seq_id in seq_ids:
            if self._seqs[seq_id].is_swapped != swapped:
                raise ValueError(f"sequence {seq_id} is {'not ' if swapped else ''}swapped out")
            block_ids.update(dict.fromkeys(self._seqs[seq_id].block_table))
        return list(block_ids)
