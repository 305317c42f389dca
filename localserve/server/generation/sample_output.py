"""One sample of a response as the APIs show it: its answer text, its reasoning and its tool calls, read from
the engine's text deltas by the chat format's stream parser (no I/O here).

A `SampleOutput` keeps what the sample said so far and the events not yet sent (`pending`, in order), which
one API's view (server/generation/stream.py for Responses, server/openai/completion_events.py for chat completions)
takes and spells. Without a parser (a plain completion, or a chat turn that neither offers tools nor
reasons) every delta is content as it comes.

A call is handed on only once it has ended whole: its events are held from its start to its end, then pending
all at once (its argument pieces as they came). A call the output ends inside (the token limit, a stop string,
a cancel) or whose text broke off is dropped, so no API ever shows a call with arguments that are no JSON
object; the calls kept are numbered 0, 1, 2, ... in `calls`' order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from localserve.engine.outputs import StopReason
from localserve.server.request.generation_request import is_json_object
from localserve.tokenizer.chat_format import ChatStreamParser
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)


@dataclass(frozen=True)
class ToolCall:
    """A call the sample made, whole: its id (the API's `call_id`), the function and its arguments (the JSON text
    of an object)."""

    id: str
    name: str
    arguments: str

    @property
    def input(self) -> dict[str, Any]:
        """The arguments as an object (Ollama's `arguments`, Anthropic's `input`)."""
        return json.loads(self.arguments)

    def message_call(self) -> dict[str, Any]:
        """As a conversation stores it (request_model.Message's `tool_calls`)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and its most likely alternatives, each token as its text."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass
class SampleOutput:
    """What one sample said, and what of it is not sent yet."""

    parser: ChatStreamParser | None = None
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    pending: list[StreamEvent] = field(default_factory=list)
    held: list[StreamEvent] = field(default_factory=list)  # the open call's events, until it ends
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    all_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_output_tokens: int = 0
    num_reasoning_tokens: int = 0
    finish_reason: str | None = None  # the engine's: "stop" | "length" | "abort" | "error" (None: running)
    stop: StopReason | None = None  # why the engine stopped it (which stop token or string among them)
    _finished: bool = False

    @property
    def ended_calling_tools(self) -> bool:
        """The sample stopped (not cut by its token limit) after calling tools: a tool call ended its turn."""
        return self.finish_reason == "stop" and bool(self.calls)

    def feed(self, text: str) -> None:
        """The engine's next text delta of this sample."""
        if not text:
            return
        self._take(self.parser.feed(text) if self.parser is not None else [ContentDelta(text)])

    def finish(self) -> None:
        """The sample has ended (or the response did): release what the parser holds, close an open call."""
        if self._finished:
            return
        self._finished = True
        if self.parser is not None:
            self._take(self.parser.finish())

    @property
    def has_pending(self) -> bool:
        return bool(self.pending or self.pending_logprobs)

    def add_logprob(self, entry: TokenLogprob) -> None:
        """The log-probability of the sample's next token."""
        self.pending_logprobs.append(entry)
        self.all_logprobs.append(entry)

    def take_pending(self) -> tuple[list[StreamEvent], list[TokenLogprob]]:
        """The events and log-probability entries not sent yet (a view sends them)."""
        events, entries = self.pending, self.pending_logprobs
        self.pending, self.pending_logprobs = [], []
        return events, entries

    def _take(self, events: list[StreamEvent]) -> None:
        for event in events:
            if isinstance(event, (ToolCallStart, ToolCallArgumentsDelta)):
                self.held.append(event)
                continue
            if isinstance(event, ToolCallEnd):
                self._end_call(event)
                continue
            if isinstance(event, ContentDelta):
                self.content += event.text
            elif isinstance(event, ReasoningDelta):
                self.reasoning += event.text
            self.pending.append(event)

    def _end_call(self, end: ToolCallEnd) -> None:
        """The held call ends: kept, numbered after the calls kept before it, when whole; else dropped."""
        held, self.held = self.held, []
        start = held[0]
        assert isinstance(start, ToolCallStart), "a call's events begin with its start"
        if not end.whole or not is_json_object(end.arguments):
            return
        index = len(self.calls)
        self.calls.append(ToolCall(start.id, start.name, end.arguments))
        self.pending += [replace(event, index=index) for event in [*held, end]]
