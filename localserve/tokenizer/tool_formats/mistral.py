"""Mistral: calls after the `[TOOL_CALLS]` control token, with 9-character alphanumeric call ids.

Two forms. Mistral Nemo (and Mistral 7B v0.3) write one JSON array of calls, an id in each:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]

Newer models (Mistral Small 3.2, Devstral, Magistral) write each call as its name then its arguments, after
`[ARGS]`, with an optional `[CALL_ID]` and id between, or right after the name:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search{"query": "föhn"}

Mistral's templates refuse a conversation whose call ids are not 9 letters and digits, so ids of another
shape (OpenAI's `call_...`) are mapped to such ids, the same way in the call and in its result. The ids a
model writes are not kept: each call gets a new one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from localserve.tokenizer.json_stream import ElementEnd, ElementPiece, JsonArrayReader, JsonValueScanner
from localserve.tokenizer.tool_formats.base import (
    ALPHANUMERIC,
    CallEvents,
    CallGrammar,
    ToolCallParser,
    ToolFormat,
    ToolUse,
    random_call_id,
)
from localserve.tokenizer.tool_formats.json_call import JsonCallReader
from localserve.tokenizer.tool_formats.lark import calls_grammar, json_value, literal, marker

__all__ = ["MistralArgsFormat", "MistralArrayFormat", "mistral_call_id"]

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_call_id(call_id: str) -> str:
    """`call_id` as Mistral's templates accept it: itself when it is 9 letters and digits, else 9 derived from it."""
    if MISTRAL_ID.fullmatch(call_id):
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
    return "".join(ALPHANUMERIC[(digest >> (6 * place)) % len(ALPHANUMERIC)] for place in range(9))


class _MistralFormat(ToolFormat):
    """What both Mistral forms share: the marker, the ids."""

    def new_call_id(self) -> str:
        return random_call_id(9, prefix="")

    def template_inputs(self, messages: Sequence[Mapping[str, Any]],
                        use: ToolUse | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        converted, tools = super().template_inputs(messages, use)
        for message in converted:
            if message.get("tool_calls"):
                message["tool_calls"] = [{**call, "id": mistral_call_id(call["id"])} if isinstance(call.get("id"), str)
                                         else call for call in message["tool_calls"]]
            if message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
                message["tool_call_id"] = mistral_call_id(message["tool_call_id"])
        return converted, tools

    def _grammar(self, use: ToolUse, rules: list[str]) -> CallGrammar:
        lark = calls_grammar(marker(TOOL_CALLS, self.tokens.ids), TOOL_CALLS, rules, "call", lazy=use.lazy,
                             parallel=use.parallel, answer=use.answer)
        return CallGrammar(lark, TOOL_CALLS, self.tokens.ids.get(TOOL_CALLS)) if use.lazy else CallGrammar(lark)


class MistralArrayFormat(_MistralFormat):
    """`[TOOL_CALLS][{...}, {...}]` (Mistral Nemo)."""

    name = "mistral_array"
    markers = (TOOL_CALLS,)

    def grammar(self, use: ToolUse) -> CallGrammar:
        calls = " | ".join(f"call_{index}" for index in range(len(use.tools)))
        more = f'(", " ({calls}))*' if use.parallel else ""
        # as the template writes a call: its function object's JSON, with the id after the arguments
        rules = [f'call: "[" ({calls}) {more} "]"', r'CALL_ID: /, "id": "[A-Za-z0-9]{9}"/']
        rules += [f'call_{index}: {literal(_array_prefix(tool.name))} {json_value(tool.parameters)} CALL_ID? "}}"'
                  for index, tool in enumerate(use.tools)]
        # parallel calls are elements of one array, so one opener at most
        return self._grammar(ToolUse(use.tools, use.required, parallel=False, answer=use.answer), rules)

    def parser(self, use: ToolUse) -> MistralArrayParser:
        return MistralArrayParser(CallEvents(self.new_call_id))


def _array_prefix(name: str) -> str:
    return f'{{"name": "{name}", "arguments": '


class MistralArrayParser(ToolCallParser):
    """Content until `[TOOL_CALLS]`, then an array of call objects (or one object); whitespace after it dropped."""

    def __init__(self, events: CallEvents) -> None:
        super().__init__(events)
        self._state = "text"
        self._array: JsonArrayReader | None = None
        self._calls: dict[int, JsonCallReader] = {}
        self._consumed = ""

    def advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if self.content_until([TOOL_CALLS], final) is None:
                return False
            self._state, self._array, self._calls, self._consumed = "array", JsonArrayReader(), {}, ""
            return True
        if self._state == "array":
            text, self.buffer = self.buffer, ""
            self._consumed += text
            for part in self._array.feed(text):
                if part.index not in self._calls:
                    self._calls[part.index] = JsonCallReader(self.events)
                call = self._calls[part.index]
                if isinstance(part, ElementPiece):
                    call.feed(part.text)
                elif isinstance(part, ElementEnd) and not call.opened:
                    self.events.content(call.consumed)  # an element that is not a call, as written
            if self._array.malformed and not self._calls:
                self.events.content(self.space_before_marker + TOOL_CALLS + self._consumed)
                self._state = "text"
                return False
            if final and not self._array.done:
                last = self._calls[max(self._calls)] if self._calls else None
                if last is None:
                    self.events.content(self.space_before_marker + TOOL_CALLS + self._consumed)
                elif not last.opened:  # cut before its name
                    self.events.content(last.consumed)
                return False
            if self._array.done or self._array.malformed:
                if self.events.is_open:  # its element was no whole call object
                    self.events.close(whole=False)
                self.buffer, self._state = self._array.rest, "after_call"
                return True
            return False
        self.buffer = self.buffer.lstrip()
        if not self.buffer:
            return False
        self._state = "text"
        return True


class MistralArgsFormat(_MistralFormat):
    """`[TOOL_CALLS]name[ARGS]{...}` per call (Mistral Small 3.2 and later)."""

    name = "mistral_args"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def grammar(self, use: ToolUse) -> CallGrammar:
        args = marker(ARGS, self.tokens.ids)
        calls = " | ".join(f"call_{index}" for index in range(len(use.tools)))
        # an id may come between the name and the arguments, as the template writes earlier calls
        rules = [f"call: {calls}", f"call_id: {marker(CALL_ID, self.tokens.ids)} /[A-Za-z0-9]{{9}}/"]
        rules += [f"call_{index}: {literal(tool.name)} call_id? {args} {json_value(tool.parameters)}"
                  for index, tool in enumerate(use.tools)]
        return self._grammar(use, rules)

    def parser(self, use: ToolUse) -> MistralArgsParser:
        return MistralArgsParser(CallEvents(self.new_call_id))


class MistralArgsParser(ToolCallParser):
    """Content until `[TOOL_CALLS]`; the name until `[ARGS]`, `[CALL_ID]` (an id follows, up to `[ARGS]`) or
    the arguments' `{`; the arguments' JSON object; then more calls, or text."""

    def __init__(self, events: CallEvents) -> None:
        super().__init__(events)
        self._state = "text"
        self._arguments: JsonValueScanner | None = None

    def advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._state == "text":
            if self.content_until([TOOL_CALLS], final) is None:
                return False
            self._state = "name"
            return True
        if self._state in ("name", "call_id"):
            ends = [ARGS, CALL_ID, "{"] if self._state == "name" else [ARGS, "{"]
            found = [(self.buffer.find(end), end) for end in ends if end in self.buffer]
            if not found:
                if final and self._state == "name":  # cut before the arguments: not a call
                    self.events.content(self.space_before_marker + TOOL_CALLS + self.buffer)
                    self.buffer = ""
                return False
            at, end = min(found)
            if self._state == "name":
                self.events.open(self.buffer[:at].strip())
            self.buffer = self.buffer[at + (0 if end == "{" else len(end)):]
            self._state = "call_id" if end == CALL_ID else "arguments"
            return True
        if self._state == "arguments":
            if self._arguments is None:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return False
                self._arguments = JsonValueScanner()
            end = self._arguments.feed(self.buffer)
            piece = self.buffer if end is None else self.buffer[:end]
            self.events.arguments(piece)
            if end is None:
                self.buffer = ""
                return False
            self.events.close()
            self.buffer, self._state, self._arguments = self.buffer[end:], "after_call", None
            return True
        self.buffer = self.buffer.lstrip()
        if not self.buffer:
            return False
        self._state = "text"
        return True
