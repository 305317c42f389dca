"""Decides what each engine step runs: continuous batching, chunked prefill, preemption. No torch.

A step is built in this order: (1) make room for the running requests' decodes, preempting if the
pool is short (engine/preemption.py); (2) append each decoding sequence's last sampled token and
schedule the decodes, oldest request first; (3) prefill chunks of running requests (long or readmitted
prompts), both within the token budget (engine/batch.py); then, unless this step preempted, (4)
swapped-out requests come back and waiting requests are admitted, in arrival order across both queues,
while slots, the token budget and blocks allow (engine/admission.py). With speculative decoding, drafts
lengthen the decode rows between (2) and (3) (engine/speculation.py): the scheduler decides which rows
draft and how many tokens, and stops there (`Batch.drafting`); the engine has the drafter make the
drafts (a draft model's forward passes never run in here) and hands them to `add_drafts`, which
lengthens the rows and goes on with (3) and (4). With a time budget, the prefill
chunks and admissions of (3) and (4) get only the tokens that keep the step within it
(engine/step_budget.py), which learns each step's cost from the durations the engine measures, and a
chunk's new images are charged their encoder time there (engine/encode_budget.py; whether an image is
cached comes in as data, `image_cached`: the scheduler never reads the embeddings). Each of
those modules states its rules and why they hold; docs/ARCHITECTURE.md, "Scheduling rules", sums them up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from localserve.engine.admission import Admission
from localserve.engine.batch import Batch, BatchFiller
from localserve.engine.config import SchedulerConfig
from localserve.engine.drafting import Draft
from localserve.engine.encode_budget import EncoderCost, ImageFit, StepImages
from localserve.engine.events import EventKind, EventLog
from localserve.engine.preemption import Preemption
from localserve.engine.request_queues import RequestQueues
from localserve.engine.sequence import Request, RequestState, ScheduledRow, Sequence
from localserve.engine.speculation import Speculation
from localserve.engine.step_budget import StepCostModel, StepShape, StepTimeBudget
from localserve.engine.stop_reason import ERROR
from localserve.kv.block_manager import BlockManager

log = logging.getLogger(__name__)


class Scheduler:
    """Holds the waiting, running and swapped requests and builds one Batch per step."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, events: EventLog | None = None, *,
                 speculation: Speculation | None = None, step_budget: StepTimeBudget | None = None,
                 step_cost: StepCostModel | None = None, image_cached: Callable[[bytes], bool] | None = None) -> None:
        """`speculation` drafts for the decodes, `step_budget` bounds the prefill in time; both read
        `step_cost` (the step budget's own when not given), which `observe_step` feeds. `image_cached` tells
        whether an image's embeddings are held (by content hash; the engine's `EmbeddingCache`): with a step
        budget, a chunk's other images are charged their encoder time (engine/encode_budget.py), learnt in
        `encoder_cost` from what `observe_encode` is shown."""
        self.config = config
        self.block_manager = block_manager
        self.events = events if events is not None else EventLog()
        self.queues = RequestQueues()
        self.encoder_cost = EncoderCost() if step_budget is not None else None
        image_fit = (ImageFit(self.encoder_cost, image_cached)
                     if self.encoder_cost is not None and image_cached is not None else None)
        self.filler = BatchFiller(config.enable_chunked_prefill, block_manager, self.events, image_fit)
        self.preemption = Preemption(config.preemption_mode, config.max_num_seqs, block_manager, self.events,
                                     self.queues)
        self.admission = Admission(config.max_num_seqs, block_manager, self.events, self.queues, self.filler)
        self._with_followers: list[Request] = []  # requests whose samples wait for their leader's prefill
        self.speculation = speculation
        self.step_budget = step_budget
        self.step_cost = step_cost if step_cost is not None or step_budget is None else step_budget.cost
        # A step waiting for its drafts (schedule() -> add_drafts): its batch, its decodes' shape, the slots
        # in use and the running sequences with prefill left.
        self._drafting: tuple[Batch, StepShape, int, list[tuple[Request, Sequence]]] | None = None

    def add(self, request: Request) -> None:
        self.queues.add(request)

    def has_work(self) -> bool:
        return self.queues.has_work()

    def schedule(self) -> Batch:
        """The next step's batch (module doc). When decode rows are to draft, the batch is complete only
        after `add_drafts`: its `drafting` says which drafter is to propose what."""
        self._drafting = None
        batch = Batch(self.config.max_num_batched_tokens)
        unfit = self.preemption.make_room(batch)
        if unfit is not None:
            self._fail(unfit, batch, f"the KV pool ({self.block_manager.num_blocks} blocks) is too small for "
                                     f"this request's {len(unfit.live_seqs)} sequences")
        slots_in_use, prefills = self.filler.add_decodes(batch, self.queues.running)
        decodes = None
        if self.speculation is not None or self.step_budget is not None:
            decodes = batch.shape(self.block_manager.block_size)
            if self.speculation is not None:
                batch.drafting = self.speculation.plan(batch, decodes)
                if batch.drafting is not None:
                    self._drafting = (batch, decodes, slots_in_use, prefills)
                    return batch
        self._fill(batch, decodes, slots_in_use, prefills)
        return batch

    def add_drafts(self, batch: Batch, drafts: list[Draft], drafting_s: float) -> None:
        """The drafts `batch.drafting` asked for (in its order), made in `drafting_s` seconds: the decode rows
        become verify rows and the step is completed (module doc)."""
        if self._drafting is None or self._drafting[0] is not batch:
            raise ValueError("add_drafts: this batch asks for no drafts (it is not the last one scheduled, or "
                             "its drafts were added already)")
        _, decodes, slots_in_use, prefills = self._drafting
        self._drafting = None
        self.speculation.add_drafts(batch, drafts, drafting_s)
        self._fill(batch, decodes, slots_in_use, prefills)

    def _fill(self, batch: Batch, decodes: StepShape | None, slots_in_use: int,
              prefills: list[tuple[Request, Sequence]]) -> None:
        """The rest of the step after its decodes (and drafts): prefill chunks, then admissions."""
        if self.step_budget is not None:
            self.step_budget.start_step(decodes)
            # Asked only with prompt tokens to place: a usual gap costs a sort of the recent steps.
            if prefills or self.queues.waiting or self.queues.swapped:
                allowed = self.step_budget.prefill_tokens(decodes, batch.shape(self.block_manager.block_size))
                batch.limit_prefill(allowed)
                if allowed is not None and self.filler.images is not None:
                    tokens_per_s = self.step_budget.encode_tokens_per_s()
                    if tokens_per_s is not None:  # new images are charged their encodes (encode_budget.py)
                        batch.images = StepImages(batch.num_tokens + allowed, tokens_per_s)
        for request, seq in prefills:  # prefill chunks of running requests, arrival order
            self.filler.add_prefill(batch, request, seq)
        if not batch.preempted:
            for request in self.admission.admit(batch, slots_in_use):
                if request.followers and request not in self._with_followers:
                    self._with_followers.append(request)
        batch.close()

    def mark_computed(self, batch: Batch) -> None:
        """After the forward pass: the step's tokens have their KV; followers take what their leader computed."""
        mark_computed = self.block_manager.mark_computed
        holds_states = self.block_manager.state_group is not None
        for row in batch.rows:
            seq = row.seq
            # A verify row's drafted tokens count once accepted (engine/speculation.py, `commit`).
            num_computed = seq.num_computed_tokens + row.query_len - row.num_draft_tokens
            seq.num_computed_tokens = num_computed
            if row.num_draft_tokens and holds_states:
                continue  # its recurrent states are written after the verification: `commit` marks them all
            mark_computed(seq.seq_id, num_computed)
        if self._with_followers:
            self._catch_up_followers()

    def take_draft(self, row: ScheduledRow) -> Draft:
        """After the forward pass: the verify row is its sequence's decode row again; returns its draft."""
        return self.speculation.restore_row(row)

    def settle_draft(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The verification's tokens were appended to `seq` (which may have finished on one): `num_accepted`
        of its `num_drafted` drafted tokens were kept; the blocks keep their KV, the totals count it."""
        self.speculation.settle(seq, num_drafted, num_accepted)

    def observe_step(self, batch: Batch, duration_s: float) -> None:
        """The step of `batch` took `duration_s`, drafting left out (the drafter's cost is learnt apart, from
        `add_drafts`): the cost model learns from it."""
        if self.step_cost is not None:
            shape = batch.shape(self.block_manager.block_size)
            if self.step_budget is not None:
                self.step_budget.observe(shape, duration_s)  # before the cost model learns from the step
            self.step_cost.observe(shape, duration_s)

    def observe_encode(self, num_tokens: int, duration_s: float) -> None:
        """The step's encoder made the embeddings of images of `num_tokens` tokens in all in `duration_s`: the
        encoder's cost learns from it (engine/encode_budget.py)."""
        if self.encoder_cost is not None:
            self.encoder_cost.observe(num_tokens, duration_s)

    def finish(self, request: Request) -> None:
        """Take a request out of its queue, free the blocks of its live sequences, and drop their rows."""
        holds_blocks = request.state is RequestState.RUNNING or request.state is RequestState.SWAPPED
        self.queues.move(request, RequestState.FINISHED)
        if holds_blocks:
            for seq in request.live_seqs:
                self.block_manager.free(seq.seq_id)
        request.followers = []
        for seq in request.seqs:
            seq.decode_row = None  # it refers back to the sequence (Sequence.decode_row)
            if self.speculation is not None:
                self.speculation.release(seq)

    def _catch_up_followers(self) -> None:
        """Followers take the blocks their leader has computed; a request whose followers all caught up
        leaves the list (so does one preempted or finished meanwhile: its followers are cleared)."""
        bm = self.block_manager
        for request in self._with_followers:
            for seq in request.followers:
                seq.num_computed_tokens = bm.num_computed_tokens(seq.seq_id)
            request.followers = [seq for seq in request.followers if bm.awaits_leader(seq.seq_id)]
        self._with_followers = [request for request in self._with_followers if request.followers]

    def _fail(self, request: Request, batch: Batch, reason: str) -> None:
        self.finish(request)
        request.error = reason
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason, seq.stop = "error", ERROR
        batch.failed.append(request)
        self.events.append(EventKind.FAILED, request.label, reason=reason)
        log.warning("request %s failed: %s", request.request_id, reason)
