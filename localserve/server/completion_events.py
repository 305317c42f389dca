"""Chat completion and text completion objects and stream chunks, built from a `ResponseStream` (no I/O).

The engine's outputs are absorbed by the transport-free `ResponseStream` (server/response_events.py);
`CompletionView` reads the same state in the shapes of OpenAI's `/v1/chat/completions`
(`chat.completion`, `chat.completion.chunk`) and `/v1/completions` (`text_completion`). A stream's
chunks are coalesced like the websocket mode's deltas: one per choice with all text absorbed since the
last drain.
"""

from __future__ import annotations

from typing import Any

from localserve.server.http_exchange import EVENT_STREAM, error_body, sse
from localserve.server.response_events import ResponseStream

# The engine's reasons, as OpenAI's endpoints name them (the engine says "stop" for EOS and stop strings).
FINISH_REASONS = {"stop": "stop", "length": "length"}


class CompletionView:
    """One chat completion (`chat=True`) or text completion over a ResponseStream (an `HttpView`)."""

    stream_type = EVENT_STREAM

    def __init__(self, stream: ResponseStream, chat: bool, include_usage: bool = False) -> None:
        self.stream, self.chat, self.include_usage = stream, chat, include_usage
        hex_id = stream.response_id.removeprefix("resp_")
        self.id = f"chatcmpl-{hex_id}" if chat else f"cmpl-{hex_id}"
        self.object = "chat.completion" if chat else "text_completion"
        self._started = False
        self._finished: set[int] = set()  # choices whose finish_reason was sent
        self._usage_sent = False

    @property
    def ended_normally(self) -> bool:
        """The engine finished every choice (a stop or the token limit): not failed, cancelled or shut down."""
        return self.stream.ended_normally

    # ------------------------------------------------------------------ over HTTP
    def whole(self) -> dict[str, Any]:
        """The completion; a ProtocolError when the response did not end normally."""
        if not self.ended_normally:
            raise self.stream.ending_error()
        return self.completion()

    def pieces(self, done: bool) -> bytes:
        """The chunks not sent yet as server-sent events; once `done`, an error if it did not end normally,
        then `[DONE]`."""
        pieces = [sse(chunk) for chunk in self.chunks()]
        if done:
            if not self.ended_normally:
                pieces.append(sse(error_body(self.stream.ending_error())))
            pieces.append(sse("[DONE]"))
        return b"".join(pieces)

    # ------------------------------------------------------------------ the whole answer
    def completion(self) -> dict[str, Any]:
        """The non-streamed answer, once the stream is done."""
        stream = self.stream
        choices = []
        for index, text in enumerate(stream.texts):
            logprobs = self._logprobs(stream.all_logprobs[index], 0)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                                "logprobs": logprobs, "finish_reason": self._finish_reason(index)})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": self._finish_reason(index)})
        return {**self._head(self.object), "choices": choices, "usage": self.usage()}

    def usage(self) -> dict[str, Any]:
        """Token counts with the prompt tokens served from the prefix cache."""
        stream = self.stream
        completion_tokens = sum(stream.num_output_tokens)
        return {"prompt_tokens": stream.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": stream.num_prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stream.num_cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": 0}}

    # ------------------------------------------------------------------ streaming
    def chunks(self) -> list[dict[str, Any]]:
        """The chunks not sent yet: each choice's opening (chat), new text, its finish; then the usage."""
        stream = self.stream
        chunks = []
        if not self._started and self.chat:
            chunks += [self._chunk(index, {"role": "assistant", "content": ""}) for index in range(len(stream.texts))]
        self._started = True
        for index in range(len(stream.texts)):
            text, entries = stream.pending_texts[index], stream.pending_logprobs[index]
            if text or entries:
                offset = len(stream.texts[index]) - len(text)
                stream.pending_texts[index], stream.pending_logprobs[index] = "", []
                chunks.append(self._chunk(index, {"content": text} if self.chat else text,
                                          logprobs=self._logprobs(entries, offset)))
            if index not in self._finished and stream.finish_reasons[index] in FINISH_REASONS and self.ended_normally:
                self._finished.add(index)
                chunks.append(self._chunk(index, {} if self.chat else "", finish_reason=self._finish_reason(index)))
        if self.include_usage:
            for chunk in chunks:
                chunk["usage"] = None
            if self.ended_normally and not self._usage_sent:
                self._usage_sent = True
                chunks.append({**self._head(f"{self.object}.chunk" if self.chat else self.object), "choices": [],
                               "usage": self.usage()})
        return chunks

    # ------------------------------------------------------------------ pieces
    def _head(self, kind: str) -> dict[str, Any]:
        head = {"id": self.id, "object": kind, "created": self.stream.created_at, "model": self.stream.model}
        if self.chat:
            head["system_fingerprint"] = None
        return head

    def _chunk(self, index: int, delta: dict[str, Any] | str, logprobs: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def _finish_reason(self, index: int) -> str:
        return FINISH_REASONS.get(self.stream.finish_reasons[index] or "", "length")

    def _logprobs(self, entries: list[dict[str, Any]], text_offset: int) -> dict[str, Any] | None:
        """Entries of the ResponseStream ({token, bytes, logprob, top_logprobs}) in the endpoint's shape."""
        if self.stream.params.logprobs is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(text_offset)
            text_offset += len(entry["token"])
        return {"tokens": [entry["token"] for entry in entries],
                "token_logprobs": [entry["logprob"] for entry in entries],
                "top_logprobs": [{top["token"]: top["logprob"] for top in entry["top_logprobs"]} for entry in entries],
                "text_offset": offsets}
