"""The integrity check of the block manager's books, read through their public view (kv/block_books.py).

Run by the tests after every operation and, with `EngineConfig.check_integrity`, after every engine
step. The manager's parts check their own books besides (`CpuSwapPool.check_integrity`,
`Followers.check_integrity`); this checks the manager's books and how the parts agree with them.
"""

from __future__ import annotations

from localserve.kv.block_books import BlockBooks
from localserve.kv.block_hash import hash_payload


def check_integrity(books: BlockBooks) -> None:
    """Raise AssertionError, saying what is wrong, unless every invariant of the pools holds.

    free + cached + used == total; a block is in the free queue exactly when its count is 0; every
    GPU and CPU ref count equals the number of block tables pointing at the block; the prefix-cache
    map and the blocks' keys agree and each key matches the contents behind it; each sequence's
    keys match its tokens; each block table covers exactly its sequence's tokens; a follower shares
    its leader's blocks and has not caught up yet.
    """
    block_size = books.block_size
    table_refs = {False: [0] * books.num_blocks, True: [0] * len(books.swap_holder_counts)}  # by is_swapped
    for seq_id, seq in books.sequences.items():
        num_distinct_blocks = len(set(seq.block_table))
        _check(seq.num_tokens == len(seq.token_ids) or seq.shares_token_ids and seq.num_tokens < len(seq.token_ids),
               f"seq {seq_id}: {seq.num_tokens} tokens counted, {len(seq.token_ids)} in its list")
        _check(len(seq.block_table) == num_distinct_blocks == -(-seq.num_tokens // block_size),
               f"seq {seq_id}: {len(seq.block_table)} blocks ({num_distinct_blocks} distinct) for "
               f"{seq.num_tokens} tokens")
        num_keys = seq.num_computed_tokens // block_size if books.enable_prefix_caching else 0
        _check(0 <= seq.num_computed_tokens <= seq.num_tokens and len(seq.block_hashes) == num_keys,
               f"seq {seq_id}: {seq.num_computed_tokens} computed tokens, {len(seq.block_hashes)} keys")
        for index, block_hash in enumerate(seq.block_hashes):
            _check(hash_payload(seq.block_payload(index, block_size)) == block_hash,
                   f"seq {seq_id}: key of block {index} does not match its tokens")
        for index, block_id in enumerate(seq.block_table):
            table_refs[seq.is_swapped][block_id] += 1
            registered_hash = None if seq.is_swapped else books.block_hashes[block_id]
            _check(registered_hash is None or seq.block_hashes[index:index + 1] == [registered_hash],
                   f"seq {seq_id}: block {block_id} is registered under another key")
    for seq_id, link in books.followers.items():  # shares blocks its leader has not computed yet
        seq, leader = books.sequences.get(seq_id), books.sequences.get(link.leader_id)
        num_shared = link.num_shared_blocks
        _check(seq is not None and leader is not None and leader.is_swapped == seq.is_swapped
               and leader.block_table[:num_shared] == seq.block_table[:num_shared]
               and seq.num_computed_tokens < num_shared * block_size,
               f"seq {seq_id}: not a follower of seq {link.leader_id}")
    for seq_id, seq in books.sequences.items():
        _check(seq.may_share_last_block or not seq.num_tokens % block_size
               or table_refs[seq.is_swapped][seq.block_table[-1]] == 1,
               f"seq {seq_id}: its partly filled last block has other holders and is not marked as shared")
    num_cached = 0
    for block_id, (count, block_hash, content) in enumerate(
            zip(books.ref_counts, books.block_hashes, books.block_contents, strict=True)):
        num_tables = table_refs[False][block_id]
        _check(count == num_tables, f"block {block_id}: ref count {count}, {num_tables} tables")
        in_free_queue = block_id in books.free_queue
        _check(in_free_queue == (count == 0), f"block {block_id}: count {count}, free: {in_free_queue}")
        _check((block_hash is None) == (content is None), f"block {block_id}: key and contents disagree")
        if block_hash is not None:
            _check(content is not None and hash_payload(content) == block_hash,
                   f"block {block_id}: key does not match its contents")
            _check(books.hash_to_block.get(block_hash) == block_id, f"block {block_id}: key maps away")
            num_cached += count == 0
    for block_hash, block_id in books.hash_to_block.items():
        _check(books.block_hashes[block_id] == block_hash, f"prefix-cache map names block {block_id}")
    _check(num_cached == books.num_cached_blocks, f"{num_cached} cached blocks, {books.num_cached_blocks} counted")
    num_free = len(books.free_queue) - books.num_cached_blocks
    num_used = books.num_blocks - len(books.free_queue)
    _check(num_free + num_cached + num_used == books.num_blocks,
           f"free {num_free} + cached {num_cached} + used {num_used} != {books.num_blocks}")
    _check(list(books.swap_holder_counts) == table_refs[True],
           f"CPU ref counts {list(books.swap_holder_counts)}, tables pointing at each block {table_refs[True]}")


def _check(condition: bool, message: str) -> None:
    # Not `assert`: the checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
