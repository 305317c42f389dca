"""Tool calls over Anthropic's Messages API and Ollama's chat, on the tiny grammar model given Qwen2's chat
template (Hermes calls, `<tool_call>` one token): a forced call comes back as a `tool_use` block the SDK
parses (whole and streamed, its input an object valid under the tool's schema), the conversation goes on
with the `tool_result`, and each API's tool turns render the same prompt as chat completions' spelling
of the same conversation (the prompt token counts are equal). On a scripted thinking model
(tests/helpers/tool_models.py), whole round trips under tool_choice auto on both APIs: thinking, two calls
(Ollama's each whole, arguments as objects; Anthropic's tool_use blocks), the results sent back, the
thinking and the answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import jsonschema
import ollama
import pytest

from tests.helpers.server import make_llm, running_server
from tests.helpers.server import post_ok as post
from tests.helpers.tool_models import THINKING_TEMPLATE, hermes_call, write_tool_model

TEMPLATE = Path(__file__).resolve().parents[1] / "helpers" / "templates" / "qwen2.jinja"
# bounded, so the random model's forced call ends well within max_tokens
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city"], "additionalProperties": False}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "the weather", "input_schema": SCHEMA}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                                "parameters": SCHEMA}}
QUESTION = {"role": "user", "content": "weather in Paris?"}
GREEDY = {"temperature": 0}  # a forced call of the random model ends in about 40 tokens


@pytest.fixture(scope="module")
def server(grammar_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-model")
    for path in grammar_model_dir.iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE.read_text()}))
    with running_server(make_llm(folder, max_model_len=1024), model_alias="tool-model") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0,
                             timeout=60) as client:
        yield client


def test_an_anthropic_tool_round_trip(server, client):
    forced = client.messages.create(model="tool-model", max_tokens=100, messages=[QUESTION], tools=[ANTHROPIC_TOOL],
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert forced.stop_reason == "tool_use"
    calls = [block for block in forced.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, SCHEMA)
    conversation = [QUESTION, {"role": "assistant", "content": [block.model_dump() for block in forced.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                                  "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model="tool-model", max_tokens=5, messages=conversation, tools=[ANTHROPIC_TOOL],
                                    tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens") and [block.type for block in answer.content] == ["text"]
    # the same conversation spelled as chat completions spell it reads the same prompt
    reference = post(server.port, "/v1/chat/completions", {
        "messages": [QUESTION, {"role": "assistant", "content": None, "tool_calls": [{
            "id": calls[0].id, "type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps(calls[0].input)}}]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}],
        "tools": [OPENAI_TOOL], "tool_choice": "none", "max_tokens": 5, "temperature": 0})
    prompt_tokens = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert prompt_tokens == reference["usage"]["prompt_tokens"]
    assert answer.content[0].text == reference["choices"][0]["message"]["content"]
    counted = client.messages.count_tokens(model="tool-model", messages=conversation, tools=[ANTHROPIC_TOOL],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == prompt_tokens


def test_an_anthropic_tool_call_streamed(client):
    fields = {"model": "tool-model", "max_tokens": 100, "messages": [QUESTION], "tools": [ANTHROPIC_TOOL],
              "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, "extra_body": GREEDY}
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert [block.model_dump(exclude={"id"}) for block in final.content] == [
        block.model_dump(exclude={"id"}) for block in whole.content]
    starts = [event.content_block for event in events if event.type == "content_block_start"]
    calls = [block for block in final.content if block.type == "tool_use"]
    assert [block.type for block in starts][-len(calls):] == ["tool_use"] * len(calls)
    assert [(block.id, block.name) for block in starts if block.type == "tool_use"] == [
        (block.id, block.name) for block in calls]
    arguments = "".join(event.delta.partial_json for event in events
                        if event.type == "content_block_delta" and event.delta.type == "input_json_delta")
    assert len(calls) == 1 and json.loads(arguments) == calls[0].input  # one call at most: parallel use disabled
    jsonschema.validate(calls[0].input, SCHEMA)


def test_ollama_tool_turns_render_as_chat_completions_do(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    assert "tools" in client.show("tool-model").capabilities
    arguments = {"city": "Paris", "days": 2}
    # raw JSON: the ollama client rewrites a tool's schema into its own model (it drops maxLength and the like)
    answer = ollama.ChatResponse.model_validate(post(server.port, "/api/chat", {
        "model": "tool-model", "stream": False, "tools": [OPENAI_TOOL], "options": {"temperature": 0, "num_predict": 5},
        "messages": [QUESTION, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": arguments}}]},
                     {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]}))
    reference = post(server.port, "/v1/chat/completions", {
        "messages": [QUESTION, {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1_0", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": json.dumps(arguments)}}]},
                     {"role": "tool", "tool_call_id": "call_1_0", "content": "sunny"}],
        "tools": [OPENAI_TOOL], "max_tokens": 5, "temperature": 0})
    assert answer.prompt_eval_count == reference["usage"]["prompt_tokens"]
    message = reference["choices"][0]["message"]
    assert answer.message.content == (message["content"] or "")
    assert [call.function.name for call in answer.message.tool_calls or []] == [
        call["function"]["name"] for call in message.get("tool_calls") or []]


# ---------------------------------------------------------------------------------- a scripted thinking model
# tests/helpers/tool_models.py: it thinks, calls get_weather and get_time, and after the results thinks and answers
WEATHER = hermes_call("get_weather", {"city": "Paris"})
TIME = hermes_call("get_time", {"zone": "CET"})
SCRIPT_CALLS = ["<think>\nI should look.\n</think>\n\n", WEATHER, "\n", TIME]
SCRIPT_ANSWER = ["<think>\nBoth came.\n</think>\n\n", "It is sunny ", "at noon."]
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for name, key in (("get_weather", "city"), ("get_time", "zone"))]
EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
ASK = [{"role": "user", "content": "what is the weather in paris and what time is it there"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, server):  # after `server`: one engine thread at a time
    folder = tmp_path_factory.mktemp("scripted-tools")
    write_tool_model(folder, SCRIPT_CALLS, SCRIPT_ANSWER, THINKING_TEMPLATE)
    with running_server(make_llm(folder, max_model_len=1024), model_alias="tools") as scripted:
        yield scripted


def test_an_ollama_tool_round_trip_with_thinking(scripted):
    client = ollama.Client(host=f"http://127.0.0.1:{scripted.port}", timeout=60)
    assert client.show("tools").capabilities == ["completion", "tools", "thinking"]
    reference = post(scripted.port, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "temperature": 0})
    called = client.chat(model="tools", messages=ASK, tools=TOOLS, options={"temperature": 0})
    assert [(call.function.name, dict(call.function.arguments)) for call in called.message.tool_calls] == EXPECTED_CALLS
    assert called.message.thinking == reference["choices"][0]["message"]["reasoning_content"] == "I should look."
    streamed = list(client.chat(model="tools", messages=ASK, tools=TOOLS, options={"temperature": 0}, stream=True))
    assert [(call.function.name, dict(call.function.arguments)) for part in streamed
            for call in part.message.tool_calls or ()] == EXPECTED_CALLS  # each call whole, once
    assert "".join(part.message.thinking or "" for part in streamed) == called.message.thinking
    results = [{"role": "tool", "content": text, "tool_name": name}
               for name, text in (("get_weather", "sunny"), ("get_time", "noon"))]
    answer = client.chat(model="tools", tools=TOOLS, options={"temperature": 0},
                         messages=[*ASK, called.message.model_dump(exclude_none=True), *results])
    assert (answer.message.thinking, answer.message.content) == ("Both came.", "It is sunny at noon.")
    assert not answer.message.tool_calls


def test_an_anthropic_tool_round_trip_with_thinking(scripted):
    tools = [{"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]} for tool in TOOLS]
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{scripted.port}", api_key="unused", max_retries=0) as sdk:
        fields = {"model": "tools", "max_tokens": 200, "messages": ASK, "tools": tools, "extra_body": GREEDY}
        called = sdk.messages.create(**fields)
        with sdk.messages.stream(**fields) as stream:
            final = stream.get_final_message()
        assert [block.type for block in called.content] == ["thinking", "tool_use", "tool_use"]
        assert called.stop_reason == final.stop_reason == "tool_use" and called.content[0].thinking == "I should look."
        assert [(block.name, block.input) for block in called.content[1:]] == EXPECTED_CALLS
        assert [block.model_dump(exclude={"id"}) for block in final.content] == [
            block.model_dump(exclude={"id"}) for block in called.content]
        results = [{"type": "tool_result", "tool_use_id": block.id, "content": text}
                   for block, text in zip(called.content[1:], ("sunny", "noon"))]
        answer = sdk.messages.create(**{**fields, "messages": [
            *ASK, {"role": "assistant", "content": [block.model_dump() for block in called.content]},
            {"role": "user", "content": results}]})
    assert [block.type for block in answer.content] == ["thinking", "text"] and answer.stop_reason == "end_turn"
    assert (answer.content[0].thinking, answer.content[1].text) == ("Both came.", "It is sunny at noon.")
