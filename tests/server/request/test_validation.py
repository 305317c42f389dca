"""Every field checked at the edge, over the wire: values of the wrong JSON type, numbers too large for
a float, text that is not valid Unicode, and every size a client controls get an `error` event naming
the parameter (never a 1011 close), and the connection goes on serving. Parameters that would change
the output and are not supported are refused; the ones accepted are echoed as requested. And the checks
of server/request/validation.py on their own: JSON types, finite numbers, ranges and lengths at their bound and
one past it, lone surrogates found by path, values shown short and printable."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from localserve.server.request.validation import (
    ProtocolError,
    check_length,
    check_range,
    check_value,
    find_invalid_unicode,
    parse_json_object,
    shown,
)
from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server

MAX_STORED_CHARS = 4000
GOOD = {"type": "response.create", "input": "hello world", "max_output_tokens": 2}
CREATE = '{"type": "response.create", "input": "hi", "max_output_tokens": 2, '  # add one field and "}"
HUGE = "1" + "0" * 400  # an integer JSON allows and no float holds


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, max_stored_chars=MAX_STORED_CHARS) as server:
        yield server


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def answer_then_usable(port: int, frame: str) -> dict:
    """Send `frame`; return the last event it brought, after checking the connection still serves."""
    async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
        await connection.send(frame)
        try:
            answer = (await collect_response(connection))[-1]
        except ConnectionClosed as closed:
            return {"type": "closed", "code": closed.rcvd.code if closed.rcvd else None}
        await connection.send(json.dumps(GOOD))
        assert (await collect_response(connection))[-1]["type"] in CLOSING_EVENTS
        return answer


ESCAPED_VALIDATION = [
    # a field of the wrong JSON type where a string is expected
    ('{"type": "response.create", "input": [{"role": ["user"], "content": "hi"}]}', "invalid_type",
     "input[0].role"),
    ('{"type": "response.create", "input": [{"type": ["message"], "role": "user", "content": "hi"}]}',
     "invalid_type", "input[0].type"),
    # numbers that overflow to infinity
    (CREATE + f'"temperature": {HUGE}}}', "decimal_above_max_value", "temperature"),
    (CREATE + f'"localserve": {{"min_p": {HUGE}}}}}', "decimal_above_max_value", "localserve.min_p"),
    (CREATE + '"top_p": 1e999}', "invalid_value", "top_p"),
    # a seed torch cannot take
    (CREATE + f'"localserve": {{"seed": {2 ** 64}}}}}', "integer_above_max_value", "localserve.seed"),
    # text that is not valid Unicode
    ('{"type": "response.create", "input": "\\ud800 hi"}', "invalid_value", "input"),
    (CREATE + '"instructions": "be \\udfff brief"}', "invalid_value", "instructions"),
    (CREATE + '"metadata": {"k": "\\ud800"}}', "invalid_value", "metadata.k"),
    (CREATE + '"localserve": {"stop": ["\\ud83d"]}}', "invalid_value", "localserve.stop[0]"),
]


@pytest.mark.parametrize("frame, code, param", ESCAPED_VALIDATION,
                         ids=[f"{param}-{index}" for index, (_, _, param) in enumerate(ESCAPED_VALIDATION)])
def test_values_that_escaped_validation_get_an_error_event(server, frame, code, param):
    answer = run(answer_then_usable(server.port, frame))
    assert answer["type"] == "error", answer
    assert (answer["error"]["code"], answer["error"]["param"]) == (code, param)


BOUNDS = [
    # stop strings: how many, and how long (each is searched for after every token)
    (CREATE + '"localserve": {"stop": ' + json.dumps([f"s{i}" for i in range(9)]) + '}}',
     "array_above_max_length", "localserve.stop"),
    (CREATE + '"localserve": {"stop": ["' + "x" * 129 + '"]}}', "string_above_max_length", "localserve.stop[0]"),
    # stream_id: copied onto every event
    (CREATE + '"stream_id": "' + "a" * 257 + '"}', "invalid_stream_id", "stream_id"),
    (CREATE + '"stream_id": "lane one"}', "invalid_stream_id", "stream_id"),
    (CREATE + '"stream_id": ""}', "invalid_stream_id", "stream_id"),
    # log-probabilities x samples x tokens: the closing events carry them all
    ('{"type": "response.create", "input": "hi", "max_output_tokens": 500, "top_logprobs": 20, '
     '"localserve": {"n": 16}}', "invalid_value", "max_output_tokens"),
    # metadata
    (CREATE + '"metadata": ' + json.dumps({f"k{i}": "v" for i in range(17)}) + '}', "invalid_value", "metadata"),
    # ids
    (CREATE + '"previous_response_id": "' + "r" * 257 + '"}', "string_above_max_length",
     "previous_response_id"),
]


@pytest.mark.parametrize("frame, code, param", BOUNDS,
                         ids=[f"{param}-{index}" for index, (_, _, param) in enumerate(BOUNDS)])
def test_every_size_a_client_controls_is_bounded(server, frame, code, param):
    answer = run(answer_then_usable(server.port, frame))
    assert answer["type"] == "error", answer
    assert (answer["error"]["code"], answer["error"]["param"]) == (code, param)


def test_a_conversation_larger_than_the_store_is_not_kept(server):
    conversations = server.server.conversations

    async def main(port: int) -> list[dict]:
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            # one word the tokenizer does not know: one token, more characters than the whole store holds
            await connection.send(json.dumps(GOOD | {"input": "x" * (MAX_STORED_CHARS + 500)}))
            first = (await collect_response(connection))[-1]
            await connection.send(json.dumps(GOOD | {"previous_response_id": first["response"]["id"]}))
            return [first, (await collect_response(connection))[-1]]

    first, second = run(main(server.port))
    assert first["type"] in CLOSING_EVENTS
    assert second["type"] == "error" and second["error"]["code"] == "previous_response_not_found"
    assert conversations.num_chars <= MAX_STORED_CHARS


UNSUPPORTED = [  # tools, tool_choice, text.format and reasoning are honoured (test_request_formats.py pins them)
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
]


@pytest.mark.parametrize("fields, param", UNSUPPORTED, ids=[param for _, param in UNSUPPORTED])
def test_parameters_that_would_change_the_output_are_refused(server, fields, param):
    answer = run(answer_then_usable(server.port, json.dumps(GOOD | fields)))
    assert answer["type"] == "error", answer
    assert (answer["error"]["code"], answer["error"]["param"]) == ("unsupported_parameter", param)


def test_unknown_parameters_are_refused(server):
    answer = run(answer_then_usable(server.port, json.dumps(GOOD | {"temprature": 0.5})))
    assert (answer["error"]["code"], answer["error"]["param"]) == ("unknown_parameter", "temprature")


def test_the_response_echoes_what_was_requested(server):
    tools = []  # the tiny model's word-level tokenizer is one llguidance cannot read: no grammar runs on it
    requested = {"tools": tools, "tool_choice": "auto", "parallel_tool_calls": False, "top_logprobs": 2,
                 "temperature": 0.5, "top_p": 0.9, "max_output_tokens": 3, "store": False,
                 "text": {"format": {"type": "text"}, "verbosity": "medium"}, "truncation": "disabled",
                 "reasoning": {"effort": "none"}, "user": "someone", "prompt_cache_key": "k1",
                 "service_tier": "auto", "metadata": {"a": "b"}, "instructions": "be brief"}
    final = run(answer_then_usable(server.port, json.dumps(GOOD | requested)))
    assert final["type"] in CLOSING_EVENTS
    response = final["response"]
    assert {name: response[name] for name in requested} == requested
    assert len(response["output"][0]["content"][0]["logprobs"][0]["top_logprobs"]) == 2


# ------------------------------------------------------------------ the checks on their own
def refusal(check, *args) -> tuple[str, str | None]:
    with pytest.raises(ProtocolError) as raised:
        check(*args)
    return raised.value.code, raised.value.param


def test_json_types_booleans_are_no_numbers_and_integers_are():
    assert check_value(None, int, "n") is None
    assert check_value(3, float, "t") == 3.0 and isinstance(check_value(3, float, "t"), float)
    assert check_value(3, (int, float), "x") == 3 and isinstance(check_value(3, (int, float), "x"), int)
    assert check_value(True, bool, "b") is True
    assert refusal(check_value, True, float, "t") == ("invalid_type", "t")
    assert refusal(check_value, True, int, "n") == ("invalid_type", "n")
    assert refusal(check_value, "1", int, "n") == ("invalid_type", "n")
    assert refusal(check_value, 1.5, int, "n") == ("invalid_type", "n")
    assert refusal(check_value, int(HUGE), float, "t") == ("decimal_above_max_value", "t")
    for value in (float("inf"), float("-inf"), float("nan")):
        assert refusal(check_value, value, float, "t") == ("invalid_value", "t")


def test_ranges_at_their_bounds_and_one_past():
    check_range(0, "t", 0, 2)
    check_range(2, "t", 0, 2)
    assert refusal(check_range, 2.0000001, "t", 0, 2) == ("decimal_above_max_value", "t")
    assert refusal(check_range, -1, "n", 0, 2, True) == ("integer_below_min_value", "n")
    check_range(None, "t", 0, 2)


@pytest.mark.parametrize("at_bound, past_bound, code", [
    ("abc", "abcd", "string_above_max_length"), ([1, 2, 3], [1, 2, 3, 4], "array_above_max_length"),
    ({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3, "d": 4}, "object_above_max_length"),
])
def test_lengths_at_their_bound_and_one_past(at_bound, past_bound, code):
    check_length(at_bound, "x", 3)
    with pytest.raises(ProtocolError) as raised:
        check_length(past_bound, "x", 3)
    assert (raised.value.code, raised.value.param) == (code, "x") and "at most 3" in raised.value.message


def test_a_lone_surrogate_is_found_by_its_path():
    assert find_invalid_unicode({"input": [{"content": "fine é"}]}) is None
    assert find_invalid_unicode({"input": [{"content": "ok"}, {"content": "bad \ud800"}]}) == "input[1].content"
    assert find_invalid_unicode({"metadata": {"\udfff": "v"}}) == "metadata"  # a key: its object is named
    assert find_invalid_unicode("\ud800") == "(event)"


def test_parse_json_object():
    assert parse_json_object(b'{"a": [1]}', "the body", "not an object") == {"a": [1]}
    assert refusal(parse_json_object, b"{", "the body", "not an object") == ("invalid_json", None)
    assert refusal(parse_json_object, b"[]", "the body", "not an object") == ("invalid_json", None)
    assert refusal(parse_json_object, "[" * 100_000, "the body", "not an object") == ("invalid_json", None)
    assert refusal(parse_json_object, '{"input": "\\ud800"}', "the body", "x") == ("invalid_value", "input")


def test_a_value_is_shown_short_and_printable():
    assert shown("gpt-4o") == '"gpt-4o"' and shown(3) == "3"
    assert shown("x" * 100, 10) == '"xxxxxxxxx...'
    assert shown("a\nb\x1b\ud800") == '"a\\nb\\u001b\\ud800"'
