"""One HTTP request and its response over ASGI, with this server's bounds (no knowledge of any endpoint).

The body is read within `http_body_timeout_s` and up to `max_message_bytes` (413 beyond, checked on
Content-Length first); errors go out in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`; a streamed body is written piece by piece, each piece taken by the client within
`send_timeout_s` or the connection is reset (a client that stops reading holds nothing: asyncio's
graceful close would wait for it forever). Browser origins that passed the access check get CORS headers.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from websockets.datastructures import Headers

from localserve.server.config import INLINE_PARSE_BYTES, ServerConfig
from localserve.server.request.fields import WireFormat, parse_request
from localserve.server.request.generation_request import GenerationRequest
from localserve.server.request.validation import ProtocolError, parse_json_object

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream; charset=utf-8"
NDJSON = b"application/x-ndjson"
CORS_METHODS = b"GET, POST, OPTIONS"
CORS_HEADERS = ("Authorization", "Content-Type")  # always allowed to an allowed origin
# A preflight also allows the headers it asks for (Access-Control-Request-Headers), at most this many: the
# browser SDKs send their own (OpenAI's and Anthropic's x-stainless-*, Anthropic's x-api-key and
# anthropic-version), and the origin check, not a header list, is what keeps other pages out.
MAX_CORS_HEADERS = 64
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110)
CLOSING_ERRORS = ("request_too_large", "request_timeout", "too_many_connections")


class ClientGone(Exception):
    """The client disconnected, or stopped reading and was reset: nobody is left to answer."""


def error_body(error: ProtocolError) -> dict[str, Any]:
    """OpenAI's HTTP error object for a ProtocolError."""
    return {"error": {"message": error.message, "type": error.error_type, "param": error.param, "code": error.code}}


def _parse_body(body: bytes, wire: WireFormat, config: ServerConfig) -> GenerationRequest:
    return parse_request(parse_json_object(body, "the body", "the body must be a JSON object"), wire, config.limits)


class HttpExchange:
    """One request (method, path, headers, body) and the response written to it."""

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any, send_timeout_s: float) -> None:
        self.scope, self._receive, self._send = scope, receive, send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = Headers([(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]])
        self.connection = scope.get("state", {}).get("connection")  # transport.HttpConnection
        self.send_timeout_s = send_timeout_s
        self.started = False
        self.disconnected = False
        self.cors_origin: str | None = None  # set once the Origin passed the access check
        self.error_shape: Callable[[ProtocolError], dict[str, Any]] = error_body  # the path's API's errors
        self.status: int | None = None  # of the response, once started
        self.model: str | None = None  # what the request's log line says of a generation: the model,
        self.tokens: tuple[int, int] | None = None  # and the tokens in and out

    # ------------------------------------------------------------------ reading
    async def read_json(self, max_bytes: int, timeout_s: float) -> dict[str, Any]:
        """The body as a JSON object; a ProtocolError (400, 408, 413) for anything else."""
        body = await self._read_body(max_bytes, timeout_s)
        return parse_json_object(body, "the body", "the body must be a JSON object")

    async def read_request(self, wire: WireFormat, config: ServerConfig) -> GenerationRequest:
        """The body within the server's bounds, checked by `wire`'s field map into the one request model. A large
        body (one with images: decoding them takes a while) is parsed and checked on a worker thread, so the
        other clients are served meanwhile."""
        body = await self._read_body(config.max_body_bytes, config.http_body_timeout_s)
        if len(body) <= INLINE_PARSE_BYTES:
            return _parse_body(body, wire, config)
        return await asyncio.to_thread(_parse_body, body, wire, config)

    async def _read_body(self, max_bytes: int, timeout_s: float) -> bytes:
        too_large = ProtocolError("request_too_large", f"the body exceeds {max_bytes} bytes", status=413)
        length = self.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise too_large
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(self._receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise ProtocolError("request_timeout", f"the body did not arrive within {timeout_s:g} s",
                                    status=408) from None
            if message["type"] == "http.disconnect":
                self.disconnected = True
                raise ClientGone
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > max_bytes:
                raise too_large
            if not message.get("more_body", False):
                return b"".join(parts)

    async def wait_disconnect(self) -> None:
        """Return when the client goes away (call only once the body has been read)."""
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True

    # ------------------------------------------------------------------ writing
    async def respond_json(self, status: int, body: Any, headers: list[tuple[bytes, bytes]] | None = None,
                           close: bool = False) -> None:
        """A whole JSON response (`close`: end the connection after it, as when a body was left unread)."""
        data = (json.dumps(body) + "\n").encode()
        extra = list(headers or []) + ([(b"connection", b"close")] if close else [])
        await self.start(status, JSON, extra + [(b"content-length", str(len(data)).encode())])
        await self.write(data, more=False)

    async def respond_error(self, error: ProtocolError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        # a refused body may be unread (413, 408): the connection cannot carry another request
        await self.respond_json(error.status, self.error_shape(error), headers, close=error.code in CLOSING_ERRORS)

    async def respond_empty(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await self.start(status, None, headers + [(b"content-length", b"0")])
        await self.write(b"", more=False)

    async def start(self, status: int, content_type: bytes | None, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and headers."""
        all_headers = list(headers)
        if content_type is not None:
            all_headers.append((b"content-type", content_type))
        if self.cors_origin is not None:
            all_headers += [(b"access-control-allow-origin", self.cors_origin.encode("latin-1")), (b"vary", b"Origin")]
        self.started, self.status = True, int(status)
        await self._timed(self._send({"type": "http.response.start", "status": int(status), "headers": all_headers}))

    async def write(self, data: bytes, more: bool = True) -> None:
        """Send a piece of the body; the client must take it within send_timeout_s (else ClientGone)."""
        await self._timed(self._send({"type": "http.response.body", "body": data, "more_body": more}))

    async def _timed(self, send: Any) -> None:
        try:
            await asyncio.wait_for(send, self.send_timeout_s)
        except asyncio.TimeoutError:
            self.reset()
            raise ClientGone from None

    def reset(self) -> None:
        """Drop the connection without a goodbye (a client that reads nothing can take none)."""
        self.disconnected = True
        if self.connection is not None:
            self.connection.reset()

    def cors_preflight_headers(self) -> list[tuple[bytes, bytes]]:
        """A preflight's answer: the methods, the headers always allowed and those it asked for (valid
        names, at most MAX_CORS_HEADERS of them), and how long the browser may keep it."""
        asked = [name.strip() for name in self.headers.get("Access-Control-Request-Headers", "").split(",")]
        allowed = list(CORS_HEADERS)
        seen = {name.lower() for name in allowed}
        for name in asked:
            if len(allowed) == len(CORS_HEADERS) + MAX_CORS_HEADERS:
                break
            if HEADER_NAME.fullmatch(name) and name.lower() not in seen:
                seen.add(name.lower())
                allowed.append(name)
        return [(b"access-control-allow-methods", CORS_METHODS),
                (b"access-control-allow-headers", ", ".join(allowed).encode("latin-1")),
                (b"access-control-max-age", b"600")]


def ndjson(data: Any) -> bytes:
    """One line of newline-delimited JSON (Ollama's streams)."""
    return (json.dumps(data) + "\n").encode()


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: `event:` (the Responses API names each) and one `data:` line of JSON."""
    text = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "").encode() + f"data: {text}\n\n".encode()

