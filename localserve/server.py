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
import ipaddress
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from localserve.engine_thread import EngineThread
from localserve.metrics import EngineStats, ServerMetrics
from localserve.monitor import MIN_MONITOR_INTERVAL_S, read_monitor_snapshot, read_slots, serve_monitor
from localserve.protocol import ProtocolError
from localserve.responses_session import ResponsesSession

log = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
MONITOR_PATH = "/v1/monitor"


@dataclass
class ServerConfig:
    """Where to listen, who may connect, and the bounds on what they may send."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0: any free port (see LocalServer.port)
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed besides the server's own
    model_alias: str | None = None  # the name clients use and /v1/models lists (default: the model's)
    max_message_bytes: int = 1 << 20  # a bigger client message closes the connection with 1009
    max_connections: int = 256
    send_queue_size: int = 256  # server events waiting to be sent, per connection
    max_stored_responses: int = 1024  # conversations kept for previous_response_id (LRU)
    max_stored_chars: int = 64 << 20  # and at most this much text in all of them
    default_max_output_tokens: int = 1024  # when response.create gives no max_output_tokens
    default_temperature: float = 1.0  # when response.create gives no temperature (OpenAI's default)
    monitor_interval_s: float = 0.5  # default time between /v1/monitor snapshots


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_safety(config: ServerConfig) -> None:
    """Refuse to listen beyond this machine without an API key (raises ValueError)."""
    if not is_loopback(config.host) and not config.api_key:
        raise ValueError(f"refusing to listen on {config.host}: anyone who can reach it could use the "
                         "server; pass --api-key KEY (clients send 'Authorization: Bearer KEY'), or bind "
                         "127.0.0.1")


class ConversationStore:
    """The conversations of finished responses (messages plus reply), least recently used evicted first.

    Bounded both in conversations and in characters, so long conversations cannot pile up memory.
    """

    def __init__(self, capacity: int, max_chars: int) -> None:
        self.capacity, self.max_chars = capacity, max_chars
        self.num_chars = 0
        self._conversations: OrderedDict[str, tuple[list[dict[str, str]], int]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, str]] | None:
        """A copy of the conversation ending with `response_id`'s reply, or None."""
        entry = self._conversations.get(response_id)
        if entry is None:
            return None
        self._conversations.move_to_end(response_id)
        return list(entry[0])

    def put(self, response_id: str, messages: list[dict[str, str]]) -> None:
        num_chars = sum(len(message["content"]) for message in messages)
        self._conversations[response_id] = (messages, num_chars)
        self.num_chars += num_chars
        while len(self._conversations) > 1 and (len(self._conversations) > self.capacity
                                                 or self.num_chars > self.max_chars):
            _, (_, evicted_chars) = self._conversations.popitem(last=False)
            self.num_chars -= evicted_chars

    def __len__(self) -> int:
        return len(self._conversations)


@dataclass
class LocalServer:
    """The server for one model; `await start()` binds, `await close()` stops."""

    engine_thread: EngineThread
    tokenizer: Any  # localserve.tokenizer.Tokenizer: encode_chat, decode
    model_name: str
    config: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        check_bind_safety(self.config)
        self.served_name = self.config.model_alias or self.model_name
        self.metrics = ServerMetrics(self.served_name)
        self.conversations = ConversationStore(self.config.max_stored_responses, self.config.max_stored_chars)
        self.num_connections = 0
        self.port = self.config.port
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

    def check_model(self, model: str | None) -> None:
        """Accept no model, "default", the served name or the model's own; else `model_not_found`."""
        if model not in (None, "default", self.served_name, self.model_name):
            raise ProtocolError("model_not_found", f"model {model!r} is not served here; this server serves "
                                f"{self.served_name!r} (or send 'default')", "model", status=404)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def engine_call(self, fn) -> Any:
        """Run fn(engine) on the engine thread between steps and wait for its result."""
        return await asyncio.wrap_future(self.engine_thread.call(fn))

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
            stats = await self.engine_call(EngineStats.read)
            response = connection.respond(HTTPStatus.OK, self.metrics.render(stats).decode())
            _set_content_type(response, "text/plain; version=0.0.4; charset=utf-8")
            return response
        if path == "/v1/models":
            return _json(connection, HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.served_name, "object": "model", "created": 0, "owned_by": "localserve",
                 "max_model_len": self.engine_thread.engine.max_model_len}]})
        if path == "/slots":
            return _json(connection, HTTPStatus.OK, await self.engine_call(read_slots))
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
                await serve_monitor(connection, lambda: self.engine_call(read_monitor_snapshot), interval_s)
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
