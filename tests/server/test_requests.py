"""The wire format without a server: parsing response.create, and the events ResponseStream builds from
engine outputs (order, numbering, coalesced deltas, closing status)."""

from __future__ import annotations

import pydantic
import pytest
from openai.types.responses import ResponsesServerEvent

from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.request_fields import parse_request
from localserve.server.request_model import RequestLimits
from localserve.server.response_events import ResponseStream
from localserve.server.responses_format import RESPONSES_WEBSOCKET, parse_client_event
from localserve.server.validation import ProtocolError, error_event

SERVER_EVENT = pydantic.TypeAdapter(ResponsesServerEvent)


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
    ({"input": [{"type": "function_call", "name": "f"}]}, "unsupported_value", "input[0].type"),
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


def output(deltas: list[str], token_counts: list[int], finished=False, reasons=None, error=None, cached=0):
    reasons = reasons or [None] * len(deltas)
    completions = [CompletionOutput(index, "", list(range(count)), 0.0, reasons[index], [-0.5] * count,
                                    delta_text=delta, delta_token_ids=[count - 1] if delta else [])
                   for index, (delta, count) in enumerate(zip(deltas, token_counts, strict=True))]
    return RequestOutput("resp_x", [1, 2, 3], completions, finished, cached, error)


def make_stream(**event) -> ResponseStream:
    request = parse_response_create({"input": "hi", **event})
    params = request.sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=request.max_output_tokens or 16)
    return ResponseStream(request, params, "resp_x", "tiny", num_prompt_tokens=3,
                          token_text=lambda token_id: f"t{token_id}")


def validated(events: list[dict]) -> list:
    return [SERVER_EVENT.validate_python(event) for event in events]


def test_deltas_absorbed_between_drains_go_out_as_one():
    stream = make_stream(max_output_tokens=3, stream_id="lane")
    first = stream.drain()
    assert [e["type"] for e in first] == ["response.created", "response.in_progress",
                                          "response.output_item.added", "response.content_part.added"]
    stream.absorb(output(["Hel"], [1]))
    stream.absorb(output(["lo"], [2]))
    second = stream.drain()
    assert [(e["type"], e["delta"]) for e in second] == [("response.output_text.delta", "Hello")]
    stream.absorb(output(["!"], [3], finished=True, reasons=["length"], cached=16))
    last = validated(stream.drain())
    assert [e.type for e in last] == ["response.output_text.delta", "response.output_text.done",
                                      "response.content_part.done", "response.output_item.done",
                                      "response.incomplete"]
    numbers = [e["sequence_number"] for e in first + second] + [e.sequence_number for e in last]
    assert numbers == list(range(10))
    assert all(e.stream_id == "lane" for e in last)
    response = last[-1].response
    assert response.output[0].content[0].text == "Hello!"
    assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (3, 3, 6)
    assert response.usage.input_tokens_details.cached_tokens == 16
    assert stream.drain() == [] and not stream.has_unsent_events


def test_two_samples_are_two_output_items_with_logprobs():
    stream = make_stream(localserve={"n": 2, "logprobs": 0})
    stream.absorb(output(["a", "b"], [1, 1]))
    stream.absorb(output(["", "c"], [1, 2], finished=True, reasons=["stop", "stop"]))
    events = validated(stream.drain())
    assert [e.output_index for e in events if e.type == "response.output_text.delta"] == [0, 1]
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.content[0].text for item in final.response.output] == ["a", "bc"]
    assert [lp.token for lp in final.response.output[1].content[0].logprobs] == ["t0", "t1"]


def test_cancel_and_failure_close_the_response():
    cancelled = make_stream()
    cancelled.absorb(output(["x"], [1]))
    cancelled.cancel()
    cancelled.absorb(output(["late"], [2], finished=True, reasons=["stop"]))  # ignored: already over
    final = validated(cancelled.drain())[-1]
    assert final.type == "response.incomplete" and final.response.status == "cancelled"
    failed = make_stream()
    failed.absorb(RequestOutput("resp_x", [1], [], True, error="internal error: boom"))
    final = validated(failed.drain())[-1]
    assert final.type == "response.failed"
    error = final.response.error
    assert (error.code, error.message) == ("server_error", "internal error: boom")
