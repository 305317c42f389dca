"""A block manager keeping the caller's token list (share_token_ids) against one keeping its own copy."""

from __future__ import annotations

import random

import pytest

from localserve.kv.block_manager import BlockManager
from localserve.kv.out_of_blocks import OutOfBlocksError


def test_shared_token_list_behaves_as_a_copied_one() -> None:
    rng = random.Random(0)
    copied, shared = BlockManager(num_blocks=8, block_size=4), BlockManager(num_blocks=8, block_size=4)
    tokens = [rng.randrange(50) for _ in range(6)]
    assert copied.allocate(1, tokens) == shared.allocate(1, tokens, share_token_ids=True) == 0
    for manager in (copied, shared):
        manager.mark_computed(1, 6)
    child_tokens = list(tokens)
    copied.fork(1, 2)
    shared.fork(1, 2, child_tokens)
    with pytest.raises(ValueError, match="not sequence 1's"):
        shared.fork(1, 3, [99] + tokens[1:])
    for _ in range(10):  # 16 tokens each: 4 blocks each, the first shared, 7 in all
        for seq_id, own in ((1, tokens), (2, child_tokens)):
            token = rng.randrange(50)
            with pytest.raises(ValueError, match="shared token list first"):
                shared.append_token(seq_id, token)  # the caller appends first
            own.append(token)
            assert copied.append_token(seq_id, token) == shared.append_token(seq_id, token)
            assert copied.num_tokens(seq_id) == shared.num_tokens(seq_id) == len(own)
            for manager in (copied, shared):
                manager.mark_computed(seq_id, len(own))
    tokens.append(7)  # a pending token the manager has not been told of yet
    for manager in (copied, shared):
        manager.check_integrity()
    assert copied.snapshot() == shared.snapshot()
    assert shared.num_tokens(1) == len(tokens) - 1 == 16
    shared.append_token(1, 7)  # takes the last block
    child_tokens.append(8)
    with pytest.raises(OutOfBlocksError):  # and none is left for sequence 2's fifth
        shared.append_token(2, 8)
    shared.check_integrity()
    assert shared.num_tokens(2) == 16
    shared.free(1)
    shared.free(2)
    assert shared.num_available_blocks == 8
