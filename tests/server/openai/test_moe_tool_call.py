"""A Qwen3-MoE model served: a tool call through the official `openai` SDK with Qwen3's real chat template
(llama.cpp's copy), thinking switched off through the template (the server detects the template's Hermes
tool format, the model's call comes back as the SDK's tool call; tests/helpers/moe_models.py scripts the
model); /v1/models, Ollama's /api/show and llama.cpp's /props report its architecture and its total and
active parameters."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from safetensors import safe_open

from tests.helpers.llama_cpp_files import template_text
from tests.helpers.moe_models import write_tool_calling_qwen3_moe
from tests.helpers.server import make_llm, openai_client, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tool_calling_qwen3_moe(tmp_path_factory.mktemp("qwen3-moe-tools"),
                                        template_text("Qwen-Qwen3-0.6B.jinja"))


@pytest.fixture(scope="module")
def server(folder):
    with running_server(make_llm(folder, max_model_len=1024), model_alias="qwen3-moe") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server.port) as client:
        yield client


def test_architecture_and_parameters_reported(folder, server, client):
    config = json.loads((folder / "config.json").read_text())
    with safe_open(folder / "model.safetensors", "pt") as tensors:
        total = sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())  # noqa: SIM118
    unused_experts = config["num_experts"] - config["num_experts_per_tok"]
    active = total - unused_experts * 3 * config["hidden_size"] * config["moe_intermediate_size"]
    [model] = client.models.list().data
    assert (model.architecture, model.parameters) == ("Qwen3MoeForCausalLM", {"total": total, "active": active})
    shown = httpx.post(f"http://127.0.0.1:{server.port}/api/show", json={"model": "qwen3-moe"}).json()["model_info"]
    assert (shown["general.architecture"], shown["general.parameter_count"],
            shown["general.active_parameter_count"], shown["qwen3moe.expert_count"]) == ("qwen3moe", total, active, 4)
    props = httpx.get(f"http://127.0.0.1:{server.port}/props").json()
    assert (props["architecture"], props["parameters"]) == ("Qwen3MoeForCausalLM", {"total": total, "active": active})


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
