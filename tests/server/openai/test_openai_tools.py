"""Tool calls and reasoning over OpenAI's APIs against the official `openai` SDK, on a scripted thinking model
with a Hermes-style template (tests/helpers/tool_models.py): it thinks, then calls get_weather and get_time
(two parallel calls); after the tool results it thinks again and answers.

Chat completions with tool_choice auto, required, a named function and none, whole and streamed (the SDK's
stream helper reassembles the calls); the streamed calls' indexes, ids and argument pieces; a tool-result turn
rendered through the template, with the prefix cache hit; reasoning_effort "none" through the template's
switch. Responses function calling streamed over HTTP and over the websocket, through a tool turn with
previous_response_id (cached_tokens > 0). Every answer is parsed into the SDK's own types."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from websockets.asyncio.client import connect

from tests.helpers.server import collect_response, make_llm, openai_client, running_server, wait_until_idle
from tests.helpers.tool_models import ANSWER, CALLS, QUESTION, THINKING_TEMPLATE, TIME, WEATHER, write_tool_model

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-model")
    write_tool_model(folder, CALLS, ANSWER, THINKING_TEMPLATE)
    with running_server(make_llm(folder, max_model_len=1024), model_alias="tools") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server.port) as client:
        yield client


def ask(client, messages=None, **fields) -> ChatCompletion:
    return client.chat.completions.create(model="tools", messages=messages or [{"role": "user", "content": QUESTION}],
                                          temperature=0, **fields)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or ()]


def test_models_show_the_tool_call_format_and_reasoning(client):
    [model] = client.models.list().data
    assert model.id == "tools"
    assert (model.tool_call_format, model.reasoning) == ("hermes", {"format": "think", "can_disable": True})


@pytest.mark.parametrize("choice, parallel, expected", [
    ("auto", True, EXPECTED_CALLS),
    ("required", True, EXPECTED_CALLS),
    ({"type": "function", "function": {"name": "get_weather"}}, False, EXPECTED_CALLS[:1]),
], ids=["auto", "required", "named"])
def test_tool_choice_whole_and_streamed(client, choice, parallel, expected):
    whole = ask(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    ChatCompletion.model_validate(whole.model_dump())
    [answer] = whole.choices
    assert calls_of(answer.message) == expected and answer.finish_reason == "tool_calls"
    assert answer.message.content is None  # no trigger text, no call text in the content
    assert answer.message.reasoning_content == "I should look."
    assert all(call.id.startswith("call_") and call.type == "function" for call in answer.message.tool_calls)
    assert len({call.id for call in answer.message.tool_calls}) == len(expected)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 1  # the thinking is one piece here
    with client.chat.completions.stream(model="tools", messages=[{"role": "user", "content": QUESTION}],
                                        temperature=0, tools=TOOLS, tool_choice=choice,
                                        parallel_tool_calls=parallel) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert calls_of(final.choices[0].message) == expected and final.choices[0].finish_reason == "tool_calls"
    assert not final.choices[0].message.content
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert [(event.name, json.loads(event.arguments)) for event in done] == expected


def test_tool_choice_none_offers_no_tools(client):
    answer = ask(client, tools=TOOLS, tool_choice="none").choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason == "stop"
    assert answer.message.content == WEATHER + "\n" + TIME  # no tools offered: the text is the answer
    assert answer.message.reasoning_content == "I should look."
    with client.chat.completions.stream(model="tools", messages=[{"role": "user", "content": QUESTION}],
                                        temperature=0, tools=TOOLS, tool_choice="none") as stream:
        final = stream.get_final_completion().choices[0]
    assert (final.message.content, final.message.tool_calls, final.finish_reason) == (WEATHER + "\n" + TIME, None,
                                                                                      "stop")


def test_parallel_calls_stream_with_distinct_indexes_id_and_name_first(client):
    stream = client.chat.completions.create(model="tools", messages=[{"role": "user", "content": QUESTION}],
                                            temperature=0, tools=TOOLS, stream=True)
    deltas: dict[int, list] = {}
    reasoning, contents = [], []
    for chunk in stream:
        ChatCompletionChunk.model_validate(chunk.model_dump())
        for choice in chunk.choices:
            delta = choice.delta
            contents.append(delta.content or "")
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            for call in delta.tool_calls or ():
                deltas.setdefault(call.index, []).append(call)
    assert "".join(contents) == "" and "".join(reasoning) == "I should look."
    assert sorted(deltas) == [0, 1]
    for index, pieces in deltas.items():
        first, rest = pieces[0], pieces[1:]
        assert first.id and first.type == "function" and first.function.name == EXPECTED_CALLS[index][0]
        assert rest and all(piece.id is None and piece.function.name is None for piece in rest)
        arguments = "".join(piece.function.arguments or "" for piece in pieces)
        assert json.loads(arguments) == EXPECTED_CALLS[index][1]
    assert len(deltas[0]) == 3  # get_weather's arguments came in two pieces, as the model wrote them


def test_a_tool_result_turn_is_rendered_and_answered_from_the_cache(server, client):
    first = ask(client, tools=TOOLS).choices[0].message
    history = [{"role": "user", "content": QUESTION}, first.model_dump(exclude_none=True)]
    results = [{"role": "tool", "tool_call_id": call.id, "content": f"result of {call.function.name}"}
               for call in first.tool_calls]
    second = ask(client, history + results, tools=TOOLS)
    answer = second.choices[0]
    assert answer.message.content == "It is sunny at noon." and answer.finish_reason == "stop"
    assert answer.message.reasoning_content == "Both came." and answer.message.tool_calls is None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError) as raised:  # a result for a call nobody made
        ask(client, history + [{**results[0], "tool_call_id": "call_nobody"}], tools=TOOLS)
    assert raised.value.body["param"] == "messages" and "call_nobody" in raised.value.body["message"]
    wait_until_idle(server.server.models.serving_now().engine)


def test_reasoning_effort_none_turns_thinking_off_in_the_template(client):
    thinking, quiet = ask(client, tools=TOOLS), ask(client, tools=TOOLS, reasoning_effort="none")
    assert quiet.usage.prompt_tokens > thinking.usage.prompt_tokens  # the template's empty think block
    message = quiet.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and calls_of(message) == EXPECTED_CALLS
    assert message.content == "<think>\nI should look.\n</think>"  # not reasoning any more: free text before calls
    assert quiet.usage.completion_tokens_details.reasoning_tokens == 0


# ------------------------------------------------------------------ Responses
def check_call_events(events: list[dict]) -> list[dict]:
    """The function_call items of a streamed response, checked against their events; returns the items."""
    for event in events:
        STREAM_EVENT.validate_python(event)
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    calls = [item for item in done if item["type"] == "function_call"]
    for item in calls:
        pieces = [event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta"
                  and event["item_id"] == item["id"]]
        [finished] = [event for event in events if event["type"] == "response.function_call_arguments.done"
                      and event["item_id"] == item["id"]]
        assert "".join(pieces) == finished["arguments"] == item["arguments"] and pieces
    reasoning = [item for item in done if item["type"] == "reasoning"]
    assert [item["content"][0]["text"] for item in reasoning] == ["I should look."]
    return calls


def follow_up(response_id: str, calls: list[dict]) -> dict:
    return {"model": "tools", "previous_response_id": response_id, "tools": RESPONSES_TOOLS, "temperature": 0,
            "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
                      for call in calls]}


def test_responses_function_calling_over_http_through_a_tool_turn(client):
    with client.responses.create(model="tools", input=QUESTION, tools=RESPONSES_TOOLS, temperature=0,
                                 stream=True) as stream:
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
    calls = check_call_events(events)
    assert [(item["name"], json.loads(item["arguments"])) for item in calls] == EXPECTED_CALLS
    first = Response.model_validate(events[-1]["response"])
    assert first.status == "completed" and [item.type for item in first.output] == [
        "reasoning", "function_call", "function_call"]
    second = client.responses.create(**follow_up(first.id, calls))
    assert second.output_text == "It is sunny at noon." and second.usage.input_tokens_details.cached_tokens > 0
    assert second.usage.output_tokens_details.reasoning_tokens == 1


def test_responses_function_calling_over_the_websocket_through_a_tool_turn(server):
    async def main() -> tuple[list[dict], list[dict]]:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as connection:
            await connection.send(json.dumps({"type": "response.create", "model": "tools", "input": QUESTION,
                                              "tools": RESPONSES_TOOLS, "tool_choice": "required",
                                              "temperature": 0}))
            first = await collect_response(connection)
            calls = check_call_events(first)
            await connection.send(json.dumps({"type": "response.create",
                                              **follow_up(first[-1]["response"]["id"], calls)}))
            return first, await collect_response(connection)

    first, second = asyncio.run(main())
    assert first[-1]["type"] == "response.completed"
    final = Response.model_validate(second[-1]["response"])
    assert final.output_text == "It is sunny at noon." and final.usage.input_tokens_details.cached_tokens > 0
    wait_until_idle(server.server.models.serving_now().engine)
