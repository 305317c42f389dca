"""Whitespace around a tool call, whole and streamed, on every API: the call grammar lets a model write up to 4
whitespace characters after its calls, and it does (the default model SmolLM2 writes newlines after its JSON
call). That whitespace is no answer: the whole answer and the streamed one are the same (no content, no
whitespace-only text part, message item or text block before or after the call). On two scripted models
(tests/helpers/tool_models.py): Hermes calls, and the generic JSON form of templates without tool support."""

from __future__ import annotations

import json

import anthropic
import ollama
import pytest

from tests.helpers.server import openai_client
from tests.helpers.tool_models import (
    GENERIC_ANSWER,
    GENERIC_CALLS,
    GENERIC_TEMPLATE,
    HERMES_TEMPLATE,
    JSON_ANSWER,
    PLAIN_CALLS,
    WEATHER_TOOL,
    scripted_tool_server,
)

ASK = [{"role": "user", "content": "what is the weather in paris"}]
CALLS = [("get_weather", {"city": "Paris"})]
MODELS = {"hermes": (PLAIN_CALLS, JSON_ANSWER, HERMES_TEMPLATE), "json": (GENERIC_CALLS, GENERIC_ANSWER,
                                                                          GENERIC_TEMPLATE)}


@pytest.fixture(scope="module", params=list(MODELS))
def server(request, tmp_path_factory):
    calls, answer, template = MODELS[request.param]
    with scripted_tool_server(tmp_path_factory.mktemp(f"whitespace-{request.param}"), calls, answer,
                              template) as server:
        yield server


def test_chat_completions(server):
    with openai_client(server.port) as client:
        fields = {"model": "tools", "messages": ASK, "tools": [WEATHER_TOOL], "temperature": 0}
        whole = client.chat.completions.create(**fields).choices[0]
        chunks = [chunk.choices[0] for chunk in client.chat.completions.create(stream=True, **fields)]
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in whole.message.tool_calls] == CALLS
    assert [chunk.delta.content for chunk in chunks if chunk.delta.content] == []  # no "\n" after the call
    assert chunks[-1].finish_reason == "tool_calls"


def test_responses(server):
    with openai_client(server.port) as client:
        fields = {"model": "tools", "input": ASK, "tools": [{"type": "function", **WEATHER_TOOL["function"]}],
                  "temperature": 0}
        whole = client.responses.create(**fields)
        with client.responses.create(stream=True, **fields) as stream:
            events = list(stream)
    added = [event.item.type for event in events if event.type == "response.output_item.added"]
    streamed = events[-1].response
    assert [item.type for item in whole.output] == [item.type for item in streamed.output] == added == [
        "function_call"]
    assert [(item.name, json.loads(item.arguments)) for item in whole.output] == CALLS


def test_anthropic(server):
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0) as client:
        fields = {"model": "tools", "max_tokens": 100, "messages": ASK, "tools": [tool],
                  "extra_body": {"temperature": 0}}
        whole = client.messages.create(**fields)
        with client.messages.stream(**fields) as stream:
            events = list(stream)
            final = stream.get_final_message()
    started = [event.content_block.type for event in events if event.type == "content_block_start"]
    assert [block.type for block in whole.content] == [block.type for block in final.content] == started == [
        "tool_use"]
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert [(block.name, block.input) for block in whole.content] == CALLS


def test_ollama(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    whole = client.chat(model="tools", messages=ASK, tools=[WEATHER_TOOL], options={"temperature": 0})
    parts = list(client.chat(model="tools", messages=ASK, tools=[WEATHER_TOOL], stream=True,
                             options={"temperature": 0}))
    assert whole.message.content == "" and "".join(part.message.content or "" for part in parts) == ""
    assert [(call.function.name, dict(call.function.arguments)) for call in whole.message.tool_calls] == CALLS

