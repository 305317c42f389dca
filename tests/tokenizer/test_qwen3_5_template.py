"""Qwen3.5's chat format on its real template (llama.cpp's Qwen3.5-4B.jinja) and vocabulary (ggml-vocab-qwen35.gguf).

The vocabulary rebuilt from the GGUF encodes as transformers' own Qwen3.5 tokenizer class built from the same
tokens and merges, and as llama.cpp's tokenizer cases say (which skip the NFC step). A multi-turn agent
conversation (reasoning, calls, tool results) goes through the chat-format path and renders, as text and ids,
as transformers' `apply_chat_template` renders it. The template itself writes the model's answers: what it
renders for an assistant message, streamed in pieces or token by token, parses back into that message's
reasoning, content and calls (hypothesis). Last, where a resent conversation first differs from the tokens the
previous turn held (its prompt and its output): the template keeps only the reasoning since the last user
message and rebuilds the rest, which is what prefix reuse can hope for.
"""

from __future__ import annotations

import json
import unicodedata
from functools import cache
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from localserve.tokenizer.chat_format import ChatFormat, ChatTurn, detect_chat_format
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from localserve.tokenizer.tokenizer import Tokenizer
from localserve.tokenizer.tools import ToolChoice, ToolSpec
from tests.helpers.chat_families import FAMILIES, QWEN3_TOKENS, family_tokenizer, tokenizer_metadata
from tests.helpers.llama_cpp_files import vocabulary_cases
from tests.helpers.tool_outputs import TRICKY

FAMILY = "qwen3.5"
VOCABULARY = FAMILIES[FAMILY].vocabulary
CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WEATHER = ToolSpec("get_weather", "Current weather in a city, in °C", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "ratio": {"type": "number"}},
    "required": ["city"]})
SEARCH = ToolSpec("search", "Search the web", {
    "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["query"]})
TOOLS = [WEATHER, SEARCH]
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n"


@cache
def ours() -> Tokenizer:
    return family_tokenizer(FAMILY)


@cache
def chat_format() -> ChatFormat:
    return detect_chat_format(ours())


@cache
def reference():
    """transformers' Qwen3_5Tokenizer built from the GGUF's tokens and merges (the family's names on the
    placeholder ids, as for `ours`), with the template: the reference for ids and for rendering."""
    from tokenizers import AddedToken
    from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

    metadata = tokenizer_metadata(VOCABULARY)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    for token_id, (text, _) in QWEN3_TOKENS.items():
        tokens[token_id] = text
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Qwen3_5Tokenizer(vocab={text: index for index, text in enumerate(tokens)}, merges=merges,
                                 eos_token="<|im_end|>", pad_token="<|endoftext|>")
    added = [(text, True) for text in CONTROL] + list(QWEN3_TOKENS.values())
    tokenizer.add_tokens([AddedToken(text, special=special, normalized=False) for text, special in added])
    tokenizer.chat_template = ours().chat_template
    return tokenizer


# ---------------------------------------------------------------- the vocabulary


def test_vocabulary_encodes_as_transformers_and_llama_cpp():
    # the family's tokenizer is the GGUF's (its metadata read once per machine), names on unused placeholders
    assert tokenizer_metadata(VOCABULARY)["tokenizer.ggml.pre"] == "qwen35"
    cases = vocabulary_cases(VOCABULARY)
    assert len(cases) == 50
    for text, _ in cases:
        assert ours().encode(text, add_special_tokens=False) == reference().encode(text, add_special_tokens=False)
    # llama.cpp does not normalize: its cases of decomposed text (e + U+0301) differ from the tokenizer's, which
    # composes them first; without the NFC step the split pattern (marks kept inside words) gives its ids.
    decomposed = [text for text, _ in cases if unicodedata.normalize("NFC", text) != text]
    assert len(decomposed) == 3
    for text, expected in cases:
        if text not in decomposed:
            assert ours().encode(text, add_special_tokens=False) == expected, text
    unnormalized = BackendTokenizer.from_str(ours().backend.to_str())
    unnormalized.normalizer = None
    assert all(unnormalized.encode(text, add_special_tokens=False).ids == expected for text, expected in cases)


WORDS = st.text(alphabet=st.characters(categories=["L", "M", "N", "P", "S", "Zs"]), max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(WORDS, st.sampled_from(["'s", "'LL", "\n", "\r\n", "  ", "\t", "e\u0301", "1234"])),
                max_size=6).map("".join))
@example("Cafe\u0301 ǹ 12345 'Ve it's\n\n  x")
def test_generated_text_encodes_as_transformers(text):
    assert ours().encode(text, add_special_tokens=False) == reference().encode(text, add_special_tokens=False)


def test_detected_format_and_markers():
    detected = chat_format()
    assert (detected.tool_format.name, detected.reasoning.name) == ("qwen3_coder", "think")
    assert detected.reasoning.can_disable
    assert detected.reasoning.opens_in_prompt(True) and not detected.reasoning.opens_in_prompt(False)
    for marker in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "<|im_end|>"):
        assert len(ours().encode(marker, add_special_tokens=False)) == 1, marker
    assert ours().eos_token_ids == [ours().token_to_id("<|im_end|>")]
    turn = detected.turn(TOOLS)
    assert turn.reasoning_end.token_ids == (ours().token_to_id("</think>"),)


# ---------------------------------------------------------------- rendering

def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def agent_conversation(reasoning_resent: bool = True) -> list[dict]:
    """Two user queries; the first answered with reasoning written in the content (as some clients resend it),
    the second by two calls, their results and an answer, each step's reasoning in `reasoning_content`."""
    def reasoning(text: str) -> dict:
        return {"reasoning_content": text} if reasoning_resent else {}

    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi, who are you?"},
        {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nAn assistant."},
        {"role": "user", "content": "Weather in Zürich for 2 days, and what is föhn?"},
        {"role": "assistant", "content": "Let me check.", **reasoning("Two things: weather, then föhn."),
         "tool_calls": [call("call_1", "get_weather", {"city": "Zürich", "days": 2, "metric": True}),
                        call("call_2", "search", {"query": "föhn", "filters": {"lang": "de"}, "tags": ["wind"]})]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 °C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "A warm, dry wind."},
        {"role": "assistant", "content": "Sunny, 21 °C; föhn is a warm, dry wind.", **reasoning("Both answered.")},
        {"role": "user", "content": "Thanks!"}]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("upto", [4, 5, 7, 9])
def test_agent_conversation_renders_as_transformers(thinking, upto):
    turn = chat_format().turn(TOOLS, ToolChoice("auto"), thinking=thinking)
    inputs = turn.chat_inputs(agent_conversation()[:upto])
    prompt = ours().apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    expected = reference().apply_chat_template(inputs.messages, tools=inputs.tools, tokenize=False,
                                               add_generation_prompt=True, **inputs.variables)
    assert prompt == expected
    ids = reference().apply_chat_template(inputs.messages, tools=inputs.tools, add_generation_prompt=True,
                                          return_dict=False, **inputs.variables)
    assert ours().encode_chat(inputs.messages, tools=inputs.tools, **inputs.variables) == list(ids)
    assert prompt.endswith(GENERATION_PROMPT if thinking else "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_what_the_template_keeps_of_past_turns():
    inputs = chat_format().turn(TOOLS).chat_inputs(agent_conversation()[:7])
    prompt = ours().apply_chat_template(inputs.messages, tools=inputs.tools, **inputs.variables)
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                             '{"type": "function", "function": {"name": "get_weather", ')
    assert "</IMPORTANT>\n\nYou are terse.<|im_end|>\n" in prompt
    # before the last user query: the reasoning is gone, even where the content held it
    assert "<|im_start|>assistant\nAn assistant.<|im_end|>" in prompt and "A greeting" not in prompt
    # since it: the block, the calls with their arguments bare (JSON for objects, Python's spelling for True)
    assert ("<|im_start|>assistant\n<think>\nTwo things: weather, then föhn.\n</think>\n\nLet me check.\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            '<function=search>\n<parameter=query>\nföhn\n</parameter>\n<parameter=filters>\n{"lang": "de"}\n'
            '</parameter>\n<parameter=tags>\n["wind"]\n</parameter>\n</function>\n</tool_call><|im_end|>\n') in prompt
    # the results: one user turn, each in its own block
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny, 21 °C\n</tool_response>\n<tool_response>\n"
                           "A warm, dry wind.\n</tool_response><|im_end|>\n" + GENERATION_PROMPT)


def test_a_conversation_without_a_user_query_is_refused():
    from localserve.tokenizer.chat_template import ChatTemplateError

    with pytest.raises(ChatTemplateError, match="No user query found"):
        ours().apply_chat_template([{"role": "system", "content": "x"}])


# ---------------------------------------------------------------- the template writes the answers


def answer_text(message: dict, thinking: bool = True) -> str:
    """What a model of the template writes for `message` after the generation prompt: the template's own
    rendering of it as the latest turn, less the prompt before it and the end of the turn (with thinking off the
    prompt holds the empty block the template writes for a turn without reasoning)."""
    turn = chat_format().turn(TOOLS, thinking=thinking)
    question = [{"role": "user", "content": "Go."}]
    before = turn.chat_inputs(question)
    prompt = ours().apply_chat_template(before.messages, tools=before.tools, **before.variables)
    after = turn.chat_inputs([*question, message])
    whole = ours().apply_chat_template(after.messages, tools=after.tools, add_generation_prompt=False,
                                       **after.variables)
    assert whole.startswith(prompt) and whole.endswith("<|im_end|>\n")
    return whole[len(prompt):-len("<|im_end|>\n")]


def streamed(turn: ChatTurn, text: str, cuts: list[int] | None = None) -> tuple[list, list[str]]:
    """`text` parsed as it streams: cut at `cuts`, or token by token through the decoder as the engine does."""
    parser = turn.stream_parser()
    if cuts is not None:
        bounds = [0, *sorted(set(cuts)), len(text)]
        deltas = [text[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]
    else:
        decoder = ours().stream_decoder(skip_special_tokens=turn.skip_special_tokens)
        deltas = [decoder.step(token_id) for token_id in ours().encode(text, add_special_tokens=False)]
    events = [event for delta in deltas for event in parser.feed(delta)]
    return coalesce(events + parser.finish()), deltas


def expected_events(reasoning: str, content: str, calls: list[tuple[str, dict]]) -> list:
    events = ([ReasoningDelta(reasoning)] if reasoning else []) + ([ContentDelta(content)] if content else [])
    for index, (name, arguments) in enumerate(calls):
        events.append(ToolCallStart(index, "<id>", name))
        events += [ToolCallArgumentsDelta(index, "<arguments>"), ToolCallEnd(index, json.dumps(arguments))]
    return events


def comparable(events: list) -> list:
    """Ids left out, each call's argument pieces joined (checked to add up to the end's JSON), JSON compared."""
    out, pieces = [], {}
    for event in events:
        if isinstance(event, ToolCallStart):
            out.append(ToolCallStart(event.index, "<id>", event.name))
        elif isinstance(event, ToolCallArgumentsDelta):
            pieces[event.index] = pieces.get(event.index, "") + event.text
            if not isinstance(out[-1], ToolCallArgumentsDelta):
                out.append(ToolCallArgumentsDelta(event.index, "<arguments>"))
        elif isinstance(event, ToolCallEnd):
            assert event.whole and pieces.pop(event.index) == event.arguments
            out.append(ToolCallEnd(event.index, json.dumps(json.loads(event.arguments))))
        else:
            out.append(event)
    return out


MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>",
           "</function>", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<tool_response>")
TEXT = st.lists(st.one_of(st.sampled_from(TRICKY), st.text(alphabet="abc xyz.,0é世\n", min_size=1)),
                max_size=6).map("".join).filter(lambda text: not any(marker in text for marker in MARKERS))
WEATHER_ARGUMENTS = st.fixed_dictionaries({"city": TEXT.filter(str.strip)}, optional={
    "days": st.integers(-100, 10**6), "metric": st.booleans(), "ratio": st.sampled_from([0.5, -2.25, 1e-3, 3.0])})
SEARCH_ARGUMENTS = st.fixed_dictionaries({"query": TEXT}, optional={
    "filters": st.dictionaries(st.sampled_from(["site", "lang"]), st.one_of(TEXT, st.integers()), max_size=2),
    "tags": st.lists(TEXT, max_size=2)})
CALLS = st.lists(st.one_of(st.tuples(st.just("get_weather"), WEATHER_ARGUMENTS),
                           st.tuples(st.just("search"), SEARCH_ARGUMENTS)), max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reasoning=TEXT, content=TEXT, calls=CALLS, thinking=st.booleans(), cuts=st.lists(st.integers(0, 400)),
       by_tokens=st.booleans())
@example(reasoning="weather first", content="Let me check.", calls=[("get_weather", {"city": "Zürich", "days": 2})],
         thinking=True, cuts=[], by_tokens=True)
@example(reasoning="", content="", calls=[("search", {"query": "\n</tool_call\n"})], thinking=True, cuts=[1, 2, 3],
         by_tokens=False)
def test_what_the_template_writes_parses_back(reasoning, content, calls, thinking, cuts, by_tokens):
    reasoning = reasoning if thinking else ""  # with thinking off the model answers at once
    message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                               "tool_calls": [call(f"call_{n}", name, arguments) for n, (name, arguments)
                                              in enumerate(calls)]}
    text = answer_text(message, thinking)
    turn = chat_format().turn(TOOLS, ToolChoice("auto"), thinking=thinking)
    events, deltas = streamed(turn, text, None if by_tokens else [cut for cut in cuts if cut < len(text)])
    assert "".join(deltas) == text
    # the template trims the reasoning and the content
    expected = expected_events(reasoning.strip(), content.strip(), calls)
    assert comparable(events) == expected


@cache
def lltokenizer():
    import llguidance

    return llguidance.LLTokenizer(ours().backend.to_str(), eos_token=ours().eos_token_ids)


def grammar_accepts(lark: str, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(lltokenizer(), lark, log_level=1)
    assert not matcher.is_error(), matcher.get_error()
    ids = ours().encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_the_grammar_takes_calls_as_the_template_writes_them():
    calls = [("get_weather", {"city": "Zürich\nCH", "days": -3, "metric": False, "ratio": 1e-05}),
             ("search", {"query": " föhn ", "filters": {"site": "a.b", "n": [1, True]}, "tags": ["x", "y"]})]
    message = {"role": "assistant", "content": "Checking.", "reasoning_content": "r",
               "tool_calls": [call(f"call_{n}", name, arguments) for n, (name, arguments) in enumerate(calls)]}
    answer = answer_text(message).split("</think>\n\n", 1)[1]  # the grammar starts after the reasoning
    assert "<parameter=metric>\nFalse\n</parameter>" in answer and "<parameter=ratio>\n1e-05\n" in answer
    auto = chat_format().turn(TOOLS, ToolChoice("auto")).grammar.lark
    assert grammar_accepts(auto, answer)
    required = chat_format().turn(TOOLS, ToolChoice("required")).grammar.lark
    calls_only = answer.removeprefix("Checking.\n\n")
    assert grammar_accepts(required, calls_only) and not grammar_accepts(required, answer)
    assert grammar_accepts(required, calls_only.replace("False", "false"))
    assert not grammar_accepts(required, calls_only.replace("False", "no"))
    assert not grammar_accepts(required, calls_only.replace("\n-3\n", "\nthree\n"))


# ---------------------------------------------------------------- what a resent conversation keeps


def first_difference(held: list[int], prompt: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b), min(len(held), len(prompt)))


def held_and_resent(conversation: list[dict], step: int, resent: list[dict],
                    thinking: bool = True) -> tuple[list[int], int, list[int]]:
    """The tokens a sequence held after answering `conversation[:step]` with `conversation[step]` (its prompt,
    then the answer the template writes and the end of the turn), the prompt's length, and the prompt of
    `resent` (the conversation resent as the next turn)."""
    turn = chat_format().turn(TOOLS, thinking=thinking)
    before = turn.chat_inputs(conversation[:step])
    prompt = ours().encode_chat(before.messages, tools=before.tools, **before.variables)
    answer = answer_text(conversation[step], thinking)
    output = ours().encode(answer, add_special_tokens=False) + [ours().token_to_id("<|im_end|>")]
    again = turn.chat_inputs(resent)
    return prompt + output, len(prompt), ours().encode_chat(again.messages, tools=again.tools, **again.variables)


def test_where_a_resent_conversation_differs():
    """Figures (tokens of this vocabulary): what the next turn can reuse of what the sequence held."""
    full = agent_conversation(reasoning_resent=True)
    # a tool step resent with its reasoning: the whole sequence (prompt, reasoning, calls, end) is reused
    held, prompt_length, resent = held_and_resent(full, 4, full[:7])
    assert first_difference(held, resent) == len(held)
    # the same step resent without it (as the APIs' clients resend calls): the template writes an empty block,
    # "<think>" "\n\n" where the prompt ended "<think>" "\n": the difference is one token before the output
    bare = agent_conversation(reasoning_resent=False)
    held, prompt_length, resent = held_and_resent(full, 4, bare[:7])
    assert first_difference(held, resent) == prompt_length - 1
    # after a new user message the template drops every earlier block: the difference is where the answer's
    # turn began, before the generation prompt's "<think>" "\n"
    held, prompt_length, resent = held_and_resent(full, 2, full[:4])
    assert first_difference(held, resent) == prompt_length - 2
    # with thinking off the prompt's empty block goes too: "<think>" "\n\n" "</think>" "\n\n"
    quiet = [{**message, "content": "An assistant."} if index == 2 else message for index, message in enumerate(full)]
    held, prompt_length, resent = held_and_resent(quiet, 2, quiet[:4], thinking=False)
    assert first_difference(held, resent) == prompt_length - 4
    # so a new question after a tool loop loses all of the loop since its question: what the last step held
    # differs from the next prompt where the loop's first step began to answer
    held, prompt_length, resent = held_and_resent(full, 7, full[:9])
    turn = chat_format().turn(TOOLS)
    loop_start = turn.chat_inputs(full[:4])
    first_step = len(ours().encode_chat(loop_start.messages, tools=loop_start.tools, **loop_start.variables))
    assert first_difference(held, resent) == first_step - 2
