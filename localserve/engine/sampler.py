"""Next-token selection for a batch: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Every sequence owns a `torch.Generator` (seeded from the request's seed when given), so a seeded
request samples the same tokens whatever else shares its batch. The step's logits stay one buffer:
greedy rows take their argmax in place, penalties are applied in place to the rows that have them,
sampled rows are copied out once and filtered together (temperature, top-k, top-p, min-p as per-row
tensors; only the random draw is per row, from each row's generator), and only rows asking for
logprobs get a log-softmax. Nothing is read back from the device but one copy per step: the sampled
ids (with their logprobs, when asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from localserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One sequence's view for the sampler (the engine keeps one per sequence, its output a live view)."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    greedy: bool = field(init=False)
    has_penalties: bool = field(init=False)
    # A full log-softmax over the vocabulary only for rows that ask for logprobs, and for parallel samples
    # (n > 1), which are returned with their cumulative log-probability.
    wants_logprobs: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = p.greedy
        self.has_penalties = p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)
        self.wants_logprobs = p.logprobs is not None or p.n > 1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Log-probability of each chosen token under the model (after penalties); None for rows that neither
    # ask for logprobs nor are one of n > 1 samples, which spares a log-softmax over the vocabulary.
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per row, when any row asks


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one sequence: seeded when the request gives a seed, random otherwise."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output, as transformers), presence and frequency (output, as OpenAI)."""
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
            counts = torch.bincount(torch.tensor(list(row.output_token_ids), device=logits.device),
                                    minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits of one row [V] with top-k, top-p and min-p applied (others set to -inf).

    The rules are transformers' (its `generate` applies them in this order, each to what the previous one
    left, renormalised): top-k keeps every token at least as likely as the k-th; top-p keeps the most
    likely tokens up to and including the one whose cumulative probability reaches top_p; min-p keeps
    tokens at least min_p times as likely as the most likely one. One difference: tokens tied with the
    one that reaches top_p all stay (transformers keeps whichever its sort put first), so that, like
    top-k's, the result depends on the values alone. The most likely token always stays.
    """
    return filter_rows(logits[None], [params])[0]


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`filter_logits` for a batch [S, V], row i with params[i]: each step one operation over the batch,
    the per-row parameters as tensors (a row without a filter gets the value that keeps everything)."""
    num_rows, vocab = logits.shape
    dtype, device = logits.dtype, logits.device
    neg_inf = float("-inf")

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)[:, None]

    # Shifting the largest logit to 0 changes no probability, and no temperature can then overflow a
    # logit to +inf (which would turn the softmax into NaN); nor can one so small that the dtype rounds
    # it to 0 (0 / 0): below the smallest normal number every temperature has the same effect.
    tiny = torch.finfo(dtype).tiny
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / column([max(p.temperature, tiny) for p in params])
    top_k = [p.top_k if p.top_k is not None and p.top_k < vocab else vocab for p in params]
    with_top_k, with_top_p = any(k < vocab for k in top_k), any(p.top_p < 1.0 for p in params)
    if with_top_k or with_top_p:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
    if with_top_k:  # the k-th largest value; k = V keeps every token
        kth = sorted_logits.gather(1, torch.tensor(top_k, device=device)[:, None] - 1)
        logits = logits.masked_fill(logits < kth, neg_inf)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)  # still sorted: a suffix
    if with_top_p:
        mass_before = sorted_logits.softmax(-1).cumsum(-1).roll(1, dims=-1)
        mass_before[:, 0] = 0.0
        # The probability mass before a token only grows along the sorted row, so the tokens it leaves
        # below top_p are a prefix; the last of them reaches top_p. Its value is the threshold (ties stay).
        # At least one: a top_p below the dtype's smallest number compares as 0.
        top_p = column([p.top_p for p in params])
        num_kept = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)
        threshold = sorted_logits.gather(1, num_kept - 1).masked_fill(top_p >= 1.0, neg_inf)
        logits = logits.masked_fill(logits < threshold, neg_inf)
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < column([p.min_p for p in params]) * probs.max(-1, keepdim=True).values,
                                    neg_inf)
    return logits


_has_penalties = attrgetter("has_penalties")


class Sampler:
    """Chooses one token per row of `rows`, reading logits [R, V] (float32 or float64) in place."""

    @torch.inference_mode()  # the runner's logits are inference tensors: changed in place only in this mode
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 logit_rows: torch.Tensor | None = None) -> SamplerOutput:
        """Row i of `rows` reads `logits[logit_rows[i]]` (`logits[i]` when None: no copy at all).

        `logits` may be changed in place (penalties); with `logit_rows`, on a copy of those rows.
        """
        if logit_rows is not None:  # some logits rows feed several samples (n > 1 at the first token)
            logits = logits.index_select(0, logit_rows)
        if any(map(_has_penalties, rows)):
            apply_penalties(logits, rows)
        chosen = logits.max(dim=-1).indices  # greedy rows are done; max() is faster than argmax() on the CPU
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if sampled:  # together: one filter pass over their rows, then each row's own random draw
            index = torch.tensor(sampled, device=logits.device)
            probs = filter_rows(logits.index_select(0, index), [rows[i].params for i in sampled]).softmax(-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, each row with its own generator.
            # E is kept off 0 (CUDA's exponential_ has been seen to return it), else a removed token, p = 0,
            # could win with 0 / 0.
            noise = torch.empty_like(probs)
            for j, i in enumerate(sampled):
                noise[j].exponential_(generator=rows[i].generator)
            chosen.index_copy_(0, index, (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1))
        wanted = [i for i, row in enumerate(rows) if row.wants_logprobs]
        if not wanted:
            return SamplerOutput(token_ids=chosen.tolist(), logprobs=[None] * len(rows))
        index = torch.tensor(wanted, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
        chosen_logprobs = logprobs.gather(1, chosen.index_select(0, index)[:, None])
        max_top = min(max(rows[i].params.logprobs or 0 for i in wanted), logits.shape[-1])
        top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (logprobs[:, :0],) * 2
        # One copy to the host: ids are exact in float64 (below 2^53), float32 logprobs widen exactly.
        packed = torch.cat([chosen.double(), chosen_logprobs.double().flatten(), top_values.double().flatten(),
                            top_ids.double().flatten()]).tolist()
        num_rows, num_wanted = len(rows), len(wanted)
        output = SamplerOutput(token_ids=[int(t) for t in packed[:num_rows]], logprobs=[None] * num_rows,
                               top_logprobs=[[] for _ in rows])
        tops = num_rows + num_wanted
        for j, i in enumerate(wanted):
            output.logprobs[i] = packed[num_rows + j]
            count = rows[i].params.logprobs or 0
            values = packed[tops + j * max_top:tops + j * max_top + count]
            ids = packed[tops + num_wanted * max_top + j * max_top:][:count]
            output.top_logprobs[i] = [(int(token), value) for token, value in zip(ids, values)]
        return output
