"""The websocket server: `/v1/responses` and `/v1/monitor`, plus plain GETs on the same port.

One asyncio loop (the `websockets` library) serves every connection; the engine runs on its own
thread behind `EngineThread`, and the loop reads engine state only through `EngineThread.call`.
Before any upgrade, `process_request` answers `/health`, `/metrics`, `/v1/models` and `/slots`, and
refuses a missing or wrong API key (401), a browser Origin other than the server's own (403), an
unknown path (404) and connections beyond the limit (503).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from localserve.server.context import ServerState
from localserve.server.monitor import MIN_MONITOR_INTERVAL_S, MonitorHub, monitor_hello, serve_monitor, slots_json
from localserve.server.session import ResponsesSession

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
MONITOR_PATH = "/v1/monitor"


@dataclass
class LocalServer(ServerState):
    """The server for one model; `await start()` binds, `await close()` stops."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.num_connections = 0
        self.port = self.config.port
        self.monitor_hub = MonitorHub(self._read_monitor, start_seq=self.engine_thread.engine.events.last_seq)
        self.monitor_hello = monitor_hello(self.engine_thread.engine, self.served_name)
        self._server: Server | None = None
        self._allowed_origins: set[str] = set()

    async def start(self) -> None:
        """Bind and start accepting connections (self.port is the bound port afterwards)."""
        config = self.config
        self._server = await serve(self._handle_connection, config.host, config.port,
                                   process_request=self._process_request, max_size=config.max_message_bytes,
                                   server_header="localserve")
        self.port = self._server.sockets[0].getsockname()[1]
        own = {f"http://{host}:{self.port}" for host in ("127.0.0.1", "localhost", "[::1]", config.host)}
        self._allowed_origins = own | {origin.rstrip("/") for origin in config.allowed_origins}
        log.info("serving %s on ws://%s:%d%s", self.served_name, config.host, self.port, RESPONSES_PATH)

    async def serve_forever(self) -> None:
        """Start (if needed) and serve until cancelled."""
        if self._server is None:
            await self.start()
        await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _read_monitor(self, after_seq: int):
        return await self.engine_call(lambda engine: (engine.snapshot(), *engine.events.since(after_seq)))

    # ------------------------------------------------------------------ HTTP, before any upgrade
    async def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/health":
            return _json(connection, HTTPStatus.OK, {"status": "ok"})
        origin = request.headers.get("Origin")
        if origin is not None and origin.rstrip("/") not in self._allowed_origins:
            return _json(connection, HTTPStatus.FORBIDDEN, _http_error(
                "origin_not_allowed", f"Origin {origin!r} may not use this server; start it with "
                "--allowed-origins to allow it"))
        if self.config.api_key is not None and not _has_key(request.headers, self.config.api_key):
            response = _json(connection, HTTPStatus.UNAUTHORIZED, _http_error(
                "invalid_api_key", "missing or wrong API key: send 'Authorization: Bearer KEY'"))
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
        return _json(connection, HTTPStatus.NOT_FOUND, _http_error("not_found", f"no such path: {path}"))

    # ------------------------------------------------------------------ websockets
    async def _handle_connection(self, connection: ServerConnection) -> None:
        self.num_connections += 1
        try:
            target = urlsplit(connection.request.path)
            if target.path == RESPONSES_PATH:
                await ResponsesSession(self, connection).run()
            else:
                wanted = parse_qs(target.query).get("interval", [str(self.config.monitor_interval_s)])[0]
                try:
                    interval_s = max(MIN_MONITOR_INTERVAL_S, float(wanted))
                except ValueError:
                    await connection.close(1008, "interval must be a number of seconds")
                    return
                await serve_monitor(connection, self.monitor_hub, self.monitor_hello, interval_s)
        except Exception:
            log.exception("connection handler failed")
            await connection.close(1011, "internal error")
        finally:
            self.num_connections -= 1


def _has_key(headers: Headers, api_key: str) -> bool:
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


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
