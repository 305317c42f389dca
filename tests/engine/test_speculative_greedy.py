"""Speculative decoding keeps greedy output token for token: 100 generated requests, both drafters.

The requests (a seeded generator) mix prompt lengths, prompts sharing prefixes (prefix-cache hits) and
repeating themselves (n-gram matches), max_tokens 1-40, stop tokens, stop strings, the end-of-sequence
token, penalties, log-probabilities and n = 2 samples; they run in a pool small enough to preempt, by
recompute and by swap, every step checked (tests/helpers/engine_checks.py: budget, states, block moves
replayed on a model of the pool, integrity). Each output must equal the same request's output without
speculation in a roomy pool. The drafters: prompt lookup (n-gram); the target model itself as draft
model (every draft accepted: stops and limits inside a draft); another random model of the same
vocabulary (most drafts rejected). So that every length of draft occurs, whatever the machine's speed,
the runs draft as if drafted tokens cost nothing (`FixedStepCost`), each draft cut to a random length.
"""

from __future__ import annotations

import random

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.speculation import Draft, Drafter, DraftQuery
from localserve.loading.hf import load_model
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.engine_checks import run_requests
from tests.helpers.models import write_tiny_model
from tests.helpers.spec_costs import FixedStepCost

NUM_REQUESTS = 100


@pytest.fixture(scope="module")
def target(tiny_chat_model_dir):
    return load_model(tiny_chat_model_dir, dtype=torch.float64).model, Tokenizer.from_path(tiny_chat_model_dir)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    folder = tmp_path_factory.mktemp("draft")
    write_tiny_model(folder, "llama", seed=1, num_layers=1)
    return load_model(folder, dtype=torch.float64).model


class RandomlyCut:
    """The drafter's drafts, each cut to a random length (seeded): drafts of every length up to K."""

    def __init__(self, drafter: Drafter, seed: int) -> None:
        self.drafter = drafter
        self.rng = random.Random(seed)

    def propose(self, queries: list[DraftQuery]) -> list[Draft]:
        drafts = self.drafter.propose(queries)
        for draft in drafts:
            del draft.token_ids[self.rng.randint(0, len(draft.token_ids)):]
            if draft.probs is not None:
                draft.probs = draft.probs[:len(draft.token_ids)]
        return drafts

    def release(self, seq_id: int) -> None:
        self.drafter.release(seq_id)


def generated_requests(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 256) for _ in range(48)] for _ in range(3)]
    requests = []
    for _ in range(NUM_REQUESTS):
        kind = rng.random()
        if kind < 0.3:  # shares a prefix with others: a prefix hit once those blocks are cached
            prompt = rng.choice(bases)[:rng.randint(17, 48)]
            prompt += [rng.randrange(3, 256) for _ in range(rng.randint(0, 5))]
        elif kind < 0.6:  # repeats itself: n-gram drafts find matches
            piece = [rng.randrange(3, 256) for _ in range(rng.randint(2, 6))]
            prompt = (piece * 12)[:rng.randint(8, 60)]
        else:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 50))]
        options = {}
        if rng.random() < 0.2:
            options["stop_token_ids"] = [rng.randrange(3, 256) for _ in range(8)]
        if rng.random() < 0.2:
            options["stop"] = [f"w{rng.randrange(0, 200)}" for _ in range(6)]
        if rng.random() < 0.15:
            options["repetition_penalty"] = 1.3
        if rng.random() < 0.1:
            options["presence_penalty"] = 0.5
        if rng.random() < 0.2:
            options["logprobs"] = 2
        max_tokens = rng.choice([rng.randint(1, 16), rng.randint(17, 64)])
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.7,
                                n=rng.choice([1] * 8 + [2, 4]), **options)
        requests.append((prompt, params))
    return requests


def run_all(model, tokenizer, requests, *, check: bool, draft_model=None, **config) -> dict:
    engine = build_engine(model, tokenizer, EngineConfig(check_integrity=check, **config), draft_model=draft_model)
    speculation = engine.scheduler.speculation
    if speculation is not None:
        speculation.cost = FixedStepCost()
        speculation.drafter = RandomlyCut(speculation.drafter, seed=len(requests))
    return run_requests(engine, requests, check), engine


@pytest.fixture(scope="module")
def reference(target):
    outputs, _ = run_all(*target, generated_requests(), check=False, num_kv_blocks=1024, max_num_seqs=8)
    return outputs


@pytest.mark.parametrize("drafter, mode", [("ngram", "recompute"), ("draft: the target itself", "swap"),
                                           ("draft: another model", "swap")])
def test_greedy_output_is_the_same_with_speculation(target, other_draft, reference, drafter, mode):
    model, _ = target
    draft_model = {"ngram": None, "draft: the target itself": model, "draft: another model": other_draft}[drafter]
    outputs, engine = run_all(*target, generated_requests(), check=True, draft_model=draft_model,
                              spec_type=drafter.split(":")[0], spec_tokens=5, num_kv_blocks=16, num_cpu_blocks=12,
                              max_num_seqs=16, max_num_batched_tokens=64, preemption_mode=mode)
    totals = engine.scheduler.speculation.totals
    assert engine.num_preemptions > 0 and totals.num_drafts > (10 if drafter == "ngram" else 100)
    if drafter == "draft: the target itself":
        assert totals.num_accepted_tokens == totals.num_draft_tokens  # every drafted token is the target's own
    assert engine.block_manager.prefix_hit_tokens > 0
    for output, expected in zip(outputs, reference, strict=True):
        assert [list(o.token_ids) for o in output.outputs] == [list(o.token_ids) for o in expected.outputs], \
            output.request_id
        assert [o.text for o in output.outputs] == [o.text for o in expected.outputs]
        assert [o.finish_reason for o in output.outputs] == [o.finish_reason for o in expected.outputs]
        for got, want in zip(output.outputs, expected.outputs):
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-9)
            assert [[t for t, _ in top] for top in got.top_logprobs] == \
                [[t for t, _ in top] for top in want.top_logprobs]


@pytest.mark.gpu
@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_greedy_output_is_the_same_with_speculation_on_cuda_through_triton(tiny_chat_model_dir, drafter):
    """Verify rows (queries of K + 1 tokens) through the Triton kernels give the tokens decoding one by one does."""
    model = load_model(tiny_chat_model_dir, dtype=torch.float32, device="cuda").model
    tokenizer = Tokenizer.from_path(tiny_chat_model_dir)
    requests = generated_requests()[:40]
    config = dict(num_kv_blocks=24, num_cpu_blocks=12, max_num_seqs=16, max_num_batched_tokens=64,
                  preemption_mode="swap", attention_backend="triton")
    expected, _ = run_all(model, tokenizer, requests, check=False, **config)
    outputs, engine = run_all(model, tokenizer, requests, check=True, draft_model=model if drafter == "draft" else None,
                              spec_type=drafter, spec_tokens=5, **config)
    assert engine.scheduler.speculation.totals.num_drafts > 10
    for output, want in zip(outputs, expected, strict=True):
        assert [list(o.token_ids) for o in output.outputs] == [list(o.token_ids) for o in want.outputs]
