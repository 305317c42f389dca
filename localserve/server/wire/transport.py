"""One port for HTTP and websockets: uvicorn's HTTP/1.1 protocol in front, `websockets` behind an upgrade.

Every TCP connection starts as an `HttpConnection`: uvicorn's h11 protocol (request parsing, keep-alive,
chunked streaming bodies, pipelining, flow control) serving the ASGI app of server/http_app.py, with this
server's bounds added. The connection tells the connection book (server/wire/connection_phases.py) each
phase it enters, as h11's state shows it, and bounds each in time (`PhaseBounds`): a request head must
arrive whole within `header_s` of the connection (or of its first byte after a response; uvicorn's own
keep-alive timer, `keep_alive_s`, bounds the wait for that byte, and is reset by every byte), a body may
pause at most `body_gap_s` and must average `min_body_rate` once past its first `body_gap_s`; one that
does not is answered 408 (`request_timeout`) and closed, and so is one evicted as the oldest unfinished
connection (`too_many_unfinished_connections`). A whole request that finds `max_connections` served
connections is refused: the app answers 429 after its access checks (`over_limit`), or, when the body
completes after the app has begun, the connection does. Heads hold at most `MAX_HEAD_BYTES` (431), and
the ASGI app can reach the connection (`scope["state"]["connection"]`) to reset a client that stops reading.

A websocket upgrade is handed, with its request head and its place in the book (no moment uncounted), to
a `websockets` `ServerConnection` built here as `websockets.asyncio.server.serve` builds its own (same
extensions, size bound, write limit, close timeout), so the websocket endpoints run on the very
`websockets` connection objects they were written for; its handshake must end within `handshake_s`.
uvicorn's own websocket protocols would put ASGI messages in between, which have no ping, no transport
to reset and no write limit.
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
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState as UvicornState
from websockets.asyncio.server import Server as WebsocketServer
from websockets.asyncio.server import ServerConnection
from websockets.extensions.permessage_deflate import enable_server_permessage_deflate
from websockets.protocol import OPEN
from websockets.server import ServerProtocol

from localserve.server.wire.connection_phases import CloseReason, Phase, PhaseBounds, Slot

log = logging.getLogger(__name__)

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


def error_body(code: str, message: str, error_type: str = "invalid_request_error") -> bytes:
    """An error in OpenAI's shape, for a request the transport answers itself."""
    return (json.dumps({"error": {"message": message, "type": error_type, "param": None,
                                  "code": code}}) + "\n").encode()


def head_too_large(size: int) -> bytes:
    return error_body("request_header_too_large", f"the request head holds {size} bytes; at most "
                      f"{MAX_HEAD_BYTES} are accepted")


class ConnectionHooks(Protocol):
    """What the transport tells the server's connection book (server/wire/connection_phases.py) and asks of it."""

    limit_message: str  # the refusal of a whole request beyond max_connections
    eviction_message: str  # what an evicted connection is told

    def connection_opened(self, on_evicted: Callable[[], None]) -> Slot:
        """A new connection, in its `headers` phase."""

    def enter(self, slot: Slot, phase: Phase) -> bool:
        """Move to `phase`; False when a whole request finds no place among max_connections."""

    def cut(self, slot: Slot, reason: CloseReason) -> None:
        """An unfinished connection is closed for `reason`."""

    def close(self, slot: Slot) -> None:
        """The connection is gone."""


class HttpConnection(H11Protocol):
    """uvicorn's HTTP/1.1 protocol for one TCP connection, with its phases told and bounded."""

    def __init__(self, config: uvicorn.Config, state: UvicornState, hooks: ConnectionHooks, bounds: PhaseBounds,
                 close_timeout_s: float) -> None:
        # app_state is copied into each request's scope["state"]: the app finds its connection there
        super().__init__(config=config, server_state=state, app_state={})
        self.app_state["connection"] = self
        self.hooks, self.bounds, self.close_timeout_s = hooks, bounds, close_timeout_s
        self.over_limit = False  # this request is whole, and beyond max_connections: the app answers 429
        self.slot: Slot | None = None
        self.upgraded = False  # the socket belongs to a websocket now, and so does the slot
        self._timer: asyncio.TimerHandle | None = None  # the bound of the phase it is in (head or body)
        self._whole: RequestResponseCycle | None = None  # the latest request known whole (served or refused)
        self._refused = False  # that request is refused: its answer ends its exchange, unserved
        self._dropping = False  # evicted or answered for the last time: what the client still sends is dropped
        self._body_started = self._last_body_at = 0.0
        self._body_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.slot = self.hooks.connection_opened(self._evicted)
        self._arm(self.bounds.header_s, self._head_timed_out)
        # Evictable once its socket has been read: a callback scheduled now runs before this connection's
        # first read (the next iteration's I/O); the one it schedules runs after it.
        self.loop.call_soon(self.loop.call_soon, self._read_once)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if not self.upgraded:
            self.hooks.close(self.slot)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        cycle = self.cycle
        super().data_received(data)
        self._follow(new_request=self.cycle is not cycle, num_bytes=len(data))

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # may take a pipelined request at once
        self._follow(new_request=self.cycle is not cycle, num_bytes=0)

    def _read_once(self) -> None:
        self.slot.evictable = True

    def _follow(self, new_request: bool, num_bytes: int) -> None:
        """Enter the phase h11's state shows, after bytes arrived or a response ended. `new_request`: a
        request head arrived during this call, so the app has not run for it yet."""
        if self.upgraded or self._ending or self.slot.phase is Phase.CLOSING:
            return
        state, phase = self.conn.their_state, self.slot.phase
        if state is h11.IDLE:  # between two requests: the previous exchange, if any, is over
            began = bool(self.conn.trailing_data[0])  # bytes of the next head are in
            if phase is Phase.REQUEST and not began:
                self.hooks.enter(self.slot, Phase.IDLE)
            elif phase in (Phase.REQUEST, Phase.IDLE) and began or phase is Phase.BODY or self._refused:
                # the next head has begun, or an exchange that was never served (refused, or answered
                # before its body ended) is over: the next head is due
                self._refused = False
                self.hooks.enter(self.slot, Phase.HEADERS)
                self._arm(self.bounds.header_s, self._head_timed_out)
        elif state is h11.SEND_BODY:
            now = self.loop.time()
            if phase is not Phase.BODY:  # the bytes that completed the head are not counted
                self.hooks.enter(self.slot, Phase.BODY)
                self._body_started, self._last_body_at, self._body_bytes = now, now, 0
                self._arm(self.bounds.body_gap_s, self._body_check)
            elif num_bytes:
                self._body_bytes += num_bytes
                self._last_body_at = now
        elif state in (h11.DONE, h11.MUST_CLOSE) and self.cycle is not self._whole:  # a whole request
            self._whole = self.cycle
            self._cancel_timer()
            entered = self.hooks.enter(self.slot, Phase.REQUEST)  # from `idle`, always
            if new_request:  # the app has not seen it: it answers 429 itself, after its access checks
                self.over_limit = self._refused = not entered
            elif not entered and not self.cycle.response_started:  # the app waits for the rest of the body
                self._refuse(429, b"Too Many Requests",
                             error_body("too_many_connections", self.hooks.limit_message, "rate_limit_error"))
            elif not entered:  # answered while its body came: the connection ends with that answer
                self.cycle.keep_alive = False

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._cancel_timer()
        size = head_size(event.method, event.target, event.headers)
        if size > MAX_HEAD_BYTES:  # the HTTP app's bound, which an upgrade never reaches
            self._refuse(431, b"Request Header Fields Too Large", head_too_large(size))
            return
        self.upgraded = True
        self.slot.evictable = False  # its whole upgrade is in: the server owes it the answer
        self.hooks.enter(self.slot, Phase.HANDSHAKE)  # the websocket side takes the slot with the socket
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse, in OpenAI's error shape; uvicorn calls this inside its `except`, so
        the parser's own reason (`Found multiple Host: headers`, `Missing mandatory Host: header`) is at hand."""
        reason = str(sys.exc_info()[1] or msg)
        code = "duplicate_header" if reason.startswith("Found multiple") else "invalid_http_request"
        self._refuse(400, b"Bad Request", error_body(code, f"the HTTP request is malformed: {reason[:200]}"))

    def _refuse(self, status: int, reason: bytes, body: bytes) -> None:
        """Answer now, with a JSON error body, and close the connection (lingering, see `_close`). h11 sends
        a response before any request too (a 408 to a head not whole); an app waiting for the body is told
        its client is gone."""
        self.hooks.enter(self.slot, Phase.CLOSING)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        if self.cycle is not None and not self.cycle.response_complete:  # the app waiting for a body stops
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._close()

    def _close(self) -> None:
        """A lingering close: the answer, then the end of our side, reading (and dropping) what the client
        still sends until it closes its own, for close_timeout_s at most. Closing at once with its bytes
        unread would reset the connection, and the client might never read the answer."""
        self._cancel_timer()
        self._dropping = True
        self.transport.write_eof()
        self.loop.call_later(self.close_timeout_s, self.transport.abort)  # no-op once closed

    def reset(self) -> None:
        """Drop the connection at once (a client that stopped reading cannot take a graceful close)."""
        self.transport.abort()

    # ------------------------------------------------------------------ the bounds of unfinished phases
    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay_s, callback)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        self._cut(f"the request head did not arrive within {self.bounds.header_s:g} s (--header-timeout)")

    def _body_check(self) -> None:
        """The body's deadline moves with every byte: checked when it was due, then armed again or cut."""
        self._timer = None
        now, bounds = self.loop.time(), self.bounds
        if self.flow.read_paused:  # the server, not the client, stopped reading (the app is behind): start over
            self._body_started = self._last_body_at = now
            self._body_bytes = 0
        deadline = bounds.body_deadline(self._body_started, self._last_body_at, self._body_bytes)
        if now < deadline:
            self._arm(deadline - now, self._body_check)
        elif now - self._last_body_at >= bounds.body_gap_s:
            self._cut(f"no bytes of the body came for {bounds.body_gap_s:g} s (--body-gap-timeout)")
        else:
            self._cut(f"the body came at {self._body_bytes / (now - self._body_started):.0f} bytes/s, below "
                      f"{bounds.min_body_rate:g} (--min-body-rate) past its first {bounds.body_gap_s:g} s")

    @property
    def _ending(self) -> bool:
        """The connection's end has begun (its last answer sent, or its socket closing)."""
        return self._dropping or self.transport.is_closing()

    def _cut(self, message: str) -> None:
        """Its phase's bound passed: counted, answered 408 when it can still be, closed."""
        if self.upgraded or self._ending:
            return
        self.hooks.cut(self.slot, CloseReason.TIMEOUT)
        self._end_unfinished("request_timeout", message)

    def _evicted(self) -> None:
        """The book evicted this connection as the oldest unfinished one (it is counted already): closed
        after the linger, or when its phase's bound comes if sooner; what it sends meanwhile is dropped."""
        if self._ending:
            return
        linger_s = self.bounds.evicted_linger_s
        if self._timer is not None:  # a head's or body's bound (a body's is checked no later than it falls)
            linger_s = min(linger_s, max(0.0, self._timer.when() - self.loop.time()))
        self._dropping = True
        self._arm(linger_s, lambda: self._end_unfinished("too_many_unfinished_connections",
                                                         self.hooks.eviction_message))

    def _end_unfinished(self, code: str, message: str) -> None:
        self._cancel_timer()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._refuse(408, b"Request Timeout", error_body(code, message))
        else:  # its response has begun (the app answered without the body): nothing more can be said
            self._close()


WebsocketHandler = Callable[[ServerConnection, Slot], Awaitable[None]]
ProcessRequest = Callable[[ServerConnection, Any], Awaitable[Any]]


class SharedPort:
    """The listening socket: HTTP through uvicorn, websocket upgrades through `websockets`."""

    def __init__(self, app: Callable[..., Awaitable[None]], hooks: ConnectionHooks, *, max_message_bytes: int,
                 write_limit_bytes: int, close_timeout_s: float, bounds: PhaseBounds) -> None:
        self.hooks, self.bounds = hooks, bounds
        self.max_message_bytes, self.write_limit_bytes = max_message_bytes, write_limit_bytes
        self.close_timeout_s = close_timeout_s
        self.app = app
        self.uvicorn_config = uvicorn.Config(
            self._serve_http, http="h11", ws=self._websocket_protocol, lifespan="off", interface="asgi3",
            log_config=None, access_log=False, proxy_headers=False, server_header=False, date_header=False,
            headers=[("server", "localserve")], timeout_keep_alive=bounds.keep_alive_s,  # type: ignore[arg-type]
            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self.uvicorn_config.load()
        self.uvicorn_state = UvicornState()
        self.uvicorn_state.default_headers = list(self.uvicorn_config.encoded_headers)
        self.websockets: WebsocketServer | None = None
        self._handle_websocket: WebsocketHandler | None = None
        self._process_request: ProcessRequest | None = None
        self._upgrading: dict[ServerConnection, Slot] = {}  # handed from the upgrade to the websocket's task

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
        return HttpConnection(self.uvicorn_config, self.uvicorn_state, self.hooks, self.bounds, self.close_timeout_s)

    def _websocket_protocol(self, config: uvicorn.Config, server_state: UvicornState,
                            app_state: dict[str, Any]) -> ServerConnection:
        """Called by uvicorn on an upgrade: the `websockets` connection that takes over the socket."""
        assert self.websockets is not None
        protocol = ServerProtocol(extensions=enable_server_permessage_deflate(None), max_size=self.max_message_bytes,
                                  logger=self.websockets.logger)
        # the session's own keepalive pings (1008 when unanswered); websockets' would close with 1011
        connection = ServerConnection(protocol, self.websockets, ping_interval=None,
                                      close_timeout=self.close_timeout_s, write_limit=self.write_limit_bytes)
        self._upgrading[connection] = app_state["connection"].slot
        return connection

    async def _serve_websocket(self, connection: ServerConnection) -> None:
        """A websocket's life, as `websockets.asyncio.server.serve` leads it: handshake, handler, close; its
        slot in the book from the upgrade to the end (the handler moves it on from `handshake`)."""
        server = self.websockets
        assert server is not None and self._handle_websocket is not None
        slot = self._upgrading.pop(connection)
        slot.on_evicted = connection.transport.abort
        try:
            try:
                await asyncio.wait_for(connection.handshake(self._process_request, None, "localserve"),
                                       self.bounds.handshake_s)
            except asyncio.TimeoutError:
                self.hooks.cut(slot, CloseReason.TIMEOUT)
                raise
            if connection.protocol.state is not OPEN:  # refused: the handshake sent the HTTP answer
                connection.transport.abort()
                return
            server.all_connections.add(connection)
            try:
                async with connection:
                    await self._handle_websocket(connection, slot)
            except Exception:
                log.exception("websocket handler failed")
            finally:
                server.all_connections.discard(connection)
        except Exception:
            connection.transport.abort()
        finally:
            self.hooks.close(slot)
            server.handler_tasks.discard(asyncio.current_task())
