"""Which state slots one step of a sequence reads and writes, from its state group's block table. No torch.

A state group's table (kv/layer_groups.py, kind "state"; kv/state_group.py keeps it) has one entry per
logical block like any group, `NO_BLOCK` except at: checkpoints (entry i: the state after the first
(i + 1) * block_size tokens, kept for the prefix cache), the running state and, last, the slot the step's
final state goes to. With `num_computed` tokens computed and `num_new` to compute this step, and f the
table's last entry (the table reaches the step's last block, (num_computed + num_new - 1) // block_size):

- read: nothing (-1, zeros) when num_computed == 0; else entry r = (num_computed - 1) // block_size where it
  is a slot; else the running slot was moved ahead by the block manager (it gave the sequence no new slot):
  the step reads and updates it in place at entry f.
- write: for each block boundary strictly inside the step's tokens whose entry is a slot other than f, the
  state after that boundary (a checkpoint); last, always, the state after all the step's tokens into entry f.

Entry f is the step's last block's entry whenever the step computes every token the table has slots for
(each decode; a prefill chunk the step's token budget does not cut short); a step that ends earlier leaves
its state in f, and `BlockManager.mark_computed` then puts that slot at the entry of the step's last block.
"""

from __future__ import annotations

from collections.abc import Sequence

from localserve.kv.block_pool import NO_BLOCK


def step_state_slots(table: Sequence[int], num_computed: int, num_new: int,
                     block_size: int) -> tuple[int, list[tuple[int, int]]]:
    """(read slot or -1, [(tokens of the step after which, slot), ...]) for one sequence's step (module doc).

    Raises ValueError when the table has no slot where the step must write."""
    if num_new < 1:
        raise ValueError(f"a step computes at least one token, got {num_new}")
    end = num_computed + num_new
    last = len(table) - 1
    if last < (end - 1) // block_size or table[last] == NO_BLOCK:
        raise ValueError(f"state table {list(table)} has no slot for the running state after token {end} "
                         f"(its last entry must be a slot at block {(end - 1) // block_size} or later)")
    if num_computed == 0:
        read = -1
    else:
        running = (num_computed - 1) // block_size
        read = table[running] if table[running] != NO_BLOCK else table[last]
    saves = []
    first_boundary = num_computed // block_size + 1  # boundaries b * block_size with b >= this lie past num_computed
    for boundary in range(first_boundary, -(-end // block_size)):
        if boundary * block_size < end and table[boundary - 1] != NO_BLOCK and boundary - 1 != last:
            saves.append((boundary * block_size - num_computed, table[boundary - 1]))
    saves.append((num_new, table[last]))
    return read, saves


def kept_state_slots(saves: Sequence[tuple[int, int]], num_kept: int) -> list[tuple[int, int]]:
    """The writes of a step of which only the first `num_kept` tokens stay (a speculative verify row: its
    last real token and the accepted drafted tokens), from `saves`, the writes `step_state_slots` gave the
    whole step: its checkpoints strictly inside the kept tokens, and the state after them into the final
    state's slot (the table's last entry), as if the step had computed `num_kept` tokens. The block manager
    then treats the table as after such a step (`BlockManager.truncate`, then `mark_computed`)."""
    if not 1 <= num_kept <= saves[-1][0]:
        raise ValueError(f"a step of {saves[-1][0]} tokens keeps 1 to {saves[-1][0]} of them, got {num_kept}")
    return [(tokens, slot) for tokens, slot in saves[:-1] if tokens < num_kept] + [(num_kept, saves[-1][1])]
