"""A gpt-oss conversation in harmony through the official SDKs: llama.cpp's real gpt-oss template and a
tokenizer with harmony's real token ids, on a tiny gpt-oss (GptOssForCausalLM: windows, sinks, experts) scripted
to write an analysis message and then, its call forced by tool_choice, the call the grammar steers it to
(tests/helpers/harmony.py).

Through `openai`: the forced call arrives as `tool_calls` with valid arguments and the analysis as
`reasoning_content`, never in `content`, whole and streamed, on chat completions and Responses (a reasoning
item, then a function_call item). Through `anthropic`: the same conversation gives a thinking block and a
tool_use block, whole and streamed. Through `ollama` (no tool choice there: the analysis, which the model
repeats without a grammar, comes as `thinking`). `<|call|>` ends the turn though the model's end of sequence is
`<|return|>` alone; reasoning_effort reaches the template; "none" is refused naming the field."""

from __future__ import annotations

import json

import anthropic
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from tests.helpers.harmony import SCRIPT_CITY, SCRIPT_REASONING, write_harmony_model
from tests.helpers.server import make_llm, openai_client, running_server

QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
EXPECTED_CALL = ("get_weather", {"city": SCRIPT_CITY})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_harmony_model(tmp_path_factory.mktemp("harmony-model"))
    with running_server(make_llm(folder, max_model_len=1024), model_alias="gpt-oss") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server.port) as client:
        yield client


def ask(client, **fields) -> ChatCompletion:
    return client.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": QUESTION}],
                                          temperature=0, max_tokens=64, tools=TOOLS, **fields)


def test_models_show_the_harmony_format(client):
    [model] = client.models.list().data
    assert (model.tool_call_format, model.reasoning) == ("harmony", {"format": "harmony", "can_disable": False})
    assert model.architecture == "GptOssForCausalLM"


@pytest.mark.parametrize("choice", ["required", FORCED], ids=["required", "named"])
def test_a_forced_call_and_its_reasoning_on_chat_completions(client, choice):
    whole = ask(client, tool_choice=choice)
    ChatCompletion.model_validate(whole.model_dump())
    [answer] = whole.choices
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    assert answer.message.reasoning_content == SCRIPT_REASONING
    [call] = answer.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == EXPECTED_CALL
    assert call.id.startswith("call_")
    # <|call|> stopped it: the output is the analysis and the call, not up to max_tokens
    assert whole.usage.completion_tokens < 64
    with client.chat.completions.stream(model="gpt-oss", messages=[{"role": "user", "content": QUESTION}],
                                        temperature=0, max_tokens=64, tools=TOOLS, tool_choice=choice) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    [streamed] = final.choices
    assert streamed.finish_reason == "tool_calls" and not streamed.message.content
    assert streamed.message.reasoning_content == SCRIPT_REASONING
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed.message.tool_calls] == [
        EXPECTED_CALL]
    assert not [event for event in events if event.type == "content.delta" and event.delta]  # nothing came as content
    [done] = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert (done.name, json.loads(done.arguments)) == EXPECTED_CALL


def test_reasoning_effort_reaches_the_template_and_none_is_refused(client):
    low, high = ask(client, tool_choice=FORCED, reasoning_effort="low"), ask(client, tool_choice=FORCED,
                                                                            reasoning_effort="high")
    assert low.usage.prompt_tokens == high.usage.prompt_tokens  # "Reasoning: low" / "high": one token each
    assert low.choices[0].message.reasoning_content == SCRIPT_REASONING
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, tool_choice=FORCED, reasoning_effort="none")
    assert raised.value.body["param"] == "reasoning_effort" and "cannot turn thinking off" in \
        raised.value.body["message"]


def test_a_forced_call_and_its_reasoning_on_responses(client):
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    forced = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(model="gpt-oss", input=QUESTION, tools=tools, tool_choice=forced,
                                    temperature=0, max_output_tokens=64)
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    reasoning, call = whole.output
    assert [part.text for part in reasoning.content] == [SCRIPT_REASONING]
    assert (call.name, json.loads(call.arguments)) == EXPECTED_CALL and whole.output_text == ""
    with client.responses.create(model="gpt-oss", input=QUESTION, tools=tools, tool_choice=forced, temperature=0,
                                 max_output_tokens=64, stream=True) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == SCRIPT_REASONING
    assert (final.output[1].name, json.loads(final.output[1].arguments)) == EXPECTED_CALL
    assert not [event for event in events if event["type"] == "response.output_text.delta"]
    pieces = [event["delta"] for event in events if event["type"] == "response.reasoning_text.delta"]
    assert "".join(pieces) == SCRIPT_REASONING


def test_the_same_conversation_through_anthropic_gives_thinking_and_tool_use(server):
    tools = [{"name": tool["function"]["name"], "description": tool["function"].get("description", ""),
              "input_schema": tool["function"]["parameters"]} for tool in TOOLS]
    fields = {"model": "gpt-oss", "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}],
              "tools": tools, "tool_choice": {"type": "tool", "name": "get_weather"},
              "thinking": {"type": "enabled", "budget_tokens": 1024}, "extra_body": {"temperature": 0}}
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0) as sdk:
        message = sdk.messages.create(**fields)
        with sdk.messages.stream(**fields) as stream:
            deltas = [event.delta for event in stream if event.type == "content_block_delta"]
            streamed = stream.get_final_message()
    for answer in (message, streamed):
        assert [block.type for block in answer.content] == ["thinking", "tool_use"]
        assert answer.content[0].thinking == SCRIPT_REASONING
        assert (answer.content[1].name, answer.content[1].input) == EXPECTED_CALL
        assert answer.stop_reason == "tool_use"
    assert "".join(delta.thinking for delta in deltas if delta.type == "thinking_delta") == SCRIPT_REASONING
    assert not [delta for delta in deltas if delta.type == "text_delta"]


def test_ollama_gets_the_analysis_as_thinking(server):
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    options = {"temperature": 0, "num_predict": 24}
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat(model="gpt-oss", messages=messages, think=True, options=options)
    assert chat.message.thinking.startswith(SCRIPT_REASONING + "\n\n" + SCRIPT_REASONING)  # message after message
    assert not chat.message.content
    streamed = list(client.chat(model="gpt-oss", messages=messages, think=True, options=options, stream=True))
    assert "".join(part.message.thinking or "" for part in streamed) == chat.message.thinking
    assert not "".join(part.message.content or "" for part in streamed)
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="gpt-oss", messages=messages, think=False, options=options)
    assert raised.value.status_code == 400 and "cannot turn thinking off" in raised.value.error
