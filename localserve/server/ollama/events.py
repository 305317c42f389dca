"""Ollama's answers to `/api/chat` and `/api/generate`, built from a `GenerationStream` (no I/O here).

Streamed, they are newline-delimited JSON objects: one per engine step with what it added (`message.content`
and `message.thinking` for chat, `response` and `thinking` for generate, and each tool call whole once its
arguments are complete, as Ollama sends them) and `done: false`, then a last one with `done: true`,
`done_reason` (`stop` or `length`) and the counts and durations (nanoseconds) Ollama reports; whole, the same
last object holding the whole answer. A tool call's `arguments` is an object, as Ollama writes it. A response
that fails or is cut by a shutdown ends its stream with `{"error": ...}`, as Ollama's do.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from localserve.server.generation.sample_output import SampleOutput, ToolCall
from localserve.server.generation.stream import GenerationStream
from localserve.server.wire.api_errors import ollama_error_body
from localserve.server.wire.http_exchange import NDJSON, ndjson
from localserve.tokenizer.stream_events import ContentDelta, ReasoningDelta, ToolCallEnd

NANOSECONDS = 1_000_000_000


def wire_time(seconds: float) -> str:
    """A time (seconds since the epoch) as Ollama writes its timestamps (RFC 3339, UTC)."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def created_at() -> str:
    """Now, as Ollama writes its timestamps."""
    return wire_time(time.time())


def load_answer(model: str, chat: bool, done_reason: str = "load") -> dict[str, Any]:
    """The answer to a request with nothing to say: Ollama's way of loading a model (it is loaded), or with
    `keep_alive` 0 of unloading it (`done_reason` "unload")."""
    text = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": model, "created_at": created_at(), **text, "done": True, "done_reason": done_reason}


def ollama_call(call: ToolCall) -> dict[str, Any]:
    """A call as Ollama writes it: the function's name and its arguments as an object."""
    return {"function": {"name": call.name, "arguments": call.input}}


class OllamaView:
    """The `/api/chat` (`chat=True`) or `/api/generate` answer of one response (an `HttpView`)."""

    stream_type = NDJSON

    def __init__(self, stream: GenerationStream, chat: bool) -> None:
        self.stream, self.chat = stream, chat

    def pieces(self, done: bool) -> bytes:
        lines = []
        if self.stream.samples:
            sample = self.stream.samples[0]
            events, _ = sample.take_pending()
            content = "".join(event.text for event in events if isinstance(event, ContentDelta))
            thinking = "".join(event.text for event in events if isinstance(event, ReasoningDelta))
            calls = [sample.calls[event.index] for event in events if isinstance(event, ToolCallEnd)]
            if content or thinking or calls:
                lines.append(ndjson(self._object(content, thinking, calls, done=False)))
        if done:
            lines.append(ndjson(self._final("", "", []) if self.stream.ended_normally else
                                ollama_error_body(self.stream.ending_error())))
        return b"".join(lines)

    def whole(self) -> dict[str, Any]:
        if not self.stream.ended_normally:
            raise self.stream.ending_error()
        sample = self.stream.samples[0] if self.stream.samples else SampleOutput()
        return self._final(sample.content, sample.reasoning, sample.calls)

    def _object(self, content: str, thinking: str, calls: list[ToolCall], done: bool) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [ollama_call(call) for call in calls]
            body: dict[str, Any] = {"message": message}
        else:
            body = {"response": content, **({"thinking": thinking} if thinking else {})}
        return {"model": self.stream.model, "created_at": created_at(), **body, "done": done}

    def _final(self, content: str, thinking: str, calls: list[ToolCall]) -> dict[str, Any]:
        stream = self.stream
        finished = stream.finished_at or stream.started_at
        first = stream.first_token_at or finished
        reason = stream.samples[0].finish_reason if stream.samples else "stop"
        return {**self._object(content, thinking, calls, done=True),
                "done_reason": "length" if reason == "length" else "stop",
                "total_duration": _ns(finished - stream.started_at), "load_duration": 0,
                "prompt_eval_count": stream.num_prompt_tokens,
                "prompt_eval_duration": _ns(first - stream.started_at),
                "eval_count": sum(sample.num_output_tokens for sample in stream.samples),
                "eval_duration": _ns(finished - first)}


def _ns(seconds: float) -> int:
    return int(seconds * NANOSECONDS)
