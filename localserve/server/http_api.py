"""The HTTP side of the port: an ASGI app for OpenAI's HTTP API and the plain GETs.

`POST /v1/chat/completions`, `POST /v1/completions` and `POST /v1/responses` (streamed as server-sent
events or whole, by the model each names), `POST /v1/embeddings` and `/api/embed`
(server/embeddings_api.py), `GET /health`, `/metrics`, `/v1/models` (every model served, with its status),
`/v1/models/{id}`, `/slots`, `POST /v1/monitor/ticket` (a single-use ticket for the monitor websocket),
and the web page at `/` and under `/webui/` (server/web_ui.py; off with `ServerConfig.web_ui` False).
Every request passes the same access checks as a websocket handshake (server/access.py; the page's files
without the key, since the page must load to ask for it), then its body is read within
bounds (server/http_exchange.py) and checked into the shared request model through its endpoint's
field map (server/request_fields.py); the `ResponseService` runs it as it runs a websocket's
response. A client that disconnects, or stops reading for `send_timeout_s`, has its response aborted
at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from localserve.server.access import AccessPolicy, MonitorTickets, check_access
from localserve.server.completion_events import CompletionView
from localserve.server.completions_format import CHAT_COMPLETIONS, COMPLETIONS
from localserve.server.connection_phases import connection_limit_message
from localserve.server.context import ServerConfig, engine_result
from localserve.server.embeddings_api import EmbeddingRoutes
from localserve.server.http_exchange import EVENT_STREAM, ClientGone, HttpExchange, error_body, sse
from localserve.server.metrics import ServerMetrics
from localserve.server.models import ModelRegistry
from localserve.server.monitor import MIN_MONITOR_INTERVAL_S, slots_json
from localserve.server.request_fields import WireFormat, parse_request
from localserve.server.request_model import GenerationRequest
from localserve.server.response_events import ResponseStream, new_id
from localserve.server.responses import ResponseService
from localserve.server.responses_format import RESPONSES_HTTP
from localserve.server.validation import ProtocolError, shown
from localserve.server.web_ui import SECURITY_HEADERS, WebUi

log = logging.getLogger(__name__)

WEBSOCKET_PATHS = ("/v1/responses", "/v1/monitor")
SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class HttpApi:
    """The ASGI application of one LocalServer: the parts it is handed, nothing of the server itself."""

    def __init__(self, *, config: ServerConfig, access_policy: AccessPolicy, models: ModelRegistry,
                 responses: ResponseService, metrics: ServerMetrics, monitor_tickets: MonitorTickets,
                 embeddings: EmbeddingRoutes) -> None:
        self.config, self.access_policy, self.models = config, access_policy, models
        self.responses, self.metrics, self.monitor_tickets = responses, metrics, monitor_tickets
        self.web_ui = WebUi.from_package() if config.web_ui else None
        self.in_flight: set[ResponseStream] = set()  # HTTP responses the engine is still running
        self.shutting_down = False
        self.routes: dict[tuple[str, str], Callable[[HttpExchange], Awaitable[None]]] = {
            ("GET", "/metrics"): self._metrics, ("GET", "/v1/models"): self._models, ("GET", "/slots"): self._slots,
            ("POST", "/v1/chat/completions"): self._chat_completions, ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/responses"): self._responses, ("POST", "/v1/monitor/ticket"): self._monitor_ticket,
            **embeddings.routes()}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets never reach the app
            return
        exchange = HttpExchange(scope, receive, send, self.config.send_timeout_s)
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

    def shut_down(self) -> None:
        """The server is stopping: end every HTTP response in flight (reason `server_shutdown`)."""
        self.shutting_down = True
        for stream in list(self.in_flight):
            self.responses.shut_down(stream)

    async def _answer_error(self, exchange: HttpExchange, error: ProtocolError) -> None:
        if exchange.disconnected:
            return
        if exchange.started:  # the status line is out: the connection cannot tell the error any more
            exchange.reset()
            return
        headers = [(b"www-authenticate", b"Bearer")] if error.status == HTTPStatus.UNAUTHORIZED else []
        try:
            await exchange.respond_error(error, headers)
        except ClientGone:
            pass

    async def _dispatch(self, exchange: HttpExchange) -> None:
        method, path = exchange.method, exchange.path
        if path == "/health" and method == "GET":
            return await exchange.respond_json(200, {"status": "ok"})
        page = self.web_ui is not None and method == "GET" and self.web_ui.serves(path)
        refusal = check_access(exchange.headers, self.access_policy, needs_key=method != "OPTIONS" and not page)
        if refusal is not None:
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
            raise ProtocolError("method_not_allowed", f"{shown(method, 20)} is not allowed on {path}", status=405)
        raise ProtocolError("not_found", f"no such path: {path[:200]}", status=404)

    # ------------------------------------------------------------------ plain GETs
    async def _metrics(self, exchange: HttpExchange) -> None:
        """The server's figures, with the engine's of the model loaded last (none while no model is)."""
        now = self.models.serving_now()
        data = self.metrics.render(await engine_result(now.engine.stats()) if now is not None else None)
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
        if now is None:
            raise ProtocolError("no_model_loaded", "no model is loaded now: /slots shows a loaded model's",
                                error_type="server_error", status=503)
        snapshot = await now.monitor_hub.latest(MIN_MONITOR_INTERVAL_S)
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

    # ------------------------------------------------------------------ generation
    async def _request(self, exchange: HttpExchange, wire: WireFormat) -> GenerationRequest:
        body = await exchange.read_json(self.config.max_message_bytes, self.config.http_body_timeout_s)
        return parse_request(body, wire, self.config.limits)

    async def _chat_completions(self, exchange: HttpExchange) -> None:
        request = await self._request(exchange, CHAT_COMPLETIONS)
        await self._generate(exchange, request, lambda stream: CompletionView(stream, chat=True,
                                                                              include_usage=request.include_usage))

    async def _completions(self, exchange: HttpExchange) -> None:
        request = await self._request(exchange, COMPLETIONS)
        await self._generate(exchange, request, lambda stream: CompletionView(stream, chat=False,
                                                                              include_usage=request.include_usage))

    async def _responses(self, exchange: HttpExchange) -> None:
        await self._generate(exchange, await self._request(exchange, RESPONSES_HTTP), None)

    async def _generate(self, exchange: HttpExchange, request: GenerationRequest,
                        make_view: Callable[[ResponseStream], CompletionView] | None) -> None:
        """Run one response for this exchange; `make_view` shapes chat or text completions (None: Responses)."""
        responses = self.responses
        owner = new_id("http")  # a store: false response belongs to this request alone
        wake = asyncio.Event()
        stream = await responses.start(request, owner, lambda _: wake.set())
        self.in_flight.add(stream)

        async def watch_disconnect() -> None:
            await exchange.wait_disconnect()
            wake.set()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            view = make_view(stream) if make_view is not None else None
            if request.stream:
                await self._stream(exchange, stream, view, wake)
            else:
                while not stream.is_done and not exchange.disconnected:
                    await wake.wait()
                    wake.clear()
                if not exchange.disconnected:
                    await self._respond_whole(exchange, stream, view)
        finally:
            watcher.cancel()
            self.in_flight.discard(stream)
            if not stream.is_done:  # the client left (or was cut) first: its blocks go back now
                responses.abandon(stream)
            responses.end_owner(owner)

    async def _respond_whole(self, exchange: HttpExchange, stream: ResponseStream,
                             view: CompletionView | None) -> None:
        if view is None:  # a Responses object tells every outcome itself (failed, incomplete)
            return await exchange.respond_json(200, stream.response_object(stream.status))
        if view.ended_normally:
            return await exchange.respond_json(200, view.completion())
        raise _ending_error(stream)

    async def _stream(self, exchange: HttpExchange, stream: ResponseStream, view: CompletionView | None,
                      wake: asyncio.Event) -> None:
        """Server-sent events as the engine produces them, coalesced while the client reads slower."""
        await exchange.start(200, EVENT_STREAM, SSE_HEADERS)
        while not exchange.disconnected:
            done = stream.is_done  # read once: the stream may end while a write below awaits the client
            if view is None:
                pieces = [sse(event, event["type"]) for event in stream.drain()]
            else:
                pieces = [sse(chunk) for chunk in view.chunks()]
            if done and view is not None:
                if not view.ended_normally:
                    pieces.append(sse(error_body(_ending_error(stream))))
                pieces.append(sse("[DONE]"))
            if pieces or done:
                await exchange.write(b"".join(pieces), more=not done)
            if done:
                return
            await wake.wait()
            wake.clear()


def _ending_error(stream: ResponseStream) -> ProtocolError:
    """Why a chat or text completion did not end normally (over HTTP nothing else cancels a response)."""
    if stream.status == "failed":
        return ProtocolError("server_error", f"the request failed: {stream.error_message}",
                             error_type="server_error", status=500)
    return ProtocolError("server_shutdown", "the server is shutting down", error_type="server_error", status=503)
