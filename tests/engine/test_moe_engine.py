"""The engine on a tiny Qwen3-MoE model (float64): batched with continuous batching, chunked prefill and
prefix caching, under pressure (preemption by recompute and by swap) and with speculative decoding (n-gram
and the model drafting for itself), every greedy request gives what it gives alone; each pressured run is
checked step by step (tests/helpers/engine_checks.py)."""

from __future__ import annotations

import random

import pytest
import torch

from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from tests.helpers.engine_checks import run_greedy


@pytest.fixture(scope="module")
def moe64(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen3-moe")
    model = load_model(folder, dtype=torch.float64).model
    assert model.config.moe is not None
    return model


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """10 requests of up to 80 tokens: a third share a 24-token prefix, a third repeat themselves (n-gram
    matches)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    work = []
    for i in range(10):
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 17))]
        if i % 3 == 0:
            prompt = shared + prompt
        elif i % 3 == 1:
            prompt = (prompt[:3] * 12)[:rng.randrange(8, 33)]
        work.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(12, 41), ignore_eos=True)))
    return work


run = run_greedy


@pytest.fixture(scope="module")
def alone(moe64):
    return [run(moe64, [item], check=False, enable_prefix_caching=False)[0][0] for item in workload()]


def test_batched_with_prefix_caching_equals_alone(moe64, alone):
    outputs, engine = run(moe64, workload(), enable_prefix_caching=True)
    assert outputs == alone
    assert engine.block_manager.prefix_hit_tokens > 0
    assert max(step.num_seqs for step in engine.step_history) > 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_equal_alone(moe64, alone, mode):
    outputs, engine = run(moe64, workload(), num_kv_blocks=8, preemption_mode=mode, enable_prefix_caching=True)
    assert outputs == alone
    assert engine.num_preemptions >= 1


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculative_decoding_is_token_identical(moe64, alone, drafter):
    outputs, engine = run(moe64, workload(), spec_type=drafter, spec_tokens=4,
                          draft_model=moe64 if drafter == "draft" else None)
    assert outputs == alone
    totals = engine.scheduler.speculation.totals
    assert totals.num_drafts > 0
    if drafter == "draft":  # the model drafting for itself: every drafted token kept
        assert totals.num_accepted_tokens == totals.num_draft_tokens > 0


@pytest.mark.gpu
def test_on_cuda_through_triton_and_the_fused_experts(tiny_model_dir):
    """On CUDA (float32): through the fused-MoE kernels, batched with decode steps captured as CUDA graphs,
    every greedy request gives what it gives alone."""
    folder, _ = tiny_model_dir("qwen3-moe")
    model = load_model(folder, dtype=torch.float32, device="cuda").model
    assert model.supports_cuda_graphs
    config = {"attention_backend": "triton", "max_model_len": 256}
    alone_on_cuda = [run(model, [item], check=False, enable_prefix_caching=False, **config)[0][0]
                     for item in workload()]
    outputs, engine = run(model, workload(), enable_prefix_caching=True, **config)
    assert outputs == alone_on_cuda
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.graphs
