"""One request model behind every API: the same field values, valid and invalid, sent over the real wire
in every format that carries them (/v1/responses over HTTP and over the websocket, /v1/chat/completions,
/v1/completions) get the same answer: accepted with equal SamplingParams (the values sent, the server's
defaults for the rest), or refused with the same code naming the same field, as each format spells it.

The server runs on a recording engine thread (tests/helpers/request_wire.py): every request goes
through the whole server (HTTP or websocket, parsing, the conversation, tokenizing, the context) to the
engine's door, where its SamplingParams are kept and the request is answered at once; so every
generated case runs on the wire, not on the parsers alone. Tools, the tool choice and the answer's
format reach the engine as its grammar: the reference is worked out from the rules (the calls' grammar
of the model's chat format when tools are offered, else the format's JSON schema).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from localserve.engine.grammar import GrammarSpec
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.request.generation_request import OutputFormat
from localserve.tokenizer.chat_format import detect_chat_format
from localserve.tokenizer.tools import ToolChoice, ToolSpec
from tests.helpers.request_wire import (
    CHAT,
    COMPLETIONS,
    FORMATS,
    RESPONSES_WS,
    Outcome,
    RecordingEngineThread,
    WireClient,
    formats_carrying,
)
from tests.helpers.server import running_server

NUM_CASES = 500
DEFAULTS = SamplingDefaults(0.7, top_k=33, top_p=0.9, min_p=0.02, source="test")
DEFAULT_MAX_TOKENS = 16  # the server's, set to /v1/completions' own default: every format's default is one
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# The context is 512 tokens and a chat-templated "hello" some more than the bare prompt (with tools described
# in it, up to 131): accepted max_tokens stay below the cut to the room left, which differs between the formats
# (tested in the bounds).
MAX_UNCUT_TOKENS = 360


@pytest.fixture(scope="module")
def wire(tiny_chat_llm):
    with running_server(tiny_chat_llm, engine_thread_type=RecordingEngineThread, sampling_defaults=DEFAULTS,
                        default_max_output_tokens=DEFAULT_MAX_TOKENS) as server:
        client = WireClient(server.port, server.server.models.serving_now().engine)
        yield client
        client.close()


@pytest.fixture(scope="module")
def chat_format(tiny_chat_llm):
    return detect_chat_format(tiny_chat_llm.tokenizer)


def expected_grammar(case: dict, chat_format) -> GrammarSpec | None:
    """The grammar the case's tools, tool choice and answer format make (cases written flat, as Responses)."""
    no_parameters = {"type": "object", "properties": {}}
    # a hosted tool (`web_search`) the case's tool choice calls not is dropped (else the request is refused)
    tools = [ToolSpec(tool["name"], tool.get("description"), tool.get("parameters", no_parameters))
             for tool in case.get("tools") or () if tool.get("type", "function") == "function"]
    choice = case.get("tool_choice") or "auto"
    choice = ToolChoice.function(choice["name"]) if isinstance(choice, dict) else ToolChoice(choice)
    answer = case.get("structured_output") or {"type": "text"}
    if tools and choice.mode != "none":  # beside an answer format, the answer may be a value of it instead
        answer_format = {"json_object": OutputFormat("json_object"),
                         "json_schema": OutputFormat("json_schema", answer.get("schema"), answer.get("strict", False))
                         }.get(answer["type"])
        embedded = answer_format.embedded_schema() if answer_format is not None else None
        return GrammarSpec.lark(chat_format.turn(tools, choice, answer=embedded).grammar.lark)
    if answer["type"] == "json_object":
        return GrammarSpec.json_object()
    if answer["type"] == "json_schema":
        return GrammarSpec.json_schema(answer["schema"], strict=answer.get("strict", False))
    return None


def expected_params(case: dict, chat_format=None) -> SamplingParams:
    """The reference: the case's values, the server's defaults where it sent none, the grammar it makes."""
    chosen = {name: value for name, value in case.items() if value is not None and name in SamplingParams.__slots__}
    if isinstance(chosen.get("stop"), str):
        chosen["stop"] = [chosen["stop"]]
    defaults = {"temperature": DEFAULTS.temperature, "top_k": DEFAULTS.top_k, "top_p": DEFAULTS.top_p,
                "min_p": DEFAULTS.min_p, "max_tokens": DEFAULT_MAX_TOKENS}
    grammar = expected_grammar(case, chat_format) if chat_format is not None else None
    return SamplingParams(**(defaults | chosen), grammar=grammar)


def outcomes(wire: WireClient, case: dict) -> dict[str, Outcome]:
    return {fmt: wire.send(fmt, case) for fmt in formats_carrying(case)}


# ---------------------------------------------------------------------------------- generated cases
wrong_types = st.sampled_from(["hot", "", True, False, [], [1], {}, {"a": 1}])
non_finite = st.sampled_from([math.nan, math.inf, -math.inf, 10 ** 400])  # 10**400 overflows a float


def integers(low: int, high: int):
    """Valid integers, the bounds and one past them, anything else an integer field might get."""
    return st.one_of(st.integers(low, high), st.sampled_from([low, high, low - 1, high + 1]),
                     st.integers(), st.floats(allow_nan=False), wrong_types, non_finite, st.none())


def numbers(low: float, high: float):
    return st.one_of(st.floats(low, high), st.integers(math.ceil(low), math.floor(high)),
                     st.sampled_from([low, high, math.nextafter(low, -math.inf), math.nextafter(high, math.inf)]),
                     st.floats(allow_nan=False), wrong_types, non_finite, st.none())


texts = st.text(max_size=6)
TOOL_F = {"type": "function", "name": "f", "parameters": {}}
TOOL_G = {"type": "function", "name": "g", "description": "Gets.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}
SCHEMA_FORMAT = {"type": "json_schema", "name": "x", "strict": True,
                 "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                            "additionalProperties": False}}
valid = {
    "max_tokens": st.integers(1, MAX_UNCUT_TOKENS), "temperature": st.floats(0, 2) | st.integers(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(1, INT64_MAX),
    "min_p": st.floats(0, 1, exclude_max=True), "seed": st.integers(INT64_MIN, INT64_MAX),
    "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=8),
    "n": st.integers(1, 16), "logprobs": st.integers(0, 20), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.001, 10),
    "tools": st.sampled_from([[], [TOOL_F], [TOOL_G], [TOOL_F, TOOL_G]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"}]),
    "structured_output": st.sampled_from([{"type": "text"}, {"type": "json_object"}, SCHEMA_FORMAT]),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high"]),
}
anything = {
    "max_tokens": integers(1, MAX_UNCUT_TOKENS) | st.sampled_from([513, INT64_MAX, INT64_MAX + 1]),
    "temperature": numbers(0, 2), "top_p": numbers(0, 1), "top_k": integers(1, INT64_MAX),
    "min_p": numbers(0, 1), "seed": integers(INT64_MIN, INT64_MAX),
    "stop": st.one_of(texts, st.lists(texts, max_size=10), st.lists(texts | st.integers(), max_size=3),
                      st.just("x" * 129), wrong_types, st.none()),
    "n": integers(1, 16), "logprobs": integers(0, 20), "presence_penalty": numbers(-2, 2),
    "frequency_penalty": numbers(-2, 2), "repetition_penalty": numbers(0.001, 10),
    "tools": st.sampled_from([[], [TOOL_F], [TOOL_F, TOOL_F], [1], "f", {}, None, [{"type": "web_search"}],
                              [{"type": "function", "name": "bad name"}], [{"type": "function"}],
                              [{"type": "function", "name": "f", "parameters": {"type": "array"}}]]),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "f"},
                                    {"type": "function", "name": "zzz"}, {"type": "function"}, "any", 5, None]),
    "structured_output": st.sampled_from([{"type": "text"}, {}, {"type": "json_object"}, {"type": 5}, "json",
                                          {"type": "json_schema", "name": "x", "schema": {}}, SCHEMA_FORMAT,
                                          {"type": "json_schema", "name": "x", "schema": 5}, None]),
    "reasoning_effort": st.sampled_from(["none", "low", "high", "extreme", 3, None]),
}
unknown_fields = st.dictionaries(st.sampled_from(["frobnicate", "temprature", "max_new_tokens"]), st.integers(),
                                 max_size=1)
cases = st.one_of(
    st.fixed_dictionaries({}, optional=valid),
    st.builds(dict.__or__, st.fixed_dictionaries({}, optional=anything), unknown_fields),
)


@settings(max_examples=NUM_CASES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases)
@example(case={})
@example(case={"tools": [{"type": "web_search"}], "tool_choice": "none"})  # a hosted tool dropped (found by a CI run)
@example(case={"temperature": None, "top_p": None, "stop": None, "n": None, "tools": None, "logprobs": None})
@example(case={"temperature": 0.5, "top_k": 3, "stop": "END", "seed": 7, "max_tokens": 5, "logprobs": 2})
@example(case={"tools": [{"type": "function", "name": "f", "parameters": {}}]})
@example(case={"tools": [1]})
@example(case={"tools": "f"})
@example(case={"tool_choice": "required"})
@example(case={"structured_output": {"type": "json_object"}})
@example(case={"structured_output": "json"})
@example(case={"reasoning_effort": "high"})
@example(case={"temperature": "hot"})
@example(case={"temperature": math.nan})
@example(case={"top_p": 0})
@example(case={"min_p": 1.5})
@example(case={"top_k": 0, "temperature": -1})
@example(case={"stop": ""})
@example(case={"stop": ["a", 1]})
@example(case={"n": True})
@example(case={"seed": INT64_MAX + 1})
@example(case={"max_tokens": 513})
@example(case={"logprobs": 21})
@example(case={"frobnicate": 1, "temperature": "hot"})
@example(case={"tools": [TOOL_F, TOOL_G], "tool_choice": {"type": "function", "name": "g"}})
@example(case={"tools": [TOOL_F], "tool_choice": {"type": "function", "name": "zzz"}})
@example(case={"tools": [{"type": "function", "name": "bad name"}]})
@example(case={"structured_output": SCHEMA_FORMAT, "tools": [TOOL_F]})
@example(case={"reasoning_effort": "extreme"})
def test_every_format_gives_the_same_answer(wire, chat_format, case):
    answers = outcomes(wire, case)
    first = next(iter(answers.values()))
    assert all(answer == first for answer in answers.values()), answers
    if first.accepted:
        assert first.params == expected_params(case, chat_format)


# ---------------------------------------------------------------------------------- each outcome pinned
ACCEPTED = Outcome(params=SamplingParams())  # accepted with expected_params(case): worked out in the test
PINNED = [
    ({}, Outcome(params=expected_params({}))),
    ({"temperature": 0.5, "top_k": 3, "stop": "END", "seed": 7, "n": 2, "max_tokens": 5, "logprobs": 2,
      "repetition_penalty": 1.1, "tools": [], "tool_choice": "none", "structured_output": {"type": "text"},
      "reasoning_effort": "none"},
     Outcome(params=SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.02, seed=7, max_tokens=5,
                                   stop=["END"], n=2, logprobs=2, repetition_penalty=1.1))),
    ({"tools": [TOOL_F]}, ACCEPTED),  # tool_choice auto: the calls' grammar
    ({"tools": [TOOL_F, TOOL_G], "tool_choice": "required"}, ACCEPTED),
    ({"tools": [TOOL_F, TOOL_G], "tool_choice": {"type": "function", "name": "g"}}, ACCEPTED),
    ({"tools": [TOOL_F], "tool_choice": "none"}, Outcome(params=expected_params({}))),  # no tools offered
    ({"tools": [1]}, Outcome(status=400, code="invalid_type", field="tools[0]")),
    ({"tools": "f"}, Outcome(status=400, code="invalid_type", field="tools")),
    # a hosted tool: refused unless the tool choice calls none of it, then dropped
    ({"tools": [{"type": "web_search"}]}, Outcome(status=400, code="unsupported_value", field="tools[0].type")),
    ({"tools": [{"type": "web_search"}], "tool_choice": "none"}, Outcome(params=expected_params({}))),
    ({"tools": [{"type": "function", "name": "bad name"}]},
     Outcome(status=400, code="invalid_value", field="tools[0].name")),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
     Outcome(status=400, code="invalid_value", field="tools[0].parameters")),
    ({"tools": [TOOL_F, TOOL_F]}, Outcome(status=400, code="invalid_value", field="tools")),  # one name twice
    ({"tool_choice": "required"}, Outcome(status=400, code="invalid_value", field="tool_choice")),
    ({"tool_choice": "any"}, Outcome(status=400, code="invalid_value", field="tool_choice")),
    ({"tools": [TOOL_F], "tool_choice": {"type": "function", "name": "zzz"}},
     Outcome(status=400, code="invalid_value", field="tool_choice.name")),
    ({"structured_output": {"type": "json_object"}}, ACCEPTED),
    ({"structured_output": SCHEMA_FORMAT}, ACCEPTED),
    ({"structured_output": {"type": "json_schema", "name": "x", "schema": 5}},
     Outcome(status=400, code="invalid_type", field="structured_output.schema")),
    ({"structured_output": {"type": "yaml"}},
     Outcome(status=400, code="invalid_value", field="structured_output.type")),
    ({"structured_output": "json"}, Outcome(status=400, code="invalid_type", field="structured_output")),
    ({"structured_output": SCHEMA_FORMAT, "tools": [TOOL_F]}, ACCEPTED),  # a call, or a value of the schema
    ({"structured_output": SCHEMA_FORMAT, "tools": [TOOL_F], "tool_choice": "required"}, ACCEPTED),  # a call
    ({"reasoning_effort": "high"}, ACCEPTED),  # the tiny model does not reason: nothing changes
    ({"reasoning_effort": "extreme"}, Outcome(status=400, code="invalid_value", field="reasoning_effort")),
    ({"temperature": "hot"}, Outcome(status=400, code="invalid_type", field="temperature")),
    ({"temperature": math.nan}, Outcome(status=400, code="invalid_value", field="temperature")),
    ({"temperature": 10 ** 400}, Outcome(status=400, code="decimal_above_max_value", field="temperature")),
    ({"top_p": 0}, Outcome(status=400, code="invalid_value", field="top_p")),
    ({"min_p": 1.5}, Outcome(status=400, code="invalid_value", field="min_p")),
    ({"top_k": 0, "temperature": -1}, Outcome(status=400, code="decimal_below_min_value", field="temperature")),
    ({"stop": ""}, Outcome(status=400, code="invalid_value", field="stop")),
    ({"stop": ["a", 1]}, Outcome(status=400, code="invalid_type", field="stop")),
    ({"n": True}, Outcome(status=400, code="invalid_type", field="n")),
    ({"seed": INT64_MAX + 1}, Outcome(status=400, code="integer_above_max_value", field="seed")),
    ({"max_tokens": 513}, Outcome(status=400, code="integer_above_max_value", field="max_tokens")),
    ({"logprobs": 21}, Outcome(status=400, code="integer_above_max_value", field="logprobs")),
    ({"frobnicate": 1, "temperature": "hot"}, Outcome(status=400, code="unknown_parameter", field="frobnicate")),
    ({"tools": [{"type": "function"}], "temperature": "hot"},  # sampling is checked before the tools
     Outcome(status=400, code="invalid_type", field="temperature")),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case, expected", PINNED, ids=[str(case)[:60] for case, _ in PINNED])
def test_each_outcome_is_pinned(wire, chat_format, fmt, case, expected):
    if fmt not in formats_carrying(case):
        pytest.skip(f"{fmt} has no such field")
    if expected is ACCEPTED:
        expected = Outcome(params=expected_params(case, chat_format))
        assert expected.params.grammar is not None or case == {"reasoning_effort": "high"}
    assert wire.send(fmt, case) == expected


@pytest.mark.parametrize("fmt", [CHAT, COMPLETIONS])
def test_chat_and_text_completions_are_not_kept_for_a_follow_up(wire, fmt):
    answered = wire.send(fmt, {})
    assert answered.accepted
    same_hex = "resp_" + answered.response_id.split("-", 1)[1]  # chatcmpl-HEX / cmpl-HEX: the response's HEX
    assert wire.send(RESPONSES_WS, {"previous_response_id": same_hex}) == Outcome(
        status=400, code="previous_response_not_found", field="previous_response_id")
