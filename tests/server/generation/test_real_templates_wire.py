"""Tool turns over the wire through real chat templates (llama.cpp's copies, tests/helpers/chat_families.py):
a chat completion and a Responses request with tools, an assistant's calls and their results reach the
engine as the prompt transformers renders from the same conversation in its own shape (arguments as objects,
each result after its call), and with the family's grammar, decoding flag and reasoning end. The server runs
the family's tokenizer on a recording engine thread (tests/helpers/request_wire.py): nothing is generated."""

from __future__ import annotations

import json

import pytest

from localserve.server.app import BackgroundServer, LocalServer
from localserve.server.config import ServerConfig
from localserve.server.registry.registry import serving_loaded
from tests.helpers.chat_families import family_tokenizer, reference_tokenizer
from tests.helpers.request_wire import CHAT, RESPONSES_HTTP, RecordingEngineThread, WireClient

TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ARGUMENTS = {"city": "Paris"}
CHAT_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
RESPONSES_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
]
# The same conversation as transformers' apply_chat_template takes it.
TRANSFORMERS_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21 C"},
]
FAMILIES = {"qwen2.5": {}, "qwen3": {"enable_thinking": True}, "llama3.1": {}, "hermes3": {},
            "qwen3.5": {"enable_thinking": True}}
THINKING = ("qwen3", "qwen3.5")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_chat_llm):
    engine_thread = RecordingEngineThread(tiny_chat_llm.engine)
    engine_thread.start()
    tokenizer = family_tokenizer(request.param)
    models = serving_loaded(engine_thread, tokenizer, request.param)
    server = BackgroundServer(LocalServer(models, ServerConfig(port=0))).start()
    client = WireClient(server.port, engine_thread)
    yield request.param, tokenizer, client, engine_thread
    client.close()
    server.stop()
    engine_thread.stop()


@pytest.mark.parametrize("fmt", [CHAT, RESPONSES_HTTP])
def test_tool_turns_reach_the_engine_as_transformers_renders_them(family, fmt):
    name, tokenizer, client, engine_thread = family
    body = ({"messages": CHAT_TURNS, "tools": [{"type": "function", "function": TOOL}]} if fmt == CHAT
            else {"input": RESPONSES_TURNS, "tools": [{"type": "function", **TOOL}]})
    outcome = client.send_body(fmt, body)
    assert outcome.accepted, outcome
    reference = reference_tokenizer(name).apply_chat_template(
        TRANSFORMERS_TURNS, tools=[{"type": "function", "function": TOOL}], add_generation_prompt=True,
        tokenize=False, **FAMILIES[name])
    assert engine_thread.prompts[-1] == tokenizer.encode(reference, add_special_tokens=False)
    params = outcome.params
    assert params.grammar is not None and params.grammar.kind == "lark"  # the calls' grammar, tool_choice auto
    assert params.reasoning_end == ("</think>" if name in THINKING else None)
    assert params.skip_special_tokens is (name != "llama3.1")  # Llama's <|python_tag|> is a special token
