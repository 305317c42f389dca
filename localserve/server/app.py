"""The websocket server: `/v1/responses` and `/v1/monitor`, plus plain GETs on the same port.

One asyncio loop (the `websockets` library) serves every connection; the engine runs on its own
thread behind `EngineThread`, and the loop reads engine state only through `EngineThread.call`.
Before any upgrade, `process_request` checks access (server/access.py: duplicate headers, the Host
header, a browser Origin, the API key), answers `/health`, `/metrics`, `/v1/models` and `/slots`,
an unknown path (404) and connections beyond the limit (503). `shutdown()` ends every response in
flight with a final event before closing (SIGINT / SIGTERM in `localserve serve`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from localserve.server.access import AccessPolicy, check_access
from localserve.server.context import CLOSE_TIMEOUT_S, ServerState, close_within
from localserve.server.monitor import MIN_MONITOR_INTERVAL_S, MonitorHub, monitor_hello, serve_monitor, slots_json
from localserve.server.session import ResponsesSession

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
MONITOR_PATH = "/v1/monitor"


@dataclass
class LocalServer(ServerState):
    """The server for one model; `await start()` binds, `await shutdown()` or `await close()` stops."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.port = self.config.port
        self.monitor_hub = MonitorHub(self._read_monitor, start_seq=self.engine_thread.engine.events.last_seq)
        self.monitor_hello = monitor_hello(self.engine_thread.engine, self.served_name)
        self.sessions: set[ResponsesSession] = set()
        self._connections: set[ServerConnection] = set()  # every websocket connection being served
        self._monitors: set[ServerConnection] = set()
        self._server: Server | None = None
        self._policy: AccessPolicy | None = None
        self.metrics.num_connections.set_function(lambda: self.num_connections)

    async def start(self) -> None:
        """Bind and start accepting connections (self.port is the bound port afterwards)."""
        config = self.config
        # websockets' own keepalive closes with 1011; the session's keepalive cuts with 1008 instead.
        self._server = await serve(self._handle_connection, config.host, config.port,
                                   process_request=self._process_request, max_size=config.max_message_bytes,
                                   server_header="localserve", ping_interval=None, close_timeout=CLOSE_TIMEOUT_S,
                                   write_limit=config.write_limit_bytes)
        self.port = self._server.sockets[0].getsockname()[1]
        self._policy = AccessPolicy.build(config.host, self.port, config.allowed_hosts, config.allowed_origins,
                                          config.api_key)
        log.info("serving %s on ws://%s:%d%s", self.served_name, config.host, self.port, RESPONSES_PATH)

    async def serve_forever(self) -> None:
        """Start (if needed) and serve until `shutdown()` or `close()`."""
        if self._server is None:
            await self.start()
        await self._server.wait_closed()

    async def shutdown(self) -> None:
        """Stop accepting; end every response in flight (incomplete, `server_shutdown`), tell its client,
        then close every connection; each step bounded by `shutdown_timeout_s`."""
        if self._server is None:
            return
        self._server.close(close_connections=False)  # stop listening; connections go on for now
        for session in list(self.sessions):
            session.shut_down()
        await asyncio.gather(*(close_within(monitor, 1001, "server shutting down") for monitor in self._monitors))
        try:
            await asyncio.wait_for(self._server.wait_closed(), self.config.shutdown_timeout_s)
        except asyncio.TimeoutError:
            log.warning("clients still connected after %.1f s of shutdown: closing them",
                        self.config.shutdown_timeout_s)
            await self.close()

    async def close(self) -> None:
        """Close every connection now (1001) and stop; clients that read nothing are reset."""
        if self._server is None:
            return
        self._server.close()  # websockets' own close waits for each client to take its close frame
        try:
            await asyncio.wait_for(self._server.wait_closed(), CLOSE_TIMEOUT_S + 1)
        except asyncio.TimeoutError:
            for connection in list(self._connections):
                connection.transport.abort()
            try:
                await asyncio.wait_for(self._server.wait_closed(), CLOSE_TIMEOUT_S + 1)
            except asyncio.TimeoutError:
                log.error("the server did not close within %.0f s", 2 * CLOSE_TIMEOUT_S + 2)

    async def _read_monitor(self, after_seq: int):
        return await self.engine_call(lambda engine: (engine.snapshot(), *engine.events.since(after_seq)))

    # ------------------------------------------------------------------ HTTP, before any upgrade
    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/health":
            return _json(connection, HTTPStatus.OK, {"status": "ok"})
        refusal = check_access(request.headers, self._policy)
        if refusal is not None:
            response = _json(connection, refusal.status, _http_error(refusal.code, refusal.message))
            if refusal.status == HTTPStatus.UNAUTHORIZED:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if path in (RESPONSES_PATH, MONITOR_PATH):
            if self.num_connections >= self.config.max_connections:
                return _json(connection, HTTPStatus.SERVICE_UNAVAILABLE, _http_error(
                    "too_many_connections", f"the server holds its limit of {self.config.max_connections} "
                    "connections; retry later"))
            return None  # the websocket handshake goes on
        if path == "/metrics":
            stats = await self.engine_call(lambda engine: engine.stats())
            response = connection.respond(HTTPStatus.OK, self.metrics.render(stats).decode())
            _set_content_type(response, "text/plain; version=0.0.4; charset=utf-8")
            return response
        if path == "/v1/models":
            return _json(connection, HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.served_name, "object": "model", "created": 0, "owned_by": "localserve",
                 "max_model_len": self.engine_thread.engine.max_model_len,
                 "sampling_defaults": self.config.sampling_defaults.to_json()}]})
        if path == "/slots":
            snapshot = await self.monitor_hub.latest(MIN_MONITOR_INTERVAL_S)
            return _json(connection, HTTPStatus.OK, slots_json(snapshot, self.monitor_hello))
        return _json(connection, HTTPStatus.NOT_FOUND, _http_error("not_found", f"no such path: {path[:200]}"))

    # ------------------------------------------------------------------ websockets
    async def _handle_connection(self, connection: ServerConnection) -> None:
        self.num_connections += 1
        self._connections.add(connection)
        try:
            target = urlsplit(connection.request.path)
            if target.path == RESPONSES_PATH:
                session = ResponsesSession(self, connection)
                self.sessions.add(session)
                try:
                    await session.run()
                finally:
                    self.sessions.discard(session)
            else:
                await self._serve_monitor(connection, target.query)
        except Exception:
            log.exception("connection handler failed")
            await close_within(connection, 1011, "internal error")
        finally:
            self._connections.discard(connection)
            self.num_connections -= 1

    async def _serve_monitor(self, connection: ServerConnection, query: str) -> None:
        wanted = parse_qs(query).get("interval", [str(self.config.monitor_interval_s)])[0]
        try:
            interval_s = max(MIN_MONITOR_INTERVAL_S, float(wanted))
        except ValueError:
            await close_within(connection, 1008, "interval must be a number of seconds")
            return
        self._monitors.add(connection)
        try:
            await serve_monitor(connection, self.monitor_hub, self.monitor_hello, interval_s)
        finally:
            self._monitors.discard(connection)


def _http_error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"type": "invalid_request_error", "code": code, "message": message}}


def _set_content_type(response: Response, content_type: str) -> None:
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = content_type


def _json(connection: ServerConnection, status: HTTPStatus, body: Any) -> Response:
    response = connection.respond(status, json.dumps(body) + "\n")
    _set_content_type(response, "application/json")
    return response


class BackgroundServer:
    """A LocalServer on its own event loop thread (for tests, and for a UI in the same process)."""

    def __init__(self, server: LocalServer) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="localserve-server", daemon=True)

    def start(self) -> BackgroundServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout=30)
        return self

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()
