"""Followers: the samples or beams of a request readmitted after a recompute share the full blocks of
their common prefix, which their leader computes once; they count as computed as the leader gets there."""

from __future__ import annotations

import pytest

from localserve.kv.block_manager import BlockManager
from localserve.kv.followers import FollowerLink, Followers
from localserve.kv.out_of_blocks import OutOfBlocksError

SHARED = list(range(100, 132))  # two full blocks every sequence has in common


def three_sequences(manager: BlockManager, num_shared_blocks: int = 2) -> None:
    """Leader 1 and followers 2, 3: 32 common tokens, then 8, 9 and 10 tokens of their own."""
    manager.allocate(1, SHARED + [1] * 8)
    for seq_id in (2, 3):
        assert manager.allocate_sharing(seq_id, SHARED + [seq_id] * (7 + seq_id), 1, num_shared_blocks) == 0
        assert manager.awaits_leader(seq_id)
    manager.check_integrity()


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_followers_share_the_leaders_blocks_and_catch_up_as_it_computes_them(prefix_caching):
    manager = BlockManager(num_blocks=8, enable_prefix_caching=prefix_caching)
    three_sequences(manager)
    tables = [manager.block_table(seq_id) for seq_id in (1, 2, 3)]
    assert tables[1][:2] == tables[2][:2] == tables[0][:2] and manager.ref_count(tables[0][0]) == 3
    assert manager.num_used_blocks == 3 + 1 + 1  # each follower takes only its own third block
    manager.mark_computed(1, 16)
    manager.check_integrity()
    assert [manager.num_computed_tokens(s) for s in (2, 3)] == [16, 16] and manager.awaits_leader(2)
    manager.mark_computed(1, 40)
    manager.check_integrity()
    assert [manager.num_computed_tokens(s) for s in (2, 3)] == [32, 32] and not manager.awaits_leader(3)
    for seq_id in (2, 3):  # each computes its own tail and grows in its own blocks
        manager.mark_computed(seq_id, manager.num_tokens(seq_id))
        assert manager.append_token(seq_id, 7) == []
    manager.check_integrity()


def test_a_leader_with_cached_blocks_starts_its_followers_there_too():
    manager = BlockManager(num_blocks=8)
    manager.allocate(9, SHARED + [5])
    manager.mark_computed(9, 33)
    manager.free(9)  # its two full blocks stay in the prefix cache
    assert manager.allocate(1, SHARED + [1] * 8) == 32
    assert manager.allocate_sharing(2, SHARED + [2] * 9, 1, 2) == 32 and not manager.awaits_leader(2)
    manager.check_integrity()


@pytest.mark.parametrize("leader_first", [True, False])
def test_freeing_a_request_with_waiting_followers_gives_every_block_back(leader_first):
    manager = BlockManager(num_blocks=8)
    three_sequences(manager)
    manager.mark_computed(1, 16)
    for seq_id in (1, 2, 3) if leader_first else (3, 2, 1):
        manager.free(seq_id)
        manager.check_integrity()
    assert manager.num_used_blocks == 0


def test_followers_waiting_for_their_leader_survive_a_swap():
    manager = BlockManager(num_blocks=6, num_cpu_blocks=8)
    three_sequences(manager)
    manager.mark_computed(1, 16)
    moves = manager.swap_out([1, 2, 3])
    assert len(moves) == 5 and manager.num_used_blocks == 0  # shared blocks copied once
    manager.check_integrity()
    manager.swap_in([1, 2, 3])
    manager.check_integrity()
    assert manager.awaits_leader(2)
    manager.mark_computed(1, 40)
    assert [manager.num_computed_tokens(s) for s in (2, 3)] == [32, 32]
    manager.check_integrity()


def test_sharing_is_refused_when_it_would_not_hold():
    manager = BlockManager(num_blocks=6)
    manager.allocate(1, SHARED + [1] * 8)
    with pytest.raises(ValueError, match="cannot share"):  # the tokens differ in the second block
        manager.allocate_sharing(2, SHARED[:20] + [0] * 20, 1, 2)
    with pytest.raises(ValueError, match="cannot share"):  # nothing left for it to compute
        manager.allocate_sharing(2, SHARED, 1, 2)
    free_before = manager.num_free_blocks
    with pytest.raises(OutOfBlocksError):
        manager.allocate_sharing(2, SHARED + [2] * 60, 1, 2)  # 4 blocks of its own, 3 free
    assert manager.num_free_blocks == free_before
    manager.check_integrity()


def test_a_follower_follows_until_exactly_its_last_shared_block_is_computed():
    followers = Followers()
    followers.add(2, 1, num_shared_blocks=2)
    followers.add(3, 1, num_shared_blocks=3)
    assert followers.leads(1) and followers.awaits_leader(2) and followers.awaits_leader(3)
    assert followers.catch_up(1, 1) == [(2, 1), (3, 1)]
    assert followers.catch_up(1, 2) == [(2, 2), (3, 2)]  # 2 has all its shared blocks: it stops following
    assert not followers.awaits_leader(2) and followers.awaits_leader(3)
    assert followers.catch_up(1, 3) == [(3, 3)]
    assert not followers.leads(1) and not followers.links
    followers.check_integrity()


@pytest.mark.parametrize("gone", [1, 2])
def test_forgetting_a_leader_or_a_follower_unlinks_it(gone):
    followers = Followers()
    followers.add(2, 1, num_shared_blocks=2)
    followers.add(3, 1, num_shared_blocks=2)
    followers.forget(gone)
    assert dict(followers.links) == ({} if gone == 1 else {3: FollowerLink(1, 2)})
    assert followers.leads(1) == (gone == 2)
    followers.check_integrity()


def test_the_books_show_each_follower_link_and_refuse_writes():
    manager = BlockManager(num_blocks=8)
    three_sequences(manager)
    books = manager.books()
    assert dict(books.followers) == {2: FollowerLink(1, 2), 3: FollowerLink(1, 2)}
    with pytest.raises(TypeError):
        books.followers[4] = FollowerLink(1, 1)
    with pytest.raises(TypeError):
        books.sequences[9] = books.sequences[1]
