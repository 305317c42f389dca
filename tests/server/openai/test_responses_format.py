"""The field maps of the Responses API without a server: what differs between the websocket's
`response.create` and `POST /v1/responses`, the `localserve` object, the logprobs switches, warm-ups,
what the response object echoes, parsing `response.create` into the request (input forms, sampling fields,
refusals naming their param), and the websocket's frames and lanes."""

from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import ResponsesServerEvent

from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.openai.responses_format import (
    ECHOED,
    LOGPROBS_INCLUDE,
    RESPONSES_HTTP,
    RESPONSES_WEBSOCKET,
    check_stream_id,
    event_stream_id,
    parse_client_event,
)
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.validation import ProtocolError, error_event

SERVER_EVENT = pydantic.TypeAdapter(ResponsesServerEvent)


def over(wire, **body):
    return parse_request({"input": "hi", **body}, wire, RequestLimits())


def refused(wire, **body) -> tuple[str, str]:
    with pytest.raises(ProtocolError) as raised:
        over(wire, **body)
    return raised.value.code, raised.value.param


def test_the_websocket_and_http_differ_in_stream_and_stream_id_only():
    assert over(RESPONSES_WEBSOCKET, stream_id="lane", stream=True).stream_id == "lane"
    assert not over(RESPONSES_WEBSOCKET, stream=True).stream  # every response streams over a websocket
    assert over(RESPONSES_HTTP, stream=True).stream and not over(RESPONSES_HTTP).stream
    assert refused(RESPONSES_HTTP, stream_id="lane") == ("unsupported_parameter", "stream_id")
    assert refused(RESPONSES_HTTP, stream="yes") == ("invalid_type", "stream")
    assert refused(RESPONSES_WEBSOCKET, stream_id="a b") == ("invalid_stream_id", "stream_id")
    assert set(RESPONSES_HTTP.fields) == set(RESPONSES_WEBSOCKET.fields)  # the same fields...
    assert {name for name in RESPONSES_HTTP.fields if RESPONSES_HTTP.fields[name] != RESPONSES_WEBSOCKET.fields[name]
            } == {"stream", "stream_id"}  # ...two of them meaning another thing


@pytest.mark.parametrize("wire", [RESPONSES_WEBSOCKET, RESPONSES_HTTP])
def test_the_logprobs_spellings(wire):
    assert over(wire).sampling.logprobs is None
    assert over(wire, include=[LOGPROBS_INCLUDE]).sampling.logprobs == 0
    assert over(wire, include=["other"]).sampling.logprobs is None
    assert over(wire, top_logprobs=3).sampling.logprobs == 3  # no switch needed
    assert over(wire, top_logprobs=3, localserve={"logprobs": 5}).sampling.logprobs == 5  # the extension wins
    assert over(wire, localserve={"logprobs": 5}, top_logprobs=3).sampling.logprobs == 5
    assert refused(wire, include=[1]) == ("invalid_type", "include")


@pytest.mark.parametrize("wire", [RESPONSES_WEBSOCKET, RESPONSES_HTTP])
def test_warm_ups_store_and_identifiers(wire):
    assert not over(wire, generate=False).generate
    assert not over(wire, generate=True, prompt_cache_options={"prewarm": True}).generate  # prewarm wins
    assert over(wire, prompt_cache_options={"prewarm": False, "ttl": 5}).generate  # its other fields are free
    assert not over(wire, store=False).store and over(wire).store
    request = over(wire, instructions="be brief", previous_response_id="resp_1", metadata={"k": "v"}, model="m")
    assert (request.instructions, request.previous_response_id, request.metadata, request.model) == (
        "be brief", "resp_1", {"k": "v"}, "m")
    assert request.wire_name("input") == "input" and request.wire_name("max_tokens") == "max_output_tokens"


@pytest.mark.parametrize("wire", [RESPONSES_WEBSOCKET, RESPONSES_HTTP])
@pytest.mark.parametrize("body, expected", [
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, ("invalid_value", "tools[0].parameters")),
    ({"tools": [{"type": "file_search"}]}, ("unsupported_value", "tools[0].type")),  # a hosted tool
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "c"}]}]},
     ("unsupported_value", "tools[0].tools[0].type")),
    ({"tools": [{"type": "namespace", "name": "n"}]}, ("invalid_type", "tools[0].tools")),
    ({"tools": [{"type": "namespace", "tools": []}]}, ("invalid_type", "tools[0].name")),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "bad name"}]}]},
     ("invalid_value", "tools[0].tools[0].name")),
    ({"tools": [1]}, ("invalid_type", "tools[0]")),
    ({"tools": "f"}, ("invalid_type", "tools")),
    ({"tool_choice": "required"}, ("invalid_value", "tool_choice")),
    ({"tool_choice": {"type": "allowed_tools"}}, ("invalid_value", "tool_choice.type")),
    ({"text": {"verbosity": "low"}}, ("unsupported_parameter", "text.verbosity")),
    ({"text": {"format": "json"}}, ("invalid_type", "text.format")),
    ({"reasoning": {"effort": "extreme"}}, ("invalid_value", "reasoning.effort")),
    ({"reasoning": {"summary": 5}}, ("invalid_type", "reasoning.summary")),
    ({"reasoning": {"budget": 5}}, ("unknown_parameter", "reasoning.budget")),
    ({"truncation": "auto"}, ("unsupported_parameter", "truncation")),
    ({"multi_agent": {"enabled": True}}, ("unsupported_parameter", "multi_agent")),
    ({"parallel_tool_calls": "yes"}, ("invalid_type", "parallel_tool_calls")),
    ({"localserve": {"beams": 2}}, ("unknown_parameter", "localserve.beams")),
    ({"localserve": {"min_p": 1}}, ("invalid_value", "localserve.min_p")),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     ("invalid_type", "input[0].content[0].image_url")),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     ("unsupported_value", "input[0].content[0]")),
    ({"input": None}, ("missing_required_parameter", "input")),
    ({"messages": []}, ("unknown_parameter", "messages")),
])
def test_refusals_name_their_field(wire, body, expected):
    assert refused(wire, **body) == expected


def test_the_response_object_echoes_the_request_over_the_defaults():
    assert over(RESPONSES_WEBSOCKET).echoed == ECHOED
    echoed = over(RESPONSES_WEBSOCKET, tools=[], tool_choice="none", text={"verbosity": "medium"},
                  reasoning={"effort": "none"}, parallel_tool_calls=False, top_logprobs=2, user="u").echoed
    assert echoed == ECHOED | {"tool_choice": "none", "text": {"format": {"type": "text"}, "verbosity": "medium"},
                               "reasoning": {"effort": "none"}, "parallel_tool_calls": False, "top_logprobs": 2,
                               "user": "u"}


def test_lanes():
    assert check_stream_id(None) is None and check_stream_id("lane-1.a_b") == "lane-1.a_b"
    for bad in ("", "a b", "x" * 257, 5):
        with pytest.raises(ProtocolError) as raised:
            check_stream_id(bad)
        assert (raised.value.code, raised.value.param) == ("invalid_stream_id", "stream_id")
    assert event_stream_id({"stream_id": "ok"}) == "ok" and event_stream_id({"stream_id": "not ok"}) is None


def parse_response_create(event: dict):
    return parse_request(event, RESPONSES_WEBSOCKET, RequestLimits())


def test_input_forms_become_role_messages():
    request = parse_response_create({"type": "response.create", "instructions": "be brief", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                        {"type": "input_text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "user", "content": "again"}]})
    assert request.input_messages == [{"role": "system", "content": "rules"},
                                      {"role": "user", "content": "hi there"},
                                      {"role": "assistant", "content": "hello"},
                                      {"role": "user", "content": "again"}]
    assert request.instructions == "be brief"
    assert parse_response_create({"input": "hi"}).input_messages == [{"role": "user", "content": "hi"}]


def test_sampling_fields_and_the_extension_map_onto_sampling_params():
    request = parse_response_create({"input": "hi", "temperature": 0, "top_p": 0.5, "max_output_tokens": 7,
                                     "top_logprobs": 3, "localserve": {"top_k": 5, "min_p": 0.1, "seed": 4,
                                                                       "stop": "END", "n": 2}})
    params = request.sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=7)
    assert (params.temperature, params.top_p, params.max_tokens, params.logprobs) == (0, 0.5, 7, 3)
    assert (params.top_k, params.min_p, params.seed, params.stop, params.n) == (5, 0.1, 4, ["END"], 2)
    # JSON integers are numbers
    assert parse_response_create({"input": "hi", "temperature": 1}).sampling.temperature == 1.0


@pytest.mark.parametrize("event, code, param", [
    ({"input": "hi", "stream_id": 5}, "invalid_stream_id", "stream_id"),
    ({"input": "hi", "temperature": float("nan")}, "invalid_value", "temperature"),
    ({"input": "hi", "temperature": 2.5}, "decimal_above_max_value", "temperature"),
    ({"input": "hi", "metadata": {"k": 1}}, "invalid_value", "metadata"),
    ({"input": "hi", "background": True}, "unsupported_parameter", "background"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "invalid_type", "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "invalid_type", "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "invalid_type", "input[0].output"),
    ({"input": [{"type": "web_search_call"}]}, "unsupported_value", "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "invalid_type",
     "input[0].content[0].text"),
    ({"input": "hi", "localserve": {"stop": ["a", 1]}}, "invalid_type", "localserve.stop"),
    ({"input": "hi", "localserve": {"min_p": 1.5}}, "invalid_value", "localserve.min_p"),
    ({"input": "hi", "top_logprobs": 40}, "integer_above_max_value", "top_logprobs"),
])
def test_bad_fields_name_their_param(event, code, param):
    with pytest.raises(ProtocolError) as raised:
        parse_response_create(event).sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=4)
    assert (raised.value.code, raised.value.param) == (code, param)
    assert param in raised.value.message


def test_client_frames_must_be_json_objects_with_a_type():
    assert parse_client_event('{"type": "x"}') == {"type": "x"}
    for frame, code in [(b"{}", "unsupported_data"), ("{", "invalid_json"), ("3", "invalid_json"),
                        ('{"type": null}', "missing_required_parameter")]:
        with pytest.raises(ProtocolError) as raised:
            parse_client_event(frame)
        assert raised.value.code == code
    event = error_event(ProtocolError("invalid_json", "bad"), stream_id="lane")
    assert SERVER_EVENT.validate_python(event).error.code == "invalid_json"
    assert event["stream_id"] == "lane"
