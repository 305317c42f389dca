"""The field maps of /v1/chat/completions and /v1/completions without a server: every honoured field
reaches the request, every refused one is refused by its own name, the ignored ones are accepted and
anything else is unknown."""

from __future__ import annotations

import pytest

from localserve.loading.sampling_defaults import LLAMA_CPP_DEFAULTS
from localserve.server.openai.completions_format import CHAT_COMPLETIONS, COMPLETIONS, COMPLETIONS_DEFAULT_MAX_TOKENS
from localserve.server.request.fields import parse_request
from localserve.server.request.generation_request import UNFINISHED_CALL_IDS, RequestLimits
from localserve.server.request.validation import ProtocolError

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**body):
    return parse_request({"messages": MESSAGES, **body}, CHAT_COMPLETIONS, RequestLimits())


def completion(**body):
    return parse_request({"prompt": "hi", **body}, COMPLETIONS, RequestLimits())


def refused(parse, **body) -> tuple[str, str]:
    with pytest.raises(ProtocolError) as raised:
        parse(**body)
    return raised.value.code, raised.value.param


def test_chat_fields_reach_the_request():
    request = chat(messages=[{"role": "developer", "content": "rules"},
                             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                              "name": "ann"},
                             {"role": "assistant", "content": None, "refusal": "no"}],
                   model="m", max_tokens=50, max_completion_tokens=5, temperature=0.3, top_p=0.9, top_k=4, min_p=0.1,
                   seed=3, stop="END", n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                   logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
                   tools=[], functions=[], tool_choice="none", function_call="auto", response_format={"type": "text"},
                   reasoning_effort="none", modalities=["text"], verbosity="medium", logit_bias={},
                   user="u", store=True, metadata={"a": "b"}, parallel_tool_calls=False, service_tier="auto")
    assert request.input_messages == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"},
                                      {"role": "assistant", "content": ""}]
    assert (request.model, request.max_output_tokens, request.stream, request.include_usage) == ("m", 5, True, True)
    assert request.wire_name("max_tokens") == "max_completion_tokens" and request.wire_name("input") == "messages"
    assert not request.store and request.metadata == {}  # a chat completion is never kept for a follow-up
    params = request.sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=5)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.3, 0.9, 4, 0.1, 3)
    assert (params.stop, params.n, params.logprobs) == (["END"], 2, 2)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert chat().max_output_tokens is None  # the server's default
    assert chat(logprobs=True).sampling.logprobs == 0 and chat(logprobs=False).sampling.logprobs is None


@pytest.mark.parametrize("body, expected", [
    ({"tools": [{"type": "function"}]}, ("invalid_value", "tools[0].function")),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     ("invalid_value", "tools[0].function.parameters")),
    ({"functions": [{"name": "f"}]}, ("unsupported_parameter", "functions")),
    ({"tool_choice": "required"}, ("invalid_value", "tool_choice")),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, ("invalid_value", "tool_choice.function.name")),
    ({"function_call": {"name": "f"}}, ("unsupported_parameter", "function_call")),
    ({"response_format": {"type": "json_schema"}}, ("invalid_type", "response_format.json_schema")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
     ("invalid_type", "response_format.json_schema.schema")),
    ({"reasoning_effort": "extreme"}, ("invalid_value", "reasoning_effort")),
    ({"modalities": ["text", "audio"]}, ("unsupported_parameter", "modalities")),
    ({"audio": {"voice": "alloy"}}, ("unsupported_parameter", "audio")),
    ({"prediction": {"type": "content"}}, ("unsupported_parameter", "prediction")),
    ({"web_search_options": {"search_context_size": "low"}}, ("unsupported_parameter", "web_search_options")),
    ({"verbosity": "high"}, ("unsupported_parameter", "verbosity")),
    ({"logit_bias": {"5": 1}}, ("unsupported_parameter", "logit_bias")),
    ({"tools": {}}, ("invalid_type", "tools")),
    ({"messages": []}, ("invalid_value", "messages")),
    ({"messages": None}, ("missing_required_parameter", "messages")),
    ({"messages": [{"role": "tool", "content": "x"}]}, ("invalid_type", "messages[0].tool_call_id")),
    ({"messages": [{"role": "function", "content": "x"}]}, ("unsupported_value", "messages[0].role")),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
     ("invalid_type", "messages[0].tool_calls[0]")),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": 5}}]}]},
     ("invalid_type", "messages[0].tool_calls[0].function.arguments")),
    ({"top_logprobs": 2}, ("invalid_value", "top_logprobs")),
    ({"max_tokens": 0, "max_completion_tokens": 5}, ("integer_below_min_value", "max_tokens")),
    ({"stream_options": {"include_usage": "yes"}}, ("invalid_type", "stream_options.include_usage")),
    ({"localserve": {"top_k": 1}}, ("unknown_parameter", "localserve")),
    ({"prompt": "hi"}, ("unknown_parameter", "prompt")),
])
def test_chat_refusals_name_their_field(body, expected):
    assert refused(chat, **body) == expected


def test_completion_fields_reach_the_request():
    request = completion(prompt=["the cat"], model="m", temperature=0, top_k=2, stop=["x", "y"], n=3, logprobs=1,
                         echo=False, suffix="", best_of=1, stream=True, user="u")
    assert (request.prompt, request.input_messages, request.model, request.stream) == ("the cat", [], "m", True)
    assert request.max_output_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS and request.wire_name("input") == "prompt"
    assert not request.store
    params = request.sampling_params(LLAMA_CPP_DEFAULTS, max_tokens=4)
    assert (params.temperature, params.top_k, params.stop, params.n, params.logprobs) == (0, 2, ["x", "y"], 3, 1)


@pytest.mark.parametrize("body, expected", [
    ({"echo": True}, ("unsupported_parameter", "echo")),
    ({"suffix": "end"}, ("unsupported_parameter", "suffix")),
    ({"best_of": 2}, ("unsupported_parameter", "best_of")),
    ({"logit_bias": {"5": 1}}, ("unsupported_parameter", "logit_bias")),
    ({"prompt": [1, 2]}, ("unsupported_value", "prompt")),
    ({"prompt": None}, ("missing_required_parameter", "prompt")),
    ({"logprobs": True}, ("invalid_type", "logprobs")),
    ({"logprobs": 21}, ("integer_above_max_value", "logprobs")),
    ({"tools": []}, ("unknown_parameter", "tools")),  # the legacy endpoint has no such field
    ({"store": True}, ("unknown_parameter", "store")),
    ({"messages": MESSAGES}, ("unknown_parameter", "messages")),
])
def test_completion_refusals_name_their_field(body, expected):
    assert refused(completion, **body) == expected


@pytest.mark.parametrize("arguments", ['{"city": "Par', "[1]", "not json"])
def test_a_call_whose_arguments_are_no_object_is_the_models_own_text(arguments):
    cut = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    whole = {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    request = chat(messages=[*MESSAGES, {"role": "assistant", "content": "Let me look.", "tool_calls": [cut, whole]}])
    turn = request.input_messages[-1]
    assert turn["content"] == f"Let me look.\n{arguments}" and turn["tool_calls"] == [whole]
    assert turn[UNFINISHED_CALL_IDS] == ["c1"]  # a tool result may still answer it
