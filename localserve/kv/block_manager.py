"""The KV block manager: which physical blocks of the KV pool hold which sequence's tokens.

Pure Python bookkeeping, no tensors (DESIGN.md section 3). The layers of a model are grouped by how they
keep KV (kv/layer_groups.py: full attention, or a sliding window of W tokens); each group has its own
pool of GPU blocks (kv/block_pool.py), its own block id space, and each sequence has one block table per
group, all covering the same tokens. A block of a pool is free (in the free queue, nothing worth
keeping), cached (in the free queue with ref count 0, its contents still registered in the prefix cache)
or used (ref count >= 1: that many block tables point at it; shared when > 1). Blocks whose count drops
to 0 join the free queue's tail and new blocks come from its head, so the least recently freed cached
block is overwritten first.

A full block's prefix-cache key (kv/block_hash.py) hashes its parent's key, its tokens, the sequence's extra
key and the block's own extra key where it has one (`block_extra_keys`: the content of the image whose
tokens it covers, engine/multimodal.py); a text-only block's key is that of its tokens alone.

A window group gives back the blocks that fall wholly before the window of the sequence's next query as
soon as they do (their entries become `NO_BLOCK`, the blocks stay cached), and with `window_chunk_tokens`
(the step's token budget) window and state groups give a sequence slots a prefill chunk at a time: the
tokens with a slot in every group (`num_slotted_tokens`) bound each prefill chunk (kv/group_slots.py). A
prefix hit of L tokens is one every group accepts: a full group needs every block before L, a window group
only those its window at L covers (kv/allocation_plan.py). Block moves (copy-on-write, swap) name their
group: (source, destination, group).

A state group (`RECURRENT`, recurrent layers: at most one, last) holds state slots, not KV: its tables are
`NO_BLOCK` but at checkpoints, the running state and the slot a step's final state goes to; it grants
slots a chunk at a time like a window group, and kv/state_group.py keeps its rules (which checkpoints,
when the running slot moves, which prefix hits it accepts); kv/state_steps.py reads its tables. With a
state group, `allocate_sharing` is refused, and `truncate` after a verify row keeps the slot its kept
tokens' final state was written to (`StateGroup.cut`; the model runner writes no rejected token's state).

The manager keeps these books and its record of each sequence (`SequenceBlocks`) itself, and reads them
through `BlockViews` (kv/block_views.py: the counts, a sequence's tables, `books()`); the work of its
operations is done by functions over them: admission (kv/allocation_plan.py), the window and state groups'
slots (kv/group_slots.py), appending a token (kv/token_append.py), swapping (kv/swap_moves.py). Its parts sit
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
   token marked computed in step 2, or nothing with a state group: its states are not written yet):
   `truncate` to the accepted tokens, then `mark_computed` them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from localserve.kv.allocation_plan import AllocationPlan, plan_allocation, take_tables
from localserve.kv.block_hash import hash_payload
from localserve.kv.block_pool import BlockMove, BlockPool
from localserve.kv.block_tier import BlockTier
from localserve.kv.block_views import BlockViews
from localserve.kv.followers import Followers
from localserve.kv.group_slots import GroupSlots
from localserve.kv.integrity import check_integrity
from localserve.kv.layer_groups import RECURRENT, GroupWindow
from localserve.kv.out_of_blocks import OutOfBlocksError
from localserve.kv.sequence_blocks import SequenceBlocks, gpu_sequence
from localserve.kv.state_group import CheckpointPolicy, StateGroup
from localserve.kv.swap_moves import blocks_to_move_in, fits_out, move_in, move_out
from localserve.kv.swap_pool import CpuSwapPool
from localserve.kv.token_append import append_token, num_blocks_to_append


class BlockManager(BlockViews):
    """Lazy paged allocation with reference counts, copy-on-write, a hashed prefix cache and swapping,
    per layer group (module doc).

    Sequences are named by an int `seq_id` chosen by the caller. For each the manager keeps one block
    table per group (logical block i -> physical block id) and its token ids, which key its full blocks.
    An operation that runs out of blocks in any group raises `OutOfBlocksError` and changes nothing;
    the `can_...` questions are exact. The counts the scheduler budgets with (`num_available_blocks`,
    `num_blocks_to_...`) are the tightest group's: the fewest blocks any group can hand out, the most
    any group takes.
    """

    def __init__(self, num_blocks: int | Sequence[int], block_size: int = 16, num_cpu_blocks: int | Sequence[int] = 0,
                 enable_prefix_caching: bool = True, group_windows: Sequence[GroupWindow] = (None,),
                 window_chunk_tokens: int | None = None, state_checkpoint_blocks: int = 1) -> None:
        """`group_windows`: each group's sliding window (None: full attention, `RECURRENT`: the state group,
        last); `num_blocks`: the pool size of each group, or one size for all (`num_cpu_blocks` likewise, the
        swap pools'); `window_chunk_tokens`: see
        the module doc (None: a window or state group takes blocks for a whole prompt at admission, as a
        full group does); `state_checkpoint_blocks`: the state group checkpoints every this many blocks
        (kv/state_group.py)."""
        if window_chunk_tokens is not None and window_chunk_tokens < 1:
            raise ValueError(f"window_chunk_tokens must be >= 1, got {window_chunk_tokens}")
        if state_checkpoint_blocks < 1:
            raise ValueError(f"state_checkpoint_blocks must be >= 1, got {state_checkpoint_blocks}")
        self.window_chunk_tokens = window_chunk_tokens
        pool_sizes = [num_blocks] * len(group_windows) if isinstance(num_blocks, int) else list(num_blocks)
        if not group_windows or len(pool_sizes) != len(group_windows):
            raise ValueError(f"need one pool size per group: {len(group_windows)} groups, sizes {pool_sizes}")
        if min(pool_sizes) < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {pool_sizes}, {block_size}")
        for group, window in enumerate(group_windows):
            if window is RECURRENT:
                if group != len(group_windows) - 1:
                    raise ValueError(f"the state group (RECURRENT) must be the last group, got {list(group_windows)}")
            elif window is not None and window < 1:
                raise ValueError(f"a group's sliding window must be >= 1, got {window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self._pools = [BlockPool(size) for size in pool_sizes]
        self._state = (StateGroup(len(pool_sizes) - 1, self._pools[-1],
                                  CheckpointPolicy(block_size, state_checkpoint_blocks, enable_prefix_caching))
                       if group_windows[-1] is RECURRENT else None)
        self._slots = GroupSlots(self._pools, self.group_windows, block_size, window_chunk_tokens, self._state)
        self.state_checkpoint_blocks = state_checkpoint_blocks
        self._kv_pools = self._pools[:-1] if self._state is not None else self._pools  # the groups keeping KV
        cpu_sizes = [num_cpu_blocks] * len(pool_sizes) if isinstance(num_cpu_blocks, int) else list(num_cpu_blocks)
        if len(cpu_sizes) != len(pool_sizes):
            raise ValueError(f"need one swap pool size per group: {len(pool_sizes)} groups, sizes {cpu_sizes}")
        self._swap_tiers: list[BlockTier] = [CpuSwapPool(size) for size in cpu_sizes]
        self._followers = Followers()
        self._seqs: dict[int, SequenceBlocks] = {}
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hit_tokens = 0  # of those, tokens found there (not recomputed)
        self.cow_copies = 0

    # ---- window and state groups' slots ----
    def can_ever_hold(self, num_prompt_tokens: int, num_peak_blocks: int) -> bool:
        """True when a sequence of this prompt, growing to `num_peak_blocks` blocks, fits the pools when
        alone: a full group holds all its blocks, a window group its first chunk's, a state group its first
        chunk's slots and, to pass a checkpoint, two (kv/group_slots.py)."""
        return self._slots.can_ever_hold(num_prompt_tokens, num_peak_blocks)

    @property
    def shares_uncomputed_blocks(self) -> bool:
        """Whether `allocate_sharing` shares a leader's blocks: not where window groups give slots a chunk at a
        time (a leader's window table does not reach the blocks it has not computed yet), nor with a state
        group (a follower would need the leader's states at blocks it has not computed yet)."""
        return not (self._slots.window_groups and self.window_chunk_tokens is not None) and self._state is None

    def make_slots(self, seq_id: int) -> int:
        """Give the sequence's window and state groups slots up to `window_chunk_tokens` past its computed
        tokens, as far as their pools have them now; returns `num_slotted_tokens` (a prefill chunk's end at most)."""
        self._slots.extend(gpu_sequence(self._seqs, seq_id))
        return self.num_slotted_tokens(seq_id)

    def num_slotted_tokens(self, seq_id: int) -> int:
        """Leading tokens of the sequence with a KV slot in every group: a prefill chunk ends there at most."""
        return self._slots.num_slotted_tokens(self._seqs[seq_id])

    # ---- admission ----
    def num_blocks_to_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"",
                               use_prefix_cache: bool = True, block_extra_keys: Sequence[bytes] = ()) -> int:
        """Blocks that admitting this prompt now would take out of the free queue of the group taking most:
        every block of the prompt except prefix hits on blocks in use and blocks a window group drops (a hit
        on a cached block counts, as it leaves the free queue too)."""
        return max(self._plan_allocation(token_ids, extra_key, use_prefix_cache, block_extra_keys).num_blocks_to_take)

    def group_blocks_to_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"",
                                 use_prefix_cache: bool = True, block_extra_keys: Sequence[bytes] = ()) -> list[int]:
        """`num_blocks_to_allocate` of each group, group 0 first."""
        return self._plan_allocation(token_ids, extra_key, use_prefix_cache, block_extra_keys).num_blocks_to_take

    def can_allocate(self, token_ids: Sequence[int], extra_key: bytes = b"",
                     block_extra_keys: Sequence[bytes] = ()) -> bool:
        """True when `allocate` of this prompt would succeed now."""
        plan = self._plan_allocation(token_ids, extra_key, True, block_extra_keys)
        return self._has_room(plan.num_blocks_to_take)

    def allocate(self, seq_id: int, token_ids: Sequence[int], extra_key: bytes = b"",
                 share_token_ids: bool = False, use_prefix_cache: bool = True,
                 block_extra_keys: Sequence[bytes] = ()) -> int:
        """Give a new sequence blocks for its whole prompt in every group; returns its number of cached tokens.

        Leading full blocks found in the prefix cache are shared (ref count + 1, taken out of the free
        queue if they sat there), at most (len(token_ids) - 1) // block_size of them so that the last
        prompt token is always computed, and only as many as every group accepts (module doc). The return
        value, a multiple of block_size, is where the prefill starts. `extra_key` is mixed into every
        block's key, `block_extra_keys[i]` into block i's besides (kv/block_hash.py, `block_extra_key`: the
        content of the image whose tokens the block covers); they stay the sequence's, its forks' and
        followers'. With `share_token_ids` the manager keeps the list `token_ids` itself, not a copy: the
        caller appends each token to it, then names it to `append_token` (one token list per sequence, not
        two), and never changes the tokens before. `use_prefix_cache` False: no hits are looked up (every
        token is computed; an embedding prompt whose pooling reads them all); its full blocks still enter
        the prefix cache once computed.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        plan = self._plan_allocation(token_ids, extra_key, use_prefix_cache, block_extra_keys)
        if not self._has_room(plan.num_blocks_to_take):
            raise OutOfBlocksError(f"prompt of {len(token_ids)} tokens needs {plan.num_blocks_to_take} blocks "
                                   f"per group, {[pool.num_available_blocks for pool in self._pools]} available")
        num_cached_tokens = plan.num_hits * self.block_size
        self._seqs[seq_id] = SequenceBlocks(
            token_ids=token_ids if share_token_ids else list(token_ids),
            block_tables=take_tables(self._slots, plan, len(token_ids)),
            num_computed_tokens=num_cached_tokens, block_hashes=plan.hit_hashes, extra_key=extra_key,
            num_tokens=len(token_ids), num_prompt_tokens=len(token_ids), shares_token_ids=share_token_ids,
            block_extra_keys=tuple(block_extra_keys))
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

        Where a window group of the leader has already given back blocks the sequence's window would
        need (the leader's prefix hit reaches past the shared blocks), the sequence shares nothing and is
        allocated alone (`allocate`, prefix hits included) instead.
        """
        if self._state is not None:
            raise ValueError("allocate_sharing: a manager with a state group shares no uncomputed blocks "
                             "(shares_uncomputed_blocks is False); allocate each sequence alone")
        leader = gpu_sequence(self._seqs, leader_id)
        num_shared_tokens = num_shared_blocks * self.block_size
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already has blocks")
        # It keeps at least its last token to compute, and shares only tokens the leader has, and equal ones.
        can_share = (0 < num_shared_tokens < len(token_ids) and num_shared_tokens <= leader.num_tokens
                     and list(token_ids[:num_shared_tokens]) == leader.token_ids[:num_shared_tokens])
        if not can_share:
            raise ValueError(f"sequence {seq_id} cannot share {num_shared_blocks} blocks of sequence {leader_id}")
        num_computed_blocks = min(leader.num_computed_tokens // self.block_size, num_shared_blocks)
        if not self._slots.windows_hold(leader, num_computed_blocks, num_shared_blocks):
            return self.allocate(seq_id, token_ids, leader.extra_key, share_token_ids,
                                 block_extra_keys=leader.block_extra_keys)
        num_new_blocks = self._slots.num_blocks_for(len(token_ids)) - num_shared_blocks
        if not self._has_room([num_new_blocks] * self.num_groups):
            raise OutOfBlocksError(f"{num_new_blocks} blocks needed per group, "
                                   f"{self.num_available_blocks} available")
        block_tables = []
        for pool, leader_table in zip(self._pools, leader.block_tables, strict=True):
            table = leader_table[:num_shared_blocks]
            pool.share(table)
            block_tables.append(table + [pool.take_free_block() for _ in range(num_new_blocks)])
        seq = SequenceBlocks(token_ids=token_ids if share_token_ids else list(token_ids), block_tables=block_tables,
                             num_computed_tokens=0, block_hashes=[], extra_key=leader.extra_key,
                             num_tokens=len(token_ids), num_prompt_tokens=len(token_ids),
                             shares_token_ids=share_token_ids, block_extra_keys=leader.block_extra_keys)
        self._seqs[seq_id] = seq
        self._take_computed_blocks(seq, leader, num_computed_blocks)
        if num_computed_blocks < num_shared_blocks:
            self._followers.add(seq_id, leader_id, num_shared_blocks)
        return seq.num_computed_tokens

    # ---- decoding ----
    def num_blocks_to_append(self, seq_ids: Iterable[int]) -> int:
        """Blocks taken from the free queue of the group taking most if each of these sequences appends one
        token, in any order: one per full last block; writers into a shared, partly filled last block need a
        copy each, except that when all its holders write, the last one finds itself sole owner and writes in
        place."""
        return max(num_blocks_to_append(self._pools, self._state, self.block_size, self._seqs, seq_ids))

    def can_append(self, seq_ids: Iterable[int]) -> bool:
        """True when each of these sequences can append one token now."""
        return self._has_room(num_blocks_to_append(self._pools, self._state, self.block_size, self._seqs, seq_ids))

    def append_token(self, seq_id: int, token_id: int) -> list[BlockMove]:
        """Grow the sequence by one token, whose KV the next forward pass writes: in each group a new block
        when the last one is full; a copy of a shared, partly filled last block (copy-on-write; the others
        keep the original). Returns the (source, destination, group) block copies to make first."""
        seq = self._seqs[seq_id]
        if seq.is_swapped:
            gpu_sequence(self._seqs, seq_id)  # raises
        copies = append_token(self._pools, self._state, self.block_size, seq, seq_id, token_id)
        self.cow_copies += len(copies)
        return copies

    def mark_computed(self, seq_id: int, num_computed_tokens: int) -> None:
        """Record that the KV of the sequence's first `num_computed_tokens` tokens is written.

        Each block this makes full and computed is registered in the prefix cache of every group, unless
        its key is already registered to another block (that mapping is kept); then window groups give back
        the blocks now wholly before the window. The count never decreases.
        """
        seq = self._seqs[seq_id]
        num_before = seq.num_computed_tokens
        if seq.is_swapped or not num_before <= num_computed_tokens <= self.num_slotted_tokens(seq_id):
            gpu_sequence(self._seqs, seq_id)  # raises if swapped
            raise ValueError(f"sequence {seq_id}: num_computed_tokens must be in [{num_before}, "
                             f"{self.num_slotted_tokens(seq_id)}] (its tokens with slots), got {num_computed_tokens}")
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
                    # The KV groups (the state group, last, registers its checkpoints in `move_on`).
                    for pool, table in zip(self._kv_pools, seq.block_tables):
                        pool.register(table[index], seq.block_hashes[index], content)
            if self._followers.leads(seq_id):
                for follower_id, num_blocks in self._followers.catch_up(seq_id, num_full_blocks):
                    self._take_computed_blocks(self._seqs[follower_id], seq, num_blocks)
        self._slots.move_on(seq, num_before)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Keep only the sequence's first `num_tokens` tokens: the rejected tokens of a speculative draft.

        The blocks past the kept tokens lose one count each (last first) and join the free queue's tail.
        When blocks go, the sequence's tables become new lists (see `live_block_table`).
        Only uncomputed tokens can go (`num_computed_tokens <= num_tokens`): a block enters the prefix cache
        only once full of computed tokens, so none that held a dropped token is registered under any key,
        and the kept last block is written again only past the kept tokens. A shared token list
        (`share_token_ids`) is its owner's to shorten; a copy is shortened here.
        """
        seq = gpu_sequence(self._seqs, seq_id)
        if not max(1, seq.num_computed_tokens) <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id}: truncate to [{max(1, seq.num_computed_tokens)}, "
                             f"{seq.num_tokens}] tokens, got {num_tokens}")
        num_blocks = self._slots.num_blocks_for(num_tokens)
        for group, pool in enumerate(self._pools):
            table = seq.block_tables[group]
            if group == self.state_group:
                seq.block_tables[group] = self._state.cut(table, num_tokens)
                continue
            dropped = table[num_blocks:]
            if dropped:
                # A new list: a table that shrank is never the same list grown back (whoever mirrors tables by
                # list, as the model runner does, sees another list and reads it whole).
                seq.block_tables[group] = table[:num_blocks]
                pool.release(reversed(dropped))
        if not seq.shares_token_ids:
            del seq.token_ids[num_tokens:]
        seq.num_tokens = num_tokens

    def fork(self, parent_seq_id: int, child_seq_id: int, child_token_ids: list[int] | None = None) -> None:
        """Make `child_seq_id` a copy of the parent sharing all its blocks (each ref count + 1). The
        parent's KV must be fully written (fork after `mark_computed`, before `append_token`), so shared
        blocks never receive writes: each sample or beam then appends its own token. `child_token_ids`: the
        caller's list of the parent's tokens for the child to share (see `allocate`); else a copy."""
        parent = gpu_sequence(self._seqs, parent_seq_id)
        if parent.num_computed_tokens != parent.num_tokens:
            raise ValueError(f"sequence {parent_seq_id} has tokens whose KV is not written; fork after "
                             f"mark_computed, before append_token")
        if child_seq_id in self._seqs:
            raise ValueError(f"sequence {child_seq_id} already has blocks")
        tokens = parent.token_ids[:parent.num_tokens]
        if child_token_ids is not None and child_token_ids[:parent.num_tokens] != tokens:
            raise ValueError(f"sequence {child_seq_id}: its token list is not sequence {parent_seq_id}'s")
        for pool, table in zip(self._pools, parent.block_tables, strict=True):
            pool.share(table)
        self._seqs[child_seq_id] = SequenceBlocks(
            token_ids=tokens if child_token_ids is None else child_token_ids,
            block_tables=[list(table) for table in parent.block_tables],
            num_computed_tokens=parent.num_computed_tokens, block_hashes=list(parent.block_hashes),
            extra_key=parent.extra_key, num_tokens=parent.num_tokens, num_prompt_tokens=parent.num_prompt_tokens,
            shares_token_ids=child_token_ids is not None, may_share_last_block=True,
            block_extra_keys=parent.block_extra_keys)
        parent.may_share_last_block = True

    def free(self, seq_id: int) -> None:
        """Forget the sequence (swapped or not): its blocks lose one count each, last block first. A GPU
        block reaching 0 joins the free-queue tail, keeping its prefix-cache entry if it has one,
        so a conversation's deep blocks are overwritten before its first ones.
        """
        seq = self._seqs.pop(seq_id)
        self._followers.forget(seq_id)  # the scheduler frees its followers with it; alone, each computes itself
        for pool, tier, table in zip(self._pools, self._swap_tiers, seq.block_tables, strict=True):
            if seq.is_swapped:
                tier.release(table)
            else:
                pool.release(reversed(table))

    # ---- preemption by swap ----
    def can_swap_out(self, seq_ids: Sequence[int]) -> bool:
        """True when every group's CPU pool has room for the distinct blocks of these GPU sequences."""
        return fits_out(self._seqs, self._swap_tiers, seq_ids)

    def swap_out(self, seq_ids: Sequence[int]) -> list[BlockMove]:
        """Move these sequences (all of one request's samples or beams) to the CPU pools.

        Returns the (gpu_block, cpu_block, group) copies to make, one per distinct block, so shared blocks
        are copied once and stay shared. The GPU blocks are released as by `free`.
        """
        if not self.can_swap_out(seq_ids):  # raises on a repeated or swapped sequence
            raise OutOfBlocksError(f"swapping out sequences {list(seq_ids)}: a CPU pool is too small")
        return move_out(self._pools, self._swap_tiers, [self._seqs[seq_id] for seq_id in seq_ids])

    def group_blocks_to_swap_in(self, seq_ids: Sequence[int]) -> list[int]:
        """`num_blocks_to_swap_in` of each group, group 0 first."""
        return blocks_to_move_in(self._seqs, seq_ids, self.num_groups)

    def num_blocks_to_swap_in(self, seq_ids: Sequence[int]) -> int:
        """GPU blocks that swapping these sequences back in would take in the group taking most (shared
        blocks count once)."""
        return max(self.group_blocks_to_swap_in(seq_ids))

    def can_swap_in(self, seq_ids: Sequence[int]) -> bool:
        """True when every group's free queue has room for the distinct blocks of these swapped sequences."""
        return self._has_room(self.group_blocks_to_swap_in(seq_ids))

    def swap_in(self, seq_ids: Sequence[int]) -> list[BlockMove]:
        """Bring swapped sequences back to the GPU; returns the (cpu_block, gpu_block, group) copies to make.

        Their full computed blocks (in a state group, its policy checkpoints) are registered in the prefix
        cache again where their keys are free.
        """
        if not self.can_swap_in(seq_ids):
            raise OutOfBlocksError(f"swapping in sequences {list(seq_ids)}: a pool has too few blocks")
        return move_in(self._pools, self._swap_tiers, self._seqs, seq_ids, self.block_size, self._state)

    # ---- integrity ----
    def check_integrity(self) -> None:
        """Raise AssertionError, saying what is wrong, unless every invariant of the pools holds: the
        manager's books (kv/integrity.py, read through `books()`, the window bound included) and each part's
        own."""
        for tier in self._swap_tiers:
            tier.check_integrity()
        self._followers.check_integrity()
        check_integrity(self.books())

    # ---- internals ----
    def _has_room(self, num_blocks_per_group: Sequence[int]) -> bool:
        return all(num_blocks <= pool.num_available_blocks
                   for num_blocks, pool in zip(num_blocks_per_group, self._pools, strict=True))

    def _plan_allocation(self, token_ids: Sequence[int], extra_key: bytes, use_prefix_cache: bool,
                         block_extra_keys: Sequence[bytes] = ()) -> AllocationPlan:
        """The prefix hits every group accepts, and the blocks the prompt takes from each free queue
        (kv/allocation_plan.py)."""
        return plan_allocation(self._slots, token_ids, extra_key, self.enable_prefix_caching and use_prefix_cache,
                               block_extra_keys)

    def _take_computed_blocks(self, follower: SequenceBlocks, leader: SequenceBlocks, num_blocks: int) -> None:
        """The follower counts the leader's first `num_blocks` blocks, which it shares, as computed."""
        num_before = follower.num_computed_tokens
        if num_blocks * self.block_size > num_before:
            follower.num_computed_tokens = num_blocks * self.block_size
            follower.block_hashes = leader.block_hashes[:num_blocks]
            self._slots.slide_windows(follower, num_before)
