"""Anthropic's `stop_reason` and `stop_sequence` (server/anthropic/events.py) read from the neutral stream alone:
each sample's `StopReason` as the engine reports it, never the text decoded again (the stream has no tokenizer
to decode with). Whole and streamed answers name the same stop string."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from localserve.engine.outputs import CompletionOutput, RequestOutput, StopReason
from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.anthropic.events import AnthropicView
from localserve.server.anthropic.format import MESSAGES
from localserve.server.generation.stream import GenerationStream
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import RequestLimits

STOPS = ["zz", "end", "\n\n"]


def ended(text: str, finish_reason: str, stop: StopReason) -> AnthropicView:
    request = parse_request({"model": "m", "max_tokens": 16, "stop_sequences": STOPS,
                             "messages": [{"role": "user", "content": "hi"}]}, MESSAGES, RequestLimits())
    params = request.sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=16)
    stream = GenerationStream(request, params, "resp_1", "m", 3, token_text=str)
    completion = CompletionOutput(0, text, [1, 2], None, finish_reason, delta_text=text, delta_token_ids=[1, 2],
                                  stop=stop)
    stream.absorb(RequestOutput("resp_1", [1, 2, 3], [completion], True))
    return AnthropicView(stream)


def streamed_stop(view: AnthropicView) -> tuple[str, str | None]:
    events = [json.loads(line.removeprefix(b"data: ")) for line in view.pieces(done=True).split(b"\n")
              if line.startswith(b"data: ")]
    (delta,) = [event["delta"] for event in events if event["type"] == "message_delta"]
    return delta["stop_reason"], delta["stop_sequence"]


def test_each_kind_of_stop_is_spelled_as_anthropic_does():
    cases = [("stop", StopReason("eos", token_id=2), ("end_turn", None)),
             ("stop", StopReason("stop_token", token_id=7), ("end_turn", None)),
             ("stop", StopReason("stop_string", stop_string="end"), ("stop_sequence", "end")),
             ("length", StopReason("length"), ("max_tokens", None))]
    for finish_reason, stop, expected in cases:
        assert ended("some text", finish_reason, stop).stop() == expected
        assert streamed_stop(ended("some text", finish_reason, stop)) == expected


@given(st.sampled_from(STOPS), st.text(max_size=20))
def test_the_stop_string_named_is_the_one_the_engine_met(stop_string, text):
    view = ended(text, "stop", StopReason("stop_string", stop_string=stop_string))
    assert view.whole()["stop_sequence"] == stop_string and view.whole()["stop_reason"] == "stop_sequence"
