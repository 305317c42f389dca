"""A websocket client that reads nothing unless asked and sends what a polite library never would.

It runs websockets' sans-I/O `ClientProtocol` over a plain socket whose receive buffer is small, so a
server that keeps sending to it soon finds it not reading. Frames go out as built: invalid UTF-8 in a
text frame, RSV bits without an extension, compressed bombs when deflate was negotiated.
"""

from __future__ import annotations

import asyncio
import json
import socket

from websockets.client import ClientProtocol
from websockets.extensions.permessage_deflate import ClientPerMessageDeflateFactory
from websockets.frames import Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri


class HandshakeRefused(ConnectionError):
    def __init__(self, status: int) -> None:
        super().__init__(f"handshake refused: {status}")
        self.status = status


class RawClient:
    """One connection; `open()` does the handshake, then nothing is read until `read_events()`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, protocol: ClientProtocol):
        self.reader, self.writer, self.protocol = reader, writer, protocol
        self.received: list[dict] = []  # events read from the socket and not yet returned by recv()
        self.eof = False

    @classmethod
    async def open(cls, port: int, path: str = "/v1/responses", receive_buffer: int = 4096,
                   deflate: bool = False, headers: dict[str, str] | None = None) -> RawClient:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)  # before connect: sets the window
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}{path}"), max_size=None,
                                  extensions=[ClientPerMessageDeflateFactory()] if deflate else None)
        request = protocol.connect()
        for name, value in (headers or {}).items():  # replacing the library's own (Host, ...)
            del request.headers[name]
            request.headers[name] = value
        protocol.send_request(request)
        client = cls(reader, writer, protocol)
        await client.flush()
        while True:
            data = await asyncio.wait_for(reader.read(65536), 30)
            if not data:
                raise ConnectionError("the server closed during the handshake")
            protocol.receive_data(data)
            responses = [event for event in protocol.events_received() if isinstance(event, Response)]
            if responses:
                if responses[0].status_code != 101:
                    raise HandshakeRefused(responses[0].status_code)
                return client

    async def flush(self) -> None:
        self.writer.write(b"".join(self.protocol.data_to_send()))
        await asyncio.wait_for(self.writer.drain(), 30)

    async def send_text(self, data: str | bytes) -> None:
        self.protocol.send_text(data.encode() if isinstance(data, str) else data)
        await self.flush()

    async def send_binary(self, data: bytes) -> None:
        self.protocol.send_binary(data)
        await self.flush()

    async def send_with_reserved_bit(self, data: bytes) -> None:
        """A text frame with RSV2 set, which no extension uses (the server must fail the connection)."""
        raw = bytearray(Frame(Opcode.TEXT, data).serialize(mask=True, extensions=[]))
        raw[0] |= 0x20
        self.writer.write(bytes(raw))
        await asyncio.wait_for(self.writer.drain(), 30)

    async def recv(self, timeout: float) -> dict | None:
        """The next JSON event; None once the server has closed (see `close_code`) or after `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.received and self.protocol.close_code is None and not self.eof:
            try:
                data = await asyncio.wait_for(self.reader.read(65536), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return None
            except ConnectionError:  # reset by the server
                self.eof = True
                break
            if data:
                self.protocol.receive_data(data)
            else:
                self.eof = True
                self.protocol.receive_eof()
            self.received += [json.loads(frame.data) for frame in self.protocol.events_received()
                              if isinstance(frame, Frame) and frame.opcode is Opcode.TEXT]
            try:
                await self.flush()  # pongs and the closing handshake
            except (ConnectionError, asyncio.TimeoutError):
                self.eof = True
        return self.received.pop(0) if self.received else None

    @property
    def close_code(self) -> int | None:
        return self.protocol.close_code

    async def read_events(self, timeout: float) -> tuple[list[dict], int | None]:
        """Read until the server closes (or `timeout`): the JSON events received, and the close code."""
        events: list[dict] = []
        while (event := await self.recv(timeout)) is not None:
            events.append(event)
        return events, self.protocol.close_code

    def abort(self) -> None:
        """Vanish: no closing handshake, no FIN, just a reset."""
        self.writer.transport.abort()
