"""The field kinds of tool calls, structured output and reasoning (server/request/fields.py has the rest and
the parser): `Tools`, `ToolChoiceField`, `OutputFormatField` and `ReasoningEffort`, each in chat
completions' nested spelling or, `flat`, the Responses API's. Rules between them (a named function must be
one of the tools; a tool the model cannot call here) are the parser's (`_check_tool_choice`).

The model calls function tools only: their JSON arguments are what every chat format writes and constrains.
A Responses `namespace` tool (a group of function tools) is flattened into its functions, their names kept, and
each call of one names its namespace again (`GenerationRequest.tool_namespaces`). Any other kind of tool is an
`UnusableTool`: a hosted tool (web search, file search, code interpreter, ...: the provider runs it on its
side, and this server runs no tool), or a client tool in a form of its own (free-form `custom` text, a shell,
a patch, a computer). It is dropped when the request's tool_choice lets the model call no tool of it (`none`,
or a named function), else refused, saying why."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from localserve.server.request.fields import Field, RequestDraft
from localserve.server.request.generation_request import REASONING_EFFORTS, OutputFormat, ReasoningChoice
from localserve.server.request.validation import ProtocolError, check_length, check_type, check_value, shown
from localserve.tokenizer.tools import ChatFormatError, ToolChoice, ToolSpec

HOSTED_TOOLS = frozenset({  # the Responses API's tools that OpenAI runs on its side
    "web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "image_generation", "mcp", "tool_search", "programmatic_tool_calling"})
OWN_FORM_TOOLS = frozenset({"custom", "local_shell", "shell", "apply_patch", "computer", "computer_use_preview"})
HOSTED_WHY = ("is a hosted tool: the provider runs it on its side, and this server runs no tool (its model calls "
              "function tools, which the client runs)")
OWN_FORM_WHY = ("is a tool of a form of its own: this server's model calls function tools (JSON arguments) only")


@dataclass(frozen=True)
class UnusableTool:
    """A tool of a request that the model cannot be offered here: where it is, its type, and why."""

    where: str
    kind: Any  # its `type` as sent (a string, or whatever a client wrote there)
    why: str

    def refusal(self) -> ProtocolError:
        at = f"{self.where}.type"
        return ProtocolError("unsupported_value", f"'{at}' {shown(self.kind)} {self.why}: leave it out, or send a "
                             "tool_choice that calls no tool of it ('none', or a function), which drops it", at)


def add_unusable(draft: RequestDraft, tool: UnusableTool) -> None:
    """Note a tool the model cannot be offered (`_check_tool_choice` drops or refuses it)."""
    draft.values.setdefault("unusable_tools", []).append(tool)


@dataclass(frozen=True)
class Tools(Field):
    """An array of function tools, as chat completions nest them (`{"type": "function", "function": {"name",
    "description", "parameters"}}`) or, `flat`, as the Responses API writes them (`{"type": "function",
    "name", ...}`, and `namespace` tools holding such functions); each checked into a ToolSpec, an error naming
    the tool's field. A tool of another kind is an UnusableTool."""

    flat: bool = False
    shared = "tools"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        specs: list[ToolSpec] = []
        namespaces: dict[str, str] = {}
        for where, tool in each_tool(value, param, draft):
            if self.flat and tool.get("type") == "namespace":
                namespace = tool.get("name")
                if not isinstance(namespace, str) or not namespace:
                    raise ProtocolError("invalid_type", f"'{where}.name' must be the namespace's name", f"{where}.name")
                if not isinstance(tool.get("tools"), list):
                    raise ProtocolError("invalid_type", f"'{where}.tools' must be an array of function tools",
                                        f"{where}.tools")
                for inner_where, inner in each_tool(tool["tools"], f"{where}.tools", draft):
                    if self._usable(inner, inner_where, draft):
                        specs.append(self._function(inner, inner_where))
                        namespaces[specs[-1].name] = namespace
            elif self._usable(tool, where, draft):
                specs.append(self._function(tool, where))
        check_length(specs, param, draft.limits.max_tools)
        draft.set("tools", tuple(specs), param)
        if namespaces:
            draft.set("tool_namespaces", namespaces, param)

    @staticmethod
    def _usable(tool: dict[str, Any], where: str, draft: RequestDraft) -> bool:
        """False for a hosted tool or one of a form of its own (noted as an UnusableTool)."""
        kind = tool.get("type")
        if kind in HOSTED_TOOLS or kind in OWN_FORM_TOOLS:
            add_unusable(draft, UnusableTool(where, kind, HOSTED_WHY if kind in HOSTED_TOOLS else OWN_FORM_WHY))
            return False
        return True

    def _function(self, tool: dict[str, Any], where: str) -> ToolSpec:
        nested = {"type": tool.get("type"), "function": {key: tool[key] for key in FUNCTION_KEYS if key in tool}}
        try:
            return ToolSpec.from_openai(nested if self.flat else tool)
        except ChatFormatError as error:
            named = error.field.removeprefix("function.") if self.flat else error.field
            at = f"{where}.{named}"
            raise ProtocolError("invalid_value", f"'{at}' {error.reason}", at) from None


def each_tool(value: Any, param: str, draft: RequestDraft) -> Iterator[tuple[str, dict[str, Any]]]:
    """The tool objects of a `tools` array (at most `max_tools`), each with the name of its place."""
    value = check_value(value, list, param)
    check_length(value, param, draft.limits.max_tools)
    for index, tool in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(tool, dict):
            raise ProtocolError("invalid_type", f"'{where}' must be a tool object", where)
        yield where, tool


def schema_format(schema: dict[str, Any], param: str, strict: bool, name: str | None = None) -> OutputFormat:
    """An answer format of `schema`, which must compile to a grammar (else a 400 naming `param`)."""
    output_format = OutputFormat("json_schema", schema, strict, name)
    try:
        output_format.grammar()
    except ValueError as error:
        raise ProtocolError("invalid_value", f"'{param}' is not a usable JSON schema: {error}", param) from None
    return output_format


FUNCTION_KEYS = ("name", "description", "parameters", "strict")
TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolChoiceField(Field):
    """`auto`, `none`, `required`, or one function: `{"type": "function", "function": {"name": ...}}` (chat
    completions) or, `flat`, `{"type": "function", "name": ...}` (Responses)."""

    flat: bool = False
    shared = "tool_choice"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        value = check_value(value, (str, dict), param)
        if isinstance(value, str):
            if value not in TOOL_CHOICE_MODES:
                raise ProtocolError("invalid_value", f"'{param}' must be one of {', '.join(TOOL_CHOICE_MODES)} or a "
                                    f"function, got {shown(value)}", param)
            draft.set("tool_choice", ToolChoice(value), param)
            return
        if value.get("type") != "function":
            raise ProtocolError("invalid_value", f"'{param}.type' must be 'function' (only function tools exist "
                                f"here), got {shown(value.get('type'))}", f"{param}.type")
        holder, where = (value, param) if self.flat else (value.get("function"), f"{param}.function")
        if not isinstance(holder, dict) or not isinstance(holder.get("name"), str):
            raise ProtocolError("invalid_type", f"'{where}.name' must be the name of one of the tools", f"{where}.name")
        draft.set("tool_choice", ToolChoice.function(holder["name"]), param)
        draft.set("tool_choice_name_param", f"{where}.name", param)


@dataclass(frozen=True)
class OutputFormatField(Field):
    """The answer's format: `{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", ...}` with
    the schema's `name`, `schema`, `strict` and `description` inside `json_schema` (chat completions'
    `response_format`) or, `flat`, beside `type` (Responses' `text.format`). The schema must compile."""

    flat: bool = False
    shared = "output_format"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        value = check_value(value, dict, param)
        kind = value.get("type")
        if kind == "text":
            return
        if kind == "json_object":
            draft.set("output_format", OutputFormat("json_object"), param)
            return
        if kind != "json_schema":
            raise ProtocolError("invalid_value", f"'{param}.type' must be 'text', 'json_object' or 'json_schema', "
                                f"got {shown(kind)}", f"{param}.type")
        holder, where = (value, param) if self.flat else (value.get("json_schema"), f"{param}.json_schema")
        if not isinstance(holder, dict):
            raise ProtocolError("invalid_type", f"'{where}' must be an object with the schema", where)
        name = check_type(holder, "name", str, f"{where}.name")
        strict = check_type(holder, "strict", bool, f"{where}.strict")
        check_type(holder, "description", str, f"{where}.description")
        schema = holder.get("schema", {})
        if not isinstance(schema, dict):
            raise ProtocolError("invalid_type", f"'{where}.schema' must be a JSON schema object", f"{where}.schema")
        draft.set("output_format", schema_format(schema, f"{where}.schema", bool(strict), name), param)


@dataclass(frozen=True)
class ReasoningEffort(Field):
    """How hard a reasoning model thinks: one of REASONING_EFFORTS; "none" turns thinking off."""

    shared = "reasoning"

    def apply(self, value: Any, param: str, draft: RequestDraft) -> None:
        value = check_value(value, str, param)
        if value not in REASONING_EFFORTS:
            raise ProtocolError("invalid_value", f"'{param}' must be one of {', '.join(REASONING_EFFORTS)}, got "
                                f"{shown(value)}", param)
        draft.set("reasoning", ReasoningChoice(value), param)
