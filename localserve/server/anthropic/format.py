"""Anthropic's Messages API as this server reads it: the field maps of `POST /v1/messages` and
`POST /v1/messages/count_tokens` (no I/O here).

Every field of the request is honoured, ignored for a stated reason, or refused with
`unsupported_parameter` when honouring it would change the output and this server cannot; any other
is an `unknown_parameter`. `temperature`, `top_p` and `top_k` are honoured for the clients that still
send them (the `anthropic` SDK 2.x has no arguments for them: send them with `extra_body`), by the
shared rules (temperature up to 2, where Anthropic stops at 1). `output_config.format` (a JSON schema)
constrains the answer. `tools` (custom tools: name, description, input_schema) and `tool_choice` (auto,
any, tool, none; `disable_parallel_tool_use`) become the shared tool fields; an assistant's `tool_use`
blocks become its calls and a user's `tool_result` blocks the tool messages before its text, as chat
completions spell them; an assistant's `thinking` blocks its reasoning (`redacted_thinking` is encrypted:
dropped), which the templates that render reasoning keep in a tool loop (server/request/messages.py).
`thinking` enabled or disabled turns the model's reasoning on or off where its template can
(`budget_tokens` is not enforced: the reasoning ends when the model ends it, within `max_tokens`); left
out, the template's default holds.
"""

from __future__ import annotations

import json
from typing import Any

from localserve.server.request import fields, tool_fields
from localserve.server.request.generation_request import ReasoningChoice
from localserve.server.request.images import ImageBounds, check_media_type, decode_base64
from localserve.server.request.messages import PART_PATH, MessageFormat
from localserve.server.request.validation import ProtocolError, check_type, check_value, shown
from localserve.tokenizer.tools import ChatFormatError, ToolChoice, ToolSpec

SYSTEM_FIELD = "the system prompt is the top-level 'system' field"
NO_FETCHING_HERE = ("the server does not fetch images for a client: send the image inline as a base64 source "
                    "({\"type\": \"base64\", \"media_type\", \"data\"})")


def _image_block(block: dict[str, Any], where: str, bounds: ImageBounds) -> tuple[bytes, str]:
    """An `image` block: {"type": "image", "source": {"type": "base64", "media_type", "data"}}; a `url` (or
    `file`) source is refused: the server fetches nothing."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ProtocolError("invalid_type", f"'{where}.source' must be an object {{\"type\": \"base64\", "
                            "\"media_type\", \"data\"}", f"{where}.source")
    kind = source.get("type")
    if kind == "url":
        raise ProtocolError("invalid_image_url", f"'{where}.source' is a url source: {NO_FETCHING_HERE}",
                            f"{where}.source")
    if kind != "base64":
        raise ProtocolError("unsupported_value", f"'{where}.source.type' must be \"base64\" (files and URLs are "
                            f"not fetched), got {shown(kind)}", f"{where}.source.type")
    media_type = check_media_type(source.get("media_type"), f"{where}.source.media_type")
    return decode_base64(source.get("data"), f"{where}.source.data", bounds), media_type


# the messages once their tool blocks are spelled as chat completions spell calls and results
THINKING = "localserve_thinking"  # an assistant message's thinking blocks' text, once respelled
ANTHROPIC_MESSAGES = MessageFormat(text_parts=("text",), at_least_one=True, tool_turns="chat",
                                   refused_roles={"system": SYSTEM_FIELD, "developer": SYSTEM_FIELD},
                                   image_parts={"image": _image_block}, reasoning_fields=(THINKING,))
NO_ACCOUNTS = "there are no accounts"
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool", naming one
ANTHROPIC_TOOL_WHY = ("is not a custom tool: Anthropic runs its server tools on its side, and its built-in client "
                      "tools have schemas of their own; this server's model calls custom tools, which the client runs")
# Context edits that change nothing here: thinking of turns before the last user message is never rendered
# (the templates drop it), and that of the turns after it (a tool loop) is what the model must see again, so
# clearing earlier thinking, or keeping it (Claude Code's `keep: "all"`), leaves the prompt as it is.
NO_OP_CONTEXT_EDITS = ("clear_thinking_20251015",)


def _context_edits_change_nothing(value: dict[str, Any]) -> bool:
    edits = value.get("edits", [])
    return isinstance(edits, list) and all(isinstance(edit, dict) and edit.get("type") in NO_OP_CONTEXT_EDITS
                                           for edit in edits)


def _context_edit_why(value: dict[str, Any]) -> str:
    edits = value.get("edits")
    kinds = [edit.get("type") for edit in edits if isinstance(edit, dict)] if isinstance(edits, list) else []
    other = next((kind for kind in kinds if kind not in NO_OP_CONTEXT_EDITS), None)
    what = f"the edit {shown(other)}" if other is not None else "'edits' other than an array of edits"
    return (f"{what} would change the context, which is never edited or compacted here (tool results stay as "
            f"sent); only {', '.join(NO_OP_CONTEXT_EDITS)} is accepted, since earlier thinking is never rendered")


def _respell_messages(messages: list[Any], param: str) -> list[Any]:
    """`messages` of text, `tool_use`, `tool_result` and `thinking` blocks (module doc), as chat completions
    spell them."""
    return [spelled for index, message in enumerate(messages)
            for spelled in _chat_messages(message, f"{param}[{index}]")]


def _chat_messages(message: Any, where: str) -> list[Any]:
    """One Anthropic message as chat completions' messages: a user's tool results first, each its own."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return [message]
    role = message.get("role")
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for number, block in enumerate(content):
        at = f"{where}.content[{number}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": check_type(block, "text", str, f"{at}.text") or ""})
        elif kind == "image" and role == "user":
            texts.append(_image_part(block, at))
        elif kind == "thinking" and role == "assistant":
            thinking.append(check_type(block, "thinking", str, f"{at}.thinking") or "")
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted: nothing to render
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "content": _result_content(block.get("content", ""), f"{at}.content"),
                            "tool_call_id": block.get("tool_use_id")})
        else:
            raise ProtocolError("unsupported_value", f"'{at}' must be a text block{_blocks_of(role)}: "
                                f"this server takes no {shown(kind)} block here", at)
    if role == "assistant":
        return [{"role": "assistant", "content": texts, **({"tool_calls": calls} if calls else {}),
                 **({THINKING: "".join(thinking)} if thinking else {})}]
    return results + ([{**message, "content": texts}] if texts or not results else [])


def _blocks_of(role: Any) -> str:
    """The other blocks a message of `role` may hold (a role of the wrong JSON type is refused later)."""
    return {"assistant": ", tool_use or thinking", "user": ", image or tool_result"}.get(role, "") if isinstance(
        role, str) else ""


def _tool_use(block: dict[str, Any], at: str) -> dict[str, Any]:
    call_input = block.get("input", {})
    if not isinstance(call_input, dict):
        raise ProtocolError("invalid_type", f"'{at}.input' must be an object", f"{at}.input")
    return {"id": block.get("id"), "type": "function",
            "function": {"name": block.get("name"), "arguments": json.dumps(call_input)}}


def _image_part(block: dict[str, Any], at: str) -> dict[str, Any]:
    """An image block as the shared parser reads it, with its path as sent."""
    return {"type": "image", "source": block.get("source"), PART_PATH: at}


def _result_content(content: Any, at: str) -> str | list[dict[str, Any]]:
    """A tool result's content: a string, or text and image blocks (`is_error` is left to the text to say)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError("invalid_type", f"'{at}' must be a string or an array of text or image blocks", at)
    parts = []
    for number, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image":
            parts.append(_image_part(block, f"{at}[{number}]"))
        elif kind == "text":
            parts.append({"type": "text", "text": check_type(block, "text", str, f"{at}[{number}].text") or ""})
        else:
            raise ProtocolError("unsupported_value", f"'{at}[{number}]' must be a text or image block",
                                f"{at}[{number}]")
    return parts


class AnthropicTools(fields.Field):
    """`tools`: custom tools (`name`, `description`, `input_schema`); Anthropic's server tools (web search,
    code execution, ...: it runs them on its side) and its built-in client tools (bash, text editor, computer:
    schemas of its own) are unusable tools (request_tool_fields.UnusableTool): dropped when the tool choice calls
    none of them, else refused, naming the tool."""

    shared = "tools"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        specs = []
        for where, tool in tool_fields.each_tool(value, param, draft):
            if tool.get("type", "custom") != "custom":
                tool_fields.add_unusable(draft, tool_fields.UnusableTool(where, tool.get("type"), ANTHROPIC_TOOL_WHY))
                continue
            function = {"name": tool.get("name"), "description": tool.get("description"),
                        "parameters": tool.get("input_schema")}
            try:
                specs.append(ToolSpec.from_openai({"type": "function", "function": function}))
            except ChatFormatError as error:
                named = {"function.parameters": "input_schema"}.get(error.field, error.field.removeprefix("function."))
                at = where if named == "function" else f"{where}.{named}"
                raise ProtocolError("invalid_value", f"'{at}' {error.reason}", at) from None
        draft.set("tools", tuple(specs), param)


class AnthropicToolChoice(fields.Field):
    """`tool_choice`: `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name"}`, with
    `disable_parallel_tool_use` (at most one call)."""

    shared = "tool_choice"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        value = check_value(value, dict, param)
        kind = value.get("type")
        if kind == "tool":
            name = check_type(value, "name", str, f"{param}.name")
            if name is None:
                raise ProtocolError("invalid_type", f"'{param}.name' must be the name of one of the tools",
                                    f"{param}.name")
            draft.set("tool_choice", ToolChoice.function(name), param)
            draft.set("tool_choice_name_param", f"{param}.name", param)
        elif kind in TOOL_CHOICES:
            draft.set("tool_choice", ToolChoice(TOOL_CHOICES[kind]), param)
        else:
            raise ProtocolError("invalid_value", f"'{param}.type' must be 'auto', 'any', 'tool' or 'none', got "
                                f"{shown(kind)}", f"{param}.type")
        if check_type(value, "disable_parallel_tool_use", bool, f"{param}.disable_parallel_tool_use"):
            draft.set("parallel_tool_calls", False, param)


class Thinking(fields.Field):
    """`thinking`: `{"type": "enabled", "budget_tokens"}` (or "adaptive") thinks, `{"type": "disabled"}` does
    not, where the template can switch it."""

    shared = "reasoning"

    def apply(self, value: Any, param: str, draft: fields.RequestDraft) -> None:
        value = check_value(value, dict, param)
        kind = value.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise ProtocolError("invalid_value", f"'{param}.type' must be 'enabled', 'adaptive' or 'disabled', "
                                f"got {shown(kind)}", f"{param}.type")
        check_type(value, "budget_tokens", int, f"{param}.budget_tokens")
        draft.set("reasoning", ReasoningChoice("none" if kind == "disabled" else "medium"), param)


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
        draft.set("output_format", tool_fields.schema_format(schema, f"{param}.schema", True), param)


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
    "messages": fields.Messages(ANTHROPIC_MESSAGES, _respell_messages),
    "system": SystemPrompt(),
    "tool_choice": AnthropicToolChoice(),
    "tools": AnthropicTools(),
    "thinking": Thinking(),
    "mcp_servers": fields.Refused("there are no MCP servers to reach", kind=list),
    "output_config": fields.Nested({"format": JsonOutput(),
                                    "effort": fields.Refused("the served model's effort is not set on this API: only "
                                                             "'high', Anthropic's default, is accepted",
                                                             fields.one_of("high"), str, order=3)}),
    "cache_control": fields.Ignored("the prefix cache keeps every prompt's blocks without being asked", dict),
    "context_management": fields.Refused(_context_edit_why, _context_edits_change_nothing, dict),
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
