"""The block manager's read side: what the scheduler budgets with, what the monitor shows and what the
step contract carries of a sequence (kv/block_manager.py: `BlockManager` inherits it and keeps the books).

Every method here reads and none changes a book. The pool-wide counts add up all groups, or take the
tightest group's where the scheduler budgets with them (`num_available_blocks`: the fewest blocks any group
can hand out); `books()` is the whole read-only view (kv/block_books.py) the integrity check and the per-block
snapshot walk.
"""

from __future__ import annotations

from localserve.kv.block_books import BlockBooks, BlockPoolSnapshot, GroupUsage, PoolBooks, pool_snapshot
from localserve.kv.block_pool import BlockPool
from localserve.kv.block_tier import BlockTier
from localserve.kv.followers import Followers
from localserve.kv.layer_groups import GroupWindow
from localserve.kv.sequence_blocks import SequenceBlocks
from localserve.kv.state_group import StateGroup


class BlockViews:
    """The block manager's reads over its books (module doc); `BlockManager` sets the books."""

    block_size: int
    enable_prefix_caching: bool
    group_windows: tuple[GroupWindow, ...]
    state_checkpoint_blocks: int
    _pools: list[BlockPool]  # per group
    _swap_tiers: list[BlockTier]  # per group
    _state: StateGroup | None
    _followers: Followers
    _seqs: dict[int, SequenceBlocks]

    @property
    def num_groups(self) -> int:
        return len(self._pools)

    @property
    def state_group(self) -> int | None:
        """The state group's index (the last group), None without one."""
        return None if self._state is None else self._state.group

    @property
    def group_num_blocks(self) -> tuple[int, ...]:
        """Each group's pool size."""
        return tuple(pool.num_blocks for pool in self._pools)

    @property
    def num_blocks(self) -> int:
        """GPU blocks of all groups' pools."""
        return sum(pool.num_blocks for pool in self._pools)

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks in the free queues holding nothing reusable (all groups)."""
        return sum(pool.num_free_blocks for pool in self._pools)

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks in the free queues whose contents the prefix cache can still hand out (all groups)."""
        return sum(pool.num_cached_blocks for pool in self._pools)

    @property
    def num_available_blocks(self) -> int:
        """Blocks allocations can take, free + cached (taking a cached one evicts its contents), in the group
        that has the fewest."""
        return min(pool.num_available_blocks for pool in self._pools)

    @property
    def group_available_blocks(self) -> list[int]:
        """`num_available_blocks` of each group, group 0 first."""
        return [pool.num_available_blocks for pool in self._pools]

    @property
    def num_used_blocks(self) -> int:
        """GPU blocks pointed at by at least one block table (all groups)."""
        return sum(pool.num_used_blocks for pool in self._pools)

    @property
    def usage_ratio(self) -> float:
        """Used over all GPU blocks of the fullest group, 0..1 (cached blocks count as not used)."""
        return max(pool.num_used_blocks / pool.num_blocks for pool in self._pools)

    @property
    def cached_block_evictions(self) -> int:
        """Cached blocks overwritten by an allocation (all groups)."""
        return sum(pool.cached_block_evictions for pool in self._pools)

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of the CPU swap pools (one per group)."""
        return sum(tier.capacity for tier in self._swap_tiers)

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks not holding a swapped-out sequence (all groups)."""
        return sum(tier.num_free_blocks for tier in self._swap_tiers)

    def group_usage(self) -> list[GroupUsage]:
        """Blocks used, cached and free in each group's pool."""
        return [GroupUsage(window, pool.num_blocks, pool.num_used_blocks, pool.num_cached_blocks,
                           pool.num_free_blocks) for window, pool in zip(self.group_windows, self._pools, strict=True)]

    def free_queue_block_ids(self, group: int = 0) -> list[int]:
        """GPU block ids in the group's free queue, head (next to be handed out) first."""
        return list(self._pools[group].free_queue)

    def ref_count(self, block_id: int, group: int = 0) -> int:
        """Number of block tables pointing at GPU block `block_id` of the group."""
        return self._pools[group].ref_counts[block_id]

    def block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """A copy of the sequence's block table in the group (CPU block ids while it is swapped out)."""
        return list(self._seqs[seq_id].block_tables[group])

    def live_block_table(self, seq_id: int, group: int = 0) -> list[int]:
        """The sequence's block table in the group itself, not a copy: read-only, and true only until the
        sequence's next operation (the step contract carries tables this way, sparing a copy per sequence a step)."""
        return self._seqs[seq_id].block_tables[group]

    def live_block_tables(self, seq_id: int) -> list[list[int]]:
        """Every group's `live_block_table` of the sequence, in group order (the list itself, read-only)."""
        return self._seqs[seq_id].block_tables

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence, including appended ones whose KV is not written yet."""
        return self._seqs[seq_id].num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """Leading tokens of the sequence whose KV is written (prefix hits included)."""
        return self._seqs[seq_id].num_computed_tokens

    def is_swapped(self, seq_id: int) -> bool:
        """True while the sequence lives in the CPU pool."""
        return self._seqs[seq_id].is_swapped

    def awaits_leader(self, seq_id: int) -> bool:
        """True while the sequence shares blocks its leader has not computed yet (see `allocate_sharing`)."""
        return self._followers.awaits_leader(seq_id)

    def books(self) -> BlockBooks:
        """A read-only view of every book the manager keeps, true until its next operation (no copies)."""
        pools = tuple(PoolBooks.of(pool, window, tier.holder_counts)
                      for pool, window, tier in zip(self._pools, self.group_windows, self._swap_tiers, strict=True))
        return BlockBooks(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching, pools=pools,
                          sequences=self._seqs, followers=self._followers.links,
                          state_checkpoint_blocks=self.state_checkpoint_blocks)

    def snapshot(self) -> BlockPoolSnapshot:
        """The state of every GPU and CPU block, group after group (see `BlockPoolSnapshot`)."""
        return pool_snapshot(self.books())
