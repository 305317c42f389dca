"""One group's pool of GPU blocks: reference counts, the free queue and the prefix cache's keys.

The block manager (kv/block_manager.py) keeps one pool per layer group (kv/layer_groups.py); each is its
own block id space. A block is free (in the free queue, nothing worth keeping), cached (in the free
queue with ref count 0, its key still registered) or used (ref count >= 1). Freed blocks join the
queue's tail and new ones come from its head, so the least recently freed cached block is overwritten
first. Block tables may hold `NO_BLOCK` where a window group dropped a block or a state group keeps no
slot: it is never counted.
"""

from __future__ import annotations

from collections.abc import Iterable

from localserve.kv.block_hash import BlockContent
from localserve.kv.free_queue import FreeBlockQueue

NO_BLOCK = -1
"""A block-table entry with no block: a window group's that left the window and was given back, a state
group's that holds no slot."""

BlockMove = tuple[int, int, int]
"""A block copy the KV pool makes for the block manager: (source block, destination block, group)."""


class BlockPool:
    """The books of `num_blocks` GPU blocks (see the module doc)."""

    __slots__ = ("num_blocks", "ref_counts", "block_hashes", "block_contents", "free_queue", "hash_to_block",
                 "num_cached_blocks", "cached_block_evictions")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # set while in the prefix cache
        self.block_contents: list[BlockContent | None] = [None] * num_blocks  # behind each key
        self.free_queue = FreeBlockQueue(num_blocks)  # head first
        self.hash_to_block: dict[bytes, int] = {}
        self.num_cached_blocks = 0  # blocks in the free queue with a key
        self.cached_block_evictions = 0  # cached blocks overwritten by an allocation

    @property
    def num_available_blocks(self) -> int:
        """Blocks allocations can take: free + cached."""
        return len(self.free_queue)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) - self.num_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def take_free_block(self) -> int:
        """Pop the free-queue head with ref count 1, evicting its contents from the prefix cache."""
        block_id = self.free_queue.popleft()
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.hash_to_block[block_hash]
            self.block_hashes[block_id] = None
            self.block_contents[block_id] = None
            self.num_cached_blocks -= 1
            self.cached_block_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def hold(self, block_id: int) -> None:
        """One more table points at the block (a prefix hit or a share), taking it out of the free queue."""
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
            self.num_cached_blocks -= self.block_hashes[block_id] is not None
        self.ref_counts[block_id] += 1

    def share(self, block_ids: Iterable[int]) -> None:
        """One more table points at each of these used blocks (a fork, a follower); `NO_BLOCK` entries are
        skipped."""
        ref_counts = self.ref_counts
        for block_id in block_ids:
            if block_id != NO_BLOCK:
                ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Each block loses one count, in the order given; a block reaching 0 joins the free-queue tail,
        still cached if it has a key. `NO_BLOCK` entries are skipped."""
        ref_counts = self.ref_counts
        block_hashes = self.block_hashes
        freed = []
        num_cached = 0
        for block_id in block_ids:
            if block_id == NO_BLOCK:
                continue
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                freed.append(block_id)
                if block_hashes[block_id] is not None:
                    num_cached += 1
        self.free_queue.extend(freed)
        self.num_cached_blocks += num_cached

    def register(self, block_id: int, block_hash: bytes, content: BlockContent) -> None:
        """Enter a full computed block in the prefix cache, unless it or its key is registered already."""
        if self.block_hashes[block_id] is None and block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
            self.block_contents[block_id] = content
