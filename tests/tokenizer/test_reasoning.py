"""Reasoning split from the answer: `<think>` blocks as they stream, and whole chat outputs (reasoning, then an
answer with calls) parsed back from arbitrary splits."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.tokenizer.chat_format import TOOL_FORMATS, TaggedStreamParser
from localserve.tokenizer.reasoning import ThinkFormat
from localserve.tokenizer.stream_events import ContentDelta, ReasoningDelta, ToolCallEnd, ToolCallStart, coalesce
from localserve.tokenizer.tool_formats.base import ToolUse
from localserve.tokenizer.tools import ToolSpec
from tests.helpers.tool_outputs import json_arguments, plain_text, write_answer, write_reasoning

THINK = ThinkFormat(end_token_ids=(9,), switch=None, opens={True: False, False: False})


def split(pieces: list[str], opened: bool = False) -> list[list]:
    splitter = THINK.splitter(opened)
    return [splitter.feed(piece) for piece in pieces] + [splitter.finish()]


def test_reasoning_then_answer_with_the_end_marker_split_across_deltas():
    assert split(["<thi", "nk>\nI ", "think.\n</th", "ink>\n\nThe an", "swer."]) == [
        [], [ReasoningDelta("I")], [ReasoningDelta(" think.")], [ContentDelta("The an")], [ContentDelta("swer.")], []]


def test_text_that_looks_like_a_marker_is_reasoning_or_content():
    assert coalesce(sum(split(["<think>a </thinking> b</think>c </think"]), [])) == [
        ReasoningDelta("a </thinking> b"), ContentDelta("c </think")]
    assert split(["<thin", "g>"]) == [[], [ContentDelta("<thing>")], []]


def test_an_output_without_a_think_block_is_all_answer():
    assert coalesce(sum(split(["  Hello", " there"]), [])) == [ContentDelta("Hello there")]


def test_a_prompt_that_opens_the_block_starts_inside_it():
    assert coalesce(sum(split(["Hmm, ", "so.</think>", "Yes."], opened=True), [])) == [
        ReasoningDelta("Hmm, so."), ContentDelta("Yes.")]
    assert coalesce(sum(split(["still thinking when cut"], opened=True), [])) == [
        ReasoningDelta("still thinking when cut")]


def split_points(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=10).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)], strict=True)])


TOOLS = (ToolSpec("get_weather"), ToolSpec("search"))


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["hermes", "mistral_array", "mistral_args"]), plain_text(min_size=1), plain_text(),
       st.lists(st.tuples(st.sampled_from(["get_weather", "search"]), json_arguments()), max_size=2),
       st.booleans(), st.data())
def test_generated_reasoning_and_calls_parse_back(format_name, reasoning, content, calls, opened, data):
    text = write_reasoning(reasoning, write_answer(format_name, content, calls), opened)
    parser = TaggedStreamParser(THINK.splitter(opened), TOOL_FORMATS[format_name]().parser(ToolUse(TOOLS)))
    events = []
    for piece in data.draw(split_points(text)):
        events += parser.feed(piece)
    events = coalesce(events + parser.finish())
    assert events[0] == ReasoningDelta(reasoning)
    assert [e for e in events if isinstance(e, ContentDelta)] == ([ContentDelta(content)] if content else [])
    names = [e.name for e in events if isinstance(e, ToolCallStart)]
    arguments = [json.loads(e.arguments) for e in events if isinstance(e, ToolCallEnd)]
    assert list(zip(names, arguments, strict=True)) == calls
