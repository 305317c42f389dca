"""Decides what each engine step runs: continuous batching, chunked prefill, preemption. No torch.

A step is built in this order: (1) make room for the running requests' decodes, preempting if the
pool is short; (2) append each decoding sequence's last sampled token and schedule the decodes,
oldest request first; (3) prefill chunks of running requests (long or readmitted prompts); then,
unless this step preempted, (4) swapped-out requests come back and waiting requests are admitted,
in arrival order across both queues, while slots (`max_num_seqs`), the token budget
(`max_num_batched_tokens`) and blocks allow.

The rules, and why (docs/ARCHITECTURE.md, "Scheduling rules", says the same):

Admission (new, swapped and preempted requests alike). A request is planned as a whole: the blocks
it takes now (its prompt minus prefix-cache hits; after a recompute its samples or beams share the
full blocks of their common prefix, each adds its own tail; after a swap, its distinct blocks) plus
headroom: one block for every sequence running after it (samples and beams count, and a request not
yet forked counts its `n`), its own capped by what it can still grow to (`peak_blocks`). So a
(re)admitted request is not preempted again by the next decodes, and the `n - 1` copy-on-write copies
after a fork have room. Slots count the same sequences. The swapped and waiting queues are served
as one, strictly in arrival order (a request that fell back from swap to recompute does not wait
behind one swapped out after it), and nothing passes a request that does not fit yet: no request
waits behind a later one. Fairness bound: a request that fits the pool alone (checked when it is added: its
`peak_blocks` against the pool) is admitted at the latest once every request ahead of it is admitted
and the running requests have finished; when nothing runs its headroom is at most its own growth, so
it fits. Nothing is readmitted in a step that preempted: that step was short of blocks.

Victims. When the decodes of a step need more blocks than are available, requests are preempted,
whole (half a request's KV is useless), before anything else goes into the step, so a victim has no
chunk, append or block copy to withdraw, and no move of the step names its blocks but its own
swap-out or free. The victim is the newest running request, because it has the least invested and
the older ones keep their priority (an older request is never preempted to make room for a newer
one), except that a request readmitted and not yet sampled since is passed over (anti-thrashing: it
would be evicted before its re-prefill paid off). The request needing the blocks is the last
candidate: it yields itself rather than evict an older request. The headroom above keeps a protected
request from needing blocks, so every request is preempted at most once more than it samples. A
request alone in the pool that still does not fit fails with a reason instead of looping.
"""

from __future__ import annotations

import bisect
import logging
import operator
from collections import deque
from dataclasses import dataclass, field

from localserve.engine.config import SchedulerConfig
from localserve.engine.events import EventKind, EventLog
from localserve.engine.sequence import Request, RequestState, Sequence
from localserve.engine.step import SeqChunk, StepInput
from localserve.kv.block_manager import BlockManager

log = logging.getLogger(__name__)
_arrival = operator.attrgetter("arrival")


def peak_blocks(num_prompt_tokens: int, max_tokens: int, num_seqs: int, block_size: int) -> int:
    """The most blocks a request can hold: its full prompt blocks once, and each sample's or beam's
    own blocks up to the last token it writes (the last sampled token is never written)."""
    shared = num_prompt_tokens // block_size
    per_seq = -(-(num_prompt_tokens + max_tokens - 1) // block_size)
    return shared + num_seqs * (per_seq - shared)


@dataclass
class Batch:
    """One step's work: which sequences run, with how many query tokens over how much context."""

    seqs: list[Sequence] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)  # the request of each entry of seqs
    step_input: StepInput = field(default_factory=lambda: StepInput(chunks=[]))
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # could never fit; finished with an error

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(q for q in self.query_lens if q > 1)

    @property
    def context_lens(self) -> list[int]:
        return [seq.num_computed_tokens + q for seq, q in zip(self.seqs, self.query_lens)]


class Scheduler:
    """Holds the waiting, running and swapped requests and builds one Batch per step."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, events: EventLog | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.events = events if events is not None else EventLog()
        self.waiting: list[Request] = []  # arrival order
        self.running: list[Request] = []  # arrival order
        self.swapped: list[Request] = []  # arrival order
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.num_swap_fallbacks = 0  # swap asked for but the swap pool was full: recompute instead
        self._with_followers: list[Request] = []  # requests whose samples wait for their leader's prefill
        # Recent preemptions: (request id, its output tokens at that moment); bounded for long runs.
        self.preemption_log: deque[tuple[str, int]] = deque(maxlen=10_000)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def peak_blocks(self, request: Request) -> int:
        return peak_blocks(len(request.prompt_token_ids), request.params.max_tokens, request.num_slots,
                           self.block_manager.block_size)

    def schedule(self) -> Batch:
        batch = Batch()
        self._make_room(batch)
        budget, slots_in_use, prefills = self._schedule_decodes(batch)
        for request, seq in prefills:  # prefill chunks of running requests, arrival order
            budget -= self._add_prefill(batch, request, seq, budget)
        if not batch.preempted:
            self._admit(batch, budget, slots_in_use)
        return batch

    def mark_computed(self, batch: Batch) -> None:
        """After the forward pass: the step's tokens have their KV; followers take what their leader computed."""
        mark_computed = self.block_manager.mark_computed
        for seq, num_tokens in zip(batch.seqs, batch.query_lens):
            seq.num_computed_tokens = num_computed = seq.num_computed_tokens + num_tokens
            mark_computed(seq.seq_id, num_computed)
        if self._with_followers:
            self._catch_up_followers()

    # ---- the steps of schedule() ----
    def _make_room(self, batch: Batch) -> None:
        """Preempt (module doc, "Victims") until every pending token of the running requests has a block."""
        bm = self.block_manager
        if bm.num_available_blocks >= self.config.max_num_seqs:
            return  # a pending append takes at most one block, and at most max_num_seqs sequences run
        block_size = bm.block_size
        need = 0  # all the pending appends together, first: when they fit, nobody is preempted
        for request in self.running:
            seqs = request.seqs
            if len(seqs) == 1:  # a lone sequence's partly filled last block is its own: no copy-on-write
                seq = seqs[0]
                need += seq.pending_append and seq.finish_reason is None and (len(seq.token_ids) - 1) % block_size == 0
            elif pending := [seq.seq_id for seq in seqs if seq.pending_append and seq.finish_reason is None]:
                need += bm.num_blocks_to_append(pending)
        if need <= bm.num_available_blocks:
            return
        num_planned = 0  # blocks the appends of the requests kept so far take
        for request in list(self.running):
            if request.state is not RequestState.RUNNING:
                continue  # preempted for an older request
            pending = [seq.seq_id for seq in request.live_seqs if seq.pending_append]
            need = bm.num_blocks_to_append(pending) if pending else 0
            while num_planned + need > bm.num_available_blocks:
                if self.running == [request]:
                    self._fail(request, batch, f"the KV pool ({bm.num_blocks} blocks) is too small for this "
                                               f"request's {len(pending)} sequences")
                    break
                victim = next(r for r in reversed(self.running) if r is request or not r.just_readmitted)
                self._preempt(victim, batch)
                if victim is request:
                    break
            else:
                num_planned += need

    def _schedule_decodes(self, batch: Batch) -> tuple[int, int, list[tuple[Request, Sequence]]]:
        """Append the last sampled tokens (the room is made) and schedule one-token steps, oldest first.

        Returns the budget left, the slots in use, and the sequences with prompt tokens left (arrival order).
        """
        bm = self.block_manager
        append_token, live_block_table = bm.append_token, bm.live_block_table
        budget = self.config.max_num_batched_tokens
        seqs, requests, query_lens = batch.seqs, batch.requests, batch.query_lens
        step = batch.step_input
        chunks = step.chunks
        prefills: list[tuple[Request, Sequence]] = []
        slots_in_use = 0
        for request in self.running:
            num_live = 0
            for seq in request.seqs:
                if seq.finish_reason is not None:
                    continue
                num_live += 1
                token_ids = seq.token_ids
                seq_id = seq.seq_id
                if seq.pending_append:
                    if copies := append_token(seq_id, token_ids[-1]):
                        step.block_copies += copies
                        self.events.append(EventKind.COPY_ON_WRITE, request.label, num_blocks=len(copies))
                    seq.pending_append = False
                position = len(token_ids) - 1
                num_computed = seq.num_computed_tokens
                if num_computed == position:
                    if budget > 0:
                        seqs.append(seq)
                        requests.append(request)
                        query_lens.append(1)
                        # Its decode chunk is rewritten each step, not made anew (engine/step.py); the block
                        # manager's table in it stays the same list until (re)admission makes a new chunk.
                        chunk = seq.decode_chunk
                        if chunk is None:
                            chunk = seq.decode_chunk = SeqChunk([0], 0, live_block_table(seq_id), True, seq_id)
                        chunk.token_ids[0] = token_ids[-1]
                        chunk.start_pos = position
                        chunks.append(chunk)
                        budget -= 1
                elif num_computed < position and seq not in request.followers:
                    prefills.append((request, seq))
            slots_in_use += num_live if request.forked else request.params.n
        return budget, slots_in_use, prefills

    def _admit(self, batch: Batch, budget: int, slots_in_use: int) -> None:
        """Swapped and waiting requests (new, or preempted by recompute) come in arrival order across
        both queues while the next one fits; a waiting one also needs a token of the budget."""
        while self.swapped or self.waiting:
            if self.swapped and (not self.waiting or self.swapped[0].arrival < self.waiting[0].arrival):
                if not self._swap_in(batch, self.swapped[0], slots_in_use):
                    return
                request = self.swapped.pop(0)
            else:
                request = self.waiting[0]
                used = self._admit_waiting(batch, request, budget, slots_in_use) if budget > 0 else None
                if used is None:
                    return
                self.waiting.pop(0)
                budget -= used
            slots_in_use += request.num_slots
            request.state = RequestState.RUNNING
            self._insert_running(request)

    def _swap_in(self, batch: Batch, request: Request, slots_in_use: int) -> bool:
        """Bring a swapped request back if it fits; its pending tokens are appended by the next step."""
        bm = self.block_manager
        seq_ids = [s.seq_id for s in request.live_seqs]
        if not self._fits(request, bm.num_blocks_to_swap_in(seq_ids), slots_in_use):
            return False
        moves = bm.swap_in(seq_ids)
        for seq in request.live_seqs:
            seq.decode_chunk = None  # its block table is another list now
        batch.step_input.swap_in += moves
        self.events.append(EventKind.SWAPPED_IN, request.label, num_blocks=len(moves))
        self.events.append(EventKind.RESUMED, request.label)
        request.just_readmitted = True
        return True

    def _admit_waiting(self, batch: Batch, request: Request, budget: int, slots_in_use: int) -> int | None:
        """Give a waiting request its blocks and prefill chunks if it fits; returns the tokens scheduled."""
        bm = self.block_manager
        seqs = request.live_seqs
        num_shared_blocks = self._num_shared_blocks(seqs)
        need = bm.num_blocks_to_allocate(seqs[0].token_ids) + sum(
            -(-seq.num_tokens // bm.block_size) - num_shared_blocks for seq in seqs[1:])
        if not self._fits(request, need, slots_in_use):
            return None
        leader = seqs[0]
        for seq in seqs:
            seq.decode_chunk = None  # a readmitted sequence's block table is another list now
        leader.num_computed_tokens = bm.allocate(leader.seq_id, leader.token_ids, share_token_ids=True)  # 1 list
        for seq in seqs[1:]:
            if num_shared_blocks:
                seq.num_computed_tokens = bm.allocate_sharing(seq.seq_id, seq.token_ids, leader.seq_id,
                                                              num_shared_blocks, share_token_ids=True)
            else:
                seq.num_computed_tokens = bm.allocate(seq.seq_id, seq.token_ids, share_token_ids=True)
        request.followers = [seq for seq in seqs[1:] if bm.awaits_leader(seq.seq_id)]
        if request.followers and request not in self._with_followers:
            self._with_followers.append(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = leader.num_computed_tokens
            self.events.append(EventKind.ADMITTED, request.label, num_prompt_tokens=len(request.prompt_token_ids))
            if request.num_cached_tokens:
                self.events.append(EventKind.PREFIX_HIT, request.label, num_cached_tokens=request.num_cached_tokens)
        else:
            request.just_readmitted = True
            self.events.append(EventKind.RESUMED, request.label)
        used = 0
        for seq in seqs:
            if seq not in request.followers:
                used += self._add_prefill(batch, request, seq, budget - used)
        return used

    # ---- helpers ----
    def _fits(self, request: Request, num_blocks: int, slots_in_use: int) -> bool:
        """The admission rule (module doc): slots, and the blocks it takes now plus decode headroom."""
        if slots_in_use + request.num_slots > self.config.max_num_seqs:
            return False
        own_growth = min(request.num_slots, max(0, self.peak_blocks(request) - num_blocks))
        return num_blocks + slots_in_use + own_growth <= self.block_manager.num_available_blocks

    def _num_shared_blocks(self, seqs: list[Sequence]) -> int:
        """Full blocks of the sequences' common prefix, each keeping at least its last token to compute."""
        if len(seqs) < 2:
            return 0
        first = seqs[0].token_ids
        common = min(seq.num_tokens for seq in seqs) - 1
        for seq in seqs[1:]:
            common = next((i for i, (a, b) in enumerate(zip(first[:common], seq.token_ids)) if a != b), common)
        return common // self.block_manager.block_size

    def _add_prefill(self, batch: Batch, request: Request, seq: Sequence, budget: int) -> int:
        """Schedule as much of the sequence's uncomputed tokens as the budget allows; returns tokens used."""
        start = seq.num_computed_tokens
        remaining = len(seq.token_ids) - start
        if self.config.enable_chunked_prefill:
            num_tokens = min(remaining, budget)
        elif remaining <= budget or batch.num_prefill_tokens == 0:
            # Without chunking a prompt runs whole; alone in its step it may exceed the budget.
            num_tokens = remaining
        else:
            num_tokens = 0
        if num_tokens > 0:
            batch.seqs.append(seq)
            batch.requests.append(request)
            batch.query_lens.append(num_tokens)
            batch.step_input.chunks.append(SeqChunk(
                seq.token_ids[start:start + num_tokens], start, self.block_manager.live_block_table(seq.seq_id),
                needs_logits=num_tokens == remaining, seq_id=seq.seq_id))
            self.events.append(EventKind.PREFILL_CHUNK, request.label, num_tokens=num_tokens,
                               num_computed_tokens=start)
        return num_tokens

    def _catch_up_followers(self) -> None:
        """Followers take the blocks their leader has computed; a request whose followers all caught up
        leaves the list (so does one preempted or finished meanwhile: its followers are cleared)."""
        bm = self.block_manager
        for request in self._with_followers:
            for seq in request.followers:
                seq.num_computed_tokens = bm.num_computed_tokens(seq.seq_id)
            request.followers = [seq for seq in request.followers if bm.awaits_leader(seq.seq_id)]
        self._with_followers = [request for request in self._with_followers if request.followers]

    def _insert_running(self, request: Request) -> None:
        bisect.insort_right(self.running, request, key=_arrival)  # after any of the same arrival

    def _fail(self, request: Request, batch: Batch, reason: str) -> None:
        self.finish(request)
        request.error = reason
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or "error"
        batch.failed.append(request)
        self.events.append(EventKind.FAILED, request.label, reason=reason)
        log.warning("request %s failed: %s", request.request_id, reason)

    def _preempt(self, request: Request, batch: Batch) -> None:
        """Evict a whole request: by swap when configured and the CPU pool has room, else by recompute."""
        bm = self.block_manager
        self.running.remove(request)
        seq_ids = [s.seq_id for s in request.live_seqs]
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.preemption_log.append((request.request_id, request.num_output_tokens))
        batch.preempted.append(request)
        fallback = self.config.preemption_mode == "swap" and not bm.can_swap_out(seq_ids)
        if self.config.preemption_mode == "swap" and not fallback:
            moves = bm.swap_out(seq_ids)
            batch.step_input.swap_out += moves
            request.state = RequestState.SWAPPED
            self._insert_by_arrival(self.swapped, request)
            mode = "swap"
            self.events.append(EventKind.PREEMPTED, request.label, mode=mode, fallback=False)
            self.events.append(EventKind.SWAPPED_OUT, request.label, num_blocks=len(moves))
        else:
            for seq in request.live_seqs:
                bm.free(seq.seq_id)
                seq.num_computed_tokens = 0
                seq.pending_append = False
            request.followers = []
            request.state = RequestState.WAITING
            self._insert_by_arrival(self.waiting, request)
            mode = "recompute"
            self.events.append(EventKind.PREEMPTED, request.label, mode=mode, fallback=fallback)
            if fallback:
                self.num_swap_fallbacks += 1
                log.warning("swap pool full (%d blocks): preempting request %s by recompute instead",
                            bm.num_cpu_blocks, request.request_id)
        self.num_preemptions_by_mode[mode] += 1
        log.warning("preempted request %s by %s (%d preemptions so far)", request.request_id, mode,
                    self.num_preemptions)

    @staticmethod
    def _insert_by_arrival(queue: list[Request], request: Request) -> None:
        bisect.insort_left(queue, request, key=_arrival)  # before any of the same arrival

    def finish(self, request: Request) -> None:
        """Take a request out of its queue and free the blocks of its live sequences."""
        state = request.state
        if state is RequestState.WAITING:
            self.waiting.remove(request)
        elif state is RequestState.RUNNING or state is RequestState.SWAPPED:
            queue = self.running if state is RequestState.RUNNING else self.swapped
            index = bisect.bisect_left(queue, request.arrival, key=_arrival)  # arrival order: no O(N) remove()
            del queue[index if index < len(queue) and queue[index] is request else queue.index(request)]
            for seq in request.live_seqs:
                self.block_manager.free(seq.seq_id)
        request.followers = []
        request.state = RequestState.FINISHED
