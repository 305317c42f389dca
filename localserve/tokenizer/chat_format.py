"""A model's chat format: its tool-call format and reasoning format, detected from its chat template at load,
and what one request's turn needs of them.

    chat_format = detect_chat_format(tokenizer)          # once, at load; names: chat_format.tool_format.name,
                                                         # chat_format.reasoning.name (or None)
    turn = chat_format.turn(tools, ToolChoice("auto"), parallel_tool_calls=True, thinking=True, effort="high")
    inputs = turn.chat_inputs(messages)                   # the messages, tools and variables for the template
    prompt_ids = tokenizer.encode_chat(inputs.messages, tools=inputs.tools, **inputs.variables)
    turn.grammar, turn.reasoning_end, turn.skip_special_tokens, turn.stop_token_ids  # what the engine is told
    parser = turn.stream_parser()                        # one per sequence: feed(delta) -> events, finish()

Tool formats are told apart by what their templates write (checked in this order): Qwen3-Coder's
`<function=`/`<parameter=`, Mistral's `[TOOL_CALLS]` (with `[ARGS]`: the newer form), Hermes/Qwen's
`<tool_call>`, Llama 3's `<|python_tag|>` or `"parameters": ` beside `<|start_header_id|>`, Gemma 4's
`<|tool_call>` (checked first); a template with none of them gets the generic JSON form. A template that
writes `<think>` or `</think>` reasons (Gemma 4's: `<|channel>thought` ... `<channel|>`); the prompt it
renders, with its switch on and off, says whether the output starts inside the block. A template that writes
harmony's `<|channel|>` and `<|message|>` is gpt-oss's format (tokenizer/harmony.py), a format of its own rather
than a tool-call format beside `<think>` reasoning: those are the "tagged" families of this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localserve.tokenizer.chat_template import ChatTemplateError
from localserve.tokenizer.chat_turn import ChatFormat, ChatInputs, ChatStreamParser, ChatTurn, check_tool_names
from localserve.tokenizer.errors import TokenizerError
from localserve.tokenizer.harmony import HarmonyFormat, is_harmony_template
from localserve.tokenizer.reasoning import ChannelThoughtFormat, Marker, ReasoningSplitter, ThinkFormat
from localserve.tokenizer.stream_events import ContentDelta, ReasoningDelta, StreamEvent, coalesce
from localserve.tokenizer.tokenizer import Tokenizer
from localserve.tokenizer.tool_formats.base import (
    CallEvents,
    CallGrammar,
    MarkerTokens,
    PlainTextParser,
    ToolCallParser,
    ToolFormat,
    ToolUse,
)
from localserve.tokenizer.tool_formats.gemma4 import Gemma4Format
from localserve.tokenizer.tool_formats.generic_json import GenericJsonFormat
from localserve.tokenizer.tool_formats.hermes import HermesFormat
from localserve.tokenizer.tool_formats.llama3_json import Llama3JsonFormat
from localserve.tokenizer.tool_formats.mistral import MistralArgsFormat, MistralArrayFormat
from localserve.tokenizer.tool_formats.qwen3_coder import Qwen3CoderFormat
from localserve.tokenizer.tools import AUTO, ChatFormatError, ToolChoice, ToolSpec

__all__ = ["TOOL_FORMATS", "ChatFormat", "ChatInputs", "ChatStreamParser", "ChatTurn", "TaggedChatFormat",
           "TaggedStreamParser", "TaggedTurn", "detect_chat_format"]

TOOL_FORMATS: dict[str, type[ToolFormat]] = {
    cls.name: cls for cls in (HermesFormat, Qwen3CoderFormat, Llama3JsonFormat, MistralArrayFormat,
                              MistralArgsFormat, Gemma4Format, GenericJsonFormat)}
THINKING_SWITCH = "enable_thinking"
PROBE = [{"role": "user", "content": "Hello"}]


def detect_tool_format(template: str) -> type[ToolFormat]:
    """The tool-call format a chat template writes."""
    if "<|tool_call>" in template:
        return Gemma4Format
    if "<function=" in template and "<parameter=" in template:
        return Qwen3CoderFormat
    if "[TOOL_CALLS]" in template:
        return MistralArgsFormat if "[ARGS]" in template else MistralArrayFormat
    if "<tool_call>" in template:
        return HermesFormat
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters": ' in template):
        return Llama3JsonFormat
    return GenericJsonFormat


def detect_chat_format(tokenizer: Tokenizer, chat_template: str | None = None) -> ChatFormat:
    """The chat format of `tokenizer`'s template (or of `chat_template`, when given); TokenizerError without one."""
    template = chat_template or tokenizer.chat_template
    if not template:
        raise TokenizerError(f"{tokenizer.source}: the tokenizer has no chat template")
    tokens = MarkerTokens.of(tokenizer.added_tokens)
    if is_harmony_template(template):
        return HarmonyFormat(tokens)
    tool_format = detect_tool_format(template)(tokens)
    reasoning = None
    kind = ChannelThoughtFormat if ChannelThoughtFormat.start in template else ThinkFormat
    if kind.start in template or kind.end in template:
        switch = THINKING_SWITCH if THINKING_SWITCH in template else None

        def opens(thinking: bool) -> bool:
            variables = {switch: thinking} if switch else {}
            try:
                prompt = tokenizer.apply_chat_template(PROBE, chat_template=template, **variables)
            except ChatTemplateError:
                return False
            return prompt.rfind(kind.start) > prompt.rfind(kind.end)

        end_ids = tuple(tokenizer.encode(kind.end, add_special_tokens=False))
        reasoning = kind(end_ids, switch, {True: opens(True), False: opens(False)})
    return TaggedChatFormat(tool_format, reasoning)


@dataclass(frozen=True)
class TaggedChatFormat(ChatFormat):
    """A model's tool-call format and reasoning format (None: the template does not reason)."""

    tool_format: ToolFormat
    reasoning: ThinkFormat | None

    def turn(self, tools: Sequence[ToolSpec] = (), tool_choice: ToolChoice = AUTO,
             parallel_tool_calls: bool = True, thinking: bool = True,
             answer: Mapping[str, Any] | None = None, effort: str | None = None) -> TaggedTurn:
        """See `ChatFormat.turn`: `thinking=False` needs a template that can switch it off; `effort` has no
        levels here; under `required` or a named function the answer is the calls, so `answer` is unused."""
        check_tool_names(tools)
        if not thinking and self.reasoning is not None and not self.reasoning.can_disable:
            raise ChatFormatError("reasoning_effort", "this model's chat template cannot turn thinking off")
        callable_tools = tool_choice.chosen_tools(tools)
        use = None
        if callable_tools:
            required = tool_choice.mode in ("required", "function")
            use = ToolUse(callable_tools, required=required, parallel=parallel_tool_calls, offered=tuple(tools),
                          answer=None if required else answer)
        return TaggedTurn(self.tool_format, self.reasoning, use, thinking)


class TaggedTurn(ChatTurn):
    """One request's turn of a tagged family: the tool format's inputs, grammar and parser, after `<think>`."""

    def __init__(self, tool_format: ToolFormat, reasoning: ThinkFormat | None, use: ToolUse | None,
                 thinking: bool) -> None:
        self._tool_format = tool_format
        self._reasoning = reasoning
        self._use = use
        self._thinking = thinking

    @property
    def tools_offered(self) -> bool:
        return self._use is not None

    @property
    def reasons(self) -> bool:
        return self._reasoning is not None and self._thinking

    def chat_inputs(self, messages: Sequence[Mapping[str, Any]]) -> ChatInputs:
        converted, tools = self._tool_format.template_inputs(messages, self._use)
        variables = self._reasoning.template_variables(self._thinking) if self._reasoning else {}
        return ChatInputs(converted, tools, variables)

    @property
    def grammar(self) -> CallGrammar | None:
        return self._tool_format.grammar(self._use) if self._use is not None else None

    @property
    def reasoning_end(self) -> Marker | None:
        return self._reasoning.end_marker if self.reasons else None

    @property
    def skip_special_tokens(self) -> bool:
        markers = [*self._tool_format.markers] if self._use is not None else []
        if self.reasons:
            markers += [self._reasoning.start, self._reasoning.end]
        return not any(marker in self._tool_format.tokens.special for marker in markers)

    def stream_parser(self) -> TaggedStreamParser:
        splitter = self._reasoning.splitter(self._reasoning.opens_in_prompt(True)) if self.reasons else None
        if self._use is None:
            return TaggedStreamParser(splitter, PlainTextParser(CallEvents(self._tool_format.new_call_id)))
        return TaggedStreamParser(splitter, self._tool_format.parser(self._use))


class TaggedStreamParser(ChatStreamParser):
    """One output's text deltas in, its events out: reasoning split off first, then the answer's content and
    calls as the tool format reads them (see `stream_events`)."""

    def __init__(self, splitter: ReasoningSplitter | None, tool_parser: ToolCallParser) -> None:
        self._splitter = splitter
        self._tool_parser = tool_parser

    def feed(self, text: str) -> list[StreamEvent]:
        pieces = self._splitter.feed(text) if self._splitter else [ContentDelta(text)]
        return coalesce(self._route(pieces))

    def finish(self) -> list[StreamEvent]:
        pieces = self._splitter.finish() if self._splitter else []
        return coalesce(self._route(pieces) + self._tool_parser.finish())

    def _route(self, pieces: list[ReasoningDelta | ContentDelta]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for piece in pieces:
            events += [piece] if isinstance(piece, ReasoningDelta) else self._tool_parser.feed(piece.text)
        return events
