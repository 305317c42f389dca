"""The error body of each API this port speaks, chosen by the request's path (no I/O here).

OpenAI's paths (and every other path) answer `{"error": {"message", "type", "param", "code"}}`;
Ollama's (`/api/...`) `{"error": MESSAGE}`, as Ollama's own server and its clients read it; Anthropic's
(`/v1/messages...`) `{"type": "error", "error": {"type", "message"}}`, the `type` named after the status
as Anthropic names them. The last two carry this server's `code` and `param` beside, so every refusal
names its field on every API (clients read the fields they know and skip the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localserve.server.request.validation import ProtocolError
from localserve.server.wire.http_exchange import error_body

ErrorShape = Callable[[ProtocolError], dict[str, Any]]

OLLAMA_PREFIX = "/api/"
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error types by HTTP status (its docs' "HTTP errors"); a status it has none for is an api_error.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                         413: "request_too_large", 426: "invalid_request_error", 429: "rate_limit_error",
                         431: "invalid_request_error", 503: "overloaded_error"}


def ollama_error_body(error: ProtocolError) -> dict[str, Any]:
    """Ollama's error object: the message, with this server's code and field beside it."""
    return {"error": error.message, "code": error.code, "param": error.param}


def anthropic_error_body(error: ProtocolError) -> dict[str, Any]:
    """Anthropic's error object: its error type for the status, the message, this server's code and field."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(int(error.status), "api_error"),
                                       "message": error.message, "code": error.code, "param": error.param}}


def error_shape_for(path: str) -> ErrorShape:
    """The error body of the API that `path` belongs to."""
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error_body
    if path in ANTHROPIC_PATHS:
        return anthropic_error_body
    return error_body
