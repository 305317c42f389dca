"""`response.create`, parsed and checked into a `ResponseRequest` (no I/O here).

The request model of OpenAI's Responses API as this server serves it, independent of the transport:
the websocket session uses it, and an HTTP `POST /v1/responses` can share it. Every field of OpenAI's
`response.create` is either honoured, ignored for a stated reason (`IGNORED_FIELDS`), or refused
with `unsupported_parameter` when honouring it would change the output and this server cannot; any
other field is an `unknown_parameter`. Every size a client controls is bounded by `RequestLimits`.
docs/PROTOCOL.md lists the same, field by field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from localserve.engine.sampling_params import SamplingParams
from localserve.server.validation import (
    ProtocolError,
    check_length,
    check_range,
    check_type,
    parse_json_object,
    shown,
)

# Sampling settings OpenAI's API has no field for; clients put them in this object of response.create.
EXTENSION_FIELD = "localserve"
EXTENSION_PARAMS = {"top_k": int, "min_p": float, "seed": int, "stop": (str, list), "n": int, "logprobs": int,
                    "presence_penalty": float, "frequency_penalty": float, "repetition_penalty": float}
MIN_REPETITION_PENALTY = 1e-3
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PART_TYPES = ("input_text", "output_text")
STREAM_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,256}")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # seeds: a torch generator takes 64 bits

# Fields accepted and echoed in the response object, that change nothing here, and why.
IGNORED_FIELDS = {
    "parallel_tool_calls": "the model is never offered tools, so it calls none",
    "max_tool_calls": "the model is never offered tools, so it calls none",
    "service_tier": "there is one tier",
    "user": "there are no accounts", "safety_identifier": "there are no accounts",
    "prompt_cache_key": "the prefix cache finds shared blocks by their content, with no key",
    "prompt_cache_retention": "cached blocks stay until the pool needs them",
    "stream": "over a websocket every response streams",
    "stream_options": "over a websocket every response streams",
    "background_options": "there are no background responses",
    "image": "the server takes text only",
    "access_programs": "there are no access programs",
}
# Fields honoured (or refused when a value would change the output; see _refuse_unsupported).
HONOURED_FIELDS = {"type", "input", "instructions", "model", "previous_response_id", "max_output_tokens",
                   "temperature", "top_p", "top_logprobs", "metadata", "stream_id", "store", "generate",
                   "include", "prompt_cache_options", "tools", "tool_choice", "text", "reasoning", "truncation",
                   "background", "prompt", "conversation", "context_management", "moderation", "multi_agent",
                   EXTENSION_FIELD}


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on everything a client sizes in one request (documented in docs/PROTOCOL.md)."""

    max_input_chars: int = 1 << 20  # input text plus instructions of one request, before tokenization
    max_conversation_chars: int = 4 << 20  # a stored conversation plus the new input
    max_input_items: int = 4096
    max_stop_strings: int = 8
    max_stop_chars: int = 128  # each stop string is searched for after every token
    max_parallel_samples: int = 16
    max_logprob_entries: int = 1 << 16  # (logprobs + 1) x n x max_output_tokens: the closing events' size
    max_metadata_keys: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
    max_id_chars: int = 256  # model and previous_response_id


@dataclass
class ResponseRequest:
    """A checked `response.create`: what to say (messages) and how to sample (everything else)."""

    input_messages: list[dict[str, str]]  # this turn's input, roles user/assistant/system
    prompt: str | None = None  # instead of messages: text tokenized as it is, no chat template (completions)
    instructions: str | None = None
    model: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    stream_id: str | None = None
    store: bool = True  # False: only the connection that made it may continue it
    generate: bool = True  # False: prefill the input into the cache, answer with no output
    logprobs: int | None = None  # alternatives per token, when log-probabilities are wanted
    extension: dict[str, Any] = field(default_factory=dict)  # checked EXTENSION_PARAMS
    echo: dict[str, Any] = field(default_factory=dict)  # accepted OpenAI fields echoed as requested
    # how errors name the fields: the HTTP chat and completions bodies spell them differently
    extension_prefix: str = f"{EXTENSION_FIELD}."
    max_tokens_field: str = "max_output_tokens"
    input_field: str = "input"

    @property
    def num_samples(self) -> int:
        return self.extension.get("n", 1)

    @property
    def num_input_chars(self) -> int:
        return (sum(len(message["content"]) for message in self.input_messages) + len(self.instructions or "")
                + len(self.prompt or ""))

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; a value SamplingParams refuses becomes a ProtocolError."""
        ext = self.extension
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, max_tokens=max_tokens,
                top_k=ext.get("top_k"), min_p=ext.get("min_p", 0.0), seed=ext.get("seed"),
                stop=list(ext.get("stop", [])), n=self.num_samples, logprobs=self.logprobs,
                presence_penalty=ext.get("presence_penalty", 0.0), frequency_penalty=ext.get("frequency_penalty", 0.0),
                repetition_penalty=ext.get("repetition_penalty", 1.0))
        except ValueError as exc:
            name = str(exc).split(" ", 1)[0].removeprefix("SamplingParams.")
            param = {"max_tokens": self.max_tokens_field, "temperature": "temperature", "top_p": "top_p"}.get(
                name, f"{self.extension_prefix}{name}")
            message = str(exc).replace(f"SamplingParams.{name}", param)
            raise ProtocolError("invalid_value", message, param) from None


def parse_client_event(frame: str | bytes) -> dict[str, Any]:
    """A client frame as a dict with a string `type`; raises ProtocolError for anything else."""
    if isinstance(frame, bytes):
        raise ProtocolError("unsupported_data", "binary frames are not accepted: send JSON events as text")
    event = parse_json_object(frame, "the message", "an event must be a JSON object")
    if not isinstance(event.get("type"), str):
        raise ProtocolError("missing_required_parameter", "an event needs a string 'type'", "type")
    return event


def event_stream_id(event: dict[str, Any]) -> str | None:
    """The event's `stream_id` if it is a valid lane name (errors about the event are sent on its lane)."""
    stream_id = event.get("stream_id")
    return stream_id if isinstance(stream_id, str) and STREAM_ID_PATTERN.fullmatch(stream_id) else None


def check_stream_id(event: dict[str, Any]) -> str | None:
    """The event's lane: None (the default lane) or 1-256 characters of [A-Za-z0-9_.-]."""
    stream_id = event.get("stream_id")
    if stream_id is None:
        return None
    if not isinstance(stream_id, str) or not STREAM_ID_PATTERN.fullmatch(stream_id):
        raise ProtocolError("invalid_stream_id", f"'stream_id' must be 1-256 characters of A-Z, a-z, 0-9, "
                            f"'_', '.' and '-', got {shown(stream_id)}", "stream_id")
    return stream_id


def _parse_input(value: Any, limits: RequestLimits) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", "'input' must be a string or an array of messages", "input")
    check_length(value, "input", limits.max_input_items)
    messages = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise ProtocolError("invalid_type", f"'{where}' must be a message object", where)
        kind = check_type(item, "type", str, f"{where}.type") or "message"
        if kind != "message":
            raise ProtocolError("unsupported_value", f"'{where}.type' {shown(kind)} is not supported: this "
                                "server takes text messages only", f"{where}.type")
        role = check_type(item, "role", str, f"{where}.role")
        if role not in ROLES:
            raise ProtocolError("invalid_value", f"'{where}.role' must be one of {sorted(ROLES)}, "
                                f"got {shown(role)}", f"{where}.role")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                part_where = f"{where}.content[{part_index}]"
                if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
                    raise ProtocolError("unsupported_value", f"'{part_where}' must be a text part "
                                        f"(type {' or '.join(TEXT_PART_TYPES)})", part_where)
                texts.append(check_type(part, "text", str, f"{part_where}.text") or "")
            content = "".join(texts)
        if not isinstance(content, str):
            raise ProtocolError("invalid_type", f"'{where}.content' must be a string or an array of text "
                                "parts", f"{where}.content")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def _refuse_unsupported(event: dict[str, Any]) -> None:
    """Refuse values that would change the output in ways this server cannot honour."""
    def refuse(param: str, why: str) -> None:
        raise ProtocolError("unsupported_parameter", f"'{param}' is not supported: {why}", param)

    if event.get("background"):
        refuse("background", "background responses do not exist over a websocket")
    tool_choice = check_type(event, "tool_choice", (str, dict))
    if tool_choice is not None and tool_choice not in ("auto", "none"):
        refuse("tool_choice", "this server never calls tools, so it cannot be made to call one")
    text = check_type(event, "text", dict) or {}
    text_format = check_type(text, "format", dict, "text.format") or {}
    if text_format.get("type", "text") != "text":
        refuse("text.format", f"structured output ({shown(text_format.get('type'))}) is not supported; "
               "only plain text")
    if text.get("verbosity") not in (None, "medium"):
        refuse("text.verbosity", "the model's length is set with max_output_tokens")
    reasoning = check_type(event, "reasoning", dict) or {}
    if reasoning.get("effort") not in (None, "none") or any(
            value is not None for key, value in reasoning.items() if key != "effort"):
        refuse("reasoning", "the served model does not reason apart from its answer")
    if event.get("truncation") not in (None, "disabled"):
        refuse("truncation", "an input longer than the context is an error (context_length_exceeded), "
               "never cut")
    for name, why in (("prompt", "there are no stored prompt templates; send the text"),
                      ("conversation", "there are no conversation objects; use previous_response_id"),
                      ("context_management", "the context is never compacted"),
                      ("moderation", "there is no moderation model")):
        if event.get(name):
            refuse(name, why)
    if (check_type(event, "multi_agent", dict) or {}).get("enabled"):
        refuse("multi_agent", "there is one model and no agents")


def _parse_echo(event: dict[str, Any]) -> dict[str, Any]:
    """The accepted OpenAI fields the response object carries as they were requested."""
    tools = check_type(event, "tools", list) or []
    if not all(isinstance(tool, dict) and isinstance(tool.get("type"), str) for tool in tools):
        raise ProtocolError("invalid_type", "'tools' must be an array of objects with a string 'type'", "tools")
    text = dict(check_type(event, "text", dict) or {})
    text.setdefault("format", {"type": "text"})
    echo = {"tools": tools, "tool_choice": event.get("tool_choice") or "auto", "text": text,
            "reasoning": event.get("reasoning"), "truncation": event.get("truncation") or "disabled",
            "parallel_tool_calls": check_type(event, "parallel_tool_calls", bool) is not False,
            "max_tool_calls": check_type(event, "max_tool_calls", int),
            "service_tier": check_type(event, "service_tier", str) or "default", "background": False}
    for name in ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"):
        echo[name] = check_type(event, name, str)
    return echo


def _parse_extension(event: dict[str, Any], limits: RequestLimits) -> dict[str, Any]:
    extension = check_type(event, EXTENSION_FIELD, dict) or {}
    for name in extension:
        if name not in EXTENSION_PARAMS:
            raise ProtocolError("unknown_parameter", f"'{EXTENSION_FIELD}.{shown(name, 40)}' is not a parameter; "
                                f"known: {', '.join(EXTENSION_PARAMS)}", f"{EXTENSION_FIELD}.{name}")
    return check_sampling_extras(extension, limits, f"{EXTENSION_FIELD}.")


def check_sampling_extras(values: dict[str, Any], limits: RequestLimits, prefix: str = "") -> dict[str, Any]:
    """The EXTENSION_PARAMS present in `values`, type- and range-checked (errors name `prefix` + the field).

    The websocket mode takes them in the `localserve` object; the HTTP chat and completions endpoints
    as top-level fields, as llama.cpp and vLLM do."""
    checked: dict[str, Any] = {}
    for name, kind in EXTENSION_PARAMS.items():
        value = check_type(values, name, kind, f"{prefix}{name}")
        if value is not None:
            checked[name] = value
    stop = checked.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        param = f"{prefix}stop"
        check_length(stop, param, limits.max_stop_strings)
        for index, string in enumerate(stop):
            if not isinstance(string, str):
                raise ProtocolError("invalid_type", f"'{param}' must be a string or an array of strings", param)
            check_length(string, f"{param}[{index}]", limits.max_stop_chars)
        checked["stop"] = stop
    check_range(checked.get("top_k"), f"{prefix}top_k", 1, INT64_MAX, integer=True)
    check_range(checked.get("seed"), f"{prefix}seed", INT64_MIN, INT64_MAX, integer=True)
    check_range(checked.get("n"), f"{prefix}n", 1, limits.max_parallel_samples, integer=True)
    check_range(checked.get("logprobs"), f"{prefix}logprobs", 0, 20, integer=True)
    for name in ("presence_penalty", "frequency_penalty"):
        check_range(checked.get(name), f"{prefix}{name}", -2, 2)
    # > 0 (a penalty divides positive logits); larger than this only ever bans every seen token
    check_range(checked.get("repetition_penalty"), f"{prefix}repetition_penalty", MIN_REPETITION_PENALTY, 10)
    return checked


def parse_response_create(event: dict[str, Any], limits: RequestLimits | None = None) -> ResponseRequest:
    """Check every field of a `response.create` (bounds from `limits`) into a ResponseRequest."""
    limits = limits or RequestLimits()
    for name in event:
        if name not in HONOURED_FIELDS and name not in IGNORED_FIELDS:
            raise ProtocolError("unknown_parameter", f"unknown parameter {shown(name, 40)}; docs/PROTOCOL.md lists "
                                "the fields this server takes", name)
    _refuse_unsupported(event)
    if event.get("input") is None:
        raise ProtocolError("missing_required_parameter", "'input' is required", "input")
    request = ResponseRequest(input_messages=_parse_input(event["input"], limits),
                              instructions=check_type(event, "instructions", str),
                              model=check_type(event, "model", str),
                              max_output_tokens=check_type(event, "max_output_tokens", int),
                              temperature=check_type(event, "temperature", float),
                              top_p=check_type(event, "top_p", float),
                              previous_response_id=check_type(event, "previous_response_id", str),
                              metadata=check_type(event, "metadata", dict) or {},
                              stream_id=check_stream_id(event),
                              store=check_type(event, "store", bool) is not False,
                              generate=check_type(event, "generate", bool) is not False,
                              extension=_parse_extension(event, limits), echo=_parse_echo(event))
    cache_options = check_type(event, "prompt_cache_options", dict) or {}
    if check_type(cache_options, "prewarm", bool, "prompt_cache_options.prewarm"):
        request.generate = False  # as OpenAI: prewarm overrides generate
    check_length(request.model, "model", limits.max_id_chars)
    check_length(request.previous_response_id, "previous_response_id", limits.max_id_chars)
    if request.num_input_chars > limits.max_input_chars:
        raise ProtocolError("string_above_max_length", f"'input' and 'instructions' hold "
                            f"{request.num_input_chars} characters; at most {limits.max_input_chars} are "
                            "accepted", "input")
    check_range(request.max_output_tokens, "max_output_tokens", 1, INT64_MAX, integer=True)
    check_range(request.temperature, "temperature", 0, 2)
    check_range(request.top_p, "top_p", 0, 1)
    _check_metadata(request.metadata, limits)
    top_logprobs = check_type(event, "top_logprobs", int)
    check_range(top_logprobs, "top_logprobs", 0, 20, integer=True)
    include = check_type(event, "include", list) or []
    if not all(isinstance(name, str) for name in include):
        raise ProtocolError("invalid_type", "'include' must be an array of strings", "include")
    request.echo["top_logprobs"] = top_logprobs
    request.logprobs = request.extension.get("logprobs", top_logprobs)
    if request.logprobs is None and LOGPROBS_INCLUDE in include:
        request.logprobs = 0
    return request


def _check_metadata(metadata: dict[str, Any], limits: RequestLimits) -> None:
    if len(metadata) > limits.max_metadata_keys or not all(
            isinstance(value, str) and len(key) <= limits.max_metadata_key_chars
            and len(value) <= limits.max_metadata_value_chars for key, value in metadata.items()):
        raise ProtocolError("invalid_value", f"'metadata' must map at most {limits.max_metadata_keys} strings "
                            f"(keys up to {limits.max_metadata_key_chars} characters) to strings (up to "
                            f"{limits.max_metadata_value_chars} characters)", "metadata")
