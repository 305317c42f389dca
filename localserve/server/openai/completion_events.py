"""Chat completion and text completion objects and stream chunks, read from a `GenerationStream` (no I/O).

The engine's outputs are absorbed by the API-neutral `GenerationStream` (server/generation/stream.py);
`CompletionView` reads it in the shapes of OpenAI's `/v1/chat/completions`
(`chat.completion`, `chat.completion.chunk`) and `/v1/completions` (`text_completion`). A stream's
chunks are coalesced like the websocket mode's deltas: one per choice with all text absorbed since the
last drain, and, for a chat turn the format parses, one per reasoning piece (`delta.reasoning_content`,
and `delta.reasoning` as vLLM names it) and per call event (`delta.tool_calls`: the call's `index`, `id`,
`type` and `function.name` once, then `function.arguments` in pieces). A choice that called a tool ends with
`finish_reason: "tool_calls"`.
"""

from __future__ import annotations

from typing import Any

from localserve.server.generation.sample_output import SampleOutput, TokenLogprob
from localserve.server.generation.stream import GenerationStream
from localserve.server.openai.logprobs import logprob_entries
from localserve.server.wire.http_exchange import EVENT_STREAM, error_body, sse
from localserve.tokenizer.stream_events import ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStart

# The engine's reasons, as OpenAI's endpoints name them (the engine says "stop" for EOS and stop strings).
FINISH_REASONS = {"stop": "stop", "length": "length"}


class CompletionView:
    """One chat completion (`chat=True`) or text completion over a GenerationStream (an `HttpView`)."""

    stream_type = EVENT_STREAM

    def __init__(self, stream: GenerationStream, chat: bool, include_usage: bool = False) -> None:
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
        choices = []
        for index, sample in enumerate(self.stream.samples):
            logprobs = self._logprobs(sample.all_logprobs, 0)
            if self.chat:
                choices.append({"index": index, "message": self._message(sample), "logprobs": logprobs,
                                "finish_reason": self._finish_reason(index)})
            else:
                choices.append({"index": index, "text": sample.content, "logprobs": logprobs,
                                "finish_reason": self._finish_reason(index)})
        return {**self._head(self.object), "choices": choices, "usage": self.usage()}

    def _message(self, sample: SampleOutput) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": sample.content, "refusal": None}
        if sample.calls:
            # as OpenAI answers a turn of calls alone (whitespace around calls is no answer)
            message["content"] = sample.content if sample.content.strip() else None
            message["tool_calls"] = [call.message_call() for call in sample.calls]
        if sample.reasoning:
            message["reasoning_content"] = message["reasoning"] = sample.reasoning
        return message

    def usage(self) -> dict[str, Any]:
        """Token counts with the prompt tokens served from the prefix cache."""
        stream = self.stream
        completion_tokens = stream.num_output_tokens
        return {"prompt_tokens": stream.num_prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": stream.num_prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": stream.num_cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": stream.num_reasoning_tokens}}

    # ------------------------------------------------------------------ streaming
    def chunks(self) -> list[dict[str, Any]]:
        """The chunks not sent yet: each choice's opening (chat), new text, its finish; then the usage."""
        stream = self.stream
        chunks = []
        if not self._started and self.chat:
            chunks += [self._chunk(index, {"role": "assistant", "content": ""}) for index in range(len(stream.samples))]
        self._started = True
        for index, sample in enumerate(stream.samples):
            chunks += self._sample_chunks(index, sample)
            if index not in self._finished and sample.finish_reason in FINISH_REASONS and self.ended_normally:
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

    def _sample_chunks(self, index: int, sample: SampleOutput) -> list[dict[str, Any]]:
        """The chunks of the sample's events not sent yet: its text joined between other events."""
        events, entries = sample.take_pending()
        chunks: list[dict[str, Any]] = []
        text = ""
        sent = len(sample.content) - sum(len(event.text) for event in events if isinstance(event, ContentDelta))

        def flush() -> None:
            nonlocal text, entries, sent
            if text or entries:
                chunks.append(self._chunk(index, {"content": text} if self.chat else text,
                                          logprobs=self._logprobs(entries, sent)))
                sent += len(text)
                text, entries = "", []

        for event in events:
            if isinstance(event, ContentDelta):
                text += event.text
                continue
            flush()
            if isinstance(event, ReasoningDelta):
                chunks.append(self._chunk(index, {"reasoning_content": event.text, "reasoning": event.text}))
            elif isinstance(event, ToolCallStart):
                chunks.append(self._chunk(index, {"tool_calls": [{
                    "index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}]}))
            elif isinstance(event, ToolCallArgumentsDelta):
                chunks.append(self._chunk(index, {"tool_calls": [{"index": event.index,
                                                                  "function": {"arguments": event.text}}]}))
        flush()
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
        sample = self.stream.samples[index]
        if self.chat and sample.ended_calling_tools:
            return "tool_calls"
        return FINISH_REASONS.get(sample.finish_reason or "", "length")

    def _logprobs(self, entries: list[TokenLogprob], text_offset: int) -> dict[str, Any] | None:
        """The sample's log-probabilities in the endpoint's shape."""
        if self.stream.params.logprobs is None:
            return None
        if self.chat:
            return {"content": logprob_entries(entries), "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(text_offset)
            text_offset += len(entry.token)
        return {"tokens": [entry.token for entry in entries],
                "token_logprobs": [entry.logprob for entry in entries],
                "top_logprobs": [dict(entry.top) for entry in entries],
                "text_offset": offsets}
