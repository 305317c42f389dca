"""The engine on a tiny gpt-oss model (float64; windows of 16, random sinks): prompts and generations several
windows long give transformers' greedy tokens alone, and the same batched with prefix caching, with prefill
chunks that end inside windows and across their edges, under pressure (preemption by recompute and by swap)
and with speculative decoding (n-gram, and the model drafting for itself); each batched run is checked step
by step (tests/helpers/engine_checks.py)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from tests.helpers.engine_checks import run_greedy, run_requests
from tests.helpers.gpt_oss_models import WINDOW, save_gpt_oss, tiny_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss")
    save_gpt_oss(folder, tiny_config(), seed=5, tokenizer=False)
    return folder


@pytest.fixture(scope="module")
def model64(saved):
    return load_model(saved, dtype=torch.float64).model


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """8 requests, prompts of 1 to 4.5 windows and 2 to 4 windows generated: a third share a 40-token prefix
    (longer than a window), a third repeat themselves (n-gram matches)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    work = []
    for i in range(8):
        prompt = [rng.randrange(3, 320) for _ in range(rng.randrange(WINDOW, 3 * WINDOW))]
        if i % 3 == 0:
            prompt = shared + prompt[:rng.randrange(1, WINDOW)]
        elif i % 3 == 1:
            prompt = (prompt[:5] * 20)[:rng.randrange(WINDOW, 4 * WINDOW)]
        max_tokens = rng.randrange(2 * WINDOW, 4 * WINDOW)
        work.append((prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    return work


run = functools.partial(run_greedy, num_kv_blocks=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def alone(model64):
    return [run(model64, [item], check=False, enable_prefix_caching=False)[0][0] for item in workload()]


def test_alone_gives_transformers_greedy_tokens(saved, alone):
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64,
                                                                 experts_implementation="eager").eval()
    for (prompt, params), tokens in zip(workload(), alone):
        with torch.no_grad():  # whole forward passes: the definition (see tests/models/test_gpt_oss.py)
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False,
                                         eos_token_id=None, pad_token_id=0, use_cache=False)[0, len(prompt):]
        assert list(tokens) == expected.tolist()


def test_batched_with_prefix_caching_equals_alone(model64, alone):
    """The window layers keep their KV in a pool of their own (kv/layer_groups.py), which the integrity
    check, run after every step, holds to the window's blocks per sequence."""
    outputs, engine = run(model64, workload(), enable_prefix_caching=True)
    assert [usage.sliding_window for usage in engine.block_manager.group_usage()] == [None, WINDOW]
    assert outputs == alone
    assert engine.block_manager.prefix_hit_tokens > 0
    assert max(step.num_seqs for step in engine.step_history) > 4


@pytest.mark.parametrize("budget", [7, WINDOW + 5])
def test_chunked_prefill_across_window_edges_equals_alone(model64, alone, budget):
    """Budgets of 7 and 21 tokens: prefill chunks start and end inside windows and span their edges."""
    outputs, engine = run(model64, workload(), max_num_batched_tokens=budget, max_num_seqs=4,
                          enable_prefix_caching=False)
    assert outputs == alone
    assert any(0 < step.num_prefill_tokens < WINDOW for step in engine.step_history)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_equal_alone(model64, alone, mode):
    outputs, engine = run(model64, workload(), num_kv_blocks=14, preemption_mode=mode, enable_prefix_caching=True)
    assert outputs == alone
    assert engine.num_preemptions >= 1


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_speculative_decoding_is_token_identical(model64, alone, drafter):
    outputs, engine = run(model64, workload(), spec_type=drafter, spec_tokens=4,
                          draft_model=model64 if drafter == "draft" else None)
    assert outputs == alone
    totals = engine.scheduler.speculation.totals
    assert totals.num_drafts > 0
    if drafter == "draft":  # the model drafting for itself: every drafted token kept
        assert totals.num_accepted_tokens == totals.num_draft_tokens > 0


def test_triton_attention_gives_the_torch_backends_tokens(saved):
    """The Triton kernels (in Triton's interpreter here) with windows and sinks: three requests several
    windows long, chunked (budget 24), the same greedy tokens as the torch backend (float32)."""
    from localserve.attention.triton_backend import TritonAttentionBackend

    model = load_model(saved, dtype=torch.float32).model
    work = [(prompt[:3 * WINDOW], SamplingParams(temperature=0, max_tokens=WINDOW + 4, ignore_eos=True))
            for prompt, _ in workload(seed=1)[:3]]

    def tokens(backend):
        engine = build_engine(model, None, EngineConfig(num_kv_blocks=32, max_num_seqs=3, max_num_batched_tokens=24,
                                                        attention_backend="torch", check_integrity=True))
        if backend is not None:
            engine.runner.backend = backend  # the interpreter's kernels, which "auto" never picks
        return [output.outputs[0].token_ids for output in run_requests(engine, work, check=False)]

    assert tokens(TritonAttentionBackend()) == tokens(None)
