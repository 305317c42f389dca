"""The block manager's free queue: GPU blocks with no holder, the least recently freed at the head."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator


class FreeBlockQueue:
    """A FIFO of block ids with removal from the middle, as an `OrderedDict` of ids would be, on a deque.

    Freed blocks join the tail, allocations take the head, and a prefix-cache hit on a cached block takes
    it out of the middle. An `OrderedDict` does all three in O(1) but every operation goes through its
    hash table and a linked node per entry, scattered over a pool-sized heap (several MB at 64,000
    blocks); a deque touches its two ends only. Removal from the middle is lazy: the entry stays, and
    `_num_stale[block]` counts the entries of that block left behind. A block has at most one live entry,
    always its newest, so of a block's entries that reach the head the first `_num_stale` ones are stale
    and skipped: order and contents are exactly those of the eager queue.
    """

    __slots__ = ("_entries", "_is_member", "_num_stale", "_num_live", "_num_stale_total")

    def __init__(self, num_blocks: int) -> None:
        self._entries: deque[int] = deque(range(num_blocks))  # head first; stale entries included
        self._is_member = bytearray(b"\x01") * num_blocks
        self._num_stale = [0] * num_blocks  # entries of each block still in the deque but removed
        self._num_live = num_blocks
        self._num_stale_total = 0

    def __len__(self) -> int:
        return self._num_live

    def __contains__(self, block_id: int) -> bool:
        return bool(self._is_member[block_id])

    def __iter__(self) -> Iterator[int]:
        """Live block ids, head first."""
        skips = {block_id: count for block_id, count in enumerate(self._num_stale) if count}
        for block_id in self._entries:
            if skips.get(block_id):
                skips[block_id] -= 1
            else:
                yield block_id

    def append(self, block_id: int) -> None:
        """Put a block that is not in the queue at its tail."""
        self._entries.append(block_id)
        self._is_member[block_id] = 1
        self._num_live += 1

    def extend(self, block_ids: Iterable[int]) -> None:
        """Put blocks, none of them in the queue, at its tail in this order."""
        block_ids = list(block_ids)
        self._entries.extend(block_ids)
        is_member = self._is_member
        for block_id in block_ids:
            is_member[block_id] = 1
        self._num_live += len(block_ids)

    def popleft(self) -> int:
        """Take the head block out of the queue (IndexError when empty)."""
        if not self._num_live:
            raise IndexError("pop from an empty free queue")
        entries, num_stale = self._entries, self._num_stale
        block_id = entries.popleft()
        while num_stale[block_id]:
            num_stale[block_id] -= 1
            self._num_stale_total -= 1
            block_id = entries.popleft()
        self._is_member[block_id] = 0
        self._num_live -= 1
        return block_id

    def __delitem__(self, block_id: int) -> None:
        """Take a block out of the middle of the queue (KeyError when it is not in it)."""
        if not self._is_member[block_id]:
            raise KeyError(block_id)
        self._is_member[block_id] = 0
        self._num_stale[block_id] += 1
        self._num_live -= 1
        self._num_stale_total += 1
        if self._num_stale_total > 1024 + self._num_live:  # mostly stale: rebuild it, as long as it is
            self._entries = deque(self)
            self._num_stale = [0] * len(self._num_stale)
            self._num_stale_total = 0
