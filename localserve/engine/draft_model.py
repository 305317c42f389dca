"""The draft model's drafter: a small model of the target's tokenizer proposes the next tokens, one forward
pass per drafted token, batched over the sequences that draft.

Its KV lives in a pool of its own (its own `PagedKVCache` and `BlockManager`, built by engine/builder.py),
not in the target's: the draft model's layers, heads and head size are its own, so its KV cannot share the
target's tensors, and a block table of its own keeps the target's scheduling, preemption and admission
rules untouched. The draft pool is a cache: a sequence's draft KV is kept between steps, and its tokens are
brought up to the target's at each proposal (the longest common prefix of what the draft pool holds and
the target's tokens stays; the rest is computed again). So a target sequence preempted, swapped, forked
or continued from the prefix cache needs nothing special here: its draft catches up, prompt tokens through
the draft pool's own prefix cache. When the draft pool is full, the least recently used draft sequences
are evicted; a sequence that still finds no room drafts nothing that step.

A sequence whose draft lags by more than `MAX_CATCH_UP_TOKENS` (a new long prompt) catches up that much a
step, drafting nothing until it is level, so one long prompt never holds a whole step.

For temperature > 0 a drafted token is drawn from the draft model's distribution after the request's
penalties and filters (the same as the target's, engine/spec_acceptance.py), with a generator of the
sequence's own, and the distributions go with the draft for the acceptance rule.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from localserve.engine.drafting import Draft, DraftQuery
from localserve.engine.model_runner import ModelRunner
from localserve.engine.sampler import apply_penalties, filter_rows, make_generator
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.spec_acceptance import has_penalties
from localserve.engine.step import SeqChunk, StepInput
from localserve.kv.block_manager import BlockManager
from localserve.kv.out_of_blocks import OutOfBlocksError

MAX_CATCH_UP_TOKENS = 512


@dataclass(slots=True)
class DraftSequence:
    """What the draft pool holds for one target sequence: its token list (shared with the draft block
    manager), how many positions have their KV written (the last draft's tokens included), its generator."""

    token_ids: list[int]
    num_written: int
    generator: torch.Generator


@dataclass(slots=True)
class _Drafting:
    """One query during a proposal."""

    query: DraftQuery
    seq: DraftSequence
    draft: Draft
    probs: list[torch.Tensor]  # the draft model's distribution of each drafted token (temperature > 0)


@dataclass(slots=True)
class _PlaceRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class DraftModelDrafter:
    """The `Drafter` of a draft model (module doc) over its runner and its pool's block manager."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.device = runner.device
        self._seqs: OrderedDict[int, DraftSequence] = OrderedDict()  # by target sequence id, least recent first

    def propose(self, queries: list[DraftQuery]) -> list[Draft]:
        bm = self.block_manager
        in_use = {query.seq_id for query in queries}
        drafts = [Draft([]) for _ in queries]
        active: list[_Drafting] = []
        chunks: list[SeqChunk] = []
        for query, draft in zip(queries, drafts):
            seq = self._catch_up(query, in_use)
            if seq is None:
                continue
            start = bm.num_computed_tokens(query.seq_id)
            end = min(len(query.token_ids), start + MAX_CATCH_UP_TOKENS)
            level = end == len(query.token_ids)
            chunks.append(SeqChunk(seq.token_ids[start:end], start, bm.live_block_table(query.seq_id),
                                   needs_logits=level, seq_id=query.seq_id))
            seq.num_written = end
            if level:
                active.append(_Drafting(query, seq, draft, []))
        if not chunks:
            return drafts
        logits = self.runner.execute(StepInput(chunks))
        for chunk in chunks:
            bm.mark_computed(chunk.seq_id, chunk.context_len)
        drafting_all = list(active)
        while active:
            self._draw(active, logits)
            active = [drafting for drafting in active
                      if len(drafting.draft.token_ids) < drafting.query.max_tokens and self._append(drafting, in_use)]
            if active:
                logits = self.runner.execute(StepInput([
                    SeqChunk([drafting.draft.token_ids[-1]], len(drafting.seq.token_ids) - 1,
                             bm.live_block_table(drafting.query.seq_id), seq_id=drafting.query.seq_id)
                    for drafting in active]))
                for drafting in active:
                    drafting.seq.num_written = len(drafting.seq.token_ids)
        for drafting in drafting_all:
            if drafting.probs:
                drafting.draft.probs = torch.stack(drafting.probs)
        return drafts

    def release(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self.block_manager.free(seq_id)

    # ---- internals ----
    def _catch_up(self, query: DraftQuery, in_use: set[int]) -> DraftSequence | None:
        """The draft sequence of `query` holding the target's tokens, its KV kept up to their common
        prefix; None when the pool has no room for it even after evicting sequences not in `in_use`."""
        bm, target = self.block_manager, query.token_ids
        seq = self._seqs.pop(query.seq_id, None)
        if seq is not None:
            common = 0
            limit = min(seq.num_written, len(target) - 1)  # the last token is run again: its logits are wanted
            held = seq.token_ids
            while common < limit and held[common] == target[common]:
                common += 1
            common = max(common, bm.num_computed_tokens(query.seq_id))  # computed tokens are committed ones
            bm.mark_computed(query.seq_id, common)
            bm.truncate(query.seq_id, common)
            del held[common:]
            seq.num_written = common
            try:
                for token in target[common:]:
                    held.append(token)
                    self._append_token(query.seq_id, token, in_use)
            except OutOfBlocksError:
                del held[bm.num_tokens(query.seq_id):]
                self._seqs[query.seq_id] = seq
                return None
        else:
            tokens = list(target)
            while not bm.can_allocate(tokens) and self._evict(in_use):
                pass
            if not bm.can_allocate(tokens):
                return None
            seed = query.params.seed
            seq = DraftSequence(tokens, 0, make_generator(None if seed is None else seed + query.seq_id, self.device))
            seq.num_written = bm.allocate(query.seq_id, tokens, share_token_ids=True)
        self._seqs[query.seq_id] = seq  # the most recently used now
        return seq

    def _append_token(self, seq_id: int, token: int, in_use: set[int]) -> None:
        """Append the token (already in the shared list) to the draft pool, evicting others for a block."""
        bm = self.block_manager
        while not bm.can_append([seq_id]) and self._evict(in_use):
            pass
        bm.append_token(seq_id, token)

    def _append(self, drafting: _Drafting, in_use: set[int]) -> bool:
        """The drafted token joins the draft sequence, so the next forward pass reads it; False when the
        pool has no block for it."""
        seq, token = drafting.seq, drafting.draft.token_ids[-1]
        seq.token_ids.append(token)
        try:
            self._append_token(drafting.query.seq_id, token, in_use)
        except OutOfBlocksError:
            seq.token_ids.pop()
            return False
        return True

    def _evict(self, in_use: set[int]) -> bool:
        """Free the least recently used draft sequence not in `in_use`; False when there is none."""
        victim = next((seq_id for seq_id in self._seqs if seq_id not in in_use), None)
        if victim is None:
            return False
        self.release(victim)
        return True

    @torch.inference_mode()
    def _draw(self, active: list[_Drafting], logits: torch.Tensor) -> None:
        """Each active query's next drafted token from its row of `logits` (in order)."""
        for row, drafting in enumerate(active):
            query = drafting.query
            params = query.params
            place_logits = logits[row:row + 1]
            tokens = drafting.draft.token_ids
            if has_penalties(params):
                output = list(query.token_ids[query.prompt_len:]) + tokens
                place_logits = apply_penalties(place_logits.clone(), [
                    _PlaceRow(params, list(query.token_ids[:query.prompt_len]), output)])
            if params.greedy:
                tokens.append(int(place_logits[0].argmax()))
                continue
            probs = filter_rows(place_logits, [params]).softmax(-1)[0]
            noise = torch.empty_like(probs).exponential_(generator=drafting.seq.generator)
            tokens.append(int((probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax()))
            drafting.probs.append(probs)
