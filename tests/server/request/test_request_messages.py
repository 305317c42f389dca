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
