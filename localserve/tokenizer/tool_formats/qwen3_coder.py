"""Qwen3-Coder: each call an XML-like block, one element per argument, values written bare.

As the template writes a call:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A value is the text between the newline after `<parameter=name>` and the one before `</parameter>` (so it
cannot hold `</parameter>`). The arguments go out as JSON, each value typed by the tool's schema: a string
argument (or one the schema does not describe) is a JSON string and streams as it comes; any other is parsed
from its text once complete (`True`/`False`, as the template writes booleans, too), a string when it does not
parse.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from localserve.tokenizer.held_text import split_at_marker
from localserve.tokenizer.tool_formats.base import CallEvents, CallGrammar, ToolCallParser, ToolFormat, ToolUse
from localserve.tokenizer.tool_formats.lark import calls_grammar, json_value, literal, marker
from localserve.tokenizer.tools import ToolSpec

__all__ = ["Qwen3CoderFormat", "Qwen3CoderParser"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"


class Qwen3CoderFormat(ToolFormat):
    """`<tool_call><function=name><parameter=p>value</parameter></function></tool_call>` blocks."""

    name = "qwen3_coder"
    markers = (OPEN, CLOSE)

    def grammar(self, use: ToolUse) -> CallGrammar:
        calls = " | ".join(f"call_{index}" for index in range(len(use.tools)))
        rules = [f'call: "\\n" ({calls}) "\\n" {marker(CLOSE, self.tokens.ids)}',
                 f"string_value[lazy]: ANY_TEXT {literal(chr(10) + END_PARAMETER)}"]
        for index, tool in enumerate(use.tools):
            required = set(tool.parameters.get("required", ()))
            parameters = []
            for name, schema in tool.properties.items():
                head = literal(f"{PARAMETER}{name}>\n")
                value = ('string_value "\\n"' if _streams_as_string(schema)
                         else f'{_typed_value(schema)} {literal(chr(10) + END_PARAMETER + chr(10))}')
                parameters.append(f"({head} {value})" + ("" if name in required else "?"))
            rules.append(f"call_{index}: {literal(f'{FUNCTION}{tool.name}>{chr(10)}')} {' '.join(parameters)} "
                         f"{literal(END_FUNCTION)}")
        lark = calls_grammar(marker(OPEN, self.tokens.ids), OPEN, rules, "call", lazy=use.lazy, parallel=use.parallel,
                             answer=use.answer)
        return CallGrammar(lark, OPEN, self.tokens.ids.get(OPEN)) if use.lazy else CallGrammar(lark)

    def parser(self, use: ToolUse) -> Qwen3CoderParser:
        return Qwen3CoderParser(CallEvents(self.new_call_id), use.tools)


def _kinds(schema: Mapping[str, Any] | None) -> set[Any]:
    kind = (schema or {}).get("type")
    return set(kind) if isinstance(kind, list) else {kind}


def _streams_as_string(schema: Mapping[str, Any] | None) -> bool:
    """A value written bare is a string unless its schema gives it only other types."""
    kinds = _kinds(schema)
    return "string" in kinds or None in kinds


def _typed_value(schema: Mapping[str, Any]) -> str:
    """The grammar of a non-string value: JSON of its schema; a boolean also as the templates write one
    (jinja's `string` filter: Python's `True`/`False`)."""
    if _kinds(schema) == {"boolean"} and not {"enum", "const"} & schema.keys():
        return '("true" | "false" | "True" | "False")'
    return json_value(schema)


def _typed_json(text: str, schema: Mapping[str, Any] | None) -> str:
    """The JSON of a complete non-string value as written, typed by its schema."""
    if "boolean" in _kinds(schema) and text.strip() in ("True", "False"):
        return text.strip().lower()
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


class Qwen3CoderParser(ToolCallParser):
    """Content until `<tool_call>`; `<function=name>` opens the call; each `<parameter=...>` becomes a member of
    the arguments' JSON; `</function>` closes it. Whitespace around a call is dropped."""

    def __init__(self, events: CallEvents, tools: tuple[ToolSpec, ...]) -> None:
        super().__init__(events)
        self._tools = {tool.name: tool for tool in tools}
        self._state = "text"
        self._schemas: Mapping[str, Mapping[str, Any]] = {}
        self._members = 0
        self._schema: Mapping[str, Any] | None = None

    def advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if self.content_until([OPEN], final) is None:
                return False
            self._state = "function"
            return True
        handler = {"function": self._function, "parameters": self._parameters, "value": self._value,
                   "closing": self._closing}.get(self._state, self._after_call)
        return handler(final)

    def _function(self, final: bool) -> bool:
        stripped = self.buffer.lstrip()
        end = stripped.find(">") if stripped.startswith(FUNCTION) else -1
        if end >= 0:
            name = stripped[len(FUNCTION):end]
            self.events.open(name)
            tool = self._tools.get(name)
            self._schemas, self._members = (tool.properties if tool else {}), 0
            self.buffer, self._state = stripped[end + 1:], "parameters"
            return True
        if not final and (FUNCTION.startswith(stripped) or stripped.startswith(FUNCTION)):
            return False
        self.events.content(self.space_before_marker + OPEN + self.buffer)  # not a call: as written
        self.buffer, self._state = "", "text"
        return False

    def _parameters(self, final: bool) -> bool:
        stripped = self.buffer.lstrip()
        if stripped.startswith(PARAMETER) and (end := stripped.find(">")) >= 0:
            value = stripped[end + 1:]
            if not value and not final:
                return False  # the newline after the tag is not part of the value: wait to see it
            name = stripped[len(PARAMETER):end]
            self._schema = self._schemas.get(name)
            prefix = ("{" if self._members == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
            self.events.arguments(prefix + ('"' if _streams_as_string(self._schema) else ""))
            self._members += 1
            self.buffer, self._state = value.removeprefix("\n"), "value"
            return True
        if stripped.startswith(END_FUNCTION) or not (final or _may_become(stripped, (PARAMETER, END_FUNCTION))):
            self.events.arguments("}" if self._members else "{}")
            self.events.close(whole=stripped.startswith(END_FUNCTION))
            rest = stripped[len(END_FUNCTION):] if stripped.startswith(END_FUNCTION) else stripped
            self.buffer, self._state = rest, "closing"
            return True
        return False

    def _value(self, final: bool) -> bool:
        split = split_at_marker(self.buffer, [END_PARAMETER])
        string = _streams_as_string(self._schema)
        if split.marker is None and not final:
            if string:  # stream what is safe, holding the newline that may come before the end tag
                safe = split.safe_end - int(self.buffer[:split.safe_end].endswith("\n"))
                self.events.arguments(json.dumps(self.buffer[:safe], ensure_ascii=False)[1:-1])
                self.buffer = self.buffer[safe:]
            return False
        end = split.safe_end if split.marker is not None else len(self.buffer)
        value = self.buffer[:end].removesuffix("\n") if split.marker is not None else self.buffer
        if string:
            self.events.arguments(json.dumps(value, ensure_ascii=False)[1:-1] + ('"' if split.marker else ""))
        elif split.marker is not None:
            self.events.arguments(_typed_json(value, self._schema))
        else:
            self.events.arguments(value)  # cut mid-value: as written
        self.buffer = self.buffer[end + len(END_PARAMETER):] if split.marker is not None else ""
        self._state = "parameters"
        return split.marker is not None

    def _closing(self, final: bool) -> bool:
        self.buffer = self.buffer.lstrip()
        if self.buffer.startswith(CLOSE):
            self.buffer, self._state = self.buffer[len(CLOSE):], "after_call"
            return True
        if CLOSE.startswith(self.buffer) and not final:
            return False
        self._state = "after_call"
        return True

    def _after_call(self, final: bool) -> bool:
        self.buffer = self.buffer.lstrip()
        if not self.buffer:
            return False
        self._state = "text"
        return True


def _may_become(text: str, markers: tuple[str, ...]) -> bool:
    """True while `text` may still grow into one of `markers` followed by more."""
    return any(marker.startswith(text) or text.startswith(marker) for marker in markers)
