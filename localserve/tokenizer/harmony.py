"""gpt-oss's chat format, harmony: messages on channels, delimited by special tokens.

Each message is `<|start|>{header}<|message|>{body}` and ends with `<|end|>`, or, ending the turn, with
`<|return|>` (the answer is done) or `<|call|>` (a tool call waits for its result). The prompt ends with
`<|start|>assistant`, so the output begins with the first message's header. The header names the channel and,
for a call, its recipient:

    <|channel|>analysis<|message|>The user wants the weather. Call get_weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}
    (<|call|>, which ends the output)

- `analysis` is reasoning (`reasoning_content`, Responses reasoning items, Anthropic thinking blocks, Ollama's
  `thinking`); resent, it is the analysis before a call in a tool loop (the template's `thinking`; left out
  beside the turn's text, which the template renders as the analysis), and the template drops it elsewhere;
- `commentary` with a recipient `to=functions.NAME` (before or after the channel: the template writes
  `assistant to=functions.NAME<|channel|>commentary json`) is a call whose body is its JSON arguments;
  `commentary` without one is a preamble the user sees, content like `final`;
- `final` is the answer.

The template's `reasoning_effort` (low, medium, high; medium when unset) is the request's effort; harmony always
reasons, so an effort of "none" is refused. A turn ends with `<|return|>` or `<|call|>`; both are stop tokens
of the turn (a GGUF names only one of them end of sequence). One call per turn: the template renders one call
per assistant message and names each tool result after the call just before it, so a conversation with several
calls in one message is rendered as one message per call, each followed by its results.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from localserve.tokenizer.chat_template import REASONING_NAMES
from localserve.tokenizer.chat_turn import ChatFormat, ChatInputs, ChatStreamParser, ChatTurn, check_tool_names
from localserve.tokenizer.held_text import split_at_marker
from localserve.tokenizer.json_stream import JsonValueScanner
from localserve.tokenizer.stream_events import StreamEvent
from localserve.tokenizer.tool_formats.base import CallEvents, CallGrammar, MarkerTokens, ToolUse, random_call_id
from localserve.tokenizer.tool_formats.lark import json_value, literal, marker, regex_literal
from localserve.tokenizer.tools import AUTO, ChatFormatError, ToolChoice, ToolSpec, template_messages

__all__ = ["HarmonyCalls", "HarmonyFormat", "HarmonyParser", "HarmonyReasoning", "HarmonyTurn",
           "is_harmony_template"]

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
FUNCTIONS = "functions."
# The request's reasoning effort as the template's level: the nearest of the three it takes.
LEVELS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
# Arguments as gpt-oss writes them: compact JSON (the harmony spec's examples; not the template's `tojson`).
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_HEADER_CHARS = 256  # a header is a role, a channel, a recipient and a content type: short, on one line
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def is_harmony_template(template: str) -> bool:
    """True for a template that writes harmony's messages (gpt-oss's)."""
    return all(token in template for token in (START, CHANNEL, MESSAGE, CALL))


@dataclass(frozen=True)
class HarmonyReasoning:
    """Harmony's reasoning, as `/v1/models` shows it: the analysis channel, always on, at one of three levels."""

    name: ClassVar[str] = "harmony"
    can_disable: ClassVar[bool] = False
    levels: ClassVar[tuple[str, ...]] = ("low", "medium", "high")

    @staticmethod
    def template_variables(effort: str | None) -> dict[str, Any]:
        """The template's `reasoning_effort` for a request's effort (none: the template's default)."""
        return {} if effort is None else {"reasoning_effort": LEVELS[effort]}


class HarmonyCalls:
    """Harmony's tool calls, bound to a vocabulary's added tokens: the template's inputs and the grammar."""

    name: ClassVar[str] = "harmony"  # stable: shown by /v1/models

    def __init__(self, tokens: MarkerTokens) -> None:
        self.tokens = tokens

    def template_inputs(self, messages: Sequence[Mapping[str, Any]],
                        use: ToolUse | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages, one call per assistant message, each followed by its results; and the tools, each
        with a description (the template writes `"// " + description` and fails on a tool without one)."""
        tools = None
        if use is not None:
            tools = [tool.template_tool() for tool in use.shown_tools]
            for tool in tools:
                tool["function"].setdefault("description", "")
        return one_call_per_message([_analysis_or_content(message) for message in template_messages(messages)]), tools

    def grammar(self, use: ToolUse) -> CallGrammar:
        """The whole output's grammar (harmony's structure is in special tokens, so it is constrained from the
        first token; the message bodies other than a call's are free text, which holds no special token, nor a
        marker that ends a message spelled in ordinary tokens).

        Under tool_choice `auto`: any analysis and preamble messages, then a call or the final answer (a value
        of `use.answer` when the request has an answer format). Under `required` or a named function: at most
        one analysis message and one preamble, then the call. After the recipient, the call's arguments must
        follow its function's schema."""
        token = self._token
        follow = f'{token(END)} {token(START)} "assistant"'
        rules = [f'analysis: {token(CHANNEL)} "analysis" {token(MESSAGE)} TEXT {follow}',
                 f'preamble: {token(CHANNEL)} "commentary" {token(MESSAGE)} TEXT {follow}',
                 "call: " + " | ".join(f"call_{index}" for index in range(len(use.tools))),
                 f'content_type: " " {token(CONSTRAIN)}? "json" {token(MESSAGE)}']
        for index, tool in enumerate(use.tools):
            recipient = literal(f" to={FUNCTIONS}{tool.name}")
            headers = (f'{token(CHANNEL)} "commentary" {recipient} | {recipient} {token(CHANNEL)} "commentary"')
            arguments = json_value({**tool.parameters, "x-guidance": COMPACT_JSON})
            rules.append(f"call_{index}: ({headers}) content_type {arguments} {token(CALL)}")
        if use.required:
            start = "start: analysis? preamble? call"
        else:
            body = "TEXT" if use.answer is None else json_value(use.answer)
            rules.append(f'final: {token(CHANNEL)} "final" {token(MESSAGE)} {body} {token(RETURN)}')
            start = "start: (analysis | preamble)* (call | final)"
        # a body never spells a marker that ends a message in ordinary tokens: the parser would end it there
        spelled = "|".join(regex_literal(text) for text in (END, START, RETURN, CALL))
        text = f"TEXT: /(?s:.*)/ & ~/(?s:.*)({spelled})(?s:.*)/"
        return CallGrammar("\n".join(["%llguidance {}", start, *rules, text]) + "\n")

    def _token(self, text: str) -> str:
        return marker(text, self.tokens.ids)


def one_call_per_message(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (as `template_messages` gives them) with each assistant message of several calls split into
    one message per call, each followed by the tool results that answer it (matched by `tool_call_id`; results
    that name no call of the message keep their place after the last one)."""
    out: list[dict[str, Any]] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        index += 1
        calls = message.get("tool_calls") or []
        if message.get("role") != "assistant" or len(calls) < 2:
            out.append(message)
            continue
        results = []
        while index < len(messages) and messages[index].get("role") == "tool":
            results.append(messages[index])
            index += 1
        ids = [call.get("id") for call in calls]
        for number, call in enumerate(calls):
            split = {**message, "tool_calls": [call]}
            if number:  # the turn's text and its reasoning (analysis) came once, before its first call
                split = {**_without_reasoning(split), "content": ""}
            out.append(split)
            out += [result for result in results if result.get("tool_call_id") == ids[number]]
        out += [result for result in results if result.get("tool_call_id") not in ids]
    return out


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key not in REASONING_NAMES}


def _analysis_or_content(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with calls and text: the template renders the text as the analysis before its call
    and refuses a `thinking` beside it, so a resent reasoning is left out there (elsewhere it is the analysis:
    the template's `thinking`, filled by render_chat_template)."""
    if message.get("tool_calls") and message.get("content"):
        return _without_reasoning(message)
    return message


class HarmonyFormat(ChatFormat):
    """gpt-oss's chat format over a vocabulary's added tokens (`MarkerTokens`)."""

    def __init__(self, tokens: MarkerTokens) -> None:
        self.tool_format = HarmonyCalls(tokens)
        self.reasoning = HarmonyReasoning()
        self.stop_token_ids = tuple(tokens.ids[text] for text in (RETURN, CALL) if text in tokens.ids)

    def turn(self, tools: Sequence[ToolSpec] = (), tool_choice: ToolChoice = AUTO,
             parallel_tool_calls: bool = True, thinking: bool = True,
             answer: Mapping[str, Any] | None = None, effort: str | None = None) -> HarmonyTurn:
        """See `ChatFormat.turn`; one call at most whatever `parallel_tool_calls` says (harmony's turn ends at a
        call); `effort` picks the template's reasoning level."""
        check_tool_names(tools)
        if not thinking or effort == "none":
            raise ChatFormatError("reasoning_effort", "gpt-oss's harmony format always reasons: its template "
                                  "takes a reasoning level, low, medium or high, and cannot turn thinking off")
        if effort is not None and effort not in LEVELS:
            raise ChatFormatError("reasoning_effort", f"harmony's reasoning levels are low, medium and high, not "
                                  f"{effort!r}")
        callable_tools = tool_choice.chosen_tools(tools)
        use = None
        if callable_tools:
            required = tool_choice.mode in ("required", "function")
            use = ToolUse(callable_tools, required=required, parallel=False, offered=tuple(tools),
                          answer=None if required else answer)
        return HarmonyTurn(self, use, effort)


class HarmonyTurn(ChatTurn):
    """One request's harmony turn."""

    def __init__(self, chat_format: HarmonyFormat, use: ToolUse | None, effort: str | None) -> None:
        self._format = chat_format
        self._use = use
        self._effort = effort

    @property
    def tools_offered(self) -> bool:
        return self._use is not None

    @property
    def reasons(self) -> bool:
        return True

    def chat_inputs(self, messages: Sequence[Mapping[str, Any]]) -> ChatInputs:
        converted, tools = self._format.tool_format.template_inputs(messages, self._use)
        return ChatInputs(converted, tools, self._format.reasoning.template_variables(self._effort))

    @property
    def grammar(self) -> CallGrammar | None:
        return self._format.tool_format.grammar(self._use) if self._use is not None else None

    @property
    def skip_special_tokens(self) -> bool:
        return False  # the parser reads the special tokens that delimit the messages

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._format.stop_token_ids

    def stream_parser(self) -> HarmonyParser:
        return HarmonyParser(calls=self._use is not None)


class HarmonyParser(ChatStreamParser):
    """Harmony messages, decoded with their special tokens, into events: analysis bodies as reasoning, final
    and preamble bodies as content, a call's body as its arguments (the call opens when its header is complete,
    and ends, whole when its body is one JSON value, with the message or the output).

    The messages of one kind are joined by a blank line. Text where a header should be that cannot be one (a line
    break, over MAX_HEADER_CHARS, or the output ends) is content, as the model wrote it, up to the message's
    end; a header cut short by the end of the output is left out (it is structure, not text). Only a recipient
    `functions.NAME` makes a call, and only where tools were offered (`calls`); another (a tool's own message
    `to=assistant`, a built-in tool never offered here) leaves the body content.
    """

    def __init__(self, calls: bool, new_call_id: Callable[[], str] = random_call_id) -> None:
        self._calls = calls
        self._events = CallEvents(new_call_id)
        self._buffer = ""
        self._state = "header"  # header | body | between (after a message's end, before the next header)
        self._kind = "content"  # the body's: reasoning | content | call
        self._kinds_seen: set[str] = set()  # the kinds of the messages that had text
        self._body_started = False
        self._value: JsonValueScanner | None = None
        self._value_done = False
        self._after_value = ""

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        self._advance(final=False)
        return self._events.take()

    def finish(self) -> list[StreamEvent]:
        self._advance(final=True)
        self._end_message()
        return self._events.take()

    def _advance(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """One move; False when nothing more can be read now."""
        if self._state == "between":
            if self._buffer.startswith(START):
                self._buffer, self._state = self._buffer[len(START):], "header"
                return True
            if START.startswith(self._buffer) and not final:
                return False
            self._state = "header"  # no <|start|>: the next header follows at once
            return bool(self._buffer)
        if self._state == "header":
            return self._read_header(final)
        split = split_at_marker(self._buffer, [END, RETURN, CALL, START])
        end = len(self._buffer) if final and split.marker is None else split.safe_end
        self._body(self._buffer[:end])
        self._buffer = self._buffer[end:]
        if split.marker is None:
            return False
        self._end_message()
        if split.marker != START:
            self._buffer = self._buffer[len(split.marker):]
            self._state = "between"
        else:
            self._buffer, self._state = self._buffer[len(START):], "header"
        return True

    def _read_header(self, final: bool) -> bool:
        split = split_at_marker(self._buffer, [MESSAGE])
        header = self._buffer[:split.safe_end] if split.marker is not None else self._buffer
        if split.marker is None and not final and _may_be_header(header):
            return False
        if split.marker is not None and _may_be_header(header):
            self._buffer = self._buffer[split.safe_end + len(MESSAGE):]
            self._open_message(header)
            return True
        if final and _may_be_header(header):  # cut inside a header: no message began
            self._buffer = ""
            return False
        self._kind, self._state, self._body_started = "content", "body", False  # not a header: text as written
        return True

    def _open_message(self, header: str) -> None:
        recipient = RECIPIENT.search(header)
        channel = CHANNEL_NAME.search(header)
        self._state, self._body_started = "body", False
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS) and self._calls:
            self._kind = "call"
            self._events.open(recipient.group(1)[len(FUNCTIONS):])
            self._value, self._value_done, self._after_value = JsonValueScanner(), False, ""
        else:
            self._kind = "reasoning" if channel is not None and channel.group(1) == "analysis" else "content"

    def _body(self, text: str) -> None:
        if not text:
            return
        if self._kind == "call":
            self._call_text(text)
            return
        if not self._body_started and self._kind in self._kinds_seen:
            text = "\n\n" + text  # a later message of the same kind
        self._body_started = True
        self._kinds_seen.add(self._kind)
        if self._kind == "reasoning":
            self._events.reasoning(text)
        else:
            self._events.content(text)

    def _call_text(self, text: str) -> None:
        if self._value_done:
            self._after_value += text
            return
        if not self._body_started:
            stripped = text.lstrip()
            if not stripped:
                return
            self._body_started, text = True, stripped
        end = self._value.feed(text)
        if end is None:
            self._events.arguments(text)
            return
        self._events.arguments(text[:end])
        self._value_done, self._after_value = True, text[end:]

    def _end_message(self) -> None:
        if self._kind == "call" and self._events.is_open:
            self._events.close(whole=self._value_done and not self._after_value.strip())
        self._kind = "content"


def _may_be_header(text: str) -> bool:
    """True while `text` can still be (the start of) a message's header."""
    return len(text) <= MAX_HEADER_CHARS and "\n" not in text and not any(
        token in text for token in (END, START, RETURN, CALL))
