"""`POST /v1/chat/completions` and `POST /v1/completions` bodies, checked into the shared `ResponseRequest`.

The two older OpenAI endpoints as this server serves them (no I/O here). Like `response.create`
(server/requests.py), every field of OpenAI's request is honoured, ignored for a stated reason, or
refused with `unsupported_parameter` when honouring it would change the output and this server cannot;
any other field is an `unknown_parameter`. The sampling fields llama.cpp and vLLM add (`top_k`, `min_p`,
`repetition_penalty`) are top-level fields here, checked by the same code as the websocket mode's
`localserve` object, and every size is bounded by the same `RequestLimits`. docs/PROTOCOL.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localserve.server.requests import (
    EXTENSION_PARAMS,
    INT64_MAX,
    ROLES,
    RequestLimits,
    ResponseRequest,
    check_sampling_extras,
)
from localserve.server.validation import ProtocolError, check_length, check_range, check_type, shown

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions

# Fields of both endpoints accepted and ignored, and why.
COMMON_IGNORED = {
    "user": "there are no accounts", "safety_identifier": "there are no accounts",
    "service_tier": "there is one tier",
    "prompt_cache_key": "the prefix cache finds shared blocks by their content, with no key",
    "prompt_cache_retention": "cached blocks stay until the pool needs them",
}
CHAT_IGNORED = COMMON_IGNORED | {
    "store": "chat completions are not stored; use /v1/responses with previous_response_id to continue",
    "metadata": "chat completions are not stored, so there is nothing to tag",
    "parallel_tool_calls": "the model is never offered tools, so it calls none",
}
# Sampling fields shared with the websocket mode's extension object (checked by check_sampling_extras).
# (log-probabilities are asked for differently by each endpoint)
SAMPLING_FIELDS = tuple(name for name in EXTENSION_PARAMS if name != "logprobs")
COMMON_HONOURED = {"model", "max_tokens", "temperature", "top_p", "stream", "stream_options", "logit_bias",
                   *SAMPLING_FIELDS}
CHAT_HONOURED = COMMON_HONOURED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                   "tool_choice", "functions", "function_call", "response_format", "modalities",
                                   "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options"}
COMPLETION_HONOURED = COMMON_HONOURED | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_TEXT_PART = "text"


@dataclass
class HttpGeneration:
    """A checked chat or completions body: the shared request, and how the answer is to be shaped."""

    request: ResponseRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def _check_fields(body: dict[str, Any], honoured: set[str], ignored: dict[str, str]) -> None:
    for name in body:
        if name not in honoured and name not in ignored:
            raise ProtocolError("unknown_parameter", f"unknown parameter {shown(name, 40)}; docs/PROTOCOL.md lists "
                                "the fields this server takes", name)


def _refuse(param: str, why: str) -> ProtocolError:
    return ProtocolError("unsupported_parameter", f"'{param}' is not supported: {why}", param)


def _common(body: dict[str, Any], limits: RequestLimits) -> tuple[dict[str, Any], bool, bool, int | None]:
    """Sampling extras, stream, include_usage and max_tokens, shared by both endpoints."""
    if check_type(body, "logit_bias", dict):
        raise _refuse("logit_bias", "token biases are not applied; leave it empty")
    extras = check_sampling_extras({name: body[name] for name in SAMPLING_FIELDS if name in body}, limits)
    stream = check_type(body, "stream", bool) is True
    options = check_type(body, "stream_options", dict) or {}
    include_usage = check_type(options, "include_usage", bool, "stream_options.include_usage") is True
    max_tokens = check_type(body, "max_tokens", int)
    check_range(max_tokens, "max_tokens", 1, INT64_MAX, integer=True)
    return extras, stream, include_usage, max_tokens


def _sampling(body: dict[str, Any]) -> tuple[float | None, float | None]:
    temperature, top_p = check_type(body, "temperature", float), check_type(body, "top_p", float)
    check_range(temperature, "temperature", 0, 2)
    check_range(top_p, "top_p", 0, 1)
    return temperature, top_p


def _parse_messages(value: Any, limits: RequestLimits) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise ProtocolError("invalid_type", "'messages' must be an array of messages", "messages")
    if not value:
        raise ProtocolError("invalid_value", "'messages' must hold at least one message", "messages")
    check_length(value, "messages", limits.max_input_items)
    messages = []
    for index, item in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(item, dict):
            raise ProtocolError("invalid_type", f"'{where}' must be a message object", where)
        role = check_type(item, "role", str, f"{where}.role")
        if role in ("tool", "function"):
            raise ProtocolError("unsupported_value", f"'{where}.role' {role!r} is not supported: this server "
                                "never calls tools", f"{where}.role")
        if role not in ROLES:
            raise ProtocolError("invalid_value", f"'{where}.role' must be one of {sorted(ROLES)}, got "
                                f"{shown(role)}", f"{where}.role")
        for name in ("tool_calls", "function_call", "audio"):
            if item.get(name):
                raise ProtocolError("unsupported_value", f"'{where}.{name}' is not supported: this server "
                                    "takes text messages only", f"{where}.{name}")
        check_type(item, "name", str, f"{where}.name")  # a participant's name: the templates ignore it
        check_type(item, "refusal", str, f"{where}.refusal")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                part_where = f"{where}.content[{part_index}]"
                if not isinstance(part, dict) or part.get("type") != CHAT_TEXT_PART:
                    raise ProtocolError("unsupported_value", f"'{part_where}' must be a text part (type "
                                        f"{CHAT_TEXT_PART!r}): this server takes text only", part_where)
                texts.append(check_type(part, "text", str, f"{part_where}.text") or "")
            content = "".join(texts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ProtocolError("invalid_type", f"'{where}.content' must be a string or an array of text parts",
                                f"{where}.content")
        messages.append({"role": ROLES[role], "content": content})
    return messages


def _refuse_chat_unsupported(body: dict[str, Any]) -> None:
    if check_type(body, "tools", list) or check_type(body, "functions", list):
        raise _refuse("tools", "the model is not offered tools by this server; send no tools")
    if check_type(body, "function_call", (str, dict)) not in (None, "none", "auto"):
        raise _refuse("function_call", "this server never calls functions")
    if check_type(body, "tool_choice", (str, dict)) not in (None, "none", "auto"):
        raise _refuse("tool_choice", "this server never calls tools, so it cannot be made to call one")
    response_format = check_type(body, "response_format", dict) or {}
    if response_format.get("type", "text") != "text":
        raise _refuse("response_format", f"structured output ({shown(response_format.get('type'))}) is not "
                      "supported; only plain text")
    modalities = check_type(body, "modalities", list)
    if modalities not in (None, ["text"]):
        raise _refuse("modalities", "the server answers in text only")
    for name, why in (("audio", "the server answers in text only"),
                      ("prediction", "predicted outputs are not used"),
                      ("web_search_options", "there is no web search")):
        if body.get(name):
            raise _refuse(name, why)
    if check_type(body, "reasoning_effort", str) not in (None, "none"):
        raise _refuse("reasoning_effort", "the served model does not reason apart from its answer")
    if check_type(body, "verbosity", str) not in (None, "medium"):
        raise _refuse("verbosity", "the answer's length is set with max_completion_tokens")


def parse_chat_completion(body: dict[str, Any], limits: RequestLimits) -> HttpGeneration:
    """Check a `/v1/chat/completions` body into the shared request model."""
    _check_fields(body, CHAT_HONOURED, CHAT_IGNORED)
    _refuse_chat_unsupported(body)
    if body.get("messages") is None:
        raise ProtocolError("missing_required_parameter", "'messages' is required", "messages")
    messages = _parse_messages(body["messages"], limits)
    extras, stream, include_usage, max_tokens = _common(body, limits)
    max_completion_tokens = check_type(body, "max_completion_tokens", int)
    check_range(max_completion_tokens, "max_completion_tokens", 1, INT64_MAX, integer=True)
    logprobs = check_type(body, "logprobs", bool)
    top_logprobs = check_type(body, "top_logprobs", int)
    check_range(top_logprobs, "top_logprobs", 0, 20, integer=True)
    if top_logprobs is not None and not logprobs:
        raise ProtocolError("invalid_value", "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    temperature, top_p = _sampling(body)
    request = ResponseRequest(
        input_messages=messages, model=check_type(body, "model", str),
        max_output_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        temperature=temperature, top_p=top_p, store=False, extension=extras,
        logprobs=(top_logprobs or 0) if logprobs else None, extension_prefix="",
        max_tokens_field="max_completion_tokens" if max_completion_tokens is not None else "max_tokens",
        input_field="messages")
    _check_sizes(request, limits)
    return HttpGeneration(request, stream, include_usage)


def parse_completion(body: dict[str, Any], limits: RequestLimits) -> HttpGeneration:
    """Check a `/v1/completions` body (prompt in, text out, no chat template) into the shared request model."""
    _check_fields(body, COMPLETION_HONOURED, COMMON_IGNORED)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if prompt is None:
        raise ProtocolError("missing_required_parameter", "'prompt' is required", "prompt")
    if not isinstance(prompt, str):
        raise ProtocolError("unsupported_value", "'prompt' must be a string (or an array of one string): "
                            "batches and token arrays are not supported", "prompt")
    if check_type(body, "echo", bool):
        raise _refuse("echo", "the prompt is not repeated in the answer")
    if check_type(body, "suffix", str):
        raise _refuse("suffix", "there is no fill-in-the-middle")
    best_of = check_type(body, "best_of", int)
    if best_of not in (None, 1):
        raise _refuse("best_of", "use n to sample several completions")
    extras, stream, include_usage, max_tokens = _common(body, limits)
    logprobs = check_type(body, "logprobs", int)
    check_range(logprobs, "logprobs", 0, 20, integer=True)
    temperature, top_p = _sampling(body)
    request = ResponseRequest(
        input_messages=[], prompt=prompt, model=check_type(body, "model", str),
        max_output_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=temperature, top_p=top_p, store=False, extension=extras, logprobs=logprobs,
        extension_prefix="", max_tokens_field="max_tokens", input_field="prompt")
    _check_sizes(request, limits)
    return HttpGeneration(request, stream, include_usage)


def _check_sizes(request: ResponseRequest, limits: RequestLimits) -> None:
    check_length(request.model, "model", limits.max_id_chars)
    if request.num_input_chars > limits.max_input_chars:
        raise ProtocolError("string_above_max_length", f"the input holds {request.num_input_chars} characters; "
                            f"at most {limits.max_input_chars} are accepted", request.input_field)

