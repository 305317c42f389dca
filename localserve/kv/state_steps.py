"""Which state slots one step of a sequence reads and writes, from its state group's block table. No torch.

A state group's table (kv/layer_groups.py, kind "state") has one entry per logical block like any group,
`NO_BLOCK` except at: checkpoints (entry i: the state after the first (i + 1) * block_size tokens, kept
for the prefix cache) and the running state. With `num_computed` tokens computed and `num_new` to compute
this step:

- read: nothing (-1, zeros) when num_computed == 0; else entry r = (num_computed - 1) // block_size where it
  is a slot; else the running slot was moved ahead by the block manager (it gave the sequence no new slot):
  the step reads and updates it in place at the last entry f = (num_computed + num_new - 1) // block_size.
- write: for each block boundary strictly inside the step's tokens whose entry is a slot, the state after
  that boundary (a checkpoint); last, always, the state after all the step's tokens into entry f.
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
    last = (end - 1) // block_size
    if last >= len(table) or table[last] == NO_BLOCK:
        raise ValueError(f"state table {list(table)} has no slot for the running state at entry {last}")
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
