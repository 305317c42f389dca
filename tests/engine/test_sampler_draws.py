"""What the sampler draws and reports: sampling frequencies over many seeded draws match the reference
distribution (a chi-square bound), no filter ever leaves a row without a token (hypothesis), and the
reported log-probabilities are the log-softmax of the penalized logits, before temperature and the filters.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampler import Sampler, SamplingRow, apply_penalties, filter_logits, make_generator
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from tests.helpers.sampling import kept, penalized_reference, sampling_reference

PROMPT, OUTPUT = [1, 2, 2, 5], [5, 7, 7]


def chi_square_bound(df: int, alpha: float = 1e-3) -> float:
    """The (1 - alpha) quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DRAW_CASES = {
    "temperature 1": {},
    "temperature 0.7, top_k 5": {"temperature": 0.7, "top_k": 5},
    "top_p 0.8": {"top_p": 0.8},
    "temperature 1.3, top_p 0.9, min_p 0.1": {"temperature": 1.3, "top_p": 0.9, "min_p": 0.1},
    "penalties, top_k 8": {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3, "top_k": 8},
    "tied logits across the top_p boundary": {"top_p": 0.5, "logits": [1.0, 1.0, 1.0, 1.0, 0.0, -1.0]},
}


@pytest.mark.parametrize("name", DRAW_CASES)
def test_sampling_frequencies_match_the_filtered_distribution(name):
    options = dict(DRAW_CASES[name])
    values = options.pop("logits", None)
    logits = torch.tensor(values) if values else torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(**options)
    draws = 4000
    rows = [SamplingRow(params, make_generator(seed), PROMPT, OUTPUT) for seed in range(draws)]
    counts = np.bincount(Sampler()(logits.expand(draws, -1).clone(), rows).token_ids, minlength=len(logits))
    probs = sampling_reference(logits, params, PROMPT, OUTPUT).numpy()
    possible = probs > 0
    assert counts[~possible].sum() == 0  # never a token the filters removed
    expected = draws * probs[possible]
    statistic = ((counts[possible] - expected) ** 2 / expected).sum()
    assert possible.sum() >= 3 and statistic < chi_square_bound(int(possible.sum()) - 1)


def test_a_seeded_draw_does_not_depend_on_its_batch():
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.2, top_p=0.9, presence_penalty=0.4)
    alone = [Sampler()(logits[i:i + 1].clone(), [SamplingRow(params, make_generator(i), [1], [i])]).token_ids[0]
             for i in range(6)]
    reverse = [SamplingRow(params, make_generator(i), [1], [i]) for i in reversed(range(6))]
    assert Sampler()(logits.flip(0).clone(), reverse).token_ids == alone[::-1]


finite_logit = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 3.0]), st.floats(-60, 60, width=32))


@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(1, 24))
    logits = draw(st.lists(finite_logit, min_size=vocab, max_size=vocab))
    masked = draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
    masked[draw(st.integers(0, vocab - 1))] = False  # a row holds at least one possible token
    logits = [float("-inf") if m else v for v, m in zip(logits, masked)]
    token = st.integers(0, vocab - 1)
    params = SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0, 10))),
        top_k=draw(st.one_of(st.none(), st.integers(1, vocab + 2))),
        top_p=draw(st.floats(0, 1, exclude_min=True)),
        min_p=draw(st.floats(0, 1, exclude_max=True)),
        repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.01, 100))),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 5))))
    row = SamplingRow(params, make_generator(draw(st.integers(0, 2**32))), draw(st.lists(token, min_size=1)),
                      draw(st.lists(token)))
    return torch.tensor(logits, dtype=torch.float32), row


@settings(max_examples=300, deadline=None)
@given(sampling_cases())
def test_no_filter_leaves_a_row_without_a_token(case):
    logits, row = case
    penalized = apply_penalties(logits.clone()[None], [row])[0]
    top = set(torch.nonzero(penalized == penalized.max()).flatten().tolist())
    if not row.params.greedy:
        filtered = filter_logits(penalized.clone(), row.params)
        assert top <= kept(filtered)  # the most likely tokens always survive
        probs = filtered.softmax(-1)
        assert not probs.isnan().any() and probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    result = Sampler()(logits.clone()[None], [row])
    [token] = result.token_ids
    if row.params.greedy:
        assert token == min(top)
    else:
        assert probs[token] > 0
    if row.params.logprobs is not None:
        assert math.isfinite(result.logprobs[0]) and result.logprobs[0] <= 0


# ------------------------------------------------------------------ log-probabilities
@pytest.mark.parametrize("options", [
    {}, {"temperature": 0}, {"temperature": 0.3, "top_k": 3}, {"top_p": 0.5, "min_p": 0.2},
    {"temperature": 0.7, "repetition_penalty": 1.4, "presence_penalty": 0.5, "frequency_penalty": 0.25},
], ids=str)
def test_logprobs_are_the_penalized_log_softmax_before_temperature_and_filters(options):
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(4)) * 2
    wanted = [5, 2, 0, None, 5]  # top alternatives asked for, per row (None: none at all)
    rows = [SamplingRow(SamplingParams(logprobs=count, **options), make_generator(i), PROMPT, OUTPUT)
            for i, count in enumerate(wanted)]
    result = Sampler()(logits.clone(), rows)
    for i, (row, count) in enumerate(zip(rows, wanted)):
        token = result.token_ids[i]
        if count is None:
            assert result.logprobs[i] is None and result.top_logprobs[i] == []
            continue
        reference = torch.log_softmax(penalized_reference(logits[i].double(), row.params, PROMPT, OUTPUT), -1)
        assert result.logprobs[i] == pytest.approx(reference[token].item(), abs=1e-5)
        values, ids = reference.topk(count)
        assert [t for t, _ in result.top_logprobs[i]] == ids.tolist()
        np.testing.assert_allclose([v for _, v in result.top_logprobs[i]], values.numpy(), atol=1e-5)
        if row.params.greedy and count:
            assert token == ids[0]


def test_parallel_samples_carry_the_chosen_logprob_without_alternatives():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    rows = [SamplingRow(SamplingParams(n=2, top_k=4), make_generator(i), [1], []) for i in range(2)]
    result = Sampler()(logits.clone(), rows)
    reference = torch.log_softmax(logits.double(), -1)
    for i, token in enumerate(result.token_ids):
        assert result.logprobs[i] == pytest.approx(reference[i, token].item(), abs=1e-5)
        assert result.top_logprobs[i] == []


def test_engine_logprobs_equal_transformers_on_the_same_tokens(tiny_model_dir):
    """End to end: each step's logprobs are the log-softmax of transformers' logits for the tokens so far,
    penalized by what the request had generated by then."""
    folder, hf_model = tiny_model_dir("llama")
    engine = build_engine(load_model(folder).model, None, EngineConfig(num_kv_blocks=16))
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=8, logprobs=3, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    prompt = [5, 9, 9, 17, 5, 40]
    request_id = engine.add_request(prompt, params)
    output = engine.run_to_completion()[request_id].outputs[0]
    assert len(output.token_ids) == len(output.logprobs) == len(output.top_logprobs) == 8
    with torch.no_grad():
        all_logits = hf_model(torch.tensor([prompt + output.token_ids])).logits[0].double()
    for step, token in enumerate(output.token_ids):
        penalized = penalized_reference(all_logits[len(prompt) + step - 1], params, prompt, output.token_ids[:step])
        reference = torch.log_softmax(penalized, -1)
        assert output.logprobs[step] == pytest.approx(reference[token].item(), abs=1e-4)
        values, ids = reference.topk(3)
        assert [t for t, _ in output.top_logprobs[step]] == ids.tolist()
    assert output.cumulative_logprob == pytest.approx(sum(output.logprobs))
