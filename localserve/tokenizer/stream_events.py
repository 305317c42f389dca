"""What a model's output turns into as it streams: content, reasoning and tool calls, as typed events.

A chat stream parser (`chat_format.ChatStreamParser`) is fed the text deltas of one sequence and returns these
events in order. A call's events come as one `ToolCallStart` (its index in the output, its id and the
function's name, once), its arguments' JSON text in `ToolCallArgumentsDelta` pieces, then one `ToolCallEnd`
whose `arguments` is the pieces joined; indexes count 0, 1, 2, ... in the order the calls open, and a call
closes before the next one opens. A call the output ends inside (cut by the token limit, a stop string or a
cancel), or whose text broke off, ends with `whole` False: its arguments are what it had.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["ContentDelta", "ReasoningDelta", "StreamEvent", "ToolCallArgumentsDelta", "ToolCallEnd",
           "ToolCallStart", "coalesce"]


@dataclass(frozen=True, slots=True)
class ContentDelta:
    """Answer text (OpenAI's `content`)."""

    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning text (OpenAI's `reasoning_content`), the inside of a `<think>` block without its markers."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A call opens: `index` counts the calls of this output from 0; `id` is new (the format's own shape)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    """The next piece of a call's arguments, JSON text (OpenAI's `function.arguments`, streamed)."""

    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    """A call ends; `arguments` is all its pieces joined. `whole`: the format's call ended as it is written (its
    arguments then valid JSON); False for a call cut short or broken off, whose arguments are what it had."""

    index: int
    arguments: str
    whole: bool = True


StreamEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


def coalesce(events: Iterable[StreamEvent]) -> list[StreamEvent]:
    """`events` with neighbours of the same text kind (and call) joined and empty texts left out."""
    joined: list[StreamEvent] = []
    for event in events:
        if isinstance(event, (ContentDelta, ReasoningDelta, ToolCallArgumentsDelta)):
            if not event.text:
                continue
            last = joined[-1] if joined else None
            if type(last) is type(event) and getattr(last, "index", None) == getattr(event, "index", None):
                joined[-1] = _with_text(event, last.text + event.text)
                continue
        joined.append(event)
    return joined


def _with_text(event: ContentDelta | ReasoningDelta | ToolCallArgumentsDelta,
               text: str) -> ContentDelta | ReasoningDelta | ToolCallArgumentsDelta:
    if isinstance(event, ToolCallArgumentsDelta):
        return ToolCallArgumentsDelta(event.index, text)
    return type(event)(text)
