"""Generated requests of the new fields over the wire, on a real engine (the scripted thinking Hermes model of
tests/helpers/tool_models.py): valid and invalid `tools` (namespace and hosted tools among them),
`tool_choice`, `parallel_tool_calls`, `response_format` / `text.format` (beside tools too),
`reasoning_effort` / `reasoning`, `client_metadata`, a token limit that cuts the calls, and a history of tool
turns (answered, unknown, a cut call sent back, a result naming its function instead of its call) on
/v1/chat/completions and /v1/responses, streamed or not. Every answer is a 400 whose `param` names one of the
fields the request sent, or a well-formed answer (the SDK's types) whose calls' arguments are JSON objects;
never a 5xx; and after each request every KV block is back. Fixed examples pin each rule."""

from __future__ import annotations

import http.client
import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.helpers.server import make_llm, running_server, wait_until_idle
from tests.helpers.tool_models import ANSWER, CALLS, QUESTION, THINKING_TEMPLATE, write_tool_model

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "description": "Time.", "parameters": {"type": "object",
                                                                    "properties": {"zone": {"type": "string"}}}}
BAD_TOOLS = [{"name": "bad name"}, {"name": "f", "parameters": {"type": "array"}}, {"name": "f", "parameters": 3},
             {}, {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strnig"}}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
FORMATS = [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "s", "schema": SCHEMA},
           {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True},
           {"type": "json_schema", "name": "s", "schema": {"type": "foo"}}, {"type": "xml"}, "json",
           {"type": "json_schema", "name": "s", "schema": [1]}]
# tools sent as they are (not a function's fields): a namespace of functions, hosted and own-form tools
NAMESPACE = {"type": "namespace", "name": "mcp__weather", "description": "Weather.", "tools": [{"type": "function",
                                                                                                **WEATHER}]}
AS_SENT = [NAMESPACE, {"type": "web_search"}, {"type": "code_interpreter", "container": {"type": "auto"}},
           {"type": "custom", "name": "patch"}]
CHOICES = ["auto", "none", "required", "any", {"name": "get_weather"}, {"name": "nobody"}, 5]
EFFORTS = ["none", "low", "high", "extreme"]
CLIENT_METADATA = {"session_id": "019a0b1c-2d3e-7f40-8a9b-0c1d2e3f4a5b", "x-codex-turn-metadata": '{"turn": 1}'}
# The fields a case may set, as each endpoint spells them (what an error's param may begin with).
PARAMS = {"chat": {"tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "parallel_tool_calls",
                   "format": "response_format", "effort": "reasoning_effort", "history": "messages",
                   "client_metadata": "client_metadata", "max_tokens": "max_tokens"},
          "responses": {"tools": "tools", "tool_choice": "tool_choice", "parallel_tool_calls": "parallel_tool_calls",
                        "format": "text.format", "effort": "reasoning.effort", "history": "input",
                        "client_metadata": "client_metadata", "max_tokens": "max_output_tokens"}}

cases = st.fixed_dictionaries({"api": st.sampled_from(["chat", "responses"]), "stream": st.booleans()}, optional={
    "tools": st.lists(st.sampled_from([WEATHER, TIME, *BAD_TOOLS, *AS_SENT]), max_size=3),
    "tool_choice": st.sampled_from(CHOICES),
    "parallel_tool_calls": st.sampled_from([True, False, "yes"]),
    "format": st.sampled_from(FORMATS),
    "effort": st.sampled_from(EFFORTS),
    "history": st.sampled_from(["answered", "unknown_call", "cut_call", "by_name"]),
    "client_metadata": st.sampled_from([CLIENT_METADATA, {"k": 5}]),
    "max_tokens": st.sampled_from([1, 2, 3]),  # cuts the thinking, or the calls: pieces of one token each
})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tool-model")
    write_tool_model(folder, CALLS, ANSWER, THINKING_TEMPLATE)
    with running_server(make_llm(folder, max_model_len=1024)) as server:
        yield server


@pytest.fixture(scope="module")
def wire(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    yield connection
    connection.close()


def body_for(case: dict) -> dict:
    """The case as its endpoint's request (tools and named choices nested for chat, flat for Responses)."""
    chat = case["api"] == "chat"
    body: dict = {"model": "default", "temperature": 0,
                  "max_tokens" if chat else "max_output_tokens": case.get("max_tokens", 40), "stream": case["stream"]}
    turn = [{"role": "user", "content": QUESTION}]
    if "history" in case:
        history = case["history"]
        call_id = "call_2" if history == "unknown_call" else "call_1"
        arguments = '{"city": "Par' if history == "cut_call" else '{"city": "Paris"}'  # a cut call sent back
        if chat:
            result = {"role": "tool", "content": "sunny"} | ({} if history == "by_name" else {"tool_call_id": call_id})
            turn += [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": arguments}}]}, result]
        else:
            named = {"name": "get_weather"} if history == "by_name" else {"call_id": call_id}
            turn += [{"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
                     {"type": "function_call_output", "output": "sunny", **named}]
    body["messages" if chat else "input"] = turn
    if "tools" in case:
        body["tools"] = [tool if tool in AS_SENT else {"type": "function", "function": tool} if chat
                         else {"type": "function", **tool} for tool in case["tools"]]
    if "client_metadata" in case:
        body["client_metadata"] = case["client_metadata"]
    if "tool_choice" in case:
        choice = case["tool_choice"]
        if isinstance(choice, dict):
            choice = {"type": "function", "function": choice} if chat else {"type": "function", **choice}
        body["tool_choice"] = choice
    if "parallel_tool_calls" in case:
        body["parallel_tool_calls"] = case["parallel_tool_calls"]
    if "format" in case:
        answer = case["format"]
        if chat and isinstance(answer, dict) and answer.get("type") == "json_schema":
            answer = {"type": "json_schema", "json_schema": {key: value for key, value in answer.items()
                                                             if key != "type"}}
        body["response_format" if chat else "text"] = answer if chat else {"format": answer}
    if "effort" in case:
        if chat:
            body["reasoning_effort"] = case["effort"]
        else:
            body["reasoning"] = {"effort": case["effort"]}
    return body


def send(connection: http.client.HTTPConnection, case: dict) -> tuple[int, dict | list]:
    """The status and the answer: the error object, the whole answer, or the streamed events."""
    path = "/v1/chat/completions" if case["api"] == "chat" else "/v1/responses"
    connection.request("POST", path, json.dumps(body_for(case)), {"Content-Type": "application/json"})
    answer = connection.getresponse()
    data = answer.read().decode()
    if answer.status != 200:
        return answer.status, json.loads(data)["error"]
    if not case["stream"]:
        return 200, json.loads(data)
    events = [line.removeprefix("data: ") for line in data.splitlines() if line.startswith("data: ")]
    return 200, [json.loads(event) for event in events if event != "[DONE]"]


def check_answer(case: dict, answer: dict | list) -> None:
    """A well-formed answer in the SDK's types, whose calls (if any) name tools of the request and carry arguments
    that are JSON objects (a call the token limit cut short is never handed out), whole and streamed."""
    names = {tool.get("name") for tool in case.get("tools", ())} | {"get_weather"}  # the namespace's function
    if case["api"] == "chat":
        if case["stream"]:
            pieces: dict[int, str] = {}
            for chunk in answer:
                for choice in ChatCompletionChunk.model_validate(chunk).choices:
                    for call in choice.delta.tool_calls or ():
                        pieces[call.index] = pieces.get(call.index, "") + (call.function.arguments or "")
            arguments = list(pieces.values())
        else:
            completion = ChatCompletion.model_validate(answer)
            calls = completion.choices[0].message.tool_calls or ()
            assert all(call.function.name in names for call in calls)
            arguments = [call.function.arguments for call in calls]
    else:
        if case["stream"]:
            for event in answer:
                STREAM_EVENT.validate_python(event)
            answer = answer[-1]["response"]
        response = Response.model_validate(answer)
        assert response.status in ("completed", "incomplete")
        calls = [item for item in response.output if item.type == "function_call"]
        assert all(call.name in names for call in calls)
        arguments = [call.arguments for call in calls]
    assert all(isinstance(json.loads(text), dict) for text in arguments), arguments


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                               HealthCheck.function_scoped_fixture])
@given(case=cases)
@example(case={"api": "chat", "stream": False, "tools": [WEATHER], "tool_choice": {"name": "nobody"}})
@example(case={"api": "responses", "stream": True, "tool_choice": "required"})
@example(case={"api": "chat", "stream": False, "tools": [{"name": "bad name"}]})
@example(case={"api": "responses", "stream": False, "format": {"type": "json_schema", "name": "s",
                                                                "schema": {"type": "foo"}}})
@example(case={"api": "chat", "stream": True, "history": "unknown_call"})
@example(case={"api": "chat", "stream": False, "format": {"type": "json_schema", "name": "s", "schema": SCHEMA}})
@example(case={"api": "responses", "stream": True, "tools": [WEATHER, TIME], "tool_choice": "auto"})
@example(case={"api": "chat", "stream": True, "tools": [WEATHER, TIME], "history": "answered"})
@example(case={"api": "chat", "stream": True, "tools": [WEATHER, TIME], "max_tokens": 2})  # the call cut
@example(case={"api": "responses", "stream": False, "tools": [WEATHER], "history": "cut_call", "max_tokens": 2})
@example(case={"api": "responses", "stream": True, "tools": [NAMESPACE], "history": "by_name",
               "client_metadata": CLIENT_METADATA})
@example(case={"api": "responses", "stream": False, "tools": [WEATHER, {"type": "web_search"}], "tool_choice": "none"})
def test_new_fields_get_a_400_naming_one_of_them_or_a_well_formed_answer(server, wire, case):
    status, answer = send(wire, case)
    assert status in (200, 400), (status, answer)
    if status == 400:
        sent = [PARAMS[case["api"]][name] for name in PARAMS[case["api"]] if name in case]
        assert any(answer["param"].startswith(param) for param in sent), (answer, case)
        assert answer["message"]
    else:
        check_answer(case, answer)
    wait_until_idle(server.server.models.serving_now().engine)


PINNED = [  # (case, the param of its 400)
    ({"tools": [WEATHER], "tool_choice": {"name": "nobody"}}, {"chat": "tool_choice.function.name",
                                                               "responses": "tool_choice.name"}),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"name": "bad name"}]}, {"chat": "tools[0].function.name", "responses": "tools[0].name"}),
    ({"tools": [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strnig"}}}}]},
     "tools"),  # the calls' grammar does not compile: the tools are named
    ({"format": {"type": "json_schema", "name": "s", "schema": {"type": "foo"}}},
     {"chat": "response_format", "responses": "text.format"}),  # compiled by the engine: the field is named
    ({"history": "unknown_call"}, {"chat": "messages", "responses": "input"}),
    ({"effort": "extreme"}, {"chat": "reasoning_effort", "responses": "reasoning.effort"}),
    ({"tools": [WEATHER, {"type": "web_search"}]}, "tools[1].type"),  # hosted: refused unless never called
    ({"tools": [NAMESPACE, NAMESPACE]}, {"chat": "tools[0].type", "responses": "tools"}),  # its function twice
    ({"history": "unknown_call"}, {"chat": "messages", "responses": "input"}),
    ({"client_metadata": {"k": 5}}, "client_metadata"),
]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("case, param", PINNED, ids=[str(case)[:50] for case, _ in PINNED])
def test_each_new_refusal_is_pinned(wire, api, case, param):
    status, answer = send(wire, {"api": api, "stream": False, **case})
    assert (status, answer["param"]) == (400, param[api] if isinstance(param, dict) else param), answer
