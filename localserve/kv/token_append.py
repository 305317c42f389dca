"""Growing a sequence by one token: the work of the block manager's `append_token` (kv/block_manager.py),
and what it takes, counted before a step for `num_blocks_to_append` and `can_append`. No torch: the block
copies are returned, (source, destination, group), for the KV pool to make.

The token's KV is written by the next forward pass. In each group whose table covers the sequence's
tokens (a window or state group whose table stops short of them, a prompt not yet computed, gives no slot
here: kv/group_slots.py) it takes a new block when the last one is full, and a copy of a shared, partly
filled last block (copy-on-write, after a `fork`; the other holders keep the original); the state group
grants a new block's slot by its own rules (kv/state_group.py, `grant`). Writers into one shared last block
need a copy each, except that when all its holders write, the last one finds itself sole owner and writes
in place.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from localserve.kv.block_pool import BlockMove, BlockPool
from localserve.kv.out_of_blocks import OutOfBlocksError
from localserve.kv.sequence_blocks import SequenceBlocks, gpu_sequence
from localserve.kv.state_group import StateGroup


def num_blocks_to_append(pools: Sequence[BlockPool], state: StateGroup | None, block_size: int,
                         seqs: Mapping[int, SequenceBlocks], seq_ids: Iterable[int]) -> list[int]:
    """Per group, the blocks taken from its free queue if each of these sequences appends one token, in any
    order (module doc)."""
    num_blocks = [0] * len(pools)
    writers_per_shared_block: dict[tuple[int, int], int] = {}  # (group, block) -> writers
    for seq_id in seq_ids:
        seq = seqs[seq_id]
        if seq.is_swapped:
            gpu_sequence(seqs, seq_id)  # raises
        covers = [len(table) * block_size >= seq.num_tokens for table in seq.block_tables]
        if state is not None and covers[state.group] and seq.num_tokens % block_size == 0:
            covers[state.group] = False  # a new block's slot: the state group's rules
            num_blocks[state.group] += state.num_slots_to_grant(
                seq.block_tables[state.group], seq.num_computed_tokens, seq.num_prompt_tokens, seq.num_tokens + 1)
        if seq.num_tokens % block_size == 0:
            num_blocks = [count + covered for count, covered in zip(num_blocks, covers, strict=True)]
        elif seq.may_share_last_block:
            for group, (pool, table) in enumerate(zip(pools, seq.block_tables, strict=True)):
                if covers[group] and pool.ref_counts[table[-1]] > 1:
                    key = (group, table[-1])
                    writers_per_shared_block[key] = writers_per_shared_block.get(key, 0) + 1
    for (group, block_id), num_writers in writers_per_shared_block.items():
        holders = pools[group].ref_counts[block_id]
        num_blocks[group] += num_writers if num_writers < holders else num_writers - 1
    return num_blocks


def append_token(pools: Sequence[BlockPool], state: StateGroup | None, block_size: int, seq: SequenceBlocks,
                 seq_id: int, token_id: int) -> list[BlockMove]:
    """Grow the sequence (on the GPU, named `seq_id`) by one token (module doc); returns the block copies to
    make first, each one copy-on-write. Raises `OutOfBlocksError`, changing nothing, where a pool is short."""
    num_tokens = seq.num_tokens
    if not seq.shares_token_ids:
        seq.token_ids.append(token_id)
    elif len(seq.token_ids) <= num_tokens:
        raise ValueError(f"sequence {seq_id}: append token {num_tokens} to the shared token list first")
    needs_new_block = num_tokens % block_size == 0
    # A window or state group whose table stops short of the tokens (a prompt not yet computed) gives no
    # slot here.
    covers = [len(table) * block_size >= num_tokens for table in seq.block_tables]
    if not needs_new_block and (not seq.may_share_last_block or all(
            pool.ref_counts[table[-1]] == 1 for pool, table, covered in zip(pools, seq.block_tables, covers,
                                                                            strict=True) if covered)):
        seq.num_tokens = num_tokens + 1  # the common case: room in its own last block
        seq.may_share_last_block = False  # its other holders, if any, have left
        return []
    writes_copy = [covered and (needs_new_block or pool.ref_counts[table[-1]] > 1)
                   for pool, table, covered in zip(pools, seq.block_tables, covers, strict=True)]
    grants_state = state is not None and writes_copy[state.group]
    if grants_state:
        writes_copy[state.group] = False  # the state group's rules, below
    if any(needs and not pool.free_queue for needs, pool in zip(writes_copy, pools, strict=True)) or (
            grants_state and state.num_slots_to_grant(seq.block_tables[state.group], seq.num_computed_tokens,
                                                      seq.num_prompt_tokens, num_tokens + 1)
            > state.pool.num_available_blocks):
        if not seq.shares_token_ids:
            seq.token_ids.pop()  # changes nothing
        raise OutOfBlocksError(f"sequence {seq_id} needs a block, none available")
    seq.num_tokens = num_tokens + 1
    seq.may_share_last_block = False  # a new block, or a copy of its last: its own
    copies = []
    if grants_state:
        seq.block_tables[state.group], copies = state.grant(
            seq.block_tables[state.group], seq.num_computed_tokens, seq.num_prompt_tokens, num_tokens + 1,
            exact=True)
    for group, (pool, block_table) in enumerate(zip(pools, seq.block_tables, strict=True)):
        if not writes_copy[group]:
            continue
        block_id = pool.take_free_block()
        if needs_new_block:
            block_table.append(block_id)
            continue
        pool.ref_counts[block_table[-1]] -= 1  # stays >= 1: the other holders keep it
        copies.append((block_table[-1], block_id, group))
        block_table[-1] = block_id
    return copies
