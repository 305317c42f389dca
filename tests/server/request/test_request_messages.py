"""A conversation's messages in each API's form, checked into roles and text, and every refusal naming
where it is."""

from __future__ import annotations

import pytest

from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.messages import MessageFormat, parse_messages
from localserve.server.request.validation import ProtocolError

LIMITS = RequestLimits(max_input_items=2)


def test_messages_in_each_form():
    strict = MessageFormat(text_parts=("text",), at_least_one=True, refused_roles={"tool": "no tools"},
                                  null_assistant_content=True, unused_text_fields=("name",))
    loose = MessageFormat(text_parts=("input_text", "output_text"), bare_string=True, item_types=("message",))
    assert parse_messages("hi", "input", loose, LIMITS) == [{"role": "user", "content": "hi"}]
    assert parse_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]},
                                  {"role": "assistant", "content": None, "name": "x"}], "m", strict, LIMITS) == [
        {"role": "system", "content": "ab"}, {"role": "assistant", "content": ""}]
    cases = [
        ("hi", strict, ("invalid_type", "m")), ([], strict, ("invalid_value", "m")),
        ([{"role": "user", "content": "a"}] * 3, strict, ("array_above_max_length", "m")),
        ([3], strict, ("invalid_type", "m[0]")), ([{"role": "tool", "content": "a"}], strict,
                                                  ("unsupported_value", "m[0].role")),
        ([{"role": "wizard", "content": "a"}], strict, ("invalid_value", "m[0].role")),
        ([{"role": "user", "content": "a", "name": 5}], strict, ("invalid_type", "m[0].name")),
        ([{"role": "user", "content": [{"type": "image_url"}]}], strict, ("unsupported_value", "m[0].content[0]")),
        ([{"role": "assistant", "content": None}], loose, ("invalid_type", "m[0].content")),
        ([{"type": "function_call", "role": "user", "content": "a"}], loose, ("unsupported_value", "m[0].type")),
        ([{"role": "tool", "content": "a"}], loose, ("invalid_value", "m[0].role")),
    ]
    for value, form, expected in cases:
        with pytest.raises(ProtocolError) as raised:
            parse_messages(value, "m", form, LIMITS)
        assert (raised.value.code, raised.value.param) == expected, value


def test_resent_reasoning_joins_its_assistant_turn():
    """Chat completions' `reasoning_content` (else `reasoning`) on an assistant message; a Responses reasoning
    item's text joins the assistant turn after it (a message or calls), and starts a new one; reasoning before
    a user message belongs to no turn; a user's reasoning field is not read."""
    chat = MessageFormat(text_parts=("text",), tool_turns="chat", reasoning_fields=("reasoning_content", "reasoning"))
    assert parse_messages([{"role": "user", "content": "q", "reasoning_content": 5},
                           {"role": "assistant", "content": "a", "reasoning_content": "", "reasoning": "r"}],
                          "m", chat, RequestLimits()) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    responses = MessageFormat(text_parts=("input_text", "output_text"), item_types=("message",),
                              tool_turns="responses")

    def thought(text: str) -> dict:
        return {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
                "content": [{"type": "reasoning_text", "text": text}]}

    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    parsed = parse_messages([{"role": "user", "content": "q"}, thought("one"), {"role": "assistant", "content": "a"},
                             thought("two"), call, {**call, "call_id": "c2"},
                             {"type": "function_call_output", "call_id": "c1", "output": "x"},
                             thought("lost"), {"role": "user", "content": "again"}], "m", responses, RequestLimits())
    assert [(message["role"], message.get("reasoning_content")) for message in parsed] == [
        ("user", None), ("assistant", "one"), ("assistant", "two"), ("tool", None), ("user", None)]
    assert [call["id"] for call in parsed[2]["tool_calls"]] == ["c1", "c2"]  # both calls in the turn after "two"
    assert parse_messages([thought("a"), thought("b"), {"role": "assistant", "content": "x"}], "m", responses,
                          RequestLimits())[0]["reasoning_content"] == "ab"
