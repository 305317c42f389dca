"""Tools beside an answer format under tool_choice auto, on every API: one grammar, so the model either calls a
tool or answers in the schema. On the scripted Hermes model (tests/helpers/tool_models.py), which calls
get_weather and, after the result, answers with a JSON object.

openai-agents' `Agent(tools=[get_weather], output_type=Weather)` sends exactly this on chat completions and on
Responses. The package cannot be a test dependency here (it pins websockets below the server's 17 and brings
mcp, starlette and cryptography), so its requests are replayed as it sends them: captured field for field from
openai-agents 0.24.0 (`Runner.run` with `OpenAIChatCompletionsModel` and `OpenAIResponsesModel`), each turn
built from the previous answer as the agent builds it. The round trip ends with the typed output. Ollama's
`format` and Anthropic's `output_config.format` beside tools do the same with their clients."""

from __future__ import annotations

import copy
import json

import anthropic
import jsonschema
import ollama
from openai.types.chat import ChatCompletion
from pydantic import BaseModel

from tests.helpers.tool_models import WEATHER_TOOL


class Weather(BaseModel):
    """The agent's output type."""

    city: str
    summary: str


# openai-agents' JSON schema of Weather (strict) and of get_weather's arguments, as it sends them
OUTPUT_SCHEMA = {"properties": {"city": {"title": "City", "type": "string"},
                                "summary": {"title": "Summary", "type": "string"}},
                 "required": ["city", "summary"], "title": "Weather", "type": "object", "additionalProperties": False}
ARGUMENTS_SCHEMA = {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                    "title": "get_weather_args", "type": "object", "additionalProperties": False}
INSTRUCTIONS = "Answer with the weather."
QUESTION = "What is the weather in Paris?"
AGENT_CHAT_REQUEST = {
    "model": "tools",
    "messages": [{"content": INSTRUCTIONS, "role": "system"}, {"role": "user", "content": QUESTION}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True,
                                                               "schema": OUTPUT_SCHEMA}},
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": ARGUMENTS_SCHEMA, "strict": True}}],
}
AGENT_RESPONSES_REQUEST = {
    "model": "tools", "include": [], "input": [{"content": QUESTION, "role": "user"}], "instructions": INSTRUCTIONS,
    "text": {"format": {"type": "json_schema", "name": "final_output", "schema": OUTPUT_SCHEMA, "strict": True}},
    "tools": [{"name": "get_weather", "parameters": ARGUMENTS_SCHEMA, "strict": True, "type": "function",
               "description": "The weather in a city."}],
}
TOOL_OUTPUT = "sunny"  # what the agent's get_weather returns


def test_an_agent_with_tools_and_an_output_type_on_chat_completions(weather_client):
    first = weather_client.chat.completions.create(**AGENT_CHAT_REQUEST)
    ChatCompletion.model_validate(first.model_dump())
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    second = copy.deepcopy(AGENT_CHAT_REQUEST)  # the agent's next turn: its call and the tool's output appended
    second["messages"] += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
                           {"role": "tool", "tool_call_id": call.id, "content": TOOL_OUTPUT}]
    final = weather_client.chat.completions.create(**second).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert Weather.model_validate_json(final.message.content) == Weather(city="Paris", summary="sunny")


def test_an_agent_with_tools_and_an_output_type_on_responses(weather_client):
    first = weather_client.responses.create(**AGENT_RESPONSES_REQUEST)  # parsed into the SDK's Response
    [call] = first.output
    assert call.type == "function_call" and (call.name, json.loads(call.arguments)) == ("get_weather",
                                                                                         {"city": "Paris"})
    second = copy.deepcopy(AGENT_RESPONSES_REQUEST)
    second["input"] += [{"arguments": call.arguments, "call_id": call.call_id, "name": call.name,
                         "type": "function_call", "id": call.id, "status": "completed"},
                        {"call_id": call.call_id, "output": TOOL_OUTPUT, "type": "function_call_output"}]
    final = weather_client.responses.create(**second)
    assert final.status == "completed" and [item.type for item in final.output] == ["message"]
    assert Weather.model_validate_json(final.output_text) == Weather(city="Paris", summary="sunny")


def test_a_forced_call_beside_a_format_is_still_a_call(weather_client):
    forced = weather_client.chat.completions.create(**AGENT_CHAT_REQUEST, tool_choice="required").choices[0]
    assert forced.finish_reason == "tool_calls" and [call.function.name for call in forced.message.tool_calls] == [
        "get_weather"]


def test_ollama_format_beside_tools(weather_server):
    client = ollama.Client(host=f"http://127.0.0.1:{weather_server.port}", timeout=60)
    ask = [{"role": "user", "content": QUESTION}]
    called = client.chat(model="tools", messages=ask, tools=[WEATHER_TOOL], format=OUTPUT_SCHEMA,
                         options={"temperature": 0})
    [call] = called.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    answer = client.chat(model="tools", tools=[WEATHER_TOOL], format=OUTPUT_SCHEMA, options={"temperature": 0},
                         messages=[*ask, called.message.model_dump(exclude_none=True),
                                   {"role": "tool", "content": TOOL_OUTPUT, "tool_name": "get_weather"}])
    assert not answer.message.tool_calls
    jsonschema.validate(json.loads(answer.message.content), OUTPUT_SCHEMA)


def test_anthropic_output_config_beside_tools(weather_server):
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": ARGUMENTS_SCHEMA}
    fields = {"model": "tools", "max_tokens": 100, "tools": [tool], "extra_body": {"temperature": 0},
              "output_config": {"format": {"type": "json_schema", "schema": OUTPUT_SCHEMA}}}
    ask = [{"role": "user", "content": QUESTION}]
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{weather_server.port}", api_key="unused",
                             max_retries=0) as sdk:
        called = sdk.messages.create(messages=ask, **fields)
        assert called.stop_reason == "tool_use" and [block.type for block in called.content] == ["tool_use"]
        assert (called.content[0].name, called.content[0].input) == ("get_weather", {"city": "Paris"})
        answer = sdk.messages.create(messages=[
            *ask, {"role": "assistant", "content": [block.model_dump() for block in called.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": called.content[0].id,
                                          "content": TOOL_OUTPUT}]}], **fields)
    assert answer.stop_reason == "end_turn" and [block.type for block in answer.content] == ["text"]
    assert Weather.model_validate_json(answer.content[0].text) == Weather(city="Paris", summary="sunny")
