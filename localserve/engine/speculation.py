"""Speculative decoding, the scheduler's side: which decode rows get a draft, how long, and what the block
manager keeps after the verification. No torch, and no drafter call but `release`: the scheduler decides
(`plan`, a `DraftRequest` on the step's batch), the engine has the drafter compute the drafts between
`Scheduler.schedule()` and the forward pass (the draft model's forward passes, engine/draft_model.py),
and hands them back (`add_drafts`); the acceptance is engine/spec_acceptance.py.

A drafter proposes up to K tokens to follow a sequence (engine/ngram_drafter.py: the tokens after an
earlier occurrence of its last few; engine/draft_model.py: a small model of the same tokenizer). The
sequence's decode row then carries its last sampled token and the draft, a verify row of K + 1 query
tokens, and the target model's logits at each of them decide how much of the draft is kept: the accepted
tokens plus one of the target's own (spec_acceptance.py), so a verification yields 1 to K + 1 tokens.

The rules, and why:
- Drafted tokens are appended to the sequence's token list and its blocks for the step only; only the
  last real token is marked computed after the forward pass (`Scheduler.mark_computed`); `commit` then
  truncates the block manager to the accepted tokens and marks them computed. So a block that held a
  rejected token is never registered in the prefix cache (kv/block_manager.py, `truncate`).
- K adapts per sequence: each drafted token is worth its chance of being accepted (the sequence's recent
  acceptance to the power of its place in the draft) and costs one more query token of the step (the
  step cost model's per-drafted-token estimate, and the drafter's own time per token); a token is drafted
  while its worth over its cost beats the step's tokens over its time (so it raises the step's tokens per
  second), best tokens first, down to no draft at all: drafts that keep failing stop, and a batch whose
  step already costs a token's worth per token (many streams on a CPU) drafts little. The step's time is
  its decodes' as measured where the fit's extrapolation is higher (`StepCostModel.estimate_decodes`):
  priced against an overestimated step, drafted tokens look cheap.
- A draft never preempts anyone: it takes new blocks only while more than `max_num_seqs` blocks stay
  available (what the next step's appends can need at most), and tokens only from the step's budget.
- A draft never runs past `max_tokens` or the context: a verification yields at most K + 1 tokens, and a
  sequence with L tokens of its limit left drafts at most L - 1. Stop tokens, stop strings and the
  length limit apply to each accepted token in turn (the engine appends them one by one).
- Grammars (constrained decoding): a draft is cut where the sequence's grammar forbids a token
  (`constrain_draft`), and each place of a verify row gets the mask of the matcher advanced by the draft
  before it (engine/grammar_masks.py; the matcher is rolled back: only the tokens appended after the
  verification advance it). So a drafted token is kept only if the grammar allows it, greedy output is
  the same as without a draft, and sampled output is the masked target's.
- Beam search drafts nothing (a beam step needs every beam's logits at once).
- Recurrent layers (a state group): their state after a token cannot be taken back, so the model runner
  writes a verify row's states only after the verification, for its kept tokens (`settle_states`); the
  row is marked computed only then, by `commit` (`Scheduler.mark_computed` skips it), whose `truncate`
  moves the final state's slot back to the last kept block (kv/state_group.py, `cut`). A drafted token
  the state pool has no slot for is not drafted (`_lengthen` stops there).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from localserve.engine.batch import Batch
from localserve.engine.drafting import Draft, Drafter, DraftQuery, DraftRequest
from localserve.engine.events import EventLog
from localserve.engine.sequence import ScheduledRow, Sequence
from localserve.engine.spec_state import SpecState
from localserve.engine.step_budget import StepCostModel, StepShape
from localserve.kv.block_manager import BlockManager
from localserve.kv.out_of_blocks import OutOfBlocksError

SPEC_TYPES = ("ngram", "draft")
# Before the cost model has learnt a token's cost, a drafted token is taken to cost this share of the
# decodes' step (a CPU's batch-1 step: a few extra tokens cost little beside reading every weight).
UNLEARNT_TOKEN_SHARE = 0.1
DRAFTER_COST_DECAY = 0.9  # the drafter's measured seconds per drafted token: a running average

__all__ = ["SPEC_TYPES", "Draft", "DraftQuery", "Drafter", "Speculation", "SpecTotals", "constrain_draft",
           "spec_totals"]


def constrain_draft(seq: Sequence, draft: Draft) -> Draft:
    """The draft cut at its first token the sequence's grammar forbids (unchanged without a grammar).

    A drafted point mass (n-gram, or greedy) on a forbidden token would surely be rejected: it is dropped.
    A draft model's sampled draft keeps it as its last token: its rejection draws the target's token from
    the residual max(0, p - q) (engine/spec_acceptance.py), and only that keeps the target's distribution
    (drawing from p there, as a cut draft would, favours the tokens the draft model also proposes)."""
    if seq.grammar is None or not draft.token_ids:
        return draft
    num_allowed = seq.grammar.num_allowed(draft.token_ids)
    if num_allowed == len(draft.token_ids):
        return draft
    keep = num_allowed + (draft.probs is not None)
    return Draft(draft.token_ids[:keep], draft.probs[:keep] if draft.probs is not None else None)


@dataclass(slots=True)
class SpecTotals:
    """Since the engine started: verify rows, drafted tokens, accepted drafted tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: the accepted ones and the target's own (0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def spec_totals(states: Iterable[SpecState | None]) -> SpecTotals:
    """The totals of some sequences (those that never drafted have None)."""
    totals = SpecTotals()
    for state in states:
        if state is not None:
            totals.num_drafts += state.num_drafts
            totals.num_draft_tokens += state.num_draft_tokens
            totals.num_accepted_tokens += state.num_accepted_tokens
    return totals


class Speculation:
    """Drafts for the decode rows of a step and keeps the accepted tokens after it (module doc)."""

    def __init__(self, drafter: Drafter, max_draft_tokens: int, block_manager: BlockManager, max_num_seqs: int,
                 cost: StepCostModel, events: EventLog) -> None:
        if max_draft_tokens < 1:
            raise ValueError(f"speculative decoding needs --spec-tokens >= 1, got {max_draft_tokens}")
        self.drafter = drafter
        self.max_draft_tokens = max_draft_tokens
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.cost = cost
        self.events = events
        self.totals = SpecTotals()
        self.drafter_s_per_token = 0.0  # measured: the drafter's time over the tokens it drafted
        self._planned: list[tuple[ScheduledRow, int]] = []  # the rows of the step's DraftRequest, in order

    # ---- before the forward pass ----
    def plan(self, batch: Batch, decodes: StepShape) -> DraftRequest | None:
        """The drafts the step's decode rows (all its rows so far) ask for, as long as each token is worth
        it; None when no row drafts. The drafter runs outside the scheduler: `add_drafts` takes its drafts."""
        self._planned = self._plan(batch, decodes)
        if not self._planned:
            self._idle(batch)
            return None
        return DraftRequest(self.drafter, [
            DraftQuery(row.seq.seq_id, row.seq.token_ids, row.seq.prompt_len, num_tokens, row.request.params)
            for row, num_tokens in self._planned])

    def add_drafts(self, batch: Batch, drafts: list[Draft], drafting_s: float) -> None:
        """Lengthen the planned decode rows by their drafts (`plan`'s queries, in order), which the drafter
        made in `drafting_s` seconds (it learns the drafter's cost per token from them)."""
        planned, self._planned = self._planned, []
        num_drafted = 0
        for (row, _), draft in zip(planned, drafts, strict=True):
            draft = constrain_draft(row.seq, draft)
            if draft.token_ids:
                num_drafted += self._lengthen(batch, row, draft)
        if num_drafted:
            per_token = drafting_s / num_drafted
            self.drafter_s_per_token = (per_token if not self.totals.num_drafts else DRAFTER_COST_DECAY
                                        * self.drafter_s_per_token + (1 - DRAFTER_COST_DECAY) * per_token)
        self._idle(batch)

    @staticmethod
    def _idle(batch: Batch) -> None:
        """The decode rows that draft nothing this step: their acceptance estimate drifts to the prior."""
        for row in batch.rows:
            if not row.num_draft_tokens and row.seq.speculation is not None:
                row.seq.speculation.idle()

    def _plan(self, batch: Batch, decodes: StepShape) -> list[tuple[ScheduledRow, int]]:
        """The decode rows to draft for and how many tokens each, the worthiest tokens first (module doc)."""
        candidates: list[tuple[float, int, ScheduledRow]] = []  # (worth, place in the draft, row)
        for row in batch.rows:
            request, seq = row.request, row.seq
            if request.beam_search:
                continue
            state = seq.speculation
            if state is None:
                state = seq.speculation = SpecState()
            max_tokens = min(self.max_draft_tokens, request.max_num_tokens - len(seq.token_ids) - 1)
            acceptance = state.acceptance
            worth = 1.0
            for place in range(1, max_tokens + 1):
                worth *= acceptance
                candidates.append((worth, place, row))
        if not candidates:
            return []
        cost = self.cost
        if cost.ready:
            step_s, token_s = cost.estimate_decodes(decodes), cost.per_draft_token_s + self.drafter_s_per_token
        else:  # in units of the step's time
            step_s, token_s = 1.0, UNLEARNT_TOKEN_SHARE
        tokens = float(decodes.num_rows)
        candidates.sort(key=lambda candidate: -candidate[0])
        bm = self.block_manager
        spare_blocks = bm.num_available_blocks - self.max_num_seqs
        budget = batch.budget_left
        planned: dict[int, list] = {}  # id(row) -> [row, tokens planned]
        block_size = bm.block_size
        for worth, place, row in candidates:
            if worth * step_s <= token_s * tokens or budget <= 0:
                break
            entry = planned.get(id(row))
            if (entry[1] if entry else 0) != place - 1:
                continue  # an earlier place of this row's draft was not taken
            if (len(row.seq.token_ids) + place - 1) % block_size == 0:  # this token starts a new block
                if spare_blocks <= 0:
                    continue
                spare_blocks -= 1
            if entry is None:
                entry = planned[id(row)] = [row, 0]
            entry[1] = place
            tokens += worth
            step_s += token_s
            budget -= 1
        return [(row, num_tokens) for row, num_tokens in planned.values()]

    def _lengthen(self, batch: Batch, row: ScheduledRow, draft: Draft) -> int:
        """Make the decode row a verify row: the draft joins the sequence's tokens, its blocks and its chunk,
        as far as the pools have room (all of it but where a state group's slots run short); returns the
        tokens it took."""
        seq, chunk = row.seq, row.chunk
        append_token = self.block_manager.append_token
        num_appended = 0
        for token in draft.token_ids:
            seq.token_ids.append(token)
            try:
                batch.step_input.block_copies += append_token(seq.seq_id, token)
            except OutOfBlocksError:  # a state group's slots can run short where a block was counted: cut here
                seq.token_ids.pop()
                break
            num_appended += 1
        if not num_appended:
            return 0
        tokens = draft.token_ids[:num_appended]
        chunk.token_ids.extend(tokens)
        chunk.num_draft_tokens = row.num_draft_tokens = len(tokens)
        row.query_len += len(tokens)
        batch.num_tokens += len(tokens)
        batch.num_draft_tokens += len(tokens)
        batch.num_context_tokens += len(tokens)
        state = seq.speculation
        state.draft, state.draft_probs = tokens, None if draft.probs is None else draft.probs[:num_appended]
        return num_appended

    # ---- after the forward pass ----
    def restore_row(self, row: ScheduledRow) -> Draft:
        """The verify row is the sequence's decode row again (one token) and the draft leaves its token list;
        returns the draft. The first thing done with a verify row after the forward pass."""
        seq, chunk = row.seq, row.chunk
        num_drafted = row.num_draft_tokens
        del chunk.token_ids[1:]
        chunk.num_draft_tokens = row.num_draft_tokens = 0
        row.query_len = 1
        del seq.token_ids[len(seq.token_ids) - num_drafted:]
        state = seq.speculation
        draft = Draft(state.draft, state.draft_probs)
        state.draft, state.draft_probs = [], None
        return draft

    def settle(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """After a verification's tokens were appended to the sequence (one by one, the stop rules applied):
        counts it, and for a sequence that goes on keeps what was accepted (`commit`)."""
        if seq.finish_reason is None:
            self.commit(seq, num_drafted, num_accepted)
        else:
            self.record(seq, num_drafted, num_accepted)

    def commit(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """After the accepted tokens and the target's own were appended to a sequence that goes on: the block
        manager keeps the KV of its tokens up to the accepted ones (the last appended is pending, as after
        any sampled token). Counts the verification."""
        num_computed = len(seq.token_ids) - 1
        bm = self.block_manager
        bm.truncate(seq.seq_id, num_computed)
        bm.mark_computed(seq.seq_id, num_computed)
        seq.num_computed_tokens = num_computed
        if seq.decode_row is not None:  # a truncation that dropped blocks made the table another list
            seq.decode_row.chunk.block_table = bm.live_block_table(seq.seq_id)
        self.record(seq, num_drafted, num_accepted)

    def record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """Count a verification of `num_drafted` tokens, `num_accepted` of them accepted."""
        seq.speculation.record(num_drafted, num_accepted)
        totals = self.totals
        totals.num_drafts += 1
        totals.num_draft_tokens += num_drafted
        totals.num_accepted_tokens += num_accepted

    def release(self, seq: Sequence) -> None:
        """The sequence has finished or left its request."""
        if seq.speculation is not None:
            self.drafter.release(seq.seq_id)
