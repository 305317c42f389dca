"""The one request type: the server's sampling defaults fill in exactly the fields a request left out,
once, into the engine's SamplingParams; what it counts of the input; how its format names a field."""

from __future__ import annotations

from localserve.engine.sampling_params import SamplingParams
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.request.generation_request import GenerationRequest, SamplingChoice

DEFAULTS = SamplingDefaults(0.6, top_k=20, top_p=0.85, min_p=0.03, source="test")


def test_the_defaults_fill_only_what_the_request_left_out():
    left_out = GenerationRequest([]).sampling_params(DEFAULTS, max_tokens=9)
    assert left_out == SamplingParams(temperature=0.6, top_k=20, top_p=0.85, min_p=0.03, max_tokens=9)
    chosen = SamplingChoice(temperature=0.0, top_k=1, stop=("a", "b"), n=2, logprobs=0, seed=5, presence_penalty=1.0,
                            frequency_penalty=-1.0, repetition_penalty=1.3)
    params = GenerationRequest([], sampling=chosen).sampling_params(DEFAULTS, max_tokens=3)
    assert params == SamplingParams(temperature=0.0, top_k=1, top_p=0.85, min_p=0.03, seed=5, max_tokens=3,
                                    stop=["a", "b"], n=2, logprobs=0, presence_penalty=1.0, frequency_penalty=-1.0,
                                    repetition_penalty=1.3)
    # zero is a choice, not a missing value
    assert GenerationRequest([], sampling=SamplingChoice(min_p=0.0)).sampling_params(DEFAULTS, 1).min_p == 0.0
    off = SamplingDefaults(1.0, source="off")  # top_k None: the filter is off
    assert GenerationRequest([]).sampling_params(off, 1).top_k is None


def test_samples_input_size_and_wire_names():
    assert SamplingChoice().num_samples == 1 and SamplingChoice(n=4).num_samples == 4
    request = GenerationRequest([{"role": "user", "content": "abc"}, {"role": "assistant", "content": "de"}],
                                instructions="xy", wire_names={"input": "messages", "max_tokens": "max_tokens"})
    assert request.num_input_chars == 7
    assert GenerationRequest([], prompt="hello").num_input_chars == 5
    assert request.wire_name("input") == "messages"
