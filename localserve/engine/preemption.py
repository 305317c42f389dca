"""Victims: which running requests a step short of blocks preempts, and how. No torch.

The rules, and why (docs/ARCHITECTURE.md, "Scheduling rules", says the same):

When the decodes of a step need more blocks than are available, requests are preempted, whole (half a
request's KV is useless), before anything else goes into the step, so a victim has no chunk, append or
block copy to withdraw, and no move of the step names its blocks but its own swap-out or free. The
victim is the newest running request, because it has the least invested and the older ones keep their
priority (an older request is never preempted to make room for a newer one), except that a request
readmitted and not yet sampled since is passed over (anti-thrashing: it would be evicted before its
re-prefill paid off). The request needing the blocks is the last candidate: it yields itself rather
than evict an older request. The admission headroom (engine/admission.py) keeps a protected request
from needing blocks, so every request is preempted at most once more than it samples. A request alone
in the pool that still does not fit fails with a reason instead of looping (the scheduler fails it).

A victim is preempted by swap when `preemption_mode` is "swap" and the CPU pool has room for its
blocks; else by recompute: its blocks are freed and it waits to be prefilled again.
"""

from __future__ import annotations

import logging
from collections import deque

from localserve.engine.batch import Batch
from localserve.engine.events import EventKind, EventLog
from localserve.engine.request_queues import RequestQueues
from localserve.engine.sequence import Request, RequestState
from localserve.kv.block_manager import BlockManager

log = logging.getLogger(__name__)


class Preemption:
    """Preempts running requests until every pending token of the others has a block (module doc), and
    counts what it did."""

    def __init__(self, mode: str, max_num_seqs: int, block_manager: BlockManager, events: EventLog,
                 queues: RequestQueues) -> None:
        self.mode = mode  # "swap" or "recompute"
        self.max_num_seqs = max_num_seqs
        self.block_manager = block_manager
        self.events = events
        self.queues = queues
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.num_swap_fallbacks = 0  # swap asked for but the CPU pool was full: recompute instead
        # (request id, its output tokens at that moment) of the recent preemptions; bounded for long runs.
        self.recent: deque[tuple[str, int]] = deque(maxlen=10_000)

    def make_room(self, batch: Batch) -> Request | None:
        """Preempt until every pending token of the running requests left has a block: oldest first, each
        request keeps the blocks of its appends or has room made for them (module doc). Returns the
        request that does not fit even alone in the pool, for the scheduler to fail, else None."""
        bm = self.block_manager
        if bm.num_available_blocks >= self.max_num_seqs:
            return None  # a pending append takes at most one block, and at most max_num_seqs sequences run
        if self._num_blocks_to_append_all() <= bm.num_available_blocks:
            return None
        running = self.queues.running
        num_planned = 0  # blocks the appends of the requests kept so far take
        for request in list(running):
            if request.state is not RequestState.RUNNING:
                continue  # preempted for an older request
            pending = [seq.seq_id for seq in request.live_seqs if seq.pending_append]
            need = bm.num_blocks_to_append(pending) if pending else 0
            while num_planned + need > bm.num_available_blocks:
                if running == [request]:
                    return request
                victim = self._victim_for(request)
                self._preempt(victim, batch)
                if victim is request:
                    break
            else:
                num_planned += need
        return None

    def _num_blocks_to_append_all(self) -> int:
        """The blocks all the pending appends of the running requests take together (when they fit,
        nobody is preempted)."""
        bm = self.block_manager
        block_size = bm.block_size
        need = 0
        for request in self.queues.running:
            seqs = request.seqs
            if len(seqs) == 1:
                # A lone sequence's partly filled last block is its own: no copy-on-write to ask the manager about.
                seq = seqs[0]
                if seq.pending_append and seq.finish_reason is None and (len(seq.token_ids) - 1) % block_size == 0:
                    need += 1
            else:
                pending = [seq.seq_id for seq in seqs if seq.pending_append and seq.finish_reason is None]
                if pending:
                    need += bm.num_blocks_to_append(pending)
        return need

    def _victim_for(self, request: Request) -> Request:
        """The newest running request not readmitted and unsampled since; `request`, which needs the
        blocks, before any older one."""
        return next(r for r in reversed(self.queues.running) if r is request or not r.just_readmitted)

    def _preempt(self, request: Request, batch: Batch) -> None:
        """Evict a whole request: by swap when configured and the CPU pool has room, else by recompute."""
        seq_ids = [seq.seq_id for seq in request.live_seqs]
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.recent.append((request.request_id, request.num_output_tokens))
        batch.preempted.append(request)
        fallback = self.mode == "swap" and not self.block_manager.can_swap_out(seq_ids)
        if self.mode == "swap" and not fallback:
            mode = "swap"
            self._swap_out(request, seq_ids, batch)
        else:
            mode = "recompute"
            self._free_for_recompute(request, fallback)
        self.num_preemptions_by_mode[mode] += 1
        log.warning("preempted request %s by %s (%d preemptions so far)", request.request_id, mode,
                    self.num_preemptions)

    def _swap_out(self, request: Request, seq_ids: list[int], batch: Batch) -> None:
        moves = self.block_manager.swap_out(seq_ids)
        batch.step_input.swap_out += moves
        self.queues.move(request, RequestState.SWAPPED)
        self.events.append(EventKind.PREEMPTED, request.label, mode="swap", fallback=False)
        self.events.append(EventKind.SWAPPED_OUT, request.label, num_blocks=len(moves))

    def _free_for_recompute(self, request: Request, fallback: bool) -> None:
        for seq in request.live_seqs:
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.pending_append = False
        request.followers = []
        self.queues.move(request, RequestState.WAITING)
        self.events.append(EventKind.PREEMPTED, request.label, mode="recompute", fallback=fallback)
        if fallback:
            self.num_swap_fallbacks += 1
            log.warning("swap pool full (%d blocks): preempting request %s by recompute instead",
                        self.block_manager.num_cpu_blocks, request.request_id)
