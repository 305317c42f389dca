"""The runner's block tables kept between steps equal the tables copied whole, step after step.

Generated steps change tables the ways the block manager does (a new last block, a copy-on-write of
the last block, a new list after swap-in or readmission), schedule random subsets of the sequences,
and mix in one-off chunks without a sequence id; each step's gathered array must equal the tables
padded with zeros.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.engine.block_tables import BlockTableRows


def padded(tables: list[list[int]]) -> np.ndarray:
    width = max(1, max(len(table) for table in tables))
    return np.array([table + [0] * (width - len(table)) for table in tables], np.int64)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_kept_rows_equal_whole_copies(data):
    rows = BlockTableRows(num_rows=2, width=2)  # small, so rows and width grow too
    tables = {seq_id: [data.draw(st.integers(0, 99))] for seq_id in range(6)}
    for _ in range(data.draw(st.integers(1, 12))):
        for seq_id in tables:
            change = data.draw(st.sampled_from(["none", "none", "append", "copy-on-write", "new list"]))
            table = tables[seq_id]
            if change == "append":
                table.append(data.draw(st.integers(0, 99)))
            elif change == "copy-on-write":
                table[-1] = data.draw(st.integers(0, 99))
            elif change == "new list":
                tables[seq_id] = data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=9))
        step = data.draw(st.lists(st.sampled_from(sorted(tables)), unique=True, min_size=1))
        one_off = data.draw(st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=5), max_size=2))
        seq_ids = [*step, *[None] * len(one_off)]
        step_tables = [tables[seq_id] for seq_id in step] + one_off
        assert np.array_equal(rows.gather(seq_ids, step_tables), padded(step_tables))
