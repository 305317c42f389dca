"""Speculative decoding with grammars: each drafted token is checked against the mask of its place.

A draft is cut at the first token its sequence's grammar forbids (`constrain_draft`); a verify row gets
one mask per place, the matcher walked through the draft to make them and rolled back, so it is advanced
only by the tokens the verification keeps. Fixed examples of both, then constrained and free requests
mixed on the tiny model with a byte-level BPE vocabulary (tests/helpers/grammar_model.py): every
constrained output is accepted by its grammar, and greedy outputs equal the same requests without
speculation. The draft model is the target itself unconstrained: its drafts are what the target writes
without the grammar, so they keep proposing tokens the grammar forbids.
"""

from __future__ import annotations

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.constraints import GrammarCompiler
from localserve.engine.grammar import GrammarSpec
from localserve.engine.grammar_masks import GrammarMasks
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.sequence import Request, ScheduledRow, Sequence
from localserve.engine.speculation import Draft, constrain_draft
from localserve.engine.step import SeqChunk
from tests.helpers.grammar_model import check_json, check_regex
from tests.helpers.spec_costs import FixedStepCost

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}
WORDS = "[a-z]{1,6}( [a-z]{1,6}){0,3}[.!]"
GRAMMARS = {"json": (GrammarSpec.json_schema(SCHEMA), lambda text: check_json(text, SCHEMA)),
            "regex": (GrammarSpec.regex(WORDS), lambda text: check_regex(text, WORDS)),
            "free": (None, None)}


@pytest.fixture(scope="module")
def compiler(grammar_model):
    _, tokenizer = grammar_model
    return GrammarCompiler(tokenizer.backend, 448, [2])


def constrained_seq(compiler, pattern: str, token_ids: list[int]) -> Sequence:
    seq = Sequence(0, len(token_ids), list(token_ids), torch.Generator())
    seq.grammar = compiler.matcher(SamplingParams(grammar=GrammarSpec.regex(pattern)))
    return seq


def test_a_draft_is_cut_at_the_first_token_the_grammar_forbids(grammar_model, compiler):
    _, tokenizer = grammar_model
    a, b, c, x = (tokenizer.encode(text)[0] for text in "abcx")
    seq = constrained_seq(compiler, "ab{2}c", [5])
    assert constrain_draft(seq, Draft([a, b, b, c])).token_ids == [a, b, b, c]
    assert constrain_draft(seq, Draft([a, x, b])).token_ids == [a]  # a point mass on x: x would surely fail
    assert constrain_draft(seq, Draft([x, a])).token_ids == []
    assert constrain_draft(seq, Draft([a, b, b, c, a])).token_ids == [a, b, b, c]  # nothing after the grammar's end
    # A draft model's sampled draft keeps its forbidden token, to be rejected by the rule whose residual
    # keeps the target's distribution; nothing after it.
    probs = torch.rand(3, 448)
    cut = constrain_draft(seq, Draft([a, x, b], probs))
    assert cut.token_ids == [a, x] and torch.equal(cut.probs, probs[:2])
    assert seq.grammar.matcher.validate_tokens([a, b, b, c]) == 4  # checking consumed nothing


def mask_of(compiler, pattern: str, consumed: list[int]) -> torch.Tensor:
    """The bias a fresh matcher of `pattern` gives after `consumed` (a plain decode row's mask)."""
    seq = constrained_seq(compiler, pattern, [5])
    assert seq.grammar.matcher.consume_tokens(consumed) if consumed else True
    row = ScheduledRow(Request("r", 0, [5], SamplingParams(), [seq]), seq, 1, SeqChunk([5], 0, [0]))
    logits = torch.zeros(1, 448)
    GrammarMasks(448, torch.device("cpu")).start([row]).apply(logits)
    return logits[0]


def test_a_verify_row_gets_the_mask_of_each_place_and_the_matcher_is_rolled_back(grammar_model, compiler):
    _, tokenizer = grammar_model
    a, b, x = (tokenizer.encode(text)[0] for text in "abx")
    pattern = "ab{2}c"
    verified = constrained_seq(compiler, pattern, [5, a, b])  # drafted [a, b]; then a forbidden token kept
    free = Sequence(1, 1, [5], torch.Generator())
    after = constrained_seq(compiler, "x+", [5])  # a decode row after the verify row

    def row(seq: Sequence, tokens: list[int], num_draft: int) -> ScheduledRow:
        request = Request("r", 0, [5], SamplingParams(), [seq])
        return ScheduledRow(request, seq, len(tokens), SeqChunk(tokens, 0, [0], num_draft_tokens=num_draft),
                            num_draft_tokens=num_draft)

    rows = [row(free, [5, a, x], 2), row(verified, [5, a, b, x], 3), row(after, [5], 0)]
    logits = torch.zeros(3 + 4 + 1, 448)  # the free verify row's 3 rows, the constrained one's 4, the decode's 1
    GrammarMasks(448, torch.device("cpu")).start(rows).apply(logits)
    assert torch.equal(logits[:3], torch.zeros(3, 448))
    assert torch.equal(logits[3], mask_of(compiler, pattern, []))
    assert torch.equal(logits[4], mask_of(compiler, pattern, [a]))
    assert torch.equal(logits[5], mask_of(compiler, pattern, [a, b]))
    assert torch.isinf(logits[6]).any()  # after the forbidden x: never read (x is rejected at place 2)
    assert torch.equal(logits[7], mask_of(compiler, "x+", []))
    assert verified.grammar.matcher.validate_tokens([a, b, b]) == 3  # back where it was: nothing consumed


def requests(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    # Texts the grammars write in part, so that n-gram drafts find matches in the prompt.
    prompts = [tokenizer.encode(text) for text in ('{"n": 12, "ok": true}, {"n": 7, "ok": false}, {"n": 3, "ok": ',
                                                   "abc abc abc. xyz abc hello world! abc", "hello world",
                                                   '[1, 2], {"ok": true}, {"n": 12')]
    mixed = []
    for index, prompt in enumerate(prompts):
        for grammar, _ in GRAMMARS.values():
            mixed.append((prompt, SamplingParams(temperature=0, max_tokens=16 + index, grammar=grammar,
                                                 logprobs=1 if index == 1 else None)))
            mixed.append((prompt, SamplingParams(temperature=1.0, seed=index, n=2, max_tokens=12, grammar=grammar)))
    return mixed


def run_all(model, tokenizer, mixed, **config) -> tuple[list, object]:
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=256, max_num_seqs=32, **config),
                          draft_model=model if config.get("spec_type") == "draft" else None)
    if engine.scheduler.speculation is not None:
        engine.scheduler.speculation.cost = FixedStepCost()
    ids = [engine.add_request(prompt, params) for prompt, params in mixed]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[request_id] for request_id in ids], engine


@pytest.fixture(scope="module")
def reference(grammar_model):
    outputs, _ = run_all(*grammar_model, requests(grammar_model[1]))
    return outputs


@pytest.mark.parametrize("spec_type", ["ngram", "draft"])
def test_constrained_and_free_requests_with_speculation(grammar_model, reference, spec_type):
    mixed = requests(grammar_model[1])
    outputs, engine = run_all(*grammar_model, mixed, spec_type=spec_type, spec_tokens=4)
    totals = engine.scheduler.speculation.totals
    assert totals.num_drafts > (10 if spec_type == "ngram" else 50)
    assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    for (_, params), output, expected in zip(mixed, outputs, reference, strict=True):
        assert output.error is None
        check = next(check for grammar, check in GRAMMARS.values() if grammar == params.grammar)
        for sample in output.outputs:
            if check is not None and sample.finish_reason == "stop":
                check(sample.text)
        if params.greedy:
            assert [o.token_ids for o in output.outputs] == [o.token_ids for o in expected.outputs]
            for got, want in zip(output.outputs, expected.outputs):
                assert got.logprobs == pytest.approx(want.logprobs, abs=1e-9)
