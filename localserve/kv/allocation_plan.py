"""Admission for the block manager (kv/block_manager.py, `allocate`): a prompt's prefix hits as every layer
group accepts them, what each group's table takes from its free queue, and the tables that plan gives the new
sequence. No state of its own: it reads and changes the pools.

A hit of k blocks needs, in a full group, each of the k blocks in its prefix cache; in a window group,
those the window of the query at position k * block_size covers; in the state group, entry k - 1's
checkpoint (kv/state_group.py). So the full groups bound k by their first miss, and the window and state
groups may then lower it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localserve.kv.block_hash import ROOT_HASH, block_extra_key, hash_block
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.group_slots import GroupSlots
from localserve.kv.layer_groups import RECURRENT, GroupWindow, num_blocks_out_of_window


@dataclass(slots=True)
class AllocationPlan:
    """A prompt's prefix hits as every group accepts them, and what each group takes from its free queue."""

    hit_hashes: list[bytes]  # keys of the hit blocks, one per block before the hit point
    # Per group: the hit blocks it holds (a window group: those in its window; the state group: the last one).
    group_hits: list[list[int]]
    num_blocks_to_take: list[int]  # per group

    @property
    def num_hits(self) -> int:
        return len(self.hit_hashes)


def num_hits_dropped(num_hits: int, window: GroupWindow, block_size: int) -> int:
    """Leading hit blocks a group does not hold: those before a window, all but the last in a state group."""
    if window is RECURRENT:
        return max(0, num_hits - 1)
    return num_blocks_out_of_window(num_hits * block_size, window, block_size)


def plan_allocation(slots: GroupSlots, token_ids: Sequence[int], extra_key: bytes, look_up: bool,
                    block_extra_keys: Sequence[bytes] = ()) -> AllocationPlan:
    """The prefix hits every group accepts (module doc) and the blocks the prompt takes from each free queue
    (a window or state group: for its first chunk, `slots`).

    `look_up` False: no hits. `block_extra_keys`: each block's own extra key (block_hash.block_extra_key)."""
    pools, group_windows, block_size, state = slots.pools, slots.group_windows, slots.block_size, slots.state
    full_groups = [group for group, window in enumerate(group_windows) if window is None]
    window_groups = [group for group, window in enumerate(group_windows) if window is not None
                     and window is not RECURRENT]
    hashes: list[bytes] = []
    found: list[list[int | None]] = []  # per hashed block: its block id in each group, None: not cached
    if look_up:
        block_hash = ROOT_HASH
        for index in range((len(token_ids) - 1) // block_size):
            # Chained: the previous block's key is this one's parent.
            block_hash = hash_block(block_hash, token_ids[index * block_size:(index + 1) * block_size],
                                    block_extra_key(extra_key, block_extra_keys, index))
            block_ids = [pool.hash_to_block.get(block_hash) for pool in pools]
            if any(block_ids[group] is None for group in full_groups):
                break
            # Without a full group, a miss does not end the search: a later window may still be cached.
            hashes.append(block_hash)
            found.append(block_ids)

    def accepted(num_hits: int) -> bool:
        if state is not None and num_hits and found[num_hits - 1][state.group] is None:
            return False
        return all(None not in [found[index][group] for index in range(
            num_blocks_out_of_window(num_hits * block_size, group_windows[group], block_size), num_hits)]
            for group in window_groups)

    num_hits = len(hashes)
    while num_hits and not accepted(num_hits):
        num_hits -= 1
    num_cached_tokens = num_hits * block_size
    group_hits = []
    num_blocks_to_take = []
    for group, (pool, window) in enumerate(zip(pools, group_windows, strict=True)):
        num_dropped = num_hits_dropped(num_hits, window, block_size)
        hits = [found[index][group] for index in range(num_dropped, num_hits)]
        group_hits.append(hits)
        num_taken = sum(1 for block_id in hits if pool.ref_counts[block_id] == 0)  # hits leave the free queue too
        if window is RECURRENT:
            table = [NO_BLOCK] * num_dropped + hits
            num_blocks_to_take.append(num_taken + state.num_slots_to_grant(
                table, num_cached_tokens, len(token_ids), slots.slot_target(len(token_ids), num_cached_tokens)))
        else:
            num_new = slots.num_table_blocks(window, len(token_ids), num_cached_tokens) - num_dropped - len(hits)
            num_blocks_to_take.append(num_new + num_taken)
    return AllocationPlan(hashes[:num_hits], group_hits, num_blocks_to_take)


def take_tables(slots: GroupSlots, plan: AllocationPlan, num_tokens: int) -> list[list[int]]:
    """Carry the plan out for a prompt of `num_tokens` tokens, which the pools have room for: the new
    sequence's table in each group, its hits held and new blocks taken for the rest (a window or state group:
    its first chunk)."""
    num_cached_tokens = plan.num_hits * slots.block_size
    block_tables = []
    for pool, window, hits in zip(slots.pools, slots.group_windows, plan.group_hits, strict=True):
        # Hits leave the free queue before new blocks are taken from its head, which could evict them.
        for block_id in hits:
            pool.hold(block_id)
        num_dropped = num_hits_dropped(plan.num_hits, window, slots.block_size)
        if window is RECURRENT:
            block_tables.append(slots.state.grant([NO_BLOCK] * num_dropped + hits, num_cached_tokens, num_tokens,
                                                  slots.slot_target(num_tokens, num_cached_tokens), exact=True)[0])
            continue
        num_new_blocks = slots.num_table_blocks(window, num_tokens, num_cached_tokens) - num_dropped - len(hits)
        block_tables.append([NO_BLOCK] * num_dropped + hits + [pool.take_free_block() for _ in range(num_new_blocks)])
    return block_tables
