"""Per-block extra keys (kv/block_hash.py, `block_extra_key`: an image's content in the blocks covering its
tokens): a prefix hit needs the same tokens and the same keys block by block; forks, followers and swaps keep
a sequence's keys; text-only keys are unchanged."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.kv.block_hash import ROOT_HASH, block_extra_key, hash_block
from localserve.kv.block_manager import BlockManager

TOKENS = [7] * 40  # the same placeholder ids throughout: only the keys tell the blocks apart


def computed(bm: BlockManager, seq_id: int, tokens: list[int], keys: tuple[bytes, ...]) -> int:
    """Allocate and compute a prompt; returns its prefix-hit tokens."""
    num_cached = bm.allocate(seq_id, tokens, block_extra_keys=keys)
    bm.mark_computed(seq_id, len(tokens))
    bm.check_integrity()
    return num_cached


def test_a_hit_needs_the_same_keys_block_by_block():
    bm = BlockManager(32, 16)
    assert computed(bm, 0, TOKENS, (b"cat", b"cat2")) == 0
    bm.free(0)
    assert computed(bm, 1, TOKENS, (b"cat", b"cat2")) == 32
    assert computed(bm, 2, TOKENS, (b"cat", b"dog")) == 16  # the second block holds another image
    assert computed(bm, 3, TOKENS, (b"dog", b"cat2")) == 0  # the chain breaks at the first block
    assert computed(bm, 4, TOKENS, ()) == 0  # the placeholders as text
    for seq_id in range(1, 5):
        bm.free(seq_id)
    bm.check_integrity()


def test_text_only_keys_are_the_keys_without_extra_keys():
    bm = BlockManager(32, 16)
    computed(bm, 0, list(range(40)), (b"", b""))
    first = hash_block(ROOT_HASH, list(range(16)))
    assert list(bm.books().sequences[0].block_hashes) == [first, hash_block(first, list(range(16, 32)))]
    bm.free(0)
    assert computed(bm, 1, list(range(40)), ()) == 32  # empty keys and none are the same keys
    assert block_extra_key(b"x", (b"",), 0) == b"x"


def test_forks_and_swaps_keep_the_keys():
    bm = BlockManager(32, 16, num_cpu_blocks=32)
    keys = (b"cat", b"cat2")
    computed(bm, 0, TOKENS, keys)
    bm.fork(0, 1)
    bm.check_integrity()
    bm.swap_out([0, 1])
    bm.check_integrity()
    bm.swap_in([0, 1])  # registered again, under the same keys
    bm.check_integrity()
    bm.append_token(1, 9)
    bm.mark_computed(1, 41)
    bm.free(0)
    bm.free(1)
    assert computed(bm, 2, TOKENS + [9, 9], keys) == 32
    assert computed(bm, 3, TOKENS + [9, 9], (b"cat", b"other")) == 16
    bm.check_integrity()


def test_followers_share_their_leaders_keys():
    bm = BlockManager(32, 16)
    keys = (b"cat", b"cat2")
    bm.allocate(0, TOKENS, block_extra_keys=keys)
    bm.allocate_sharing(1, TOKENS, 0, 2)
    bm.mark_computed(0, len(TOKENS))
    bm.check_integrity()  # the follower's blocks carry the leader's keys
    bm.free(0)
    bm.free(1)
    assert computed(bm, 2, TOKENS, keys) == 32


@settings(max_examples=60, deadline=None)
@given(num_tokens=st.integers(1, 70), first=st.lists(st.sampled_from([b"", b"a", b"b"]), max_size=5),
       second=st.lists(st.sampled_from([b"", b"a", b"b"]), max_size=5))
def test_the_hit_is_the_leading_blocks_whose_keys_agree(num_tokens, first, second):
    bm = BlockManager(16, 16)
    tokens = [7] * num_tokens
    computed(bm, 0, tokens, tuple(first))
    bm.free(0)
    num_hits = 0
    while (num_hits < (num_tokens - 1) // 16
           and block_extra_key(b"", first, num_hits) == block_extra_key(b"", second, num_hits)):
        num_hits += 1
    assert computed(bm, 1, tokens, tuple(second)) == 16 * num_hits
    bm.free(1)
    bm.check_integrity()
    assert bm.num_used_blocks == 0
