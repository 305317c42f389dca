"""How far a sequence's tables reach in the block manager's window and state groups (kv/block_manager.py
keeps the tables; this module grants their slots a chunk at a time and gives back what a window left).

A full group gives a sequence a block for each of its tokens at once. With `window_chunk_tokens` (the
step's token budget), a window group gives it blocks for at most that many tokens past its computed ones
at a time: at admission for its first prefill chunk, then as `mark_computed` moves on (as many as its pool
has then, the same number in each window group), and for each appended token once its prompt is computed
(kv/token_append.py). The tokens with a slot in every group (`num_slotted_tokens`) bound each prefill
chunk, and a window pool of max_num_seqs x (ceil((W + chunk - 1) / block_size) + 1) blocks always has room
for them (kv/group_plan.py). Without it, a window group's first table covers the whole prompt, as a full
group's does.

A window group gives back the blocks that fall wholly before the window of the sequence's next query
(positions < num_computed_tokens - W + 1) as soon as they do: their entries become `NO_BLOCK`, always a
prefix of the table, and the blocks join the free queue still cached, so a later prompt with the same
tokens finds them.

The state group (`RECURRENT`, last) grants its slots a chunk at a time too, by its own rules
(kv/state_group.py: `grant`, `coverage`, `after_step`).
"""

from __future__ import annotations

from collections.abc import Sequence

from localserve.kv.block_pool import NO_BLOCK, BlockPool
from localserve.kv.layer_groups import RECURRENT, GroupWindow, num_blocks_out_of_window
from localserve.kv.sequence_blocks import SequenceBlocks
from localserve.kv.state_group import StateGroup


class GroupSlots:
    """The window and state groups' slots over the block manager's pools (module doc): it changes the
    sequences' tables and the pools' counts, never a sequence's tokens."""

    __slots__ = ("pools", "group_windows", "block_size", "window_chunk_tokens", "state", "window_groups")

    def __init__(self, pools: Sequence[BlockPool], group_windows: Sequence[GroupWindow], block_size: int,
                 window_chunk_tokens: int | None, state: StateGroup | None) -> None:
        self.pools = pools
        self.group_windows = group_windows
        self.block_size = block_size
        self.window_chunk_tokens = window_chunk_tokens
        self.state = state
        self.window_groups = [group for group, window in enumerate(group_windows)
                              if window is not None and window is not RECURRENT]

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot_target(self, num_tokens: int, num_computed_tokens: int) -> int:
        """Tokens a window group gives slots to: up to `window_chunk_tokens` past the computed ones."""
        if self.window_chunk_tokens is None:
            return num_tokens
        return min(num_tokens, num_computed_tokens + self.window_chunk_tokens)

    def num_table_blocks(self, window: int | None, num_tokens: int, num_computed_tokens: int) -> int:
        """Entries of a new table in a group of this window: every token's, or a window group's slotted ones."""
        if window is None:
            return self.num_blocks_for(num_tokens)
        return self.num_blocks_for(self.slot_target(num_tokens, num_computed_tokens))

    def num_slotted_tokens(self, seq: SequenceBlocks) -> int:
        """Leading tokens of the sequence with a KV slot in every group."""
        num_slotted = seq.num_tokens
        if self.window_groups:
            num_slotted = min(num_slotted, len(seq.block_tables[self.window_groups[0]]) * self.block_size)
        if self.state is not None:
            num_slotted = min(num_slotted, self.state.coverage(seq.block_tables[self.state.group],
                                                               seq.num_computed_tokens, seq.num_tokens))
        return num_slotted

    def can_ever_hold(self, num_prompt_tokens: int, num_peak_blocks: int) -> bool:
        """`BlockManager.can_ever_hold`: a full group holds all the blocks, a window group its first chunk's, a
        state group its first chunk's slots and, to pass a checkpoint, two."""
        num_first_blocks = self.num_blocks_for(self.slot_target(num_prompt_tokens, 0))
        if self.state is not None:
            num_first_slots = self.state.num_slots_to_grant([], 0, num_prompt_tokens,
                                                            self.slot_target(num_prompt_tokens, 0))
            if self.state.pool.num_blocks < max(num_first_slots, min(2, num_peak_blocks)):
                return False
        return all(pool.num_blocks >= (num_peak_blocks if window is None else min(num_first_blocks, num_peak_blocks))
                   for pool, window in zip(self.pools, self.group_windows, strict=True) if window is not RECURRENT)

    def windows_hold(self, leader: SequenceBlocks, num_computed_blocks: int, num_shared_blocks: int) -> bool:
        """Whether each window group of the leader still holds the blocks of its first `num_shared_blocks` that
        the window of a sequence sharing them, with `num_computed_blocks` of them computed, needs."""
        for group in self.window_groups:
            first_needed = num_blocks_out_of_window(num_computed_blocks * self.block_size, self.group_windows[group],
                                                    self.block_size)
            leader_table = leader.block_tables[group]
            if len(leader_table) < num_shared_blocks or NO_BLOCK in leader_table[first_needed:num_shared_blocks]:
                return False
        return True

    def extend(self, seq: SequenceBlocks) -> None:
        """Window and state groups give the sequence slots up to `window_chunk_tokens` past its computed tokens,
        as far as their pools have them now."""
        self._extend_windows(seq)
        self._extend_states(seq)

    def move_on(self, seq: SequenceBlocks, num_computed_before: int) -> None:
        """After `mark_computed`: the state group places its running slot and registers the checkpoints the
        step completed (kv/state_group.py, `after_step`), window groups give back what left the window, and
        both give slots for the next chunk."""
        state = self.state
        if state is not None:
            pool = state.pool
            seq.block_tables[state.group] = state.after_step(
                seq.block_tables[state.group], num_computed_before, seq.num_computed_tokens, seq.num_prompt_tokens,
                lambda index, slot: pool.register(slot, seq.block_hashes[index],
                                                  seq.block_payload(index, self.block_size)))
        if self.window_groups:  # (a full-attention model's step calls nothing more)
            self.slide_windows(seq, num_computed_before)
            self._extend_windows(seq)
        if state is not None:
            self._extend_states(seq)

    def slide_windows(self, seq: SequenceBlocks, num_computed_before: int) -> None:
        """Window groups give back the sequence's blocks that its computed tokens moved out of the window,
        oldest first, still cached where they have a key."""
        for group in self.window_groups:
            window = self.group_windows[group]
            start = num_blocks_out_of_window(num_computed_before, window, self.block_size)
            end = num_blocks_out_of_window(seq.num_computed_tokens, window, self.block_size)
            if end > start:
                table = seq.block_tables[group]
                self.pools[group].release(table[start:end])
                table[start:end] = [NO_BLOCK] * (end - start)

    def _extend_windows(self, seq: SequenceBlocks) -> None:
        """Window groups give the sequence slots up to `window_chunk_tokens` past its computed tokens, as many
        blocks as every window pool has now (the same number in each)."""
        if not self.window_groups:
            return
        tables = [seq.block_tables[group] for group in self.window_groups]
        wanted = self.num_blocks_for(self.slot_target(seq.num_tokens, seq.num_computed_tokens)) - len(tables[0])
        num_new_blocks = min(wanted, *(self.pools[group].num_available_blocks for group in self.window_groups))
        for group, table in zip(self.window_groups, tables, strict=True):
            pool = self.pools[group]
            table += [pool.take_free_block() for _ in range(num_new_blocks)]

    def _extend_states(self, seq: SequenceBlocks) -> None:
        """The state group gives the sequence slots up to `window_chunk_tokens` past its computed tokens, as
        many as its pool has now (kv/state_group.py)."""
        if self.state is not None:
            group = self.state.group
            seq.block_tables[group] = self.state.grant(
                seq.block_tables[group], seq.num_computed_tokens, seq.num_prompt_tokens,
                self.slot_target(seq.num_tokens, seq.num_computed_tokens), exact=False)[0]
