"""Anthropic's answer to `POST /v1/messages`, built from a `GenerationStream` (no I/O here).

Whole: a `message` object whose content blocks come in the order the model wrote them: `thinking` (a
reasoning model's reasoning, with an empty `signature`: nothing here signs it), `text`, and one `tool_use`
block per call (its `input` the arguments as an object). Streamed: server-sent events, each named by its
`type`: `message_start` (usage with the prompt's tokens), `ping`, then for each block `content_block_start`,
its deltas (`thinking_delta`, `text_delta`, or `input_json_delta` with the arguments' JSON as it comes) and
`content_block_stop`; then `message_delta` (`stop_reason`, `stop_sequence` and the output tokens) and
`message_stop`. A response that fails or is cut by a shutdown ends with an `error` event.

`stop_reason` is `end_turn` for the end-of-sequence token, `tool_use` for a turn that called tools,
`max_tokens` for the token limit and `stop_sequence` for a stop string, named as the engine reports it
(the sample's `StopReason`).
"""

from __future__ import annotations

from typing import Any

from localserve.server.generation.sample_output import SampleOutput, ToolCall
from localserve.server.generation.stream import GenerationStream
from localserve.server.wire.api_errors import anthropic_error_body
from localserve.server.wire.http_exchange import EVENT_STREAM, sse
from localserve.tokenizer.stream_events import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)


def message_id(stream: GenerationStream) -> str:
    return "msg_" + stream.response_id.removeprefix("resp_")


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}


class AnthropicView:
    """The `/v1/messages` answer of one response (an `HttpView`)."""

    stream_type = EVENT_STREAM

    def __init__(self, stream: GenerationStream) -> None:
        self.stream = stream
        self._started = False
        self._blocks: list[str] = []  # the kind of each block opened so far, in order
        self._open = False  # the last block is not stopped yet

    @property
    def sample(self) -> SampleOutput:
        return self.stream.samples[0] if self.stream.samples else SampleOutput()

    # ------------------------------------------------------------------ whole
    def whole(self) -> dict[str, Any]:
        if not self.stream.ended_normally:
            raise self.stream.ending_error()
        sample = self.sample
        content: list[dict[str, Any]] = []
        if sample.reasoning:
            content.append({"type": "thinking", "thinking": sample.reasoning, "signature": ""})
        if sample.content or not sample.calls:
            content.append({"type": "text", "text": sample.content})
        content += [tool_use_block(call) for call in sample.calls]
        reason, stop_sequence = self.stop()
        return {**self._message(content), "stop_reason": reason, "stop_sequence": stop_sequence,
                "usage": self._usage(sample.num_output_tokens)}

    # ------------------------------------------------------------------ streamed
    def pieces(self, done: bool) -> bytes:
        stream = self.stream
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [{"type": "message_start", "message": {**self._message([]), "stop_reason": None,
                                                             "stop_sequence": None, "usage": self._usage(0)}},
                       {"type": "ping"}]
        pending, _ = self.sample.take_pending()
        text = ""  # a text block's new text goes in one delta per call
        for event in pending:
            if isinstance(event, ContentDelta):
                events += self._block("text", {"type": "text", "text": ""})
                text += event.text
                continue
            if text:
                events.append(self._delta({"type": "text_delta", "text": text}))
                text = ""
            if isinstance(event, ReasoningDelta):
                events += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, ToolCallStart):
                events += self._block("tool_use", {"type": "tool_use", "id": event.id, "name": event.name,
                                                   "input": {}}, fresh=True)
            elif isinstance(event, ToolCallArgumentsDelta):
                events.append(self._delta({"type": "input_json_delta", "partial_json": event.text}))
            elif isinstance(event, ToolCallEnd):
                events += self._stop_block()
        if text:
            events.append(self._delta({"type": "text_delta", "text": text}))
        if done and stream.ended_normally:
            if not self._blocks:  # an answer with nothing in it still has its (empty) text block
                events += self._block("text", {"type": "text", "text": ""})
            events += self._stop_block()
            reason, stop_sequence = self.stop()
            events += [{"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": self.sample.num_output_tokens}},
                       {"type": "message_stop"}]
        elif done:
            events.append(anthropic_error_body(stream.ending_error()))
        return b"".join(sse(event, event["type"]) for event in events)

    def _block(self, kind: str, start: dict[str, Any], fresh: bool = False) -> list[dict[str, Any]]:
        """Events that open a `kind` block (none while one is open, unless `fresh`), stopping the open one."""
        if self._open and self._blocks[-1] == kind and not fresh:
            return []
        events = self._stop_block()
        self._blocks.append(kind)
        self._open = True
        return events + [{"type": "content_block_start", "index": len(self._blocks) - 1, "content_block": start}]

    def _stop_block(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self._blocks) - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}

    # ------------------------------------------------------------------ pieces
    def stop(self) -> tuple[str, str | None]:
        """The stop reason and the stop string met (None unless a stop string ended the text)."""
        sample = self.sample
        if sample.finish_reason == "length":
            return "max_tokens", None
        if sample.calls:
            return "tool_use", None
        if sample.stop is not None and sample.stop.kind == "stop_string":
            return "stop_sequence", sample.stop.stop_string
        return "end_turn", None

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": message_id(self.stream), "type": "message", "role": "assistant", "content": content,
                "model": self.stream.model}

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        """Anthropic counts the prompt tokens read from the cache apart from the input tokens."""
        cached = self.stream.num_cached_tokens
        return {"input_tokens": self.stream.num_prompt_tokens - cached, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
