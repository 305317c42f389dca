"""Tools as a request offers them, the tool choice, and a conversation's tool turns as templates expect them.

A tool is a function with a name, a description and a JSON schema of its parameters (OpenAI's
`{"type": "function", "function": {...}}`). Chat templates read tools in that shape, assistant messages with
`tool_calls` whose `function.arguments` are dicts (not the JSON text the APIs carry), and `tool` messages
with `tool_call_id` (and `name`), as transformers' `apply_chat_template(messages, tools=...)` passes them:
`template_messages` turns a conversation from the APIs' shape into that one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["AUTO", "ChatFormatError", "ToolChoice", "ToolSpec", "template_messages"]

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for function names (dots allowed, as vLLM)
EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


class ChatFormatError(ValueError):
    """Tools, a tool choice or a conversation that a chat format cannot use; `field` names the culprit
    (in OpenAI chat completions' spelling, such as `tools[1].function.parameters`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class ToolSpec:
    """One function a model may call: its name, description and the JSON schema of its arguments.

    `parameters` is an object schema; a tool without one takes no arguments (OpenAI: "omitting parameters
    defines a function with an empty parameter list").
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME.fullmatch(self.name):
            raise ChatFormatError("function.name", f"must be 1-64 letters, digits, '_', '.' or '-', got {self.name!r}")
        if self.description is not None and not isinstance(self.description, str):
            raise ChatFormatError("function.description", "must be a string")
        if not isinstance(self.parameters, Mapping):
            raise ChatFormatError("function.parameters", "must be a JSON schema object")
        if self.parameters.get("type", "object") != "object":
            raise ChatFormatError("function.parameters", f"must describe an object, not {self.parameters['type']!r}")
        properties = self.parameters.get("properties", {})
        if not isinstance(properties, Mapping) or not all(isinstance(p, Mapping) for p in properties.values()):
            raise ChatFormatError("function.parameters.properties", "must map each argument to its schema")

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> ToolSpec:
        """A tool as chat completions send it: `{"type": "function", "function": {"name", ...}}`."""
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ChatFormatError("type", "only function tools are supported")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ChatFormatError("function", "must be an object")
        parameters = function.get("parameters")
        return cls(function.get("name"), function.get("description"),
                   dict(EMPTY_PARAMETERS) if parameters is None else parameters)

    @property
    def properties(self) -> Mapping[str, Mapping[str, Any]]:
        """Each argument's schema, in the schema's order."""
        return self.parameters.get("properties", {})

    def template_tool(self) -> dict[str, Any]:
        """The tool as templates read it (transformers' JSON-schema shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's `tool_choice`: `auto` (the model decides), `required` (at least one call), `none` (no tools
    offered), or `function` with `name` (exactly that function)."""

    mode: Literal["auto", "required", "none", "function"] = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "required", "none", "function"):
            raise ChatFormatError("tool_choice", f"must be 'auto', 'required', 'none' or a function, got {self.mode!r}")
        if (self.mode == "function") != (self.name is not None):
            raise ChatFormatError("tool_choice", "a function name goes with mode 'function' alone")

    @classmethod
    def function(cls, name: str) -> ToolChoice:
        """Call exactly the function `name`."""
        return cls("function", name)

    def chosen_tools(self, tools: Sequence[ToolSpec]) -> tuple[ToolSpec, ...]:
        """The tools a call may use under this choice (none for `none`)."""
        if self.mode == "none":
            return ()
        if self.mode == "function":
            chosen = tuple(tool for tool in tools if tool.name == self.name)
            if not chosen:
                raise ChatFormatError("tool_choice.function.name", f"{self.name!r} is not one of the tools")
            return chosen
        if self.mode == "required" and not tools:
            raise ChatFormatError("tool_choice", "'required' needs at least one tool")
        return tuple(tools)


AUTO = ToolChoice("auto")


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates read them: each call's `function.arguments` a dict (parsed from the JSON
    text the APIs send), an assistant message with calls and no content with empty content, each `tool`
    message with the `name` of the call it answers when it does not say."""
    names_by_id: dict[str, str] = {}
    converted = []
    for index, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for number, call in enumerate(message["tool_calls"]):
                where = f"messages[{index}].tool_calls[{number}]"
                calls.append(_template_call(call, where))
                if isinstance(call.get("id"), str):
                    names_by_id[call["id"]] = calls[-1]["function"]["name"]
            message["tool_calls"] = calls
            if message.get("content") is None:  # templates read it as text (Qwen3's splits it)
                message["content"] = ""
        elif message.get("role") == "tool" and "name" not in message and message.get("tool_call_id") in names_by_id:
            message["name"] = names_by_id[message["tool_call_id"]]
        converted.append(message)
    return converted


def _template_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatFormatError(f"{where}.function", "must be an object with a name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            raise ChatFormatError(f"{where}.function.arguments", f"is not valid JSON ({exc})") from None
    if not isinstance(arguments, Mapping):
        raise ChatFormatError(f"{where}.function.arguments", "must be a JSON object")
    converted = {"type": "function", "function": {"name": function["name"], "arguments": dict(arguments)}}
    if call.get("id") is not None:
        converted = {"id": call["id"], **converted}
    return converted
