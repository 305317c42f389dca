"""The generic JSON form, for templates without tool support (the default model SmolLM2's among them).

The tools are described in the system prompt, and the whole answer is one JSON object, either calls or an
answer (llama.cpp's generic format):

    {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    {"tool_calls": [{"name": ..., "arguments": ...}, ...]}       (when several calls may come)
    {"response": "It is sunny."}

Its grammar constrains the answer from its first token, `auto` included. Earlier tool turns of the conversation
are written the same way: an assistant's calls as that JSON, a tool's result as a user message holding
`{"tool_response": {"name": ..., "content": ...}}`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from localserve.tokenizer.json_stream import (
    ElementPiece,
    JsonArrayReader,
    JsonObjectReader,
    JsonStringDecoder,
    MemberKey,
    MemberPiece,
)
from localserve.tokenizer.tool_formats.base import CallEvents, CallGrammar, ToolCallParser, ToolFormat, ToolUse
from localserve.tokenizer.tool_formats.json_call import JsonCallReader
from localserve.tokenizer.tool_formats.lark import WS, json_value
from localserve.tokenizer.tools import ToolSpec, template_messages

__all__ = ["GenericJsonFormat", "GenericJsonParser", "tools_prompt"]


class GenericJsonFormat(ToolFormat):
    """One JSON object per answer: `tool_call`, `tool_calls` or `response`."""

    name = "json"
    markers = ()

    def template_inputs(self, messages: Sequence[Mapping[str, Any]],
                        use: ToolUse | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        converted: list[dict[str, Any]] = []
        for message in template_messages(messages):
            if message.get("tool_calls"):
                calls = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                         for call in message["tool_calls"]]
                written = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
                converted.append({"role": "assistant", "content": json.dumps(written, ensure_ascii=False)})
            elif message.get("role") == "tool":
                result = {"tool_response": {"name": message.get("name"), "content": message.get("content")}}
                line = json.dumps(result, ensure_ascii=False)
                if converted and converted[-1].get("tool_results"):  # results of one turn in one user message
                    converted[-1]["content"] += "\n" + line
                else:
                    converted.append({"role": "user", "content": line, "tool_results": True})
            else:
                converted.append(message)
        for message in converted:
            message.pop("tool_results", None)
        if use is not None:
            prompt = tools_prompt(use)
            if converted and converted[0].get("role") == "system":
                converted[0] = {**converted[0], "content": f"{converted[0]['content']}\n\n{prompt}"}
            else:
                converted.insert(0, {"role": "system", "content": prompt})
        return converted, None

    def grammar(self, use: ToolUse) -> CallGrammar:
        return CallGrammar("\n".join(["%llguidance {}", "start: WS? answer WS?",
                                      f"answer: {json_value(answer_schema(use))}", WS]) + "\n")

    def parser(self, use: ToolUse) -> GenericJsonParser:
        return GenericJsonParser(CallEvents(self.new_call_id), response_is_json=use.answer is not None)


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """A call of `tool`: its name and arguments."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": dict(tool.parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def answer_schema(use: ToolUse) -> dict[str, Any]:
    """The schema of an answer under `use`."""
    call = {"anyOf": [call_schema(tool) for tool in use.tools]}
    forms = [{"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
              "additionalProperties": False}]
    if use.parallel:
        forms.append({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                      "required": ["tool_calls"], "additionalProperties": False})
    if not use.required:
        response = dict(use.answer) if use.answer is not None else {"type": "string"}
        forms.append({"type": "object", "properties": {"response": response}, "required": ["response"],
                      "additionalProperties": False})
    return {"anyOf": forms}


def tools_prompt(use: ToolUse) -> str:
    """The system prompt's description of the tools and of the answer's form."""
    tools = "\n".join(json.dumps({"name": tool.name, "description": tool.description or "",
                                  "parameters": dict(tool.parameters)}, ensure_ascii=False) for tool in use.shown_tools)
    forms = ['{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}} to call a tool']
    if use.parallel:
        forms.append('{"tool_calls": [{"name": ..., "arguments": ...}, ...]} to call several at once')
    if not use.required and use.answer is not None:
        forms.append('{"response": <your answer as a JSON value of the format asked for>} to answer the user')
    elif not use.required:
        forms.append('{"response": "<your answer>"} to answer the user')
    only = f" You must call {use.tools[0].name}." if use.required and len(use.tools) == 1 else ""
    return (f"You can call these tools:\n{tools}\n\nReply with one JSON object and nothing else: "
            + ", or ".join(forms) + "." + only)


class GenericJsonParser(ToolCallParser):
    """The answer's object: the text of `response` as content (its JSON text when it is no string, or when the
    answer has a format: `response_is_json`), the calls of `tool_call` / `tool_calls`; an answer that is not a
    JSON object is content as written; whitespace after the object is dropped."""

    def __init__(self, events: CallEvents, response_is_json: bool = False) -> None:
        super().__init__(events)
        self._state = "start"
        self._object = JsonObjectReader()
        self._response: JsonStringDecoder | None = None
        self._response_is_json = response_is_json
        self._response_is_text = True  # False when `response` is not a string: its JSON is the content
        self._call: JsonCallReader | None = None
        self._calls: JsonArrayReader | None = None
        self._array_calls: dict[int, JsonCallReader] = {}

    def advance(self, final: bool) -> None:
        if self._state == "start":
            stripped = self.buffer.lstrip()
            if not stripped and not final:
                return
            self._state = "object" if stripped.startswith("{") else "text"
        if self._state == "object":
            text, self.buffer = self.buffer, ""
            for part in self._object.feed(text):
                if isinstance(part, MemberKey):
                    self._begin_member(part.key)
                elif isinstance(part, MemberPiece):
                    self._member_piece(part.key, part.text)
            if self._object.malformed:
                self.buffer, self._state = self._object.rest, "text"
            elif self._object.done:
                self.buffer, self._state = self._object.rest, "after"
        if self._state == "after":  # whitespace after the answer's object (the grammar allows some) says nothing
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return
            self._state = "text"
        if self._state == "text":
            self.events.content(self.buffer)
            self.buffer = ""

    def _begin_member(self, key: str) -> None:
        if key == "response":
            self._response = None
        elif key == "tool_call":
            self._call = JsonCallReader(self.events)
        elif key == "tool_calls":
            self._calls = JsonArrayReader()

    def _member_piece(self, key: str, text: str) -> None:
        if key == "response":
            if self._response is None and self._response_is_text:
                self._response_is_text = text.startswith('"') and not self._response_is_json
                self._response = JsonStringDecoder() if self._response_is_text else None
            self.events.content(self._response.feed(text) if self._response_is_text else text)
        elif key == "tool_call":
            self._call.feed(text)
        elif key == "tool_calls":
            for part in self._calls.feed(text):
                if part.index not in self._array_calls:
                    self._array_calls[part.index] = JsonCallReader(self.events)
                if isinstance(part, ElementPiece):
                    self._array_calls[part.index].feed(part.text)
