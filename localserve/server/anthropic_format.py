"""Anthropic's Messages API as this server reads it: the field maps of `POST /v1/messages` and
`POST /v1/messages/count_tokens` (no I/O here).

Every field of the request is honoured, ignored for a stated reason, or refused with
`unsupported_parameter` when honouring it would change the output and this server cannot; any other
is an `unknown_parameter`. `temperature`, `top_p` and `top_k` are honoured for the clients that still
send them (the `anthropic` SDK 2.x has no arguments for them: send them with `extra_body`), by the
shared rules (temperature up to 2, where Anthropic stops at 1). `output_config.format` (a JSON schema)
constrains the answer. `tools`, `tool_choice` other than auto or none, `thinking` other than disabled, and
`tool_use` and `tool_result` blocks are refused like any block that is not text, until the output side of
tool calls and reasoning exists.
"""

from __future__ import annotations

from typing import Any

from localserve.server import request_fields as fields
from localserve.server.request_messages import MessageFormat
from localserve.server.request_model import OutputFormat
from localserve.server.validation import ProtocolError, check_type, check_value, shown

ANTHROPIC_MESSAGES = MessageFormat(text_parts=("text",), at_least_one=True,
                                   refused_roles={"system": "the system prompt is the top-level 'system' field",
                                                  "developer": "the system prompt is the top-level 'system' field"})
NO_ACCOUNTS = "there are no accounts"
NO_TOOLS_YET = "tool use is not served on the Messages API yet"


def _auto_or_none(tool_choice: dict[str, Any]) -> bool:
    return tool_choice.get("type") in ("auto", "none")


def _disabled(thinking: dict[str, Any]) -> bool:
    return thinking.get("type") == "disabled"


class JsonOutput(fields.Field):
    """`output_config.format`: `{"type": "json_schema", "schema": {...}}`, the answer a JSON value of the
    schema; a keyword the engine cannot enforce is refused, naming it (Anthropic refuses those too)."""

    shared = "output_format"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        value = check_value(value, dict, param)
        if value.get("type") != "json_schema":
            raise ProtocolError("invalid_value", f"'{param}.type' must be 'json_schema', got "
                                f"{shown(value.get('type'))}", f"{param}.type")
        schema = value.get("schema")
        if not isinstance(schema, dict):
            raise ProtocolError("invalid_type", f"'{param}.schema' must be a JSON schema object", f"{param}.schema")
        output_format = OutputFormat("json_schema", schema, strict=True)
        try:
            output_format.grammar()
        except ValueError as error:
            raise ProtocolError("invalid_value", f"'{param}.schema' is not a usable JSON schema: {error}",
                                f"{param}.schema") from None
        draft.set("output_format", output_format, param)


class SystemPrompt(fields.Field):
    """`system`: a string, or an array of text blocks joined into one."""

    stage = fields.Stage.IDENTIFIER

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        value = check_value(value, (str, list), param)
        if isinstance(value, list):
            texts = []
            for index, block in enumerate(value):
                where = f"{param}[{index}]"
                if not isinstance(block, dict) or block.get("type") != "text":
                    raise ProtocolError("unsupported_value", f"'{where}' must be a text block: this server takes "
                                        "text only", where)
                texts.append(check_type(block, "text", str, f"{where}.text") or "")
            value = "".join(texts)
        draft.set("instructions", value, param)


# The fields both endpoints take: the conversation, and what would change how it is rendered.
PROMPT_FIELDS: dict[str, fields.Field] = {
    "model": fields.Required(fields.Text("model", bounded=True)),
    "messages": fields.Messages(ANTHROPIC_MESSAGES),
    "system": SystemPrompt(),
    "tool_choice": fields.Refused(f"{NO_TOOLS_YET}, so nothing can be made to call one", _auto_or_none, dict,
                                  order=0),
    "tools": fields.Refused(f"{NO_TOOLS_YET}; send no tools", fields.is_empty, list, order=1),
    "thinking": fields.Refused("extended thinking is not served on the Messages API yet; send "
                               "{\"type\": \"disabled\"} or leave it out", _disabled, dict, order=3),
    "mcp_servers": fields.Refused("there are no MCP servers to reach", kind=list),
    "output_config": fields.Nested({"format": JsonOutput(),
                                    "effort": fields.Refused("the served model's effort is not set on this API",
                                                             fields.is_empty, str, order=3)}),
    "cache_control": fields.Ignored("the prefix cache keeps every prompt's blocks without being asked", dict),
    "context_management": fields.Refused("the context is never compacted"),
    "container": fields.Refused("there are no code-execution containers"),
}

MESSAGES = fields.WireFormat({
    **PROMPT_FIELDS,
    "max_tokens": fields.Required(fields.Sampling("max_tokens")),
    "stop_sequences": fields.Sampling("stop"),
    "temperature": fields.Sampling("temperature"),
    "top_p": fields.Sampling("top_p"),
    "top_k": fields.Sampling("top_k"),
    "stream": fields.Flag("stream"),
    "metadata": fields.Nested({"user_id": fields.Ignored(NO_ACCOUNTS, str)}),
    "service_tier": fields.Ignored("there is one tier", str),
    "speed": fields.Ignored("there is one speed", str),
    "inference_geo": fields.Ignored("the model runs on this machine", str),
    "diagnostics": fields.Ignored("nothing is recorded beyond the request's log line"),
    "user_profile_id": fields.Ignored(NO_ACCOUNTS, str),
    "workspace_id": fields.Ignored(NO_ACCOUNTS, str),
}, stores=False)

COUNT_TOKENS = fields.WireFormat(PROMPT_FIELDS, stores=False)
