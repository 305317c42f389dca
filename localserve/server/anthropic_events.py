"""Anthropic's answer to `POST /v1/messages`, built from a `ResponseStream` (no I/O here).

Whole: a `message` object with one text block. Streamed: server-sent events, each named by its
`type`: `message_start` (usage with the prompt's tokens), `content_block_start`, `ping`, one
`content_block_delta` (`text_delta`) per engine step with new text, `content_block_stop`,
`message_delta` (`stop_reason`, `stop_sequence` and the output tokens) and `message_stop`. A response
that fails or is cut by a shutdown ends with an `error` event.

`stop_reason` is `end_turn` for the end-of-sequence token, `max_tokens` for the token limit and
`stop_sequence` for a stop string, which is named: the engine cuts the text where it begins, so the stop
string is the shortest one that the whole output's text continues with there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from localserve.server.api_errors import anthropic_error_body
from localserve.server.http_exchange import EVENT_STREAM, sse
from localserve.server.response_events import ResponseStream

Decode = Callable[[Sequence[int]], str]


def message_id(stream: ResponseStream) -> str:
    return "msg_" + stream.response_id.removeprefix("resp_")


class AnthropicView:
    """The `/v1/messages` answer of one response (an `HttpView`); `decode` names the stop string met."""

    stream_type = EVENT_STREAM

    def __init__(self, stream: ResponseStream, decode: Decode) -> None:
        self.stream, self.decode = stream, decode
        self._started = False

    # ------------------------------------------------------------------ whole
    def whole(self) -> dict[str, Any]:
        if not self.stream.ended_normally:
            raise self.stream.ending_error()
        reason, stop_sequence = self.stop()
        return {**self._message([{"type": "text", "text": self.stream.texts[0]}]), "stop_reason": reason,
                "stop_sequence": stop_sequence, "usage": self._usage(sum(self.stream.num_output_tokens))}

    # ------------------------------------------------------------------ streamed
    def pieces(self, done: bool) -> bytes:
        stream = self.stream
        events: list[dict[str, Any]] = []
        if not self._started:
            self._started = True
            events += [{"type": "message_start", "message": {**self._message([]), "stop_reason": None,
                                                             "stop_sequence": None, "usage": self._usage(0)}},
                       {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                       {"type": "ping"}]
        if stream.pending_texts and stream.pending_texts[0]:
            events.append({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": stream.pending_texts[0]}})
            stream.pending_texts[0] = ""
        if done and stream.ended_normally:
            reason, stop_sequence = self.stop()
            events += [{"type": "content_block_stop", "index": 0},
                       {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                        "usage": {"output_tokens": sum(stream.num_output_tokens)}},
                       {"type": "message_stop"}]
        elif done:
            events.append(anthropic_error_body(stream.ending_error()))
        return b"".join(sse(event, event["type"]) for event in events)

    # ------------------------------------------------------------------ pieces
    def stop(self) -> tuple[str, str | None]:
        """The stop reason and the stop string met (None unless a stop string ended the text)."""
        stream = self.stream
        if stream.finish_reasons[0] == "length":
            return "max_tokens", None
        token_ids, text = stream.final_token_ids[0], stream.texts[0]
        if stream.params.stop and token_ids:
            whole = self.decode(token_ids)
            met = [stop for stop in stream.params.stop if whole.startswith(stop, len(text))]
            if met:
                return "stop_sequence", min(met, key=len)
        return "end_turn", None

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": message_id(self.stream), "type": "message", "role": "assistant", "content": content,
                "model": self.stream.model}

    def _usage(self, output_tokens: int) -> dict[str, Any]:
        """Anthropic counts the prompt tokens read from the cache apart from the input tokens."""
        cached = self.stream.num_cached_tokens
        return {"input_tokens": self.stream.num_prompt_tokens - cached, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
