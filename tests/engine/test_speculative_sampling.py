"""Speculative sampling keeps the target's distribution: a chi-square test at temperature 1.0.

A random tiny model with a vocabulary of 8 tokens; 2,000 seeded requests of 3 tokens each: the first
from the prompt's prefill, the second and third from one verify row of a 2-token draft (or more rows
when a draft is rejected). The drafters: a point mass (always the same two tokens, as an n-gram draft
is) and a draft model (another random model, so its distribution differs from the target's). The
sampled joint distribution of the second and third tokens is compared with the exact one, computed
from the target's logits after the same penalties and filters (engine/sampler.py's own functions),
by a chi-square test at p = 0.001. The test's power is checked on a wrong rule: drawing from the
target's distribution after a rejection instead of the residual (the classic mistake) must fail it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from localserve.models.config import ModelConfig
from localserve.models.llama import LlamaForCausalLM

from localserve.engine import spec_acceptance
from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampler import apply_penalties, filter_rows
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.speculation import Draft
from tests.helpers.spec_costs import FixedStepCost

VOCAB = 8
NUM_SAMPLES = 2000
PROMPT = [1, 5, 2, 6]
P_VALUE = 1e-3


def random_model(seed: int) -> LlamaForCausalLM:
    config = ModelConfig("llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3 if param.dim() > 1 else 1.0)
    return model


class PointMass:
    """Drafts the same token every time, as an n-gram match would: a point-mass proposal."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, queries):
        return [Draft([self.token][:q.max_tokens]) for q in queries]

    def release(self, seq_id):
        pass


PARAMS = {"temperature 1": SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
          "filters and penalties": SamplingParams(temperature=0.9, top_k=6, top_p=0.95, min_p=0.02,
                                                  repetition_penalty=1.3, presence_penalty=0.4, max_tokens=3,
                                                  ignore_eos=True)}


def exact_distribution(model, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(second, third token), the first summed out, from the model's logits as the sampler takes them."""

    class Row:
        def __init__(self, output):
            self.params, self.prompt_token_ids, self.output_token_ids = params, PROMPT, output

    engine = build_engine(model, None, EngineConfig(num_kv_blocks=4))

    def next_probs(output: list[int]) -> torch.Tensor:
        logits = engine.runner.prompt_logits(PROMPT + output, [0, 1, 2, 3])[-1:].clone()
        return filter_rows(apply_penalties(logits, [Row(output)]), [params]).softmax(-1)[0]

    first = next_probs([])
    joint = {}
    for t1 in range(VOCAB):
        second = next_probs([t1])
        for t2 in range(VOCAB):
            third = next_probs([t1, t2])
            for t3 in range(VOCAB):
                joint[t2, t3] = joint.get((t2, t3), 0.0) + float(first[t1] * second[t2] * third[t3])
    return joint


def sampled_counts(model, drafter, params: SamplingParams) -> tuple[dict[tuple[int, int], int], int]:
    config = EngineConfig(num_kv_blocks=2048, max_num_seqs=256, max_num_batched_tokens=2048, spec_type="draft",
                          spec_tokens=2)
    engine = build_engine(model, None, config, draft_model=drafter_model(drafter))
    speculation = engine.scheduler.speculation
    speculation.cost = FixedStepCost()
    if isinstance(drafter, PointMass):
        speculation.drafter = drafter
    counts: dict[tuple[int, int], int] = {}
    for start in range(0, NUM_SAMPLES, 1000):
        ids = [engine.add_request(PROMPT, SamplingParams(**{**_fields(params), "seed": seed}))
               for seed in range(start, start + 1000)]
        final = engine.run_to_completion()
        for request_id in ids:
            tokens = list(final[request_id].token_ids)
            counts[tokens[1], tokens[2]] = counts.get((tokens[1], tokens[2]), 0) + 1
    return counts, speculation.totals


def drafter_model(drafter):
    return drafter if isinstance(drafter, LlamaForCausalLM) else random_model(99)


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def chi_square_p_value(counts: dict, expected_probs: dict) -> float:
    """Pearson's test, cells expected below 5 pooled into one; the p-value from the regularized gamma."""
    statistic, cells, pooled_count, pooled_expected = 0.0, 0, 0, 0.0
    for cell, probability in expected_probs.items():
        expected, observed = probability * NUM_SAMPLES, counts.get(cell, 0)
        if expected < 5:
            pooled_count, pooled_expected = pooled_count + observed, pooled_expected + expected
            continue
        statistic += (observed - expected) ** 2 / expected
        cells += 1
    if pooled_expected > 0:
        statistic += (pooled_count - pooled_expected) ** 2 / pooled_expected
        cells += 1
    assert sum(counts.values()) == NUM_SAMPLES and set(counts) <= set(expected_probs)
    degrees = cells - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def target():
    return random_model(0)


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("drafter_name", ["point mass", "draft model"])
def test_the_sampled_distribution_is_the_targets(target, drafter_name, params_name):
    params = PARAMS[params_name]
    exact = exact_distribution(target, params)
    drafter = PointMass(likeliest_second(exact)) if drafter_name == "point mass" else random_model(1)
    counts, totals = sampled_counts(target, drafter, params)
    # Every request verified a draft, accepted often and rejected often: the rule was exercised both ways.
    assert totals.num_drafts == NUM_SAMPLES
    assert 0.1 * NUM_SAMPLES < totals.num_accepted_tokens < 0.9 * NUM_SAMPLES
    assert chi_square_p_value(counts, exact) > P_VALUE


def test_a_wrong_rule_fails_the_test(target, monkeypatch):
    """Power: after a rejection, draw from the target's distribution instead of the residual."""
    right = spec_acceptance._sample

    def wrong(block, row):
        tokens, num_accepted = right(block, row)
        if num_accepted < len(row.draft):
            probs = filter_rows(block, [row.request.params]).softmax(-1)[num_accepted]
            tokens[-1] = spec_acceptance._draw(probs, row.seq.generator)
        return tokens, num_accepted

    monkeypatch.setattr(spec_acceptance, "_sample", wrong)
    params = PARAMS["temperature 1"]
    exact = exact_distribution(target, params)
    counts, _ = sampled_counts(target, PointMass(likeliest_second(exact)), params)
    assert chi_square_p_value(counts, exact) < P_VALUE


def likeliest_second(exact: dict[tuple[int, int], float]) -> int:
    """The second token most often sampled: a point mass on it is accepted often and rejected often."""
    marginal = [sum(p for (second, _), p in exact.items() if second == token) for token in range(VOCAB)]
    return max(range(VOCAB), key=marginal.__getitem__)


def test_the_p_value_of_a_perfect_sample_is_one_and_of_a_wrong_one_is_tiny():
    expected = {cell: 1 / 4 for cell in itertools.product(range(2), range(2))}
    exact = {cell: NUM_SAMPLES // 4 for cell in expected}
    assert chi_square_p_value(exact, expected) == pytest.approx(1.0)
    skewed = {(0, 0): NUM_SAMPLES // 4 + 300, (0, 1): NUM_SAMPLES // 4 - 300, (1, 0): NUM_SAMPLES // 4,
              (1, 1): NUM_SAMPLES // 4}
    assert chi_square_p_value(skewed, expected) < 1e-6
