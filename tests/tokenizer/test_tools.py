"""Tools as requests offer them, the tool choice, and tool turns as chat templates read them."""

from __future__ import annotations

import pytest

from localserve.tokenizer.tools import ChatFormatError, ToolChoice, ToolSpec, template_messages

CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Weather", "strict": True, "parameters": CITY}}


def test_a_tool_from_openai_and_as_templates_read_it():
    tool = ToolSpec.from_openai(WEATHER)
    assert tool.template_tool() == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather",
        "parameters": CITY}}  # no "strict"
    bare = ToolSpec.from_openai({"type": "function", "function": {"name": "now"}})
    assert bare.template_tool() == {"type": "function", "function": {
        "name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(("tool", "field"), [
    ({"type": "retrieval"}, "type"),
    ({"type": "function", "function": "get_weather"}, "function"),
    ({"type": "function", "function": {"name": "has space"}}, "function.name"),
    ({"type": "function", "function": {"name": "x" * 65}}, "function.name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}, "function.parameters"),
    ({"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 1}}}},
     "function.parameters.properties"),
    ({"type": "function", "function": {"name": "f", "description": 3}}, "function.description"),
])
def test_a_tool_that_cannot_be_used_names_its_field(tool, field):
    with pytest.raises(ChatFormatError) as caught:
        ToolSpec.from_openai(tool)
    assert caught.value.field == field


def test_tool_choice_picks_the_tools_a_call_may_use():
    tools = [ToolSpec("a"), ToolSpec("b")]
    assert ToolChoice("auto").chosen_tools(tools) == tuple(tools)
    assert ToolChoice("none").chosen_tools(tools) == ()
    assert ToolChoice.function("b").chosen_tools(tools) == (tools[1],)
    with pytest.raises(ChatFormatError, match="'c' is not one of the tools") as caught:
        ToolChoice.function("c").chosen_tools(tools)
    assert caught.value.field == "tool_choice.function.name"
    with pytest.raises(ChatFormatError, match="needs at least one tool"):
        ToolChoice("required").chosen_tools([])
    with pytest.raises(ChatFormatError):
        ToolChoice("sometimes")


def test_tool_turns_as_templates_read_them():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21"},
                {"role": "tool", "tool_call_id": "call_2", "name": "clock", "content": "noon"}]
    converted = template_messages(messages)
    assert converted[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}}]
    assert converted[1]["content"] == ""  # templates read the content of a message with calls as text
    assert converted[2] == {"role": "tool", "tool_call_id": "call_1", "content": "21", "name": "get_weather"}
    assert converted[3]["name"] == "clock"  # a name the client gave is kept
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}'  # the input is not changed


@pytest.mark.parametrize(("arguments", "reason"), [("{oops", "is not valid JSON"), ("[1]", "must be a JSON object")])
def test_call_arguments_that_are_not_an_object_name_the_message(arguments, reason):
    messages = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}]}]
    with pytest.raises(ChatFormatError, match=reason) as caught:
        template_messages(messages)
    assert caught.value.field == "messages[0].tool_calls[0].function.arguments"
