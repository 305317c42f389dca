"""Gemma 4: each call `<|tool_call>call:NAME{ARGUMENTS}<tool_call|>`, the arguments in the template's own
notation, not JSON.

As Gemma 4's template writes a call (`format_argument`): `call:get_weather{city:<|"|>Paris<|"|>,days:2}`:
keys bare, in sorted order, joined by `,`; a string between two `<|"|>` (one token in Gemma 4's vocabulary),
numbers and `true`/`false` bare, a list in `[...]`, an object in `{...}` with bare keys. Calls follow each
other with nothing between them; after its calls the model hands over with `<|tool_response>` (an
end-of-generation token in the vocabulary: see localserve/tokenizer/gguf.py).

The parser holds each call until it is whole (a call's arguments go out at its end; `<tool_call|>` inside a
string is text) and writes its arguments as JSON; a call whose arguments cannot be read, or cut before its
end, closes with what the model wrote (not whole); text between the markers that is no call is content as
written. The grammar writes each tool's arguments in that notation by its schema (strings, numbers,
integers, booleans, enums, lists and objects of those; anything else as any value of the notation).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from localserve.tokenizer.tool_formats.base import CallEvents, CallGrammar, ToolCallParser, ToolFormat, ToolUse
from localserve.tokenizer.tool_formats.lark import calls_grammar, literal, marker

__all__ = ["Gemma4Format", "Gemma4Parser", "read_arguments"]

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL = "call:"
BARE_END = ",}]"  # what ends a bare value
INTEGER = r"/-?(0|[1-9][0-9]*)/"
NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"


class Gemma4Format(ToolFormat):
    """`<|tool_call>call:name{key:value,...}<tool_call|>` calls."""

    name = "gemma4"
    markers = (OPEN, CLOSE)

    def grammar(self, use: ToolUse) -> CallGrammar:
        quote = marker(QUOTE, self.tokens.ids)
        rules = _value_rules(quote, QUOTE in self.tokens.ids)
        calls = " | ".join(f"call_{index}" for index in range(len(use.tools)))
        rules.append(f"call: ({calls}) {marker(CLOSE, self.tokens.ids)}")
        for index, tool in enumerate(use.tools):
            required = set(tool.parameters.get("required", ()))
            members = [(_member(name, schema, quote), name in required)
                       for name, schema in sorted(tool.properties.items())]
            rules.append(f"call_{index}: {literal(CALL + tool.name + '{')} {_members(members)} \"}}\"")
        lark = calls_grammar(marker(OPEN, self.tokens.ids), OPEN, rules, "call", lazy=use.lazy, parallel=use.parallel,
                             answer=use.answer)
        return CallGrammar(lark, OPEN, self.tokens.ids.get(OPEN)) if use.lazy else CallGrammar(lark)

    def parser(self, use: ToolUse) -> Gemma4Parser:
        return Gemma4Parser(CallEvents(self.new_call_id))


def _value_rules(quote: str, quote_is_token: bool) -> list[str]:
    """The notation's values: `string` (with `STRING_TEXT`), `value` (any of them)."""
    if quote_is_token:  # the text between two quote tokens holds no quote token (a terminal never spans one)
        strings = [f"string: {quote} STRING_TEXT {quote}", "STRING_TEXT: /(?s:.*)/"]
    else:
        strings = [f"string: {quote} string_rest", f"string_rest[lazy]: ANY_TEXT {quote}"]
    return [*strings,
            f'value: string | {NUMBER} | "true" | "false" | "null" | "[" (value ("," value)*)? "]" '
            f'| "{{" (key ":" value ("," key ":" value)*)? "}}"',
            r"key: /[A-Za-z_][A-Za-z0-9_]*/"]


def _member(name: str, schema: Mapping[str, Any] | None, quote: str) -> str:
    return f"{literal(name + ':')} {_schema_value(schema, quote)}"


def _members(members: list[tuple[str, bool]]) -> str:
    """Members in order, each required or not, joined by commas (an optional one may be left out)."""
    def first(k: int) -> tuple[str, bool]:  # (expression, may be empty) of members k.. with no comma before
        if k == len(members):
            return "", True
        member, required = members[k]
        rest = " ".join(f'("," {m})' + ("" if req else "?") for m, req in members[k + 1:])
        if required:
            return f"{member} {rest}", False
        later, empty = first(k + 1)
        choice = f"({member} {rest})" + (f" | ({later})" if later else "")
        return f"({choice})", True

    expression, may_be_empty = first(0)
    return f"({expression})?" if expression and may_be_empty else expression


def _schema_value(schema: Mapping[str, Any] | None, quote: str) -> str:
    """A value of the notation that follows `schema` as far as it is described (else any value)."""
    schema = schema or {}
    kind = schema.get("type")
    if schema.get("enum") and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(f"{quote} {literal(v)} {quote}" for v in schema["enum"]) + ")"
    if kind == "string":
        return "string"
    if kind == "integer":
        return INTEGER
    if kind == "number":
        return NUMBER
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        item = _schema_value(schema["items"], quote)
        return f'"[" ({item} ("," {item})*)? "]"'
    if kind == "object" and isinstance(schema.get("properties"), Mapping):
        required = set(schema.get("required", ()))
        members = [(_member(n, s, quote), n in required) for n, s in sorted(schema["properties"].items())]
        return f'"{{" {_members(members)} "}}"'
    return "value"


class Gemma4Parser(ToolCallParser):
    """Content until `<|tool_call>`; the call held until `<tool_call|>`, then read whole."""

    def __init__(self, events: CallEvents) -> None:
        super().__init__(events)
        self._in_call = False
        self._after_call = False  # whitespace between or after calls separates them: no content

    def advance(self, final: bool) -> None:
        while True:
            if self._after_call:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return
                self._after_call = False
            if not self._in_call:
                if self.content_until([OPEN], final) is None:
                    return
                self._in_call = True
            end = _close_outside_strings(self.buffer)
            if end < 0:
                if final:
                    self._emit(self.buffer, whole=False)
                    self.buffer = ""
                return
            self._emit(self.buffer[:end], whole=True)
            self.buffer = self.buffer[end + len(CLOSE):]
            self._in_call, self._after_call = False, True

    def _emit(self, body: str, whole: bool) -> None:
        brace = body.find("{")
        name = body[len(CALL):brace] if body.startswith(CALL) and brace > len(CALL) else None
        if name is None or not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
            self.events.content(self.space_before_marker + OPEN + body + (CLOSE if whole else ""))
            return
        self.events.open(name)
        try:
            arguments = read_arguments(body[brace:]) if whole else None
        except ValueError:
            arguments = None
        if arguments is None:
            self.events.arguments(body[brace:])
            self.events.close(whole=False)
        else:
            self.events.arguments(json.dumps(arguments, ensure_ascii=False))
            self.events.close()


def _close_outside_strings(text: str) -> int:
    """Where `<tool_call|>` ends the call in `text` (never inside a `<|"|>` string), or -1."""
    i, in_string = 0, False
    while True:
        quote, close = text.find(QUOTE, i), -1 if in_string else text.find(CLOSE, i)
        if close >= 0 and (quote < 0 or close < quote):
            return close
        if quote < 0:
            return -1
        i, in_string = quote + len(QUOTE), not in_string


def read_arguments(text: str) -> dict[str, Any]:
    """`{key:value,...}` in Gemma 4's notation as a dict; ValueError where it is not that."""
    value, end = _read_value(text, 0)
    if end != len(text) or not isinstance(value, dict):
        raise ValueError(f"not one object of the notation: {text!r}")
    return value


def _read_value(text: str, i: int) -> tuple[Any, int]:
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise ValueError("an unterminated string")
        return text[i + len(QUOTE):end], end + len(QUOTE)
    if text.startswith("{", i):
        return _read_items(text, i + 1, "}", keyed=True)
    if text.startswith("[", i):
        return _read_items(text, i + 1, "]", keyed=False)
    end = i
    while end < len(text) and text[end] not in BARE_END:
        end += 1
    word = text[i:end].strip()
    if not word:
        raise ValueError(f"a value expected at {i}")
    return _bare(word), end


def _read_items(text: str, i: int, close: str, keyed: bool) -> tuple[Any, int]:
    items: dict[str, Any] | list[Any] = {} if keyed else []
    if text.startswith(close, i):
        return items, i + 1
    while True:
        if keyed:
            if text.startswith(QUOTE, i):
                key, i = _read_value(text, i)
            else:
                colon = text.find(":", i)
                if colon < 0:
                    raise ValueError("a key without a value")
                key, i = text[i:colon].strip(), colon
            if not text.startswith(":", i):
                raise ValueError(f"':' expected at {i}")
            value, i = _read_value(text, i + 1)
            items[key] = value
        else:
            value, i = _read_value(text, i)
            items.append(value)
        if text.startswith(",", i):
            i += 1
        elif text.startswith(close, i):
            return items, i + 1
        else:
            raise ValueError(f"',' or {close!r} expected at {i}")


def _bare(word: str) -> Any:
    """A bare value: true/false, null/None, a number; anything else stays text."""
    if word in ("true", "false"):
        return word == "true"
    if word in ("null", "None"):
        return None
    try:
        return json.loads(word)
    except ValueError:
        return word
