"""FreeBlockQueue against an OrderedDict of block ids (the eager queue it replaces), on generated operations."""

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.kv.free_queue import FreeBlockQueue

NUM_BLOCKS = 6
# (operation, block): take the head, free a block not in the queue, or take a block out of the middle.
operations = st.lists(st.tuples(st.sampled_from(["pop", "append", "delete"]), st.integers(0, NUM_BLOCKS - 1)),
                      max_size=200)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_free_queue_matches_an_ordered_dict(ops: list[tuple[str, int]]) -> None:
    queue, reference = FreeBlockQueue(NUM_BLOCKS), OrderedDict.fromkeys(range(NUM_BLOCKS))
    for op, block_id in ops:
        if op == "pop" and reference:
            assert queue.popleft() == reference.popitem(last=False)[0]
        elif op == "append" and block_id not in reference:
            queue.append(block_id)
            reference[block_id] = None
        elif op == "delete" and block_id in reference:
            del queue[block_id]
            del reference[block_id]
        assert list(queue) == list(reference) and len(queue) == len(reference)
        assert all((b in queue) == (b in reference) for b in range(NUM_BLOCKS))


def test_mostly_stale_queue_is_rebuilt_in_order_and_refuses_what_it_lacks() -> None:
    queue = FreeBlockQueue(2000)
    for block_id in range(1500):  # prefix hits taking cached blocks out of the middle, again and again
        del queue[block_id]
        queue.append(block_id)
        del queue[block_id]
    assert len(queue._entries) <= 1024 + 2 * len(queue)  # stale entries were dropped on the way
    assert list(queue) == list(range(1500, 2000))
    assert queue.popleft() == 1500
    with pytest.raises(KeyError):
        del queue[1500]
    queue.extend([7, 3])
    assert list(queue)[-2:] == [7, 3]
    for _ in range(len(queue)):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
