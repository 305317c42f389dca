"""Decides what each engine step runs: continuous batching, chunked prefill, preemption.

Order within a step: running decodes first (oldest request first), then prefill chunks of running
requests, then swapped-out requests come back, then waiting requests are admitted in arrival order,
as long as slots (`max_num_seqs`), the token budget (`max_num_batched_tokens`) and free blocks allow.
When a decode needs a block and none is free, the most recently arrived running request is preempted,
all its sequences at once, by recompute (blocks freed, prompt + output prefilled again later) or swap.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from localserve.engine.config import SchedulerConfig
from localserve.engine.events import EventKind, EventLog
from localserve.engine.sequence import Request, RequestState, Sequence
from localserve.engine.step import SeqChunk, StepInput
from localserve.kv.block_manager import BlockManager

log = logging.getLogger(__name__)


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
        # Recent preemptions: (request id, its output tokens at that moment); bounded for long runs.
        self.preemption_log: deque[tuple[str, int]] = deque(maxlen=10_000)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        # 1. Decodes, oldest first; make room by preempting the newest requests.
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted while making room for an older request
            pending = [s for s in request.live_seqs if s.pending_append]
            if pending:
                while not bm.can_append([s.seq_id for s in pending]):
                    if self.running == [request]:
                        # Alone in the pool and still no room (say n samples that all outgrew it): it could
                        # never finish, and preempting it would only loop. It fails; its blocks come back.
                        self._fail(request, batch, f"the KV pool ({bm.num_blocks} blocks) is too small for "
                                                   f"this request's {len(pending)} sequences")
                        break
                    victim = self._pick_victim()
                    self._preempt(victim, batch)
                    if victim is request:
                        break
                if request not in self.running:
                    continue
                for seq in pending:
                    copies = bm.append_token(seq.seq_id, seq.token_ids[-1])
                    if copies:
                        batch.step_input.block_copies += copies
                        self.events.append(EventKind.COPY_ON_WRITE, request.label, num_blocks=len(copies))
                    seq.pending_append = False
            for seq in request.live_seqs:
                if seq.num_uncomputed_tokens == 1 and budget > 0:
                    self._add(batch, request, seq, 1)
                    budget -= 1
        # 2. Prefill chunks of running requests (resumed or long prompts), in arrival order.
        scheduled = {seq.seq_id for seq in batch.seqs}
        for request in self.running:
            for seq in request.live_seqs:
                if seq.num_uncomputed_tokens > 1 and seq.seq_id not in scheduled:
                    budget -= self._add_prefill(batch, request, seq, budget)
        # 3. Swapped requests come back (their pending tokens are appended by the next step's decodes).
        while self.swapped and self._has_slots(self.swapped[0]):
            request = self.swapped[0]
            seq_ids = [s.seq_id for s in request.live_seqs]
            if not self._leaves_decode_headroom(bm.num_blocks_to_swap_in(seq_ids)):
                break
            moves = bm.swap_in(seq_ids)
            batch.step_input.swap_in += moves
            self.swapped.pop(0)
            self.events.append(EventKind.SWAPPED_IN, request.label, num_blocks=len(moves))
            self.events.append(EventKind.RESUMED, request.label)
            request.state = RequestState.RUNNING
            request.just_readmitted = True
            self._insert_running(request)
        # 4. Admit waiting requests in arrival order while slots, budget and blocks allow.
        while self.waiting and budget > 0 and not self.swapped and self._has_slots(self.waiting[0]):
            request = self.waiting[0]
            seqs = request.live_seqs
            need = sum(bm.num_blocks_to_allocate(s.token_ids) for s in seqs)
            if not self._leaves_decode_headroom(need):
                break
            self.waiting.pop(0)
            for seq in seqs:
                seq.num_computed_tokens = bm.allocate(seq.seq_id, seq.token_ids)
                seq.pending_append = False
            if request.num_preemptions == 0:
                request.num_cached_tokens = seqs[0].num_computed_tokens
                self.events.append(EventKind.ADMITTED, request.label,
                                   num_prompt_tokens=len(request.prompt_token_ids))
                if request.num_cached_tokens:
                    self.events.append(EventKind.PREFIX_HIT, request.label,
                                       num_cached_tokens=request.num_cached_tokens)
            else:
                request.just_readmitted = True
                self.events.append(EventKind.RESUMED, request.label)
            request.state = RequestState.RUNNING
            self._insert_running(request)
            for seq in seqs:
                budget -= self._add_prefill(batch, request, seq, budget)
        batch.step_input.chunks = [
            SeqChunk(seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + q], seq.num_computed_tokens,
                     bm.block_table(seq.seq_id), needs_logits=seq.num_computed_tokens + q == seq.num_tokens)
            for seq, q in zip(batch.seqs, batch.query_lens)]
        return batch

    def _add(self, batch: Batch, request: Request, seq: Sequence, num_tokens: int) -> None:
        batch.seqs.append(seq)
        batch.requests.append(request)
        batch.query_lens.append(num_tokens)

    def _add_prefill(self, batch: Batch, request: Request, seq: Sequence, budget: int) -> int:
        """Schedule as much of the sequence's uncomputed tokens as the budget allows; returns tokens used."""
        remaining = seq.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            num_tokens = min(remaining, budget)
        elif remaining <= budget or batch.num_prefill_tokens == 0:
            # Without chunking a prompt runs whole; alone in its step it may exceed the budget.
            num_tokens = remaining
        else:
            num_tokens = 0
        if num_tokens > 0:
            self._add(batch, request, seq, num_tokens)
            self.events.append(EventKind.PREFILL_CHUNK, request.label, num_tokens=num_tokens,
                               num_computed_tokens=seq.num_computed_tokens)
        return num_tokens

    def _has_slots(self, request: Request) -> bool:
        return self.num_running_seqs() + len(request.live_seqs) <= self.config.max_num_seqs

    def _leaves_decode_headroom(self, num_blocks: int) -> bool:
        # Admit only when one more block for every running sequence would still fit afterwards, so a
        # request just (re)admitted is not preempted again by the very next decode step.
        return num_blocks + self.num_running_seqs() <= self.block_manager.num_available_blocks

    def _insert_running(self, request: Request) -> None:
        index = len(self.running)
        while index > 0 and self.running[index - 1].arrival > request.arrival:
            index -= 1
        self.running.insert(index, request)

    def _fail(self, request: Request, batch: Batch, reason: str) -> None:
        self.finish(request)
        request.error = reason
        for seq in request.seqs:
            seq.finish_reason = seq.finish_reason or "error"
        batch.failed.append(request)
        self.events.append(EventKind.FAILED, request.label, reason=reason)
        log.warning("request %s failed: %s", request.request_id, reason)

    def _pick_victim(self) -> Request:
        """The most recently arrived running request, passing over one just readmitted (no thrashing)."""
        for request in reversed(self.running):
            if not request.just_readmitted:
                return request
        return self.running[-1]

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
            request.state = RequestState.WAITING
            self._insert_by_arrival(self.waiting, request)
            mode = "recompute"
            self.events.append(EventKind.PREEMPTED, request.label, mode=mode, fallback=fallback)
            if fallback:
                self.num_swap_fallbacks += 1
                log.warning("swap pool full (%d blocks): preempting request %s by recompute instead",
                            bm.num_cpu_blocks, request.request_id)
        self.num_preemptions_by_mode[mode] += 1
        # Any entries of this request already in the batch are dropped.
        keep = [i for i, r in enumerate(batch.requests) if r is not request]
        batch.seqs = [batch.seqs[i] for i in keep]
        batch.requests = [batch.requests[i] for i in keep]
        batch.query_lens = [batch.query_lens[i] for i in keep]
        log.warning("preempted request %s by %s (%d preemptions so far)", request.request_id, mode,
                    self.num_preemptions)

    @staticmethod
    def _insert_by_arrival(queue: list[Request], request: Request) -> None:
        index = 0
        while index < len(queue) and queue[index].arrival < request.arrival:
            index += 1
        queue.insert(index, request)

    def finish(self, request: Request) -> None:
        """Take a request out of the queues and free the blocks of its live sequences."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        if request.state in (RequestState.RUNNING, RequestState.SWAPPED):
            for seq in request.live_seqs:
                self.block_manager.free(seq.seq_id)
        request.state = RequestState.FINISHED
