"""The sampler's filters and penalties against transformers' logits processors (and OpenAI's formula for
presence / frequency penalties) on hand-built distributions at their boundaries, and greedy == argmax.

Each hand-built case also states the tokens that must survive, worked out by hand, so a case where the
reference and the code agreed on a wrong answer would still fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from localserve.engine.sampler import Sampler, SamplingRow, apply_penalties, filter_logits, make_generator
from localserve.engine.sampling_params import SamplingParams
from tests.helpers.sampling import filtered_reference, kept, penalized_reference, presence_frequency_reference


def from_probs(probs: list[float]) -> torch.Tensor:
    """float32 logits whose softmax is exactly `probs` (checked: for powers of two it is exact)."""
    logits = torch.tensor([math.log(p) for p in probs], dtype=torch.float32)
    assert logits.softmax(-1).tolist() == probs, "the boundary case is not exact in float32"
    return logits


DYADIC = [0.5, 0.25, 0.125, 0.0625, 0.0625]  # cumulative: 0.5, 0.75, 0.875, 0.9375, 1 (exact in float32)
TIES = torch.tensor([2.0, 5.0, 5.0, 1.0, 5.0, 0.0, 1.0])  # three tied for the top (1, 2, 4), two for fourth

FILTER_CASES = {
    # name: (logits, filter parameters, the tokens that must survive)
    "top_p: the token crossing top_p stays": (torch.tensor([0.7, 0.2, 0.1]).log(), {"top_p": 0.6}, {0}),
    "top_p: two needed": (torch.tensor([0.7, 0.2, 0.1]).log(), {"top_p": 0.75}, {0, 1}),
    "top_p: the top token exactly at top_p": (from_probs(DYADIC), {"top_p": 0.5}, {0}),
    "top_p: two tokens exactly at top_p": (from_probs(DYADIC), {"top_p": 0.75}, {0, 1}),
    "top_p: three tokens exactly at top_p": (from_probs(DYADIC), {"top_p": 0.875}, {0, 1, 2}),
    "top_p: just above a cumulative step": (from_probs(DYADIC), {"top_p": 0.8750001}, {0, 1, 2, 3, 4}),
    "top_p: a tie straddles top_p, both stay": (from_probs(DYADIC), {"top_p": 0.9375}, {0, 1, 2, 3, 4}),
    "top_p: tiny keeps the tied top": (TIES, {"top_p": 1e-6}, {1, 2, 4}),
    "top_p: the tied top is enough": (TIES, {"top_p": 0.5}, {1, 2, 4}),
    "top_p: just under 1 still drops the far tail": (torch.tensor([0.0, -10.0, -12.0]), {"top_p": 0.99999}, {0, 1}),
    "top_k 1": (torch.tensor([0.3, 2.0, -1.0, 1.9]), {"top_k": 1}, {1}),
    "top_k 1 with a tied top keeps the ties": (TIES, {"top_k": 1}, {1, 2, 4}),
    "top_k 5 with a tie at the fifth keeps both": (TIES, {"top_k": 5}, {0, 1, 2, 4, 3, 6}),
    "top_k of the vocabulary size": (TIES, {"top_k": 7}, set(range(7))),
    "top_k above the vocabulary size": (TIES, {"top_k": 50}, set(range(7))),
    "min_p cuts all but the top": (torch.tensor([0.6, 0.3, 0.1]).log(), {"min_p": 0.51}, {0}),
    "min_p exactly at a ratio keeps it": (from_probs([0.5, 0.25, 0.25]), {"min_p": 0.5}, {0, 1, 2}),
    "min_p just above a ratio drops it": (from_probs([0.5, 0.25, 0.25]), {"min_p": 0.5000001}, {0}),
    "min_p with a tied top": (torch.tensor([0.45, 0.45, 0.1]).log(), {"min_p": 0.9}, {0, 1}),
    "temperature 2 widens the nucleus": (torch.tensor([0.7, 0.2, 0.1]).log(), {"top_p": 0.6, "temperature": 2.0},
                                         {0, 1}),
    "temperature 0.5 narrows min_p": (torch.tensor([0.5, 0.3, 0.2]).log(), {"min_p": 0.3, "temperature": 0.5},
                                      {0, 1}),
    "top_k then top_p renormalised": (torch.tensor([0.4, 0.3, 0.2, 0.1]).log(), {"top_k": 2, "top_p": 0.55},
                                      {0}),
    "top_k, top_p and min_p": (torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]).log(),
                               {"top_k": 4, "top_p": 0.7, "min_p": 0.8}, {0, 1}),
}


@pytest.mark.parametrize("name", FILTER_CASES)
def test_filter_at_its_boundary_equals_transformers(name):
    logits, options, survivors = FILTER_CASES[name]
    params = SamplingParams(**options)
    ours = filter_logits(logits.clone(), params)
    reference = filtered_reference(logits, params)
    assert kept(ours) == kept(reference) == survivors
    torch.testing.assert_close(ours.softmax(-1), reference.softmax(-1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("options", [
    {"temperature": 0.6}, {"temperature": 1.7, "top_k": 8}, {"top_p": 0.9}, {"temperature": 0.8, "top_p": 0.5},
    {"min_p": 0.05}, {"temperature": 1.3, "top_k": 20, "top_p": 0.8, "min_p": 0.1},
    {"temperature": 0.3, "top_k": 3, "min_p": 0.2},
], ids=str)
def test_filters_on_random_logits_equal_transformers(seed, options):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, generator=generator) * 3
    params = SamplingParams(**options)
    ours = filter_logits(logits.clone(), params)
    reference = filtered_reference(logits, params)
    assert kept(ours) == kept(reference)
    torch.testing.assert_close(ours.softmax(-1), reference.softmax(-1), rtol=1e-5, atol=1e-7)


def penalize(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    row = SamplingRow(params, make_generator(0), prompt, output)
    return apply_penalties(logits.clone()[None], [row])[0]


# Token 3 is three times in the prompt; 5 in both; 7 three times in the output; 8 once in the output.
PROMPT, OUTPUT = [3, 3, 1, 3, 5], [5, 7, 7, 8, 7]
PENALTY_LOGITS = torch.tensor([0.5, -1.0, 2.0, 1.5, 0.0, -0.5, 3.0, 0.0, -2.0, 1.0])


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_counts_each_prompt_or_output_token_once(penalty):
    params = SamplingParams(repetition_penalty=penalty)
    ours = penalize(PENALTY_LOGITS, params, PROMPT, OUTPUT)
    torch.testing.assert_close(ours, penalized_reference(PENALTY_LOGITS, params, PROMPT, OUTPUT))
    seen = {1, 3, 5, 7, 8}
    by_hand = [(v / penalty if v > 0 else v * penalty) if i in seen else v
               for i, v in enumerate(PENALTY_LOGITS.tolist())]
    torch.testing.assert_close(ours, torch.tensor(by_hand))


@pytest.mark.parametrize("presence, frequency", [(0.5, 0.0), (0.0, 0.4), (0.6, 0.3), (-0.5, -1.0), (2.0, 2.0)])
def test_presence_and_frequency_penalties_count_only_generated_tokens(presence, frequency):
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
    ours = penalize(PENALTY_LOGITS, params, PROMPT, OUTPUT)
    expected = presence_frequency_reference(PENALTY_LOGITS.numpy().astype(np.float64), OUTPUT, presence, frequency)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert ours[3] == PENALTY_LOGITS[3]  # only in the prompt: untouched
    assert ours[7].item() == pytest.approx(PENALTY_LOGITS[7].item() - 3 * frequency - presence)


def test_all_penalties_together_equal_the_references():
    params = SamplingParams(repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)
    ours = penalize(PENALTY_LOGITS, params, PROMPT, OUTPUT)
    torch.testing.assert_close(ours, penalized_reference(PENALTY_LOGITS, params, PROMPT, OUTPUT))


def test_no_output_yet_means_no_presence_or_frequency_penalty():
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    assert torch.equal(penalize(PENALTY_LOGITS, params, PROMPT, []), PENALTY_LOGITS)


def test_greedy_is_argmax_of_the_penalized_logits_and_ignores_the_filters():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=generator)
    logits[5, [4, 9, 30]] = logits[5].max() + 1  # a three-way tie: the lowest index wins, as argmax
    options = [{}, {"repetition_penalty": 1.5}, {"presence_penalty": 1.0, "frequency_penalty": 0.5},
               {"top_k": 1, "top_p": 0.1, "min_p": 0.5}, {"repetition_penalty": 0.8}, {}]
    rows = [SamplingRow(SamplingParams(temperature=0, **o), make_generator(i), [i, 9, 9], [i + 1, 9, 9])
            for i, o in enumerate(options)]
    chosen = Sampler()(logits.clone(), rows).token_ids
    expected = [int(np.argmax(penalized_reference(logits[i], row.params, row.prompt_token_ids,
                                                  row.output_token_ids).numpy())) for i, row in enumerate(rows)]
    assert chosen == expected
    assert chosen[5] == 4


def test_top_k_1_samples_the_argmax():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(5))
    rows = [SamplingRow(SamplingParams(temperature=1.5, top_k=1), make_generator(i), [1], []) for i in range(8)]
    assert Sampler()(logits.clone(), rows).token_ids == logits.argmax(-1).tolist()
