"""OpenAI's HTTP endpoints over raw sockets (tiny model, engine steps slowed to a known pace): chunks are
sent as the engine makes them, a client that closes mid-stream frees every block at once, keep-alive
carries several requests on one connection, and hostile requests (oversized, malformed, slow, foreign
Origin or Host, no key, a saturated server) get a 4xx in OpenAI's error shape, never a 500."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import time

import pytest

from tests.helpers.server import running_server, wait_until_idle

API_KEY = "sekrit-key"
STEP_DELAY_S = 0.03  # each engine step takes at least this long: streaming is observable
MAX_BODY_BYTES = 64 << 10
BODY_TIMEOUT_S = 1.0
CHAT = {"model": "default", "messages": [{"role": "user", "content": "hello world tell me a story"}],
        "temperature": 0, "stop": "never said"}


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    engine = tiny_chat_llm.engine
    step = engine.step

    def slow_step():
        time.sleep(STEP_DELAY_S)
        return step()

    engine.step = slow_step
    try:
        with running_server(tiny_chat_llm, api_key=API_KEY, max_message_bytes=MAX_BODY_BYTES,
                            http_body_timeout_s=BODY_TIMEOUT_S, max_running_responses=2,
                            allowed_origins=("http://localhost:3000",)) as server:
            yield server
    finally:
        del engine.step


def connect(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)


def headers(server, **extra) -> dict[str, str]:
    return {"Host": f"127.0.0.1:{server.port}", "Authorization": f"Bearer {API_KEY}",
            "Content-Type": "application/json", **extra}


def post(connection, server, path: str, body, **extra) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, data, headers(server, **extra))
    response = connection.getresponse()
    payload = response.read()
    return response.status, json.loads(payload)


def assert_error(status: int, body: dict, expected_status: int, code: str | None = None) -> None:
    assert status == expected_status, (status, body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and (code is None or body["error"]["code"] == code), body


def engine_busy(server) -> bool:
    engine_thread = server.server.models.serving_now().engine
    return engine_thread.call(lambda engine: engine.has_unfinished_requests()).result(30)


def test_chunks_arrive_while_the_engine_is_still_generating(server):
    connection = connect(server)
    connection.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 40, "stream": True}),
                       headers(server))
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    first_content, busy_then = None, None
    lines = []
    while (line := response.readline()) != b"":
        if line.startswith(b"data: ") and line != b"data: [DONE]\n":
            chunk = json.loads(line[6:])
            if first_content is None and chunk["choices"][0]["delta"].get("content"):
                first_content = chunk
                busy_then = engine_busy(server)  # the last token is not generated yet
        lines.append(line)
        if line == b"data: [DONE]\n":
            break
    connection.close()
    assert first_content is not None and busy_then is True
    assert lines[-1] == b"data: [DONE]\n"
    wait_until_idle(server.server.models.serving_now().engine)


def test_a_client_closing_mid_stream_frees_every_block_at_once(server):
    engine_thread = server.server.models.serving_now().engine
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    body = json.dumps({**CHAT, "max_tokens": 400, "stream": True}).encode()  # 12 s of steps if left to run
    head = "".join(f"{name}: {value}\r\n" for name, value in headers(server).items())
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    while b'"content": "' not in received.split(b"data:", 2)[-1]:  # a chunk with generated text
        received += sock.recv(65536)
    assert engine_busy(server)
    sock.close()
    start = time.monotonic()
    wait_until_idle(engine_thread, timeout=5)  # every block free or cached, the request gone
    assert time.monotonic() - start < 2.0
    assert not server.server.http_api.in_flight
    # a client waiting for a whole (non-streamed) answer that goes away is noticed too
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    body = json.dumps({**CHAT, "max_tokens": 400}).encode()
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 10
    while not engine_busy(server):
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.02)
    sock.close()
    start = time.monotonic()
    wait_until_idle(engine_thread, timeout=5)
    assert time.monotonic() - start < 2.0


def test_keep_alive_carries_several_requests_on_one_connection(server):
    connection = connect(server)
    ports = set()
    for path, body in [("/v1/chat/completions", {**CHAT, "max_tokens": 2}),
                       ("/v1/completions", {"model": "default", "prompt": "hello world", "max_tokens": 2}),
                       ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "stream": True}),
                       ("/v1/responses", {"model": "default", "input": "hello", "max_output_tokens": 2}),
                       ("/v1/chat/completions", {**CHAT, "messages": "not a list"})]:
        connection.request("POST", path, json.dumps(body), headers(server))
        response = connection.getresponse()
        response.read()
        assert response.status in (200, 400) and not response.will_close, path
        ports.add(connection.sock.getsockname()[1])
    connection.request("GET", "/v1/models", headers=headers(server))
    assert connection.getresponse().status == 200
    ports.add(connection.sock.getsockname()[1])
    connection.close()
    assert len(ports) == 1  # one TCP connection all along


@pytest.mark.parametrize("body, code", [
    (b"{not json", "invalid_json"), (b"[1, 2]", "invalid_json"), (b"\xff\xfe{}", "invalid_json"),
    (b'{"model": "default", "messages": [{"role": "user", "content": "\\ud800"}]}', "invalid_value"),
    (b"[" * 20_000 + b"]" * 20_000, "invalid_json"),  # nested deeper than the parser goes
    (json.dumps({**CHAT, "n": 0}).encode(), "integer_below_min_value"),
    (json.dumps({**CHAT, "max_tokens": 10 ** 30}).encode(), None),
    (json.dumps({**CHAT, "messages": [{"role": "tool", "content": "x"}]}).encode(), "invalid_type"),  # no call id
    (json.dumps({**CHAT, "tools": [{"type": "function"}]}).encode(), "invalid_value"),
    (json.dumps({**CHAT, "temperature": "hot"}).encode(), "invalid_type"),
    (json.dumps({**CHAT, "stream_options": []}).encode(), "invalid_type"),
])
def test_malformed_bodies_get_a_400(server, body, code):
    connection = connect(server)
    assert_error(*post(connection, server, "/v1/chat/completions", body), 400, code)
    connection.close()


def test_oversized_and_slow_bodies_get_413_and_408(server):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "hello " * MAX_BODY_BYTES}]}).encode()
    assert_error(*post(connect(server), server, "/v1/chat/completions", big), 413, "request_too_large")
    # the same size sent chunked, with no Content-Length to refuse early: counted as it arrives, the answer
    # comes before the rest is sent (paced, so the server has read all that was sent when it closes)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers(server).items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}Transfer-Encoding: chunked\r\n\r\n".encode())
    for start in range(0, len(big), 8192):
        piece = big[start:start + 8192]
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        if select.select([sock], [], [], 0.05)[0]:
            break
    else:
        raise AssertionError("the whole oversized body was taken")
    reply = sock.makefile("rb").read()
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply
    # a body promised and never sent
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers(server).items())
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}Content-Length: 100\r\n\r\n{{".encode())
    reply = sock.makefile("rb").read()
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in reply
    # a request head beyond the bound: arrived whole in one read (checked by the app), or still incomplete
    # at the bound (by the parser)
    connection = connect(server)
    connection.request("GET", "/v1/models", headers={**headers(server), "X-Padding": "x" * 20_000})
    response = connection.getresponse()
    assert_error(response.status, json.loads(response.read()), 431, "request_header_too_large")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: {'x' * 20_000}".encode())
    reply = sock.makefile("rb").read()
    sock.close()
    assert reply.startswith(b"HTTP/1.1 400") and b'"invalid_http_request"' in reply


def test_foreign_origin_or_host_and_a_missing_key_are_refused(server):
    cases = [({"Origin": "http://evil.example"}, 403, "origin_not_allowed"),
             ({"Host": "evil.example"}, 403, "host_not_allowed"),
             ({"Authorization": "Bearer wrong"}, 401, "invalid_api_key"),
             ({"Authorization": ""}, 401, "invalid_api_key")]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        for extra, status, code in cases:
            assert_error(*post(connect(server), server, path, CHAT, **extra), status, code)
    # an allowed origin gets its CORS answer; the preflight needs no key
    status, body = post(connect(server), server, "/v1/chat/completions", {**CHAT, "max_tokens": 1},
                        Origin="http://localhost:3000")
    assert status == 200 and body["object"] == "chat.completion"
    connection = connect(server)
    connection.request("OPTIONS", "/v1/chat/completions", headers={"Host": f"127.0.0.1:{server.port}",
                                                                   "Origin": "http://localhost:3000"})
    response = connection.getresponse()
    assert response.status == 204 and response.getheader("Access-Control-Allow-Origin") == "http://localhost:3000"


def test_paths_methods_models_and_a_saturated_server(server):
    assert_error(*post(connect(server), server, "/v1/nothing", CHAT), 404, "not_found")
    assert_error(*post(connect(server), server, "/v1/chat/completions", {**CHAT, "model": "other"}), 404,
                 "model_not_found")
    connection = connect(server)
    connection.request("GET", "/v1/chat/completions", headers=headers(server))
    response = connection.getresponse()
    assert_error(response.status, json.loads(response.read()), 405, "method_not_allowed")
    # max_running_responses=2: two long streams hold the server, a third request is told to retry
    held = []
    for _ in range(2):
        connection = connect(server)
        connection.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "max_tokens": 400, "stream": True}),
                           headers(server))
        assert connection.getresponse().status == 200
        held.append(connection)
    assert_error(*post(connect(server), server, "/v1/completions", {"model": "default", "prompt": "hi"}), 429,
                 "server_busy")
    for connection in held:
        connection.close()
    wait_until_idle(server.server.models.serving_now().engine, timeout=5)
    status, body = post(connect(server), server, "/v1/completions", {"model": "default", "prompt": "hi",
                                                                     "max_tokens": 1})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def test_shutdown_ends_http_streams_with_their_reason(server):  # last: it stops the module's server
    streams = []
    for path, body in [("/v1/chat/completions", {**CHAT, "max_tokens": 400, "stream": True}),
                       ("/v1/responses", {"model": "default", "input": "hello", "max_output_tokens": 400,
                                          "temperature": 0, "localserve": {"stop": "never said"}, "stream": True})]:
        connection = connect(server)
        connection.request("POST", path, json.dumps(body), headers(server))
        response = connection.getresponse()
        assert response.status == 200
        while b"delta" not in response.readline():  # streaming text
            pass
        streams.append(response)
    asyncio.run_coroutine_threadsafe(server.server.shutdown(), server.loop).result(30)
    chat_rest, responses_rest = (response.read().decode() for response in streams)
    last_chunks = [line for line in chat_rest.split("\n") if line.startswith("data: ")][-2:]
    assert json.loads(last_chunks[0][6:])["error"]["code"] == "server_shutdown" and last_chunks[1] == "data: [DONE]"
    final = json.loads([line for line in responses_rest.split("\n") if line.startswith("data: ")][-1][6:])
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "server_shutdown"}
    wait_until_idle(server.server.models.serving_now().engine, timeout=5)
