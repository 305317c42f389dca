"""The engine on tiny Gemma 3 and Gemma 4 (MoE) models (float64) with windows of 16 tokens: batched with
continuous batching, chunked prefill (chunks that end on either side of a window's edge) and prefix
caching, under pressure (preemption by recompute and by swap) and with speculative decoding (n-gram and
the model drafting for itself), every greedy request gives what it gives alone, over prompts and
generations of several windows; each pressured run is checked step by step (tests/helpers/engine_checks.py)."""

from __future__ import annotations

import random

import pytest
import torch

from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from tests.helpers.engine_checks import run_greedy
from tests.helpers.gemma_models import gemma3_config, gemma4_config
from tests.helpers.models import save_random_model


@pytest.fixture(scope="module", params=["gemma3", "gemma4-moe"])
def gemma64(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    config = gemma3_config() if request.param == "gemma3" else gemma4_config(moe=True)
    save_random_model(folder, config)
    return load_model(folder, dtype=torch.float64).model


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """8 requests of up to 96 tokens (windows of 16): a third share a 24-token prefix, a third repeat
    themselves (n-gram matches)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 320) for _ in range(24)]
    work = []
    for i in range(8):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(3, 40))]
        if i % 3 == 0:
            prompt = shared + prompt
        elif i % 3 == 1:
            prompt = (prompt[:3] * 16)[:rng.randrange(8, 41)]
        work.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(20, 41), ignore_eos=True)))
    return work


run = run_greedy


@pytest.fixture(scope="module")
def alone(gemma64):
    return [run(gemma64, [item], check=False, enable_prefix_caching=False)[0][0] for item in workload()]


def test_batched_with_prefix_caching_equals_alone(gemma64, alone):
    outputs, engine = run(gemma64, workload(), enable_prefix_caching=True)
    assert outputs == alone
    assert max(step.num_seqs for step in engine.step_history) > 4


@pytest.mark.parametrize("chunk", [7, 16, 17])
def test_chunked_prefill_across_the_window_edge_equals_alone(gemma64, alone, chunk):
    """Step budgets of 7 (chunks end inside windows), 16 (on their edges) and 17 (one past); one sequence
    decodes beside a prefill at most, so chunks keep that size (three requests: such steps are many)."""
    outputs, engine = run(gemma64, workload()[:3], max_num_batched_tokens=chunk, max_num_seqs=2,
                          enable_prefix_caching=False)
    assert outputs == alone[:3]
    assert max(step.num_tokens for step in engine.step_history) <= chunk


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_equal_alone(gemma64, alone, mode):
    outputs, engine = run(gemma64, workload(), num_kv_blocks=10, preemption_mode=mode, enable_prefix_caching=True)
    assert outputs == alone
    assert engine.num_preemptions >= 1


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculative_decoding_is_token_identical(gemma64, alone, drafter):
    outputs, engine = run(gemma64, workload(), spec_type=drafter, spec_tokens=4,
                          draft_model=gemma64 if drafter == "draft" else None)
    assert outputs == alone
    totals = engine.scheduler.speculation.totals
    assert totals.num_drafts > 0
    if drafter == "draft":  # the model drafting for itself: every drafted token kept
        assert totals.num_accepted_tokens == totals.num_draft_tokens > 0
