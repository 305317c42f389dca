"""A tool call through the official `openai` SDK from a Qwen3-MoE model served with Qwen3's real chat
template (llama.cpp's copy), thinking switched off through the template: the server detects the template's
Hermes tool format, the model's call comes back as the SDK's tool call (tests/helpers/moe_models.py scripts
the model)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.llama_cpp_files import template_text
from tests.helpers.moe_models import write_tool_calling_qwen3_moe
from tests.helpers.server import make_llm, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = write_tool_calling_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-tools"),
                                          template_text("Qwen-Qwen3-0.6B.jinja"))
    with running_server(make_llm(folder, max_model_len=1024), model_alias="qwen3-moe") as server, \
            openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0,
                          timeout=60) as client:
        yield client


def test_a_tool_call_through_the_openai_sdk(client):
    [model] = client.models.list().data
    assert model.tool_call_format == "hermes"
    completion = client.chat.completions.create(
        model="qwen3-moe", messages=[{"role": "user", "content": "what is the weather in paris"}], tools=TOOLS,
        temperature=0, reasoning_effort="none")  # Qwen3's thinking switch off: the answer starts at once
    [choice] = completion.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
