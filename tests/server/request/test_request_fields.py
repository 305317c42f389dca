"""The field kinds every wire format is made of and the one parser, without a server: the order fields
are checked in, preferred spellings, the log-probability switch, open and closed objects, refusals,
echoed fields; and a new wire format made of nothing but a field map."""

from __future__ import annotations

import pytest

from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.request import fields as fields
from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.messages import MessageFormat
from localserve.server.request.validation import ProtocolError

LIMITS = RequestLimits(max_input_chars=20, max_input_items=2, max_stop_strings=2, max_stop_chars=3,
                       max_parallel_samples=4, max_id_chars=8)
DEFAULTS = SamplingDefaults(0.5, top_k=7, top_p=0.8, min_p=0.01, source="test")
# Refusals shared by formats, checked in their `order` before a format's own ones.
FORCED_TOOL_CHOICE_REFUSED = fields.Refused("no tool is called", fields.one_of("auto", "none"), (str, dict), order=0)
TOOLS_REFUSED = fields.Refused("no tools are offered", fields.is_empty, list, order=1)
STRUCTURED_OUTPUT_REFUSED = fields.Refused("only plain text", fields.plain_text, dict, order=2)


def reasoning_refused(allows, kind) -> fields.Refused:
    return fields.Refused("the model does not reason", allows, kind, order=3)


# An Ollama-shaped /api/chat, written as a test would write the next format: a map and nothing else.
OLLAMA_CHAT = fields.WireFormat({
    "model": fields.Text("model", bounded=True),
    "messages": fields.Messages(MessageFormat(text_parts=("text",), refused_fields=("images", "tool_calls"))),
    "options": fields.Nested({
        "num_predict": fields.Sampling("max_tokens"), "temperature": fields.Sampling("temperature"),
        "top_k": fields.Sampling("top_k"), "top_p": fields.Sampling("top_p"), "seed": fields.Sampling("seed"),
        "stop": fields.Sampling("stop"), "repeat_penalty": fields.Sampling("repetition_penalty")}),
    "stream": fields.Flag("stream"),
    "tools": TOOLS_REFUSED,
    "format": fields.Refused("structured output is not supported; only plain text", kind=(str, dict)),
    "think": reasoning_refused(fields.is_empty, bool),
    "keep_alive": fields.Ignored("the model stays loaded while the server runs"),
}, default_max_tokens=128)


def parse(body: dict, wire: fields.WireFormat = OLLAMA_CHAT):
    return fields.parse_request(body, wire, LIMITS)


def refusal(body: dict, wire: fields.WireFormat = OLLAMA_CHAT) -> tuple[str, str | None]:
    with pytest.raises(ProtocolError) as raised:
        parse(body, wire)
    assert raised.value.param is None or raised.value.param in raised.value.message or \
        raised.value.code == "unknown_parameter"
    return raised.value.code, raised.value.param


HELLO = {"messages": [{"role": "user", "content": "hello"}]}


def test_a_new_format_is_a_field_map():
    request = parse({**HELLO, "model": "m", "stream": True, "keep_alive": "5m",
                     "options": {"num_predict": 9, "temperature": 0, "stop": ["x"], "repeat_penalty": 1.2}})
    assert request.input_messages == [{"role": "user", "content": "hello"}] and request.model == "m"
    assert request.stream and request.max_output_tokens == 9
    params = request.sampling_params(DEFAULTS, max_tokens=9)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0, 7, 0.8, 0.01)  # defaults fill in
    assert (params.stop, params.repetition_penalty, params.max_tokens) == (["x"], 1.2, 9)
    assert parse(HELLO).max_output_tokens == 128  # the format's own default
    # the shared rules, naming the field as this format spells it
    assert refusal({**HELLO, "options": {"temperature": 3}}) == ("decimal_above_max_value", "options.temperature")
    assert refusal({**HELLO, "options": {"num_predict": 0}}) == ("integer_below_min_value", "options.num_predict")
    assert refusal({**HELLO, "options": {"mirostat": 1}}) == ("unknown_parameter", "options.mirostat")
    assert refusal({**HELLO, "tools": [{"type": "function"}]}) == ("unsupported_parameter", "tools")
    assert refusal({**HELLO, "think": True}) == ("unsupported_parameter", "think")
    assert refusal({**HELLO, "format": "json"}) == ("unsupported_parameter", "format")
    assert refusal({**HELLO, "messages": [{"role": "user", "content": "x", "images": ["..."]}]}) == (
        "unsupported_value", "messages[0].images")
    assert parse(HELLO).wire_name("max_tokens") == "options.num_predict"


def test_fields_are_checked_in_one_order_whatever_the_map_or_the_body_says():
    # unknown names first, then refusals, the input, identifiers, sampling in SAMPLING_RULES' order
    body = {"options": {"seed": "x", "temperature": "hot"}, "model": "m" * 9, "tools": [1], "messages": 5,
            "frobnicate": 1}
    # one mistake mended at a time (None: the field goes)
    fixes = [("frobnicate", None), ("tools", []), ("messages", HELLO["messages"]), ("model", "m"),
             ("options", {"seed": "x"}), ("options", {})]
    expected = [("unknown_parameter", "frobnicate"), ("unsupported_parameter", "tools"), ("invalid_type", "messages"),
                ("string_above_max_length", "model"), ("invalid_type", "options.temperature"),
                ("invalid_type", "options.seed")]
    for (name, fixed), answer in zip(fixes, expected, strict=True):
        assert refusal(body) == answer
        body = {key: value for key, value in {**body, name: fixed}.items() if value is not None}
    assert parse(body).model == "m"
    assert refusal({"model": 5}) == ("missing_required_parameter", "messages")  # the input before identifiers


def test_refusals_come_first_in_their_order():
    chat_like = fields.WireFormat({"messages": fields.Messages(MessageFormat(text_parts=("text",))),
                                   "reasoning_effort": reasoning_refused(fields.one_of("none"), str),
                                   "audio": fields.Refused("text only"),
                                   "response_format": STRUCTURED_OUTPUT_REFUSED,
                                   "tools": TOOLS_REFUSED, "tool_choice": FORCED_TOOL_CHOICE_REFUSED})
    body = {**HELLO, "audio": {"voice": "x"}, "reasoning_effort": "high", "response_format": {"type": "json_object"},
            "tools": [{"type": "function"}], "tool_choice": "required"}
    for name in ("tool_choice", "tools", "response_format", "reasoning_effort", "audio"):
        assert refusal(body, chat_like) == ("unsupported_parameter", name)
        del body[name]
    assert parse(body, chat_like).input_messages
    assert parse({**HELLO, "tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
                  "reasoning_effort": "none"}, chat_like)


def test_a_preferred_spelling_wins_and_an_error_names_the_one_that_set_the_value():
    wire = fields.WireFormat({"prompt": fields.Prompt(), "max_tokens": fields.Sampling("max_tokens"),
                              "max_new": fields.Sampling("max_tokens", preferred=True)})
    for body in ({"prompt": "x", "max_new": 3, "max_tokens": 9}, {"prompt": "x", "max_tokens": 9, "max_new": 3}):
        request = parse(body, wire)
        assert request.max_output_tokens == 3 and request.wire_name("max_tokens") == "max_new"
    assert parse({"prompt": "x", "max_tokens": 9}, wire).wire_name("max_tokens") == "max_tokens"
    assert parse({"prompt": "x"}, wire).wire_name("max_tokens") == "max_tokens"  # the first spelling
    assert refusal({"prompt": "x", "max_new": 3, "max_tokens": 0}, wire) == ("integer_below_min_value", "max_tokens")


def test_the_logprobs_switch():
    wire = fields.WireFormat({"prompt": fields.Prompt(), "logprobs": fields.LogprobsSwitch(),
                              "top_logprobs": fields.Sampling("logprobs", needs_switch=True)})
    assert parse({"prompt": "x", "logprobs": True}, wire).sampling.logprobs == 0
    assert parse({"prompt": "x", "logprobs": True, "top_logprobs": 3}, wire).sampling.logprobs == 3
    assert parse({"prompt": "x", "logprobs": False}, wire).sampling.logprobs is None
    assert refusal({"prompt": "x", "top_logprobs": 3}, wire) == ("invalid_value", "top_logprobs")
    assert refusal({"prompt": "x", "logprobs": False, "top_logprobs": 3}, wire) == ("invalid_value", "top_logprobs")


def test_open_and_closed_objects_and_the_input_size():
    wire = fields.WireFormat({"prompt": fields.Prompt(), "options": fields.Nested({"seed": fields.Sampling("seed")}),
                              "extra": fields.Nested({"flag": fields.Flag("stream")}, open=True)})
    assert parse({"prompt": "x", "extra": {"flag": True, "other": 1}}, wire).stream
    assert refusal({"prompt": "x", "options": {"other": 1}}, wire) == ("unknown_parameter", "options.other")
    assert refusal({"prompt": "x", "options": 5}, wire) == ("invalid_type", "options")
    assert parse({"prompt": ["x" * 20]}, wire).prompt == "x" * 20  # a batch of one
    assert refusal({"prompt": "x" * 21}, wire) == ("string_above_max_length", "prompt")
    assert refusal({"prompt": ["a", "b"]}, wire) == ("unsupported_value", "prompt")
    assert refusal({}, wire) == ("missing_required_parameter", "prompt")


def test_echoed_fields_keep_what_was_sent_over_their_defaults():
    wire = fields.WireFormat({"prompt": fields.Prompt(), "text": fields.Nested({}, open=True),
                              "tools": TOOLS_REFUSED},
                             echoed={"text": {"format": {"type": "text"}}, "tools": [], "absent": None})
    request = parse({"prompt": "x", "text": {"verbosity": "medium"}}, wire)
    assert request.echoed == {"text": {"format": {"type": "text"}, "verbosity": "medium"}, "tools": [], "absent": None}
    request.echoed["tools"].append("mine")
    assert parse({"prompt": "x"}, wire).echoed["tools"] == []  # a default is never shared between requests
