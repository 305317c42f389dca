"""A public, read-only view of the block manager's books (`BlockManager.books()`), for the readers that
walk all of them: the integrity check (kv/integrity.py) and the per-block snapshot the monitor shows.

The view copies nothing: it is true until the manager's next operation, and its readers change nothing
(its lists and records are typed read-only, its maps are read-only proxies).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from localserve.kv.block_hash import BlockContent
from localserve.kv.block_pool import BlockPool
from localserve.kv.followers import FollowerLink
from localserve.kv.layer_groups import GroupWindow, group_label


class SequenceView(Protocol):
    """What the block manager keeps of one sequence (its record, `block_manager.SequenceBlocks`), read-only."""

    @property
    def token_ids(self) -> Sequence[int]:
        """Its tokens; with `shares_token_ids` the caller's list, which may run a pending token ahead."""
        ...

    @property
    def num_tokens(self) -> int:
        """Tokens the manager has of `token_ids`."""
        ...

    @property
    def num_prompt_tokens(self) -> int:
        """Its prompt's tokens (where the state group's last checkpoint of the prompt lies)."""
        ...

    @property
    def shares_token_ids(self) -> bool: ...

    @property
    def block_tables(self) -> Sequence[Sequence[int]]:
        """Per group: GPU block ids (NO_BLOCK where a window or state group holds none), or CPU ids while swapped
        out."""
        ...

    @property
    def is_swapped(self) -> bool: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """Keys of its full computed blocks (with prefix caching only)."""
        ...

    @property
    def extra_key(self) -> bytes: ...

    @property
    def may_share_last_block(self) -> bool:
        """Clear: its last block, if partly filled, is its own."""
        ...

    def block_payload(self, index: int, block_size: int) -> BlockContent:
        """What the key of its block `index` is the hash of."""
        ...


@dataclass(frozen=True)
class PoolBooks:
    """One group's pool as it is now: its window and the books of its GPU and CPU blocks."""

    sliding_window: GroupWindow  # None: full attention; RECURRENT: the state group
    num_blocks: int
    ref_counts: Sequence[int]  # per GPU block: the block tables pointing at it
    block_hashes: Sequence[bytes | None]  # per GPU block: its prefix-cache key, while it has one
    block_contents: Sequence[BlockContent | None]  # per GPU block: what that key is the hash of
    hash_to_block: Mapping[bytes, int]  # the prefix cache: key -> GPU block
    free_queue: Collection[int]  # GPU blocks no table points at (free or cached)
    num_cached_blocks: int  # of those, the ones with a key
    swap_holder_counts: Sequence[int]  # per CPU swap-pool block: the swapped-out tables pointing at it

    @classmethod
    def of(cls, pool: BlockPool, sliding_window: GroupWindow, swap_holder_counts: Sequence[int]) -> PoolBooks:
        return cls(sliding_window, pool.num_blocks, pool.ref_counts, pool.block_hashes, pool.block_contents,
                   MappingProxyType(pool.hash_to_block), pool.free_queue, pool.num_cached_blocks, swap_holder_counts)


@dataclass(frozen=True)
class BlockBooks:
    """The block manager's books as they are now (see the module doc)."""

    block_size: int
    enable_prefix_caching: bool
    pools: tuple[PoolBooks, ...]  # per layer group, group 0 first
    sequences: Mapping[int, SequenceView]  # by sequence id
    followers: Mapping[int, FollowerLink]  # follower id -> its leader and the blocks they share
    state_checkpoint_blocks: int = 1  # the state group's checkpoint spacing (kv/state_group.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sequences", MappingProxyType(self.sequences))


@dataclass(frozen=True)
class GroupUsage:
    """One group's pool in numbers, for the monitor and /metrics."""

    sliding_window: GroupWindow  # None: full attention; RECURRENT: the state group
    num_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_free_blocks: int

    @property
    def label(self) -> str:
        return group_label(self.sliding_window)


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """State of every block, for the monitor.

    `block_states` has one character per GPU block, the pools of the groups one after the other (group 0
    first, `group_num_blocks` long each), indexed by block id within its group: '.' free, 'c' cached (free,
    contents kept for the prefix cache), 'u' used by one block table, 's' shared by several.
    `ref_counts[i]` is the number of block tables pointing at that block. `cpu_block_states` maps the
    groups' CPU swap pools the same way ('.', 'u' or 's').
    """

    block_states: str
    ref_counts: tuple[int, ...]
    cpu_block_states: str
    group_num_blocks: tuple[int, ...] = ()


def pool_snapshot(books: BlockBooks) -> BlockPoolSnapshot:
    """The state of every GPU and CPU block, read from the books."""
    states = "".join(".us"[min(count, 2)] if count or block_hash is None else "c"
                     for pool in books.pools
                     for count, block_hash in zip(pool.ref_counts, pool.block_hashes, strict=True))
    cpu_states = "".join(".us"[min(count, 2)] for pool in books.pools for count in pool.swap_holder_counts)
    ref_counts = tuple(count for pool in books.pools for count in pool.ref_counts)
    return BlockPoolSnapshot(states, ref_counts, cpu_states, tuple(pool.num_blocks for pool in books.pools))
