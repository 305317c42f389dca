"""References for the sampler: Hugging Face transformers' logits processors, in the order its `generate`
applies them, and an independent reference for OpenAI's presence and frequency penalties.

transformers has no presence / frequency penalty; OpenAI defines them on the counts of the tokens
generated so far (not the prompt's): mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty.
They come after the repetition penalty, as in vLLM.

One rule is ours, not transformers': when tokens tie with the token whose cumulative probability
crosses top_p, all of them stay (transformers keeps whichever of them its sort happens to put first),
so that the filter depends on the values alone, as top-k's does.
"""

from __future__ import annotations

import numpy as np
import torch

from localserve.engine.sampling_params import SamplingParams


def presence_frequency_reference(logits: np.ndarray, output_token_ids: list[int], presence: float,
                                 frequency: float) -> np.ndarray:
    """OpenAI's formula on a copy of `logits` [V]."""
    counts = np.zeros(logits.shape[-1])
    for token in output_token_ids:
        counts[token] += 1
    return logits - counts * frequency - (counts > 0) * presence


def penalized_reference(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int],
                        output_token_ids: list[int]) -> torch.Tensor:
    """Logits [V] after the repetition (transformers), presence and frequency (OpenAI) penalties."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    scores = logits.clone()[None]
    if params.repetition_penalty != 1.0:
        input_ids = torch.tensor([prompt_token_ids + output_token_ids])
        scores = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(input_ids, scores)
    if params.presence_penalty or params.frequency_penalty:
        shifted = presence_frequency_reference(scores[0].double().numpy(), output_token_ids,
                                               params.presence_penalty, params.frequency_penalty)
        scores = torch.from_numpy(shifted).to(scores.dtype)[None]
    return scores[0]


def filtered_reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [V] after temperature, top-k, top-p and min-p (removed tokens at -inf), as transformers."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = TemperatureLogitsWarper(float(params.temperature))(None, logits.clone()[None])
    if params.top_k is not None:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        before = scores
        scores = TopPLogitsWarper(params.top_p)(None, before)
        smallest_kept = scores[torch.isfinite(scores)].min()
        scores = torch.where(before >= smallest_kept, before, scores)  # ties with the crossing token stay
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores[0]


def sampling_reference(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: list[int],
                       output_token_ids: list[int]) -> torch.Tensor:
    """The distribution [V] (float64) a sampled request draws its next token from."""
    penalized = penalized_reference(logits.double(), params, prompt_token_ids, output_token_ids)
    return filtered_reference(penalized, params).softmax(-1)


def kept(logits: torch.Tensor) -> set[int]:
    """Indices a filter left in (finite logits)."""
    return set(torch.isfinite(logits).nonzero().flatten().tolist())
