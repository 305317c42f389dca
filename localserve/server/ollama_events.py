"""Ollama's answers to `/api/chat` and `/api/generate`, built from a `ResponseStream` (no I/O here).

Streamed, they are newline-delimited JSON objects: one per engine step with the text it added
(`message.content` for chat, `response` for generate) and `done: false`, then a last one with
`done: true`, `done_reason` (`stop` or `length`) and the counts and durations (nanoseconds) Ollama
reports; whole, the same last object holding the whole text. A response that fails or is cut by a
shutdown ends its stream with `{"error": ...}`, as Ollama's do.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from localserve.server.api_errors import ollama_error_body
from localserve.server.http_exchange import NDJSON, ndjson
from localserve.server.response_events import ResponseStream

NANOSECONDS = 1_000_000_000


def created_at() -> str:
    """Now, as Ollama writes its timestamps (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def load_answer(model: str, chat: bool) -> dict[str, Any]:
    """The answer to a request with nothing to say: Ollama's way of loading a model (it is loaded)."""
    text = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": model, "created_at": created_at(), **text, "done": True, "done_reason": "load"}


class OllamaView:
    """The `/api/chat` (`chat=True`) or `/api/generate` answer of one response (an `HttpView`)."""

    stream_type = NDJSON

    def __init__(self, stream: ResponseStream, chat: bool) -> None:
        self.stream, self.chat = stream, chat

    def pieces(self, done: bool) -> bytes:
        stream = self.stream
        lines = []
        text = stream.pending_texts[0] if stream.pending_texts else ""
        if stream.pending_texts:
            stream.pending_texts[0] = ""
        if text:
            lines.append(ndjson(self._object(text, done=False)))
        if done:
            lines.append(ndjson(self._final("") if stream.ended_normally else
                                ollama_error_body(stream.ending_error())))
        return b"".join(lines)

    def whole(self) -> dict[str, Any]:
        if not self.stream.ended_normally:
            raise self.stream.ending_error()
        return self._final(self.stream.texts[0] if self.stream.texts else "")

    def _object(self, text: str, done: bool) -> dict[str, Any]:
        body = {"message": {"role": "assistant", "content": text}} if self.chat else {"response": text}
        return {"model": self.stream.model, "created_at": created_at(), **body, "done": done}

    def _final(self, text: str) -> dict[str, Any]:
        stream = self.stream
        finished = stream.finished_at or stream.started_at
        first = stream.first_token_at or finished
        reason = stream.finish_reasons[0] if stream.finish_reasons else "stop"
        return {**self._object(text, done=True), "done_reason": "length" if reason == "length" else "stop",
                "total_duration": _ns(finished - stream.started_at), "load_duration": 0,
                "prompt_eval_count": stream.num_prompt_tokens,
                "prompt_eval_duration": _ns(first - stream.started_at),
                "eval_count": sum(stream.num_output_tokens), "eval_duration": _ns(finished - first)}


def _ns(seconds: float) -> int:
    return int(seconds * NANOSECONDS)
