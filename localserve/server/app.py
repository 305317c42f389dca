"""The server: OpenAI's HTTP API and the websocket endpoints on one port.

One asyncio loop serves every connection; each loaded model's engine runs on its own thread behind
`EngineThread`, and the server reads it only through `EngineAccess` (its facts, submit and abort,
statistics, snapshots and events), lent per request by the `ModelRegistry` (server/registry/registry.py), which
loads and unloads the models requests ask for. `LocalServer` builds the parts and hands each what it
uses: the configuration, the models, the conversation store, the metrics, the response service. Each
connection starts as HTTP/1.1
(uvicorn's h11 protocol, server/wire/transport.py): requests go to the ASGI app of server/http_app.py;
a websocket upgrade is handed to `websockets`, whose handshake runs `_process_request` (access checks:
duplicate headers, the Host header, a browser Origin, the API key, or for `/v1/monitor` a single-use
ticket from `POST /v1/monitor/ticket` instead, since a browser cannot send the key on a websocket; the
path; the connection limit) before `/v1/responses` or `/v1/monitor` is served. Every connection has
its place in the `ConnectionBook` (server/wire/connection_phases.py) from its first byte to its last,
across the upgrade: the transport moves it through the HTTP phases and the handshake, the handler on
from there (a monitor is served at once, a `/v1/responses` websocket once its first event comes).
`shutdown()` ends every response in flight, on either transport, with a final event before closing
(SIGINT / SIGTERM in `localserve serve`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection
from websockets.http11 import Request, Response

from localserve.server.config import ServerConfig
from localserve.server.embeddings.api import EmbeddingRoutes
from localserve.server.generation.conversations import ConversationStore
from localserve.server.generation.service import GenerationService
from localserve.server.http_app import HttpApp
from localserve.server.monitor.metrics import ServerMetrics
from localserve.server.monitor.monitor import MIN_MONITOR_INTERVAL_S, serve_monitor
from localserve.server.openai.responses_socket import ResponsesSession
from localserve.server.registry.registry import ModelRegistry
from localserve.server.wire.access import AccessPolicy, MonitorTickets, check_access, check_bind_safety
from localserve.server.wire.closing import CLOSE_TIMEOUT_S, close_within
from localserve.server.wire.connection_phases import LIMIT_REACHED_REASON, ConnectionBook, FirstEventWait, Phase, Slot
from localserve.server.wire.transport import SharedPort

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
MONITOR_PATH = "/v1/monitor"


class LocalServer:
    """The server for the models of `models`; `await start()` binds, `await shutdown()` or `await close()`
    stops (the caller unloads the models afterwards: `models.unload_all()`)."""

    def __init__(self, models: ModelRegistry, config: ServerConfig | None = None) -> None:
        self.config = config = config or ServerConfig()
        check_bind_safety(config)
        self.models = models
        self.metrics = ServerMetrics(models.catalog.default.id)
        self.conversations = ConversationStore(config.max_stored_responses, config.max_stored_chars)
        self.responses = GenerationService(models, config, self.conversations, self.metrics)
        self.embeddings = EmbeddingRoutes(models, config)
        self.monitor_tickets = MonitorTickets()  # issued by the HTTP API, redeemed by the monitor's handshake
        self.connections = ConnectionBook(config.max_connections,
                                          config.max_unfinished_connections or config.max_connections)
        self.port = config.port
        self.sessions: set[ResponsesSession] = set()
        self.http_api: HttpApp | None = None  # built by start(), once the access policy knows the port
        self._connections: set[ServerConnection] = set()  # every websocket connection being served
        self._monitors: set[ServerConnection] = set()
        self._server: Server | None = None
        self._port: SharedPort | None = None
        self.access_policy: AccessPolicy | None = None
        self.metrics.watch_connections(self.connections.counts)

    @property
    def num_connections(self) -> int:
        """Open connections, of every kind and phase."""
        return self.connections.num_open

    async def start(self) -> None:
        """Bind and start accepting connections (self.port is the bound port afterwards)."""
        config = self.config
        # the ASGI app takes the connections itself; its access policy names the port, known once bound (no
        # request arrives before)
        self.http_api = HttpApp(config=config, access_policy=None, models=self.models, responses=self.responses,
                                metrics=self.metrics, monitor_tickets=self.monitor_tickets, embeddings=self.embeddings)
        self._port = SharedPort(self.http_api, self.connections, max_message_bytes=config.max_body_bytes,
                                write_limit_bytes=config.write_limit_bytes, close_timeout_s=CLOSE_TIMEOUT_S,
                                bounds=config.phase_bounds)
        self._server = await self._port.listen(config.host, config.port, self._process_request,
                                               self._handle_connection)
        self.port = self._server.sockets[0].getsockname()[1]
        self.access_policy = self.http_api.access_policy = AccessPolicy.build(
            config.host, self.port, config.allowed_hosts, config.allowed_origins, config.api_key)
        self.models.start()
        served = ", ".join(entry.id for entry in self.models.catalog.entries)
        log.info("serving %s on ws://%s:%d/v1/responses and http://%s:%d/v1", served, config.host, self.port,
                 config.host, self.port)

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
        self.http_api.shut_down()
        for connection in self._port.http_connections:
            connection.shutdown()  # idle ones close now, busy ones after their response
        await asyncio.gather(*(close_within(monitor, 1001, "server shutting down") for monitor in self._monitors))
        try:
            await asyncio.wait_for(self._all_closed(), self.config.shutdown_timeout_s)
        except asyncio.TimeoutError:
            log.warning("clients still connected after %.1f s of shutdown: closing them",
                        self.config.shutdown_timeout_s)
            await self.close()

    async def close(self) -> None:
        """Close every connection now (websockets 1001) and stop; clients that read nothing are reset."""
        if self._server is None:
            return
        self._server.close()  # websockets' own close waits for each client to take its close frame
        self.http_api.shut_down()
        for connection in self._port.http_connections:
            connection.shutdown()
        try:
            await asyncio.wait_for(self._all_closed(), CLOSE_TIMEOUT_S + 1)
        except asyncio.TimeoutError:
            for connection in [*self._connections, *self._port.http_connections]:
                connection.transport.abort()
            try:
                await asyncio.wait_for(self._all_closed(), CLOSE_TIMEOUT_S + 1)
            except asyncio.TimeoutError:
                log.error("the server did not close within %.0f s", 2 * CLOSE_TIMEOUT_S + 2)

    async def _all_closed(self) -> None:
        await self._server.wait_closed()
        while self._port.http_connections or self._port.uvicorn_state.tasks:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------------ websocket handshakes
    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        target = urlsplit(request.path)
        path = target.path
        refusal = check_access(request.headers, self.access_policy,
                               needs_key=not (path == MONITOR_PATH and self._has_monitor_ticket(target.query)))
        if refusal is not None:
            response = _json(connection, refusal.status, _http_error(refusal.code, refusal.message))
            if refusal.status == HTTPStatus.UNAUTHORIZED:
                response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if path not in (RESPONSES_PATH, MONITOR_PATH):
            return _json(connection, HTTPStatus.NOT_FOUND, _http_error(
                "not_found", f"no websocket endpoint at {path[:200]}: use {RESPONSES_PATH} or {MONITOR_PATH}"))
        if self.connections.served_full:  # it could not be served: refused now rather than at its first event
            return _json(connection, HTTPStatus.TOO_MANY_REQUESTS, _http_error(
                "too_many_connections", self.connections.limit_message, "rate_limit_error"))
        return None  # the websocket handshake goes on

    def _has_monitor_ticket(self, query: str) -> bool:
        """The query names a ticket this server issued, unused and unexpired (it is spent now)."""
        tickets = parse_qs(query).get("ticket", [])
        return len(tickets) == 1 and self.monitor_tickets.redeem(tickets[0])

    # ------------------------------------------------------------------ websockets
    async def _handle_connection(self, connection: ServerConnection, slot: Slot) -> None:
        self._connections.add(connection)
        try:
            target = urlsplit(connection.request.path)
            if target.path == RESPONSES_PATH:
                session = ResponsesSession(self.config, self.responses, connection,
                                           FirstEventWait(self.connections, slot))
                self.sessions.add(session)
                try:
                    await session.run()
                finally:
                    self.sessions.discard(session)
            elif self.connections.enter(slot, Phase.WEBSOCKET):  # a monitor's upgrade is its whole request
                await self._serve_monitor(connection, target.query)
            else:
                await close_within(connection, 1013, LIMIT_REACHED_REASON)
        except Exception:
            log.exception("connection handler failed")
            await close_within(connection, 1011, "internal error")
        finally:
            self._connections.discard(connection)

    async def _serve_monitor(self, connection: ServerConnection, query: str) -> None:
        wanted = parse_qs(query).get("interval", [str(self.config.monitor_interval_s)])[0]
        try:
            interval_s = max(MIN_MONITOR_INTERVAL_S, float(wanted))
        except ValueError:
            await close_within(connection, 1008, "interval must be a number of seconds")
            return
        self._monitors.add(connection)
        try:
            await serve_monitor(connection, self.models, interval_s, self.connections.counts)
        finally:
            self._monitors.discard(connection)


def _http_error(code: str, message: str, error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


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
        """Close the server and its event loop (once; stopping again does nothing)."""
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()
