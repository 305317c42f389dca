"""One HTTP exchange over ASGI (server/wire/http_exchange.py) on its own, driven by a minimal ASGI receive/send
pair (tests/helpers/asgi.py; no socket, no server): the body bound at exactly `max_bytes` (read) and one
byte more (413), by Content-Length before anything is read and by counting a chunked body; the body's
deadline (408) for the whole body, not each piece; a client that disconnects; OpenAI's error body, and
which errors close the connection; CORS headers for an origin that passed the access check; every write
timed, and a client that stops reading reset."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from openai.types.shared import ErrorObject

from localserve.server.request.validation import ProtocolError
from localserve.server.wire.http_exchange import (
    CLOSING_ERRORS,
    MAX_CORS_HEADERS,
    ClientGone,
    HttpExchange,
    error_body,
    sse,
)
from tests.helpers.asgi import AsgiPeer, body_messages

MAX_BYTES = 64


def exchange_for(peer: AsgiPeer, headers: dict[str, str] | None = None, send_timeout_s: float = 5.0) -> HttpExchange:
    return HttpExchange(peer.scope(headers=headers), peer.receive, peer.send, send_timeout_s)


def body_of(size: int) -> bytes:
    """A JSON object of exactly `size` bytes."""
    return json.dumps({"k": "x" * (size - len('{"k": ""}'))}).encode()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def read(peer: AsgiPeer, headers: dict[str, str] | None = None, timeout_s: float = 5.0) -> Any:
    """What read_json returns, or the ProtocolError / ClientGone it raises."""
    async def main():
        try:
            return await exchange_for(peer, headers).read_json(MAX_BYTES, timeout_s)
        except (ProtocolError, ClientGone) as error:
            return error

    return run(main())


def test_a_body_of_exactly_max_bytes_is_read_by_content_length_and_chunked():
    body = body_of(MAX_BYTES)
    assert len(body) == MAX_BYTES
    assert read(AsgiPeer(body_messages(body, 1)), {"Content-Length": str(MAX_BYTES)}) == json.loads(body)
    assert read(AsgiPeer(body_messages(body, 5))) == json.loads(body)  # chunked: no Content-Length
    assert read(AsgiPeer([{"type": "http.request", "body": body}])) == json.loads(body)  # more_body left out


def test_one_byte_more_is_a_413_by_content_length_before_anything_is_read():
    peer = AsgiPeer(body_messages(body_of(MAX_BYTES + 1), 1))
    error = read(peer, {"Content-Length": str(MAX_BYTES + 1)})
    assert (error.code, error.status) == ("request_too_large", 413) and str(MAX_BYTES) in error.message
    assert peer.num_received == 0


def test_one_byte_more_is_a_413_when_chunked_or_when_content_length_understates_it():
    for messages, headers in ((body_messages(body_of(MAX_BYTES + 1), 5), None),
                              (body_messages(body_of(MAX_BYTES + 1), 1), {"Content-Length": "10"})):
        error = read(AsgiPeer(messages), headers)
        assert (error.code, error.status) == ("request_too_large", 413)


def test_a_content_length_that_is_no_number_leaves_the_bound_to_the_count():
    body = body_of(MAX_BYTES)
    assert read(AsgiPeer(body_messages(body, 2)), {"Content-Length": "-5"}) == json.loads(body)


def test_a_body_that_does_not_arrive_in_time_is_a_408():
    error = read(AsgiPeer([]), timeout_s=0.05)
    assert (error.code, error.status) == ("request_timeout", 408) and "0.05 s" in error.message


def test_the_deadline_is_for_the_whole_body_not_each_piece():
    body = body_of(MAX_BYTES)
    trickled = AsgiPeer(body_messages(body, 8), delays_s=[0.04] * 8)  # each piece in time, the whole body not
    error = read(trickled, timeout_s=0.2)
    assert (error.code, error.status) == ("request_timeout", 408) and trickled.num_received < 8
    assert read(AsgiPeer(body_messages(body, 8), delays_s=[0.01] * 8), timeout_s=2.0) == json.loads(body)


def test_a_client_that_disconnects_while_sending_is_gone():
    peer = AsgiPeer([{"type": "http.request", "body": b'{"a"', "more_body": True}, {"type": "http.disconnect"}])
    exchange = exchange_for(peer)

    async def main():
        with pytest.raises(ClientGone):
            await exchange.read_json(MAX_BYTES, 5.0)

    run(main())
    assert exchange.disconnected


@pytest.mark.parametrize("body, message", [(b"{", "the body is not valid JSON"), (b"[1]", "JSON object"),
                                           (b"\xff", "the body is not valid JSON")])
def test_a_body_that_is_no_json_object_is_a_400(body, message):
    error = read(AsgiPeer(body_messages(body, 1)))
    assert (error.code, error.status) == ("invalid_json", 400) and message in error.message


def test_wait_disconnect_returns_when_the_client_goes():
    peer = AsgiPeer([{"type": "http.request", "body": b""}, {"type": "http.disconnect"}])
    exchange = exchange_for(peer)
    run(exchange.wait_disconnect())
    assert exchange.disconnected and peer.num_received == 2


def test_the_error_body_is_openais_error_object():
    error = ProtocolError("integer_above_max_value", "'max_tokens' must be <= 512", "max_tokens")
    body = error_body(error)
    assert body == {"error": {"message": "'max_tokens' must be <= 512", "type": "invalid_request_error",
                              "param": "max_tokens", "code": "integer_above_max_value"}}
    parsed = ErrorObject.model_validate(body["error"])  # the SDK's own type
    assert (parsed.code, parsed.param, parsed.type, parsed.message) == (
        "integer_above_max_value", "max_tokens", "invalid_request_error", "'max_tokens' must be <= 512")


@pytest.mark.parametrize("code, status, closes", [
    ("request_too_large", 413, True), ("request_timeout", 408, True), ("too_many_connections", 429, True),
    ("invalid_json", 400, False), ("model_not_found", 404, False), ("server_busy", 429, False),
])
def test_an_error_response_is_json_and_closes_only_after_an_unread_body_or_over_the_limit(code, status, closes):
    assert (code in CLOSING_ERRORS) == closes
    peer = AsgiPeer()
    run(exchange_for(peer).respond_error(ProtocolError(code, "why", status=status), [(b"www-authenticate", b"Bearer")]))
    assert peer.status == status
    assert peer.headers[b"content-type"] == b"application/json"
    assert peer.headers[b"www-authenticate"] == b"Bearer"
    assert int(peer.headers[b"content-length"]) == len(peer.body)
    assert json.loads(peer.body) == error_body(ProtocolError(code, "why", status=status))
    assert (peer.headers.get(b"connection") == b"close") == closes
    assert peer.sent[-1]["more_body"] is False


def test_an_origin_that_passed_the_check_gets_cors_headers_and_no_origin_none():
    allowed, plain = AsgiPeer(), AsgiPeer()
    exchange = exchange_for(allowed, {"Origin": "http://localhost:3000"})
    exchange.cors_origin = "http://localhost:3000"
    run(exchange.respond_json(200, {"ok": True}))
    assert allowed.headers[b"access-control-allow-origin"] == b"http://localhost:3000"
    assert allowed.headers[b"vary"] == b"Origin"
    run(exchange_for(plain).respond_json(200, {"ok": True}))
    assert b"access-control-allow-origin" not in plain.headers and b"vary" not in plain.headers
    assert json.loads(plain.body) == {"ok": True}


def test_a_preflight_names_the_methods_and_headers_a_browser_may_use():
    peer = AsgiPeer()
    exchange = exchange_for(peer)
    exchange.cors_origin = "http://localhost:3000"
    run(exchange.respond_empty(204, exchange.cors_preflight_headers()))
    assert peer.status == 204 and peer.body == b"" and peer.headers[b"content-length"] == b"0"
    assert peer.headers[b"access-control-allow-methods"] == b"GET, POST, OPTIONS"
    assert set(peer.headers[b"access-control-allow-headers"].lower().split(b", ")) == {b"authorization",
                                                                                       b"content-type"}
    assert peer.headers[b"access-control-allow-origin"] == b"http://localhost:3000"


# What the official SDKs send from a browser (the OpenAI and Anthropic JavaScript SDKs' own headers, the key
# as Anthropic sends it): a preflight that leaves one out fails the request before it is sent.
SDK_HEADERS = ("x-api-key, anthropic-version, anthropic-dangerous-direct-browser-access, x-stainless-arch, "
               "x-stainless-lang, x-stainless-os, x-stainless-package-version, x-stainless-retry-count, "
               "x-stainless-runtime, x-stainless-runtime-version, x-stainless-timeout, openai-beta")


@pytest.mark.parametrize("requested, allowed", [
    (None, {"authorization", "content-type"}),
    ("Authorization, Content-Type", {"authorization", "content-type"}),
    (SDK_HEADERS, {"authorization", "content-type", *SDK_HEADERS.split(", ")}),
    ("x-api-key,anthropic-version", {"authorization", "content-type", "x-api-key", "anthropic-version"}),
    # not header names: left out, the browser then refuses the request itself
    ("x-ok, bad header, \u00e9t\u00e9, a:b", {"authorization", "content-type", "x-ok"}),
    (", ,x-ok,,", {"authorization", "content-type", "x-ok"}),
])
def test_a_preflight_allows_the_headers_it_is_asked_for(requested, allowed):
    peer = AsgiPeer()
    exchange = exchange_for(peer, {"Access-Control-Request-Headers": requested} if requested is not None else None)
    exchange.cors_origin = "http://localhost:3000"
    run(exchange.respond_empty(204, exchange.cors_preflight_headers()))
    assert set(peer.headers[b"access-control-allow-headers"].decode().lower().split(", ")) == allowed


@pytest.mark.parametrize("asked", [MAX_CORS_HEADERS, MAX_CORS_HEADERS + 1, 500])
def test_a_preflight_allows_at_most_a_bounded_list_of_headers(asked):
    names = [f"x-h{i}" for i in range(asked)]
    peer = AsgiPeer()
    exchange = exchange_for(peer, {"Access-Control-Request-Headers": ", ".join(names)})
    exchange.cors_origin = "http://localhost:3000"
    run(exchange.respond_empty(204, exchange.cors_preflight_headers()))
    allowed = peer.headers[b"access-control-allow-headers"].decode().split(", ")
    assert allowed == ["Authorization", "Content-Type", *names[:MAX_CORS_HEADERS]]  # at the bound: all of them


def test_a_client_that_takes_a_write_in_time_gets_it_and_one_that_stops_reading_is_reset():
    reading = AsgiPeer(send_delay_s=0.02)
    run(exchange_for(reading, send_timeout_s=0.5).respond_json(200, {"ok": True}))
    assert reading.status == 200 and reading.resets == 0
    stuck = AsgiPeer(send_delay_s=None)
    exchange = exchange_for(stuck, send_timeout_s=0.05)

    async def main():
        with pytest.raises(ClientGone):
            await exchange.start(200, b"text/event-stream", [])

    run(main())
    assert exchange.started and exchange.disconnected and stuck.resets == 1


def test_a_stream_write_that_stalls_mid_body_is_reset_too():
    peer = AsgiPeer(send_delay_s=0.0)
    exchange = exchange_for(peer, send_timeout_s=0.05)

    async def main():
        await exchange.start(200, b"text/event-stream", [])
        await exchange.write(b"data: 1\n\n")
        peer.send_delay_s = None  # the client stops reading
        with pytest.raises(ClientGone):
            await exchange.write(b"data: 2\n\n")

    run(main())
    assert [message.get("body") for message in peer.sent[1:]] == [b"data: 1\n\n"] and peer.resets == 1


def test_server_sent_events():
    assert sse({"a": 1}, "response.created") == b'event: response.created\ndata: {"a": 1}\n\n'
    assert sse({"a": 1}) == b'data: {"a": 1}\n\n'
    assert sse("[DONE]") == b"data: [DONE]\n\n"
