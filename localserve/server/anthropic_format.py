"""Anthropic's Messages API as this server reads it: the field maps of `POST /v1/messages` and
`POST /v1/messages/count_tokens` (no I/O here).

Every field of the request is honoured, ignored for a stated reason, or refused with
`unsupported_parameter` when honouring it would change the output and this server cannot; any other
is an `unknown_parameter`. `temperature`, `top_p` and `top_k` are honoured for the clients that still
send them (the `anthropic` SDK 2.x has no arguments for them: send them with `extra_body`), by the
shared rules (temperature up to 2, where Anthropic stops at 1). `tool_use` and `tool_result` blocks are
refused like any block that is not text, until tool calls exist.
"""

from __future__ import annotations

from typing import Any

from localserve.server import request_fields as fields
from localserve.server.request_messages import MessageFormat
from localserve.server.validation import ProtocolError, check_type, check_value

ANTHROPIC_MESSAGES = MessageFormat(text_parts=("text",), at_least_one=True,
                                   refused_roles={"system": "the system prompt is the top-level 'system' field",
                                                  "developer": "the system prompt is the top-level 'system' field"})
NO_ACCOUNTS = "there are no accounts"


def _auto_or_none(tool_choice: dict[str, Any]) -> bool:
    return tool_choice.get("type") in ("auto", "none")


def _disabled(thinking: dict[str, Any]) -> bool:
    return thinking.get("type") == "disabled"


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
    "tool_choice": fields.Refused(f"{fields.NEVER_CALLS_TOOLS}, so it cannot be made to call one", _auto_or_none,
                                  dict, order=0),
    "tools": fields.TOOLS_REFUSED,
    "thinking": fields.reasoning_refused(_disabled, dict),
    "mcp_servers": fields.Refused("there are no MCP servers to reach", kind=list),
    "output_config": fields.Nested({"format": fields.Refused("structured output is not supported; only plain text",
                                                             kind=dict, order=2),
                                    "effort": fields.reasoning_refused(fields.is_empty, str)}),
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
