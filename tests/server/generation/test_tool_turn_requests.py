"""Coding agents' tool turns as they send them, on the scripted Hermes model (tests/helpers/tool_models.py), which
calls get_weather and, after the result, answers.

Codex CLI's Responses requests (streamed, `store: false`, `client_metadata`, `include: []`): its MCP tools come
as a `namespace` tool (a group of function tools, in the openai SDK's types), flattened here into their function
tools with their names kept, so a call comes back naming its function and its namespace; a
`function_call_output` may name the function instead of the call (`call_id` is optional in the SDK's types).
A hosted tool (`web_search`) cannot run here: refused with a message saying so, unless the request's
tool_choice leaves it uncalled (then it is dropped). llama.cpp's `/apply-template` renders tools and tool turns
as chat completions does (the prompt it gives is the prompt chat completions counts)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response

from tests.helpers.server import post_ok as post
from tests.helpers.tool_models import JSON_ANSWER, WEATHER_TOOL

WEATHER_PARAMETERS = WEATHER_TOOL["function"]["parameters"]
SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"}},
             "required": ["command"], "additionalProperties": False}}
WEATHER_NAMESPACE = {"type": "namespace", "name": "mcp__weather", "description": "The weather MCP server's tools.",
                     "tools": [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                                "parameters": WEATHER_PARAMETERS}]}
CLIENT_METADATA = {"x-codex-installation-id": "3f1c0a9e-5b7d-4c2a-9e8f-0d1b2c3a4e5f",
                   "session_id": "019a0b1c-2d3e-7f40-8a9b-0c1d2e3f4a5b"}
ASK = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "what is the weather in paris"}]}


def codex_request(input_items: list[dict], tools: list[dict], **fields) -> dict:
    """A Responses request as Codex CLI builds one (codex-rs: ResponsesApiRequest, client_metadata)."""
    return {"model": "tools", "instructions": "You are Codex, a coding agent.", "input": input_items, "tools": tools,
            "tool_choice": "auto", "parallel_tool_calls": False, "store": False, "stream": True, "include": [],
            "prompt_cache_key": CLIENT_METADATA["session_id"], "extra_body": {"client_metadata": CLIENT_METADATA},
            **fields}


def final_response(client, request: dict) -> Response:
    with client.responses.create(**request) as stream:
        events = list(stream)
    assert events[-1].type == "response.completed", events[-1]
    return events[-1].response


def test_codex_namespace_tools_and_an_output_without_call_id(weather_client):
    first = final_response(weather_client, codex_request([ASK], [SHELL, WEATHER_NAMESPACE]))
    [call] = first.output
    assert call.type == "function_call" and (call.name, call.namespace) == ("get_weather", "mcp__weather")
    assert json.loads(call.arguments) == {"city": "Paris"}
    # Codex sends the whole conversation back (store: false), its output naming the function, not the call
    follow_up = [ASK, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "name": "get_weather", "namespace": "mcp__weather",
                  "output": "sunny"}]
    second = final_response(weather_client, codex_request(follow_up, [SHELL, WEATHER_NAMESPACE]))
    assert second.output_text == JSON_ANSWER[0]


@pytest.mark.parametrize("hosted", [{"type": "web_search"}, {"type": "web_search_preview"},
                                    {"type": "code_interpreter", "container": {"type": "auto"}}])
def test_a_hosted_tool_is_refused_saying_so(weather_client, hosted):
    with pytest.raises(openai.BadRequestError) as refused:
        weather_client.responses.create(**codex_request([ASK], [SHELL, hosted]))
    error = refused.value.body
    assert (error["code"], error["param"]) == ("unsupported_value", "tools[1].type")
    assert "hosted tool" in error["message"] and hosted["type"] in error["message"]


def test_a_hosted_tool_the_request_never_calls_is_dropped(weather_client):
    answer = final_response(weather_client, codex_request([ASK], [SHELL, {"type": "web_search"}], tool_choice="none"))
    assert [item.type for item in answer.output] == ["message"]


def test_apply_template_renders_tools_and_tool_turns_as_chat_completions_does(weather_server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conversation = [{"role": "user", "content": "what is the weather in paris"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"model": "tools", "messages": conversation, "tools": [WEATHER_TOOL]}
    prompt = post(weather_server.port, "/apply-template", body)["prompt"]
    # the template's own rendering of the tools, of the call (its arguments an object) and of the result
    assert "Tools: get_weather" in prompt and '"arguments": {"city": "Paris"}' in prompt and "(for call_1)" in prompt
    counted = post(weather_server.port, "/v1/chat/completions", {**body, "max_tokens": 1})["usage"]["prompt_tokens"]
    assert len(post(weather_server.port, "/tokenize", {"content": prompt})["tokens"]) == counted
