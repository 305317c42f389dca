"""The Responses events (server/openai/responses_events.py) of a `GenerationStream` (server/generation/stream.py)
without a server: the events built from engine outputs (order, numbering, coalesced deltas, closing status),
each validated as the `openai` SDK's server event."""

from __future__ import annotations

import pydantic
from openai.types.responses import ResponsesServerEvent

from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.generation.stream import GenerationStream
from localserve.server.openai.responses_events import ResponsesEvents
from localserve.server.openai.responses_format import RESPONSES_WEBSOCKET
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import RequestLimits

SERVER_EVENT = pydantic.TypeAdapter(ResponsesServerEvent)


def output(deltas: list[str], token_counts: list[int], finished=False, reasons=None, error=None, cached=0):
    reasons = reasons or [None] * len(deltas)
    completions = [CompletionOutput(index, "", list(range(count)), 0.0, reasons[index], [-0.5] * count,
                                    delta_text=delta, delta_token_ids=[count - 1] if delta else [])
                   for index, (delta, count) in enumerate(zip(deltas, token_counts, strict=True))]
    return RequestOutput("resp_x", [1, 2, 3], completions, finished, cached, error)


class StreamWithEvents(ResponsesEvents):
    """A stream and its Responses events as one object: the engine's side (`absorb`, the endings) goes to
    the stream, `drain` reads the events."""

    def __getattr__(self, name: str):
        return getattr(self.stream, name)  # absorb, cancel, shut_down, fail


def make_stream(**event) -> StreamWithEvents:
    request = parse_request({"input": "hi", **event}, RESPONSES_WEBSOCKET, RequestLimits())
    params = request.sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=request.max_output_tokens or 16)
    return StreamWithEvents(GenerationStream(request, params, "resp_x", "tiny", num_prompt_tokens=3,
                                             token_text=lambda token_id: f"t{token_id}"))


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


def test_a_shutdown_closes_incomplete_with_its_reason_and_the_text_so_far():
    stream = make_stream()
    stream.absorb(output(["so far"], [2]))
    stream.shut_down()
    stream.absorb(output([" late"], [3], finished=True, reasons=["stop"]))  # ignored: already over
    final = stream.drain()[-1]  # raw: the SDK's types know no reason "server_shutdown" (docs/PROTOCOL.md has it)
    response = final["response"]
    assert (final["type"], response["status"]) == ("response.incomplete", "incomplete")
    assert response["incomplete_details"] == {"reason": "server_shutdown"}
    assert response["output"][0]["content"][0]["text"] == "so far" and response["output"][0]["status"] == "incomplete"
    assert response["usage"]["output_tokens"] == 2


def test_an_ending_after_the_end_changes_nothing():
    stream = make_stream()
    stream.absorb(output(["done"], [1], finished=True, reasons=["stop"]))
    stream.cancel()
    stream.shut_down()
    stream.fail("too late")
    final = validated(stream.drain())[-1]
    assert final.type == "response.completed" and final.response.status == "completed"
    assert final.response.error is None and final.response.incomplete_details is None


def test_a_warm_up_answers_with_no_output_item():
    stream = make_stream(generate=False)
    stream.absorb(output(["unseen"], [1], finished=True, reasons=["length"], cached=2))
    events = validated(stream.drain())
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert events[-1].response.output == [] and events[-1].response.usage.output_tokens == 0
    assert events[-1].response.usage.input_tokens_details.cached_tokens == 2


def test_a_logprob_entry_carries_the_token_its_bytes_and_its_alternatives():
    stream = make_stream(top_logprobs=2)
    completion = CompletionOutput(0, "", [7], 0.0, "stop", logprobs=[-0.25], top_logprobs=[[(7, -0.25), (9, -1.5)]],
                                  delta_text="é", delta_token_ids=[7])
    stream.stream.token_text = {7: "é", 9: "e"}.get
    stream.absorb(RequestOutput("resp_x", [1], [completion], True))
    delta = next(e for e in validated(stream.drain()) if e.type == "response.output_text.delta")
    (entry,) = delta.logprobs
    assert (entry.token, entry.bytes, entry.logprob) == ("é", [0xC3, 0xA9], -0.25)
    assert [(top.token, top.bytes, top.logprob) for top in entry.top_logprobs] == [("é", [0xC3, 0xA9], -0.25),
                                                                                  ("e", [0x65], -1.5)]


def test_nothing_is_unsent_only_after_the_opening_and_the_closing_went_out():
    stream = make_stream()
    assert stream.has_unsent_events  # the opening events
    stream.drain()
    assert not stream.has_unsent_events
    stream.absorb(output(["a"], [1]))
    assert stream.has_unsent_events
    stream.drain()
    stream.cancel()
    assert stream.has_unsent_events  # the closing events
    assert validated(stream.drain())[-1].type == "response.incomplete" and not stream.has_unsent_events
