"""Client events of `/v1/responses`, parsed and checked (no I/O here).

The text subset of OpenAI's Responses API WebSocket mode. `parse_client_event` turns a frame into a
dict, `parse_response_create` turns a `response.create` event into a `ResponseRequest` (messages and
sampling settings, every field checked). Bad input raises `ProtocolError`, which `error_event` turns
into the `error` event the client gets. The server's events are built in `response_events`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from localserve.engine.sampling_params import SamplingParams

# Sampling settings OpenAI's API has no field for; clients put them in this object of response.create.
EXTENSION_FIELD = "localserve"
EXTENSION_PARAMS = {"top_k": int, "min_p": float, "seed": int, "stop": list, "n": int, "logprobs": int}
MAX_PARALLEL_SAMPLES = 16
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PART_TYPES = ("input_text", "output_text")
MAX_METADATA_KEYS = 16


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


def parse_client_event(frame: str | bytes) -> dict[str, Any]:
    """A client frame as a dict with a string `type`; raises ProtocolError for anything else."""
    if isinstance(frame, bytes):
        raise ProtocolError("unsupported_data", "binary frames are not accepted: send JSON events as text")
    try:
        event = json.loads(frame)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"the message is not valid JSON: {exc}") from None
    if not isinstance(event, dict):
        raise ProtocolError("invalid_json", "an event must be a JSON object")
    if not isinstance(event.get("type"), str):
        raise ProtocolError("missing_required_parameter", "an event needs a string 'type'", "type")
    return event


@dataclass
class ResponseRequest:
    """A checked `response.create`: what to say (messages) and how to sample (everything else)."""

    input_messages: list[dict[str, str]]  # this turn's input, roles user/assistant/system
    instructions: str | None = None
    model: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    stream_id: str | None = None
    extension: dict[str, Any] = field(default_factory=dict)  # checked EXTENSION_PARAMS

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; a value SamplingParams refuses becomes a ProtocolError."""
        ext = self.extension
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, max_tokens=max_tokens,
                top_k=ext.get("top_k"), min_p=ext.get("min_p", 0.0), seed=ext.get("seed"),
                stop=list(ext.get("stop", [])), n=ext.get("n", 1), logprobs=ext.get("logprobs"))
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
            param = {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}.get(
                name, f"{EXTENSION_FIELD}.{name}")
            message = str(exc).replace(f"SamplingParams.{name}", param)
            raise ProtocolError("invalid_value", message, param) from None


def _check_type(event: dict[str, Any], name: str, expected: type | tuple[type, ...],
                param: str | None = None) -> Any:
    """event[name] if it is of the expected JSON type (None when absent or null)."""
    value = event.get(name)
    if value is None:
        return None
    kinds = expected if isinstance(expected, tuple) else (expected,)
    is_number = float in kinds and isinstance(value, int)
    if isinstance(value, bool) and bool not in kinds or not (isinstance(value, kinds) or is_number):
        wanted = " or ".join({int: "an integer", float: "a number", str: "a string", list: "an array",
                              dict: "an object", bool: "a boolean"}[k] for k in kinds)
        got = json.dumps(value)[:60]
        raise ProtocolError("invalid_type", f"'{param or name}' must be {wanted}, got {got}", param or name)
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("invalid_value", f"'{param or name}' must be finite", param or name)
    return float(value) if is_number else value


def _check_range(value: float | None, param: str, low: float, high: float, integer: bool = False) -> None:
    kind = "integer" if integer else "decimal"
    if value is not None and value < low:
        raise ProtocolError(f"{kind}_below_min_value", f"'{param}' must be >= {low}, got {value}", param)
    if value is not None and value > high:
        raise ProtocolError(f"{kind}_above_max_value", f"'{param}' must be <= {high}, got {value}", param)


def _parse_input(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", "'input' must be a string or an array of messages", "input")
    messages = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ProtocolError("invalid_type", f"'{where}' must be a message object", where)
        if item.get("type", "message") != "message":
            raise ProtocolError("unsupported_value", f"'{where}.type' {item.get('type')!r} is not supported: "
                                "this server takes text messages only", f"{where}.type")
        role = item.get("role")
        if role not in ROLES:
            raise ProtocolError("invalid_value", f"'{where}.role' must be one of {sorted(ROLES)}, "
                                f"got {role!r}", f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                part_where = f"{where}.content[{part_index}]"
                if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                    raise ProtocolError("unsupported_value", f"'{part_where}' must be a text part "
                                        f"(type {' or '.join(TEXT_PART_TYPES)})", part_where)
                if not isinstance(part.get("text"), str):
                    raise ProtocolError("invalid_type", f"'{part_where}.text' must be a string",
                                        f"{part_where}.text")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ProtocolError("invalid_type", f"'{where}.content' must be a string or an array of text "
                                "parts", f"{where}.content")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def parse_response_create(event: dict[str, Any]) -> ResponseRequest:
    """Check every field of a `response.create` this server uses; unknown fields are ignored."""
    if event.get("background"):
        raise ProtocolError("unsupported_value", "background responses are not supported over WebSocket",
                            "background")
    if event.get("input") is None:
        raise ProtocolError("missing_required_parameter", "'input' is required", "input")
    request = ResponseRequest(input_messages=_parse_input(event["input"]),
                              instructions=_check_type(event, "instructions", str),
                              model=_check_type(event, "model", str),
                              max_output_tokens=_check_type(event, "max_output_tokens", int),
                              temperature=_check_type(event, "temperature", float),
                              top_p=_check_type(event, "top_p", float),
                              previous_response_id=_check_type(event, "previous_response_id", str),
                              metadata=_check_type(event, "metadata", dict) or {},
                              stream_id=_check_type(event, "stream_id", str))
    _check_range(request.max_output_tokens, "max_output_tokens", 1, 1 << 31, integer=True)
    _check_range(request.temperature, "temperature", 0, 2)
    _check_range(request.top_p, "top_p", 0, 1)
    if len(request.metadata) > MAX_METADATA_KEYS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in request.metadata.items()):
        raise ProtocolError("invalid_value", f"'metadata' must map at most {MAX_METADATA_KEYS} strings (keys "
                            "up to 64 characters) to strings (up to 512 characters)", "metadata")
    top_logprobs = _check_type(event, "top_logprobs", int)
    _check_range(top_logprobs, "top_logprobs", 0, 20, integer=True)
    extension = _check_type(event, EXTENSION_FIELD, dict) or {}
    for name in extension:
        if name not in EXTENSION_PARAMS:
            raise ProtocolError("unknown_parameter", f"'{EXTENSION_FIELD}.{name}' is not a parameter; known: "
                                f"{', '.join(EXTENSION_PARAMS)}", f"{EXTENSION_FIELD}.{name}")
    for name, kind in EXTENSION_PARAMS.items():
        kinds = (str, list) if name == "stop" else kind
        value = _check_type(extension, name, kinds, f"{EXTENSION_FIELD}.{name}")
        if value is not None:
            request.extension[name] = [value] if name == "stop" and isinstance(value, str) else value
    if not all(isinstance(s, str) for s in request.extension.get("stop", [])):
        raise ProtocolError("invalid_type", f"'{EXTENSION_FIELD}.stop' must be a string or an array of "
                            "strings", f"{EXTENSION_FIELD}.stop")
    _check_range(request.extension.get("n"), f"{EXTENSION_FIELD}.n", 1, MAX_PARALLEL_SAMPLES, integer=True)
    if top_logprobs is not None and "logprobs" not in request.extension:
        request.extension["logprobs"] = top_logprobs
    return request
