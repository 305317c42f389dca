"""Hermes, Qwen2.5, Qwen3 and QwQ: each call a JSON object between `<tool_call>` and `</tool_call>`.

As the templates write a call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several blocks, separated by a newline. `<tool_call>` is a trigger string, not a special
token in every vocabulary (Qwen's vocabularies hold it as an ordinary added token, Hermes 3's not at all).
"""

from __future__ import annotations

from localserve.tokenizer.tool_formats.base import CallEvents, CallGrammar, ToolCallParser, ToolFormat, ToolUse
from localserve.tokenizer.tool_formats.json_call import JsonCallReader
from localserve.tokenizer.tool_formats.lark import calls_grammar, json_value, literal, marker

__all__ = ["HermesFormat", "HermesParser"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesFormat(ToolFormat):
    """`<tool_call>{json}</tool_call>` blocks."""

    name = "hermes"
    markers = (OPEN, CLOSE)

    def grammar(self, use: ToolUse) -> CallGrammar:
        calls = " | ".join(f"call_{index}" for index in range(len(use.tools)))
        rules = [f'call: "\\n" ({calls}) "\\n" {marker(CLOSE, self.tokens.ids)}']
        rules += [f"call_{index}: {literal(_call_prefix(tool.name))} {json_value(tool.parameters)} \"}}\""
                  for index, tool in enumerate(use.tools)]
        lark = calls_grammar(marker(OPEN, self.tokens.ids), OPEN, rules, "call", lazy=use.lazy, parallel=use.parallel,
                             answer=use.answer)
        return CallGrammar(lark, OPEN, self.tokens.ids.get(OPEN)) if use.lazy else CallGrammar(lark)

    def parser(self, use: ToolUse) -> HermesParser:
        return HermesParser(self)


def _call_prefix(name: str) -> str:
    return f'{{"name": "{name}", "arguments": '


class HermesParser(ToolCallParser):
    """Content until `<tool_call>`, then the call's JSON object, then `</tool_call>`; whitespace around a call
    is dropped (it separates the calls from the content and from each other)."""

    def __init__(self, tool_format: HermesFormat) -> None:
        super().__init__(CallEvents(tool_format.new_call_id))
        self._state = "text"
        self._call: JsonCallReader | None = None

    def advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One move; False when nothing more can be read now."""
        if self._state == "text":
            if self.content_until([OPEN], final) is None:
                return False
            self._state, self._call = "call", JsonCallReader(self.events)
            return True
        if self._state == "call":
            return self._read_call(final)
        if self._state == "closing":
            self.buffer = self.buffer.lstrip()
            if self.buffer.startswith(CLOSE):
                self.buffer, self._state = self.buffer[len(CLOSE):], "after_call"
                return True
            if CLOSE.startswith(self.buffer) and not final:
                return False
            self._state = "after_call"  # the closing tag is missing: what follows is read as text
            return True
        # after_call: whitespace between or after calls separates them
        self.buffer = self.buffer.lstrip()
        if not self.buffer:
            return False
        self._state = "text"
        return True

    def _read_call(self, final: bool) -> bool:
        call, text = self._call, self.buffer
        self.buffer = ""
        if text:
            call.feed(text)
        if call.malformed and not call.opened or final and not call.opened and not call.done:
            self.events.content(self.space_before_marker + OPEN + call.consumed)  # not a call: as written
            self._state = "text"
            return False
        if call.malformed:  # the call's text broke off: it ends with what it has
            self.events.close(whole=False)
        if call.done or call.malformed:
            self.buffer, self._state = call.rest, "closing"
            return True
        return False
