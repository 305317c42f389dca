"""The model runner's copy of the block tables, kept between steps as one padded array (numpy, no torch).

Each step's chunks carry the block manager's own table lists (engine/step.py). Copying every table into
an array every step would read each block id of every running sequence every step, O(context) per
sequence; instead each sequence keeps a row here, and a step writes only what changed since the
sequence's last step. Between two steps of a sequence its table changes only at its end (a new last
block, or a copy-on-write of its last block) or is replaced by another list (swap-in, readmission, a
truncation that dropped blocks: kv/block_manager.py, `truncate`):
so a row is rewritten from its last mirrored entry when that entry differs, whole when the list is
another, and otherwise only its new entries are appended. A sequence missing from a step loses its
row (it is rewritten whole if it comes back), so rows never outlive their sequences; a row is zeroed
when given back, so entries past a sequence's blocks are 0, as in a freshly padded array.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class _Row:
    __slots__ = ("index", "table", "num_mirrored", "last_block", "step")

    def __init__(self, index: int) -> None:
        self.index = index
        self.table: list[int] | None = None  # the block manager's list this row mirrors
        self.num_mirrored = 0
        self.last_block = -1  # table[num_mirrored - 1] when mirrored
        self.step = 0  # the last step that gathered it


class BlockTableRows:
    """Rows of block ids by sequence id; `gather` returns a step's tables [num_seqs, widest] as int64."""

    def __init__(self, num_rows: int = 64, width: int = 64) -> None:
        self._array = np.zeros((num_rows, width), np.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._rows: dict[int, _Row] = {}
        self._step = 0

    def gather(self, seq_ids: Sequence[int | None], tables: Sequence[list[int]]) -> np.ndarray:
        """The step's tables in order, zero-padded; a None seq id is not kept for the next step."""
        self._step = step = self._step + 1
        rows = self._rows
        released: list[_Row] = []  # rows of chunks without a sequence id: this step only
        indices = []
        widest = 1
        for seq_id, table in zip(seq_ids, tables):
            row = rows.get(seq_id) if seq_id is not None else None
            if row is None:
                row = _Row(self._take_row())
                if seq_id is None:
                    released.append(row)
                else:
                    rows[seq_id] = row
            row.step = step
            num_blocks = len(table)
            # Most steps of most sequences change nothing: the same list, as long, ending in the same block.
            if row.table is not table or row.num_mirrored != num_blocks or (num_blocks and table[-1] != row.last_block):
                self._mirror(row, table)
            if num_blocks > widest:
                widest = num_blocks
            indices.append(row.index)
        tables_array = self._array[indices, :widest]
        if len(rows) + len(released) > len(indices):  # some sequences left since the last step
            released += [rows.pop(seq_id) for seq_id in [s for s, row in rows.items() if row.step != step]]
        for row in released:  # their rows go back, zeroed
            self._array[row.index, :row.num_mirrored] = 0
            self._free_rows.append(row.index)
        return tables_array

    def _mirror(self, row: _Row, table: list[int]) -> None:
        """Write what changed of `table` into the row: its new entries, a replaced last block, or all of it."""
        num_blocks = len(table)
        start = row.num_mirrored
        if row.table is not table or start > num_blocks:
            self._array[row.index, num_blocks:start] = 0  # a shorter list than the one mirrored
            start = 0
        elif start and table[start - 1] != row.last_block:
            start -= 1  # its last block was copied on write
        if start < num_blocks:
            if num_blocks > self._array.shape[1]:
                self._widen(num_blocks)
            self._array[row.index, start:num_blocks] = table[start:]
        row.table, row.num_mirrored, row.last_block = table, num_blocks, table[-1] if table else -1

    def _take_row(self) -> int:
        if not self._free_rows:
            grown = self._array.shape[0]
            self._array = np.concatenate([self._array, np.zeros_like(self._array)])
            self._free_rows = list(range(2 * grown - 1, grown - 1, -1))
        return self._free_rows.pop()

    def _widen(self, width: int) -> None:
        wider = np.zeros((self._array.shape[0], max(width, 2 * self._array.shape[1])), np.int64)
        wider[:, :self._array.shape[1]] = self._array
        self._array = wider
