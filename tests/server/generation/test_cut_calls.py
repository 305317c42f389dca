"""A tool call cut short by the token limit, on every API, whole and streamed, with the official clients: the
scripted Hermes model (tests/helpers/tool_models.py) writes its call in two pieces, so `max_tokens` 1 cuts it
inside its arguments. Such a call is never handed out (a client would get arguments that are no JSON object:
Ollama's client refuses the whole answer); the answer is what came before it, with the length finish. A call
whole at the limit is kept. A conversation sent back holding a cut call (an older answer of this server, as
Open WebUI sends its history back) is accepted: the call's text is the model's own text, and a tool result may
answer it."""

from __future__ import annotations

import json

import anthropic
import ollama

from tests.helpers.server import post_json, wait_until_idle
from tests.helpers.tool_models import WEATHER_TOOL

ASK = [{"role": "user", "content": "what is the weather in paris"}]
CUT = {"max_tokens": 1, "temperature": 0}  # the call's first piece: its name and part of its arguments
CUT_ARGUMENTS = '{"city": "Par'  # what the first piece holds of the arguments
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                  "input_schema": WEATHER_TOOL["function"]["parameters"]}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}


def test_chat_completions_drop_a_cut_call_whole_and_streamed(weather_server, weather_client):
    whole = weather_client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER_TOOL], **CUT)
    [choice] = whole.choices
    assert (choice.finish_reason, choice.message.tool_calls, choice.message.content or "") == ("length", None, "")
    chunks = list(weather_client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER_TOOL],
                                                         stream=True, **CUT))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert not any(delta.tool_calls for delta in deltas)
    assert "".join(delta.content or "" for delta in deltas) == ""
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    wait_until_idle(weather_server.server.models.serving_now().engine)


def test_a_call_whole_at_the_limit_is_kept(weather_client):
    whole = weather_client.chat.completions.create(model="tools", messages=ASK, tools=[WEATHER_TOOL], max_tokens=2,
                                                   temperature=0)
    [choice] = whole.choices
    assert choice.finish_reason == "length"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


def test_responses_drop_a_cut_call_whole_and_streamed(weather_client):
    fields = {"model": "tools", "input": ASK, "tools": [RESPONSES_TOOL], "max_output_tokens": 1, "temperature": 0}
    whole = weather_client.responses.create(**fields)
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["message"]
    assert whole.output_text == ""
    with weather_client.responses.create(stream=True, **fields) as stream:
        events = list(stream)
    assert not any(event.type.startswith("response.function_call") for event in events)
    final = events[-1].response
    assert final.status == "incomplete" and [item.type for item in final.output] == ["message"]


def test_anthropic_drops_a_cut_call_whole_and_streamed(weather_server):
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{weather_server.port}", api_key="unused",
                             max_retries=0) as client:
        fields = {"model": "tools", "max_tokens": 1, "messages": ASK, "tools": [ANTHROPIC_TOOL],
                  "extra_body": {"temperature": 0}}
        whole = client.messages.create(**fields)
        with client.messages.stream(**fields) as stream:
            events = list(stream)
            final = stream.get_final_message()
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    assert [block.model_dump() for block in whole.content] == [block.model_dump() for block in final.content] == [
        {"type": "text", "text": "", "citations": None}]
    assert not any(event.type == "content_block_start" and event.content_block.type == "tool_use" for event in events)


def test_ollama_never_hands_out_a_cut_call(weather_server):
    client = ollama.Client(host=f"http://127.0.0.1:{weather_server.port}", timeout=60)
    whole = client.chat(model="tools", messages=ASK, tools=[WEATHER_TOOL], options={"num_predict": 1,
                                                                                    "temperature": 0})
    assert (whole.done_reason, whole.message.tool_calls, whole.message.content) == ("length", None, "")
    parts = list(client.chat(model="tools", messages=ASK, tools=[WEATHER_TOOL], stream=True,
                             options={"num_predict": 1, "temperature": 0}))
    assert not any(part.message.tool_calls for part in parts) and parts[-1].done_reason == "length"
    kept = client.chat(model="tools", messages=ASK, tools=[WEATHER_TOOL], options={"num_predict": 2,
                                                                                   "temperature": 0})
    assert [(call.function.name, dict(call.function.arguments)) for call in kept.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


# ---------------------------------------------------------------------------------- a cut call sent back
def cut_turn(arguments: str = CUT_ARGUMENTS) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "call_cut", "type": "function", "function": {
        "name": "get_weather", "arguments": arguments}}]}


def test_chat_history_holding_a_cut_call_is_the_models_own_text(weather_server):
    go_on = {"role": "user", "content": "go on"}
    status, cut = post_json(weather_server.port, "/v1/chat/completions", {
        "model": "tools", "messages": [*ASK, cut_turn(), go_on], "tools": [WEATHER_TOOL], **CUT})
    assert status == 200, cut
    status, as_text = post_json(weather_server.port, "/v1/chat/completions", {
        "model": "tools", "messages": [*ASK, {"role": "assistant", "content": CUT_ARGUMENTS}, go_on],
        "tools": [WEATHER_TOOL], **CUT})
    assert status == 200 and cut["usage"]["prompt_tokens"] == as_text["usage"]["prompt_tokens"]
    # Open WebUI's history: the cut call, and the tool's answer to it
    status, answered = post_json(weather_server.port, "/v1/chat/completions", {
        "model": "tools", "messages": [*ASK, cut_turn(), {"role": "tool", "tool_call_id": "call_cut",
                                                          "content": "error: bad arguments"}],
        "tools": [WEATHER_TOOL], **CUT})
    assert status == 200, answered


def test_responses_input_holding_a_cut_call_is_accepted(weather_server):
    status, answer = post_json(weather_server.port, "/v1/responses", {
        "model": "tools", "tools": [RESPONSES_TOOL], "max_output_tokens": 1, "temperature": 0, "input": [
            *ASK, {"type": "function_call", "call_id": "call_cut", "name": "get_weather", "arguments": CUT_ARGUMENTS},
            {"type": "function_call_output", "call_id": "call_cut", "output": "error: bad arguments"}]})
    assert status == 200 and answer["status"] == "incomplete", answer


def test_ollama_history_holding_a_cut_call_is_accepted(weather_server):
    # what this server's /api/chat once answered (arguments as the unfinished text), sent back as it was
    status, answer = post_json(weather_server.port, "/api/chat", {
        "model": "tools", "stream": False, "tools": [WEATHER_TOOL], "options": {"num_predict": 1, "temperature": 0},
        "messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": CUT_ARGUMENTS}}]},
                     {"role": "tool", "content": "error: bad arguments", "tool_name": "get_weather"}]})
    assert status == 200, answer
    ollama.ChatResponse.model_validate(answer)
    wait_until_idle(weather_server.server.models.serving_now().engine)
