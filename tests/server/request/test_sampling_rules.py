"""The shared sampling fields' rules, each at its bound and past it, and the JSON types they take."""

from __future__ import annotations

import math

import pytest

from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.sampling_rules import INT64_MAX, SAMPLING_RULES
from localserve.server.request.validation import ProtocolError

LIMITS = RequestLimits(max_stop_strings=2, max_stop_chars=3, max_parallel_samples=4)


@pytest.mark.parametrize("name, at_bound, past_bound, code", [
    ("temperature", 2, math.nextafter(2, 3), "decimal_above_max_value"),
    ("temperature", 0, -0.5, "decimal_below_min_value"),
    ("top_p", math.nextafter(0, 1), 0, "invalid_value"),  # an open end
    ("top_p", 1, 1.5, "decimal_above_max_value"),
    ("min_p", math.nextafter(1, 0), 1, "invalid_value"),
    ("min_p", 0, -0.1, "invalid_value"),  # every value outside [0, 1) says the interval
    ("top_k", 1, 0, "integer_below_min_value"),
    ("seed", INT64_MAX, INT64_MAX + 1, "integer_above_max_value"),
    ("n", 4, 5, "integer_above_max_value"),  # the limit: LIMITS.max_parallel_samples
    ("logprobs", 20, 21, "integer_above_max_value"),
    ("repetition_penalty", 0.001, math.nextafter(0.001, 0), "decimal_below_min_value"),
    ("presence_penalty", -2, -2.5, "decimal_below_min_value"),
])
def test_each_number_rule_at_its_bound_and_past_it(name, at_bound, past_bound, code):
    rule = SAMPLING_RULES[name]
    assert rule.check(at_bound, name, LIMITS) == at_bound
    with pytest.raises(ProtocolError) as raised:
        rule.check(past_bound, name, LIMITS)
    assert (raised.value.code, raised.value.param) == (code, name)


def test_number_rules_take_json_types_only():
    rule = SAMPLING_RULES["temperature"]
    assert rule.check(1, "t", LIMITS) == 1.0 and isinstance(rule.check(1, "t", LIMITS), float)
    for value, code in [(True, "invalid_type"), ("1", "invalid_type"), (math.nan, "invalid_value"),
                        (10 ** 400, "decimal_above_max_value")]:
        with pytest.raises(ProtocolError) as raised:
            rule.check(value, "t", LIMITS)
        assert raised.value.code == code
    with pytest.raises(ProtocolError) as raised:
        SAMPLING_RULES["top_k"].check(2.0, "k", LIMITS)
    assert raised.value.code == "invalid_type"


def test_stop_strings():
    rule = SAMPLING_RULES["stop"]
    assert rule.check("ab", "stop", LIMITS) == ("ab",)
    assert rule.check(["a", "abc"], "stop", LIMITS) == ("a", "abc")
    for value, expected in [(["a", "b", "c"], ("array_above_max_length", "stop")),
                            (["abcd"], ("string_above_max_length", "stop[0]")), ([""], ("invalid_value", "stop")),
                            (["a", 1], ("invalid_type", "stop")), (5, ("invalid_type", "stop"))]:
        with pytest.raises(ProtocolError) as raised:
            rule.check(value, "stop", LIMITS)
        assert (raised.value.code, raised.value.param) == expected
