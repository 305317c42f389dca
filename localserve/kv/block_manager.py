"""The KV block manager: which physical blocks of the KV pool hold which sequence's tokens.

Pure Python bookkeeping, no tensors (DESIGN.md section 3). Each of the `num_blocks` GPU blocks is
either free (in the free queue, nothing worth keeping), cached (in the free queue with ref count 0,
its contents still registered in the prefix cache) or used (ref count >= 1: that many block tables
point at it; shared when > 1). Blocks whose count drops to 0 join the free queue's tail and new
blocks come from its head, so the least recently freed cached block is overwritten first.

The manager keeps these books and its record of each sequence (`SequenceBlocks`) itself; its parts sit
behind small interfaces: the CPU swap pool, a tier (kv/block_tier.py: store blocks, give them back) of
`num_cpu_blocks` blocks holding the sequences preempted by swap, with no prefix cache; the followers
(kv/followers.py: which sequences share blocks their leader has not computed yet); the integrity check
and the per-block snapshot, which read the public view `books()` (kv/block_books.py).

In an engine step the calls come in this order:
1. Before the forward pass: `allocate` new prompts, `append_token` the token each decoding sequence
   sampled last step (its KV is written by this pass), `free` / `swap_out` / `swap_in` to preempt,
   each after its `can_...` check. The model runner makes the returned block copies, swap-out ones
   first, then swap-in, then copy-on-write, and only then runs the forward pass.
2. After the forward pass: `mark_computed(seq_id, n)`, n = tokens whose KV is now written. Only then
   do full blocks enter the prefix cache. Forks (parallel samples, beams) come after this.
3. After sampling a speculative verify row (its drafted tokens appended in step 1, only its last real
   token marked computed in step 2): `truncate` to the accepted tokens, then `mark_computed` them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from localserve.kv.block_books import BlockBooks, BlockPoolSnapshot, pool_snapshot
from localserve.kv.block_hash import ROOT_HASH, BlockContent, PrefixHit, block_payload, hash_block, hash_payload
from localserve.kv.block_tier import BlockTier
from localserve.kv.followers import Followers
from localserve.kv.free_queue import FreeBlockQueue
from localserve.kv.integrity import check_integrity
from localserve.kv.out_of_blocks import OutOfBlocksError
from localserve.kv.swap_pool import CpuSwapPool


@dataclass(slots=True, eq=False)
class SequenceBlocks:
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

    def block_payload(self, index: int, block_size: int) -> BlockContent:
        """What the key of its block `index` is the hash of: the previous block's key, its extra key, its tokens."""
        parent_hash = self.block_hashes[index - 1] if index else ROOT_HASH
        return block_payload(parent_hash, self.token_ids[index * block_size:(index + 1) * block_size], self.extra_key)


class BlockManager:
    """Lazy paged allocation with reference counts, copy-on-write, a hashed prefix cache and swapping.

    Sequences are named by an int `seq_id` chosen by the caller. For each the manager keeps its block
    table (logical block i -> physical block id) and its token ids, which key its full blocks. An
    operation that runs out of blocks raises `OutOfBlocksError` and changes nothing; the `can_...`
    questions are exact.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[bytes | None] = [None] * num_blocks  # set while in the prefix cache
        self._block_contents: list[BlockContent | None] = [None] * num_blocks  # behind each key
        self._free_queue = FreeBlockQueue(num_blocks)  # head first
        self._hash_to_block: dict[bytes, int] = {}
        self._num_cached_blocks = 0  # blocks in the free queue with a key
        self._swap_tier: BlockTier = CpuSwapPool(num_cpu_blocks)
        self._followers = Followers()
        self._seqs: dict[int, SequenceBlocks] = {}
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens found there (not recomputed)
        self.cow_copies = 0
        self.cached_block_evictions = 0  # cached blocks overwritten by an allocation

    # ---- observability ----
    @property
    def num_free_blocks(self) -> int:
        """GPU blocks in the free queue holding nothing reusable."""
        return len(self._free_queue) - self._num_cached_blocks

    @property
    def num_cached_blocks(self) -> int:
        """GPU blocks in the free queue whose contents the prefix cache can still hand out."""
        return self._num_cached_blocks

    @property
    def num_available_blocks(self) -> int:
        """Blocks allocations can take: free + cached (taking a cached one evicts its contents)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        """GPU blocks pointed at by at least one block table."""
        return self.num_blocks - len(self._free_queue)

    @property
    def usage_ratio(self) -> float:
        """Used GPU blocks over all GPU blocks, 0..1 (cached blocks count as not used)."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of the CPU swap pool."""
        return self._swap_tier.capacity

    @property
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks not holding a swapped-out sequence."""
        return self._swap_tier.num_free_blocks

    def free_queue_block_ids(self) -> list[int]:
        """GPU block ids in the free queue, head (next to be handed out) first."""
        return list(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        """Number of block tables pointing at GPU block `block_id`."""
        return self._ref_counts[block_id]

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (CPU block ids while it is swapped out)."""
        return list(self._seqs[seq_id].block_table)

    def live_block_table(self, seq_id: int) -> list[int]:
        """The sequence's block table itself, not a copy: read-only, and true only until the sequence's
        next operation (the step contract carries tables this way, sparing a copy per sequence a step)."""
        return self._seqs[seq_id].block_table

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence, including appended ones whose KV is not written yet."""
        return self._seqs[seq_id].num_tokens

    def num_computed_tokens(self, seq_id: int) -> int:
        """Leading tokens of the sequence whose KV is written (prefix hits included)."""
        return self._seqs[seq_id].num_computed_tokens

    def is_swapped(self, seq_id: int) -> bool:
        """True while the sequence lives in the CPU pool."""
        return self._seqs[seq_id].is_swapped

    def awaits_leader(self, seq_id: int) -> bool:
        """True while the sequence shares blocks its leader has not computed yet (see `allocate_sharing`)."""
        return self._followers.awaits_leader(seq_id)

    def books(self) -> BlockBooks:
        """A read-only view of every book the manager keeps, true until its next operation (no copies)."""
        return BlockBooks(num_blocks=self.num_blocks, block_size=self.block_size,
                          enable_prefix_caching=self.enable_prefix_caching, ref_counts=self._ref_counts,
                          block_hashes=self._block_hashes, block_contents=self._block_contents,
                          hash_to_block=MappingProxyType(self._hash_to_block), free_queue=self._free_queue,
                          num_cached_blocks=self._num_cached_blocks, sequences=MappingProxyType(self._seqs),
                          followers=self._followers.links, swap_holder_counts=self._swap_tier.holder_counts)

    def snapshot(self) -> BlockPoolSnapshot:
        """The state of every GPU and CPU block (see `BlockPoolSnapshot`)."""
        return pool_snapshot(self.books())

    # ---- admission ----
    def num_blocks_to_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"",
                               use_prefix_cache: bool = True) -> int:
        """Blocks that admitting this prompt now would take out of the free queue: every block of the
        prompt except prefix hits on blocks in use (a hit on a cached block counts, as it leaves the free
        queue too). So `can_allocate` is exactly this <= num_available_blocks."""
        return self._plan_allocation(token_ids, extra_key, use_prefix_cache)[1]

    def can_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"") -> bool:
        """True when `allocate` of this prompt would succeed now."""
        return self.num_blocks_to_allocate(token_ids, extra_key) <= len(self._free_queue)

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_key: bytes = b"",
                 share_token_ids: bool = False, use_prefix_cache: bool = True) -> int:
        """Give a new sequence blocks for its whole prompt; returns its number of cached tokens.

        Leading full blocks found in the prefix cache are shared (ref count + 1, taken out of the free
        queue if they sat there), at most (len(token_ids) - 1) // block_size of them so that the last
        prompt token is always computed. The return value, a multiple of block_size, is where the
        prefill starts. `extra_key` is mixed into every block's key. With `share_token_ids` the manager
        keeps the list `token_ids` itself, not a copy: the caller appends each token to it, then names it
        to `append_token` (one token list per sequence, not two), and never changes the tokens before.
        `use_prefix_cache` False: no hits are looked up (every token is computed; an embedding prompt whose
        pooling reads them all); its full blocks still enter the prefix cache once computed.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        hits, num_blocks_to_take = self._plan_allocation(token_ids, extra_key, use_prefix_cache)
        if num_blocks_to_take > len(self._free_queue):
            raise OutOfBlocksError(f"prompt of {len(token_ids)} tokens needs {num_blocks_to_take} blocks, "
                                   f"{len(self._free_queue)} available")
        # Hits leave the free queue before new blocks are taken from its head, which could evict them.
        for _, block_id in hits:
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
                self._num_cached_blocks -= 1
            self._ref_counts[block_id] += 1
        block_table = [block_id for _, block_id in hits]
        num_new_blocks = self._num_blocks_for(len(token_ids)) - len(hits)
        block_table += [self._take_free_block() for _ in range(num_new_blocks)]
        num_cached_tokens = len(hits) * self.block_size
        self._seqs[seq_id] = SequenceBlocks(
            token_ids=token_ids if share_token_ids else list(token_ids), block_table=block_table,
            num_computed_tokens=num_cached_tokens, block_hashes=[block_hash for block_hash, _ in hits],
            extra_key=extra_key, num_tokens=len(token_ids), shares_token_ids=share_token_ids)
        if self.enable_prefix_caching and use_prefix_cache:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += num_cached_tokens
        return num_cached_tokens

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
        # It keeps at least its last token to compute, and shares only tokens the leader has, and equal ones.
        can_share = (0 < num_shared_tokens < len(token_ids) and num_shared_tokens <= leader.num_tokens
                     and list(token_ids[:num_shared_tokens]) == leader.token_ids[:num_shared_tokens])
        if not can_share:
            raise ValueError(f"sequence {seq_id} cannot share {num_shared_blocks} blocks of sequence {leader_id}")
        num_new_blocks = self._num_blocks_for(len(token_ids)) - num_shared_blocks
        if num_new_blocks > len(self._free_queue):
            raise OutOfBlocksError(f"{num_new_blocks} blocks needed, {len(self._free_queue)} available")
        block_table = leader.block_table[:num_shared_blocks]
        for block_id in block_table:
            self._ref_counts[block_id] += 1
        block_table += [self._take_free_block() for _ in range(num_new_blocks)]
        seq = SequenceBlocks(token_ids=token_ids if share_token_ids else list(token_ids), block_table=block_table,
                             num_computed_tokens=0, block_hashes=[], extra_key=leader.extra_key,
                             num_tokens=len(token_ids), shares_token_ids=share_token_ids)
        self._seqs[seq_id] = seq
        num_computed_blocks = min(leader.num_computed_tokens // self.block_size, num_shared_blocks)
        self._take_computed_blocks(seq, leader, num_computed_blocks)
        if num_computed_blocks < num_shared_blocks:
            self._followers.add(seq_id, leader_id, num_shared_blocks)
        return seq.num_computed_tokens

    # ---- decoding ----
    def num_blocks_to_append(self, seq_ids: Iterable[int]) -> int:
        """Blocks taken from the free queue if each of these sequences appends one token, in any order:
        one per full last block; writers into a shared, partly filled last block need a copy each, except
        that when all its holders write, the last one finds itself sole owner and writes in place."""
        num_blocks = 0
        writers_per_shared_block: dict[int, int] = {}
        ref_counts = self._ref_counts
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            if seq.is_swapped:
                self._gpu_seq(seq_id)  # raises
            if seq.num_tokens % self.block_size == 0:
                num_blocks += 1
            elif seq.may_share_last_block:
                last_block_id = seq.block_table[-1]
                if ref_counts[last_block_id] > 1:
                    writers_per_shared_block[last_block_id] = writers_per_shared_block.get(last_block_id, 0) + 1
        for block_id, num_writers in writers_per_shared_block.items():
            num_blocks += num_writers if num_writers < ref_counts[block_id] else num_writers - 1
        return num_blocks

    def can_append(self, seq_ids: Iterable[int]) -> bool:
        """True when each of these sequences can append one token now."""
        return self.num_blocks_to_append(seq_ids) <= len(self._free_queue)

    def append_token(self, seq_id: int, token_id: int) -> list[tuple[int, int]]:
        """Grow the sequence by one token, whose KV the next forward pass writes: a new block when the
        last one is full; a copy of a shared, partly filled last block (copy-on-write; the others keep
        the original). Returns the (source, destination) block copies to make first: [] or one pair."""
        seq = self._seqs[seq_id]
        if seq.is_swapped:
            self._gpu_seq(seq_id)  # raises
        num_tokens = seq.num_tokens
        if not seq.shares_token_ids:
            seq.token_ids.append(token_id)
        elif len(seq.token_ids) <= num_tokens:
            raise ValueError(f"sequence {seq_id}: append token {num_tokens} to the shared token list first")
        needs_new_block = num_tokens % self.block_size == 0
        if not needs_new_block and (not seq.may_share_last_block or self._ref_counts[seq.block_table[-1]] == 1):
            seq.num_tokens = num_tokens + 1  # the common case: room in its own last block
            seq.may_share_last_block = False  # its other holders, if any, have left
            return []
        if not self._free_queue:
            if not seq.shares_token_ids:
                seq.token_ids.pop()  # changes nothing
            raise OutOfBlocksError(f"sequence {seq_id} needs a block, none available")
        block_id = self._take_free_block()
        seq.num_tokens = num_tokens + 1
        seq.may_share_last_block = False  # a new block, or a copy of its last: its own
        block_table = seq.block_table
        if needs_new_block:
            block_table.append(block_id)
            return []
        self._ref_counts[block_table[-1]] -= 1  # stays >= 1: the other holders keep it
        copies = [(block_table[-1], block_id)]
        block_table[-1] = block_id
        self.cow_copies += 1
        return copies

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Record that the KV of the sequence's first `num_computed_tokens` tokens is written.

        Each block this makes full and computed is registered in the prefix cache, unless its key is
        already registered to another block (that mapping is kept). The count never decreases.
        """
        seq = self._seqs[seq_id]
        num_before = seq.num_computed_tokens
        if seq.is_swapped or not num_before <= num_computed_tokens <= seq.num_tokens:
            self._gpu_seq(seq_id)  # raises if swapped
            raise ValueError(f"sequence {seq_id}: num_computed_tokens must be in [{num_before}, "
                             f"{seq.num_tokens}], got {num_computed_tokens}")
        seq.num_computed_tokens = num_computed_tokens
        # A sequence holds the key of each of its full computed blocks (check_integrity: one key per
        # block_size computed tokens), and followers share full blocks only, so both are due only when
        # the count crosses a block's end: nothing more for the other tokens.
        num_full_blocks = num_computed_tokens // self.block_size
        if num_full_blocks > num_before // self.block_size:
            if self.enable_prefix_caching:
                for index in range(len(seq.block_hashes), num_full_blocks):
                    content = seq.block_payload(index, self.block_size)
                    seq.block_hashes.append(hash_payload(content))
                    self._register(seq.block_table[index], seq.block_hashes[index], content)
            if self._followers.leads(seq_id):
                for follower_id, num_blocks in self._followers.catch_up(seq_id, num_full_blocks):
                    self._take_computed_blocks(self._seqs[follower_id], seq, num_blocks)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the sequence's first `num_tokens` tokens: the rejected tokens of a speculative draft.

        The blocks past the kept tokens lose one count each (last first) and join the free queue's tail.
        When blocks go, the sequence's table becomes a new list (see `live_block_table`).
        Only uncomputed tokens can go (`num_computed_tokens <= num_tokens`): a block enters the prefix cache
        only once full of computed tokens, so none that held a dropped token is registered under any key,
        and the kept last block is written again only past the kept tokens. A shared token list
        (`share_token_ids`) is its owner's to shorten; a copy is shortened here.
        """
        seq = self._gpu_seq(seq_id)
        if not max(1, seq.num_computed_tokens) <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id}: truncate to [{max(1, seq.num_computed_tokens)}, "
                             f"{seq.num_tokens}] tokens, got {num_tokens}")
        num_blocks = self._num_blocks_for(num_tokens)
        dropped = seq.block_table[num_blocks:]
        if dropped:
            # A new list: a table that shrank is never the same list grown back (whoever mirrors tables by
            # list, as the model runner does, sees another list and reads it whole).
            seq.block_table = seq.block_table[:num_blocks]
            self._release_blocks(dropped)
        if not seq.shares_token_ids:
            del seq.token_ids[num_tokens:]
        seq.num_tokens = num_tokens

    def fork(self, parent_seq_id: int, child_seq_id: int, child_token_ids: list[int] | None = None) -> None:
        """Make `child_seq_id` a copy of the parent sharing all its blocks (each ref count + 1). The
        parent's KV must be fully written (fork after `mark_computed`, before `append_token`), so shared
        blocks never receive writes: each sample or beam then appends its own token. `child_token_ids`: the
        caller's list of the parent's tokens for the child to share (see `allocate`); else a copy."""
        parent = self._gpu_seq(parent_seq_id)
        if parent.num_computed_tokens != parent.num_tokens:
            raise ValueError(f"sequence {parent_seq_id} has tokens whose KV is not written; fork after "
                             f"mark_computed, before append_token")
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id} already has blocks")
        tokens = parent.token_ids[:parent.num_tokens]
        if child_token_ids is not None and child_token_ids[:parent.num_tokens] != tokens:
            raise ValueError(f"sequence {child_seq_id}: its token list is not sequence {parent_seq_id}'s")
        for block_id in parent.block_table:
            self._ref_counts[block_id] += 1
        self._seqs[child_seq_id] = SequenceBlocks(
            token_ids=tokens if child_token_ids is None else child_token_ids, block_table=list(parent.block_table),
            num_computed_tokens=parent.num_computed_tokens, block_hashes=list(parent.block_hashes),
            extra_key=parent.extra_key, num_tokens=parent.num_tokens, shares_token_ids=child_token_ids is not None,
            may_share_last_block=True)
        parent.may_share_last_block = True

    def free(self, seq_id: int) -> None:
        """Forget the sequence (swapped or not): its blocks lose one count each, last block first. A GPU
        block reaching 0 joins the free-queue tail, keeping its prefix-cache entry if it has one,
        so a conversation's deep blocks are overwritten before its first ones.
        """
        seq = self._seqs.pop(seq_id)
        self._followers.forget(seq_id)  # the scheduler frees its followers with it; alone, each computes itself
        if seq.is_swapped:
            self._swap_tier.release(seq.block_table)
        else:
            self._release_blocks(seq.block_table)

    # ---- preemption by swap ----
    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """True when the CPU pool has room for the distinct blocks of these GPU sequences."""
        return len(self._distinct_blocks(seq_ids, swapped=False)) <= self._swap_tier.num_free_blocks

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move these sequences (all of one request's samples or beams) to the CPU pool.

        Returns the (gpu_block, cpu_block) copies to make, one per distinct block, so shared blocks are
        copied once and stay shared. The GPU blocks are released as by `free`.
        """
        self._distinct_blocks(seq_ids, swapped=False)  # raises on a repeated or swapped sequence
        seqs = [self._seqs[seq_id] for seq_id in seq_ids]
        cpu_tables, copies = self._swap_tier.store([seq.block_table for seq in seqs])
        for seq, cpu_table in zip(seqs, cpu_tables, strict=True):
            self._release_blocks(seq.block_table)
            seq.block_table = cpu_table
            seq.is_swapped = True
        return copies

    def num_blocks_to_swap_in(self, seq_ids: Sequence[int]) -> int:
        """GPU blocks that swapping these sequences back in would take (shared blocks count once)."""
        return len(self._distinct_blocks(seq_ids, swapped=True))

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """True when the free queue has room for the distinct blocks of these swapped sequences."""
        return self.num_blocks_to_swap_in(seq_ids) <= len(self._free_queue)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back to the GPU; returns the (cpu_block, gpu_block) copies to make.

        Their full computed blocks are registered in the prefix cache again where their keys are free.
        """
        cpu_block_ids = self._distinct_blocks(seq_ids, swapped=True)
        if len(cpu_block_ids) > len(self._free_queue):
            raise OutOfBlocksError(f"swap in needs {len(cpu_block_ids)} blocks, {len(self._free_queue)} free")
        cpu_to_gpu = {cpu_block_id: self._take_free_block() for cpu_block_id in cpu_block_ids}
        for block_id in cpu_to_gpu.values():
            self._ref_counts[block_id] = 0  # counted below, once per table pointing at it
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            self._swap_tier.release(seq.block_table)
            seq.block_table = [cpu_to_gpu[cpu_block_id] for cpu_block_id in seq.block_table]
            for block_id in seq.block_table:
                self._ref_counts[block_id] += 1
            seq.is_swapped = False
            for index, block_hash in enumerate(seq.block_hashes):
                self._register(seq.block_table[index], block_hash, seq.block_payload(index, self.block_size))
        return list(cpu_to_gpu.items())

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, unless every invariant of the pools holds: the
        manager's books (kv/integrity.py, read through `books()`) and each part's own."""
        self._swap_tier.check_integrity()
        self._followers.check_integrity()
        check_integrity(self.books())

    # ---- internals ----
    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _gpu_seq(self, seq_id: int) -> SequenceBlocks:
        seq = self._seqs[seq_id]
        if seq.is_swapped:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq

    def _plan_allocation(self, token_ids: Sequence[int], extra_key: bytes,
                         use_prefix_cache: bool) -> tuple[list[PrefixHit], int]:
        """The prefix hits as (key, block id), capped, and the blocks the prompt takes from the free queue."""
        hits: list[PrefixHit] = []
        block_hash = ROOT_HASH
        block_size = self.block_size
        lookup = self.enable_prefix_caching and use_prefix_cache
        for index in range((len(token_ids) - 1) // block_size if lookup else 0):
            # Chained: the previous block's key is this one's parent.
            block_tokens = token_ids[index * block_size:(index + 1) * block_size]
            block_hash = hash_block(block_hash, block_tokens, extra_key)
            if (block_id := self._hash_to_block.get(block_hash)) is None:
                break
            hits.append((block_hash, block_id))
        num_hits_in_use = sum(1 for _, block_id in hits if self._ref_counts[block_id] > 0)
        return hits, self._num_blocks_for(len(token_ids)) - num_hits_in_use

    def _take_free_block(self) -> int:
        """Pop the free-queue head with ref count 1, evicting its contents from the prefix cache."""
        block_id = self._free_queue.popleft()
        block_hash = self._block_hashes[block_id]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self._block_hashes[block_id] = None
            self._block_contents[block_id] = None
            self._num_cached_blocks -= 1
            self.cached_block_evictions += 1
        self._ref_counts[block_id] = 1
        return block_id

    def _release_blocks(self, block_ids: list[int]) -> None:
        """Each block loses one count, the table's last block first (see `free`); a block reaching 0 joins
        the free-queue tail, still cached if it has a key."""
        ref_counts = self._ref_counts
        block_hashes = self._block_hashes
        freed = []
        num_cached = 0
        for block_id in reversed(block_ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                freed.append(block_id)
                if block_hashes[block_id] is not None:
                    num_cached += 1
        self._free_queue.extend(freed)
        self._num_cached_blocks += num_cached

    def _register(self, block_id: int, block_hash: bytes, content: BlockContent) -> None:
        if self._block_hashes[block_id] is None and block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block_id
            self._block_hashes[block_id] = block_hash
            self._block_contents[block_id] = content

    def _take_computed_blocks(self, follower: SequenceBlocks, leader: SequenceBlocks, num_blocks: int) -> None:
        """The follower counts the leader's first `num_blocks` blocks, which it shares, as computed."""
        if num_blocks * self.block_size > follower.num_computed_tokens:
            follower.num_computed_tokens = num_blocks * self.block_size
            follower.block_hashes = leader.block_hashes[:num_blocks]

    def _distinct_blocks(self, seq_ids: Sequence[int], swapped: bool) -> list[int]:
        """Block ids of these sequences' tables, each once; all must be in the pool named by `swapped`."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids repeated: {list(seq_ids)}")
        block_ids: dict[int, None] = {}
        for seq_id in seq_ids:
            if self._seqs[seq_id].is_swapped != swapped:
                raise ValueError(f"sequence {seq_id} is {'not ' if swapped else ''}swapped out")
            block_ids.update(dict.fromkeys(self._seqs[seq_id].block_table))
        return list(block_ids)
