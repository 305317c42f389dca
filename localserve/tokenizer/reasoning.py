"""Reasoning formats: a model's thinking between `<think>` and `</think>`, split from its answer as it streams.

Qwen3 writes the block itself at the start of its output (`<think>\\n...\\n</think>\\n\\n` then the answer);
QwQ's and DeepSeek-R1's templates open it in the prompt, so their output starts inside it. Where the template
reads a switch variable (Qwen3's `enable_thinking`), thinking can be turned off; the prompt then holds an empty
block and the output is all answer. The end marker, as text and token ids, is where a grammar of the answer
begins: constrained decoding starts after it, never inside the reasoning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from localserve.tokenizer.held_text import is_prefix_of_any, split_at_marker
from localserve.tokenizer.stream_events import ContentDelta, ReasoningDelta

__all__ = ["ChannelThoughtFormat", "Marker", "ReasoningSplitter", "ThinkFormat"]


@dataclass(frozen=True)
class Marker:
    """A marker as text and as the token ids the vocabulary encodes it to."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ThinkFormat:
    """`<think>...</think>` reasoning, as one template and vocabulary have it.

    `switch` is the template variable that turns thinking on and off (None: the template has none); `opens`
    says, for thinking on and off, whether the rendered prompt ends inside an open block.
    """

    end_token_ids: tuple[int, ...]
    switch: str | None
    opens: Mapping[bool, bool]

    name: ClassVar[str] = "think"  # stable: shown by /v1/models
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    @property
    def can_disable(self) -> bool:
        """True when the template can turn thinking off."""
        return self.switch is not None

    @property
    def end_marker(self) -> Marker:
        """Where the reasoning ends and the answer (and its grammar) begins."""
        return Marker(self.end, self.end_token_ids)

    def opens_in_prompt(self, thinking: bool) -> bool:
        """True when the prompt itself opens the block, so the output starts inside it."""
        return self.opens[thinking]

    def template_variables(self, thinking: bool) -> dict[str, Any]:
        """The template variables that turn thinking on or off (none without a switch)."""
        return {self.switch: thinking} if self.switch else {}

    def splitter(self, opened: bool) -> ReasoningSplitter:
        """A fresh splitter for one output; `opened`: the prompt opened the block."""
        return ReasoningSplitter(self.start, self.end, opened)


@dataclass(frozen=True)
class ChannelThoughtFormat(ThinkFormat):
    """Gemma 4's reasoning: `<|channel>thought` ... `<channel|>` at the start of the output; with thinking
    off (`enable_thinking` false) the prompt holds an empty block."""

    name: ClassVar[str] = "gemma4_thought"
    start: ClassVar[str] = "<|channel>thought"
    end: ClassVar[str] = "<channel|>"


class ReasoningSplitter:
    """Splits one output, fed in deltas, into reasoning and the answer's text.

    A block is recognised only at the very start of the output (after whitespace), or is already open there.
    The whitespace just inside the block and just after it is dropped; text that may still become a marker
    is held until it cannot. Without an end, all that follows the start is reasoning.
    """

    def __init__(self, start: str, end: str, opened: bool) -> None:
        self._start, self._end = start, end
        self._state = "inside" if opened else "before"
        self._strip = True  # drop the whitespace that begins the current part
        self._buffer = ""

    def feed(self, text: str) -> list[ReasoningDelta | ContentDelta]:
        """Reasoning and answer text that the delta `text` completes."""
        self._buffer += text
        return [piece for piece in self._advance(final=False) if piece.text]

    def finish(self) -> list[ReasoningDelta | ContentDelta]:
        """What is left when the output has ended."""
        return [piece for piece in self._advance(final=True) if piece.text]

    def _advance(self, final: bool) -> list[ReasoningDelta | ContentDelta]:
        out: list[ReasoningDelta | ContentDelta] = []
        if self._strip:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return out
            self._strip = False
        if self._state == "before":
            if self._buffer.startswith(self._start):
                self._buffer, self._state, self._strip = self._buffer[len(self._start):], "inside", True
                return self._advance(final)
            if is_prefix_of_any(self._buffer, [self._start]) and not final:
                return out
            self._state = "answer"
        if self._state == "inside":
            split = split_at_marker(self._buffer, [self._end])
            if split.marker is not None:
                out.append(ReasoningDelta(self._buffer[:split.safe_end].rstrip()))
                self._buffer = self._buffer[split.safe_end + len(self._end):]
                self._state, self._strip = "answer", True
                return out + self._advance(final)
            end = len(self._buffer) if final else len(self._buffer[:split.safe_end].rstrip())
            out.append(ReasoningDelta(self._buffer[:end]))
            self._buffer = self._buffer[end:]
            return out
        out.append(ContentDelta(self._buffer))
        self._buffer = ""
        return out
