"""What every chat format gives the server: one request's turn (the template's inputs, the grammar of its
answer, how to decode and stop, a stream parser), whatever family the format is.

Two kinds of format implement it: the tagged families (tokenizer/chat_format.py: a tool-call format and
`<think>` reasoning written as markup in the model's text) and gpt-oss's harmony (tokenizer/harmony.py:
messages on channels, delimited by special tokens). The server sees only these interfaces.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from localserve.tokenizer.reasoning import Marker
from localserve.tokenizer.stream_events import StreamEvent
from localserve.tokenizer.tool_formats.base import CallGrammar
from localserve.tokenizer.tools import AUTO, ChatFormatError, ToolChoice, ToolSpec

__all__ = ["ChatFormat", "ChatInputs", "ChatStreamParser", "ChatTurn", "Named", "ReasoningDescription",
           "check_tool_names"]


@dataclass(frozen=True)
class ChatInputs:
    """What a chat template is rendered with: `tokenizer.encode_chat(messages, tools=tools, **variables)`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    variables: dict[str, Any]


class Named(Protocol):
    """A part of a format that `/v1/models` names."""

    name: str


class ReasoningDescription(Named, Protocol):
    """A format's reasoning as `/v1/models` shows it: its name and whether a request can turn it off."""

    @property
    def can_disable(self) -> bool: ...


class ChatStreamParser(ABC):
    """One output's text deltas in (decoded as `ChatTurn.skip_special_tokens` says), its events out."""

    @abstractmethod
    def feed(self, text: str) -> list[StreamEvent]:
        """The events that `text`, the next delta of decoded text, completes."""

    @abstractmethod
    def finish(self) -> list[StreamEvent]:
        """The last events, once the output has ended (held text released, an open call closed)."""


class ChatTurn(ABC):
    """What one request needs of the chat format: the template's inputs, the grammar of its answer, where the
    reasoning ends, how to decode, when to stop and how to parse its output."""

    @property
    @abstractmethod
    def tools_offered(self) -> bool:
        """True when the prompt offers tools (not with tool_choice `none`)."""

    @property
    @abstractmethod
    def reasons(self) -> bool:
        """True when the output may hold reasoning."""

    @abstractmethod
    def chat_inputs(self, messages: Sequence[Mapping[str, Any]]) -> ChatInputs:
        """The template's inputs for `messages` (in the APIs' shape: call arguments as JSON text)."""

    @property
    @abstractmethod
    def grammar(self) -> CallGrammar | None:
        """The grammar of the answer's calls, or None when no tools are offered."""

    @property
    def reasoning_end(self) -> Marker | None:
        """Where any grammar of the answer starts (after the reasoning), or None: from the first token."""
        return None

    @property
    @abstractmethod
    def skip_special_tokens(self) -> bool:
        """How to decode the output for the parser: False when a marker it reacts to is a special token."""

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Tokens that end the turn beside the model's end-of-sequence ones (the engine's `stop_token_ids`)."""
        return ()

    @abstractmethod
    def stream_parser(self) -> ChatStreamParser:
        """A fresh parser for one sequence of the output."""


class ChatFormat(ABC):
    """A model's chat format, detected once from its template: `tool_format.name` and `reasoning` (its `name`
    and `can_disable`, or None: the template does not reason) describe it; `turn` resolves one request."""

    tool_format: Named
    reasoning: ReasoningDescription | None

    @abstractmethod
    def turn(self, tools: Sequence[ToolSpec] = (), tool_choice: ToolChoice = AUTO,
             parallel_tool_calls: bool = True, thinking: bool = True,
             answer: Mapping[str, Any] | None = None, effort: str | None = None) -> ChatTurn:
        """One request's use of the format: the tools offered, `tool_choice`, whether several calls may come,
        whether the model thinks and how hard (`effort`: the request's reasoning effort, None for the
        template's default; formats without levels read only `thinking`), and the JSON schema an answer must
        follow when it calls nothing (`answer`, with llguidance's `x-guidance` settings). Raises
        ChatFormatError naming the field a request got wrong."""


def check_tool_names(tools: Sequence[ToolSpec]) -> None:
    """ChatFormatError when two of `tools` share a name (a call names its function by name alone)."""
    names = [tool.name for tool in tools]
    if duplicate := next((name for name in names if names.count(name) > 1), None):
        raise ChatFormatError("tools", f"two tools are named {duplicate!r}")
