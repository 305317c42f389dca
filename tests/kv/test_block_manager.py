"""One test per rule of the block manager (DESIGN.md section 3), with exact expectations."""

from __future__ import annotations

import pytest

from localserve.kv.block_hash import ROOT_HASH, hash_block
from localserve.kv.block_manager import BlockManager
from localserve.kv.out_of_blocks import OutOfBlocksError


def prompt(num_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + num_tokens))


def decode(manager: BlockManager, seq_id: int, token_ids: list[int]) -> list[tuple[int, int]]:
    """One engine step per token: the KV of every token so far is written, then the next is appended."""
    copies = []
    for token_id in token_ids:
        manager.mark_computed(seq_id, manager.num_tokens(seq_id))
        copies += manager.append_token(seq_id, token_id)
    manager.check_integrity()
    return copies


def test_prompt_takes_blocks_for_its_tokens_only_and_a_block_per_16_generated():
    manager = BlockManager(num_blocks=8)
    assert manager.num_blocks_to_allocate(prompt(40)) == 3
    assert manager.allocate(1, prompt(40)) == 0
    assert manager.block_table(1) == [0, 1, 2]  # 16 + 16 + 8
    decode(manager, 1, prompt(8, 1000))  # tokens 41..48 fill block 2
    assert manager.block_table(1) == [0, 1, 2]
    decode(manager, 1, [2000])  # the 49th token
    assert manager.block_table(1) == [0, 1, 2, 3]
    assert manager.num_tokens(1) == 49
    assert (manager.num_used_blocks, manager.num_free_blocks, manager.usage_ratio) == (4, 4, 0.5)


def test_can_allocate_is_exact_and_a_failed_allocate_changes_nothing():
    manager = BlockManager(num_blocks=3)
    assert manager.can_allocate(prompt(48))
    assert manager.num_blocks_to_allocate(prompt(49)) == 4
    assert not manager.can_allocate(prompt(49))
    with pytest.raises(OutOfBlocksError):
        manager.allocate(1, prompt(49))
    assert manager.free_queue_block_ids() == [0, 1, 2]
    assert (manager.prefix_query_tokens, manager.prefix_hit_tokens) == (0, 0)
    manager.check_integrity()


def test_two_samples_share_the_prompt_and_only_the_first_writer_copies_the_partial_last_block():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 40)
    manager.fork(1, 2)
    assert manager.block_table(2) == [0, 1, 2]
    assert [manager.ref_count(block_id) for block_id in range(4)] == [2, 2, 2, 0]
    assert manager.num_blocks_to_append([1, 2]) == 1  # one copy: the second writer owns the original by then
    assert manager.append_token(1, 500) == [(2, 3, 0)]  # sample 1 copies block 2 (its 3rd) into block 3
    assert manager.block_table(1) == [0, 1, 3]
    assert manager.append_token(2, 600) == []  # sample 2 writes in place into the original
    assert manager.block_table(2) == [0, 1, 2]
    assert [manager.ref_count(block_id) for block_id in range(4)] == [2, 2, 1, 1]
    assert manager.cow_copies == 1
    assert decode(manager, 1, [501]) == [] and decode(manager, 2, [601]) == []  # no more copies
    assert manager.cow_copies == 1


def test_a_full_shared_last_block_needs_no_copy():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(32))
    manager.mark_computed(1, 32)
    manager.fork(1, 2)
    assert manager.num_blocks_to_append([1, 2]) == 2  # a fresh block each
    assert manager.append_token(1, 500) == []
    assert manager.append_token(2, 600) == []
    assert (manager.block_table(1), manager.block_table(2)) == ([0, 1, 2], [0, 1, 3])
    assert (manager.ref_count(1), manager.cow_copies) == (2, 0)
    manager.check_integrity()


def test_num_blocks_to_append_counts_new_blocks_and_copies_exactly():
    manager = BlockManager(num_blocks=16)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 40)
    for child in (2, 3, 4):
        manager.fork(1, child)
    manager.allocate(5, prompt(16, 100))  # its last block is full: appending takes a new one
    assert manager.num_blocks_to_append([1, 2, 3, 4]) == 3  # 4 holders all write: the last writes in place
    assert manager.num_blocks_to_append([1, 2]) == 2  # 2 of 4 holders write: both copy
    assert manager.num_blocks_to_append([1, 2, 3, 4, 5]) == 4
    available = manager.num_available_blocks
    copies = [pair for seq_id in (1, 2, 3, 4, 5) for pair in manager.append_token(seq_id, 700)]
    assert copies == [(2, 4, 0), (2, 5, 0), (2, 6, 0)]  # seq 5 took block 3 at allocation, its new block is 7
    assert available - manager.num_available_blocks == 4
    assert manager.block_table(4) == [0, 1, 2] and manager.block_table(5) == [3, 7]
    manager.check_integrity()


def test_append_without_a_free_block_raises_and_changes_nothing():
    manager = BlockManager(num_blocks=2)
    manager.allocate(1, prompt(32))
    assert not manager.can_append([1])
    with pytest.raises(OutOfBlocksError):
        manager.append_token(1, 5)
    assert manager.num_tokens(1) == 32
    manager.check_integrity()


def test_finished_request_frees_tail_first_and_its_prefix_comes_back_least_recently_freed_evicted_first():
    manager = BlockManager(num_blocks=4)
    manager.allocate(1, prompt(40))
    decode(manager, 1, prompt(9, 1000))  # 49 tokens, 4 blocks
    assert manager.block_table(1) == [0, 1, 2, 3]
    manager.free(1)
    assert manager.free_queue_block_ids() == [3, 2, 1, 0]  # tail first: block 3 is the next overwritten
    assert manager.snapshot().block_states == "ccc."  # full computed blocks keep their contents
    assert (manager.num_cached_blocks, manager.num_free_blocks) == (3, 1)
    new_prompt = prompt(32) + prompt(8, 5000)  # same first 32 tokens
    assert manager.allocate(2, new_prompt) == 32
    assert manager.block_table(2) == [0, 1, 3]  # blocks 0 and 1 come back; the new one is the head
    assert manager.free_queue_block_ids() == [2]
    assert (manager.prefix_query_tokens, manager.prefix_hit_tokens) == (80, 32)
    assert manager.cached_block_evictions == 0
    manager.allocate(3, prompt(10, 9000))
    assert manager.block_table(3) == [2]  # the least recently freed cached block is overwritten
    assert (manager.cached_block_evictions, manager.num_cached_blocks) == (1, 0)
    manager.check_integrity()


def test_allocation_overwrites_the_least_recently_freed_cached_blocks_first():
    manager = BlockManager(num_blocks=6, block_size=4)
    first, second = prompt(9), prompt(9, 100)
    for seq_id, token_ids in ((1, first), (2, second)):
        manager.allocate(seq_id, token_ids)
        manager.mark_computed(seq_id, 9)
    manager.free(2)  # blocks 5, 4, 3 join the tail
    manager.free(1)  # then 2, 1, 0
    assert manager.free_queue_block_ids() == [5, 4, 3, 2, 1, 0]
    assert manager.snapshot().block_states == "cc.cc."
    manager.allocate(3, prompt(12, 200))
    assert manager.block_table(3) == [5, 4, 3]
    assert manager.cached_block_evictions == 2  # blocks 4 and 3: request 2's prefix is gone
    assert manager.allocate(4, first) == 8  # request 1's prefix, freed later, is still there
    manager.free(3)
    assert manager.allocate(5, second) == 0
    manager.check_integrity()


def test_running_requests_share_their_full_computed_blocks():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 40)
    other = prompt(32) + prompt(20, 300)
    assert manager.num_blocks_to_allocate(other) == 2  # 4 blocks, 2 of them in use by request 1
    assert manager.allocate(2, other) == 32
    assert manager.block_table(2) == [0, 1, 3, 4]
    assert [manager.ref_count(block_id) for block_id in range(5)] == [2, 2, 1, 1, 1]
    assert manager.snapshot().block_states == "ssuuu..."
    manager.check_integrity()


def test_reviving_a_cached_block_counts_as_taking_it_from_the_free_queue():
    manager = BlockManager(num_blocks=3)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 40)
    manager.free(1)
    assert manager.num_blocks_to_allocate(prompt(40)) == 3  # 2 hits revived from the queue + 1 new
    assert manager.can_allocate(prompt(40))
    assert manager.allocate(2, prompt(40)) == 32
    assert manager.num_available_blocks == 0
    manager.check_integrity()


def test_prefix_hits_leave_at_least_the_last_prompt_token_to_compute():
    manager = BlockManager(num_blocks=16)
    manager.allocate(1, prompt(48))
    manager.mark_computed(1, 48)  # 3 full computed blocks
    assert manager.allocate(2, prompt(32)) == 16  # (32 - 1) // 16 = 1 block reused
    assert manager.allocate(3, prompt(33)) == 32
    assert manager.allocate(4, prompt(48)) == 32
    assert manager.allocate(5, prompt(49)) == 48
    assert manager.prefix_hit_tokens == 128
    manager.check_integrity()


def test_blocks_are_shared_only_once_their_kv_is_written():
    manager = BlockManager(num_blocks=16)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 20)  # first chunk of a chunked prefill
    assert manager.allocate(2, prompt(40)) == 16
    manager.mark_computed(1, 40)
    assert manager.allocate(3, prompt(40)) == 32
    manager.check_integrity()


def test_duplicate_content_keeps_the_existing_mapping():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(40))
    manager.allocate(2, prompt(40))  # same prompt before request 1 is computed: no hit
    assert manager.block_table(2) == [3, 4, 5]
    manager.mark_computed(1, 40)
    manager.mark_computed(2, 40)  # blocks 3, 4 hold the same content as 0, 1: not registered
    manager.free(2)
    assert manager.snapshot().block_states == "uuu....."
    manager.free(1)
    assert manager.snapshot().block_states == "cc......"
    assert manager.allocate(3, prompt(40)) == 32
    assert manager.block_table(3)[:2] == [0, 1]
    manager.check_integrity()


def test_without_prefix_caching_nothing_is_hashed_or_reused():
    manager = BlockManager(num_blocks=8, enable_prefix_caching=False)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 40)
    assert manager.allocate(2, prompt(40)) == 0
    manager.free(1)
    assert (manager.num_cached_blocks, manager.snapshot().block_states) == (0, "...uuu..")
    assert (manager.prefix_query_tokens, manager.prefix_hit_tokens) == (0, 0)
    manager.check_integrity()


def test_extra_key_separates_otherwise_equal_prefixes():
    manager = BlockManager(num_blocks=16)
    manager.allocate(1, prompt(40), extra_key=b"lora:a")
    manager.mark_computed(1, 40)
    assert manager.allocate(2, prompt(40), extra_key=b"lora:b") == 0
    assert manager.allocate(3, prompt(40)) == 0
    assert manager.allocate(4, prompt(40), extra_key=b"lora:a") == 32
    manager.check_integrity()


def test_block_keys_chain_through_the_parent_and_include_the_extra_key():
    tokens = prompt(16)
    first = hash_block(ROOT_HASH, tokens)
    assert len(first) == 32 and first == hash_block(ROOT_HASH, tuple(tokens))
    assert hash_block(first, tokens) != first
    assert hash_block(ROOT_HASH, tokens, b"x") != first
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [2, 1])


def test_beam_search_shares_blocks_near_the_root_and_dropping_a_beam_frees_its_own_path():
    manager = BlockManager(num_blocks=16, block_size=4)
    manager.allocate(1, prompt(6))  # blocks 0, 1 (2 tokens in block 1)
    decode(manager, 1, [10, 11])  # 8 tokens: block 1 full
    manager.mark_computed(1, 8)
    manager.fork(1, 2)  # beam 2 branches off at depth 8
    assert manager.append_token(1, 12) == [] and manager.append_token(2, 22) == []
    assert (manager.block_table(1), manager.block_table(2)) == ([0, 1, 2], [0, 1, 3])
    decode(manager, 1, [13])  # beam 1: 10 tokens
    manager.mark_computed(1, 10)
    manager.fork(1, 3)  # beam 3 branches off beam 1 in the middle of block 2
    assert manager.append_token(3, 33) == [(2, 4, 0)]
    assert manager.append_token(1, 14) == []
    decode(manager, 2, [23])
    manager.mark_computed(2, 10)
    manager.fork(2, 4)  # beam 4 branches off beam 2 in the middle of block 3
    assert manager.append_token(4, 44) == [(3, 5, 0)]
    manager.check_integrity()
    tables = {beam: manager.block_table(beam) for beam in (1, 2, 3, 4)}
    assert tables == {1: [0, 1, 2], 2: [0, 1, 3], 3: [0, 1, 4], 4: [0, 1, 5]}
    assert [manager.ref_count(block_id) for block_id in range(6)] == [4, 4, 1, 1, 1, 1]
    manager.free(3)  # beam 3 dropped: its own block 4 is freed, the root path loses one count
    assert [manager.ref_count(block_id) for block_id in range(6)] == [3, 3, 1, 1, 0, 1]
    assert manager.free_queue_block_ids()[-1] == 4
    manager.mark_computed(1, 11)
    manager.fork(1, 5)  # beam 1 takes the dropped beam's place
    assert [manager.ref_count(block_id) for block_id in range(6)] == [4, 4, 2, 1, 0, 1]
    for beam in (1, 2, 4, 5):
        manager.free(beam)
    assert manager.num_used_blocks == 0
    assert manager.num_cached_blocks == 2  # the prompt's full blocks 0 and 1 (computed, keyed)
    manager.check_integrity()


def test_swap_out_copies_shared_blocks_once_and_swap_in_restores_the_sharing():
    manager = BlockManager(num_blocks=8, num_cpu_blocks=4)
    manager.allocate(1, prompt(40))
    manager.mark_computed(1, 40)
    manager.fork(1, 2)
    manager.append_token(1, 500)  # seq 1: [0, 1, 3], seq 2: [0, 1, 2]
    assert manager.can_swap_out([1, 2])
    assert manager.swap_out([1, 2]) == [(0, 0, 0), (1, 1, 0), (3, 2, 0), (2, 3, 0)]
    assert (manager.block_table(1), manager.block_table(2)) == ([0, 1, 2], [0, 1, 3])
    assert manager.is_swapped(1) and manager.num_used_blocks == 0
    assert manager.snapshot().cpu_block_states == "ssuu"
    assert manager.free_queue_block_ids()[-4:] == [3, 2, 1, 0]  # released tail first, shared ones last
    manager.check_integrity()
    manager.allocate(3, prompt(80, 1000))  # takes 5 blocks from the head, evicting block 1's contents
    assert manager.num_blocks_to_swap_in([1, 2]) == 4  # shared blocks count once
    assert not manager.can_swap_in([1, 2])
    manager.free(3)
    assert manager.can_swap_in([1, 2])
    copies = manager.swap_in([1, 2])
    assert [cpu for cpu, _, _ in copies] == [0, 1, 2, 3]
    gpu_of = {cpu: gpu for cpu, gpu, _ in copies}
    assert manager.block_table(1) == [gpu_of[0], gpu_of[1], gpu_of[2]]
    assert manager.block_table(2) == [gpu_of[0], gpu_of[1], gpu_of[3]]
    assert [manager.ref_count(gpu_of[cpu]) for cpu in range(4)] == [2, 2, 1, 1]
    assert manager.num_free_cpu_blocks == 4 and not manager.is_swapped(1)
    manager.check_integrity()
    assert manager.allocate(4, prompt(40)) == 32  # swapped-in blocks are keyed again
    assert manager.block_table(4)[:2] == [gpu_of[0], gpu_of[1]]
    assert manager.append_token(2, 600) == []  # the swapped-in copy is its own: written in place
    manager.check_integrity()


def test_swap_out_needs_room_for_every_distinct_block():
    manager = BlockManager(num_blocks=8, num_cpu_blocks=2)
    manager.allocate(1, prompt(40))
    assert not manager.can_swap_out([1])
    with pytest.raises(OutOfBlocksError):
        manager.swap_out([1])
    assert manager.block_table(1) == [0, 1, 2] and not manager.is_swapped(1)
    manager.check_integrity()


def test_a_swapped_sequence_can_be_freed_but_not_grown():
    manager = BlockManager(num_blocks=8, num_cpu_blocks=4)
    manager.allocate(1, prompt(20))
    manager.swap_out([1])
    with pytest.raises(ValueError, match="swapped out"):
        manager.append_token(1, 7)
    manager.free(1)
    assert manager.num_free_cpu_blocks == 4
    manager.check_integrity()


def test_misuse_is_rejected():
    manager = BlockManager(num_blocks=8)
    manager.allocate(1, prompt(20))
    with pytest.raises(ValueError, match="already has blocks"):
        manager.allocate(1, prompt(4))
    with pytest.raises(ValueError, match="at least one token"):
        manager.allocate(2, [])
    with pytest.raises(ValueError, match="not written"):
        manager.fork(1, 2)  # its prompt's KV is not computed yet
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.mark_computed(1, 21)
    manager.mark_computed(1, 20)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        manager.mark_computed(1, 19)
    with pytest.raises(ValueError, match="repeated"):
        manager.swap_out([1, 1])
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0)
    manager.check_integrity()


def test_check_integrity_reports_a_wrong_ref_count_and_a_leaked_block():
    manager = BlockManager(num_blocks=4)
    manager.allocate(1, prompt(20))
    pool = manager._pools[0]
    pool.ref_counts[0] += 1  # as if a table had been forgotten without releasing its blocks
    with pytest.raises(AssertionError, match="block 0: ref count 2, 1 tables"):
        manager.check_integrity()
    pool.ref_counts[0] -= 1
    del pool.free_queue[3]  # a block that is nowhere
    with pytest.raises(AssertionError, match="block 3"):
        manager.check_integrity()


def test_check_integrity_reports_a_key_that_does_not_match_the_contents():
    manager = BlockManager(num_blocks=4)
    manager.allocate(1, prompt(20))
    manager.mark_computed(1, 20)
    manager._seqs[1].token_ids[3] = 99
    with pytest.raises(AssertionError, match="does not match its tokens"):
        manager.check_integrity()


def test_snapshot_shows_every_block_state_and_ref_count():
    manager = BlockManager(num_blocks=6, block_size=4, num_cpu_blocks=2)
    manager.allocate(1, prompt(6))
    manager.mark_computed(1, 6)
    manager.fork(1, 2)
    manager.allocate(3, prompt(3, 50))
    manager.mark_computed(3, 3)
    manager.allocate(4, prompt(5, 90))
    manager.mark_computed(4, 5)
    manager.free(4)
    snapshot = manager.snapshot()
    assert snapshot.block_states == "ssuc.."
    assert snapshot.ref_counts == (2, 2, 1, 0, 0, 0)
    assert snapshot.cpu_block_states == ".."
