"""Every bound a client controls in a request, at the bound and one past it, on every wire format that
carries the field (/v1/responses over HTTP and over the websocket, /v1/chat/completions,
/v1/completions): exactly the limit is accepted, one more is refused, naming the field.

The request limits are set small here (the defaults are tested the same way, only slower to reach);
the server runs on a recording engine thread (tests/helpers/request_wire.py), so what the engine
would run is compared too. A float bound's "one past" is the next float beyond it.
"""

from __future__ import annotations

import math

import pytest

from localserve.server.request.generation_request import RequestLimits
from tests.helpers.request_wire import (
    RESPONSES_HTTP,
    RESPONSES_WS,
    Outcome,
    RecordingEngineThread,
    WireClient,
    formats_carrying,
)
from tests.helpers.server import running_server

LIMITS = RequestLimits(max_input_chars=40, max_conversation_chars=60, max_input_items=3, max_stop_strings=2,
                       max_stop_chars=4, max_parallel_samples=3, max_logprob_entries=60, max_metadata_keys=2,
                       max_metadata_key_chars=3, max_metadata_value_chars=5, max_id_chars=40, max_tools=2)
MAX_MODEL_LEN = 512  # the tiny model's context
SERVED_NAME = "tinychat" + "x" * 32  # an id as long as the limit allows
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def tools(count: int) -> list[dict]:
    return [{"type": "function", "name": f"f{index}"} for index in range(count)]


def past(bound: float, direction: float) -> float:
    """The next float beyond `bound` going towards `direction`."""
    return math.nextafter(bound, direction)


def refused(code: str, field: str) -> Outcome:
    return Outcome(status=400, code=code, field=field)


# (what, the case at the bound, its outcome (None: accepted), the case one past it, its outcome)
BOUNDS = [
    ("input chars", {"input_text": "x" * 40}, None, {"input_text": "x" * 41},
     refused("string_above_max_length", "input")),
    ("input and instructions chars", {"input_text": "x" * 20, "instructions": "i" * 20}, None,
     {"input_text": "x" * 21, "instructions": "i" * 20}, refused("string_above_max_length", "input")),
    ("input items", {"input_items": ["hi"] * 3}, None, {"input_items": ["hi"] * 4},
     refused("array_above_max_length", "input")),
    ("stop strings", {"stop": ["a", "b"]}, None, {"stop": ["a", "b", "c"]}, refused("array_above_max_length", "stop")),
    ("stop string chars", {"stop": "abcd"}, None, {"stop": "abcde"}, refused("string_above_max_length", "stop[0]")),
    ("parallel samples", {"n": 3}, None, {"n": 4}, refused("integer_above_max_value", "n")),
    ("one sample at least", {"n": 1}, None, {"n": 0}, refused("integer_below_min_value", "n")),
    ("logprob entries", {"logprobs": 2, "max_tokens": 20}, None, {"logprobs": 2, "max_tokens": 21},
     refused("invalid_value", "max_tokens")),
    ("logprob entries of samples", {"logprobs": 0, "n": 3, "max_tokens": 20}, None,
     {"logprobs": 0, "n": 3, "max_tokens": 21}, refused("invalid_value", "max_tokens")),
    ("logprob entries (max_completion_tokens)", {"logprobs": 2, "max_completion_tokens": 20}, None,
     {"logprobs": 2, "max_completion_tokens": 21}, refused("invalid_value", "max_tokens")),
    ("logprobs at most 20", {"logprobs": 20, "max_tokens": 1}, None, {"logprobs": 21, "max_tokens": 1},
     refused("integer_above_max_value", "logprobs")),
    ("logprobs at least 0", {"logprobs": 0, "max_tokens": 1}, None, {"logprobs": -1, "max_tokens": 1},
     refused("integer_below_min_value", "logprobs")),
    ("localserve.logprobs at most 20", {"extension_logprobs": 20, "max_tokens": 1}, None,
     {"extension_logprobs": 21, "max_tokens": 1}, refused("integer_above_max_value", "extension_logprobs")),
    ("metadata keys", {"metadata": {"abc": "vvvvv", "def": "wwwww"}}, None,
     {"metadata": {"abc": "v", "def": "w", "ghi": "x"}}, refused("invalid_value", "metadata")),
    ("metadata key chars", {"metadata": {"abc": "v"}}, None, {"metadata": {"abcd": "v"}},
     refused("invalid_value", "metadata")),
    ("metadata value chars", {"metadata": {"abc": "vvvvv"}}, None, {"metadata": {"abc": "vvvvvv"}},
     refused("invalid_value", "metadata")),
    ("model chars", {"model": SERVED_NAME}, None, {"model": SERVED_NAME + "x"},
     refused("string_above_max_length", "model")),
    ("previous_response_id chars", {"previous_response_id": "resp_" + "0" * 35},
     refused("previous_response_not_found", "previous_response_id"), {"previous_response_id": "resp_" + "0" * 36},
     refused("string_above_max_length", "previous_response_id")),
    ("temperature at most 2", {"temperature": 2}, None, {"temperature": past(2, 3)},
     refused("decimal_above_max_value", "temperature")),
    ("temperature at least 0", {"temperature": 0}, None, {"temperature": past(0, -1)},
     refused("decimal_below_min_value", "temperature")),
    ("top_p at most 1", {"top_p": 1}, None, {"top_p": past(1, 2)}, refused("decimal_above_max_value", "top_p")),
    ("top_p above 0", {"top_p": past(0, 1)}, None, {"top_p": 0}, refused("invalid_value", "top_p")),
    ("top_k at least 1", {"top_k": 1}, None, {"top_k": 0}, refused("integer_below_min_value", "top_k")),
    ("top_k int64", {"top_k": INT64_MAX}, None, {"top_k": INT64_MAX + 1}, refused("integer_above_max_value", "top_k")),
    ("min_p at least 0", {"min_p": 0}, None, {"min_p": past(0, -1)}, refused("invalid_value", "min_p")),
    ("min_p below 1", {"min_p": past(1, 0)}, None, {"min_p": 1}, refused("invalid_value", "min_p")),
    *[(f"{name} {side}", {name: bound}, None, {name: past(bound, 3 * bound)},
       refused(f"decimal_{side}_value", name))
      for name in ("presence_penalty", "frequency_penalty") for side, bound in (("above_max", 2), ("below_min", -2))],
    ("repetition_penalty at least 0.001", {"repetition_penalty": 0.001}, None,
     {"repetition_penalty": past(0.001, 0)}, refused("decimal_below_min_value", "repetition_penalty")),
    ("repetition_penalty at most 10", {"repetition_penalty": 10}, None, {"repetition_penalty": past(10, 11)},
     refused("decimal_above_max_value", "repetition_penalty")),
    ("seed int64 low", {"seed": INT64_MIN}, None, {"seed": INT64_MIN - 1}, refused("integer_below_min_value", "seed")),
    ("seed int64 high", {"seed": INT64_MAX}, None, {"seed": INT64_MAX + 1}, refused("integer_above_max_value", "seed")),
    ("max tokens at least 1", {"max_tokens": 1}, None, {"max_tokens": 0},
     refused("integer_below_min_value", "max_tokens")),
    ("max tokens the context", {"max_tokens": MAX_MODEL_LEN}, None, {"max_tokens": MAX_MODEL_LEN + 1},
     refused("integer_above_max_value", "max_tokens")),
    ("max_completion_tokens the context", {"max_completion_tokens": MAX_MODEL_LEN}, None,
     {"max_completion_tokens": MAX_MODEL_LEN + 1}, refused("integer_above_max_value", "max_tokens")),
    ("tools", {"tools": tools(2)}, None, {"tools": tools(3)}, refused("array_above_max_length", "tools")),
]
CASES = [pytest.param(fmt, case, expected, id=f"{what}-{side}-{fmt}")
         for what, at_case, at_expected, past_case, past_expected in BOUNDS
         for side, case, expected in (("at", at_case, at_expected), ("past", past_case, past_expected))
         for fmt in formats_carrying(at_case)]


@pytest.fixture(scope="module")
def wire(tiny_chat_llm):
    with running_server(tiny_chat_llm, engine_thread_type=RecordingEngineThread, model_alias=SERVED_NAME,
                        limits=LIMITS) as server:
        client = WireClient(server.port, server.server.models.serving_now().engine)
        yield client
        client.close()


def check_accepted(outcome: Outcome, case: dict) -> None:
    """Accepted, and what reached the engine is what was sent (max_tokens cut to the context's room)."""
    assert outcome.accepted, outcome
    params = outcome.params
    for name, value in case.items():
        if name in ("max_tokens", "max_completion_tokens"):
            assert params.max_tokens == value if value < MAX_MODEL_LEN else 0 < params.max_tokens < MAX_MODEL_LEN
        elif name in ("logprobs", "extension_logprobs"):
            assert params.logprobs == value
        elif name == "tools":
            assert params.grammar is not None and params.grammar.kind == "lark"  # the calls' grammar
        elif name in params.__slots__:
            assert getattr(params, name) == ([value] if name == "stop" and isinstance(value, str) else value)


@pytest.mark.parametrize("fmt, case, expected", CASES)
def test_each_bound_holds_exactly(wire, fmt, case, expected):
    outcome = wire.send(fmt, case)
    if expected is None:
        check_accepted(outcome, case)
    else:
        assert outcome == expected


@pytest.mark.parametrize("fmt", [RESPONSES_HTTP, RESPONSES_WS])
def test_the_conversation_bound_counts_the_stored_turns(wire, fmt):
    first = wire.send(fmt, {"input_text": "c" * 30})
    assert first.accepted
    at_bound = wire.send(fmt, {"previous_response_id": first.response_id, "input_text": "d" * 30})
    check_accepted(at_bound, {})
    assert wire.send(fmt, {"previous_response_id": first.response_id, "input_text": "d" * 31}) == refused(
        "string_above_max_length", "input")
