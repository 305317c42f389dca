"""OpenAI's Responses API as this server reads it: the field map of `response.create` (over the websocket)
and of `POST /v1/responses` (the same fields, plus `stream`), and the websocket mode's frames and lanes.

Every field of OpenAI's `response.create` is honoured, ignored for a stated reason, or refused with
`unsupported_parameter` when honouring it would change the output and this server cannot; any other
field is an `unknown_parameter`. The sampling settings OpenAI's API has no field for are in this
server's `localserve` object. docs/PROTOCOL.md lists the same, field by field.
"""

from __future__ import annotations

import re
from typing import Any

from localserve.server.request import fields, tool_fields
from localserve.server.request.images import ImageBounds, check_detail, read_image_url
from localserve.server.request.messages import MessageFormat
from localserve.server.request.validation import ProtocolError, parse_json_object, shown

EXTENSION_FIELD = "localserve"  # this server's sampling fields, which OpenAI's API does not have
EXTENSION_SAMPLING = ("top_k", "min_p", "seed", "stop", "n", "logprobs", "presence_penalty", "frequency_penalty",
                      "repetition_penalty")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
STREAM_ID_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,256}")


def _input_image(part: dict[str, Any], where: str, bounds: ImageBounds) -> tuple[bytes, None]:
    """An `input_image` part: {"type": "input_image", "image_url": a data URL, "detail"}; a `file_id` is refused
    (there is no Files API here)."""
    if part.get("file_id") is not None:
        raise ProtocolError("unsupported_value", f"'{where}.file_id' is not supported: there is no Files API here; "
                            "send the image as a data URL in 'image_url'", f"{where}.file_id")
    check_detail(part, where)
    return read_image_url(part.get("image_url"), f"{where}.image_url", bounds), None


RESPONSES_INPUT = MessageFormat(text_parts=("input_text", "output_text"), bare_string=True,
                                       item_types=("message",), tool_turns="responses",
                                       image_parts={"input_image": _input_image})


def _not_enabled(value: dict[str, Any]) -> bool:
    return not value.get("enabled")


def _never(value: Any) -> bool:
    return False


class StreamId(fields.Field):
    """The websocket lane a response runs on (see check_stream_id)."""

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        draft.set("stream_id", check_stream_id(value), param)


FIELDS: dict[str, fields.Field] = {
    "type": fields.Ignored("the event's type, response.create (over HTTP the path says what the body is)"),
    "input": fields.Messages(RESPONSES_INPUT),
    "instructions": fields.Text("instructions"),
    "model": fields.Text("model", bounded=True),
    "previous_response_id": fields.Text("previous_response_id", bounded=True),
    "max_output_tokens": fields.Sampling("max_tokens"),
    "temperature": fields.Sampling("temperature"),
    "top_p": fields.Sampling("top_p"),
    "top_logprobs": fields.Sampling("logprobs"),
    EXTENSION_FIELD: fields.Nested({name: fields.Sampling(name, preferred=name == "logprobs")
                                    for name in EXTENSION_SAMPLING}),
    "include": fields.Include(LOGPROBS_INCLUDE),
    "metadata": fields.Metadata(),
    "client_metadata": fields.Metadata(client=True),
    "store": fields.Flag("store"),
    "generate": fields.Flag("generate"),
    "prompt_cache_options": fields.Nested({"prewarm": fields.Prewarm()}, open=True),
    "tools": tool_fields.Tools(flat=True),
    "tool_choice": tool_fields.ToolChoiceField(flat=True),
    "parallel_tool_calls": fields.Flag("parallel_tool_calls"),
    "text": fields.Nested({"format": tool_fields.OutputFormatField(flat=True), "verbosity": fields.Refused(
        "the model's length is set with max_output_tokens", fields.one_of("medium"))}, open=True),
    "reasoning": fields.Nested({
        "effort": tool_fields.ReasoningEffort(),
        "summary": fields.Ignored("the reasoning is given whole, as the reasoning item's reasoning_text", str),
        "generate_summary": fields.Ignored("the reasoning is given whole, as the reasoning item's reasoning_text",
                                           str)}),
    "truncation": fields.Refused("an input longer than the context is an error (context_length_exceeded), never "
                                 "cut", fields.one_of("disabled")),
    "background": fields.Refused("background responses do not exist over a websocket"),
    "prompt": fields.Refused("there are no stored prompt templates; send the text"),
    "conversation": fields.Refused("there are no conversation objects; use previous_response_id"),
    "context_management": fields.Refused("the context is never compacted"),
    "moderation": fields.Refused("there is no moderation model"),
    "multi_agent": fields.Refused("there is one model and no agents", _not_enabled, dict),
    "max_tool_calls": fields.Ignored("one response is one turn of the model: parallel_tool_calls bounds its calls",
                                     int),
    "service_tier": fields.Ignored("there is one tier", str),
    "user": fields.Ignored("there are no accounts", str),
    "safety_identifier": fields.Ignored("there are no accounts", str),
    "prompt_cache_key": fields.Ignored("the prefix cache finds shared blocks by their content, with no key", str),
    "prompt_cache_retention": fields.Ignored("cached blocks stay until the pool needs them", str),
    "stream_options": fields.Ignored("the events are sent as they are, with no obfuscation to switch"),
    "background_options": fields.Ignored("there are no background responses"),
    "image": fields.Ignored("the server takes text only"),
    "access_programs": fields.Ignored("there are no access programs"),
}
# What the response object echoes as requested, and what it says when the request left a field out.
ECHOED = {"tools": [], "tool_choice": "auto", "text": {"format": {"type": "text"}}, "reasoning": None,
          "truncation": "disabled", "parallel_tool_calls": True, "max_tool_calls": None, "service_tier": "default",
          "background": False, "user": None, "safety_identifier": None, "prompt_cache_key": None,
          "prompt_cache_retention": None, "top_logprobs": None}

ECHOED_IF_SENT = ("client_metadata",)  # a client's own tags (Codex's), kept with the response

RESPONSES_WEBSOCKET = fields.WireFormat(FIELDS | {
    "stream": fields.Ignored("over a websocket every response streams"), "stream_id": StreamId()}, echoed=ECHOED,
    echoed_if_sent=ECHOED_IF_SENT)
RESPONSES_HTTP = fields.WireFormat(FIELDS | {
    "stream": fields.Flag("stream"),
    "stream_id": fields.Refused("lanes exist on a websocket connection (ws://.../v1/responses); over HTTP each "
                                "request is its own response", _never)}, echoed=ECHOED, echoed_if_sent=ECHOED_IF_SENT)


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


def check_stream_id(stream_id: Any) -> str | None:
    """A lane: None (the default lane) or 1-256 characters of [A-Za-z0-9_.-]."""
    if stream_id is None:
        return None
    if not isinstance(stream_id, str) or not STREAM_ID_PATTERN.fullmatch(stream_id):
        raise ProtocolError("invalid_stream_id", f"'stream_id' must be 1-256 characters of A-Z, a-z, 0-9, "
                            f"'_', '.' and '-', got {shown(stream_id)}", "stream_id")
    return stream_id
