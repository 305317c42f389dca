"""Read-only views of the block manager's books, kept beside it: the integrity check (run by the tests
after every operation and, with `EngineConfig.check_integrity`, after every engine step) and the pool
snapshot the monitor shows. Both read the manager's private state on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from localserve.kv.block_hash import hash_payload

if TYPE_CHECKING:
    from localserve.kv.block_manager import BlockManager


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """State of every block, for the monitor.

    `block_states` has one character per GPU block, indexed by block id: '.' free, 'c' cached (free,
    contents kept for the prefix cache), 'u' used by one block table, 's' shared by several.
    `ref_counts[i]` is the number of block tables pointing at GPU block i. `cpu_block_states` maps the
    CPU swap pool the same way ('.', 'u' or 's').
    """

    block_states: str
    ref_counts: tuple[int, ...]
    cpu_block_states: str


def pool_snapshot(manager: BlockManager) -> BlockPoolSnapshot:
    states = "".join(".us"[min(count, 2)] if count or block_hash is None else "c"
                     for count, block_hash in zip(manager._ref_counts, manager._block_hashes, strict=True))
    cpu_states = "".join(".us"[min(count, 2)] for count in manager._cpu_pool.ref_counts)
    return BlockPoolSnapshot(states, tuple(manager._ref_counts), cpu_states)


def check_integrity(manager: BlockManager) -> None:
    """Raise AssertionError, saying what is wrong, unless every invariant of the pools holds.

    free + cached + used == total; a block is in the free queue exactly when its count is 0; every
    GPU and CPU ref count equals the number of block tables pointing at the block; the prefix-cache
    map and the blocks' keys agree and each key matches the contents behind it; each sequence's
    keys match its tokens; each block table covers exactly its sequence's tokens; a follower shares
    its leader's blocks and has not caught up yet.
    """
    table_refs = {False: [0] * manager.num_blocks, True: [0] * manager.num_cpu_blocks}  # by is_swapped
    for seq_id, seq in manager._seqs.items():
        num_distinct_blocks = len(set(seq.block_table))
        _check(seq.num_tokens == len(seq.token_ids) or seq.shares_token_ids and seq.num_tokens < len(seq.token_ids),
               f"seq {seq_id}: {seq.num_tokens} tokens counted, {len(seq.token_ids)} in its list")
        _check(len(seq.block_table) == num_distinct_blocks == manager._num_blocks_for(seq.num_tokens),
               f"seq {seq_id}: {len(seq.block_table)} blocks ({num_distinct_blocks} distinct) for "
               f"{seq.num_tokens} tokens")
        num_keys = seq.num_computed_tokens // manager.block_size if manager.enable_prefix_caching else 0
        _check(0 <= seq.num_computed_tokens <= seq.num_tokens and len(seq.block_hashes) == num_keys,
               f"seq {seq_id}: {seq.num_computed_tokens} computed tokens, {len(seq.block_hashes)} keys")
        for index, block_hash in enumerate(seq.block_hashes):
            _check(hash_payload(manager._block_content(seq, index)) == block_hash,
                   f"seq {seq_id}: key of block {index} does not match its tokens")
        if seq.leader is not None:  # shares blocks its leader has not computed yet
            leader = manager._seqs.get(seq.leader)
            _check(leader is not None and seq_id in leader.followers and leader.is_swapped == seq.is_swapped
                   and leader.block_table[:seq.num_shared_blocks] == seq.block_table[:seq.num_shared_blocks]
                   and seq.num_computed_tokens < seq.num_shared_blocks * manager.block_size,
                   f"seq {seq_id}: not a follower of seq {seq.leader}")
        _check(all(manager._seqs[f].leader == seq_id for f in seq.followers), f"seq {seq_id}: stray followers")
        for index, block_id in enumerate(seq.block_table):
            table_refs[seq.is_swapped][block_id] += 1
            registered_hash = None if seq.is_swapped else manager._block_hashes[block_id]
            _check(registered_hash is None or seq.block_hashes[index:index + 1] == [registered_hash],
                   f"seq {seq_id}: block {block_id} is registered under another key")
    for seq_id, seq in manager._seqs.items():
        _check(seq.may_share_last_block or not seq.num_tokens % manager.block_size
               or table_refs[seq.is_swapped][seq.block_table[-1]] == 1,
               f"seq {seq_id}: its partly filled last block has other holders and is not marked as shared")
    num_cached = 0
    for block_id, (count, block_hash, content) in enumerate(
            zip(manager._ref_counts, manager._block_hashes, manager._block_contents, strict=True)):
        num_tables = table_refs[False][block_id]
        _check(count == num_tables, f"block {block_id}: ref count {count}, {num_tables} tables")
        in_free_queue = block_id in manager._free_queue
        _check(in_free_queue == (count == 0), f"block {block_id}: count {count}, free: {in_free_queue}")
        _check((block_hash is None) == (content is None), f"block {block_id}: key and contents disagree")
        if block_hash is not None:
            _check(content is not None and hash_payload(content) == block_hash,
                   f"block {block_id}: key does not match its contents")
            _check(manager._hash_to_block.get(block_hash) == block_id, f"block {block_id}: key maps away")
            num_cached += count == 0
    for block_hash, block_id in manager._hash_to_block.items():
        _check(manager._block_hashes[block_id] == block_hash, f"prefix-cache map names block {block_id}")
    _check(num_cached == manager._num_cached_blocks,
           f"{num_cached} cached blocks, {manager._num_cached_blocks} counted")
    num_free, num_used = manager.num_free_blocks, manager.num_used_blocks
    _check(num_free + num_cached + num_used == manager.num_blocks,
           f"free {num_free} + cached {num_cached} + used {num_used} != {manager.num_blocks}")
    _check(manager._cpu_pool.ref_counts == table_refs[True],
           f"CPU ref counts {manager._cpu_pool.ref_counts}, tables pointing at each block {table_refs[True]}")
    unused_cpu_blocks = [block_id for block_id, count in enumerate(manager._cpu_pool.ref_counts) if count == 0]
    _check(sorted(manager._cpu_pool.free_block_ids) == unused_cpu_blocks, "CPU free list != CPU blocks with count 0")


def _check(condition: bool, message: str) -> None:
    # Not `assert`: the checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
