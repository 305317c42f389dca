"""What a request's tools, tool choice, answer format and reasoning make of one turn of the served model's
chat format (no I/O here): the template's inputs, the engine's grammar and decoding flags, the stream parser.

`model_chat_format` (server/registry/served_model.py) detects the format once, when a model loads. `plan_turn`
resolves one request against it: the `ChatTurn` (tools offered unless tool_choice is `none`, thinking off for
`reasoning_effort: "none"`, the effort as the template's level where it takes one), the grammar (the calls'
grammar when tools are offered, which under tool_choice `auto` lets the answer be a value of the answer format's
schema instead of calls; else the answer format's JSON schema), and what the engine is told (`grammar`,
`reasoning_end`, `skip_special_tokens`, the turn's `stop_token_ids`). Every refusal names the request's field
as its format spells it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localserve.engine.grammar import GrammarSpec
from localserve.server.request.generation_request import UNFINISHED_CALL_IDS, GenerationRequest, Message
from localserve.server.request.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatFormat, ChatStreamParser, ChatTurn
from localserve.tokenizer.tools import ChatFormatError


@dataclass(frozen=True)
class TurnPlan:
    """One request's turn: how to render it, what the engine is told, how to read the output."""

    turn: ChatTurn | None  # None: the model has no chat format (plain text, no tools)
    grammar: GrammarSpec | None
    grammar_field: str | None  # the field the grammar comes from (an engine error about it names that field)
    reasoning_end: str | None
    skip_special_tokens: bool

    @property
    def parses(self) -> bool:
        """True when the output needs the format's parser (tools offered, or the model reasons)."""
        return self.turn is not None and (self.turn.tools_offered or self.turn.reasons)

    def parser(self) -> ChatStreamParser:
        return self.turn.stream_parser()

    def engine_fields(self) -> dict[str, Any]:
        """SamplingParams' fields of this turn."""
        stops = list(self.turn.stop_token_ids) if self.turn is not None else []
        return {"grammar": self.grammar, "reasoning_end": self.reasoning_end,
                "skip_special_tokens": self.skip_special_tokens, **({"stop_token_ids": stops} if stops else {})}


def plan_turn(request: GenerationRequest, chat_format: ChatFormat | None) -> TurnPlan:
    """The turn of `request` (a chat request: messages, not a prompt); ProtocolError naming the field."""
    output_format = request.output_format
    grammar = output_format.grammar() if output_format is not None else None
    grammar_field = request.wire_names.get("output_format") if grammar is not None else None
    offers_tools = bool(request.tools) and request.tool_choice.mode != "none"
    if chat_format is None:
        if offers_tools:
            raise ProtocolError("unsupported_value", "the served model has no chat template, so it cannot be "
                                "offered tools", request.wire_name("tools"))
        return TurnPlan(None, grammar, grammar_field, None, True)
    try:
        turn = chat_format.turn(request.tools, request.tool_choice, request.parallel_tool_calls,
                                thinking=request.reasoning.thinking, effort=request.reasoning.effort,
                                answer=output_format.embedded_schema() if output_format is not None else None)
    except ChatFormatError as error:
        param = request.wire_name("reasoning") if error.field == "reasoning_effort" else request.wire_name("tools")
        raise ProtocolError("invalid_value", f"'{param}': {error.reason}", param) from None
    if turn.grammar is not None:  # the calls' grammar covers the whole answer (with the answer format's, if any)
        grammar, grammar_field = GrammarSpec.lark(turn.grammar.lark), request.wire_name("tools")
    reasoning_end = turn.reasoning_end.text if turn.reasoning_end is not None else None
    return TurnPlan(turn, grammar, grammar_field, reasoning_end, turn.skip_special_tokens)


def resolve_tool_results(conversation: Sequence[Message], param: str) -> None:
    """Each tool result must answer a call made earlier in the conversation (as OpenAI requires); one that names
    the function instead of the call (`tool_call_id` None) is given the earliest unanswered call of it."""
    called: set[str] = set()
    unanswered: list[tuple[str, str | None]] = []  # (call id, function name), oldest first
    for message in conversation:
        for call in message.get("tool_calls") or ():
            called.add(call["id"])
            unanswered.append((call["id"], call["function"]["name"]))
        for call_id in message.get(UNFINISHED_CALL_IDS) or ():  # the model's own text now, still answerable
            called.add(call_id)
            unanswered.append((call_id, None))
        if message["role"] != "tool":
            continue
        if message["tool_call_id"] is None:
            match = next((call_id for call_id, name in unanswered if name == message["name"]), None)
            if match is None:
                raise ProtocolError("invalid_value", f"'{param}': the tool result of {message['name']!r} answers "
                                    "no unanswered call of that function in an earlier assistant turn", param)
            message["tool_call_id"] = match
        if message["tool_call_id"] not in called:
            raise ProtocolError("invalid_value", f"'{param}': the tool result for call "
                                f"{message['tool_call_id']!r} answers no tool call of an earlier assistant turn",
                                param)
        unanswered = [pair for pair in unanswered if pair[0] != message["tool_call_id"]]
