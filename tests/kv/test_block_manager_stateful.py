"""Random engine histories against the block manager, checked after every step.

Besides `check_integrity()`, the machine keeps a model of the KV pool itself: every slot of every GPU
and CPU block holds the prefix of tokens whose KV it stands for. Writing a step's KV, making the block
copies the manager returns (copy-on-write, swap out, swap in) and reading a prefix hit then prove
end to end that no sequence ever reads KV other than its own, and that no shared block is written.
Speculative drafts are appended, their KV written, and truncated back to the accepted tokens; a block
in the prefix cache must then hold the KV of exactly the tokens its key names.

The pool has one to three layer groups (full attention and sliding windows of 1-6 tokens): each group
has its own pool and its own KV model; a sequence reads, in a window group, only the KV of its window,
and the integrity check holds each window group to the blocks of its window at every step.

Some managers have a state group last (recurrent layers): its model keeps, per slot, the tokens folded
into the state it holds. Each step reads and writes the slots `step_state_slots` names on the manager's
table (it must never raise there, whatever the step's length): the read slot must hold exactly the
state of the computed tokens, no write may land in a shared or registered slot, and a registered
checkpoint holds the state of the tokens its key names. A verify step there writes the states of its kept
tokens only (`kept_state_slots`), then `truncate` moves the final state's slot back to the last kept entry.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from localserve.kv.block_manager import BlockManager
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.layer_groups import RECURRENT, window_start
from localserve.kv.out_of_blocks import OutOfBlocksError
from localserve.kv.state_steps import kept_state_slots, step_state_slots

SMALL_VOCAB = st.integers(0, 2)  # few distinct tokens, so prompts often share prefixes by chance
MAX_RUNNING_REQUESTS = 4  # like the scheduler's slots: leaves room in the pool for decoding


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(data=st.data(), block_size=st.sampled_from([1, 2, 4]),
                num_cpu_blocks=st.integers(0, 16), enable_prefix_caching=st.booleans(),
                group_windows=st.sampled_from([(None,), (None, "w"), ("w",), (None, "w", "w"), (None, "s"),
                                               (None, "w", "s"), ("s",)]),
                window_chunk_tokens=st.sampled_from([None, 1, 3, 8]), state_checkpoint_blocks=st.integers(1, 3))
    def create_manager(self, data, block_size, num_cpu_blocks, enable_prefix_caching, group_windows,
                       window_chunk_tokens, state_checkpoint_blocks):
        group_windows = tuple(RECURRENT if window == "s" else window and data.draw(st.integers(1, 6))
                              for window in group_windows)
        pool_sizes = [data.draw(st.integers(4, 40)) for _ in group_windows]
        self.manager = BlockManager(pool_sizes, block_size, num_cpu_blocks, enable_prefix_caching, group_windows,
                                    window_chunk_tokens, state_checkpoint_blocks)
        self.state_group = len(group_windows) - 1 if group_windows[-1] is RECURRENT else None
        self.group_windows = group_windows
        self.num_groups = len(group_windows)
        self.block_size = block_size
        self.requests: dict[int, list[int]] = {}  # request id -> its live sequence ids
        self.swapped_requests: set[int] = set()
        self.token_ids: dict[int, list[int]] = {}  # sequence id -> its tokens
        self.num_computed: dict[int, int] = {}
        self.past_prompts: list[list[int]] = [[0] * 8]
        # Per group, per block, per slot: the tokens whose KV it holds (a state group: one slot per block, the
        # tokens folded into its state).
        self.gpu_kv = [[[None] * (1 if window is RECURRENT else block_size) for _ in range(num_blocks)]
                       for num_blocks, window in zip(pool_sizes, group_windows)]
        self.cpu_kv = [[[None] * (1 if window is RECURRENT else block_size) for _ in range(num_cpu_blocks)]
                       for window in group_windows]
        self.next_id = 0

    # ---- helpers ----
    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def gpu_requests(self) -> list[int]:
        return sorted(set(self.requests) - self.swapped_requests)

    def available(self) -> list[int]:
        return [usage.num_blocks - usage.num_used_blocks for usage in self.manager.group_usage()]

    def compute(self, seq_id: int, num_computed: int) -> bool:
        """The forward pass writes KV for positions [computed, num_computed) chunk by chunk, each as far as
        the window groups give slots, then the engine says so; False when they run out of slots first."""
        while self.num_computed[seq_id] < num_computed:
            end = min(num_computed, self.manager.make_slots(seq_id))
            if end <= self.num_computed[seq_id]:
                return False
            self.step_states(seq_id, self.num_computed[seq_id], end)
            self.write_kv(seq_id, self.num_computed[seq_id], end)
            self.manager.mark_computed(seq_id, end)
            self.num_computed[seq_id] = end
        return True

    def write_kv(self, seq_id: int, start: int, end: int) -> None:
        """The forward pass writes the KV of positions [start, end) in every group, marking nothing computed."""
        tokens = self.token_ids[seq_id]
        for group in range(self.num_groups):
            if group == self.state_group:
                continue
            table = self.manager.block_table(seq_id, group)
            for position in range(start, end):
                block_id = table[position // self.block_size]
                assert block_id != NO_BLOCK, f"group {group}: no block for new token {position}"
                assert self.manager.ref_count(block_id, group) == 1, f"KV written into shared block {block_id}"
                self.gpu_kv[group][block_id][position % self.block_size] = tuple(tokens[:position + 1])

    def step_states(self, seq_id: int, start: int, end: int, kept_end: int | None = None) -> None:
        """The recurrent layers' part of a step over positions [start, end): read the state of `start`
        tokens, write the checkpoints inside the step and the final state where `step_state_slots` says; a
        verify row's step keeps only the tokens before `kept_end` (`kept_state_slots`)."""
        if self.state_group is None:
            return
        group, tokens = self.state_group, self.token_ids[seq_id]
        pool = self.manager.books().pools[group]
        table = self.manager.live_block_table(seq_id, group)
        # Any step the slots allow works on this table, and reads the same slot.
        num_slotted = self.manager.num_slotted_tokens(seq_id)
        assert len({step_state_slots(table, start, num_new, self.block_size)[0]
                    for num_new in range(1, num_slotted - start + 1)}) == 1
        read, saves = step_state_slots(table, start, end - start, self.block_size)
        if kept_end is not None:
            saves = kept_state_slots(saves, kept_end - start)
            end = kept_end
        if start == 0:
            assert read == -1, f"seq {seq_id}: a first step reads slot {read}"
        else:
            held = self.gpu_kv[group][read][0]
            assert held == tuple(tokens[:start]), f"seq {seq_id}: reads the state of {held}, not of {start} tokens"
        assert [after for after, _ in saves] == sorted({after for after, _ in saves}) and saves[-1][0] == end - start
        for after, slot in saves:
            assert pool.ref_counts[slot] == 1 and pool.block_hashes[slot] is None, \
                f"seq {seq_id}: writes slot {slot}, shared or registered"
            self.gpu_kv[group][slot][0] = tuple(tokens[:start + after])

    def admit(self, token_ids: list[int]) -> None:
        manager = self.manager
        num_blocks = manager.num_blocks_to_allocate(token_ids)
        assert manager.can_allocate(token_ids) or num_blocks > manager.num_available_blocks
        seq_id = self.new_id()
        if not manager.can_allocate(token_ids):
            before = manager.snapshot()
            with pytest.raises(OutOfBlocksError):
                manager.allocate(seq_id, token_ids)
            assert manager.snapshot() == before
            return
        available, hits = self.available(), manager.prefix_hit_tokens
        num_cached_tokens = manager.allocate(seq_id, token_ids)
        assert max(map(int.__sub__, available, self.available())) == num_blocks
        assert num_cached_tokens % self.block_size == 0
        assert num_cached_tokens <= (len(token_ids) - 1) // self.block_size * self.block_size
        assert manager.prefix_hit_tokens - hits == num_cached_tokens
        self.requests[seq_id] = [seq_id]
        self.token_ids[seq_id] = list(token_ids)
        self.num_computed[seq_id] = num_cached_tokens  # the KV model checks these hits are right
        self.past_prompts.append(list(token_ids))

    def release(self, request_id: int) -> list[int]:
        """Free every sequence of a request; returns the tokens of its first one."""
        seq_ids = self.requests.pop(request_id)
        self.swapped_requests.discard(request_id)
        token_ids = self.token_ids[seq_ids[0]]
        for seq_id in seq_ids:
            self.manager.free(seq_id)
            del self.token_ids[seq_id], self.num_computed[seq_id]
        return token_ids

    def append_one_token_each(self, seq_ids: list[int], data) -> bool:
        """One decode step's appends, if the pool allows; checks the exact block and copy counts."""
        manager = self.manager
        num_blocks = manager.num_blocks_to_append(seq_ids)
        assert manager.can_append(seq_ids) or num_blocks > manager.num_available_blocks
        if not manager.can_append(seq_ids):
            return False
        available, cow_copies = self.available(), manager.cow_copies
        copies = []
        for seq_id in seq_ids:
            token_id = data.draw(SMALL_VOCAB)
            new_copies = manager.append_token(seq_id, token_id)
            assert len(new_copies) <= self.num_groups
            copies += new_copies
            self.token_ids[seq_id].append(token_id)
        assert max(map(int.__sub__, available, self.available())) == num_blocks
        assert manager.cow_copies - cow_copies == len(copies)
        for source, destination, group in copies:  # the model runner's copy-on-write
            self.gpu_kv[group][destination] = list(self.gpu_kv[group][source])
        return True

    # ---- rules ----
    @precondition(lambda self: len(self.requests) < MAX_RUNNING_REQUESTS)
    @rule(tokens=st.lists(SMALL_VOCAB, min_size=1, max_size=16))
    def allocate_new_prompt(self, tokens):
        self.admit(tokens)

    @precondition(lambda self: len(self.requests) < MAX_RUNNING_REQUESTS)
    @rule(data=st.data(), suffix=st.lists(SMALL_VOCAB, min_size=0, max_size=10))
    def allocate_prompt_sharing_a_prefix(self, data, suffix):
        earlier = data.draw(st.sampled_from(self.past_prompts))
        prefix_len = data.draw(st.integers(0, len(earlier)))
        if prefix_len + len(suffix) > 0:
            self.admit(earlier[:prefix_len] + suffix)

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data())
    def compute_a_chunk(self, data):
        request_id = data.draw(st.sampled_from(self.gpu_requests()))
        for seq_id in self.requests[request_id]:
            num_computed = data.draw(st.integers(self.num_computed[seq_id], len(self.token_ids[seq_id])))
            self.compute(seq_id, num_computed)

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def decode_steps(self, data, num_steps):
        request_id = data.draw(st.sampled_from(self.gpu_requests()))
        seq_ids = data.draw(st.lists(st.sampled_from(self.requests[request_id]), min_size=1, unique=True))
        for _ in range(num_steps):
            if not all([self.compute(seq_id, len(self.token_ids[seq_id])) for seq_id in seq_ids]):
                return  # a window group has no slots for the rest of a prompt now
            if not self.append_one_token_each(seq_ids, data):
                return

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data(), num_drafted=st.integers(1, 6))
    def verify_a_draft(self, data, num_drafted):
        """A verify step: the sequence decodes its last token and a draft, the forward pass writes all their
        KV, only the last real token is marked computed, then the accepted drafted tokens stay."""
        request_id = data.draw(st.sampled_from(self.gpu_requests()))
        seq_id = data.draw(st.sampled_from(self.requests[request_id]))
        manager, tokens = self.manager, self.token_ids[seq_id]
        if not self.compute(seq_id, max(self.num_computed[seq_id], len(tokens) - 1)) \
                or manager.make_slots(seq_id) < len(tokens):
            return  # not decoding yet: its window groups have no slots for the rest of its prompt now
        if self.state_group is not None and self.num_computed[seq_id] == len(tokens) \
                and not self.append_one_token_each([seq_id], data):
            return  # a verify row's step computes its last real token too: one must be pending
        num_real = len(tokens)
        drafted = 0
        while drafted < num_drafted and self.append_one_token_each([seq_id], data):
            drafted += 1
        start = self.num_computed[seq_id]
        num_kept = num_real + data.draw(st.integers(0, drafted))
        self.write_kv(seq_id, start, len(tokens))
        if self.state_group is not None:  # the states of the kept tokens only, written after the verification
            self.step_states(seq_id, start, len(tokens), kept_end=num_kept)
        else:
            manager.mark_computed(seq_id, num_real)
            self.num_computed[seq_id] = num_real
        available = self.available()
        tables = [manager.block_table(seq_id, group) for group in range(self.num_groups)]
        manager.truncate(seq_id, num_kept)
        num_blocks_kept = -(-num_kept // self.block_size)
        for group, table in enumerate(tables):
            if group == self.state_group:  # the final state's slot moves back to the last kept entry
                cut = table if len(table) <= num_blocks_kept else table[:num_blocks_kept - 1] + [table[-1]]
                assert manager.block_table(seq_id, group) == cut
                released = [slot for slot in table[num_blocks_kept - 1:-1] if slot != NO_BLOCK]
                assert self.available()[group] - available[group] == (len(released) if cut is not table else 0)
                continue
            assert manager.block_table(seq_id, group) == table[:num_blocks_kept]
            dropped = table[num_blocks_kept:]
            assert NO_BLOCK not in dropped
            assert self.available()[group] - available[group] == len(dropped)
            free_queue = manager.free_queue_block_ids(group)
            assert free_queue[len(free_queue) - len(dropped):] == dropped[::-1]
        del tokens[num_kept:]
        if self.state_group is not None:
            manager.mark_computed(seq_id, num_kept)
            self.num_computed[seq_id] = num_kept
        else:
            self.compute(seq_id, data.draw(st.integers(num_real, num_kept)))  # the accepted tokens' KV is theirs

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data())
    def fork(self, data):
        request_id = data.draw(st.sampled_from(self.gpu_requests()))
        parent = data.draw(st.sampled_from(self.requests[request_id]))
        if not self.compute(parent, len(self.token_ids[parent])):
            return
        child = self.new_id()
        self.manager.fork(parent, child)
        self.requests[request_id].append(child)
        self.token_ids[child] = list(self.token_ids[parent])
        self.num_computed[child] = self.num_computed[parent]

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data())
    def beam_search_step(self, data):
        """Beams are reordered: survivors forked from chosen parents, the rest dropped; then all grow."""
        request_id = data.draw(st.sampled_from(self.gpu_requests()))
        beams = self.requests[request_id]
        parents = data.draw(st.lists(st.sampled_from(beams), min_size=len(beams), max_size=len(beams)))
        new_beams = []
        if not all([self.compute(parent, len(self.token_ids[parent])) for parent in beams]):
            return
        for index, parent in enumerate(parents):
            if parent in parents[:index]:  # a second child of the same parent: fork it
                child = self.new_id()
                self.manager.fork(parent, child)
                self.token_ids[child] = list(self.token_ids[parent])
                self.num_computed[child] = self.num_computed[parent]
                new_beams.append(child)
            else:
                new_beams.append(parent)
        for beam in beams:
            if beam not in parents:
                self.manager.free(beam)
                del self.token_ids[beam], self.num_computed[beam]
        self.requests[request_id] = new_beams
        self.append_one_token_each(new_beams, data)

    @precondition(lambda self: any(len(seq_ids) > 1 for seq_ids in self.requests.values()))
    @rule(data=st.data())
    def drop_beam(self, data):
        request_id = data.draw(st.sampled_from(sorted(r for r, s in self.requests.items() if len(s) > 1)))
        seq_id = data.draw(st.sampled_from(self.requests[request_id]))
        self.requests[request_id].remove(seq_id)
        self.manager.free(seq_id)
        del self.token_ids[seq_id], self.num_computed[seq_id]

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        self.release(data.draw(st.sampled_from(sorted(self.requests))))

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        """All of a request's blocks go at once; it comes back as one long prompt (often a prefix hit)."""
        self.admit(self.release(data.draw(st.sampled_from(self.gpu_requests()))))

    @precondition(lambda self: self.gpu_requests())
    @rule(data=st.data())
    def swap_out(self, data):
        request_id = data.draw(st.sampled_from(self.gpu_requests()))
        seq_ids = self.requests[request_id]
        if not self.manager.can_swap_out(seq_ids):
            with pytest.raises(OutOfBlocksError):
                self.manager.swap_out(seq_ids)
            return
        distinct_blocks = {(block_id, group) for seq_id in seq_ids for group in range(self.num_groups)
                           for block_id in self.manager.block_table(seq_id, group) if block_id != NO_BLOCK}
        copies = self.manager.swap_out(seq_ids)
        assert {(gpu_block_id, group) for gpu_block_id, _, group in copies} == distinct_blocks  # shared: once
        assert len(copies) == len(distinct_blocks)
        for gpu_block_id, cpu_block_id, group in copies:
            self.cpu_kv[group][cpu_block_id] = list(self.gpu_kv[group][gpu_block_id])
        self.swapped_requests.add(request_id)

    @precondition(lambda self: self.swapped_requests)
    @rule(data=st.data())
    def swap_in(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.swapped_requests)))
        seq_ids = self.requests[request_id]
        if not self.manager.can_swap_in(seq_ids):
            with pytest.raises(OutOfBlocksError):
                self.manager.swap_in(seq_ids)
            return
        for cpu_block_id, gpu_block_id, group in self.manager.swap_in(seq_ids):
            self.gpu_kv[group][gpu_block_id] = list(self.cpu_kv[group][cpu_block_id])
        self.swapped_requests.remove(request_id)

    # ---- invariants, after every step ----
    @invariant()
    def pools_are_consistent(self):
        self.manager.check_integrity()

    @invariant()
    def a_cached_block_holds_the_kv_of_the_tokens_its_key_names(self):
        for group, pool in enumerate(self.manager.books().pools):
            for block_id, content in enumerate(pool.block_contents):
                if content is not None:
                    tokens = struct.unpack(f"<{self.block_size}q", content[-8 * self.block_size:])
                    if group == self.state_group:  # the state of the tokens up to the block's end
                        state = self.gpu_kv[group][block_id][0]
                        assert state is not None and len(state) % self.block_size == 0 \
                            and state[-self.block_size:] == tokens, f"checkpoint {block_id} holds {state}"
                        continue
                    held = [slot[-1] if slot else None for slot in self.gpu_kv[group][block_id]]
                    assert held == list(tokens), (f"group {group}: block {block_id} holds the KV of {held}, "
                                                  f"its key names {tokens}")

    @invariant()
    def each_sequence_holds_exactly_its_tokens_and_reads_its_own_kv(self):
        for request_id, seq_ids in self.requests.items():
            kv = self.cpu_kv if request_id in self.swapped_requests else self.gpu_kv
            for seq_id in seq_ids:
                tokens = self.token_ids[seq_id]
                assert self.manager.num_tokens(seq_id) == len(tokens)
                assert self.manager.num_computed_tokens(seq_id) == self.num_computed[seq_id]
                for group, window in enumerate(self.group_windows):
                    table = self.manager.block_table(seq_id, group)
                    if window is RECURRENT:  # its running slot holds the state of the computed tokens
                        num_computed = self.num_computed[seq_id]
                        if num_computed:
                            slot = table[(num_computed - 1) // self.block_size]
                            slot = slot if slot != NO_BLOCK else table[-1]  # moved ahead for the next step
                            assert kv[group][slot][0] == tuple(tokens[:num_computed]), f"seq {seq_id}: state"
                        continue
                    num_blocks = -(-len(tokens) // self.block_size)
                    # A window group's table may stop short of the tokens (slots a chunk at a time).
                    assert len(table) == num_blocks if window is None else len(table) <= num_blocks
                    # What the sequence's next query reads: its window's KV (all of it in a full group).
                    for position in range(window_start(self.num_computed[seq_id], window), self.num_computed[seq_id]):
                        slot = kv[group][table[position // self.block_size]][position % self.block_size]
                        assert slot == tuple(tokens[:position + 1]), (f"seq {seq_id}, group {group}: reads wrong "
                                                                      f"KV at {position}")


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_block_manager_random_histories = BlockManagerMachine.TestCase
