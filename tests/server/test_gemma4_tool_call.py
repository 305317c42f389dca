"""A Gemma 4 model served: a tool call through the official `openai` SDK with Gemma 4's real chat template
(llama.cpp's copy), thinking switched off through the template: the server detects the template's Gemma 4
tool format and its reasoning format, the model's call in Gemma 4's notation comes back as the SDK's tool call
with JSON arguments, streamed and not (tests/helpers/gemma_models.py scripts the model)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.gemma_models import write_tool_calling_gemma4
from tests.helpers.llama_cpp_files import template_text
from tests.helpers.server import make_llm, openai_client, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather ahead.",
                                           "parameters": {"type": "object", "properties": {"days": {"type": "integer"}},
                                                          "required": ["days"]}}}]
MESSAGES = [{"role": "user", "content": "what is the weather in the next two days"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = write_tool_calling_gemma4(tmp_path_factory.mktemp("gemma4-tools"),
                                       template_text("google-gemma-4-31B-it.jinja"))
    with running_server(make_llm(folder, max_model_len=1024), model_alias="gemma4") as server, \
            openai_client(server.port) as client:
        yield client


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_tool_call_through_the_openai_sdk(client, tool_choice):
    [model] = client.models.list().data
    assert model.tool_call_format == "gemma4"
    completion = client.chat.completions.create(model="gemma4", messages=MESSAGES, tools=TOOLS, temperature=0,
                                                tool_choice=tool_choice, reasoning_effort="none")
    [choice] = completion.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"days": 2})


def test_a_streamed_tool_call(client):
    chunks = list(client.chat.completions.create(model="gemma4", messages=MESSAGES, tools=TOOLS, temperature=0,
                                                 reasoning_effort="none", stream=True))
    calls = [call for chunk in chunks for choice in chunk.choices for call in (choice.delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(call.function.arguments or "" for call in calls)) == {"days": 2}
    assert not "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
