"""One step's batch, and how the scheduler fills it within the token budget. No torch.

The rules (docs/ARCHITECTURE.md, "Scheduling rules", says the same): the decodes come first, oldest
request first, one token each, while the budget (`max_num_batched_tokens`) lasts; then the prefill
chunks, the running requests' before the admitted ones', each as much of its sequence's uncomputed
tokens as the budget left allows (chunked prefill). Without chunked prefill a prompt runs whole or not
at all: alone among the step's prefills it may exceed the budget, beside another it waits.

A prompt's bidirectional image spans (engine/multimodal.py: Gemma 3's images, whose tokens see each other)
are computed whole: no prefill chunk ends strictly inside one (`span_safe_chunk`).

A decoding sequence keeps its row from step to step (`Sequence.decode_row`): the filler rewrites its
token and position instead of making a row and a chunk per sequence per step.

Two more limits may come between the decodes and the prefill chunks (engine/scheduler.py): speculative
drafts lengthen decode rows into verify rows (engine/speculation.py; the batch asks for them in
`drafting`, and the engine's drafter makes them before the rest is filled in), and a time budget may
lower the token budget the prefill chunks get (engine/step_budget.py, `limit_prefill`); under it, a chunk
reaching an image whose embeddings are not cached is charged the image's encode (engine/encode_budget.py):
one that does not fit stops before the image, unless it is the step's first prefill chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING

from localserve.engine.drafting import DraftRequest
from localserve.engine.events import EventKind, EventLog
from localserve.engine.sequence import Request, ScheduledRow, Sequence
from localserve.engine.step import SeqChunk, StepInput
from localserve.engine.step_budget import StepShape
from localserve.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from localserve.engine.encode_budget import ImageFit, StepImages

_multimodal = attrgetter("multimodal")


@dataclass(eq=False, slots=True)
class Batch:
    """One step's work: a row per scheduled sequence, the block moves, the requests preempted or failed.

    `step_input` holds the moves as the step is built and the rows' chunks once it is (`close`).
    """

    token_budget: int
    rows: list[ScheduledRow] = field(default_factory=list)
    step_input: StepInput = field(default_factory=StepInput)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # could never fit; finished with an error
    num_tokens: int = 0  # the rows' query tokens
    num_prefill_tokens: int = 0  # of those, the ones in prefill chunks of more than one token
    num_draft_tokens: int = 0  # of those, the drafted tokens of verify rows (not prefill tokens)
    num_pooled_tokens: int = 0  # of those, the ones of embedding prompts (their hidden states are pooled)
    num_context_tokens: int = 0  # the rows' context lengths, summed: the KV the step reads
    num_prefill_rows: int = 0  # the rows of prefill chunks (Batch.add), of one token or more
    # The step's time budget for new images (engine/encode_budget.py); None: their encodes are not charged.
    images: StepImages | None = None
    # Set by Scheduler.schedule() when decode rows are to draft: the step is complete once the drafts are
    # handed back (Scheduler.add_drafts); None: the step is complete as scheduled.
    drafting: DraftRequest | None = None

    @property
    def budget_left(self) -> int:
        """Tokens the step can still take (negative after a whole prompt past the budget, without chunking)."""
        return self.token_budget - self.num_tokens

    def add(self, row: ScheduledRow) -> None:
        self.rows.append(row)
        self.num_tokens += row.query_len
        self.num_prefill_rows += 1
        self.num_context_tokens += row.chunk.context_len
        if row.query_len > 1:
            self.num_prefill_tokens += row.query_len
        if row.chunk.needs_hidden:
            self.num_pooled_tokens += row.query_len

    @property
    def has_images(self) -> bool:
        """Whether a chunk of the closed step has images (engine/multimodal.py); at C speed, every step asks."""
        return any(map(_multimodal, self.step_input.chunks))

    def drop_requests(self, requests: Iterable[Request]) -> None:
        """Take the rows of these requests out of the closed step (their images failed: engine.py)."""
        dropped = {id(request) for request in requests}
        kept = [row for row in self.rows if id(row.request) not in dropped]
        self.num_tokens -= sum(row.query_len for row in self.rows if id(row.request) in dropped)
        self.rows = kept
        self.step_input.chunks = [row.chunk for row in kept]

    def limit_prefill(self, num_tokens: int | None) -> None:
        """Let the prefill chunks and admissions to come take at most `num_tokens` more (None: no new limit)."""
        if num_tokens is not None:
            self.token_budget = min(self.token_budget, self.num_tokens + num_tokens)

    def shape(self, block_size: int) -> StepShape:
        """What the step's time is estimated from (engine/step_budget.py)."""
        num_rows = len(self.rows)
        num_prefill_tokens = self.num_tokens - num_rows - self.num_draft_tokens  # past each row's first token
        return StepShape(num_rows, num_prefill_tokens, self.num_draft_tokens, self.num_context_tokens / block_size)

    def close(self) -> None:
        """Every row is in: their chunks become the step input's, in row order (the runner's logits rows
        follow it)."""
        self.step_input.chunks = [row.chunk for row in self.rows]


def span_safe_chunk(spans: tuple[tuple[int, int], ...], start: int, num_tokens: int, slotted: int,
                    budget_left: int | None) -> int:
    """A prefill chunk's length, `num_tokens` from `start` by the rules above, made to end outside every
    bidirectional span (`spans`: (offset, end), in order), since each token of one sees every other and a
    later chunk cannot give the earlier one's tokens its keys: ending strictly inside a span that starts
    after `start`, the chunk ends at that span's start; one that starts at or inside the span (a prefix hit
    may land inside one: the cached tokens were computed seeing the whole span) takes the rest of the span
    whole, if its KV slots are made (`slotted`) and it fits `budget_left` (None: the step has no other
    prefill chunk, and this one may pass the budget as a whole prompt does without chunking: a span is
    never longer than the budget, engine/multimodal.py, so it always makes progress), else nothing (0)."""
    end = start + num_tokens
    for offset, span_end in spans:
        if offset >= end:
            break
        if end < span_end:  # offset < end < span_end: strictly inside
            if offset > start:
                return offset - start
            rest = span_end - start
            return rest if rest <= slotted and (budget_left is None or rest <= budget_left) else 0
    return num_tokens


class BatchFiller:
    """Gives the running and admitted requests' sequences their rows of a step (module doc)."""

    def __init__(self, enable_chunked_prefill: bool, block_manager: BlockManager, events: EventLog,
                 images: ImageFit | None = None) -> None:
        """`images` charges the encodes of a chunk's new images to the step's time budget (None: never)."""
        self.enable_chunked_prefill = enable_chunked_prefill
        self.block_manager = block_manager
        self.events = events
        self.images = images

    def add_decodes(self, batch: Batch, running: list[Request]) -> tuple[int, list[tuple[Request, Sequence]]]:
        """Append each running sequence's last sampled token to its blocks (the room is made) and give a
        decode row to each with only that token left to compute, oldest request first, while the budget lasts.

        Returns the slots the running requests hold and their sequences with prompt tokens left (arrival order).
        """
        # The per-decode path: the names it calls are looked up once, and the rows skip Batch.add.
        append_token = self.block_manager.append_token
        add_row = batch.rows.append
        block_copies = batch.step_input.block_copies
        budget = budget_before = batch.budget_left
        context_tokens = 0
        prefills: list[tuple[Request, Sequence]] = []
        slots_in_use = 0
        for request in running:
            num_live = 0
            pooled = request.pooling is not None  # an embedding prompt: prefill chunks to its last token
            for seq in request.seqs:
                if seq.finish_reason is not None:
                    continue
                num_live += 1
                token_ids = seq.token_ids
                if seq.pending_append:
                    if copies := append_token(seq.seq_id, token_ids[-1]):
                        block_copies += copies
                        self.events.append(EventKind.COPY_ON_WRITE, request.label, num_blocks=len(copies))
                    seq.pending_append = False
                position = len(token_ids) - 1
                num_computed = seq.num_computed_tokens
                if num_computed == position and not pooled:
                    if budget > 0:
                        row = seq.decode_row
                        if row is None:
                            row = seq.decode_row = self._decode_row(request, seq)
                        chunk = row.chunk
                        chunk.token_ids[0] = token_ids[-1]
                        chunk.start_pos = position
                        add_row(row)
                        budget -= 1
                        context_tokens += position + 1
                elif (num_computed < position or pooled) and seq not in request.followers:
                    prefills.append((request, seq))
            slots_in_use += num_live if request.forked else request.params.n
        batch.num_tokens += budget_before - budget  # one token per decode row, none a prefill token
        batch.num_context_tokens += context_tokens
        return slots_in_use, prefills

    def add_prefill(self, batch: Batch, request: Request, seq: Sequence) -> None:
        """Give the sequence a row of as many of its uncomputed tokens as the rules allow (module doc)."""
        start = seq.num_computed_tokens
        remaining = len(seq.token_ids) - start
        # Window layer groups give slots a chunk's worth at a time (kv/block_manager.py): the chunk ends there.
        slotted = self.block_manager.make_slots(seq.seq_id) - start
        if self.enable_chunked_prefill:
            num_tokens = min(remaining, slotted, batch.budget_left)
        elif remaining <= batch.budget_left or batch.num_prefill_tokens == 0:
            num_tokens = min(remaining, slotted)
        else:
            num_tokens = 0
        if num_tokens > 0 and request.bidirectional_spans and num_tokens < remaining:
            num_tokens = span_safe_chunk(request.bidirectional_spans, start, num_tokens, slotted,
                                         batch.budget_left if batch.num_prefill_tokens else None)
        step_images = batch.images
        if step_images is not None and self.images is not None and request.image_spans and num_tokens > 0:
            fitted = self.images.fit(step_images, batch.num_tokens, batch.num_prefill_rows == 0, request, start,
                                     num_tokens, self.enable_chunked_prefill)
            if fitted < num_tokens and request.bidirectional_spans and fitted > 0:
                fitted = span_safe_chunk(request.bidirectional_spans, start, fitted, fitted, None)
            num_tokens = fitted
            batch.token_budget = min(batch.token_budget, step_images.token_limit)
        if num_tokens <= 0:
            return
        pooled = request.pooling is not None  # an embedding prompt: hidden states, never logits
        chunk = SeqChunk(seq.token_ids[start:start + num_tokens], start,
                         self.block_manager.live_block_table(seq.seq_id),
                         needs_logits=num_tokens == remaining and not pooled, seq_id=seq.seq_id, needs_hidden=pooled,
                         group_block_tables=self._group_tables(seq.seq_id), multimodal=request.multimodal)
        batch.add(ScheduledRow(request, seq, num_tokens, chunk))
        self.events.append(EventKind.PREFILL_CHUNK, request.label, num_tokens=num_tokens, num_computed_tokens=start)

    def _decode_row(self, request: Request, seq: Sequence) -> ScheduledRow:
        """A decoding sequence's row, rewritten each step. The block manager's table in its chunk stays
        the same list until the sequence is readmitted, which drops the row (engine/admission.py)."""
        # Its images too: a prompt whose last token alone is left to compute (a prefix hit) decodes it.
        chunk = SeqChunk([0], 0, self.block_manager.live_block_table(seq.seq_id), needs_logits=True,
                         seq_id=seq.seq_id, group_block_tables=self._group_tables(seq.seq_id),
                         multimodal=request.multimodal)
        return ScheduledRow(request, seq, 1, chunk)

    def _group_tables(self, seq_id: int) -> list[list[int]]:
        """Every group's table of the sequence where the pool has layer groups (the manager's own list)."""
        bm = self.block_manager
        return bm.live_block_tables(seq_id) if bm.num_groups > 1 else []
