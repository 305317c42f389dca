"""Gemma 4's chat format on its real template (google-gemma-4-31B-it.jinja) and vocabulary
(ggml-vocab-gemma-4.gguf), both llama.cpp's: detection, a conversation with calls and tool results rendered
through the chat-format code, output streamed token by token and parsed into reasoning and calls, the
grammar of its calls (llguidance); and the notation's arguments read back as written (hypothesis)."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from localserve.tokenizer.chat_format import detect_chat_format
from localserve.tokenizer.stream_events import (
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from localserve.tokenizer.tokenizer import Tokenizer
from localserve.tokenizer.tool_formats.gemma4 import read_arguments
from localserve.tokenizer.tools import ToolChoice, ToolSpec
from tests.helpers.llama_cpp_files import template_text, vocabulary_path
from tests.helpers.tool_outputs import gemma4_value

WEATHER = ToolSpec("get_weather", "Current weather in a city", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]})
SEARCH = ToolSpec("search", "Search the web", {
    "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object", "properties": {
        "site": {"type": "string"}, "recent": {"type": "boolean"}}}, "tags": {"type": "array",
                                                                              "items": {"type": "string"}}},
    "required": ["query"]})
TOOLS = [WEATHER, SEARCH]
Q = '<|"|>'


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(vocabulary_path("ggml-vocab-gemma-4.gguf"))


@pytest.fixture(scope="module")
def template():
    return template_text("google-gemma-4-31B-it.jinja")


@pytest.fixture(scope="module")
def chat_format(tokenizer, template):
    return detect_chat_format(tokenizer, template)


def call_text(name: str, arguments: str) -> str:
    return f"<|tool_call>call:{name}{arguments}<tool_call|>"


def test_detected_format_and_end_of_generation(tokenizer, chat_format):
    assert chat_format.tool_format.name == "gemma4"
    assert chat_format.reasoning.name == "gemma4_thought" and chat_format.reasoning.can_disable
    assert chat_format.reasoning.opens_in_prompt(True) is False is chat_format.reasoning.opens_in_prompt(False)
    ids = {text: tokenizer.encode(text, add_special_tokens=False) for text in ("<turn|>", "<|tool_response>", Q)}
    assert all(len(token) == 1 for token in ids.values())
    assert ids["<turn|>"][0] in tokenizer.eos_token_ids and ids["<|tool_response>"][0] in tokenizer.eos_token_ids


def test_a_conversation_with_calls_and_results_renders_in_the_notation(tokenizer, template, chat_format):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "days": 2})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"}]
    inputs = chat_format.turn(TOOLS, ToolChoice("auto")).chat_inputs(messages)
    prompt = tokenizer.apply_chat_template(inputs.messages, tools=inputs.tools, chat_template=template,
                                           add_generation_prompt=True, **inputs.variables)
    assert prompt.startswith("<bos><|turn>system\n<|think|>\nBe brief.<|tool>declaration:get_weather{")
    assert call_text("get_weather", f"{{city:{Q}Zürich{Q},days:2}}") in prompt
    assert f"<|tool_response>response:get_weather{{value:{Q}sunny, 21 °C{Q}}}<tool_response|>" in prompt
    off = chat_format.turn(TOOLS, ToolChoice("auto"), thinking=False).chat_inputs(messages[:2])
    assert tokenizer.apply_chat_template(off.messages, chat_template=template, add_generation_prompt=True,
                                         **off.variables).endswith("<|turn>model\n<|channel>thought\n<channel|>")


def streamed(tokenizer, turn, text: str) -> list:
    decoder = tokenizer.stream_decoder(skip_special_tokens=turn.skip_special_tokens)
    parser = turn.stream_parser()
    events = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        events += parser.feed(decoder.step(token_id))
    return coalesce(events + parser.finish())


def test_output_streams_into_reasoning_and_calls(tokenizer, chat_format):
    turn = chat_format.turn(TOOLS, ToolChoice("auto"))
    arguments = f"{{city:{Q}Zürich, CH{Q},days:2,unit:{Q}celsius{Q}}}"
    search = f"{{filters:{{recent:true,site:{Q}a.b{Q}}},query:{Q}föhn <tool_call|> {{x:1}}{Q},tags:[{Q}a{Q},{Q}b{Q}]}}"
    text = ("<|channel>thought\nThe user wants the weather.<channel|>" + call_text("get_weather", arguments)
            + call_text("search", search))
    events = streamed(tokenizer, turn, text)
    first = {"city": "Zürich, CH", "days": 2, "unit": "celsius"}
    second = {"filters": {"recent": True, "site": "a.b"}, "query": "föhn <tool_call|> {x:1}", "tags": ["a", "b"]}
    assert events[0] == ReasoningDelta("The user wants the weather.")
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.name for s in starts] == ["get_weather", "search"]
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [json.loads(e.arguments) for e in ends] == [first, second] and all(e.whole for e in ends)
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta)) == \
        json.dumps(first, ensure_ascii=False) + json.dumps(second, ensure_ascii=False)


def test_a_call_cut_short_or_unreadable_is_not_whole(tokenizer, chat_format):
    turn = chat_format.turn(TOOLS, ToolChoice("auto"))
    cut = streamed(tokenizer, turn, f"<|tool_call>call:get_weather{{city:{Q}Zür")
    assert [e.whole for e in cut if isinstance(e, ToolCallEnd)] == [False]
    broken = streamed(tokenizer, turn, call_text("get_weather", "{city:}"))
    assert [e.whole for e in broken if isinstance(e, ToolCallEnd)] == [False]
    not_a_call = streamed(tokenizer, turn, "Hi <|tool_call>nonsense<tool_call|>")
    assert "".join(getattr(e, "text", "") for e in not_a_call) == "Hi <|tool_call>nonsense<tool_call|>"


@pytest.fixture(scope="module")
def lltokenizer(tokenizer):
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_token_ids)


def accepts(tokenizer, lltokenizer, lark: str, text: str) -> bool:
    """Whether the grammar `lark` takes `text`'s tokens and can end after them."""
    matcher = llguidance.LLMatcher(lltokenizer, lark, log_level=1)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_the_grammar_takes_calls_by_their_schemas(tokenizer, lltokenizer, chat_format):
    def takes(lark: str, text: str) -> bool:
        return accepts(tokenizer, lltokenizer, lark, text)

    auto = chat_format.turn(TOOLS, ToolChoice("auto")).grammar
    weather = call_text("get_weather", f"{{city:{Q}Zürich{Q},days:2}}")
    assert auto.trigger == "<|tool_call>" and auto.trigger_token_id is not None
    assert takes(auto.lark, weather)
    assert takes(auto.lark, "Just an answer.")
    assert takes(auto.lark, weather + call_text("search", f"{{query:{Q}föhn{Q},tags:[]}}"))
    assert takes(auto.lark, call_text("search", f"{{filters:{{recent:false}},query:{Q}x{Q}}}"))
    for bad in ("{days:2}", f"{{city:{Q}Zürich{Q},days:2.5}}", f"{{city:{Q}x{Q},unit:{Q}kelvin{Q}}}",
                f"{{days:2,city:{Q}x{Q}}}"):  # no city; a fraction of days; an unknown unit; out of order
        assert not takes(auto.lark, call_text("get_weather", bad)), bad
    assert not takes(auto.lark, call_text("get_time", f"{{city:{Q}x{Q}}}"))
    required = chat_format.turn(TOOLS, ToolChoice("required")).grammar
    assert takes(required.lark, weather) and not takes(required.lark, "An answer.")
    single = chat_format.turn(TOOLS, ToolChoice("auto"), parallel_tool_calls=False).grammar
    assert not takes(single.lark, weather + weather)


# The notation has no escapes: a string (or a key) holding the <|"|> marker cannot be written, so neither holds
# its characters (found by this test: a generated key '<|"|>').
TEXT = st.text(st.characters(exclude_characters='<|"', exclude_categories=["Cs"]), max_size=12)
KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True) | TEXT.filter(lambda key: len(key) <= 6)  # quoted
VALUES = st.recursive(st.one_of(TEXT, st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6),
                                st.floats(allow_nan=False, allow_infinity=False, width=32)),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=8)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(KEYS, VALUES, max_size=4))
@example({"_": {}, "a b": [], "": None})
def test_generated_arguments_read_back_as_written(arguments):
    assert read_arguments(gemma4_value(arguments)) == arguments


def test_gemma3s_end_of_turn_ends_generation_in_its_ggufs(tmp_path):
    import gguf

    path = tmp_path / "gemma3-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁a", "<end_of_turn>"]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3, 3, 3, 2] + [6] * 256 + [1, 3])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                  writer.close):
        write()
    assert Tokenizer.from_gguf(path).eos_token_ids == [1, len(tokens) - 1]
