"""Admission: which queued requests come into a step, and the blocks each takes. No torch.

The rules, and why (docs/ARCHITECTURE.md, "Scheduling rules", says the same):

New, swapped and preempted requests alike are planned as a whole: the blocks a request takes now (its
prompt minus prefix-cache hits; after a recompute its samples or beams share the full blocks of their
common prefix, each adds its own tail; after a swap, its distinct blocks) plus headroom: one block for
every sequence running after it (samples and beams count, and a request not yet forked counts its `n`),
its own capped by what it can still grow to (`peak_blocks`). So a (re)admitted request is not preempted
again by the next decodes, and the `n - 1` copy-on-write copies after a fork have room. Slots
(`max_num_seqs`) count the same sequences.

The swapped and waiting queues are served as one, strictly in arrival order (a request that fell back
from swap to recompute does not wait behind one swapped out after it), and nothing passes a request that
does not fit yet: no request waits behind a later one. A waiting request also needs a token of the
step's budget. Fairness bound: a request that fits the pool alone (checked when it is added: its
`peak_blocks` against the pool) is admitted at the latest once every request ahead of it is admitted and
the running requests have finished; when nothing runs its headroom is at most its own growth, so it
fits. Nothing is readmitted in a step that preempted (the scheduler does not call `admit`): that step
was short of blocks.
"""

from __future__ import annotations

from localserve.engine.batch import Batch, BatchFiller
from localserve.engine.events import EventKind, EventLog
from localserve.engine.request_queues import RequestQueues
from localserve.engine.sequence import Request, RequestState, Sequence
from localserve.kv.block_manager import BlockManager


def peak_blocks(num_prompt_tokens: int, max_tokens: int, num_seqs: int, block_size: int) -> int:
    """The most blocks a request can hold: its full prompt blocks once, and each sample's or beam's
    own blocks up to the last token it writes (the last sampled token is never written)."""
    shared = num_prompt_tokens // block_size
    per_seq = _num_blocks_for(num_prompt_tokens + max_tokens - 1, block_size)
    return shared + num_seqs * (per_seq - shared)


class Admission:
    """Brings queued requests into the running queue while the next fits (module doc): a swapped one by
    a swap-in, a waiting one by giving its sequences blocks and their first prefill chunks."""

    def __init__(self, max_num_seqs: int, block_manager: BlockManager, events: EventLog, queues: RequestQueues,
                 filler: BatchFiller) -> None:
        self.max_num_seqs = max_num_seqs
        self.block_manager = block_manager
        self.events = events
        self.queues = queues
        self.filler = filler

    def admit(self, batch: Batch, slots_in_use: int) -> list[Request]:
        """Admit queued requests in arrival order until the next does not fit; returns those admitted."""
        admitted: list[Request] = []
        while (request := self.queues.next_to_admit()) is not None:
            if request.state is RequestState.SWAPPED:
                if not self._swap_in(batch, request, slots_in_use):
                    break
            elif batch.budget_left <= 0 or not self._allocate(batch, request, slots_in_use):
                break
            slots_in_use += request.num_slots
            self.queues.move(request, RequestState.RUNNING)
            admitted.append(request)
        return admitted

    def fits(self, request: Request, group_blocks: list[int], slots_in_use: int) -> bool:
        """The admission rule: its slots, and in each layer group's pool the blocks it takes now
        (`group_blocks`) plus the decode headroom."""
        if slots_in_use + request.num_slots > self.max_num_seqs:
            return False
        peak = self.peak_blocks(request)
        return all(num_blocks + slots_in_use + min(request.num_slots, max(0, peak - num_blocks)) <= available
                   for num_blocks, available in zip(group_blocks, self.block_manager.group_available_blocks,
                                                    strict=True))

    def peak_blocks(self, request: Request) -> int:
        return peak_blocks(len(request.prompt_token_ids), request.params.max_tokens, request.num_slots,
                           self.block_manager.block_size)

    def _swap_in(self, batch: Batch, request: Request, slots_in_use: int) -> bool:
        """Bring a swapped request back if it fits; its pending tokens are appended by the next step."""
        bm = self.block_manager
        seqs = request.live_seqs
        seq_ids = [seq.seq_id for seq in seqs]
        if not self.fits(request, bm.group_blocks_to_swap_in(seq_ids), slots_in_use):
            return False
        moves = bm.swap_in(seq_ids)
        for seq in seqs:
            seq.decode_row = None  # its block table is another list now
        batch.step_input.swap_in += moves
        self.events.append(EventKind.SWAPPED_IN, request.label, num_blocks=len(moves))
        self.events.append(EventKind.RESUMED, request.label)
        request.just_readmitted = True
        return True

    def _allocate(self, batch: Batch, request: Request, slots_in_use: int) -> bool:
        """Give a waiting request its blocks and its first prefill chunks if it fits.

        Its first live sequence leads: it allocates the prompt (prefix-cache hits included), the others
        share the leader's blocks of their common prefix (followers until the leader has computed them).
        """
        bm = self.block_manager
        seqs = request.live_seqs
        leader, others = seqs[0], seqs[1:]
        num_shared_blocks = self._num_shared_blocks(seqs)
        use_prefix_cache = request.uses_prefix_cache
        block_keys = request.block_extra_keys  # its images' content (engine/multimodal.py)
        group_blocks = bm.group_blocks_to_allocate(leader.token_ids, use_prefix_cache=use_prefix_cache,
                                                   block_extra_keys=block_keys)
        others_blocks = sum(_num_blocks_for(seq.num_tokens, bm.block_size) - num_shared_blocks for seq in others)
        if not self.fits(request, [num_blocks + others_blocks for num_blocks in group_blocks], slots_in_use):
            return False
        for seq in seqs:
            seq.decode_row = None  # a readmitted sequence's block table is another list now
        # share_token_ids: the block manager keeps each sequence's token list itself (one list, not two).
        leader.num_computed_tokens = bm.allocate(leader.seq_id, leader.token_ids, share_token_ids=True,
                                                 use_prefix_cache=use_prefix_cache, block_extra_keys=block_keys)
        for seq in others:
            if num_shared_blocks:
                seq.num_computed_tokens = bm.allocate_sharing(seq.seq_id, seq.token_ids, leader.seq_id,
                                                              num_shared_blocks, share_token_ids=True)
            else:
                seq.num_computed_tokens = bm.allocate(seq.seq_id, seq.token_ids, share_token_ids=True,
                                                      block_extra_keys=block_keys)
        request.followers = [seq for seq in others if bm.awaits_leader(seq.seq_id)]
        if request.num_preemptions == 0:
            request.num_cached_tokens = leader.num_computed_tokens
            self.events.append(EventKind.ADMITTED, request.label, num_prompt_tokens=len(request.prompt_token_ids))
            if request.num_cached_tokens:
                self.events.append(EventKind.PREFIX_HIT, request.label, num_cached_tokens=request.num_cached_tokens)
        else:
            request.just_readmitted = True
            self.events.append(EventKind.RESUMED, request.label)
        for seq in seqs:
            if seq not in request.followers:
                self.filler.add_prefill(batch, request, seq)
        return True

    def _num_shared_blocks(self, seqs: list[Sequence]) -> int:
        """Full blocks of the sequences' common prefix, each keeping at least its last token to compute."""
        if len(seqs) < 2 or not self.block_manager.shares_uncomputed_blocks:
            return 0
        first = seqs[0].token_ids
        common = min(seq.num_tokens for seq in seqs) - 1
        for seq in seqs[1:]:
            common = _common_prefix_len(first, seq.token_ids, common)
        return common // self.block_manager.block_size


def _num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of `a` and `b`, at most `limit` (both have at least `limit` tokens)."""
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit
