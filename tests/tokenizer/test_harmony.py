"""Harmony, gpt-oss's chat format, on llama.cpp's real template and a tokenizer with harmony's real token ids
(tests/helpers/harmony.py): detection, tools and tool results rendered as transformers renders the template
(one call per message, each result named after its call), the reasoning level, the stream parser on fixed
outputs at each limit and on generated ones split anywhere (and token by token through the decoder), and the
grammar of the calls (llguidance, on the same vocabulary)."""

from __future__ import annotations

import functools
import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.tokenizer.chat_format import detect_chat_format
from localserve.tokenizer.harmony import MAX_HEADER_CHARS, HarmonyFormat, HarmonyParser
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from localserve.tokenizer.tools import ChatFormatError, ToolChoice, ToolSpec
from tests.helpers.harmony import CALL_ID, RETURN_ID, harmony_reference, harmony_tokenizer
from tests.helpers.tool_outputs import SEARCH, WEATHER, json_arguments

TOOLS = [WEATHER, SEARCH]
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def harmony() -> HarmonyFormat:
    detected = detect_chat_format(harmony_tokenizer())
    assert isinstance(detected, HarmonyFormat)
    return detected


# tiktoken's o200k_base split pattern, as its public definition spells it
O200K = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["Don't", "SHOUT", "it's", "HelloWorld", "12345", "km/h", "...", "\n\n", "  ",
                                 " x", "😀", "Zürich's", "ÉCOLE", "café", "\t", "/", "<|end|>"]), max_size=10))
def test_a_gpt_oss_gguf_splits_text_as_o200k(pieces):
    """`tokenizer.ggml.pre` "gpt-4o" rebuilds o200k's pre-tokenizer (checked against the `regex` package)."""
    import regex
    from tokenizers import decoders

    text = "".join(pieces)
    split = harmony_tokenizer().backend.pre_tokenizer.pre_tokenize_str(text)
    byte_level = decoders.ByteLevel()
    assert [byte_level.decode([piece]) for piece, _ in split] == regex.findall(O200K, text)


def test_the_gpt_oss_template_is_harmony():
    detected = harmony()
    assert detected.tool_format.name == "harmony" and detected.reasoning.name == "harmony"
    assert not detected.reasoning.can_disable
    assert detected.stop_token_ids == (RETURN_ID, CALL_ID)  # <|return|> and <|call|> end the turn
    turn = detected.turn(TOOLS)
    assert turn.stop_token_ids == (RETURN_ID, CALL_ID) and not turn.skip_special_tokens and turn.reasons
    assert turn.reasoning_end is None  # the grammar covers the whole output: the channels are its structure


def conversation() -> list[dict]:
    """A system prompt, a question, two calls in one assistant message (JSON text arguments), their results
    in the other order."""
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "days": 2})}},
             {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": '{"query": "föhn"}'}}]
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Zürich, and what is föhn?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_2", "content": "a warm wind"},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]


def test_tools_and_results_render_as_transformers_one_call_per_message():
    ours, reference = harmony_tokenizer(), harmony_reference()
    inputs = harmony().turn(TOOLS, effort="high").chat_inputs(conversation())
    prompt = ours.apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    expected = reference.apply_chat_template(inputs.messages, tools=inputs.tools, tokenize=False,
                                             add_generation_prompt=True, **inputs.variables)
    assert prompt == expected
    ids = reference.apply_chat_template(inputs.messages, tools=inputs.tools, add_generation_prompt=True,
                                        return_dict=False, **inputs.variables)
    assert ours.encode_chat(inputs.messages, tools=inputs.tools, **inputs.variables) == list(ids)
    assert "Reasoning: high" in prompt and "# Instructions\n\nYou are terse." in prompt
    assert "type get_weather = (_: {\n// e.g. Zürich\ncity: string,\n// how many days\ndays?: number,\n}) => any;" \
        in prompt
    # each call, then the result that answers it, named after it (the template names a result after the last call)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Zürich", "days": 2}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temp\\": 21}"<|end|>'
            '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "föhn"}<|call|>'
            '<|start|>functions.search to=assistant<|channel|>commentary<|message|>"a warm wind"<|end|>'
            '<|start|>assistant') in prompt
    assert prompt.endswith("<|start|>assistant")


def test_a_tool_loops_resent_reasoning_is_its_analysis_message():
    """An assistant turn's resent reasoning (`reasoning_content`, server/request/messages.py) is the analysis the
    template renders before its call (its `thinking`), on the first of several calls only, as transformers
    renders it; with content beside it (which the template renders as the analysis itself and refuses with
    `thinking`) it is left out; a final answer's reasoning is dropped by the template."""
    ours, reference = harmony_tokenizer(), harmony_reference()
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
    second = {"id": "c2", "type": "function", "function": {"name": "search", "arguments": '{"query": "föhn"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call, second]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": "a wind"}]
    inputs = harmony().turn(TOOLS).chat_inputs(messages)
    prompt = ours.apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    assert prompt == reference.apply_chat_template(inputs.messages, tools=inputs.tools, tokenize=False,
                                                   add_generation_prompt=True, **inputs.variables)
    assert prompt.count("<|channel|>analysis<|message|>Look it up.<|end|>") == 1
    assert ("<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant "
            "to=functions.get_weather") in prompt
    with_content = [messages[0], {**messages[1], "content": "Checking.", "tool_calls": [call]}, messages[2]]
    inputs = harmony().turn(TOOLS).chat_inputs(with_content)
    prompt = ours.apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    assert "analysis<|message|>Checking.<|end|>" in prompt and "Look it up." not in prompt
    final = [messages[0], {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."},
             {"role": "user", "content": "Thanks"}]
    inputs = harmony().turn(TOOLS).chat_inputs(final)
    assert "Easy." not in ours.apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)


def test_a_tool_without_a_description_renders():
    bare = ToolSpec("ping")
    inputs = harmony().turn([bare]).chat_inputs([{"role": "user", "content": "Hi"}])
    prompt = harmony_tokenizer().apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    assert "// \ntype ping = () => any;" in prompt


@pytest.mark.parametrize(("effort", "level"), [(None, "medium"), ("minimal", "low"), ("low", "low"),
                                                ("medium", "medium"), ("high", "high"), ("xhigh", "high")])
def test_reasoning_effort_is_the_templates_level(effort, level):
    inputs = harmony().turn(effort=effort).chat_inputs([{"role": "user", "content": "Hi"}])
    assert inputs.variables == ({} if effort is None else {"reasoning_effort": level})
    prompt = harmony_tokenizer().apply_chat_template(inputs.messages, **inputs.variables)
    assert f"\nReasoning: {level}\n" in prompt


@pytest.mark.parametrize("fields", [{"thinking": False}, {"effort": "none"}, {"effort": "extreme"}])
def test_thinking_cannot_be_turned_off_nor_set_to_an_unknown_level(fields):
    with pytest.raises(ChatFormatError) as caught:
        harmony().turn(**fields)
    assert caught.value.field == "reasoning_effort"


def test_duplicate_tool_names_are_refused():
    with pytest.raises(ChatFormatError, match="two tools are named 'search'"):
        harmony().turn([SEARCH, SEARCH])


# ------------------------------------------------------------------ parsing
def parse(text: str, calls: bool = True, pieces: list[str] | None = None) -> list:
    parser = HarmonyParser(calls, new_call_id=lambda: "<id>")
    events = []
    for piece in pieces if pieces is not None else [text]:
        events += parser.feed(piece)
    return coalesce(events + parser.finish())


def call_events(name: str, arguments: str, whole: bool = True, index: int = 0) -> list:
    return [ToolCallStart(index, "<id>", name), ToolCallArgumentsDelta(index, arguments),
            ToolCallEnd(index, arguments, whole)]


ANALYSIS = "<|channel|>analysis<|message|>User wants weather. Use get_weather.<|end|><|start|>assistant"


@pytest.mark.parametrize(("text", "expected"), [
    # the spec's form: the recipient after the channel, a content type behind <|constrain|>
    (ANALYSIS + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}',
     [ReasoningDelta("User wants weather. Use get_weather."), *call_events("get_weather", '{"city":"Paris"}')]),
    # the template's form: the recipient before the channel
    (' to=functions.search<|channel|>commentary json<|message|>{"query": "a <|b|> c"}',
     call_events("search", '{"query": "a <|b|> c"}')),
    # a preamble the user sees, then the call; the <|call|> token's text if a decoder shows it
    ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.search<|message|>{}<|call|>', [ContentDelta("Checking."), *call_events("search", "{}")]),
    (ANALYSIS + "<|channel|>final<|message|>It is sunny.<|return|>",
     [ReasoningDelta("User wants weather. Use get_weather."), ContentDelta("It is sunny.")]),
    # two analysis messages are one reasoning text, a blank line apart
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Done", [ReasoningDelta("One.\n\nTwo."), ContentDelta("Done")]),
    # cut inside the arguments: the call ends with what it has, not whole
    (ANALYSIS + '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Pa',
     [ReasoningDelta("User wants weather. Use get_weather."),
      *call_events("get_weather", '{"city": "Pa', whole=False)]),
    # cut inside a header: no message began
    (ANALYSIS + "<|channel|>comm", [ReasoningDelta("User wants weather. Use get_weather.")]),
    # cut inside the analysis
    ("<|channel|>analysis<|message|>Hmm, the", [ReasoningDelta("Hmm, the")]),
    # a model that ignores the format: its text is content as written
    ("Hello there.\nHow are you?", [ContentDelta("Hello there.\nHow are you?")]),
    ("x" * MAX_HEADER_CHARS, []),  # at the limit it could still be a header when the output ends
    ("x" * (MAX_HEADER_CHARS + 1), [ContentDelta("x" * (MAX_HEADER_CHARS + 1))]),  # one past it, it cannot
], ids=["spec-call", "template-call", "preamble-call", "final", "two-analyses", "cut-arguments", "cut-header",
        "cut-analysis", "plain-text", "header-limit", "past-header-limit"])
def test_fixed_outputs_parse(text, expected):
    assert parse(text) == expected
    assert parse(text, pieces=list(text)) == expected  # one character at a time


def test_a_recipient_without_tools_offered_or_not_a_function_is_content():
    text = '<|channel|>commentary to=functions.search json<|message|>{"query": "x"}'
    assert parse(text, calls=False) == [ContentDelta('{"query": "x"}')]
    # a tool's message (as the template writes results) or a built-in tool's call: no call of ours
    assert parse('functions.search to=assistant<|channel|>commentary<|message|>"ok"') == [ContentDelta('"ok"')]
    assert parse('<|channel|>analysis to=python code<|message|>print(1)') == [ReasoningDelta("print(1)")]


def test_arguments_followed_by_text_are_not_whole():
    text = '<|channel|>commentary to=functions.search json<|message|>{"query": "x"} and more'
    assert parse(text) == call_events("search", '{"query": "x"}', whole=False)


HARMONY_TRICKY = ["<|", "|>", "<|en", "<|end", "<|start", "<|message", "to=", "to=functions.x", "\n", " ", "é", "😀",
                  "{", "}", '"', "analysis", "final"]


def body_text(min_size: int = 0) -> st.SearchStrategy[str]:
    """Message text with harmony-marker-like pieces, never a whole marker."""
    pieces = st.lists(st.one_of(st.sampled_from(HARMONY_TRICKY), st.text(alphabet="abc xyz.,!?0", min_size=1)),
                      min_size=min_size, max_size=8)
    return pieces.map("".join).filter(lambda text: len(text) >= min_size and not any(m in text for m in MARKERS))


def message(header: str, body: str, end: str = "<|end|>") -> str:
    return f"<|start|>assistant{header}<|message|>{body}{end}"


def split_points(text: str) -> st.SearchStrategy[list[str]]:
    return st.lists(st.integers(0, len(text)), max_size=12).map(
        lambda cuts: [text[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)], strict=True)])


@st.composite
def harmony_outputs(draw) -> tuple[str, list]:
    """An output (analyses, preambles, then a call or a final answer) and the events it must parse into."""
    text, reasoning, content = "", [], []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            reasoning.append(draw(body_text(1)))
            text += message("<|channel|>analysis", reasoning[-1])
        else:
            content.append(draw(body_text(1)))
            text += message("<|channel|>commentary", content[-1])
    events = ([ReasoningDelta("\n\n".join(reasoning))] if reasoning else [])
    if draw(st.booleans()):
        name, arguments = draw(st.sampled_from(["get_weather", "search"])), draw(json_arguments())
        written = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        header = draw(st.sampled_from([f"<|channel|>commentary to=functions.{name} <|constrain|>json",
                                       f" to=functions.{name}<|channel|>commentary json"]))
        text += message(header, written, "")
        calls = call_events(name, written)
    else:
        content.append(draw(body_text(1)))
        text += message("<|channel|>final", content[-1], "")
        calls = []
    events += [ContentDelta("\n\n".join(content))] if content else []
    return text[len("<|start|>assistant"):], events + calls  # the prompt ends with <|start|>assistant


def reorder(events: list) -> list:
    """Reasoning first, then content, then the call (the generated outputs interleave the first two)."""
    return coalesce(sorted(events, key=lambda e: 0 if isinstance(e, ReasoningDelta) else
                           1 if isinstance(e, ContentDelta) else 2))


@settings(max_examples=150, deadline=None)
@given(harmony_outputs(), st.data())
def test_generated_outputs_parse_the_same_however_split(output, data):
    text, expected = output
    whole = parse(text)
    assert reorder(whole) == expected
    assert parse(text, pieces=data.draw(split_points(text))) == whole
    for event in whole:
        if isinstance(event, ContentDelta | ReasoningDelta):
            assert not any(marker in event.text for marker in MARKERS), event


@settings(max_examples=40, deadline=None)
@given(harmony_outputs())
def test_generated_outputs_parse_the_same_token_by_token(output):
    """Split at every token boundary of the real vocabulary, decoded as the engine decodes (special tokens kept)."""
    text, _ = output
    tokenizer = harmony_tokenizer()
    decoder = tokenizer.stream_decoder(skip_special_tokens=harmony().turn(TOOLS).skip_special_tokens)
    deltas = [decoder.step(token_id) for token_id in tokenizer.encode(text, add_special_tokens=False)]
    assert "".join(deltas) == text
    assert parse(text, pieces=deltas) == parse(text)


# ------------------------------------------------------------------ grammar
@functools.cache
def lltokenizer() -> llguidance.LLTokenizer:
    tokenizer = harmony_tokenizer()
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=tokenizer.eos_token_ids)


def accepts(lark: str, text: str) -> bool:
    """The grammar takes `text`, whose last token ends the turn: the tokens before it are consumed and the mask
    then allows it (an end-of-sequence token, <|return|> here, is allowed by the mask but never consumed)."""
    grammar = llguidance.LLMatcher(lltokenizer(), lark, log_level=1)
    assert not grammar.is_error(), grammar.get_error()
    *ids, last = harmony_tokenizer().encode(text, add_special_tokens=False)
    if grammar.validate_tokens(ids) != len(ids) or not grammar.consume_tokens(ids):
        return False
    allowed = grammar.compute_logit_bias()[last] > 0
    return allowed and (last in harmony_tokenizer().eos_token_ids or grammar.consume_token(last)
                        and grammar.is_accepting())


ANALYSIS_OUT = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
PREAMBLE_OUT = "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant"
SPEC_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Zürich"}<|call|>'
TEMPLATE_CALL = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Zürich","days":2}<|call|>'
FINAL = "<|channel|>final<|message|>It is 21 °C.<|return|>"


def test_a_forced_call_grammar():
    required = harmony().turn(TOOLS, ToolChoice("required")).grammar
    assert required.trigger is None
    for text in (SPEC_CALL, TEMPLATE_CALL, ANALYSIS_OUT + SPEC_CALL, ANALYSIS_OUT + PREAMBLE_OUT + TEMPLATE_CALL):
        assert accepts(required.lark, text), text
    assert not accepts(required.lark, ANALYSIS_OUT + FINAL)  # a forced call leaves no room for an answer
    assert not accepts(required.lark, ANALYSIS_OUT + ANALYSIS_OUT + SPEC_CALL)  # one analysis, then the call
    assert not accepts(required.lark, SPEC_CALL.replace('"city"', '"town"'))  # the schema's required argument
    assert not accepts(required.lark, SPEC_CALL.replace('"Zürich"', "7"))
    assert not accepts(required.lark, SPEC_CALL.replace('{"city"', '{ "city"'))  # compact, as gpt-oss writes
    assert not accepts(required.lark, SPEC_CALL.replace("get_weather", "get_time"))
    assert not accepts(required.lark, SPEC_CALL.replace("<|call|>", "<|end|>"))
    named = harmony().turn(TOOLS, ToolChoice.function("search")).grammar
    assert not accepts(named.lark, SPEC_CALL)
    assert accepts(named.lark, ANALYSIS_OUT + '<|channel|>commentary to=functions.search <|constrain|>json'
                               '<|message|>{"query":"föhn"}<|call|>')


def test_an_auto_grammar_takes_a_call_or_an_answer_after_any_reasoning():
    auto = harmony().turn(TOOLS).grammar
    for text in (SPEC_CALL, ANALYSIS_OUT + ANALYSIS_OUT + PREAMBLE_OUT + TEMPLATE_CALL, FINAL,
                 ANALYSIS_OUT + FINAL):
        assert accepts(auto.lark, text), text
    assert not accepts(auto.lark, "It is 21 °C.")  # harmony's channels, from the first token
    assert not accepts(auto.lark, FINAL.replace("<|return|>", "<|call|>"))
    answer = {"type": "object", "properties": {"temp": {"type": "integer"}}, "required": ["temp"],
              "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    formatted = harmony().turn(TOOLS, answer=answer).grammar
    assert accepts(formatted.lark, ANALYSIS_OUT + '<|channel|>final<|message|>{"temp": 21}<|return|>')
    assert accepts(formatted.lark, ANALYSIS_OUT + SPEC_CALL)
    assert not accepts(formatted.lark, ANALYSIS_OUT + FINAL)


def test_a_body_cannot_spell_a_marker_that_ends_a_message():
    """"<|end|>" written in ordinary tokens inside the analysis would end it for the parser: the grammar refuses it."""
    tokenizer = harmony_tokenizer()
    auto = harmony().turn(TOOLS).grammar
    grammar = llguidance.LLMatcher(lltokenizer(), auto.lark, log_level=1)
    head = tokenizer.encode("<|channel|>analysis<|message|>so", add_special_tokens=False)
    spelled = [*tokenizer.encode("<|", add_special_tokens=False), *tokenizer.encode("end|>", add_special_tokens=False)]
    assert tokenizer.decode(spelled, skip_special_tokens=False) == "<|end|>"
    assert grammar.consume_tokens(head) and grammar.validate_tokens(spelled) < len(spelled)
    assert accepts(auto.lark, "<|channel|>analysis<|message|>a <| b |> end|><|end|><|start|>assistant" + FINAL)


def test_no_tools_no_grammar():
    assert harmony().turn(TOOLS, ToolChoice("none")).grammar is None
    assert harmony().turn().grammar is None
