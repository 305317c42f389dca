"""What every tool-call format provides, and the parts its parsers share.

A `ToolFormat` is one chat-template family's way of writing tool calls. For one request's `ToolUse` (the
tools offered, whether a call is required, whether several may come) it gives the template's inputs, the
grammar of the calls, and a stream parser that turns the model's text into `stream_events`.
"""

from __future__ import annotations

import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from localserve.tokenizer.held_text import split_at_marker
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    StreamEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from localserve.tokenizer.tools import ToolSpec, template_messages

__all__ = ["NO_MARKER_TOKENS", "CallEvents", "CallGrammar", "MarkerTokens", "PlainTextParser", "ToolCallParser",
           "ToolFormat", "ToolUse", "random_call_id"]

ALPHANUMERIC = string.ascii_letters + string.digits


def random_call_id(length: int = 24, prefix: str = "call_") -> str:
    """A new call id: `prefix` and `length` random letters and digits (OpenAI's shape by default)."""
    return prefix + "".join(secrets.choice(ALPHANUMERIC) for _ in range(length))


@dataclass(frozen=True)
class ToolUse:
    """The tools of one request as a format writes and constrains them: the tools a call may use (`tools`),
    whether at least one call must come (`required`: tool_choice `required` or a named function), whether
    several may (`parallel`: OpenAI's `parallel_tool_calls`), the tools the prompt shows (`offered`: all
    the request's tools when a named function narrows `tools` to one; None: `tools`), and what an answer that
    calls nothing must be (`answer`: a JSON schema, with llguidance's `x-guidance` settings, when the request
    asks for a format beside its tools; None: free text; never with `required`)."""

    tools: tuple[ToolSpec, ...]
    required: bool = False
    parallel: bool = True
    offered: tuple[ToolSpec, ...] | None = None
    answer: Mapping[str, Any] | None = None

    @property
    def shown_tools(self) -> tuple[ToolSpec, ...]:
        """The tools the prompt describes."""
        return self.tools if self.offered is None else self.offered

    @property
    def lazy(self) -> bool:
        """True when the answer is free text until a call's trigger (tool_choice auto, no answer format)."""
        return not self.required and self.answer is None


@dataclass(frozen=True)
class CallGrammar:
    """The grammar of a request's answer when it may or must call tools, for the engine's constrained decoding.

    `lark` is a Lark grammar in llguidance's syntax (arguments as `%json` schemas, special tokens as `<[id]>`)
    of the whole answer: of the text after the reasoning when the output reasons (see `ChatTurn.reasoning_end`),
    else of the whole output. With a `trigger` (tool_choice `auto` in a family whose calls start with one) the
    grammar accepts any text up to the trigger, so an engine may leave the mask off until the trigger appears
    and then catch the matcher up on the tokens so far; `trigger_token_id` is set when the trigger is one
    token of the vocabulary (the grammar then wants that token, not the trigger spelled out in pieces; a
    special token's text does not show when the decoder skips special tokens). Without a trigger the grammar
    constrains from the first token.
    """

    lark: str
    trigger: str | None = None
    trigger_token_id: int | None = None


class CallEvents:
    """The events of one output's content, calls (numbered in the order they open) and, for a format whose
    parser reads reasoning too (harmony's), its reasoning."""

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        self._new_call_id = new_call_id
        self._events: list[StreamEvent] = []
        self._calls = 0
        self._open: int | None = None
        self._arguments: list[str] = []

    @property
    def is_open(self) -> bool:
        """True between a call's start and its end."""
        return self._open is not None

    def content(self, text: str) -> None:
        """Answer text."""
        self._events.append(ContentDelta(text))

    def reasoning(self, text: str) -> None:
        """Reasoning text."""
        self._events.append(ReasoningDelta(text))

    def open(self, name: str) -> None:
        """A call of function `name` starts (the previous one must have ended)."""
        assert self._open is None, "a call opens only after the previous one closed"
        self._open, self._calls = self._calls, self._calls + 1
        self._events.append(ToolCallStart(self._open, self._new_call_id(), name))

    def arguments(self, text: str) -> None:
        """The open call's next piece of argument JSON."""
        self._arguments.append(text)
        self._events.append(ToolCallArgumentsDelta(self._open, text))

    def close(self, whole: bool = True) -> None:
        """The open call ends: complete as the format writes it (`whole`), or cut short or broken off."""
        self._events.append(ToolCallEnd(self._open, "".join(self._arguments), whole))
        self._open, self._arguments = None, []

    def take(self) -> list[StreamEvent]:
        """The events since the last take, neighbours of one kind joined."""
        events, self._events = coalesce(self._events), []
        return events


class ToolCallParser(ABC):
    """Turns the text of one answer (the output after any reasoning), fed in deltas, into content and calls.

    Text that may still become a marker is held back until it cannot; `finish` releases what is held when the
    output ends: held text that never became a marker is content, a call cut short ends with the arguments it
    has (not `whole`), and a call cut before its name is known is content as the model wrote it.
    """

    def __init__(self, events: CallEvents) -> None:
        self.events = events
        self.buffer = ""
        self.space_before_marker = ""  # whitespace dropped before the last marker, given back if it is no call

    def feed(self, text: str) -> list[StreamEvent]:
        """The events that `text`, the next delta, completes."""
        self.buffer += text
        self.advance(final=False)
        return self.events.take()

    def finish(self) -> list[StreamEvent]:
        """The last events, when the output has ended."""
        self.advance(final=True)
        if self.events.is_open:
            self.events.close(whole=False)
        return self.events.take()

    @abstractmethod
    def advance(self, final: bool) -> None:
        """Consume `buffer` as far as it can be read now (to its end when `final`)."""

    def content_until(self, markers: Sequence[str], final: bool) -> str | None:
        """Pass the buffer's text on as content up to the first of `markers`, consume the marker and return it;
        or, with no marker in it, pass on all that cannot start one and return None.

        Whitespace right before a marker is dropped (it separates content from a call; kept in
        `space_before_marker`), so trailing whitespace is held until what follows it is known.
        """
        split = split_at_marker(self.buffer, markers)
        if split.marker is not None:
            before = self.buffer[:split.safe_end]
            kept = before.rstrip()
            self.events.content(kept)
            self.space_before_marker = before[len(kept):]
            self.buffer = self.buffer[split.safe_end + len(split.marker):]
            return split.marker
        end = len(self.buffer) if final else len(self.buffer[:split.safe_end].rstrip())
        self.events.content(self.buffer[:end])
        self.buffer = self.buffer[end:]
        return None


class PlainTextParser(ToolCallParser):
    """No tools: every piece of text is content."""

    def advance(self, final: bool) -> None:
        self.events.content(self.buffer)
        self.buffer = ""


@dataclass(frozen=True)
class MarkerTokens:
    """The vocabulary's added tokens, by text, as the formats' markers need them: `ids` of every added token
    (a marker that is one is one token, which grammars name by id: llguidance matches added tokens only by
    id, never as text), and which of them are `special` (a decoder skipping special tokens drops their text)."""

    ids: Mapping[str, int]
    special: frozenset[str]

    @classmethod
    def of(cls, added_tokens: Mapping[str, tuple[int, bool]]) -> MarkerTokens:
        """From `Tokenizer.added_tokens`."""
        return cls({text: token_id for text, (token_id, _) in added_tokens.items()},
                   frozenset(text for text, (_, special) in added_tokens.items() if special))


NO_MARKER_TOKENS = MarkerTokens({}, frozenset())


class ToolFormat(ABC):
    """One family's tool-call format, bound to a vocabulary's added tokens (`tokens`)."""

    name: ClassVar[str]  # stable: shown by /v1/models
    markers: ClassVar[tuple[str, ...]]  # the texts the parser reacts to

    def __init__(self, tokens: MarkerTokens = NO_MARKER_TOKENS) -> None:
        self.tokens = tokens

    def template_inputs(self, messages: Sequence[Mapping[str, Any]],
                        use: ToolUse | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The messages and tools to render the template with (`use` None: no tools offered)."""
        tools = [tool.template_tool() for tool in use.shown_tools] if use is not None else None
        return template_messages(messages), tools

    def new_call_id(self) -> str:
        """A new id for a call the model makes."""
        return random_call_id()

    @abstractmethod
    def grammar(self, use: ToolUse) -> CallGrammar:
        """The grammar of an answer under `use` (its tools are not empty)."""

    @abstractmethod
    def parser(self, use: ToolUse) -> ToolCallParser:
        """A fresh stream parser for one sequence's answer."""
