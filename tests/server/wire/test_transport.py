"""The shared port (server/wire/transport.py) on its own, no model: a small ASGI app and websocket handler
behind it, raw sockets in front. Keep-alive and pipelining, the deadline on request heads, the count of
connections, requests the parser refuses (answered in OpenAI's error shape), the hand-off of an upgrade
to `websockets`, and the bounds it carries (head size, websocket message size)."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError, InvalidStatus

from localserve.server.wire.connection_phases import CloseReason, ConnectionBook, Phase, PhaseBounds, Slot
from localserve.server.wire.transport import MAX_HEAD_BYTES, SharedPort, head_size
from tests.helpers.raw_http import WEBSOCKET_UPGRADE, exchange, open_socket, read_reply, request_bytes

HEAD_TIMEOUT_S = 0.4
BOUNDS = PhaseBounds(header_s=HEAD_TIMEOUT_S, keep_alive_s=HEAD_TIMEOUT_S, handshake_s=HEAD_TIMEOUT_S)
SLOW_RESPONSE_S = 1.0  # longer than the head deadline: the deadline is on the head, not the answer
MAX_MESSAGE_BYTES = 1000
HTTP_PHASES = (Phase.HEADERS, Phase.BODY, Phase.REQUEST, Phase.IDLE)


class CountingHooks:
    """The server's connection book with a limit of served connections, recording which connections entered
    an HTTP phase (`opened`) and which left them (`closed`: gone, or handed to a websocket), in order."""

    def __init__(self, limit: int = 100, max_unfinished: int = 100) -> None:
        self.book = ConnectionBook(max_connections=limit, max_unfinished_connections=max_unfinished)
        self.limit_message, self.eviction_message = self.book.limit_message, self.book.eviction_message
        self.opened: list[Slot] = []
        self.closed: list[Slot] = []
        self.phases: list[tuple[int, Phase]] = []  # (index in opened, phase entered), every move

    @property
    def open(self) -> int:
        return len(self.opened) - len(self.closed)

    def connection_opened(self, on_evicted) -> Slot:
        slot = self.book.connection_opened(on_evicted)
        self.opened.append(slot)
        self.phases.append((len(self.opened) - 1, slot.phase))
        return slot

    def enter(self, slot: Slot, phase: Phase) -> bool:
        was_http = slot.phase in HTTP_PHASES
        entered = self.book.enter(slot, phase)
        self.phases.append((self.opened.index(slot), slot.phase))
        if was_http and slot.phase not in HTTP_PHASES and slot.phase is not Phase.CLOSING:
            self.closed.append(slot)
        return entered

    def cut(self, slot: Slot, reason) -> None:
        self.book.cut(slot, reason)

    def close(self, slot: Slot) -> None:
        if slot not in self.closed:
            self.closed.append(slot)
        self.book.close(slot)


BODIES_GONE: list[int] = []  # bytes of each body whose client went away (or was cut) before its end


async def app(scope: dict[str, Any], receive, send) -> None:
    """Answers every path with a JSON echo of the request; `/slow` takes its time, `/reset` resets, `/body`
    reads the body first (and tells its length)."""
    connection = scope["state"]["connection"]
    if scope["path"] == "/reset":
        connection.reset()
        return
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_RESPONSE_S)
    length = 0
    if scope["path"] == "/body":
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                BODIES_GONE.append(length)
                return
            length += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
    body = json.dumps({"path": scope["path"], "over_limit": connection.over_limit, "length": length}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Handshakes:
    """The websocket side: records each handshake's request, refuses `/refused`, stalls `/stalled`, echoes."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.handled = 0
        self.handled_in: list[Phase] = []  # the phase each connection's slot was in when its handler began

    async def process_request(self, connection, request):
        self.requests.append(request)
        if request.path == "/refused":
            return connection.respond(403, "not here\n")
        if request.path == "/stalled":
            await asyncio.sleep(10 * HEAD_TIMEOUT_S)
        return None

    async def handle(self, connection, slot: Slot) -> None:
        self.handled += 1
        self.handled_in.append(slot.phase)
        async for message in connection:
            await connection.send(message)


@contextmanager
def shared_port(hooks: CountingHooks | None = None, bounds: PhaseBounds = BOUNDS
                ) -> Iterator[tuple[int, CountingHooks, Handshakes]]:
    """A SharedPort on a free port, on its own event loop thread."""
    hooks = hooks or CountingHooks()
    handshakes = Handshakes()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    port = SharedPort(app, hooks, max_message_bytes=MAX_MESSAGE_BYTES, write_limit_bytes=1 << 16, close_timeout_s=1,
                      bounds=bounds)
    server = asyncio.run_coroutine_threadsafe(port.listen("127.0.0.1", 0, handshakes.process_request,
                                                          handshakes.handle), loop).result(10)

    async def close() -> None:
        server.close()
        for connection in port.http_connections:
            connection.shutdown()
        await asyncio.wait_for(server.wait_closed(), 10)

    try:
        yield server.sockets[0].getsockname()[1], hooks, handshakes
    finally:
        asyncio.run_coroutine_threadsafe(close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def get(port: int, path: str, extra: tuple = ()) -> bytes:
    return request_bytes("GET", path, [("Host", f"127.0.0.1:{port}"), *extra])


def wait_for(condition, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def seconds_until_closed(sock: socket.socket) -> float:
    """How long until the server closes or resets `sock`, reading (and dropping) whatever comes meanwhile."""
    start = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


# ------------------------------------------------------------------ the head, as counted
@pytest.mark.parametrize("method, target, headers", [
    ("GET", "/v1/models", [("Host", "127.0.0.1:8080")]),
    ("POST", "/v1/chat/completions?x=1", [("Host", "h"), ("Content-Type", "application/json"), ("X-Empty", "")]),
    ("GET", "/", [("Host", "h"), ("X-Padding", "p" * 5000)]),
])
def test_head_size_is_the_length_of_the_head_as_a_plain_client_writes_it(method, target, headers):
    raw = request_bytes(method, target, headers)
    parsed = [(name.lower().encode(), value.encode()) for name, value in headers]
    assert head_size(method.encode(), target.encode(), parsed) == len(raw)


# ------------------------------------------------------------------ keep-alive
def test_keep_alive_answers_requests_one_after_another_on_one_connection():
    with shared_port() as (port, hooks, _), open_socket(port) as sock:
        buffered = bytearray()
        for path in ("/a", "/b", "/c"):
            sock.sendall(get(port, path))
            reply = read_reply(sock, buffered)
            assert reply.status == 200 and reply.json()["path"] == path
        assert len(hooks.opened) == 1


def test_pipelined_requests_are_answered_in_their_order():
    with shared_port() as (port, _, _), open_socket(port) as sock:
        sock.sendall(get(port, "/slow") + get(port, "/fast") + get(port, "/last"))
        buffered = bytearray()
        assert [read_reply(sock, buffered).json()["path"] for _ in range(3)] == ["/slow", "/fast", "/last"]


# ------------------------------------------------------------------ the head deadline
def test_a_connection_that_sends_no_head_is_cut_at_the_deadline():
    with shared_port() as (port, hooks, _), open_socket(port) as sock:
        held_for = seconds_until_closed(sock)
        assert HEAD_TIMEOUT_S * 0.9 <= held_for < HEAD_TIMEOUT_S + 2
        wait_for(lambda: hooks.open == 0, "the connection to be counted out")


def test_a_head_trickled_byte_by_byte_is_cut_at_the_deadline_though_bytes_keep_coming():
    with shared_port() as (port, _, _), open_socket(port) as sock:
        head = get(port, "/a", (("X-Padding", "p" * 200),))
        start = time.monotonic()
        sent = 0
        try:
            for byte in head:
                sock.sendall(bytes([byte]))
                sent += 1
                time.sleep(HEAD_TIMEOUT_S / 10)
        except (BrokenPipeError, ConnectionResetError):
            pass
        held_for = time.monotonic() - start + seconds_until_closed(sock)
        assert sent < len(head)  # the head never arrived whole
        assert held_for < HEAD_TIMEOUT_S + 2


def test_the_deadline_spares_a_slow_answer_and_starts_again_after_it():
    with shared_port() as (port, _, _), open_socket(port) as sock:
        sock.sendall(get(port, "/slow"))
        assert read_reply(sock).status == 200  # SLOW_RESPONSE_S > HEAD_TIMEOUT_S: the head had arrived
        idle_for = seconds_until_closed(sock)  # keep-alive, but the next head must come within the deadline
        assert HEAD_TIMEOUT_S * 0.9 <= idle_for < HEAD_TIMEOUT_S + 2


# ------------------------------------------------------------------ the count
def test_every_connection_is_counted_from_open_to_close_and_the_one_beyond_the_limit_is_marked():
    with shared_port(CountingHooks(limit=2)) as (port, hooks, _):
        first, second, third = (open_socket(port) for _ in range(3))
        wait_for(lambda: hooks.open == 3, "three connections")
        over_limit = []
        for sock in (first, second, third):
            sock.sendall(get(port, "/a"))
            over_limit.append(read_reply(sock).json()["over_limit"])
        assert over_limit == [False, False, True]  # what the app is told; it answers 429 itself
        second.close()
        wait_for(lambda: hooks.open == 2, "one connection fewer")
        assert hooks.closed == [hooks.opened[1]]
        first.close()
        third.close()
        wait_for(lambda: hooks.open == 0, "no connection")
        assert sorted(map(id, hooks.closed)) == sorted(map(id, hooks.opened))  # each counted out once


def test_an_upgraded_connection_is_counted_out_of_http_at_the_upgrade_and_only_then():
    async def main(port: int, hooks: CountingHooks) -> tuple[int, str]:
        async with connect(f"ws://127.0.0.1:{port}/echo") as connection:
            during = hooks.open
            await connection.send("hello")
            echoed = await connection.recv()
        return during, echoed

    with shared_port() as (port, hooks, handshakes):
        during, echoed = asyncio.run(main(port, hooks))
        assert (during, echoed) == (0, "hello")  # the websocket side counts it from its handshake on
        time.sleep(0.2)
        assert len(hooks.opened) == len(hooks.closed) == 1
        assert handshakes.handled == 1


# ------------------------------------------------------------------ what the parser refuses
@pytest.mark.parametrize("raw, code", [
    (b"NOT AN HTTP REQUEST\r\n\r\n", "invalid_http_request"),
    (b"GET / HTTP/1.1\r\n\r\n", "invalid_http_request"),  # HTTP/1.1 without Host
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", "duplicate_header"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nno colon here\r\n\r\n", "invalid_http_request"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n", "invalid_http_request"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "invalid_http_request"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", "invalid_http_request"),
])
def test_a_request_the_parser_refuses_is_a_400_in_openai_error_shape_and_closes(raw, code):
    with shared_port() as (port, _, _), open_socket(port) as sock:
        sock.sendall(raw)
        reply = read_reply(sock)
        assert reply.status == 400 and reply.header("content-type") == "application/json"
        assert reply.header("connection") == "close"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, code)
        assert error["message"].startswith("the HTTP request is malformed")
        assert seconds_until_closed(sock) < 2


@pytest.mark.parametrize("upgrade", [False, True], ids=["http", "websocket"])
def test_a_head_beyond_the_bound_is_a_431_before_the_app_or_the_handshake(upgrade):
    with shared_port() as (port, _, handshakes):
        extra = WEBSOCKET_UPGRADE if upgrade else ()
        padding = MAX_HEAD_BYTES + 1 - len(get(port, "/a", (*extra, ("X-Padding", ""))))
        reply = exchange(port, get(port, "/a", (*extra, ("X-Padding", "p" * padding))))
        assert (reply.status, reply.error_code) == (431, "request_header_too_large")
        assert handshakes.requests == []


def test_reset_drops_the_connection_without_an_answer():
    with shared_port() as (port, _, _), open_socket(port) as sock:
        sock.sendall(get(port, "/reset"))
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert received == b""


# ------------------------------------------------------------------ the websocket hand-off
def test_an_upgrade_is_handed_to_websockets_with_its_head():
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/echo?x=1", additional_headers={"Authorization": "Bearer k"},
                           max_size=None) as connection:
            await connection.send("a" * MAX_MESSAGE_BYTES)  # at the bound: echoed
            echoed = await connection.recv()
            extensions = connection.response.headers.get("Sec-WebSocket-Extensions", "")
            await connection.send("a" * (MAX_MESSAGE_BYTES + 1))  # one past: closed with 1009
            with pytest.raises(ConnectionClosedError) as closed:
                await connection.recv()
        return echoed, extensions, closed.value.rcvd.code

    with shared_port() as (port, _, handshakes):
        echoed, extensions, close_code = asyncio.run(main(port))
        assert echoed == "a" * MAX_MESSAGE_BYTES and close_code == 1009
        assert extensions.startswith("permessage-deflate")
        (request,) = handshakes.requests
        assert request.path == "/echo?x=1" and request.headers["Authorization"] == "Bearer k"


def test_a_refused_handshake_gets_its_answer_and_no_handler():
    async def main(port: int) -> int:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(f"ws://127.0.0.1:{port}/refused"):
                pass
        return refused.value.response.status_code

    with shared_port() as (port, _, handshakes):
        assert asyncio.run(main(port)) == 403
        assert handshakes.handled == 0


def test_a_handshake_that_does_not_finish_within_the_deadline_is_cut():
    with shared_port() as (port, _, handshakes), open_socket(port) as sock:
        sock.sendall(get(port, "/stalled", WEBSOCKET_UPGRADE))
        start = time.monotonic()
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert received == b"" and time.monotonic() - start < HEAD_TIMEOUT_S + 2
        assert handshakes.handled == 0


# ------------------------------------------------------------------ the phases, each bounded on its own
PHASED = PhaseBounds(header_s=0.6, body_gap_s=0.4, min_body_rate=400, keep_alive_s=0.3, handshake_s=0.6,
                     first_event_s=0.6, evicted_linger_s=0.2)


def post_head(port: int, path: str, length: int) -> bytes:
    return request_bytes("POST", path, [("Host", f"127.0.0.1:{port}"), ("Content-Length", str(length))])


def closed_for(hooks: CountingHooks, phase: Phase, reason: str) -> int:
    return hooks.book.counts().closed[phase, CloseReason(reason)]


def test_a_body_that_pauses_longer_than_the_gap_is_a_408_counted_for_the_body_phase():
    with shared_port(bounds=PHASED) as (port, hooks, _), open_socket(port) as sock:
        sock.sendall(post_head(port, "/body", 10) + b"12345")
        start = time.monotonic()
        reply = read_reply(sock)
        held_for = time.monotonic() - start
        assert (reply.status, reply.error_code) == (408, "request_timeout"), reply.body
        assert "--body-gap-timeout" in reply.json()["error"]["message"]
        assert PHASED.body_gap_s * 0.9 <= held_for < PHASED.body_gap_s + 1  # the gap, not the head's 0.6 s
        wait_for(lambda: closed_for(hooks, Phase.BODY, "timeout") == 1, "the cut to be counted")
        wait_for(lambda: BODIES_GONE[-1:] == [5], "the app to see the client gone")


def test_a_body_trickled_within_the_gap_but_below_the_rate_is_cut_at_the_rate_line():
    with shared_port(bounds=PHASED) as (port, hooks, _), open_socket(port) as sock:
        sock.sendall(post_head(port, "/body", 1000))
        start = time.monotonic()
        while time.monotonic() - start < 5:  # 10 bytes every 0.1 s: 100 bytes/s, never a gap
            sock.sendall(b"x" * 10)
            if select.select([sock], [], [], 0.1)[0]:  # the answer
                break
        reply = read_reply(sock)
        held_for = time.monotonic() - start
        assert (reply.status, reply.error_code) == (408, "request_timeout") and "--min-body-rate" in reply.body.decode()
        # the rate line: the gap as grace, plus the bytes at the minimum rate (later than the gap alone, 0.4 s)
        rate_line_s = PHASED.body_gap_s / (1 - 100 / PHASED.min_body_rate)
        assert 0.9 * rate_line_s <= held_for < rate_line_s + 1
        assert closed_for(hooks, Phase.BODY, "timeout") == 1


def test_a_body_at_the_minimum_rate_or_faster_may_take_longer_than_the_gap():
    with shared_port(bounds=PHASED) as (port, hooks, _), open_socket(port) as sock:
        sock.sendall(post_head(port, "/body", 900))
        for _ in range(9):  # 100 bytes every 0.1 s: 1000 bytes/s, over 0.9 s in all
            sock.sendall(b"y" * 100)
            time.sleep(0.1)
        reply = read_reply(sock)
        assert reply.status == 200 and reply.json()["length"] == 900
        assert sum(hooks.book.counts().closed.values()) == 0


def test_an_idle_connection_is_closed_at_its_own_bound_uncounted_and_a_next_head_has_its_own_clock():
    with shared_port(bounds=PHASED) as (port, hooks, _):
        with open_socket(port) as sock:
            sock.sendall(get(port, "/a"))
            assert read_reply(sock).status == 200
            idle_for = seconds_until_closed(sock)
            assert PHASED.keep_alive_s * 0.9 <= idle_for < PHASED.header_s  # the keep-alive bound, not the head's
        with open_socket(port) as sock:
            sock.sendall(get(port, "/a"))
            buffered = bytearray()
            assert read_reply(sock, buffered).status == 200
            time.sleep(PHASED.keep_alive_s / 2)
            head = get(port, "/b")
            sock.sendall(head[:10])  # the next head begins: its own bound from now
            began = time.monotonic()
            reply = read_reply(sock, buffered)
            assert (reply.status, reply.error_code) == (408, "request_timeout")
            assert PHASED.header_s * 0.9 <= time.monotonic() - began < PHASED.header_s + 1
        assert sum(hooks.book.counts().closed.values()) == 1  # the trickled head; never the idle one


def test_an_upgrade_keeps_its_place_in_the_book_from_the_first_byte_to_the_last():
    async def main(port: int, hooks: CountingHooks) -> list[int]:
        seen = []
        async with connect(f"ws://127.0.0.1:{port}/echo") as connection:
            seen.append(hooks.book.num_open)
            await connection.send("hello")
            assert await connection.recv() == "hello"
            seen.append(hooks.book.num_open)
        return seen

    with shared_port() as (port, hooks, handshakes):
        assert asyncio.run(main(port, hooks)) == [1, 1]
        wait_for(lambda: hooks.book.num_open == 0, "the websocket to be counted out")
        (slot,) = hooks.opened
        # headers, then handshake: never a moment out of the book; the handler takes it from the handshake
        assert [phase for index, phase in hooks.phases] == [Phase.HEADERS, Phase.HANDSHAKE]
        assert handshakes.handled_in == [Phase.HANDSHAKE]
        assert hooks.book.counts().unfinished[Phase.HANDSHAKE] == 0 and slot.phase is Phase.CLOSING


def test_a_handshake_beyond_its_bound_is_counted_for_the_handshake_phase():
    with shared_port(bounds=PHASED) as (port, hooks, _), open_socket(port) as sock:
        sock.sendall(get(port, "/stalled", WEBSOCKET_UPGRADE))
        assert seconds_until_closed(sock) < PHASED.handshake_s + 1
        wait_for(lambda: closed_for(hooks, Phase.HANDSHAKE, "timeout") == 1, "the cut to be counted")


def test_the_oldest_unfinished_connection_is_evicted_after_the_linger_and_told_why():
    with shared_port(CountingHooks(limit=4, max_unfinished=2), bounds=PHASED) as (port, hooks, _):
        oldest, second = open_socket(port), open_socket(port)
        try:
            oldest.sendall(b"GET /a HTTP/1.1\r\n")
            wait_for(lambda: len(hooks.opened) == 2 and all(slot.evictable for slot in hooks.opened),
                     "both to be read once")
            with open_socket(port) as whole:  # one more, with a whole request: served at once
                evicted_at = time.monotonic()
                whole.sendall(get(port, "/a"))
                assert read_reply(whole).status == 200
            reply = read_reply(oldest)
            lingered = time.monotonic() - evicted_at
            assert (reply.status, reply.error_code) == (408, "too_many_unfinished_connections")
            assert "--max-unfinished-connections" in reply.json()["error"]["message"]
            assert PHASED.evicted_linger_s * 0.9 <= lingered < PHASED.header_s
            assert closed_for(hooks, Phase.HEADERS, "evicted") == 1
            second.sendall(get(port, "/a"))  # the younger one was spared
            assert read_reply(second).status == 200
        finally:
            oldest.close()
            second.close()


def test_a_body_that_ends_when_max_connections_are_served_is_refused_by_the_transport():
    with shared_port(CountingHooks(limit=1), bounds=PhaseBounds(keep_alive_s=10)) as (port, hooks, _):
        with open_socket(port) as served, open_socket(port) as late:
            served.sendall(get(port, "/a"))
            assert read_reply(served).status == 200  # idle now, holding the one place
            late.sendall(post_head(port, "/body", 4) + b"ab")  # the app has begun, and waits for the rest
            wait_for(lambda: hooks.book.counts().unfinished[Phase.BODY] == 1, "the body to begin")
            late.sendall(b"cd")
            reply = read_reply(late)
            assert (reply.status, reply.error_code) == (429, "too_many_connections"), reply.body
            assert reply.json()["error"]["type"] == "rate_limit_error"
            assert "--max-connections" in reply.json()["error"]["message"]
            wait_for(lambda: BODIES_GONE[-1:] == [2], "the app to be told")
            assert seconds_until_closed(late) < 2


def test_a_refused_request_leaves_its_connection_unfinished_and_its_next_head_due():
    with shared_port(CountingHooks(limit=1), bounds=PhaseBounds(header_s=0.6, keep_alive_s=10)) as (port, hooks, _):
        with open_socket(port) as served, open_socket(port) as refused:
            served.sendall(get(port, "/a"))
            assert read_reply(served).status == 200
            buffered = bytearray()
            refused.sendall(get(port, "/a"))
            assert read_reply(refused, buffered).json()["over_limit"] is True  # the app answers (429 in the server)
            answered = time.monotonic()
            assert hooks.book.num_served == 1 and hooks.book.counts().unfinished[Phase.HEADERS] == 1
            reply = read_reply(refused, buffered)  # nothing more sent: its next head is due like any other
            assert (reply.status, reply.error_code) == (408, "request_timeout")
            assert 0.6 * 0.9 <= time.monotonic() - answered < 0.6 + 1
