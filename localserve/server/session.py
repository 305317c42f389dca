"""One `/v1/responses` websocket connection: its receive loop, its sender task and its response.

The receive loop checks each client event and submits `response.create` to the engine thread. The
engine thread's callback hops onto the event loop (`call_soon_threadsafe`) and only absorbs the
output into the `ResponseStream` and wakes the sender; the sender task alone writes to the socket,
fed by one bounded queue, so a slow client stalls only itself and text piles up as fewer, longer
deltas rather than as a growing queue. A client that goes away aborts its request at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from localserve.engine.outputs import RequestOutput
from localserve.server.context import ServerState
from localserve.server.requests import (
    ProtocolError,
    ResponseRequest,
    error_event,
    parse_client_event,
    parse_response_create,
)
from localserve.server.response_events import ResponseStream, new_id

log = logging.getLogger(__name__)

_WAKE = object()  # queue item: the current stream has events to drain
_STOP = object()  # queue item: the connection is over


class ResponsesSession:
    """Serves one client: at most one response in flight, as in OpenAI's WebSocket mode."""

    def __init__(self, server: ServerState, connection: ServerConnection) -> None:
        self.server = server
        self.connection = connection
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Any] = asyncio.Queue(server.config.send_queue_size)
        self.streams: deque[ResponseStream] = deque()  # streams whose events are not all sent, in order
        self.stream: ResponseStream | None = None  # the latest response of this connection
        self.conversation: list[dict[str, str]] = []  # its messages, stored with the reply when it ends
        self._wake_queued = False
        self._arrival_time = 0.0
        self._last_token_time: float | None = None

    @property
    def in_flight(self) -> bool:
        return self.stream is not None and not self.stream.is_done

    async def run(self) -> None:
        """Serve until the client goes away; then abort whatever is still running."""
        sender = asyncio.create_task(self._send_loop())
        try:
            async for frame in self.connection:
                await self._handle_frame(frame)
        except ConnectionClosed:
            pass  # too big a message (1009) or a vanished client: nothing more to read
        finally:
            if self.in_flight:
                self.server.engine_thread.abort(self.stream.response_id)
                self.stream.cancel()
            if self.queue.full():
                sender.cancel()
            else:
                self.queue.put_nowait(_STOP)
            try:
                await sender
            except (asyncio.CancelledError, ConnectionClosed):
                pass

    async def _handle_frame(self, frame: str | bytes) -> None:
        stream_id = None
        try:
            event = parse_client_event(frame)
            stream_id = event.get("stream_id") if isinstance(event.get("stream_id"), str) else None
            if event["type"] == "response.create":
                await self._create(event)
            elif event["type"] == "response.cancel":
                self._cancel()
            else:
                raise ProtocolError("unknown_event_type", f"unknown event type {event['type'][:80]!r}; this "
                                    "server accepts response.create and response.cancel", "type")
        except ProtocolError as error:
            await self.queue.put(error_event(error, stream_id))

    async def _create(self, event: dict[str, Any]) -> None:
        if self.in_flight:
            raise ProtocolError("response_already_in_flight", "a response is already in progress on this "
                                "connection; wait for it to end or send response.cancel (open another "
                                "connection to run responses in parallel)", status=409)
        server = self.server
        request = parse_response_create(event)
        server.check_model(request.model)
        history: list[dict[str, str]] = []
        if request.previous_response_id is not None:
            found = server.conversations.get(request.previous_response_id)
            if found is None:
                raise ProtocolError("previous_response_not_found", f"previous response "
                                    f"{request.previous_response_id!r} is not stored here (unknown, or "
                                    "evicted); send the whole conversation instead", "previous_response_id")
            history = found
        conversation = history + request.input_messages
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        prompt_ids = await self._encode_chat(system + conversation)
        defaults = server.config.sampling_defaults  # each field the request leaves out
        if request.temperature is None:
            request.temperature = defaults.temperature
        if request.top_p is None:
            request.top_p = defaults.top_p
        request.extension = {"top_k": defaults.top_k, "min_p": defaults.min_p} | request.extension
        params = request.sampling_params(self._max_tokens(request, len(prompt_ids)))
        response_id = new_id("resp")
        stream = ResponseStream(request, response_id, server.served_name, len(prompt_ids), server.token_text)
        try:
            server.engine_thread.submit(prompt_ids, params, lambda output: self._from_engine(stream, output),
                                        request_id=response_id)
        except ValueError as exc:
            raise ProtocolError("invalid_request", str(exc)) from None
        self._arrival_time, self._last_token_time = time.monotonic(), None
        self.stream, self.conversation = stream, conversation
        self.streams.append(stream)
        self._wake()

    async def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:  # rendering and tokenizing a long prompt must not hold up the other connections
            prompt_ids = await asyncio.to_thread(self.server.tokenizer.encode_chat, messages)
        except ValueError as exc:  # no chat template, or a template that raised on these messages
            raise ProtocolError("invalid_prompt", f"the chat template could not render the input: {exc}",
                                "input") from None
        if not prompt_ids:
            raise ProtocolError("invalid_prompt", "the input renders to an empty prompt", "input")
        return prompt_ids

    def _max_tokens(self, request: ResponseRequest, num_prompt_tokens: int) -> int:
        """max_output_tokens, cut to what the context has room for after the prompt."""
        max_model_len = self.server.engine_thread.engine.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise ProtocolError("context_length_exceeded", f"the prompt is {num_prompt_tokens} tokens; the "
                                f"context holds {max_model_len}, and generating needs room for one more",
                                "input")
        if request.max_output_tokens is not None and request.max_output_tokens > max_model_len:
            raise ProtocolError("integer_above_max_value", f"'max_output_tokens' must be <= {max_model_len} "
                                f"(the context length), got {request.max_output_tokens}", "max_output_tokens")
        wanted = request.max_output_tokens or self.server.config.default_max_output_tokens
        return max(1, min(wanted, max_model_len - num_prompt_tokens))

    def _cancel(self) -> None:
        if not self.in_flight:
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel")
        self.server.engine_thread.abort(self.stream.response_id)
        self.stream.cancel()
        self._finish(self.stream)

    def _from_engine(self, stream: ResponseStream, output: RequestOutput) -> None:
        """Called on the engine thread: hand the output to the event loop, never block."""
        self.loop.call_soon_threadsafe(self._on_output, stream, output)

    def _on_output(self, stream: ResponseStream, output: RequestOutput) -> None:
        if stream.is_done:  # cancelled or disconnected while this output was on its way
            return
        now = time.monotonic()
        metrics = self.server.metrics
        if any(completion.delta_token_ids for completion in output.outputs):
            if self._last_token_time is None:
                metrics.time_to_first_token.observe(now - self._arrival_time)
            else:
                metrics.inter_token_latency.observe(now - self._last_token_time)
            self._last_token_time = now
        stream.absorb(output)
        if stream.is_done:
            metrics.e2e_request_latency.observe(now - self._arrival_time)
            self._finish(stream)
        self._wake()

    def _finish(self, stream: ResponseStream) -> None:
        """Store the conversation with its reply, so a follow-up can name this response."""
        if stream.status != "failed":
            reply = {"role": "assistant", "content": stream.texts[0]}
            self.server.conversations.put(stream.response_id, self.conversation + [reply])
        self._wake()

    def _wake(self) -> None:
        # At most one wake-up waits in the queue; when the queue is full the sender drains anyway
        # after the item it is on, so nothing is lost.
        if not self._wake_queued and not self.queue.full():
            self._wake_queued = True
            self.queue.put_nowait(_WAKE)

    async def _send_loop(self) -> None:
        try:
            await self._send_events()
        except ConnectionClosed:
            raise
        except Exception:  # a bug here must not leave the client waiting forever
            log.exception("sending to a client failed; closing its connection")
            await self.connection.close(1011, "internal error")

    async def _send_events(self) -> None:
        while True:
            item = await self.queue.get()
            if item is _STOP:
                return
            if item is _WAKE:
                self._wake_queued = False
            else:
                await self.connection.send(json.dumps(item))
            while self.streams:
                stream = self.streams[0]
                for event in stream.drain():
                    await self.connection.send(json.dumps(event))
                if stream.has_unsent_events or not stream.is_done:
                    break
                self.streams.popleft()
