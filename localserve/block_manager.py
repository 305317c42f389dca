"""The KV block manager: which physical blocks of the KV pool hold which sequence's tokens.

Pure Python bookkeeping, no tensors (DESIGN.md section 3). The pool has `num_blocks` GPU blocks of
`block_size` tokens. Every GPU block is in exactly one state:

- free: in the free queue, holding nothing worth keeping;
- cached: in the free queue, ref count 0, but its contents are registered in the prefix cache, so a
  new request with the same tokens can take it back instead of recomputing it;
- used: ref count >= 1, pointed at by that many block tables (shared when > 1).

The free queue is ordered: blocks whose count reaches 0 join its tail, allocation takes from its head,
so the least recently freed cached block is overwritten (evicted) first. A CPU pool of
`num_cpu_blocks` blocks holds sequences preempted by swap; it has no prefix cache.

Per engine step the scheduler uses it like this (the order matters):
1. `can_allocate` / `allocate` admits prompts; `can_append` / `append_token` grows decoding sequences
   by the token sampled last step, whose KV this step writes; `swap_out` / `swap_in` / `free` preempt.
2. The model runner makes the returned copies in this order: swap-out, swap-in, copy-on-write, and only
   then runs the forward pass (which writes KV into blocks those calls may just have handed out).
3. After the forward pass, `mark_computed(seq_id, n)` with n = tokens whose KV is now written; only
   then do full blocks enter the prefix cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT_HASH = bytes(32)
"""Parent hash of a sequence's first block."""


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Prefix-cache key of a full block: BLAKE2b-256 of its parent's key, `extra_key` and its tokens.

    Chaining through the parent's key makes the key stand for every token up to the block's end; a
    collision would hand a request someone else's KV, hence a cryptographic hash. `extra_key` is for
    whatever else changes the KV (a LoRA adapter, images); it is length-prefixed so that it cannot run
    into the token bytes.
    """
    payload = (parent_hash + len(extra_key).to_bytes(8, "little") + extra_key
               + struct.pack(f"<{len(token_ids)}q", *token_ids))
    return hashlib.blake2b(payload, digest_size=32).digest()


class OutOfBlocksError(RuntimeError):
    """An operation needed more free blocks than its pool has; nothing was changed."""


@dataclass(frozen=True)
class BlockPoolSnapshot:
    """State of every block, for the monitor.

    `block_states` has one character per GPU block, indexed by block id: '.' free, 'c' cached (free,
    contents kept for the prefix cache), 'u' used by one block table, 's' shared by several.
    `ref_counts[i]` is the number of block tables pointing at GPU block i. `cpu_block_states` is the
    same map of the CPU swap pool ('.', 'u' or 's').
    """

    block_states: str
    ref_counts: tuple[int, ...]
    cpu_block_states: str


class _Block:
    __slots__ = ("ref_count", "block_hash", "hashed_content")

    def __init__(self) -> None:
        self.ref_count = 0
        self.block_hash: bytes | None = None  # set while registered in the prefix cache
        # (parent hash, token ids, extra key) behind block_hash, kept so check_integrity can recompute it
        self.hashed_content: tuple[bytes, tuple[int, ...], bytes] | None = None


class _Sequence:
    __slots__ = ("token_ids", "block_table", "num_computed_tokens", "block_hashes", "extra_key",
                 "is_swapped")

    def __init__(self, token_ids: list[int], block_table: list[int], num_computed_tokens: int,
                 block_hashes: list[bytes], extra_key: bytes) -> None:
        self.token_ids = token_ids
        self.block_table = block_table  # GPU block ids, or CPU block ids while swapped out
        self.num_computed_tokens = num_computed_tokens
        self.block_hashes = block_hashes  # keys of the leading full, computed blocks (prefix caching only)
        self.extra_key = extra_key
        self.is_swapped = False


class BlockManager:
    """Lazy paged allocation with reference counts, copy-on-write, a hashed prefix cache and swapping.

    Sequences are named by an int `seq_id` chosen by the caller. For each one the manager keeps its
    block table (logical block i -> physical block id) and its token ids, which it needs to key full
    blocks. Operations that run out of blocks raise `OutOfBlocksError` and change nothing; ask
    `can_allocate` / `can_append` / `can_swap_out` / `can_swap_in` first, they are exact.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1 or num_cpu_blocks < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, num_cpu_blocks >= 0; got "
                             f"{num_blocks}, {block_size}, {num_cpu_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block() for _ in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head first
        self._hash_to_block: dict[bytes, int] = {}
        self._num_cached_blocks = 0  # blocks in the free queue whose contents are registered
        self._cpu_ref_counts = [0] * num_cpu_blocks
        self._free_cpu_blocks = list(range(num_cpu_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._seqs: dict[int, _Sequence] = {}
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens found (not recomputed)
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
        """Blocks an allocation can take: free + cached (taking a cached one evicts its contents)."""
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
    def num_free_cpu_blocks(self) -> int:
        """CPU blocks not holding a swapped-out sequence."""
        return len(self._free_cpu_blocks)

    def free_queue_block_ids(self) -> list[int]:
        """GPU block ids in the free queue, head (next to be handed out) first."""
        return list(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        """Number of block tables pointing at GPU block `block_id`."""
        return self._blocks[block_id].ref_count

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table (CPU block ids while it is swapped out)."""
        return list(self._seqs[seq_id].block_table)

    def num_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence, including the last appended one whose KV may not be written yet."""
        return len(self._seqs[seq_id].token_ids)

    def num_computed_tokens(self, seq_id: int) -> int:
        """Leading tokens of the sequence whose KV is written (prefix hits included)."""
        return self._seqs[seq_id].num_computed_tokens

    def is_swapped(self, seq_id: int) -> bool:
        """True while the sequence lives in the CPU pool."""
        return self._seqs[seq_id].is_swapped

    def snapshot(self) -> BlockPoolSnapshot:
        """The state of every GPU and CPU block (see `BlockPoolSnapshot`)."""
        states = "".join(("c" if block.block_hash is not None else ".") if block.ref_count == 0
                         else ("u" if block.ref_count == 1 else "s") for block in self._blocks)
        cpu_states = "".join(".us"[min(count, 2)] for count in self._cpu_ref_counts)
        return BlockPoolSnapshot(states, tuple(block.ref_count for block in self._blocks), cpu_states)

    # ---- admission ----
    def num_blocks_to_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"") -> int:
        """Blocks that admitting this prompt now would take out of the free queue.

        That is every block of the prompt except prefix hits on blocks other sequences are using: a hit
        on a cached block counts, because it leaves the free queue too. `can_allocate` is exactly
        `num_blocks_to_allocate(...) <= num_available_blocks`.
        """
        hits = self._prefix_hits(token_ids, extra_key)
        num_shared_hits = sum(1 for _, block_id in hits if self._blocks[block_id].ref_count > 0)
        return self._num_blocks_for(len(token_ids)) - num_shared_hits

    def can_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"") -> bool:
        """True when `allocate` of this prompt would succeed now."""
        return self.num_blocks_to_allocate(token_ids, extra_key) <= len(self._free_queue)

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_key: bytes = b"") -> int:
        """Give a new sequence blocks for its whole prompt; returns its number of cached tokens.

        The leading full blocks found in the prefix cache are shared (ref count + 1, out of the free
        queue if they sat there) instead of recomputed, at most (len(token_ids) - 1) // block_size of
        them so that the last prompt token is always computed. The return value, a multiple of
        block_size, is where the prefill starts. `extra_key` is mixed into every block's key.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        hits = self._prefix_hits(token_ids, extra_key)
        num_blocks = self._num_blocks_for(len(token_ids))
        num_shared_hits = sum(1 for _, block_id in hits if self._blocks[block_id].ref_count > 0)
        if num_blocks - num_shared_hits > len(self._free_queue):
            raise OutOfBlocksError(f"prompt of {len(token_ids)} tokens needs {num_blocks - num_shared_hits} "
                                   f"blocks, {len(self._free_queue)} available")
        # Hits leave the free queue before new blocks are taken from its head, which could evict them.
        for _, block_id in hits:
            self._take_cached_block(block_id)
        block_table = [block_id for _, block_id in hits]
        for _ in range(num_blocks - len(hits)):
            block_id = self._take_free_block()
            self._blocks[block_id].ref_count = 1
            block_table.append(block_id)
        num_cached_tokens = len(hits) * self.block_size
        self._seqs[seq_id] = _Sequence(list(token_ids), block_table, num_cached_tokens,
                                       [block_hash for block_hash, _ in hits], extra_key)
        if self.enable_prefix_caching:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += num_cached_tokens
        return num_cached_tokens

    # ---- decoding ----
    def num_blocks_to_append(self, seq_ids: Iterable[int]) -> int:
        """Blocks taken from the free queue if each of these sequences appends one token, in any order.

        A sequence whose last block is full needs a new block. Writers into a shared, partly filled
        last block need a copy each, except that when all of its holders write, the last one to write
        finds itself sole owner and writes in place.
        """
        block_size = self.block_size
        num_blocks = 0
        writers_per_shared_block: dict[int, int] = {}
        for seq_id in seq_ids:
            seq = self._gpu_seq(seq_id)
            if len(seq.token_ids) % block_size == 0:
                num_blocks += 1
            else:
                last_block_id = seq.block_table[-1]
                if self._blocks[last_block_id].ref_count > 1:
                    writers_per_shared_block[last_block_id] = writers_per_shared_block.get(last_block_id, 0) + 1
        for block_id, num_writers in writers_per_shared_block.items():
            num_blocks += num_writers if num_writers < self._blocks[block_id].ref_count else num_writers - 1
        return num_blocks

    def can_append(self, seq_ids: Iterable[int]) -> bool:
        """True when each of these sequences can append one token now."""
        return self.num_blocks_to_append(seq_ids) <= len(self._free_queue)

    def append_token(self, seq_id: int, token_id: int) -> list[tuple[int, int]]:
        """Grow the sequence by one token, whose KV the next forward pass writes.

        Takes a new block when the last one is full. When the last block is partly filled and shared,
        the sequence switches to a copy of it (copy-on-write) and the others keep the original; the
        returned (source, destination) pair is the block copy the model runner must make before the
        forward pass. Returns [] or one pair.
        """
        seq = self._gpu_seq(seq_id)
        copies: list[tuple[int, int]] = []
        if len(seq.token_ids) % self.block_size == 0:
            if not self._free_queue:
                raise OutOfBlocksError(f"sequence {seq_id} needs a new block, none available")
            block_id = self._take_free_block()
            self._blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
        else:
            last_block = self._blocks[seq.block_table[-1]]
            if last_block.ref_count > 1:
                if not self._free_queue:
                    raise OutOfBlocksError(f"sequence {seq_id} needs a copy of a shared block, none available")
                copy_id = self._take_free_block()
                self._blocks[copy_id].ref_count = 1
                last_block.ref_count -= 1  # stays >= 1: the other holders keep the original
                copies.append((seq.block_table[-1], copy_id))
                seq.block_table[-1] = copy_id
                self.cow_copies += 1
        seq.token_ids.append(token_id)
        return copies

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Record that the KV of the sequence's first `num_computed_tokens` tokens is written.

        Each block that this makes full and computed is registered in the prefix cache, unless its key
        is already registered to another block (that mapping is kept). It never decreases.
        """
        seq = self._gpu_seq(seq_id)
        if not seq.num_computed_tokens <= num_computed_tokens <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id}: num_computed_tokens must be in [{seq.num_computed_tokens}, "
                             f"{len(seq.token_ids)}], got {num_computed_tokens}")
        seq.num_computed_tokens = num_computed_tokens
        if not self.enable_prefix_caching:
            return
        block_size = self.block_size
        block_hashes = seq.block_hashes
        for index in range(len(block_hashes), num_computed_tokens // block_size):
            parent_hash = block_hashes[-1] if block_hashes else ROOT_HASH
            token_ids = tuple(seq.token_ids[index * block_size:(index + 1) * block_size])
            block_hash = hash_block(parent_hash, token_ids, seq.extra_key)
            block_hashes.append(block_hash)
            self._register(seq.block_table[index], block_hash, (parent_hash, token_ids, seq.extra_key))

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Make `child_seq_id` a copy of the parent sharing all its blocks (each ref count + 1).

        The parent's KV must be fully written (fork after `mark_computed`, before `append_token`), so
        shared blocks never receive writes; each sample or beam then appends its own token and gets
        its own copy of a shared, partly filled last block.
        """
        parent = self._gpu_seq(parent_seq_id)
        if parent.num_computed_tokens != len(parent.token_ids):
            raise ValueError(f"sequence {parent_seq_id} has tokens whose KV is not written; fork after "
                             f"mark_computed, before append_token")
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id} already has blocks")
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        self._seqs[child_seq_id] = _Sequence(list(parent.token_ids), list(parent.block_table),
                                             parent.num_computed_tokens, list(parent.block_hashes),
                                             parent.extra_key)

    def free(self, seq_id: int) -> None:
        """Forget the sequence: its blocks lose one count each, last block first.

        A GPU block reaching 0 joins the free-queue tail, keeping its prefix-cache entry if it has one,
        so a conversation's deep blocks are overwritten before its first ones. Works while swapped too.
        """
        seq = self._seqs.pop(seq_id)
        if seq.is_swapped:
            self._release_cpu_blocks(seq.block_table)
        else:
            for block_id in reversed(seq.block_table):
                self._release(block_id)

    # ---- swapping (preemption by swap) ----
    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """True when the CPU pool has room for the distinct blocks of these GPU sequences."""
        return len(self._distinct_blocks(seq_ids, swapped=False)) <= len(self._free_cpu_blocks)

    def swap_out(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Move these sequences (one request's samples or beams together) to the CPU pool.

        Returns the (gpu_block, cpu_block) copies to make, one per distinct block, so shared blocks are
        copied once and stay shared. The GPU blocks are released as by `free`.
        """
        gpu_block_ids = self._distinct_blocks(seq_ids, swapped=False)
        if len(gpu_block_ids) > len(self._free_cpu_blocks):
            raise OutOfBlocksError(f"swap out needs {len(gpu_block_ids)} CPU blocks, "
                                   f"{len(self._free_cpu_blocks)} free")
        gpu_to_cpu = {block_id: self._free_cpu_blocks.pop() for block_id in gpu_block_ids}
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            for block_id in reversed(seq.block_table):
                self._release(block_id)
            seq.block_table = [gpu_to_cpu[block_id] for block_id in seq.block_table]
            for cpu_block_id in seq.block_table:
                self._cpu_ref_counts[cpu_block_id] += 1
            seq.is_swapped = True
        return list(gpu_to_cpu.items())

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """True when the free queue has room for the distinct blocks of these swapped sequences."""
        return len(self._distinct_blocks(seq_ids, swapped=True)) <= len(self._free_queue)

    def swap_in(self, seq_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Bring swapped sequences back to the GPU; returns the (cpu_block, gpu_block) copies to make.

        Their full computed blocks are registered in the prefix cache again where their keys are free.
        """
        cpu_block_ids = self._distinct_blocks(seq_ids, swapped=True)
        if len(cpu_block_ids) > len(self._free_queue):
            raise OutOfBlocksError(f"swap in needs {len(cpu_block_ids)} blocks, {len(self._free_queue)} available")
        cpu_to_gpu = {cpu_block_id: self._take_free_block() for cpu_block_id in cpu_block_ids}
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            self._release_cpu_blocks(seq.block_table)
            seq.block_table = [cpu_to_gpu[cpu_block_id] for cpu_block_id in seq.block_table]
            for block_id in seq.block_table:
                self._blocks[block_id].ref_count += 1
            seq.is_swapped = False
            parent_hash = ROOT_HASH
            for index, block_hash in enumerate(seq.block_hashes):
                token_ids = tuple(seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
                self._register(seq.block_table[index], block_hash, (parent_hash, token_ids, seq.extra_key))
                parent_hash = block_hash
        return list(cpu_to_gpu.items())

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, unless every invariant of the pools holds.

        free + cached + used == total; a block is free or cached exactly when it sits in the free queue
        with count 0; every GPU and CPU ref count equals the number of block tables pointing at it;
        the prefix-cache map and the blocks' keys agree, each key matches the contents behind it, and
        each sequence's block keys match its tokens; each block table covers exactly its tokens.
        """
        gpu_refs = [0] * self.num_blocks
        cpu_refs = [0] * self.num_cpu_blocks
        for seq_id, seq in self._seqs.items():
            _check(len(seq.block_table) == self._num_blocks_for(len(seq.token_ids)),
                   f"seq {seq_id}: {len(seq.block_table)} blocks for {len(seq.token_ids)} tokens")
            _check(len(set(seq.block_table)) == len(seq.block_table), f"seq {seq_id}: block repeated")
            _check(0 <= seq.num_computed_tokens <= len(seq.token_ids), f"seq {seq_id}: bad computed count")
            expected_num_hashes = seq.num_computed_tokens // self.block_size if self.enable_prefix_caching else 0
            _check(len(seq.block_hashes) == expected_num_hashes,
                   f"seq {seq_id}: {len(seq.block_hashes)} block keys, expected {expected_num_hashes}")
            parent_hash = ROOT_HASH
            for index, block_hash in enumerate(seq.block_hashes):
                token_ids = seq.token_ids[index * self.block_size:(index + 1) * self.block_size]
                _check(hash_block(parent_hash, token_ids, seq.extra_key) == block_hash,
                       f"seq {seq_id}: key of logical block {index} does not match its tokens")
                parent_hash = block_hash
            refs = cpu_refs if seq.is_swapped else gpu_refs
            for index, block_id in enumerate(seq.block_table):
                refs[block_id] += 1
                registered_hash = None if seq.is_swapped else self._blocks[block_id].block_hash
                _check(registered_hash is None or (index < len(seq.block_hashes)
                                                   and registered_hash == seq.block_hashes[index]),
                       f"seq {seq_id}: block {block_id} is registered under another sequence's key")
        num_free = num_cached = 0
        for block_id, block in enumerate(self._blocks):
            _check(block.ref_count == gpu_refs[block_id],
                   f"block {block_id}: ref count {block.ref_count}, {gpu_refs[block_id]} tables point at it")
            _check((block_id in self._free_queue) == (block.ref_count == 0),
                   f"block {block_id}: ref count {block.ref_count} but in free queue: {block_id in self._free_queue}")
            if block.block_hash is None:
                _check(block.hashed_content is None, f"block {block_id}: contents kept without a key")
            else:
                _check(self._hash_to_block.get(block.block_hash) == block_id,
                       f"block {block_id}: its key maps to block {self._hash_to_block.get(block.block_hash)}")
                _check(block.hashed_content is not None and hash_block(*block.hashed_content) == block.block_hash,
                       f"block {block_id}: key does not match its contents")
            num_free += block.ref_count == 0 and block.block_hash is None
            num_cached += block.ref_count == 0 and block.block_hash is not None
        for block_hash, block_id in self._hash_to_block.items():
            _check(self._blocks[block_id].block_hash == block_hash, f"key of block {block_id} maps elsewhere")
        _check(num_cached == self._num_cached_blocks,
               f"{num_cached} cached blocks, counter says {self._num_cached_blocks}")
        _check(num_free + num_cached + self.num_used_blocks == self.num_blocks,
               f"free {num_free} + cached {num_cached} + used {self.num_used_blocks} != {self.num_blocks}")
        for cpu_block_id, count in enumerate(self._cpu_ref_counts):
            _check(count == cpu_refs[cpu_block_id],
                   f"CPU block {cpu_block_id}: ref count {count}, {cpu_refs[cpu_block_id]} tables point at it")
        free_cpu = set(self._free_cpu_blocks)
        _check(len(free_cpu) == len(self._free_cpu_blocks), "CPU block listed free twice")
        _check(free_cpu == {i for i, count in enumerate(self._cpu_ref_counts) if count == 0},
               "CPU free list does not match the CPU blocks with count 0")

    # ---- internals ----
    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _gpu_seq(self, seq_id: int) -> _Sequence:
        seq = self._seqs[seq_id]
        if seq.is_swapped:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq

    def _prefix_hits(self, token_ids: Sequence[int], extra_key: bytes) -> list[tuple[bytes, int]]:
        """(key, block id) of the cached blocks matching the prompt's leading full blocks, capped."""
        if not self.enable_prefix_caching:
            return []
        hits: list[tuple[bytes, int]] = []
        parent_hash = ROOT_HASH
        block_size = self.block_size
        for index in range((len(token_ids) - 1) // block_size):
            block_hash = hash_block(parent_hash, token_ids[index * block_size:(index + 1) * block_size], extra_key)
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append((block_hash, block_id))
            parent_hash = block_hash
        return hits

    def _take_free_block(self) -> int:
        """Pop the free-queue head (ref count stays 0 for the caller to set), evicting its contents."""
        block_id, _ = self._free_queue.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._hash_to_block[block.block_hash]
            block.block_hash = block.hashed_content = None
            self._num_cached_blocks -= 1
            self.cached_block_evictions += 1
        return block_id

    def _take_cached_block(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free_queue[block_id]
            self._num_cached_blocks -= 1
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_queue[block_id] = None
            if block.block_hash is not None:
                self._num_cached_blocks += 1

    def _release_cpu_blocks(self, cpu_block_ids: list[int]) -> None:
        for cpu_block_id in reversed(cpu_block_ids):
            self._cpu_ref_counts[cpu_block_id] -= 1
            if self._cpu_ref_counts[cpu_block_id] == 0:
                self._free_cpu_blocks.append(cpu_block_id)

    def _register(self, block_id: int, block_hash: bytes, content: tuple[bytes, tuple[int, ...], bytes]) -> None:
        block = self._blocks[block_id]
        if block.block_hash is None and block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block_id
            block.block_hash = block_hash
            block.hashed_content = content

    def _distinct_blocks(self, seq_ids: Sequence[int], swapped: bool) -> list[int]:
        """Block ids of these sequences' tables, each once, checking they all live in the same pool."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids repeated: {list(seq_ids)}")
        block_ids: dict[int, None] = {}
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            if seq.is_swapped != swapped:
                raise ValueError(f"sequence {seq_id} is {'not ' if swapped else ''}swapped out")
            block_ids.update(dict.fromkeys(seq.block_table))
        return list(block_ids)


def _check(condition: bool, message: str) -> None:
    # Not `assert`: the check must also run under `python -O`.
    if not condition:
        raise AssertionError(message)
