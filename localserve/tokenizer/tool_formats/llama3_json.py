"""Llama 3.1, 3.2 and 3.3: a message is either an answer or one call, a JSON object with `parameters`.

As the templates write a call (the whole assistant message; `<|python_tag|>` may come first, the special token
Llama's built-in tools use):

    {"name": "get_weather", "parameters": {"city": "Paris"}}

There is no trigger text: an answer that starts with such an object is a call, so the grammar of `auto` lets
free text through only when it does not start with `{`, from the first token (with an answer format, a JSON
value of it instead of free text).
"""

from __future__ import annotations

from typing import Any

from localserve.tokenizer.held_text import is_prefix_of_any
from localserve.tokenizer.tool_formats.base import CallEvents, CallGrammar, ToolCallParser, ToolFormat, ToolUse
from localserve.tokenizer.tool_formats.json_call import JsonCallReader
from localserve.tokenizer.tool_formats.lark import TEMPLATE_JSON, WS, json_value, literal
from localserve.tokenizer.tools import ToolSpec

__all__ = ["Llama3JsonFormat", "Llama3JsonParser"]

PYTHON_TAG = "<|python_tag|>"
FIRST_KEYS = ("name", "type")  # Llama 3.2 sometimes writes {"type": "function", "name": ...}


class Llama3JsonFormat(ToolFormat):
    """One `{"name": ..., "parameters": ...}` object per message."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def grammar(self, use: ToolUse) -> CallGrammar:
        tag = self.tokens.ids.get(PYTHON_TAG)
        calls = " | ".join(f"call_{index}" for index in range(len(use.tools)))
        answer = "TEXT" if use.answer is None else "answer"  # free text, or a JSON value of the answer's format
        start = "start: WS? call WS?" if use.required else f"start: {answer} | call WS?"
        python_tag = f"(<[{tag}]>)? " if tag is not None else ""  # the tag may come first where it is a token
        lines = ["%llguidance {}", start, r"TEXT: /\s*([^\s{](?s:.*))?/", f"call: {python_tag}({calls})"]
        if use.answer is None:
            lines += [f'call_{index}: {literal(_call_prefix(tool.name))} {json_value(tool.parameters)} "}}"'
                      for index, tool in enumerate(use.tools)]
        else:  # a call is a JSON value too then: llguidance cannot choose between a literal and a value alike
            lines.append(f"answer: {json_value(use.answer)}")
            lines += [f"call_{index}: {json_value(_call_schema(tool))}" for index, tool in enumerate(use.tools)]
        return CallGrammar("\n".join([*lines, WS]) + "\n")

    def parser(self, use: ToolUse) -> Llama3JsonParser:
        return Llama3JsonParser(CallEvents(self.new_call_id))


def _call_prefix(name: str) -> str:
    return f'{{"name": "{name}", "parameters": '


def _call_schema(tool: ToolSpec) -> dict[str, Any]:
    """A call of `tool` as one JSON value, laid out as `_call_prefix` writes it."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, "parameters": dict(tool.parameters)},
            "required": ["name", "parameters"], "additionalProperties": False, "x-guidance": dict(TEMPLATE_JSON)}


class Llama3JsonParser(ToolCallParser):
    """At the start of the answer: `<|python_tag|>` or a JSON object whose first key is `name` (or `type`) is a
    call; anything else makes the whole answer content. After the call, whitespace is dropped."""

    def __init__(self, events: CallEvents) -> None:
        super().__init__(events)
        self._state = "start"
        self._call: JsonCallReader | None = None
        self._prefix = ""  # the text before the call object (a python tag, whitespace), given back if no call

    def advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self._state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(PYTHON_TAG):
                self._begin_call(self.buffer[:len(self.buffer) - len(stripped) + len(PYTHON_TAG)], None)
                return True
            if stripped.startswith("{"):
                self._begin_call(self.buffer[:len(self.buffer) - len(stripped)], FIRST_KEYS)
                return True
            if not final and (not stripped or is_prefix_of_any(stripped, [PYTHON_TAG])):
                return False
            self._state = "text"
            return True
        if self._state == "call":
            call, text = self._call, self.buffer
            self.buffer = ""
            if text:
                call.feed(text)
            if call.malformed and not call.opened or final and not call.opened and not call.done:
                self.events.content(self._prefix + call.consumed)  # not a call: the answer is content
                self._state = "text"
                return False
            if call.malformed:  # the call's text broke off: it ends with what it has
                self.events.close(whole=False)
            if call.done or call.malformed:
                self.buffer, self._state = call.rest.lstrip(), "after_call"
                return True
            return False
        if self._state == "after_call":
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return False
            self._state = "text"
        self.events.content(self.buffer)
        self.buffer = ""
        return False

    def _begin_call(self, prefix: str, first_keys: tuple[str, ...] | None) -> None:
        self._prefix, self.buffer = prefix, self.buffer[len(prefix):]
        self._state, self._call = "call", JsonCallReader(self.events, first_keys=first_keys)
