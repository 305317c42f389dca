"""The state group's rules: where a sequence's recurrent-state slots sit in its table, and how they move.

A state group (kv/layer_groups.py, `RECURRENT`) keeps no KV: its pool's blocks are state slots
(kv/state_shape.py), and a sequence's table has one entry per logical block, `NO_BLOCK` except where
kv/state_steps.py reads or writes a slot. The block manager (kv/block_manager.py) keeps the table through
this module, which owns what a table looks like:

- Policy checkpoints (with prefix caching): entry i, the state after (i + 1) * block_size tokens, is one
  when (i + 1) % checkpoint_blocks == 0 or (i + 1) == (num_prompt_tokens - PROMPT_TAIL) // block_size (the
  prompt's end checkpoint: the last boundary at least `PROMPT_TAIL` tokens before the prompt's end, none
  for a prompt shorter than a block and the tail). Only they are registered in the prefix cache, under
  block i's chained key; without prefix caching there are none.
- At rest (after `allocate` or `mark_computed`) with n tokens computed, n > 0: every entry before
  r = (n - 1) // block_size is `NO_BLOCK` (released; a registered checkpoint stays cached, evictable like any
  free cached block) and entry r holds the running slot X, the state after n tokens.
- Granting slots for tokens up to a target (`grant`: the first prefill chunk at admission, `make_slots`,
  `mark_computed`, `append_token`) extends the table to the target's last block, L entries: a fresh slot at
  each policy checkpoint strictly between r and L - 1, and at L - 1 the slot the step's final state goes
  to. That is X itself, moved forward (entry r becomes `NO_BLOCK`: no new slot) when X is held once,
  unregistered and not a policy checkpoint; else a fresh slot. Where the target stays in block r (L - 1 ==
  r), the step updates X in place. A shared X holding part of block r (a fork) is first copied
  (copy-on-write, by `append_token` only: the step writes it in place, or its checkpoint). The slots a
  table already holds past r (all unwritten) are reused before the pool's; admission and `append_token`
  take all the slots or raise, `make_slots` and `mark_computed` as many blocks' worth as the pool has.
  So a sequence holds at most ceil(chunk / (checkpoint_blocks x block_size)) + 3 slots: the checkpoints
  inside its chunk, the prompt's end checkpoint, X and the final state's slot (kv/group_plan.py).
- `after_step` (in `mark_computed`): the step wrote its boundary checkpoints and its final state into
  entry L - 1 (kv/state_steps.py); that slot becomes the running slot at entry (n' - 1) // block_size, the
  checkpoints it completed are registered, and the entries before the new running slot are released.

A prefix hit of k blocks is accepted by the state group iff entry k - 1's checkpoint is cached, so hits
round down to the last checkpoint; the hit slot is the sequence's running slot (shared, registered).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localserve.kv.block_pool import NO_BLOCK, BlockMove, BlockPool

PROMPT_TAIL = 8
"""Tokens at a prompt's end that the next request of a conversation may render differently: a chat template
ends a prompt with the generation prompt (Qwen3.5's `<|im_start|>assistant\\n` then `<think>\\n`, or with
thinking off an empty `<think>\\n\\n</think>\\n\\n`), whose think block the next turn renders otherwise
(dropped or rewritten with the answer), so the next turn's tokens differ from this prompt's 2 tokens before its
end with thinking on, 4 with it off (tests/tokenizer/test_qwen3_5_template.py,
`test_where_a_resent_conversation_differs`). A
checkpoint at the prompt's last boundary lies past that difference whenever the prompt ends fewer tokens
than that past a boundary (1 turn in 8 to 1 in 4 with 16-token blocks), so the prompt's end checkpoint
sits at the last boundary at least this many tokens before its end: with 8, the next turn resumes at most
8 + block_size - 1 tokens before this prompt's end (16 tokens earlier than the last boundary where that one
would have held), where a missed end checkpoint fell back to the last periodic one, up to
`checkpoint_blocks` x block_size tokens back."""


@dataclass(slots=True)
class _Layout:
    """A table's slots for one length: where the running slot goes, which entries need an own unwritten slot."""

    length: int
    running_index: int | None  # None: nothing computed, no running slot
    copy_running: bool  # the running slot is shared and written: copy it first
    reserved: list[int]  # entries needing an own unwritten slot (checkpoints to come, the final state's slot)


@dataclass(frozen=True, slots=True)
class CheckpointPolicy:
    """Which entries of a state table are policy checkpoints, and what a table may look like (module doc)."""

    block_size: int
    checkpoint_blocks: int
    checkpoints: bool  # prefix caching on: policy checkpoints are kept and registered

    def __post_init__(self) -> None:
        if self.checkpoint_blocks < 1:
            raise ValueError(f"state_checkpoint_blocks must be >= 1, got {self.checkpoint_blocks}")

    def is_checkpoint(self, index: int, num_prompt_tokens: int) -> bool:
        """Whether entry `index` (the state after (index + 1) * block_size tokens) is a policy checkpoint."""
        return self.checkpoints and ((index + 1) % self.checkpoint_blocks == 0
                                     or index + 1 == self.prompt_end_blocks(num_prompt_tokens))

    def prompt_end_blocks(self, num_prompt_tokens: int) -> int:
        """The blocks before a prompt's end checkpoint: the last boundary at least `PROMPT_TAIL` tokens before
        its end (0: none, the prompt is shorter than a block and the tail)."""
        return max(0, num_prompt_tokens - PROMPT_TAIL) // self.block_size

    def table_problem(self, table: Sequence[int], num_computed: int, num_tokens: int, num_prompt_tokens: int,
                      own: Callable[[int], bool] | None) -> str | None:
        """What is wrong with a sequence's state table (module doc), or None. `own(slot)`: whether the slot is
        held once and unregistered (None: the table is swapped out, not checked)."""
        length = len(table)
        if length > -(-num_tokens // self.block_size):
            return f"{length} entries for {num_tokens} tokens"
        running = (num_computed - 1) // self.block_size if num_computed else -1
        if length < running + 1:
            return f"{length} entries do not reach the running state of {num_computed} computed tokens"
        if any(slot != NO_BLOCK for slot in table[:max(running, 0)]):
            return f"real entries before entry {running} ({num_computed} computed tokens)"
        moved = num_computed and table[running] == NO_BLOCK
        if length - 1 > running and table[-1] == NO_BLOCK or moved and length - 1 == running:
            return "no slot for the running state"
        for index in range(running + 1, length - 1):
            if table[index] != NO_BLOCK and not self.is_checkpoint(index, num_prompt_tokens):
                return f"entry {index} holds a slot and is not a policy checkpoint"
        if own is not None:
            unwritten = [slot for slot in table[running + 1:] if slot != NO_BLOCK]
            if not all(own(slot) for slot in unwritten):
                return f"slots past the running state {unwritten} are shared or registered"
        return None


class StateGroup:
    """The rules of one manager's state group (module doc) over its pool: pure bookkeeping."""

    __slots__ = ("group", "pool", "block_size", "policy")

    def __init__(self, group: int, pool: BlockPool, policy: CheckpointPolicy) -> None:
        self.group = group
        self.pool = pool
        self.block_size = policy.block_size
        self.policy = policy

    def is_checkpoint(self, index: int, num_prompt_tokens: int) -> bool:
        """Whether entry `index` is a policy checkpoint (`CheckpointPolicy`)."""
        return self.policy.is_checkpoint(index, num_prompt_tokens)

    # ---- reading a table ----
    def running_slot(self, table: Sequence[int], num_computed: int) -> int:
        """The slot holding the state after `num_computed` (> 0) tokens: entry r's, else the moved one at the end."""
        running = table[(num_computed - 1) // self.block_size]
        return running if running != NO_BLOCK else table[-1]

    def coverage(self, table: Sequence[int], num_computed: int, num_tokens: int) -> int:
        """Leading tokens a step may compute with this table: up to its last block, none past the computed
        ones where the step would write a shared running slot in place (a fork before `append_token`)."""
        if num_computed % self.block_size and len(table) - 1 == (num_computed - 1) // self.block_size \
                and self.pool.ref_counts[table[-1]] > 1:
            return num_computed
        return min(num_tokens, len(table) * self.block_size)

    # ---- granting slots ----
    def _layout(self, table: Sequence[int], num_computed: int, num_prompt_tokens: int, length: int) -> _Layout:
        block_size = self.block_size
        if num_computed == 0:
            reserved = [index for index in range(length - 1) if self.is_checkpoint(index, num_prompt_tokens)]
            return _Layout(length, None, False, reserved + [length - 1] if length else [])
        running = (num_computed - 1) // block_size
        slot = self.running_slot(table, num_computed)
        shared = self.pool.ref_counts[slot] > 1
        partial = num_computed % block_size != 0
        if length - 1 == running:  # the step's tokens stay in block r: X is written in place
            return _Layout(length, running, partial and shared, [])
        copy = partial and shared  # X receives entry r's checkpoint or moves on: it must be its own
        between = [index for index in range(running + 1, length - 1) if self.is_checkpoint(index, num_prompt_tokens)]
        movable = (copy or not shared) and self.pool.block_hashes[slot] is None \
            and not self.is_checkpoint(running, num_prompt_tokens)
        if movable:
            return _Layout(length, length - 1, copy, between)
        return _Layout(length, running, copy, between + [length - 1])

    def _num_takes(self, table: Sequence[int], num_computed: int, layout: _Layout) -> int:
        return max(0, len(layout.reserved) + layout.copy_running - len(self._spare_slots(table, num_computed)))

    def _spare_slots(self, table: Sequence[int], num_computed: int) -> list[tuple[int, int]]:
        """(entry, slot) of the table's own unwritten slots: every real entry but the running slot (none lies
        before the running entry, so only the entries from there on are read: a chunk's, not the context's)."""
        if not num_computed:
            return [(index, slot) for index, slot in enumerate(table) if slot != NO_BLOCK]
        running_index = (num_computed - 1) // self.block_size
        running = self.running_slot(table, num_computed)
        return [(index, table[index]) for index in range(running_index, len(table))
                if table[index] != NO_BLOCK and table[index] != running]

    def _length_bounds(self, table: Sequence[int], num_computed: int, num_target_tokens: int) -> tuple[int, int]:
        shortest = (num_computed - 1) // self.block_size + 1 if num_computed else 0
        return shortest, max(shortest, -(-num_target_tokens // self.block_size))

    def num_slots_to_grant(self, table: Sequence[int], num_computed: int, num_prompt_tokens: int,
                           num_target_tokens: int) -> int:
        """Slots `grant(..., exact=True)` takes from the pool for tokens up to `num_target_tokens`."""
        length = self._length_bounds(table, num_computed, num_target_tokens)[1]
        return self._num_takes(table, num_computed, self._layout(table, num_computed, num_prompt_tokens, length))

    def grant(self, table: list[int], num_computed: int, num_prompt_tokens: int, num_target_tokens: int,
              exact: bool) -> tuple[list[int], list[BlockMove]] | None:
        """The table with slots for tokens up to `num_target_tokens` (module doc), and the copy-on-write to
        make first. `exact`: all of them or None (nothing changed); else as many blocks' worth as the pool has
        now, and never a copy (the caller cannot pass one on)."""
        shortest, length = self._length_bounds(table, num_computed, num_target_tokens)
        layout = self._layout(table, num_computed, num_prompt_tokens, length)
        available = self.pool.num_available_blocks
        if self._num_takes(table, num_computed, layout) > available or (layout.copy_running and not exact):
            if exact:
                return None
            low, high = shortest, length - 1  # the longest that fits: takes grow with the length
            while low < high:
                middle = (low + high + 1) // 2
                candidate = self._layout(table, num_computed, num_prompt_tokens, middle)
                if self._num_takes(table, num_computed, candidate) <= available and not candidate.copy_running:
                    low = middle
                else:
                    high = middle - 1
            layout = self._layout(table, num_computed, num_prompt_tokens, low)
            if layout.copy_running:  # a shared running slot written in place: no slots until append_token
                return table, []
        return self._apply(table, num_computed, layout)

    def _apply(self, table: list[int], num_computed: int, layout: _Layout) -> tuple[list[int], list[BlockMove]]:
        pool = self.pool
        spares = self._spare_slots(table, num_computed)
        laid_out = layout.length == len(table) and not layout.copy_running and (
            layout.running_index is None or table[layout.running_index] == self.running_slot(table, num_computed))
        if laid_out and [index for index, _ in spares] == layout.reserved:
            return table, []  # laid out already (most steps): the same list
        kept = {index: slot for index, slot in spares if index in layout.reserved}
        free_spares = [slot for index, slot in spares if index not in kept]
        new_table = [NO_BLOCK] * layout.length
        moves: list[BlockMove] = []
        if layout.running_index is not None:
            running = self.running_slot(table, num_computed)
            if layout.copy_running:
                copy = free_spares.pop() if free_spares else pool.take_free_block()
                moves.append((running, copy, self.group))
                pool.release([running])
                running = copy
            new_table[layout.running_index] = running
        for index in layout.reserved:
            new_table[index] = kept.get(index) if index in kept else (
                free_spares.pop() if free_spares else pool.take_free_block())
        pool.release(free_spares)
        return new_table, moves

    # ---- after a speculative verification ----
    def cut(self, table: list[int], num_tokens: int) -> list[int]:
        """The table of a step that was laid out past `num_tokens` (a verify row) but whose states were
        written as a step ending at `num_tokens` (kv/state_steps.py, `kept_state_slots`): the final state's
        slot, its last entry, moves to the entry of the block holding token `num_tokens - 1`, and the slots of
        the entries from there on (unwritten, or the running slot that slot replaces) are released; the same
        list when nothing is dropped. `after_step` then reads it as after such a step."""
        keep = -(-num_tokens // self.block_size)
        if len(table) <= keep:
            return table
        final = table[-1]
        if final == NO_BLOCK:
            raise ValueError(f"state table {table} has no final state's slot to keep for {num_tokens} tokens")
        self.pool.release([slot for slot in reversed(table[keep - 1:-1]) if slot != NO_BLOCK])
        return table[:keep - 1] + [final]

    # ---- after a step ----
    def after_step(self, table: list[int], num_before: int, num_computed: int, num_prompt_tokens: int,
                   register: Callable[[int, int], None]) -> list[int]:
        """The table once the step that computed tokens [num_before, num_computed) wrote its states
        (kv/state_steps.py): its final state's slot becomes the running slot, the policy checkpoints it
        completed are registered (`register(entry, slot)`), the entries before the running one released."""
        if num_computed == num_before:
            return table
        block_size = self.block_size
        final_index = len(table) - 1
        final = table[final_index]
        running = (num_computed - 1) // block_size
        for index in range(num_before // block_size, running):  # boundaries strictly inside the step
            if table[index] != NO_BLOCK and index != final_index and self.is_checkpoint(index, num_prompt_tokens):
                register(index, table[index])
        if num_computed % block_size == 0 and self.is_checkpoint(running, num_prompt_tokens):
            register(running, final)
        first = (num_before - 1) // block_size if num_before else 0  # no real entry lies before it
        released = [table[index] for index in range(first, running + 1)
                    if index != final_index and table[index] != NO_BLOCK]
        if not released and final_index == running:
            return table  # a step in place (a decode inside a block): the same list
        new_table = [NO_BLOCK] * running + [final] + table[running + 1:]
        if final_index > running:
            new_table[final_index] = NO_BLOCK
        self.pool.release(released)
        return new_table
