"""Each tool-call format's stream parser on text alone: fixed examples at the edges, and generated answers
(content and calls written in the format, split at arbitrary points) parsing back into the same events."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.tokenizer.chat_format import TOOL_FORMATS
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from localserve.tokenizer.tool_formats.base import ToolUse
from localserve.tokenizer.tools import ToolSpec
from tests.helpers.tool_outputs import in_written_order, json_arguments, plain_text, write_answer

TOOLS = (ToolSpec("get_weather"), ToolSpec("search"), ToolSpec("x.y-z_1"))
TYPED = ToolSpec("typed", "every type", {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}}})
USE = ToolUse((*TOOLS, TYPED))


def parse(format_name: str, pieces: list[str], use: ToolUse = USE) -> list:
    """The coalesced events of `pieces` fed one by one."""
    parser = TOOL_FORMATS[format_name]().parser(use)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return coalesce(events + parser.finish())


def feeds(format_name: str, pieces: list[str]) -> list[list]:
    """The events each feed returns, ids left out."""
    parser = TOOL_FORMATS[format_name]().parser(USE)
    return [[_no_id(event) for event in parser.feed(piece)] for piece in pieces] + [
        [_no_id(event) for event in parser.finish()]]


def _no_id(event):
    return ToolCallStart(event.index, "", event.name) if isinstance(event, ToolCallStart) else event


def call_events(index: int, name: str, arguments: str) -> list:
    return [ToolCallStart(index, "", name), ToolCallArgumentsDelta(index, arguments), ToolCallEnd(index, arguments)]


def test_a_trigger_split_across_deltas_never_reaches_the_content():
    pieces = ["Let me look.", "\n<tool", "_ca", 'll>\n{"name": "search", "argu', 'ments": {"q": 1}}\n</tool_', "call>"]
    assert feeds("hermes", pieces) == [[ContentDelta("Let me look.")], [], [], [ToolCallStart(0, "", "search")],
                                       [ToolCallArgumentsDelta(0, '{"q": 1}'), ToolCallEnd(0, '{"q": 1}')], [], []]
    assert feeds("mistral_args", ["Hi", "[TOOL_", "CALLS]sea", "rch[AR", "GS]{}"]) == [
        [ContentDelta("Hi")], [], [], [], [ToolCallStart(0, "", "search"), ToolCallArgumentsDelta(0, "{}"),
                                           ToolCallEnd(0, "{}")], []]


def test_text_that_only_looks_like_a_trigger_is_released_when_it_cannot_be_one():
    assert feeds("hermes", ["a <tool", "_cal", "lx> b", " <tool"]) == [
        [ContentDelta("a")], [], [ContentDelta(" <tool_callx> b")], [], [ContentDelta(" <tool")]]
    assert feeds("mistral_array", ["[TOOL_CALL", "S is a marker"]) == [[], [ContentDelta("[TOOL_CALLS is a marker")],
                                                                     []]
    assert parse("qwen3_coder", ["<tool_calls> are tags"]) == [ContentDelta("<tool_calls> are tags")]


def test_two_parallel_calls_get_distinct_indexes_and_ids():
    text = write_answer("hermes", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])
    events = parse("hermes", [text])
    assert [_no_id(event) for event in events] == [*call_events(0, "get_weather", '{"city": "Paris"}'),
                                                   *call_events(1, "get_weather", '{"city": "Rome"}')]
    ids = [event.id for event in events if isinstance(event, ToolCallStart)]
    assert len(set(ids)) == 2 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id in ids)
    mistral = parse("mistral_array", [write_answer("mistral_array", "", [("search", {}), ("search", {"q": 2})])])
    assert [e.index for e in mistral if isinstance(e, ToolCallEnd)] == [0, 1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", e.id) for e in mistral if isinstance(e, ToolCallStart))


@pytest.mark.parametrize("format_name", ["hermes", "mistral_array", "mistral_args", "json", "llama3_json"])
def test_end_markers_inside_json_strings_are_text(format_name):
    arguments = {"text": '</tool_call>"}] [TOOL_CALLS] </function> \\" {', "emoji": "😀 ünï"}
    events = parse(format_name, list(write_answer(format_name, "", [("search", arguments)])))
    written = json.dumps(arguments, ensure_ascii=False)
    assert [_no_id(event) for event in events] == call_events(0, "search", written)


def test_qwen3_coder_arguments_become_json_by_the_schema_types():
    text = ("<tool_call>\n<function=typed>\n<parameter=s>\n5 </parameter >\n</parameter>\n<parameter=i>\n7\n"
            "</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"k\": [1]}\n</parameter>\n"
            "<parameter=unknown>\n{x\n</parameter>\n</function>\n</tool_call>")
    arguments = '{"s": "5 </parameter >", "i": 7, "b": true, "o": {"k": [1]}, "unknown": "{x"}'
    assert [_no_id(event) for event in parse("qwen3_coder", list(text))] == call_events(0, "typed", arguments)
    # a string argument streams as it comes; its closing newline is held until the value ends
    parser = TOOL_FORMATS["qwen3_coder"]().parser(USE)
    parser.feed("<tool_call>\n<function=typed>\n<parameter=s>\nab")
    assert parser.feed("c\n") == [ToolCallArgumentsDelta(0, "c")]
    assert parser.feed("d") == [ToolCallArgumentsDelta(0, "\\nd")]


def test_llama3_calls_only_at_the_start_and_python_tag():
    assert [_no_id(e) for e in parse("llama3_json", ["<|python_tag|>", '{"name": "search", "parameters": {}}'])] == \
        call_events(0, "search", "{}")
    assert parse("llama3_json", ['{"answer": 42}']) == [ContentDelta('{"answer": 42}')]
    assert parse("llama3_json", ['Use {"name": "search"}']) == [ContentDelta('Use {"name": "search"}')]


def test_generic_json_answers_and_calls():
    assert parse("json", list('{"response": "Caf\\u00e9 \\ud83d\\ude00 \\"ok\\""}')) == [ContentDelta('Café 😀 "ok"')]
    assert parse("json", ["not JSON at all"]) == [ContentDelta("not JSON at all")]
    calls = '{"tool_calls": [{"name": "search", "arguments": {"q": 1}}, {"arguments": {}, "name": "x.y-z_1"}]}'
    events = parse("json", [calls])
    assert [_no_id(e) for e in events] == [*call_events(0, "search", '{"q": 1}'), *call_events(1, "x.y-z_1", "{}")]


@pytest.mark.parametrize("format_name", ["hermes", "mistral_array", "mistral_args", "json", "qwen3_coder",
                                         "llama3_json"])
def test_an_output_cut_mid_call_closes_the_call_with_what_it_has(format_name):
    text = write_answer(format_name, "", [("search", {"query": "föhn"})])
    cut = text[:text.index("föhn") + 2]
    events = parse(format_name, [cut])
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]
    assert events[-1].arguments.startswith('{"query": "f') and not events[-1].whole
    whole = parse(format_name, [text])
    assert whole[-1].whole and json.loads(whole[-1].arguments) == {"query": "föhn"}


def test_a_malformed_call_is_shown_as_the_model_wrote_it():
    assert parse("hermes", ["<tool_call>\nnot json\n</tool_call>"]) == [
        ContentDelta("<tool_call>\nnot json\n</tool_call>")]
    assert parse("hermes", ["ok <tool_call>\n{\"na"]) == [ContentDelta("ok <tool_call>\n{\"na")]


NAMES = st.sampled_from([tool.name for tool in TOOLS])


def split_points(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)], strict=True)])


def expected(content: str, calls: list[tuple[str, dict]]) -> list:
    events = [ContentDelta(content)] if content else []
    for index, (name, arguments) in enumerate(calls):
        events += call_events(index, name, json.dumps(arguments, ensure_ascii=False))
    return events


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["hermes", "mistral_array", "mistral_args", "gemma4"]), plain_text(),
       st.lists(st.tuples(NAMES, json_arguments()), max_size=3), st.data())
def test_generated_answers_parse_back_into_their_events(format_name, content, calls, data):
    calls = in_written_order(format_name, calls)
    text = write_answer(format_name, content, calls)
    pieces = data.draw(split_points(text))
    assert [_no_id(e) for e in parse(format_name, pieces)] == expected(content, calls)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["llama3_json", "json"]), plain_text(), st.lists(st.tuples(NAMES, json_arguments()), max_size=3),
       st.booleans(), st.data())
def test_generated_answers_or_calls_parse_back(format_name, content, calls, call, data):
    calls = calls[:1] if format_name == "llama3_json" else calls
    content, calls = ("", calls) if call and calls else (content, [])
    if format_name == "llama3_json" and content.startswith("{"):
        content = "x" + content
    text = write_answer(format_name, content, calls)
    assert [_no_id(e) for e in parse(format_name, data.draw(split_points(text)))] == expected(content, calls)


CODER_VALUES = {"s": plain_text().filter(lambda s: "</parameter>" not in s) | st.text(max_size=5),
                "i": st.integers(-10**9, 10**9), "n": st.floats(allow_nan=False, allow_infinity=False),
                "b": st.booleans(), "o": json_arguments(), "a": st.lists(st.integers(), max_size=3)}


@settings(max_examples=60, deadline=None)
@given(plain_text(), st.lists(st.fixed_dictionaries({}, optional=CODER_VALUES), max_size=3), st.data())
def test_generated_qwen3_coder_answers_parse_back(content, arguments_list, data):
    calls = [("typed", arguments) for arguments in arguments_list]
    text = write_answer("qwen3_coder", content, calls)
    assert [_no_id(e) for e in parse("qwen3_coder", data.draw(split_points(text)))] == expected(content, calls)


WHITESPACE = st.text(alphabet=" \t\r\n", max_size=4)  # what the call grammars allow around the calls


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(TOOL_FORMATS)), st.lists(st.tuples(NAMES, json_arguments()), min_size=1, max_size=2),
       WHITESPACE, WHITESPACE, st.data())
def test_whitespace_around_calls_is_no_content_however_it_streams(format_name, calls, before, after, data):
    calls = calls[:1] if format_name == "llama3_json" else calls
    if format_name == "qwen3_coder":
        calls = [("typed", {}) for _ in calls]
    calls = in_written_order(format_name, calls)
    text = before + write_answer(format_name, "", calls) + after
    assert [_no_id(e) for e in parse(format_name, data.draw(split_points(text)))] == expected("", calls)


@pytest.mark.parametrize("chunks", [
    [' <|tool_call>call:get_weather{____:None}<tool_call|>', ' '],  # found by the generated test above
    [' <|tool_call>call:get_weather{a:1}<tool_call|>', ' \n', '\t'],
    [' <|tool_call>call:get_weather{}<tool_call|> ', ' '],
])
def test_gemma4_whitespace_after_a_call_in_a_later_chunk_is_no_content(chunks):
    events = parse("gemma4", chunks)
    assert not [event for event in events if isinstance(event, ContentDelta)], events
