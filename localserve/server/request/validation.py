"""Checks on client JSON shared by every request parser: errors that name the parameter, JSON types,
finite numbers in range, valid Unicode. No I/O, no knowledge of any one event's fields.

Bad input raises `ProtocolError`; `error_event` turns it into the `error` event the client gets.
"""

from __future__ import annotations

import json
import math
from typing import Any


class ProtocolError(Exception):
    """A client mistake, reported as an `error` event (the connection stays open)."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.error_type, self.status = error_type, status


def error_event(error: ProtocolError, stream_id: str | None = None) -> dict[str, Any]:
    """The `error` server event for `error` (the shape of the SDK's `ResponseWsError`)."""
    event: dict[str, Any] = {"type": "error", "status": error.status,
                             "error": {"type": error.error_type, "code": error.code, "message": error.message,
                                       "param": error.param}}
    if stream_id is not None:
        event["stream_id"] = stream_id
    return event


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", list: "an array", dict: "an object",
               bool: "a boolean"}


def shown(value: Any, limit: int = 60) -> str:
    """A short, printable rendering of a client value for an error message."""
    text = json.dumps(value, default=str)  # ensure_ascii: lone surrogates and control characters escaped
    return text if len(text) <= limit else text[:limit] + "..."


def check_type(container: dict[str, Any], name: str, expected: type | tuple[type, ...],
               param: str | None = None) -> Any:
    """container[name] if it is of the expected JSON type (None when absent or null); see check_value."""
    return check_value(container.get(name), expected, param or name)


def check_value(value: Any, expected: type | tuple[type, ...], param: str) -> Any:
    """`value` if it is of the expected JSON type (None stays None); else an error naming `param`.

    Booleans are not numbers; an integer is a number (and becomes a float). A number too large for a
    float, infinity and NaN are refused: nothing non-finite gets past the edge.
    """
    if value is None:
        return None
    kinds = expected if isinstance(expected, tuple) else (expected,)
    is_number = float in kinds and isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, bool) and bool not in kinds or not (isinstance(value, kinds) or is_number):
        wanted = " or ".join(_TYPE_NAMES[kind] for kind in kinds)
        raise ProtocolError("invalid_type", f"'{param}' must be {wanted}, got {shown(value)}", param)
    if is_number and float in kinds and int not in kinds:
        try:
            value = float(value)
        except OverflowError:
            raise ProtocolError("decimal_above_max_value", f"'{param}' is too large, got {shown(value)}",
                                param) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("invalid_value", f"'{param}' must be a finite number", param)
    return value


def check_range(value: float | None, param: str, low: float, high: float, integer: bool = False) -> None:
    """Refuse a number outside [low, high] with OpenAI's `*_below_min_value` / `*_above_max_value` codes."""
    kind = "integer" if integer else "decimal"
    if value is not None and value < low:
        raise ProtocolError(f"{kind}_below_min_value", f"'{param}' must be >= {low}, got {shown(value)}", param)
    if value is not None and value > high:
        raise ProtocolError(f"{kind}_above_max_value", f"'{param}' must be <= {high}, got {shown(value)}", param)


def check_length(value: str | list | dict | None, param: str, maximum: int) -> None:
    """Refuse a string longer than `maximum` characters, or an array or object of more items (OpenAI's
    `string_above_max_length` / `array_above_max_length` / `object_above_max_length`)."""
    if value is None or len(value) <= maximum:
        return
    kind, what = {str: ("string", "characters"), list: ("array", "items"), dict: ("object", "keys")}[type(value)]
    raise ProtocolError(f"{kind}_above_max_length", f"'{param}' may hold at most {maximum} {what}, got "
                        f"{len(value)}", param)


def find_invalid_unicode(value: Any, path: str = "") -> str | None:
    """The path of the first string (key or value) in a JSON value that is not valid Unicode.

    JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer, socket or file accepts.
    """
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "(event)"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                if not key.isascii():
                    try:
                        key.encode("utf-8")
                    except UnicodeEncodeError:
                        return where or "(event)"
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(item))
    return None


def parse_json_object(text: str | bytes, name: str, not_an_object: str) -> dict[str, Any]:
    """`text` as a JSON object holding only valid Unicode; a ProtocolError naming `name` ("the body",
    "the message") when it is not JSON, and `not_an_object` when it is JSON but not an object."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested deeper than the parser goes
        raise ProtocolError("invalid_json", f"{name} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise ProtocolError("invalid_json", not_an_object)
    where = find_invalid_unicode(value)
    if where is not None:
        raise ProtocolError("invalid_value", f"'{where}' is not valid Unicode (it holds a lone surrogate)", where)
    return value
