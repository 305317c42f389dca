"""Speculative decoding's rules, one fixed example each, on the tiny float64 model with drafters whose
drafts are known: stops and limits inside an accepted draft, log-probabilities of accepted tokens, the
block manager keeping only accepted tokens, K falling to no draft when drafts keep failing, the n-gram
drafter's lookups, the constraint seam, and the settings refused."""

from __future__ import annotations

import time

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.ngram_drafter import NgramDrafter
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.sequence import Sequence
from localserve.engine.speculation import Draft, DraftQuery, constrain_draft
from tests.helpers.engine_checks import StepChecker
from tests.helpers.spec_costs import FixedStepCost

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class ScriptedDrafter:
    """Drafts what `continuation(tokens)` gives (a function of the sequence's tokens); counts its queries."""

    def __init__(self, continuation) -> None:
        self.continuation = continuation
        self.queries: list[DraftQuery] = []

    def propose(self, queries):
        self.queries += queries
        return [Draft(self.continuation(list(q.token_ids))[:q.max_tokens]) for q in queries]

    def release(self, seq_id):
        pass


def engine_with(model, drafter, per_token_share: float = 1e-6, **config):
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, check_integrity=True, spec_type="ngram",
                                                    spec_tokens=6, **config))
    engine.scheduler.speculation.drafter = drafter
    engine.scheduler.speculation.cost = FixedStepCost(per_token_share, step_s=1.0)
    return engine


def run(engine, prompt, params):
    checker = StepChecker(engine)
    request_id = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output if output.request_id == request_id else final
        checker.after_step()
    assert engine.is_idle_and_clean()
    return final


def plain(model, prompt, params):
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64))
    request_id = engine.add_request(prompt, params)
    return engine.run_to_completion()[request_id]


@pytest.fixture(scope="module")
def continuation(tiny64):
    """The greedy continuation of PROMPT (60 tokens): a drafter that knows it drafts what the target says."""
    tokens = list(plain(tiny64, PROMPT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)).token_ids)
    return lambda sequence: tokens[len(sequence) - len(PROMPT):]


def test_a_stop_token_inside_an_accepted_draft_ends_the_output_there(tiny64, continuation):
    stop = continuation(PROMPT)[9]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    expected = plain(tiny64, PROMPT, params)
    drafter = ScriptedDrafter(continuation)
    engine = engine_with(tiny64, drafter)
    got = run(engine, PROMPT, params)
    assert list(got.token_ids) == list(expected.token_ids) and got.token_ids[-1] == stop
    assert got.outputs[0].finish_reason == "stop"
    totals = engine.scheduler.speculation.totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > len(got.token_ids) - 1 - totals.num_drafts


def test_max_tokens_is_never_exceeded_and_the_last_draft_is_cut_to_fit(tiny64, continuation):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    drafter = ScriptedDrafter(continuation)
    got = run(engine_with(tiny64, drafter), PROMPT, params)
    assert list(got.token_ids) == continuation(PROMPT)[:10] and got.outputs[0].finish_reason == "length"
    # 1 (prefill) + 7 (6 drafted + 1) = 8; then 2 left: at most 1 drafted, never past max_tokens.
    assert [q.max_tokens for q in drafter.queries] == [6, 1]


def test_logprobs_of_accepted_tokens_are_the_ones_decoding_one_by_one_gives(tiny64, continuation):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3, repetition_penalty=1.2)
    expected = plain(tiny64, PROMPT, params)
    got = run(engine_with(tiny64, ScriptedDrafter(lambda tokens: continuation(tokens))), PROMPT, params)
    assert list(got.token_ids) == list(expected.token_ids)
    assert got.outputs[0].logprobs == pytest.approx(expected.outputs[0].logprobs, abs=1e-12)
    assert [[t for t, _ in top] for top in got.outputs[0].top_logprobs] == \
        [[t for t, _ in top] for top in expected.outputs[0].top_logprobs]


def test_a_rejected_draft_leaves_only_the_accepted_tokens_in_the_block_manager(tiny64, continuation):
    truth = continuation(PROMPT)
    # Two right tokens, then wrong ones: the verify row keeps 2 + the target's own.
    drafter = ScriptedDrafter(lambda tokens: continuation(tokens)[:2] + [1, 1, 1, 1])
    engine = engine_with(tiny64, drafter, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=3 + 8, ignore_eos=True)
    request_id = engine.add_request(PROMPT, params)
    engine.step()  # the prompt: the first token
    engine.step()  # the verify row: 1 + 6 tokens, 3 kept
    seq = engine.requests[request_id].seqs[0]
    assert seq.output_token_ids == truth[:4]
    bm = engine.block_manager
    assert bm.num_tokens(seq.seq_id) == bm.num_computed_tokens(seq.seq_id) == len(PROMPT) + 3
    assert len(bm.block_table(seq.seq_id)) == 1 and seq.num_computed_tokens == len(PROMPT) + 3
    engine.run_to_completion()
    assert engine.is_idle_and_clean()


def test_drafts_that_keep_failing_stop_and_plain_decoding_goes_on(tiny64):
    drafter = ScriptedDrafter(lambda tokens: [1, 1, 1, 1, 1, 1])  # never what the target says
    engine = engine_with(tiny64, drafter, per_token_share=0.05)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    drafted = []
    for _ in range(150):
        before = engine.scheduler.speculation.totals.num_draft_tokens
        engine.step()
        drafted.append(engine.scheduler.speculation.totals.num_draft_tokens - before)
    assert sum(drafted[:10]) >= 10  # it tries first (an acceptance of 1/2 is assumed)
    assert sum(drafted[-100:]) <= 8  # then hardly at all: an occasional probe of one token
    assert max(drafted[-100:]) <= 1


def test_a_batch_whose_step_costs_a_token_per_token_drafts_nothing(tiny64, continuation):
    drafter = ScriptedDrafter(continuation)
    engine = engine_with(tiny64, drafter, per_token_share=0.5)  # a drafted token costs half a step
    for _ in range(4):
        engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.run_to_completion()
    assert engine.scheduler.speculation.totals.num_drafts == 0  # its worth (<= 1) never pays 4 x 0.5


class FitAboveMeasured(FixedStepCost):
    """The fit puts a decode step at 1 s, measured decode-only steps at `measured_s` (seen at batch 8 on the
    dev CPU: the fit of steps that nearly all carried a prefill chunk overestimated the decodes)."""

    def __init__(self, per_draft_token_s: float, measured_s: float) -> None:
        super().__init__(per_draft_token_s, step_s=1.0)
        self.measured_s = measured_s

    def estimate_decodes(self, shape) -> float:
        return min(self.step_s, self.measured_s)


@pytest.mark.parametrize("measured_s, drafts", [(1.0, True), (0.2, False)])
def test_a_drafted_token_is_priced_against_the_measured_decode_step(tiny64, continuation, measured_s, drafts):
    # First draft: acceptance 1/2 assumed, a token costs 0.15 s: worth it beside a 1 s step, not a 0.2 s one.
    engine = engine_with(tiny64, ScriptedDrafter(continuation))
    engine.scheduler.speculation.cost = FitAboveMeasured(0.15, measured_s)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt
    engine.step()  # the first decode: drafted for, or not
    assert (engine.scheduler.speculation.totals.num_drafts > 0) is drafts


def test_the_ngram_drafter_drafts_what_followed_the_latest_longest_match():
    drafter = NgramDrafter()
    params = SamplingParams()
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 8, 1, 2, 3]
    # the suffix 1 2 3 occurred at the start; 2 3 alone last before 4 5 6: the longest match wins
    [draft] = drafter.propose([DraftQuery(0, tokens, 3, 3, params)])
    assert draft.token_ids == [9, 9, 7]
    [draft] = drafter.propose([DraftQuery(1, [4, 5, 0, 4, 5, 1, 4, 5], 1, 4, params)])
    assert draft.token_ids == [1, 4, 5]  # the latest occurrence of 4 5, up to the sequence's end
    [draft] = drafter.propose([DraftQuery(2, [1, 2, 3, 4], 1, 4, params)])
    assert draft.token_ids == []  # nothing repeats
    # the index grows with the sequence: the same sequence, longer, finds its new match
    [draft] = drafter.propose([DraftQuery(2, [1, 2, 3, 4, 1, 2], 1, 2, params)])
    assert draft.token_ids == [3, 4]


def test_a_sequence_without_a_grammar_keeps_its_draft_unchanged():
    draft = Draft([4, 5, 6])
    assert constrain_draft(Sequence(0, 1, [3], torch.Generator()), draft) is draft  # grammars: test_speculative_grammar


@pytest.mark.parametrize("settings, message", [
    ({"spec_type": "medusa"}, "spec_type"), ({"spec_tokens": 0}, "spec_tokens"),
    ({"max_step_ms": 0}, "max_step_ms"), ({"max_step_ms": "fast"}, "max_step_ms")])
def test_bad_speculation_and_step_budget_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_a_draft_model_is_required_for_spec_type_draft(tiny64):
    with pytest.raises(ValueError, match="needs a draft model"):
        build_engine(tiny64, None, EngineConfig(num_kv_blocks=8, spec_type="draft"))


def test_the_draft_model_runs_between_the_schedule_and_the_target_and_its_time_is_left_out_of_the_step_cost(
        tiny64, continuation):
    """The scheduler decides, the engine computes: each drafting step is schedule() (no forward pass in it),
    the draft model's forward passes, add_drafts, then the target's one; the cost model learns the step's
    time without the drafter's (which it learns apart, per drafted token)."""
    engine = build_engine(tiny64, None, EngineConfig(num_kv_blocks=64, check_integrity=True, spec_type="draft",
                                                     spec_tokens=4), draft_model=tiny64)
    speculation = engine.scheduler.speculation
    speculation.cost = FixedStepCost(step_s=1.0)
    calls: list[str] = []
    draft_s = [0.0]
    observed: list[float] = []

    def traced(name, fn, timed=None):
        def call(*args):
            calls.append(name)
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                calls.append(f"/{name}")
                if timed is not None:
                    timed[0] += time.perf_counter() - start
        return call

    scheduler, draft_runner = engine.scheduler, speculation.drafter.runner
    scheduler.schedule = traced("schedule", scheduler.schedule)
    scheduler.add_drafts = traced("add_drafts", scheduler.add_drafts)
    draft_runner.execute = traced("draft", draft_runner.execute, draft_s)
    engine.runner.execute = traced("target", engine.runner.execute)
    observe = scheduler.observe_step
    scheduler.observe_step = lambda batch, duration_s: (observed.append(duration_s), observe(batch, duration_s))
    request_id = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=20))
    while engine.has_unfinished_requests():
        calls.clear()
        draft_s[0] = 0.0
        final = engine.step()
        steps = [call for call in calls if not call.startswith("/")]
        if "draft" in steps:
            assert calls[:2] == ["schedule", "/schedule"], calls  # nothing ran inside the schedule
            assert steps[1:] == ["draft"] * (len(steps) - 3) + ["add_drafts", "target"], steps
            assert observed[-1] <= engine.step_history[-1].duration_s - draft_s[0]
        else:
            assert steps == ["schedule", "target"], steps
    assert final[0].request_id == request_id and list(final[0].token_ids) == continuation(PROMPT)[:20]
    assert speculation.totals.num_drafts > 0 and speculation.drafter_s_per_token > 0
