"""One port for HTTP and websockets: uvicorn's HTTP/1.1 protocol in front, `websockets` behind an upgrade.

Every TCP connection starts as an `HttpConnection`: uvicorn's h11 protocol (request parsing, keep-alive,
chunked streaming bodies, pipelining, flow control) serving the ASGI app of server/http_api.py, with this
server's bounds added: every open connection counts against `max_connections` (one beyond it is answered
429), the head of each request must arrive within `request_head_timeout_s` of the connection opening or
of the previous response (a client trickling header bytes is cut; uvicorn's keep-alive timer alone is
reset by every byte) and hold at most `MAX_HEAD_BYTES` (431), and the ASGI app can reach the connection
(`scope["state"]["connection"]`) to reset a client that stops reading.

A websocket upgrade is handed, with its request head, to a `websockets` `ServerConnection` built here as
`websockets.asyncio.server.serve` builds its own (same extensions, size bound, write limit, close
timeout), so the websocket endpoints run on the very `websockets` connection objects they were written
for. uvicorn's own websocket protocols would put ASGI messages in between, which have no ping, no
transport to reset and no write limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import h11
import uvicorn
import websockets.http11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState as UvicornState
from websockets.asyncio.server import Server as WebsocketServer
from websockets.asyncio.server import ServerConnection
from websockets.extensions.permessage_deflate import enable_server_permessage_deflate
from websockets.protocol import OPEN
from websockets.server import ServerProtocol

log = logging.getLogger(__name__)

REQUEST_HEAD_TIMEOUT_S = 10.0  # as websockets' own open_timeout
KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle keep-alive connection is closed after this long (uvicorn's default)
MAX_HEAD_BYTES = 16 << 10  # request line, header lines and the blank line (see `head_size`); more is a 431

# A websocket handshake reaches `websockets` within MAX_HEAD_BYTES; its own, tighter bounds (8192 bytes a
# line, 128 headers) would refuse some of those, in a shape of their own. It reads them at every parse;
# they are its settings (WEBSOCKETS_MAX_LINE_LENGTH, WEBSOCKETS_MAX_NUM_HEADERS), raised here to ours.
websockets.http11.MAX_LINE_LENGTH = max(websockets.http11.MAX_LINE_LENGTH, MAX_HEAD_BYTES)
websockets.http11.MAX_NUM_HEADERS = max(websockets.http11.MAX_NUM_HEADERS, MAX_HEAD_BYTES // 4)


def head_size(method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> int:
    """The bytes of a request head as parsed: `METHOD TARGET HTTP/1.1`, a `name: value` line per header
    and the blank line, each ended by CRLF (what a client sends that adds no optional whitespace). The
    parser strips whitespace around values, so padding there is not counted; it is bounded, while the
    head is incomplete, by the parser's own limit of MAX_HEAD_BYTES buffered bytes."""
    request_line = len(method) + 1 + len(target) + len(b" HTTP/1.1\r\n")
    return request_line + sum(len(name) + len(b": ") + len(value) + len(b"\r\n") for name, value in headers) + 2


def error_body(code: str, message: str) -> bytes:
    """An error in OpenAI's shape, for a request the transport answers itself."""
    return (json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                  "code": code}}) + "\n").encode()


def head_too_large(size: int) -> bytes:
    return error_body("request_header_too_large", f"the request head holds {size} bytes; at most "
                      f"{MAX_HEAD_BYTES} are accepted")


class ConnectionHooks(Protocol):
    """What the transport tells the server about its connections."""

    def http_connection_opened(self, connection: HttpConnection) -> bool:
        """Count a new HTTP connection; False when it is beyond the limit (its requests get 429)."""

    def http_connection_closed(self, connection: HttpConnection) -> None:
        """A counted HTTP connection ended, or became a websocket."""


class HttpConnection(H11Protocol):
    """uvicorn's HTTP/1.1 protocol for one TCP connection, with a bound on request heads and a count."""

    def __init__(self, config: uvicorn.Config, state: UvicornState, hooks: ConnectionHooks,
                 request_head_timeout_s: float) -> None:
        # app_state is copied into each request's scope["state"]: the app finds its connection there
        super().__init__(config=config, server_state=state, app_state={})
        self.app_state["connection"] = self
        self.hooks = hooks
        self.request_head_timeout_s = request_head_timeout_s
        self.over_limit = False
        self._counted = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted = True
        self.over_limit = not self.hooks.http_connection_opened(self)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._uncount()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request head arrived whole
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # no pipelined request was waiting
            self._arm_head_timer()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._cancel_head_timer()
        size = head_size(event.method, event.target, event.headers)
        if size > MAX_HEAD_BYTES:  # the HTTP app's bound, which an upgrade never reaches
            self._refuse(431, b"Request Header Fields Too Large", head_too_large(size))
            return
        self._uncount()  # the websocket side counts it from its handshake on
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse, in OpenAI's error shape; uvicorn calls this inside its `except`, so
        the parser's own reason (`Found multiple Host: headers`, `Missing mandatory Host: header`) is at hand."""
        reason = str(sys.exc_info()[1] or msg)
        code = "duplicate_header" if reason.startswith("Found multiple") else "invalid_http_request"
        self._refuse(400, b"Bad Request", error_body(code, f"the HTTP request is malformed: {reason[:200]}"))

    def _refuse(self, status: int, reason: bytes, body: bytes) -> None:
        """Answer the request now, with a JSON error body, and close the connection."""
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def reset(self) -> None:
        """Drop the connection at once (a client that stopped reading cannot take a graceful close)."""
        self.transport.abort()

    def _uncount(self) -> None:
        if self._counted:
            self._counted = False
            self.hooks.http_connection_closed(self)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.request_head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.get_protocol() is self and not self.transport.is_closing():
            self.transport.abort()


WebsocketHandler = Callable[[ServerConnection], Awaitable[None]]
ProcessRequest = Callable[[ServerConnection, Any], Awaitable[Any]]


class SharedPort:
    """The listening socket: HTTP through uvicorn, websocket upgrades through `websockets`."""

    def __init__(self, app: Callable[..., Awaitable[None]], hooks: ConnectionHooks, *, max_message_bytes: int,
                 write_limit_bytes: int, close_timeout_s: float,
                 request_head_timeout_s: float = REQUEST_HEAD_TIMEOUT_S) -> None:
        self.hooks = hooks
        self.max_message_bytes, self.write_limit_bytes = max_message_bytes, write_limit_bytes
        self.close_timeout_s = close_timeout_s
        self.request_head_timeout_s = request_head_timeout_s
        self.app = app
        self.uvicorn_config = uvicorn.Config(
            self._serve_http, http="h11", ws=self._websocket_protocol, lifespan="off", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False, date_header=False,
            headers=[("server", "localserve")], timeout_keep_alive=int(KEEP_ALIVE_TIMEOUT_S),
            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self.uvicorn_config.load()
        self.uvicorn_state = UvicornState()
        self.uvicorn_state.default_headers = list(self.uvicorn_config.encoded_headers)
        self.websockets: WebsocketServer | None = None
        self._handle_websocket: WebsocketHandler | None = None
        self._process_request: ProcessRequest | None = None

    async def listen(self, host: str, port: int, process_request: ProcessRequest,
                     handle_websocket: WebsocketHandler) -> WebsocketServer:
        """Bind; returns the websockets `Server` (close() / wait_closed() / sockets) over the socket."""
        self._process_request, self._handle_websocket = process_request, handle_websocket

        async def create_server() -> asyncio.Server:
            return await asyncio.get_running_loop().create_server(self._http_protocol, host, port)

        self.websockets = WebsocketServer(create_server, self._serve_websocket, logging.getLogger("websockets.server"))
        await self.websockets
        return self.websockets

    async def _serve_http(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        """The ASGI app, behind the bound on request heads (h11 bounds only a head that is incomplete)."""
        target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        size = head_size(scope["method"].encode(), target, scope["headers"])
        if size > MAX_HEAD_BYTES:
            body = head_too_large(size)
            await send({"type": "http.response.start", "status": 431, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    @property
    def http_connections(self) -> list[HttpConnection]:
        return [connection for connection in self.uvicorn_state.connections if isinstance(connection, HttpConnection)]

    def _http_protocol(self) -> HttpConnection:
        return HttpConnection(self.uvicorn_config, self.uvicorn_state, self.hooks, self.request_head_timeout_s)

    def _websocket_protocol(self, config: uvicorn.Config, server_state: UvicornState,
                            app_state: dict[str, Any]) -> ServerConnection:
        """Called by uvicorn on an upgrade: the `websockets` connection that takes over the socket."""
        assert self.websockets is not None
        protocol = ServerProtocol(extensions=enable_server_permessage_deflate(None), max_size=self.max_message_bytes,
                                  logger=self.websockets.logger)
        # the session's own keepalive pings (1008 when unanswered); websockets' would close with 1011
        return ServerConnection(protocol, self.websockets, ping_interval=None, close_timeout=self.close_timeout_s,
                                write_limit=self.write_limit_bytes)

    async def _serve_websocket(self, connection: ServerConnection) -> None:
        """A websocket's life, as `websockets.asyncio.server.serve` leads it: handshake, handler, close."""
        server = self.websockets
        assert server is not None and self._handle_websocket is not None
        try:
            await asyncio.wait_for(connection.handshake(self._process_request, None, "localserve"),
                                   self.request_head_timeout_s)
            if connection.protocol.state is not OPEN:  # refused: the handshake sent the HTTP answer
                connection.transport.abort()
                return
            server.all_connections.add(connection)
            try:
                async with connection:
                    await self._handle_websocket(connection)
            except Exception:
                log.exception("websocket handler failed")
            finally:
                server.all_connections.discard(connection)
        except Exception:
            connection.transport.abort()
        finally:
            server.handler_tasks.discard(asyncio.current_task())
