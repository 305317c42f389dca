"""One generation request over HTTP, whatever its API: the request (read by its API: request/fields.py's
`read_request`) run on the `GenerationService`, answered whole or streamed in the API's shape (its `HttpView`).

A streamed answer is written as the engine produces it, coalesced while the client reads slower; a
client that disconnects, or stops reading for `send_timeout_s`, has its response aborted at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from localserve.loading.model_folder import ModelEntry
from localserve.server.config import ServerConfig
from localserve.server.generation.service import GenerationService
from localserve.server.generation.stream import GenerationStream
from localserve.server.request.generation_request import GenerationRequest
from localserve.server.wire.http_exchange import HttpExchange

SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class HttpView(Protocol):
    """How one API answers a running response over HTTP."""

    stream_type: bytes  # the Content-Type of the streamed answer

    def pieces(self, done: bool) -> bytes:
        """The streamed answer not sent yet; `done`: the response is over, and this is the stream's end."""

    def whole(self) -> dict[str, Any]:
        """The answer once the response is over; raises ProtocolError for one that did not end normally."""


class HttpGeneration:
    """Runs the generation requests of the HTTP API; `in_flight` holds those the engine still runs."""

    def __init__(self, config: ServerConfig, responses: GenerationService) -> None:
        self.config, self.responses = config, responses
        self.in_flight: set[GenerationStream] = set()

    def shut_down(self) -> None:
        """The server is stopping: end every response in flight (reason `server_shutdown`)."""
        for stream in list(self.in_flight):
            self.responses.shut_down(stream)

    async def run(self, exchange: HttpExchange, request: GenerationRequest,
                  make_view: Callable[[GenerationStream], HttpView], entry: ModelEntry | None = None
                  ) -> GenerationStream:
        """Run one response for this exchange on `entry` (None: the model the request names) and answer it in
        `make_view`'s shape; returns its stream."""
        responses = self.responses
        wake = asyncio.Event()
        stream = await responses.start(request, None, lambda _: wake.set(), entry)
        self.in_flight.add(stream)

        async def watch_disconnect() -> None:
            await exchange.wait_disconnect()
            wake.set()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            view = make_view(stream)
            if request.stream:
                await self._stream(exchange, stream, view, wake)
            else:
                while not stream.is_done and not exchange.disconnected:
                    await wake.wait()
                    wake.clear()
                if not exchange.disconnected:
                    await exchange.respond_json(200, view.whole())
        finally:
            watcher.cancel()
            exchange.model, exchange.tokens = stream.model, (stream.num_prompt_tokens, stream.num_output_tokens)
            self.in_flight.discard(stream)
            if not stream.is_done:  # the client left (or was cut) first: its blocks go back now
                responses.abandon(stream)
        return stream

    async def _stream(self, exchange: HttpExchange, stream: GenerationStream, view: HttpView,
                      wake: asyncio.Event) -> None:
        """The answer as the engine produces it, coalesced while the client reads slower."""
        await exchange.start(200, view.stream_type, SSE_HEADERS)
        while not exchange.disconnected:
            done = stream.is_done  # read once: the stream may end while a write below awaits the client
            data = view.pieces(done)
            if data or done:
                await exchange.write(data, more=not done)
            if done:
                return
            await wake.wait()
            wake.clear()
