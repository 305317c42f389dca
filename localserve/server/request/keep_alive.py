"""How long a model stays loaded once a request is over (`GenerationRequest.keep_alive_s`), as Ollama's
`keep_alive` spells it on `/api/chat`, `/api/generate` and `/api/embed` (no I/O here)."""

from __future__ import annotations

import math
import re
from typing import Any

from localserve.server.request import fields
from localserve.server.request.validation import ProtocolError, shown

# Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "0.5s"; a bare number string is
# seconds too); a negative one keeps the model loaded for good, 0 unloads it as soon as the request is over.
NUMBER = re.compile(r"\d+(?:\.\d*)?|\.\d+")
DURATION = re.compile(r"(?:(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h))+")
DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h)")
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE_S = 10 * 365 * 86400.0  # longer is for good


def parse_keep_alive(value: Any, param: str) -> float:
    """`keep_alive` in seconds (math.inf: for good); ProtocolError naming `param` for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ProtocolError("invalid_type", f"'{param}' must be a number of seconds or a duration such as "
                            f"\"5m\", got {type(value).__name__}", param)
    if isinstance(value, str):
        body = value.strip()
        sign = -1.0 if body.startswith("-") else 1.0
        body = body.removeprefix("-") if sign < 0 else body.removeprefix("+")
        if NUMBER.fullmatch(body):
            seconds = float(body)
        elif DURATION.fullmatch(body):
            seconds = sum(float(number) * DURATION_UNITS[unit] for number, unit in DURATION_PART.findall(body))
        else:
            raise ProtocolError("invalid_value", f"'{param}' must be a number of seconds or a duration such as "
                                f"\"5m\" or \"1h30m\", got {shown(value)}", param)
        value = sign * seconds
    if value != value:  # NaN
        raise ProtocolError("invalid_value", f"'{param}' must be a number of seconds, got NaN", param)
    return math.inf if value < 0 or value > MAX_KEEP_ALIVE_S else float(value)


class KeepAlive(fields.Field):
    """`keep_alive`: how long the model stays loaded once this request is over (parse_keep_alive)."""

    shared = "keep_alive_s"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        draft.set("keep_alive_s", parse_keep_alive(value, param), param)
