"""The HTTP side of the port: an ASGI app for OpenAI's HTTP API, the other APIs local clients speak, and
the plain GETs.

`POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/responses` (server/openai/api.py: streamed
as server-sent events or whole, by the model each names), `POST /v1/embeddings` and `/api/embed`
(server/embeddings/api.py), Ollama's `/api/...` (server/ollama/api.py), Anthropic's `/v1/messages`
(server/anthropic/api.py), llama.cpp's `/tokenize`, `/detokenize`, `/apply-template` and `/props`
(server/llama_cpp/api.py), `GET /health`, `/metrics`, `/v1/models` (every model served, with its status),
`/v1/models/{id}`, `/slots`, `POST /v1/monitor/ticket` (a single-use ticket for the monitor websocket),
and the web page at `/` and under `/webui/` (server/web_ui.py; off with `ServerConfig.web_ui` False).
Every request passes the same access checks as a websocket handshake (server/wire/access.py; the page's files
without the key, since the page must load to ask for it), then its body is read within bounds
(server/wire/http_exchange.py) and checked into the shared request model through its endpoint's field map
(server/request/fields.py); the `GenerationService` runs it as it runs a websocket's response
(server/generation/over_http.py). Errors take the shape of the path's API (server/wire/api_errors.py). Each
request leaves one log line: method, path, model, status, tokens in and out, time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from localserve.server.anthropic.api import AnthropicApi
from localserve.server.config import ServerConfig
from localserve.server.embeddings.api import EmbeddingRoutes
from localserve.server.generation.over_http import HttpGeneration
from localserve.server.generation.service import GenerationService
from localserve.server.llama_cpp.api import LlamaCppApi
from localserve.server.monitor.metrics import ServerMetrics
from localserve.server.monitor.monitor import MIN_MONITOR_INTERVAL_S, slots_json
from localserve.server.ollama.api import OllamaApi
from localserve.server.openai.api import OpenAiApi
from localserve.server.openai.completions_format import CHAT_COMPLETIONS
from localserve.server.registry.engine_access import engine_result
from localserve.server.registry.registry import ModelRegistry
from localserve.server.request.validation import ProtocolError, shown
from localserve.server.web_ui import SECURITY_HEADERS, WebUi
from localserve.server.wire.access import AccessPolicy, MonitorTickets, check_access
from localserve.server.wire.api_errors import error_shape_for
from localserve.server.wire.connection_phases import connection_limit_message
from localserve.server.wire.http_exchange import ClientGone, HttpExchange

log = logging.getLogger(__name__)

WEBSOCKET_PATHS = ("/v1/responses", "/v1/monitor")
Handler = Callable[[HttpExchange], Awaitable[None]]


class HttpApp:
    """The ASGI application of one LocalServer: the parts it is handed, nothing of the server itself."""

    def __init__(self, *, config: ServerConfig, access_policy: AccessPolicy | None, models: ModelRegistry,
                 responses: GenerationService, metrics: ServerMetrics, monitor_tickets: MonitorTickets,
                 embeddings: EmbeddingRoutes) -> None:
        self.config, self.access_policy, self.models = config, access_policy, models
        self.responses, self.metrics, self.monitor_tickets = responses, metrics, monitor_tickets
        self.web_ui = WebUi.from_package() if config.web_ui else None
        self.generation = HttpGeneration(config, responses)
        self.shutting_down = False
        self.routes: dict[tuple[str, str], Handler] = {
            ("GET", "/metrics"): self._metrics, ("GET", "/v1/models"): self._models, ("GET", "/slots"): self._slots,
            ("POST", "/v1/monitor/ticket"): self._monitor_ticket,
            **OpenAiApi(self.generation, config).routes(),
            **embeddings.routes(),
            **OllamaApi(self.generation, models, config).routes(),
            **AnthropicApi(self.generation, config).routes(),
            **LlamaCppApi(self.generation, models, config, CHAT_COMPLETIONS).routes()}

    @property
    def in_flight(self) -> set:
        """The HTTP responses the engine is still running."""
        return self.generation.in_flight

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets never reach the app
            return
        exchange = HttpExchange(scope, receive, send, self.config.send_timeout_s)
        began = time.monotonic()
        try:
            await self._dispatch(exchange)
        except ClientGone:
            pass
        except ProtocolError as error:
            await self._answer_error(exchange, error)
        except Exception as exc:  # a bug: this request fails with a reason, nothing else does
            log.exception("HTTP %s %s failed", exchange.method, exchange.path[:200])
            await self._answer_error(exchange, ProtocolError("server_error", f"the request failed: "
                                                             f"{type(exc).__name__}", error_type="server_error",
                                                             status=500))
        finally:
            log_request(exchange, time.monotonic() - began)

    def shut_down(self) -> None:
        """The server is stopping: end every HTTP response in flight (reason `server_shutdown`)."""
        self.shutting_down = True
        self.generation.shut_down()

    async def _answer_error(self, exchange: HttpExchange, error: ProtocolError) -> None:
        if exchange.disconnected:
            return
        if exchange.started:  # the status line is out: the connection cannot tell the error any more
            exchange.reset()
            return
        headers = [(b"www-authenticate", b"Bearer")] if error.status == HTTPStatus.UNAUTHORIZED else []
        try:
            exchange.error_shape = error_shape_for(exchange.path)
            await exchange.respond_error(error, headers)
        except ClientGone:
            pass

    async def _dispatch(self, exchange: HttpExchange) -> None:
        # HEAD is answered wherever GET is, as GET would answer it (the transport sends no body for it)
        method = "GET" if exchange.method == "HEAD" else exchange.method
        path = exchange.path
        if path == "/health" and method == "GET":
            return await exchange.respond_json(200, {"status": "ok"})
        page = self.web_ui is not None and method == "GET" and self.web_ui.serves(path)
        refusal = check_access(exchange.headers, self.access_policy, needs_key=method != "OPTIONS" and not page)
        if refusal is not None:
            if refusal.code == "invalid_api_key":  # checked after the origin: a page it allows may read why
                exchange.cors_origin = exchange.headers.get("Origin")
            raise ProtocolError(refusal.code, refusal.message, status=refusal.status)
        exchange.cors_origin = exchange.headers.get("Origin")
        if exchange.connection is not None and exchange.connection.over_limit:
            raise ProtocolError("too_many_connections", connection_limit_message(self.config.max_connections),
                                error_type="rate_limit_error", status=429)
        if self.shutting_down:
            raise ProtocolError("server_shutdown", "the server is shutting down", error_type="server_error",
                                status=503)
        if method == "OPTIONS":  # a browser's CORS preflight, from an allowed origin
            return await exchange.respond_empty(204, exchange.cors_preflight_headers())
        if page:
            return await self._page(exchange)
        handler = self.routes.get((method, path))
        if handler is None and method == "GET" and path.startswith("/v1/models/"):
            handler = self._model
        if handler is not None:
            return await handler(exchange)
        if path in WEBSOCKET_PATHS and method == "GET":
            raise ProtocolError("websocket_required", f"GET {path} is a websocket endpoint: send an upgrade",
                                status=426)
        if any(route_path == path for _, route_path in self.routes) or path in WEBSOCKET_PATHS:
            raise ProtocolError("method_not_allowed", f"{shown(exchange.method, 20)} is not allowed on {path}",
                                status=405)
        raise ProtocolError("not_found", f"no such path: {path[:200]}", status=404)

    # ------------------------------------------------------------------ plain GETs
    async def _metrics(self, exchange: HttpExchange) -> None:
        """The server's figures, with the engine's of the model loaded last (none while no model is)."""
        now = self.models.serving_now()
        stats = None
        if now is not None:
            try:
                stats = await engine_result(now.engine.stats())
            except Exception:
                if self.models.serving_now() is now:
                    raise
                # unloaded while read (its thread refuses reads at once): the server's own figures
        data = self.metrics.render(stats)
        await exchange.start(200, b"text/plain; version=0.0.4; charset=utf-8",
                             [(b"content-length", str(len(data)).encode())])
        await exchange.write(data, more=False)

    async def _models(self, exchange: HttpExchange) -> None:
        await exchange.respond_json(200, {"object": "list", "data": self.models.listing()})

    async def _model(self, exchange: HttpExchange) -> None:
        """Any name of a model gives its object (its id and status among them)."""
        entry = self.models.find(exchange.path.removeprefix("/v1/models/"))
        await exchange.respond_json(200, self.models.describe(entry))

    async def _slots(self, exchange: HttpExchange) -> None:
        """The requests and the pool of the model loaded last."""
        now = self.models.serving_now()
        no_model = ProtocolError("no_model_loaded", "no model is loaded now: /slots shows a loaded model's",
                                 error_type="server_error", status=503)
        if now is None:
            raise no_model
        try:
            snapshot = await now.monitor_hub.latest(MIN_MONITOR_INTERVAL_S)
        except Exception:
            if self.models.serving_now() is now:
                raise
            raise no_model from None  # unloaded while read
        await exchange.respond_json(200, slots_json(snapshot, now.monitor_hello))

    async def _monitor_ticket(self, exchange: HttpExchange) -> None:
        """A ticket that opens one `/v1/monitor` socket (the key checked here stands for it there)."""
        await exchange.respond_json(200, {"ticket": self.monitor_tickets.issue(),
                                          "expires_in_s": self.monitor_tickets.lifetime_s},
                                    [(b"cache-control", b"no-store")])

    async def _page(self, exchange: HttpExchange) -> None:
        static = self.web_ui.find(exchange.path)
        if static is None:
            raise ProtocolError("not_found", f"no such path: {exchange.path[:200]}", status=404)
        headers = [*SECURITY_HEADERS, (b"etag", static.etag.encode())]
        if exchange.headers.get("If-None-Match") == static.etag:
            return await exchange.respond_empty(304, headers)
        await exchange.start(200, static.content_type.encode(),
                             [*headers, (b"content-length", str(len(static.body)).encode())])
        await exchange.write(static.body, more=False)


def log_request(exchange: HttpExchange, seconds: float) -> None:
    """The request's one log line: method, path, model, status, tokens in and out, time."""
    status = exchange.status if exchange.status is not None else "gone"  # the client left before an answer
    tokens = f"{exchange.tokens[0]} in, {exchange.tokens[1]} out" if exchange.tokens is not None else "-"
    log.info("%s %s model=%s status=%s tokens=%s %.3fs", exchange.method, exchange.path[:200],
             exchange.model or "-", status, tokens, seconds)
