"""The wire format of `/v1/responses`: client events in, server events out (no I/O here).

The text subset of OpenAI's Responses API WebSocket mode. `parse_client_event` turns a frame into a
dict, `parse_response_create` turns a `response.create` event into a `ResponseRequest` (messages and
sampling settings, every field checked), and `ResponseStream` builds the events of one response in
order, each with its `sequence_number`. Bad input raises `ProtocolError`, which `error_event` turns
into the `error` event the client gets.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localserve.outputs import RequestOutput
from localserve.sampling_params import SamplingParams

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


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `resp_...`, `msg_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


TokenText = Callable[[int], str]


class ResponseStream:
    """The server events of one response, in order, built from the engine's outputs.

    `absorb` takes each RequestOutput (on the event loop); `drain` returns the events not yet sent:
    the opening events the first time, one `response.output_text.delta` per output item with all text
    absorbed since the last drain (so at most one per engine step, fewer for a slow client), and the
    closing events once the request has finished, been cancelled or failed.
    """

    def __init__(self, request: ResponseRequest, response_id: str, model: str, num_prompt_tokens: int,
                 token_text: TokenText) -> None:
        self.request, self.response_id, self.model = request, response_id, model
        self.num_prompt_tokens = num_prompt_tokens
        self.token_text = token_text
        self.created_at = int(time.time())
        num_items = request.extension.get("n", 1)
        self.item_ids = [new_id("msg") for _ in range(num_items)]
        self.texts = [""] * num_items
        self.pending_texts = [""] * num_items
        self.pending_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_items)]
        self.all_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(num_items)]
        self.num_output_tokens = [0] * num_items
        self.finish_reasons: list[str | None] = [None] * num_items
        self.num_cached_tokens = 0
        self.status = "in_progress"  # -> completed | incomplete | cancelled | failed
        self.error_message: str | None = None
        self._next_sequence_number = 0
        self._started = False
        self._closed = False

    @property
    def is_done(self) -> bool:
        """The engine is finished with this response (the closing events may still be unsent)."""
        return self.status != "in_progress"

    @property
    def has_unsent_events(self) -> bool:
        return not self._started or any(self.pending_texts) or any(self.pending_logprobs) or (
            self.is_done and not self._closed)

    def absorb(self, output: RequestOutput) -> None:
        """Take one engine output: new text (and logprobs), and the outcome once finished."""
        if self.is_done:  # cancelled while this output was on its way
            return
        self.num_cached_tokens = output.num_cached_tokens
        for completion in output.outputs[:len(self.texts)]:
            index = completion.index
            self.pending_texts[index] += completion.delta_text
            self.texts[index] += completion.delta_text
            self.num_output_tokens[index] = len(completion.token_ids)
            self.finish_reasons[index] = completion.finish_reason
            if self.request.extension.get("logprobs") is not None and completion.delta_token_ids:
                first = len(completion.token_ids) - len(completion.delta_token_ids)
                for offset, token_id in enumerate(completion.delta_token_ids):
                    entry = self._logprob_entry(token_id, completion.logprobs[first + offset],
                                                completion.top_logprobs[first + offset]
                                                if len(completion.top_logprobs) > first + offset else [])
                    self.pending_logprobs[index].append(entry)
                    self.all_logprobs[index].append(entry)
        if output.error:
            self.fail(output.error)
        elif output.finished:
            self.status = "incomplete" if "length" in self.finish_reasons else "completed"

    def cancel(self) -> None:
        """The client cancelled: close with what was generated so far."""
        if not self.is_done:
            self.status = "cancelled"

    def fail(self, message: str) -> None:
        """The engine failed this request; it closes with `response.failed`."""
        if not self.is_done:
            self.status, self.error_message = "failed", message

    def drain(self) -> list[dict[str, Any]]:
        """The events not sent yet, numbered."""
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [{"type": "response.created", "response": self.response_object("in_progress")},
                       {"type": "response.in_progress", "response": self.response_object("in_progress")}]
            for index, item_id in enumerate(self.item_ids):
                events.append({"type": "response.output_item.added", "output_index": index,
                               "item": self._message_item(index, "in_progress", with_text=False)})
                events.append({"type": "response.content_part.added", "item_id": item_id,
                               "output_index": index, "content_index": 0, "part": self._text_part("", [])})
        for index, item_id in enumerate(self.item_ids):
            if self.pending_texts[index] or self.pending_logprobs[index]:
                events.append({"type": "response.output_text.delta", "item_id": item_id,
                               "output_index": index, "content_index": 0, "delta": self.pending_texts[index],
                               "logprobs": self.pending_logprobs[index]})
                self.pending_texts[index], self.pending_logprobs[index] = "", []
        if self.is_done and not self._closed:
            self._closed = True
            events += self._closing_events()
        for event in events:
            event["sequence_number"] = self._next_sequence_number
            self._next_sequence_number += 1
            if self.request.stream_id is not None:
                event["stream_id"] = self.request.stream_id
        return events

    def _closing_events(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item_status = "completed" if self.status == "completed" else "incomplete"
        for index, item_id in enumerate(self.item_ids):
            part = self._text_part(self.texts[index], self.all_logprobs[index])
            events += [{"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                        "content_index": 0, "text": self.texts[index], "logprobs": self.all_logprobs[index]},
                       {"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                        "content_index": 0, "part": part},
                       {"type": "response.output_item.done", "output_index": index,
                        "item": self._message_item(index, item_status)}]
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(self.status,
                                                                                    "response.incomplete")
        events.append({"type": kind, "response": self.response_object(self.status)})
        return events

    def response_object(self, status: str) -> dict[str, Any]:
        """The `response` object of OpenAI's API for this response in `status`."""
        request = self.request
        done = status != "in_progress"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "model": self.model, "instructions": request.instructions,
            "output": [self._message_item(i, "completed" if status == "completed" else "incomplete")
                       for i in range(len(self.item_ids))] if done else [],
            "error": {"code": "server_error", "message": self.error_message} if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "max_output_tokens": request.max_output_tokens, "metadata": request.metadata,
            "previous_response_id": request.previous_response_id, "parallel_tool_calls": False,
            "temperature": request.temperature, "top_p": request.top_p, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        """Token counts, with the prompt tokens served from the prefix cache."""
        output_tokens = sum(self.num_output_tokens)
        return {"input_tokens": self.num_prompt_tokens, "output_tokens": output_tokens,
                "total_tokens": self.num_prompt_tokens + output_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def _message_item(self, index: int, status: str, with_text: bool = True) -> dict[str, Any]:
        content = [self._text_part(self.texts[index], self.all_logprobs[index])] if with_text else []
        return {"id": self.item_ids[index], "type": "message", "role": "assistant", "status": status,
                "content": content}

    def _text_part(self, text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict[str, Any]:
        entry = self._token_logprob(token_id, logprob)
        entry["top_logprobs"] = [self._token_logprob(top_id, top_logprob) for top_id, top_logprob in top]
        return entry

    def _token_logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob}
