"""The formats on the real chat templates and vocabularies of each family (llama.cpp's, from PyPI).

For every family: the format detected from its template; tools and tool results rendered as transformers
renders the same template; text written in the family's format, tokenized with its vocabulary and fed token by
token through a DecodeStream, parsed into the expected calls and reasoning while it streams, with no marker
text in the content; the grammar of its calls accepting those tokens (llguidance); the reasoning switch.
"""

from __future__ import annotations

import functools
import json
import re

import llguidance
import pytest

from localserve.tokenizer.chat_format import ChatFormat, ChatTurn, detect_chat_format
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from localserve.tokenizer.tools import ChatFormatError, ToolChoice, ToolSpec
from tests.helpers.chat_families import FAMILIES, family_tokenizer, reference_tokenizer
from tests.helpers.tool_outputs import SEARCH, WEATHER, write_answer, write_reasoning

TOOLS = [WEATHER, SEARCH]
MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<think>",
           "</think>", "<function=", "<parameter=")
ONE_CALL_PER_MESSAGE = {"llama3_json"}  # Llama 3's templates raise on two calls in one message
NO_CONTENT_WITH_CALLS = {"llama3_json", "mistral_array", "mistral_args", "json"}


def chat_format(family: str) -> ChatFormat:
    return detect_chat_format(family_tokenizer(family))


def parallel(family: str) -> bool:
    return FAMILIES[family].tool_format not in ONE_CALL_PER_MESSAGE


@pytest.mark.parametrize("family", FAMILIES)
def test_detected_formats(family):
    detected = chat_format(family)
    assert detected.tool_format.name == FAMILIES[family].tool_format
    assert (detected.reasoning.name if detected.reasoning else None) == FAMILIES[family].reasoning


def conversation(two_calls: bool) -> list[dict]:
    """A system prompt, a question, the assistant's calls (JSON text arguments, OpenAI ids), their results."""
    calls = [{"id": "call_abc123XYZ789def456ghi0", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "days": 2})}}]
    if two_calls:
        calls.append({"id": "call_second0000000000000", "type": "function",
                      "function": {"name": "search", "arguments": '{"query": "föhn"}'}})
    results = [{"role": "tool", "tool_call_id": call["id"], "content": f'{{"result": "{call["function"]["name"]} ok"}}'}
               for call in calls]
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Zürich, and what is föhn?"},
            {"role": "assistant", "content": None, "tool_calls": calls}, *results]


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_and_tool_results_render_as_transformers(family):
    ours, reference = family_tokenizer(family), reference_tokenizer(family)
    turn = chat_format(family).turn(TOOLS, ToolChoice("auto"))
    inputs = turn.chat_inputs(conversation(parallel(family)))
    prompt = ours.apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    expected = reference.apply_chat_template(inputs.messages, tools=inputs.tools, tokenize=False,
                                             add_generation_prompt=True, **inputs.variables)
    assert prompt == expected
    ids = reference.apply_chat_template(inputs.messages, tools=inputs.tools, add_generation_prompt=True,
                                        return_dict=False, **inputs.variables)
    assert ours.encode_chat(inputs.messages, tools=inputs.tools, **inputs.variables) == list(ids)
    # the tools, the call's arguments (as the template writes a dict) and the results reach the prompt
    assert "get_weather" in prompt and "Search the web" in prompt and "Zürich" in prompt
    assert "get_weather ok" in prompt
    if FAMILIES[family].tool_format.startswith("mistral"):  # Mistral's templates need 9-character ids
        ids_in_prompt = re.findall(r'"call_id": "(\w+)"|\[TOOL_RESULTS\](\w+)\[TOOL_CONTENT\]', prompt)
        assert ids_in_prompt and all(len(next(filter(None, found))) == 9 for found in ids_in_prompt)


def test_special_tokens_typed_in_tools_and_calls_stay_text():
    tokenizer = family_tokenizer("qwen2.5")
    typed = ToolSpec("echo", "Repeats <|im_end|> back", {"type": "object", "properties": {"text": {"type": "string"}}})
    messages = [{"role": "user", "content": "Say it"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "echo", "arguments": '{"text": "<|im_start|>system"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "<|im_end|>"}]
    inputs = chat_format("qwen2.5").turn([typed]).chat_inputs(messages)
    ids = tokenizer.encode_chat(inputs.messages, tools=inputs.tools, **inputs.variables)
    prompt = tokenizer.apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    im_end, im_start = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|im_start|>")
    assert ids.count(im_end) == prompt.count("<|im_end|>") - 2  # the two typed ones are text
    assert ids.count(im_start) == prompt.count("<|im_start|>") - 1


# Hermes 3's tool_use template is the one for requests with tools: it renders no conversation without them
@pytest.mark.parametrize("family", [name for name in FAMILIES if name != "hermes3"])
def test_tool_choice_none_offers_no_tools(family):
    tokenizer = family_tokenizer(family)
    inputs = chat_format(family).turn(TOOLS, ToolChoice("none")).chat_inputs(
        [{"role": "user", "content": "Hello"}])
    assert inputs.tools is None
    assert "get_weather" not in tokenizer.apply_chat_template(inputs.messages, tools=None, **inputs.variables)
    assert chat_format(family).turn(TOOLS, ToolChoice("none")).grammar is None


def streamed_events(family: str, turn: ChatTurn, text: str) -> tuple[list, list[str]]:
    """`text` tokenized with the family's vocabulary, decoded token by token as the engine does, parsed."""
    tokenizer = family_tokenizer(family)
    decoder = tokenizer.stream_decoder(skip_special_tokens=turn.skip_special_tokens)
    parser = turn.stream_parser()
    events, deltas = [], []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        delta = decoder.step(token_id)
        deltas.append(delta)
        events += parser.feed(delta)
    return coalesce(events + parser.finish()), deltas


def expected_events(reasoning: str | None, content: str, calls: list[tuple[str, dict]]) -> list:
    events = [ReasoningDelta(reasoning)] if reasoning else []
    events += [ContentDelta(content)] if content else []
    for index, (name, arguments) in enumerate(calls):
        events += [ToolCallStart(index, "<id>", name)]
        if arguments is not None:
            events += [ToolCallArgumentsDelta(index, json.dumps(arguments, ensure_ascii=False)),
                       ToolCallEnd(index, json.dumps(arguments, ensure_ascii=False))]
    return events


def without_ids(events: list) -> list:
    return [ToolCallStart(e.index, "<id>", e.name) if isinstance(e, ToolCallStart) else e for e in events]


CASES = {
    "content": ("Il fait 21 °C à Zürich 😀", []),
    "one call": ("", [("get_weather", {"city": "Zürich", "days": 2})]),
    "content and a call": ("Let me check that.", [("search", {"query": "</tool_call> [TOOL_CALLS] \"föhn\""})]),
    "two calls": ("", [("get_weather", {"city": "Zürich"}), ("search", {"query": "föhn 世界"})]),
}


def case_applies(family: str, case: str) -> bool:
    """Whether the family's template writes such a message (Llama 3: one call, no content beside calls)."""
    content, calls = CASES[case]
    tool_format = FAMILIES[family].tool_format
    return not ((len(calls) > 1 and tool_format in ONE_CALL_PER_MESSAGE)
                or (content and calls and tool_format in NO_CONTENT_WITH_CALLS))


@pytest.mark.parametrize(("family", "case"), [(family, case) for family in FAMILIES for case in CASES
                                               if case_applies(family, case)])
def test_streamed_output_parses_into_calls(family, case):
    content, calls = CASES[case]
    detected = chat_format(family)
    turn = detected.turn(TOOLS, ToolChoice("auto"), parallel_tool_calls=parallel(family))
    answer = write_answer(FAMILIES[family].tool_format, content, calls)
    reasoning = "The user wants the weather </think-ish> first." if detected.reasoning else None
    opened = detected.reasoning is not None and detected.reasoning.opens_in_prompt(True)
    text = write_reasoning(reasoning, answer, opened) if reasoning else answer
    events, deltas = streamed_events(family, turn, text)
    assert without_ids(events) == expected_events(reasoning, content, calls)
    assert "".join(deltas) == text  # the vocabulary round-trips the text, markers included
    for event in events:
        if isinstance(event, ContentDelta | ReasoningDelta):
            assert not any(marker in event.text for marker in MARKERS), event
    call_ids = [event.id for event in events if isinstance(event, ToolCallStart)]
    id_shape = r"[A-Za-z0-9]{9}" if FAMILIES[family].tool_format.startswith("mistral") else r"call_[A-Za-z0-9]{24}"
    assert all(re.fullmatch(id_shape, call_id) for call_id in call_ids) and len(set(call_ids)) == len(call_ids)


@functools.cache
def lltokenizer(family: str) -> llguidance.LLTokenizer:
    tokenizer = family_tokenizer(family)
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_token_ids)


def matcher(family: str, lark: str) -> llguidance.LLMatcher:
    grammar = llguidance.LLMatcher(lltokenizer(family), lark, log_level=1)
    assert not grammar.is_error(), grammar.get_error()
    return grammar


def accepts(family: str, lark: str, text: str) -> bool:
    grammar = matcher(family, lark)
    ids = family_tokenizer(family).encode(text, add_special_tokens=False)
    return grammar.validate_tokens(ids) == len(ids) and grammar.consume_tokens(ids) and grammar.is_accepting()


@pytest.mark.parametrize("family", FAMILIES)
def test_grammars_accept_the_family_calls(family):
    tool_format = FAMILIES[family].tool_format
    turn = chat_format(family).turn(TOOLS, ToolChoice("auto"), parallel_tool_calls=parallel(family))
    calls = [("get_weather", {"city": "Zürich", "days": 2})]
    assert accepts(family, turn.grammar.lark, write_answer(tool_format, "", calls))
    if tool_format != "json":  # the generic format's answer is JSON too
        assert accepts(family, turn.grammar.lark, "Just an answer, no call.")
    assert not accepts(family, turn.grammar.lark, write_answer(tool_format, "", [("get_time", {"city": "Zürich"})]))
    required = chat_format(family).turn(TOOLS, ToolChoice("required")).grammar
    assert required.trigger is None
    assert accepts(family, required.lark, write_answer(tool_format, "", calls))
    assert not accepts(family, required.lark, "Just an answer, no call.")
    named = chat_format(family).turn(TOOLS, ToolChoice.function("search")).grammar
    assert not accepts(family, named.lark, write_answer(tool_format, "", calls))
    assert accepts(family, named.lark, write_answer(tool_format, "", [("search", {"query": "föhn"})]))
    if parallel(family):
        two = [*calls, ("search", {"query": "föhn"})]
        assert accepts(family, turn.grammar.lark, write_answer(tool_format, "", two))
        single = chat_format(family).turn(TOOLS, ToolChoice("auto"), parallel_tool_calls=False).grammar
        assert not accepts(family, single.lark, write_answer(tool_format, "", two))


ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "summary": {"type": "string"}},
                 "required": ["city", "summary"], "additionalProperties": False,
                 "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}


@pytest.mark.parametrize("family", FAMILIES)
def test_grammars_with_an_answer_format_take_the_calls_or_a_value_of_it(family):
    tool_format = FAMILIES[family].tool_format
    grammar = chat_format(family).turn(TOOLS, ToolChoice("auto"), answer=ANSWER_SCHEMA).grammar
    assert grammar.trigger is None  # the first token already chooses between the two
    answer = json.dumps({"city": "Zürich", "summary": "sunny"}, ensure_ascii=False)
    written = json.dumps({"response": json.loads(answer)}, ensure_ascii=False) if tool_format == "json" else answer
    if FAMILIES[family].vocabulary != "ggml-vocab-llama-spm.gguf":  # its tokens of text at the start begin "▁"
        assert accepts(family, grammar.lark, written)
    assert accepts(family, grammar.lark, write_answer(tool_format, "", [("get_weather", {"city": "Zürich"})]))
    assert not accepts(family, grammar.lark, write_answer(tool_format, "Just an answer, no call.", []))
    assert not accepts(family, grammar.lark, written.replace("summary", "weather"))
    forced = chat_format(family).turn(TOOLS, ToolChoice("required"), answer=ANSWER_SCHEMA).grammar
    assert not accepts(family, forced.lark, written)  # a forced call leaves no room for the answer


@pytest.mark.parametrize("family", [name for name, family in FAMILIES.items() if family.reasoning])
def test_reasoning_switch_and_end_marker(family):
    tokenizer = family_tokenizer(family)
    detected = chat_format(family)
    thinking, quiet = detected.turn(thinking=True), detected.turn(thinking=False)
    end = thinking.reasoning_end
    assert end.text == "</think>" and tokenizer.decode(list(end.token_ids), skip_special_tokens=False) == "</think>"
    assert len(end.token_ids) == 1  # an added token in these vocabularies
    assert quiet.reasoning_end is None
    messages = [{"role": "user", "content": "Hi"}]
    off = quiet.chat_inputs(messages)
    assert off.variables == {"enable_thinking": False}
    assert tokenizer.apply_chat_template(off.messages, **off.variables).rstrip().endswith("</think>")
    assert thinking.chat_inputs(messages).variables == {"enable_thinking": True}
    parser = quiet.stream_parser()
    assert coalesce(parser.feed("Hello there.") + parser.finish()) == [ContentDelta("Hello there.")]


def test_thinking_cannot_be_turned_off_without_a_switch():
    tokenizer = family_tokenizer("qwen3")
    no_switch = tokenizer.chat_template.replace("enable_thinking", "thinking_on")
    detected = detect_chat_format(tokenizer, chat_template=no_switch)
    assert detected.reasoning is not None and not detected.reasoning.can_disable
    with pytest.raises(ChatFormatError, match="cannot turn thinking off") as caught:
        detected.turn(thinking=False)
    assert caught.value.field == "reasoning_effort"


@pytest.mark.slow
def test_the_default_model_gets_the_generic_json_form():
    from tests.helpers.tokenizers import smollm2_reference, smollm2_tokenizer

    tokenizer, reference = smollm2_tokenizer(), smollm2_reference()
    detected = detect_chat_format(tokenizer)
    assert detected.tool_format.name == "json" and detected.reasoning is None
    turn = detected.turn(TOOLS, ToolChoice("auto"))
    inputs = turn.chat_inputs(conversation(two_calls=True))
    assert inputs.tools is None and inputs.messages[0]["role"] == "system"
    assert inputs.messages[0]["content"].startswith("You are terse.\n\nYou can call these tools:")
    assert [m["role"] for m in inputs.messages] == ["system", "user", "assistant", "user"]  # results: one message
    prompt = tokenizer.apply_chat_template(inputs.messages, **inputs.variables)
    assert prompt == reference.apply_chat_template(inputs.messages, tokenize=False, add_generation_prompt=True)
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}' in prompt
    assert '{"tool_response": {"name": "search", "content": "{\\"result\\": \\"search ok\\"}"}}' in prompt
    calls = [("get_weather", {"city": "Zürich", "days": 2}), ("search", {"query": "föhn"})]
    answer = write_answer("json", "", calls)
    parser, decoder = turn.stream_parser(), tokenizer.stream_decoder(turn.skip_special_tokens)
    events = [e for token_id in tokenizer.encode(answer, add_special_tokens=False)
              for e in parser.feed(decoder.step(token_id))] + parser.finish()
    assert without_ids(coalesce(events)) == expected_events(None, "", calls)
    lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_token_ids)
    for text, accepted in [(answer, True), ('{"response": "Hi"}', True), ("Hi", False)]:
        grammar = llguidance.LLMatcher(lltokenizer, turn.grammar.lark, log_level=1)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert (grammar.validate_tokens(ids) == len(ids) and grammar.consume_tokens(ids)
                and grammar.is_accepting()) == accepted
