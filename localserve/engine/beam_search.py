"""One step of beam search for one request, on top of the block manager's sharing.

Beams that keep a common history share its blocks: a surviving beam continues in place, a beam that
branches is forked (sharing every block, copy-on-write on its partly filled last block), a beam that
is dropped frees its path, so blocks near the root stay shared by all.

Rule (as vLLM's and transformers' `early_stopping=True`): each step, every live beam proposes its
2k best next tokens; candidates are ranked by cumulative log-probability; a candidate ending in EOS
becomes a finished hypothesis, the best k others become the new beams. The search ends when k
hypotheses have finished or the beams reach max_tokens; the k best by cumulative log-probability are
returned.
"""

from __future__ import annotations

from typing import Protocol

import torch

from localserve.engine.sequence import Request, Sequence
from localserve.engine.stop_reason import LENGTH, StopReason
from localserve.kv.block_manager import BlockManager


class BeamHost(Protocol):
    """What a beam step needs of the engine (LLMEngine provides it)."""

    block_manager: BlockManager
    eos_token_ids: set[int]
    max_model_len: int
    num_generation_tokens: int

    def copy_sequence(self, parent: Sequence, seed: int | None = None) -> Sequence: ...

    def fork(self, request: Request, parent: Sequence, index: int = 0) -> Sequence: ...


def beam_search_step(engine: BeamHost, request: Request, entries: list[tuple[Sequence, int]],
                     logits: torch.Tensor) -> None:
    """Advance `request`'s beams given the logits rows of its live beams (`entries`: (beam, row))."""
    width = request.params.n
    beams = [seq for seq, _ in entries]
    logprobs = torch.log_softmax(logits[[row for _, row in entries]].double(), dim=-1)
    scores = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float64)[:, None] + logprobs
    top_scores, top_index = scores.flatten().topk(min(2 * width, scores.numel()))
    vocab = logprobs.shape[1]
    eos_ids = set() if request.params.ignore_eos else engine.eos_token_ids
    chosen: list[tuple[Sequence, int, float, float]] = []  # (parent, token, score, token logprob)
    for score, flat in zip(top_scores.tolist(), top_index.tolist()):
        parent, token = beams[flat // vocab], flat % vocab
        token_logprob = float(logprobs[flat // vocab, token])
        if token in eos_ids or token in request.params.stop_token_ids:
            if len(request.finished_beams) < width:
                done = engine.copy_sequence(parent)
                _extend(done, token, score, token_logprob)
                done.finish_reason = "stop"
                done.stop = StopReason("eos" if token in eos_ids else "stop_token", token)
                request.finished_beams.append(done)
            continue
        chosen.append((parent, token, score, token_logprob))
        if len(chosen) == width:
            break
    # Branches first (forks copy the parent's state), then parents continue in place, then the rest go.
    continuing: set[int] = set()
    plan: list[tuple[Sequence, int, float, float]] = []
    for parent, token, score, token_logprob in chosen:
        if parent.seq_id in continuing:
            plan.append((engine.fork(request, parent), token, score, token_logprob))
        else:
            continuing.add(parent.seq_id)
            plan.append((parent, token, score, token_logprob))
    for beam in beams:
        if beam.seq_id not in continuing:
            engine.block_manager.free(beam.seq_id)
            request.seqs.remove(beam)
            beam.decode_row = None  # it refers back to the beam (Sequence.decode_row)
    for beam, token, score, token_logprob in plan:
        _extend(beam, token, score, token_logprob)
        beam.pending_append = True
    engine.num_generation_tokens += len(plan)
    request.just_readmitted = False
    reached_length = any(len(b.output_token_ids) >= request.params.max_tokens or b.num_tokens >= engine.max_model_len
                         for b, *_ in plan)
    if reached_length or len(request.finished_beams) >= width:
        for beam in request.live_seqs:
            engine.block_manager.free(beam.seq_id)
            beam.finish_reason, beam.stop = "length", LENGTH
            beam.pending_append = False
            beam.decode_row = None  # the early stop below drops the beams before the scheduler sees them
        if len(request.finished_beams) >= width:  # early stop: the finished hypotheses are the answer
            request.seqs = []


def _extend(seq: Sequence, token: int, score: float, token_logprob: float) -> None:
    seq.token_ids.append(token)
    seq.cumulative_logprob = score
    seq.logprobs.append(token_logprob)
