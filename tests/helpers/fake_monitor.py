"""A stand-in for the server's `/v1/monitor`: sends a hello frame, then whatever frames the test hands it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve


class FakeMonitor:
    """A websocket server on 127.0.0.1 that greets each client with `hello` and relays `send()`ed frames."""

    def __init__(self, hello: dict[str, Any], port: int = 0) -> None:
        self.hello = hello
        self.port = port
        self.paths: list[str] = []  # the request path of every connection, in order
        self._server: Server | None = None
        self._queues: list[asyncio.Queue] = []

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/monitor"

    @property
    def num_clients(self) -> int:
        return len(self._queues)

    async def start(self) -> FakeMonitor:
        self._server = await serve(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Close every connection and stop listening (the port can be taken again)."""
        self._server.close()
        await self._server.wait_closed()
        self._queues.clear()

    def send(self, frame: dict[str, Any] | str) -> None:
        """Send `frame` (JSON-encoded unless it is already a string) to every connected client."""
        for queue in self._queues:
            queue.put_nowait(frame if isinstance(frame, str) else json.dumps(frame))

    async def _handle(self, connection: ServerConnection) -> None:
        self.paths.append(connection.request.path)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.append(queue)
        closed = asyncio.ensure_future(connection.wait_closed())
        try:
            await connection.send(json.dumps(self.hello))
            while True:
                next_frame = asyncio.ensure_future(queue.get())
                await asyncio.wait([next_frame, closed], return_when=asyncio.FIRST_COMPLETED)
                if closed.done():  # the server is stopping, or the client went away
                    next_frame.cancel()
                    return
                await connection.send(next_frame.result())
        finally:
            closed.cancel()
            if queue in self._queues:
                self._queues.remove(queue)
