"""The integrity check of the block manager's books, read through their public view (kv/block_books.py).

Run by the tests after every operation and, with `EngineConfig.check_integrity`, after every engine
step. The manager's parts check their own books besides (`CpuSwapPool.check_integrity`,
`Followers.check_integrity`); this checks the manager's books and how the parts agree with them.
"""

from __future__ import annotations

from localserve.kv.block_books import BlockBooks, PoolBooks
from localserve.kv.block_hash import hash_payload
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.layer_groups import RECURRENT, max_blocks_in_window, num_blocks_out_of_window
from localserve.kv.state_group import CheckpointPolicy


def check_integrity(books: BlockBooks) -> None:
    """Raise AssertionError, saying what is wrong, unless every invariant of the pools holds.

    In each group's pool: free + cached + used == total; a block is in the free queue exactly when its
    count is 0; every GPU and CPU ref count equals the number of block tables pointing at the block; the
    prefix-cache map and the blocks' keys agree and each key matches the contents behind it. Each
    sequence's keys match its tokens; each of its block tables covers exactly its tokens (a window
    group's: at least its computed ones, at most all); in a window group exactly the blocks wholly before
    the window of its next query are given back (`NO_BLOCK`, a prefix of the table), so it holds at most
    ceil((W + n - 1) / block_size) + 1 blocks with n tokens slotted but uncomputed (ceil(W / block_size) + 1
    in a decode); a state group's table is as kv/state_group.py lays it out (no real entry before the
    running one, a slot for the running state, slots between only at policy checkpoints, those past the
    running state its own and unregistered, a registered one only at a computed policy checkpoint); a
    follower shares its leader's blocks and has not caught up yet.
    """
    block_size = books.block_size
    for seq_id, seq in books.sequences.items():
        _check(seq.num_tokens == len(seq.token_ids) or seq.shares_token_ids and seq.num_tokens < len(seq.token_ids),
               f"seq {seq_id}: {seq.num_tokens} tokens counted, {len(seq.token_ids)} in its list")
        num_keys = seq.num_computed_tokens // block_size if books.enable_prefix_caching else 0
        _check(0 <= seq.num_computed_tokens <= seq.num_tokens and len(seq.block_hashes) == num_keys,
               f"seq {seq_id}: {seq.num_computed_tokens} computed tokens, {len(seq.block_hashes)} keys")
        _check(len(seq.block_tables) == len(books.pools), f"seq {seq_id}: {len(seq.block_tables)} block tables, "
               f"{len(books.pools)} groups")
        for index, block_hash in enumerate(seq.block_hashes):
            _check(hash_payload(seq.block_payload(index, block_size)) == block_hash,
                   f"seq {seq_id}: key of block {index} does not match its tokens")
    for group, pool in enumerate(books.pools):
        _check_pool(books, group, pool)
    for seq_id, link in books.followers.items():  # shares blocks its leader has not computed yet
        seq, leader = books.sequences.get(seq_id), books.sequences.get(link.leader_id)
        num_shared = link.num_shared_blocks
        _check(seq is not None and leader is not None and leader.is_swapped == seq.is_swapped
               and all(leader_table[:num_shared] == table[:num_shared]
                       for leader_table, table in zip(leader.block_tables, seq.block_tables, strict=True))
               and seq.num_computed_tokens < num_shared * block_size,
               f"seq {seq_id}: not a follower of seq {link.leader_id}")


def _check_pool(books: BlockBooks, group: int, pool: PoolBooks) -> None:
    """The books of one group's pool, and each sequence's table in it."""
    block_size, window = books.block_size, pool.sliding_window
    where = f"group {group}" if len(books.pools) > 1 else "pool"
    table_refs = {False: [0] * pool.num_blocks, True: [0] * len(pool.swap_holder_counts)}  # by is_swapped
    if window is RECURRENT:
        _check_state_tables(books, group, pool, table_refs)
    else:
        _check_kv_tables(books, group, pool, table_refs)
    for seq_id, seq in books.sequences.items():
        table = seq.block_tables[group]
        covers_tokens = len(table) * block_size >= seq.num_tokens and table and table[-1] != NO_BLOCK
        _check(seq.may_share_last_block or not seq.num_tokens % block_size or not covers_tokens
               or table_refs[seq.is_swapped][table[-1]] == 1,
               f"{where}, seq {seq_id}: its partly filled last block has other holders and is not marked as shared")
    num_cached = 0
    for block_id, (count, block_hash, content) in enumerate(
            zip(pool.ref_counts, pool.block_hashes, pool.block_contents, strict=True)):
        num_tables = table_refs[False][block_id]
        _check(count == num_tables, f"{where}, block {block_id}: ref count {count}, {num_tables} tables")
        in_free_queue = block_id in pool.free_queue
        _check(in_free_queue == (count == 0), f"{where}, block {block_id}: count {count}, free: {in_free_queue}")
        _check((block_hash is None) == (content is None), f"{where}, block {block_id}: key and contents disagree")
        if block_hash is not None:
            _check(content is not None and hash_payload(content) == block_hash,
                   f"{where}, block {block_id}: key does not match its contents")
            _check(pool.hash_to_block.get(block_hash) == block_id, f"{where}, block {block_id}: key maps away")
            num_cached += count == 0
    for block_hash, block_id in pool.hash_to_block.items():
        _check(pool.block_hashes[block_id] == block_hash, f"{where}: prefix-cache map names block {block_id}")
    _check(num_cached == pool.num_cached_blocks,
           f"{where}: {num_cached} cached blocks, {pool.num_cached_blocks} counted")
    num_free = len(pool.free_queue) - pool.num_cached_blocks
    num_used = pool.num_blocks - len(pool.free_queue)
    _check(num_free + num_cached + num_used == pool.num_blocks,
           f"{where}: free {num_free} + cached {num_cached} + used {num_used} != {pool.num_blocks}")
    _check(list(pool.swap_holder_counts) == table_refs[True],
           f"{where}: CPU ref counts {list(pool.swap_holder_counts)}, tables pointing at each block {table_refs[True]}")


def _check_kv_tables(books: BlockBooks, group: int, pool: PoolBooks, table_refs: dict[bool, list[int]]) -> None:
    """Each sequence's table in a full or window group, counted into `table_refs`."""
    block_size, window = books.block_size, pool.sliding_window
    where = f"group {group}" if len(books.pools) > 1 else "pool"
    for seq_id, seq in books.sequences.items():
        table = seq.block_tables[group]
        num_dropped = num_blocks_out_of_window(seq.num_computed_tokens, window, block_size)
        held = table[num_dropped:]
        _check(all(block_id == NO_BLOCK for block_id in table[:num_dropped]) and NO_BLOCK not in held,
               f"{where}, seq {seq_id}: table {list(table)} should give back exactly its first {num_dropped} "
               f"blocks ({seq.num_computed_tokens} computed tokens, window {window})")
        num_blocks = -(-seq.num_tokens // block_size)
        # A window group's table may stop short of the tokens, never of the computed ones (its slots).
        min_blocks = num_blocks if window is None else -(-seq.num_computed_tokens // block_size)
        _check(min_blocks <= len(table) <= num_blocks and len(set(held)) == len(held),
               f"{where}, seq {seq_id}: {len(table)} blocks ({len(set(held))} distinct held) for "
               f"{seq.num_tokens} tokens, {seq.num_computed_tokens} computed")
        if window is not None:
            num_slotted = min(seq.num_tokens, len(table) * block_size)
            bound = max_blocks_in_window(window, block_size, max(1, num_slotted - seq.num_computed_tokens))
            _check(len(held) <= bound, f"{where}, seq {seq_id}: holds {len(held)} blocks, more than the window "
                   f"of {window} tokens needs ({bound})")
        for index, block_id in enumerate(held, start=num_dropped):
            table_refs[seq.is_swapped][block_id] += 1
            registered_hash = None if seq.is_swapped else pool.block_hashes[block_id]
            _check(registered_hash is None or seq.block_hashes[index:index + 1] == [registered_hash],
                   f"{where}, seq {seq_id}: block {block_id} is registered under another key")


def _check_state_tables(books: BlockBooks, group: int, pool: PoolBooks, table_refs: dict[bool, list[int]]) -> None:
    """Each sequence's table in the state group, counted into `table_refs`."""
    policy = CheckpointPolicy(books.block_size, books.state_checkpoint_blocks, books.enable_prefix_caching)
    where = f"group {group} (state)"

    def own(slot: int) -> bool:
        return pool.ref_counts[slot] == 1 and pool.block_hashes[slot] is None

    for seq_id, seq in books.sequences.items():
        table = seq.block_tables[group]
        problem = policy.table_problem(table, seq.num_computed_tokens, seq.num_tokens, seq.num_prompt_tokens,
                                       None if seq.is_swapped else own)
        _check(problem is None, f"{where}, seq {seq_id}: table {list(table)}: {problem}")
        held = [slot for slot in table if slot != NO_BLOCK]
        _check(len(set(held)) == len(held), f"{where}, seq {seq_id}: table {list(table)} repeats a slot")
        for index, slot in enumerate(table):
            if slot == NO_BLOCK:
                continue
            table_refs[seq.is_swapped][slot] += 1
            registered_hash = None if seq.is_swapped else pool.block_hashes[slot]
            # A hit may be another prompt's checkpoint: registered under this block's key, if not this policy's.
            _check(registered_hash is None or seq.block_hashes[index:index + 1] == [registered_hash],
                   f"{where}, seq {seq_id}: slot {slot} is registered under another key")


def _check(condition: bool, message: str) -> None:
    # Not `assert`: the checks must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
