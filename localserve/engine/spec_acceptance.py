"""Speculative decoding's acceptance: how much of a draft the target model keeps, and the token it adds.

A verify row's logits give the target's next-token distribution at each place of the draft: after the
sequence's last token (place 0) and after each drafted token. Every distribution is taken as the sampler
takes it (engine/sampler.py): the penalties first, counting the output so far and the draft before that
place, then temperature, top-k, top-p and min-p.

- Greedy: a drafted token is kept while it is the target's argmax at its place; the target's argmax at
  the first mismatch (or after the whole draft) is added. The tokens are the ones decoding one token at
  a time gives.
- Temperature > 0: the speculative sampling rule (Leviathan et al., Chen et al., 2023). Drafted token d
  at place i is kept with probability min(1, p_i(d) / q_i(d)), p the target's distribution and q the
  drafter's (the draft model's, after the same penalties and filters; the n-gram drafter's is a point
  mass on d, so d is kept with probability p_i(d)). At the first rejection the added token is drawn from
  the residual max(0, p_i - q_i), renormalised (a point mass: p_i without d); after a whole draft, from
  p at the last place. Each token is then distributed exactly as the target's own, whatever the drafter
  proposed: only how many come per step depends on it.
- Logprobs (of each kept or added token, and the top alternatives) are the sampler's: the log-softmax of
  the penalised logits at its place.

Random draws come from the sequence's own generator: a seeded request gets the same tokens on every run
with the same drafts, though not the tokens it gets without speculation (the draws are used differently).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localserve.engine.sampler import apply_penalties, filter_rows
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.sequence import Request, Sequence


@dataclass(slots=True)
class VerifyRow:
    """A sequence verified in this step: its draft, the drafter's probabilities of it (None: point masses),
    and the first of its len(draft) + 1 rows of the step's logits."""

    request: Request
    seq: Sequence
    logits_row: int
    draft: list[int]
    draft_probs: torch.Tensor | None


@dataclass(slots=True)
class Verification:
    """The tokens a verification yields, in order: the kept drafted tokens, then the target's own."""

    token_ids: list[int]
    num_accepted: int  # of the drafted tokens
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass(slots=True)
class _PlaceRow:
    """What the penalties read at one place of a draft (as `SamplingRow` offers it)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)


@torch.inference_mode()
def verify(logits: torch.Tensor, rows: list[VerifyRow]) -> list[Verification]:
    """Each verify row's tokens (module doc), reading the step's logits [R, V] (not changed)."""
    return [_verify_row(logits, row) for row in rows]


def _verify_row(logits: torch.Tensor, row: VerifyRow) -> Verification:
    params, seq, draft = row.request.params, row.seq, row.draft
    num_drafted = len(draft)
    block = logits[row.logits_row:row.logits_row + num_drafted + 1]
    if has_penalties(params):
        output = seq.output_token_ids  # place i's output: the output so far and draft[:i]
        places = [_PlaceRow(params, row.request.prompt_token_ids, output + draft[:place])
                  for place in range(num_drafted + 1)]
        block = apply_penalties(block.clone(), places)
    if params.greedy:
        choice = block.max(dim=-1).indices.tolist()
        num_accepted = 0
        while num_accepted < num_drafted and choice[num_accepted] == draft[num_accepted]:
            num_accepted += 1
        tokens = draft[:num_accepted] + [choice[num_accepted]]
    else:
        tokens, num_accepted = _sample(block, row)
    logprobs: list[float | None] = [None] * len(tokens)
    tops: list[list[tuple[int, float]] | None] = [None] * len(tokens)
    if params.logprobs is not None or params.n > 1:
        log_probs = torch.log_softmax(block[:len(tokens)], dim=-1)
        chosen = log_probs.gather(1, torch.tensor(tokens, device=block.device)[:, None]).flatten()
        logprobs = chosen.tolist()
        count = min(params.logprobs or 0, block.shape[-1])
        if count:
            values, ids = log_probs.topk(count, dim=-1)
            tops = [list(zip(place_ids, place_values)) for place_ids, place_values in zip(ids.tolist(),
                                                                                          values.tolist())]
        else:
            tops = [[] for _ in tokens]
    return Verification(tokens, num_accepted, logprobs, tops)


def _sample(block: torch.Tensor, row: VerifyRow) -> tuple[list[int], int]:
    """The speculative sampling rule (module doc): the kept drafted tokens and the added one."""
    params, draft, generator = row.request.params, row.draft, row.seq.generator
    num_drafted = len(draft)
    probs = filter_rows(block, [params] * (num_drafted + 1)).softmax(-1)
    places = torch.arange(num_drafted, device=probs.device)
    drafted = torch.tensor(draft, device=probs.device)
    target = probs[places, drafted]
    draft_probs = None if row.draft_probs is None else row.draft_probs.to(probs.dtype)
    proposed = draft_probs[places, drafted] if draft_probs is not None else torch.ones_like(target)
    uniform = torch.rand(num_drafted, generator=generator, device=probs.device, dtype=probs.dtype)
    kept = (uniform * proposed < target).tolist()  # u < p / q, with q > 0: the drafter drew the token
    num_accepted = kept.index(False) if False in kept else num_drafted
    if num_accepted == num_drafted:
        last = probs[num_drafted]
    else:
        rejected = probs[num_accepted]
        if draft_probs is not None:
            last = (rejected - draft_probs[num_accepted]).clamp_(min=0)
        else:
            last = rejected.clone()
            last[draft[num_accepted]] = 0
        if not bool(last.sum() > 0):  # p == q: the rejection had probability 0; p itself is then exact
            last = rejected
    return draft[:num_accepted] + [_draw(last, generator)], num_accepted


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A draw from the (unnormalised) weights: argmax(w / E), E ~ Exp(1) kept off 0, as the sampler draws."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return int((weights / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax())
