"""Constrained decoding in the engine, one fixed example per rule.

Most run on a scripted model (tests/helpers/scripted.py: its greedy output is a script of token texts,
every other token at logit 0), so where the grammar forbids the script's next token the masked choice
is the one token the grammar allows, and the output shows exactly where the mask applied. Its tokenizer
cannot spell words out of smaller tokens, and text a grammar forces is allowed only as the tokenizer
spells it (llguidance's canonical tokens), so these grammars force single characters at most. The
others run on the tiny random model with a byte-level BPE vocabulary (tests/helpers/grammar_model.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.engine import LLMEngine
from localserve.engine.grammar import GrammarSpec
from localserve.engine.grammar_masks import GrammarMasks
from localserve.engine.sampling_params import SamplingParams
from localserve.engine.sequence import Request, ScheduledRow, Sequence
from localserve.engine.step import SeqChunk
from localserve.loading.hf import load_model
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.grammar_model import check_json, check_regex
from tests.helpers.scripted import EOS, write_scripted_model

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def scripted_engine(folder, pieces, **config) -> tuple[LLMEngine, list[int]]:
    script = write_scripted_model(folder, pieces)
    engine = build_engine(load_model(folder, dtype=torch.float32).model, Tokenizer.from_path(folder),
                          EngineConfig(num_kv_blocks=64, **config))
    return engine, script.prompt


def greedy(**fields) -> SamplingParams:
    """Greedy, bounded within the scripted model's context."""
    return SamplingParams(**({"temperature": 0, "max_tokens": 30} | fields))


def run(engine: LLMEngine, prompt: list[int], *params: SamplingParams) -> list:
    ids = [engine.add_request(prompt, p) for p in params]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[i] for i in ids]


def test_the_mask_applies_to_the_constrained_rows_only(tmp_path):
    engine, prompt = scripted_engine(tmp_path, ["Hello", " world", "!"])
    free, constrained, free_again = run(engine, prompt, greedy(),
                                        greedy(grammar=GrammarSpec.regex("(Hello|Bye)!")),
                                        greedy())
    assert free.text == free_again.text == "Hello world!"  # beside a constrained row, as the script says
    assert constrained.text == "Hello!" and constrained.outputs[0].finish_reason == "stop"
    assert {timing.num_rows for timing in engine.grammar_masks.timings} == {1}  # one row of three masked


def test_masks_are_added_to_their_own_logits_rows_and_no_others():
    from localserve.engine.constraints import GrammarCompiler
    from tests.helpers.tokenizers import CHATML_SPECIALS, train_bpe

    backend = train_bpe(CHATML_SPECIALS)
    vocab = backend.get_vocab_size()
    compiler = GrammarCompiler(backend, vocab, [2])
    constrained = SamplingParams(grammar=GrammarSpec.regex("x+"))

    def row(params: SamplingParams, needs_logits: bool = True) -> ScheduledRow:
        seq = Sequence(0, 1, [5], torch.Generator())
        seq.grammar = compiler.matcher(params)
        request = Request("r", 0, [5], params, [seq])
        return ScheduledRow(request, seq, 1, SeqChunk([5], 0, [0], needs_logits))

    masks = GrammarMasks(vocab, torch.device("cpu"))
    rows = [row(SamplingParams()), row(constrained, needs_logits=False), row(constrained), row(SamplingParams())]
    logits = torch.randn(3, vocab)  # the rows that need logits: 0, 2 and 3
    before = logits.clone()
    masks.start(rows).apply(logits)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert finite and all(set(backend.decode([t])) == {"x"} for t in finite)
    assert torch.equal(logits[1, finite], before[1, finite])  # allowed tokens keep their logits exactly
    assert masks.start(rows[:1] + rows[3:]) is None  # nothing constrained: nothing to do


@pytest.mark.gpu
def test_masks_on_cuda_logits_equal_the_cpu_ones():
    from localserve.engine.constraints import GrammarCompiler
    from tests.helpers.tokenizers import CHATML_SPECIALS, train_bpe

    backend = train_bpe(CHATML_SPECIALS)
    vocab = backend.get_vocab_size()
    compiler = GrammarCompiler(backend, vocab, [2])
    params = SamplingParams(grammar=GrammarSpec.json_object())
    seqs = [Sequence(i, 1, [5], torch.Generator()) for i in range(3)]
    rows = []
    for seq, constrained in zip(seqs, (True, False, True)):
        seq.grammar = compiler.matcher(params) if constrained else None
        rows.append(ScheduledRow(Request("r", 0, [5], params, [seq]), seq, 1, SeqChunk([5], 0, [0])))
    logits = torch.randn(3, vocab)
    on_cuda = logits.cuda()
    GrammarMasks(vocab, torch.device("cpu")).start(rows).apply(logits)
    GrammarMasks(vocab, torch.device("cuda")).start(rows).apply(on_cuda)  # pinned bias, copied without blocking
    assert torch.equal(on_cuda.cpu(), logits)


def test_end_of_sequence_only_where_the_grammar_accepts(tmp_path):
    engine, prompt = scripted_engine(tmp_path, ["a", "b"])  # then EOS
    free, not_yet, complete, accepting = run(
        engine, prompt, greedy(),
        greedy(grammar=GrammarSpec.regex("abab")),
        greedy(grammar=GrammarSpec.regex("ab")),
        greedy(grammar=GrammarSpec.regex("ab(ab)?")))
    assert free.text == "ab" and free.token_ids[-1] == EOS
    # After "ab" the script says EOS; "abab" is not complete there: the one token it allows is "a".
    assert not_yet.text == "abab" and not_yet.outputs[0].finish_reason == "stop"
    assert EOS not in not_yet.token_ids  # a complete grammar ends the sequence, no EOS sampled
    assert complete.text == "ab" and EOS not in complete.token_ids
    assert accepting.text == "ab" and accepting.token_ids[-1] == EOS  # complete, may go on: EOS allowed


def test_length_and_stop_strings_end_a_sequence_mid_grammar(tmp_path):
    engine, prompt = scripted_engine(tmp_path, ["a", "b"])
    grammar = GrammarSpec.regex("abababab")
    by_length, by_stop = run(engine, prompt, greedy(grammar=grammar, max_tokens=3),
                             greedy(grammar=grammar, stop=["bab"]))
    assert by_length.text == "aba" and by_length.outputs[0].finish_reason == "length"
    assert by_stop.text == "a" and len(by_stop.token_ids) == 4 and by_stop.outputs[0].finish_reason == "stop"


def test_a_lazy_grammar_constrains_from_its_trigger(tmp_path):
    pieces = ["Sure", " <tool_call>", "1", "2", ";", " done"]
    engine, prompt = scripted_engine(tmp_path, pieces)
    lazy = GrammarSpec.regex("[0-9]+;").lazy("<tool_call>")
    free, call, never = run(engine, prompt, greedy(), greedy(grammar=lazy),
                            greedy(grammar=GrammarSpec.regex("x").lazy("<never>")))
    assert free.text == "Sure <tool_call>12; done"
    # The trigger begins inside the token " <tool_call>"; the call is complete at ";".
    assert call.text == "Sure <tool_call>12;" and call.outputs[0].finish_reason == "stop"
    assert never.text == free.text and never.token_ids[-1] == EOS  # free text to the end


def test_the_grammar_starts_after_the_reasoning_block(tmp_path):
    pieces = ["Hmm", " maybe", "</think>", "\n", "x", "y", ".", " bye"]
    engine, prompt = scripted_engine(tmp_path, pieces)
    params = greedy(grammar=GrammarSpec.regex("[xy]+[.]"), reasoning_end="</think>")
    request_id = engine.add_request(prompt, params)
    reasoning = []
    while engine.has_unfinished_requests():
        snapshot = engine.snapshot()
        if snapshot.requests:
            reasoning.append(snapshot.requests[0].num_reasoning_seqs)
            assert snapshot.requests[0].constrained
        for output in engine.step():
            if output.finished:
                final = output
    assert final.request_id == request_id
    # "Hmm" and " maybe" do not match: inside the reasoning block nothing is constrained.
    assert final.text == "Hmm maybe</think>\nxy." and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].num_reasoning_tokens == 3  # the marker's token included
    assert reasoning[:4] == [1, 1, 1, 0]  # before each step: the marker is the third token


def test_reasoning_is_tracked_without_a_grammar(tmp_path):
    engine, prompt = scripted_engine(tmp_path, ["Let", " me", " think", "</th", "ink>", "Yes"])
    [output] = run(engine, prompt, greedy(reasoning_end="</think>"))
    assert output.text == "Let me think</think>Yes" and output.outputs[0].num_reasoning_tokens == 5


def test_parallel_samples_each_follow_the_grammar_with_their_own_matcher(grammar_model):
    model, tokenizer = grammar_model
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    pattern = "[ab]{3}c[ab]{3}"
    [output] = run(engine, tokenizer.encode("hello"),
                   SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=20, grammar=GrammarSpec.regex(pattern)))
    texts = [o.text for o in output.outputs]
    for text in texts:
        check_regex(text, pattern)
    assert len(set(texts)) > 1  # sampled apart: one matcher each, not one shared


def test_penalties_and_filters_work_on_the_masked_logits(grammar_model):
    model, tokenizer = grammar_model
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=64))
    pattern = "[a-z]{2,5}( [a-z]{2,5}){1,3}[.]"
    grammar = GrammarSpec.regex(pattern)
    prompt = tokenizer.encode("words")
    greedy_output, top_1, penalized = run(
        engine, prompt, SamplingParams(temperature=0, max_tokens=30, grammar=grammar),
        SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=30, grammar=grammar),
        SamplingParams(temperature=1.0, top_p=0.5, seed=3, repetition_penalty=1.5, presence_penalty=1.0,
                       max_tokens=30, grammar=grammar))
    # top-k = 1 of the masked logits is the best allowed token: the greedy answer (not the best of all,
    # which the grammar may forbid, leaving no token at all)
    assert top_1.token_ids == greedy_output.token_ids
    for output in (greedy_output, top_1, penalized):
        assert output.outputs[0].finish_reason == "stop"
        check_regex(output.text, pattern)


def test_beams_with_a_grammar_are_refused():
    with pytest.raises(ValueError, match="SamplingParams.grammar is not supported with beam_search"):
        SamplingParams(n=2, beam_search=True, grammar=GrammarSpec.regex("a"))


def test_a_grammar_that_does_not_compile_is_refused_by_validate(grammar_model):
    model, tokenizer = grammar_model
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=16))
    params = SamplingParams(grammar=GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": 3}}}))
    with pytest.raises(ValueError, match="the json_schema grammar does not compile"):
        engine.validate([1, 5], params)
    with pytest.raises(ValueError, match="the json_schema grammar does not compile"):
        engine.add_request([1, 5], params)
    assert not engine.requests and engine.events.since(0)[0][-1].kind.value == "rejected"
    untokenized = build_engine(model, None, EngineConfig(num_kv_blocks=16))
    with pytest.raises(ValueError, match="a grammar needs the model's tokenizer"):
        untokenized.validate([1, 5], SamplingParams(grammar=GrammarSpec.regex("a")))
    with pytest.raises(ValueError, match="a reasoning marker needs a tokenizer"):
        untokenized.validate([1, 5], SamplingParams(reasoning_end="</think>"))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_matcher_follows_its_sequence_through_preemption(grammar_model, mode):
    model, tokenizer = grammar_model
    prompts = [tokenizer.encode(f"{i}: JSON") for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, grammar=GrammarSpec.json_schema(SCHEMA))
    alone = [run(build_engine(model, tokenizer, EngineConfig(num_kv_blocks=64)), prompt, params)[0].token_ids
             for prompt in prompts]
    engine = build_engine(model, tokenizer, EngineConfig(num_kv_blocks=10, num_cpu_blocks=16, preemption_mode=mode,
                                                         max_num_batched_tokens=16, block_size=4))
    together = run_each(engine, prompts, params)
    assert engine.num_preemptions > 0 and engine.scheduler.preemption.num_preemptions_by_mode[mode] > 0
    assert [o.token_ids for o in together] == alone
    for output in together:
        if output.outputs[0].finish_reason == "stop":
            check_json(output.text, SCHEMA)


def run_each(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    return [final[i] for i in ids]


def test_mask_timings_are_kept_per_step(tmp_path):
    engine, prompt = scripted_engine(tmp_path, ["a", "b"])
    run(engine, prompt, greedy(grammar=GrammarSpec.regex("abab")))
    timings = list(engine.grammar_masks.timings)
    assert len(timings) == 4 and all(t.num_rows == 1 for t in timings)
    assert all(t.fill_s > 0 and t.apply_s > 0 and t.wait_s >= 0 and math.isfinite(t.fill_s) for t in timings)
