"""Grammars compiled for a model's tokenizer and one matcher per sequence (engine/constraints.py): what each
rule allows next, read off llguidance's mask, on a byte-level BPE vocabulary (tests/helpers/grammar_model.py)."""

from __future__ import annotations

import numpy as np
import pytest

from localserve.engine.constraints import GrammarCompiler, GrammarRejected, SequenceGrammar
from localserve.engine.grammar import GrammarSpec
from localserve.engine.sampling_params import SamplingParams
from localserve.tokenizer.tokenizer import Tokenizer
from tests.helpers.grammar_model import EOS, MODEL_VOCAB

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(grammar_model_dir) -> Tokenizer:
    return Tokenizer.from_path(grammar_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.backend, MODEL_VOCAB, [EOS])


def allowed(grammar: SequenceGrammar) -> set[int]:
    """The ids the matcher allows next."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bits = allocate_token_bitmask(1, MODEL_VOCAB)
    fill_next_token_bitmask(grammar.matcher, bits)
    return set(np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:MODEL_VOCAB]).tolist())


def feed(grammar: SequenceGrammar, tokenizer: Tokenizer, *pieces: str | int) -> bool:
    """Advance through each piece: a text (its ordinary tokens) or one token id; returns the last advance."""
    done = False
    for piece in pieces:
        for token in [piece] if isinstance(piece, int) else tokenizer.encode(piece, add_special_tokens=False):
            done = grammar.advance(token)
    return done


def text_ids(tokenizer: Tokenizer) -> set[int]:
    """Every id that spells whole text on its own (not its special or added tokens, nor bytes of a
    character split over tokens: free text is valid UTF-8, so a lone continuation byte never starts it)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    return {i for i in range(tokenizer.vocab_size) if i not in added and "\ufffd" not in tokenizer.decode([i])}


def test_a_grammar_that_does_not_compile_is_refused_naming_why(compiler):
    cases = {GrammarSpec.regex("(ab"): "the regex grammar does not compile: .*error: unclosed group$",
             GrammarSpec.json_schema({"type": "foo"}): "the json_schema grammar does not compile: .*foo",
             GrammarSpec.lark("start: rule_nobody_wrote"): 'the lark grammar does not compile: .*rule_nobody_wrote'}
    for spec, why in cases.items():
        with pytest.raises(ValueError, match=why):
            compiler.check(SamplingParams(grammar=spec))
    with pytest.raises(ValueError, match="the regex grammar does not compile"):
        compiler.check(SamplingParams(grammar=GrammarSpec.regex("(ab").lazy("<tool_call>"), reasoning_end="</think>"))
    # strict: a keyword llguidance cannot enforce is refused; not strict, it is ignored
    conditional = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}
    with pytest.raises(ValueError, match=r'json_schema grammar does not compile: Unimplemented keys: \["if", "then"\]'):
        compiler.check(SamplingParams(grammar=GrammarSpec.json_schema(conditional)))
    compiler.check(SamplingParams(grammar=GrammarSpec.json_schema(conditional, strict=False)))


def test_a_grammar_needs_a_tokenizer_the_model_can_hold(tokenizer):
    with pytest.raises(ValueError, match="a grammar needs the model's tokenizer, and this engine has none"):
        GrammarCompiler(None, MODEL_VOCAB, [EOS]).check(SamplingParams(grammar=GrammarSpec.regex("a")))
    with pytest.raises(ValueError, match="but the model's vocabulary only 100"):
        GrammarCompiler(tokenizer.backend, 100, [EOS]).check(SamplingParams(grammar=GrammarSpec.regex("a")))


def test_end_of_sequence_only_where_the_grammar_is_complete(compiler, tokenizer):
    grammar = compiler.matcher(SamplingParams(grammar=GrammarSpec.regex("ab(ab)?")))
    assert EOS not in allowed(grammar)
    assert not feed(grammar, tokenizer, "a") and EOS not in allowed(grammar)
    assert not feed(grammar, tokenizer, "b") and EOS in allowed(grammar)  # "ab" is complete, "abab" too
    assert feed(grammar, tokenizer, "ab")  # nothing may follow "abab": the grammar is done
    # ids past the tokenizer's (the model's padding) are never allowed, even where anything goes
    assert max(allowed(compiler.matcher(SamplingParams(grammar=GrammarSpec.regex("(?s:.*)"))))) < tokenizer.vocab_size


def test_a_token_the_grammar_does_not_allow_is_rejected(compiler, tokenizer):
    grammar = compiler.matcher(SamplingParams(grammar=GrammarSpec.json_schema(SCHEMA)))
    with pytest.raises(GrammarRejected, match="the grammar rejected token"):
        feed(grammar, tokenizer, "x")


def test_a_lazy_grammar_waits_for_its_trigger_as_text_or_as_its_token(compiler, tokenizer):
    params = SamplingParams(grammar=GrammarSpec.json_schema(SCHEMA).lazy("<tool_call>"))
    call = tokenizer.token_to_id("<tool_call>")
    json_start = allowed(compiler.matcher(SamplingParams(grammar=GrammarSpec.json_schema(SCHEMA))))
    free = compiler.matcher(params)
    assert text_ids(tokenizer) | {EOS, call} <= allowed(free)  # free text, which may end
    feed(free, tokenizer, "Let me see. <tool", "_call")
    assert EOS in allowed(free)  # "<tool_call" is not the trigger yet
    feed(free, tokenizer, ">")
    assert allowed(free) == json_start
    assert feed(free, tokenizer, '{"a": 12}')  # the call is complete
    by_token = compiler.matcher(params)
    feed(by_token, tokenizer, "Sure ", call)
    assert allowed(by_token) == json_start
    untriggered = compiler.matcher(params)
    assert not feed(untriggered, tokenizer, "No call needed.") and EOS in allowed(untriggered)
    with pytest.raises(GrammarRejected):  # once triggered, the text after it is the grammar's
        feed(compiler.matcher(params), tokenizer, "<tool", "_call>", " no")


def test_no_grammar_applies_inside_the_reasoning_block(compiler, tokenizer):
    params = SamplingParams(grammar=GrammarSpec.json_schema(SCHEMA), reasoning_end="</think>")
    grammar = compiler.matcher(params)
    everything = text_ids(tokenizer) | {tokenizer.token_to_id(t) for t in ("<tool_call>", "<think>", "</think>")}
    assert everything <= allowed(grammar) and EOS not in allowed(grammar)  # the answer has not come
    feed(grammar, tokenizer, "Hmm, { is not JSON", tokenizer.token_to_id("<tool_call>"), " yet")
    assert everything <= allowed(grammar)
    feed(grammar, tokenizer, tokenizer.token_to_id("</think>"), "\n\n")  # the marker as its token, then a gap
    assert EOS not in allowed(grammar) and feed(grammar, tokenizer, '{"a": 1}')
    by_text = compiler.matcher(params)
    feed(by_text, tokenizer, "ok </th", "ink>")  # the marker spelled by ordinary tokens
    assert feed(by_text, tokenizer, '{"a": 2}')
    with pytest.raises(GrammarRejected):  # at most 4 whitespace characters before the grammar
        feed(compiler.matcher(params), tokenizer, "</think>", "     ")


def test_reasoning_then_a_lazy_trigger(compiler, tokenizer):
    params = SamplingParams(grammar=GrammarSpec.json_schema(SCHEMA).lazy("<tool_call>"), reasoning_end="</think>")
    grammar = compiler.matcher(params)
    feed(grammar, tokenizer, "I could use <tool", "_call> here, or not")  # inside reasoning: no trigger
    assert EOS not in allowed(grammar)
    feed(grammar, tokenizer, "</think>", "Calling it. ")
    assert EOS in allowed(grammar)  # free answer text may end
    assert feed(grammar, tokenizer, tokenizer.token_to_id("<tool_call>"), '{"a": 3}')


def test_forks_are_independent_and_start_where_their_parent_is(compiler, tokenizer):
    parent = compiler.matcher(SamplingParams(grammar=GrammarSpec.regex("(ab|cd)+")))
    feed(parent, tokenizer, "ab")
    child = parent.fork()
    assert allowed(child) == allowed(parent)
    feed(child, tokenizer, "c")
    assert allowed(child) != allowed(parent)
    feed(parent, tokenizer, "ab")
    assert feed(child, tokenizer, "d") is False and EOS in allowed(child)
    assert compiler.matcher(SamplingParams(grammar=GrammarSpec.regex("(ab|cd)+"))).matcher is not parent.matcher
