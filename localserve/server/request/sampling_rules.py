"""The sampling fields every wire format shares, each with its one rule of type and bounds, and the
order they are checked in (no I/O here). A format's field map says where it carries each of them
(server/request/fields.py `Sampling`); the rule is the same whatever the spelling.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localserve.server.request.generation_request import RequestLimits
from localserve.server.request.validation import ProtocolError, check_length, check_range, check_value, shown

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # seeds: a torch generator takes 64 bits
MAX_LOGPROBS = 20  # alternatives per token
MIN_REPETITION_PENALTY = 1e-3


@dataclass(frozen=True)
class NumberRule:
    """A number field's JSON type and bounds. Beyond a closed end: OpenAI's `*_below_min_value` /
    `*_above_max_value`; at an open end, or anywhere outside when `bound_codes` is off: `invalid_value`
    stating the interval."""

    kind: type  # int or float
    low: float
    high: float | Callable[[RequestLimits], int]  # a callable: the bound is one of the server's limits
    low_open: bool = False
    high_open: bool = False
    bound_codes: bool = True

    def check(self, value: Any, param: str, limits: RequestLimits) -> float:
        value = check_value(value, self.kind, param)
        high = self.high(limits) if callable(self.high) else self.high
        outside = value < self.low or value > high
        if outside and self.bound_codes:
            check_range(value, param, self.low, high, integer=self.kind is int)
        if outside or (self.low_open and value == self.low) or (self.high_open and value == high):
            interval = f"{'(' if self.low_open else '['}{self.low:g}, {high:g}{')' if self.high_open else ']'}"
            raise ProtocolError("invalid_value", f"'{param}' must be in {interval}, got {shown(value)}", param)
        return value


@dataclass(frozen=True)
class StopRule:
    """Stop strings: one string or an array of them, bounded in number and length, none empty."""

    def check(self, value: Any, param: str, limits: RequestLimits) -> tuple[str, ...]:
        value = check_value(value, (str, list), param)
        stops = [value] if isinstance(value, str) else value
        check_length(stops, param, limits.max_stop_strings)
        for index, stop in enumerate(stops):
            if not isinstance(stop, str):
                raise ProtocolError("invalid_type", f"'{param}' must be a string or an array of strings", param)
            check_length(stop, f"{param}[{index}]", limits.max_stop_chars)
            if not stop:
                raise ProtocolError("invalid_value", f"'{param}' must hold non-empty strings", param)
        return tuple(stops)


# The sampling fields every format shares, each with its one rule, in the order they are checked.
SAMPLING_RULES: dict[str, NumberRule | StopRule] = {
    "max_tokens": NumberRule(int, 1, INT64_MAX),
    "temperature": NumberRule(float, 0, 2),
    "top_p": NumberRule(float, 0, 1, low_open=True),
    "top_k": NumberRule(int, 1, INT64_MAX),
    "min_p": NumberRule(float, 0, 1, high_open=True, bound_codes=False),
    "seed": NumberRule(int, INT64_MIN, INT64_MAX),
    "stop": StopRule(),
    "n": NumberRule(int, 1, lambda limits: limits.max_parallel_samples),
    "logprobs": NumberRule(int, 0, MAX_LOGPROBS),
    "presence_penalty": NumberRule(float, -2, 2),
    "frequency_penalty": NumberRule(float, -2, 2),
    # > 0 (a penalty divides positive logits); larger than this only ever bans every seen token
    "repetition_penalty": NumberRule(float, MIN_REPETITION_PENALTY, 10),
}
SAMPLING_ORDER = tuple(SAMPLING_RULES)
