"""GrammarSpec, the plain data a request's grammar travels as, and how SamplingParams takes it."""

from __future__ import annotations

import json

import pytest

from localserve.engine.grammar import GrammarSpec
from localserve.engine.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_json_schema_carries_the_schema_and_the_compact_separators():
    spec = GrammarSpec.json_schema(SCHEMA)
    grammar = json.loads(spec.grammar)["grammars"][0]
    assert spec.kind == "json_schema" and spec.trigger is None
    assert grammar["json_schema"]["properties"] == SCHEMA["properties"]
    options = grammar["json_schema"]["x-guidance"]
    assert options["item_separator"] == ", " and options["key_separator"] == ": "
    assert options["whitespace_flexible"] is False and options["lenient"] is False
    assert json.loads(GrammarSpec.json_schema(SCHEMA, strict=False).grammar)["grammars"][0]["json_schema"][
        "x-guidance"]["lenient"] is True
    assert GrammarSpec.json_schema(json.dumps(SCHEMA)) == spec  # the schema's JSON text is the same


def test_constructors_refuse_what_is_no_grammar():
    with pytest.raises(ValueError, match="the JSON schema is not valid JSON"):
        GrammarSpec.json_schema("{not json")
    with pytest.raises(ValueError, match="a JSON schema must be an object, got list"):
        GrammarSpec.json_schema("[1]")
    with pytest.raises(ValueError, match="the regex must be a non-empty string"):
        GrammarSpec.regex("")
    with pytest.raises(ValueError, match="the GBNF grammar does not convert: Expected '\\)'"):
        GrammarSpec.gbnf('root ::= "a" | (')
    with pytest.raises(ValueError, match='non-empty "grammars" list'):
        GrammarSpec.llguidance({"grammars": []})
    with pytest.raises(ValueError, match="trigger must be a non-empty string"):
        GrammarSpec.regex("a").lazy("")


def test_every_kind_is_llguidance_json_and_names_its_source():
    specs = {"regex": GrammarSpec.regex("[a-z]+"), "lark": GrammarSpec.lark('start: "x"'),
             "gbnf": GrammarSpec.gbnf('root ::= [a-z]+ "."'), "json_object": GrammarSpec.json_object(),
             "llguidance": GrammarSpec.llguidance('{"grammars": [{"lark_grammar": "start: \\"x\\""}]}')}
    for kind, spec in specs.items():
        assert spec.kind == kind
        assert json.loads(spec.grammar)["grammars"], kind
    assert json.loads(specs["gbnf"].grammar)["grammars"][0]["lark_grammar"].strip().endswith('start: /[a-z]/+ "."')


def test_lazy_is_a_new_spec_with_the_trigger():
    spec = GrammarSpec.json_schema(SCHEMA)
    lazy = spec.lazy("<tool_call>")
    assert lazy.trigger == "<tool_call>" and lazy.grammar == spec.grammar and spec.trigger is None


def test_repr_names_the_kind_not_the_grammar():
    assert repr(GrammarSpec.regex("a" * 500).lazy("go")) == "GrammarSpec(kind='regex', trigger='go')"


def test_sampling_params_refuse_a_grammar_with_beams_and_what_is_no_spec():
    with pytest.raises(ValueError, match="SamplingParams.grammar is not supported with beam_search"):
        SamplingParams(n=2, beam_search=True, grammar=GrammarSpec.regex("a+"))
    with pytest.raises(ValueError, match="SamplingParams.grammar must be a GrammarSpec"):
        SamplingParams(grammar='{"grammars": []}')
    with pytest.raises(ValueError, match="SamplingParams.reasoning_end must be a non-empty string"):
        SamplingParams(reasoning_end="")
    with pytest.raises(ValueError, match="SamplingParams.reasoning_end is not supported with beam_search"):
        SamplingParams(n=2, beam_search=True, reasoning_end="</think>")
    params = SamplingParams(grammar=GrammarSpec.regex("a+"), reasoning_end="</think>")
    assert params.grammar.kind == "regex" and params.reasoning_end == "</think>"
