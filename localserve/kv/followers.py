"""The block manager's record of a sequence, and its followers: samples or beams readmitted after a
preemption by recompute that share their leader's first blocks before the leader has computed them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localserve.kv.swap_pool import OutOfBlocksError


@dataclass(slots=True, eq=False)
class _Sequence:
    """What the block manager knows of one sequence."""

    # Its own copy, or (`share_token_ids`) the caller's list, which may run a pending token ahead of `num_tokens`.
    token_ids: list[int]
    block_table: list[int]  # GPU block ids, or CPU block ids while swapped out
    num_computed_tokens: int
    block_hashes: list[bytes]  # keys of the full computed blocks (with prefix caching only)
    extra_key: bytes
    num_tokens: int  # tokens the manager has of token_ids
    shares_token_ids: bool = False
    is_swapped: bool = False
    # Set by `fork`, the one operation sharing a block that is not full: an append reads the last block's
    # count only then. Clear: the last block, if partly filled, is the sequence's own.
    may_share_last_block: bool = False
    # A follower shares its leader's first `num_shared_blocks` blocks before the leader has computed them
    # (`allocate_sharing`); the leader lists its followers until they caught up (a tuple: mostly empty).
    followers: tuple[int, ...] = ()
    leader: int | None = None
    num_shared_blocks: int = 0


class FollowersMixin:
    """`BlockManager`'s operations on followers (its books: `_seqs`, `_ref_counts`, the free queue)."""

    block_size: int
    _seqs: dict[int, _Sequence]

    def allocate_sharing(self, seq_id: int, token_ids: Sequence[int], leader_id: int, num_shared_blocks: int,
                         share_token_ids: bool = False) -> int:
        """Give a new sequence its leader's first `num_shared_blocks` blocks and new blocks for the rest.

        For the samples or beams of a request readmitted after a preemption by recompute: the leader
        computes their common prefix once. The shared blocks become this sequence's computed KV as the
        leader computes them (`mark_computed` on the leader carries it along); until then it must not
        be scheduled (`awaits_leader`). Takes `len(token_ids)` blocks minus the shared ones; returns its
        number of computed tokens now. `share_token_ids` as for `allocate`.
        """
        leader = self._gpu_seq(leader_id)
        num_shared_tokens = num_shared_blocks * self.block_size
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not (0 < num_shared_tokens < len(token_ids) and num_shared_tokens <= leader.num_tokens
                and list(token_ids[:num_shared_tokens]) == leader.token_ids[:num_shared_tokens]):
            raise ValueError(f"sequence {seq_id} cannot share {num_shared_blocks} blocks of sequence {leader_id}")
        num_new_blocks = self._num_blocks_for(len(token_ids)) - num_shared_blocks
        if num_new_blocks > len(self._free_queue):
            raise OutOfBlocksError(f"{num_new_blocks} blocks needed, {len(self._free_queue)} available")
        block_table = leader.block_table[:num_shared_blocks]
        for block_id in block_table:
            self._ref_counts[block_id] += 1
        block_table += [self._take_free_block() for _ in range(num_new_blocks)]
        seq = _Sequence(token_ids if share_token_ids else list(token_ids), block_table, 0, [], leader.extra_key,
                        len(token_ids), share_token_ids, leader=leader_id,
                        num_shared_blocks=num_shared_blocks)
        self._seqs[seq_id] = seq
        if not self._catch_up(seq, leader):
            leader.followers += (seq_id,)
        return seq.num_computed_tokens

    def awaits_leader(self, seq_id: int) -> bool:
        """True while the sequence shares blocks its leader has not computed yet."""
        return self._seqs[seq_id].leader is not None

    def _catch_up(self, follower: _Sequence, leader: _Sequence) -> bool:
        """Count the shared blocks the leader has computed as the follower's; True once it has them all."""
        num_blocks = min(leader.num_computed_tokens // self.block_size, follower.num_shared_blocks)
        if num_blocks * self.block_size > follower.num_computed_tokens:
            follower.num_computed_tokens = num_blocks * self.block_size
            follower.block_hashes = leader.block_hashes[:num_blocks]
        if num_blocks < follower.num_shared_blocks:
            return False
        follower.leader = None
        return True
