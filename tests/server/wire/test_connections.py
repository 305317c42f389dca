"""Clients that stop reading: a flood that is never read, a stream nobody takes, a client that vanishes.
Each is cut after a bounded buffer and time, its responses aborted, its connection slot returned; the
`num_connections` gauge comes back to zero, and closing the server never hangs. And every bound on a
connection, on each transport that carries it, at its limit (accepted) and one past it (refused): the
size of an HTTP body and of a websocket message, of a request head, the number of connections, of lanes
and of queued requests on a websocket. (`send_queue_size` is not exact on the wire: how many error
events wait depends on the socket buffers in between.)"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from localserve.server.wire.connection_phases import PhaseBounds
from localserve.server.wire.transport import MAX_HEAD_BYTES
from tests.helpers.raw_client import RawClient
from tests.helpers.raw_http import WEBSOCKET_UPGRADE, RawReply, exchange, open_socket, read_reply, request_bytes
from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server, wait_until_idle

SEND_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, max_connections=4) as server:
        yield server


@pytest.fixture(scope="module")
def impatient_server(tiny_chat_llm, server):  # after `server`: one engine thread at a time
    with running_server(tiny_chat_llm, send_timeout_s=SEND_TIMEOUT_S, keepalive_interval_s=0.5,
                        write_limit_bytes=4096) as impatient:
        yield impatient


def num_connections(server) -> float:
    """The `localserve_num_connections` gauge, read from /metrics (HTTP connections count: the scrape's own
    connection is one of them)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
        for family in text_string_to_metric_families(response.read().decode()):
            for sample in family.samples:
                if sample.name == "localserve_num_connections":
                    return sample.value
    raise AssertionError("no localserve_num_connections in /metrics")


def wait_for_no_connections(server, timeout: float) -> float:
    """Seconds until the server holds no connection (it fails the test after `timeout`)."""
    start = time.monotonic()
    while server.server.num_connections:
        assert time.monotonic() - start < timeout, f"{server.server.num_connections} connection(s) still held"
        time.sleep(0.05)
    return time.monotonic() - start


def wait_for_a_connection(server, timeout: float = 10) -> None:
    """Until the server counts a connection (it does from the connection's opening on, across the upgrade)."""
    start = time.monotonic()
    while not server.server.num_connections:
        assert time.monotonic() - start < timeout, "the connection was never counted"
        time.sleep(0.005)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


async def served_normally(port: int) -> list[dict]:
    async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
        await connection.send(json.dumps({"type": "response.create", "input": "hello", "max_output_tokens": 3}))
        return await collect_response(connection)


def test_a_flood_that_is_never_read_then_vanishes_returns_its_slot(server):
    async def flood_and_vanish(port: int) -> None:
        client = await RawClient.open(port)
        for _ in range(20):  # bad frames, each answered by an error event the client never reads
            for _ in range(500):
                client.protocol.send_text(b"not json")
            await client.flush()
        client.abort()

    async def main(port: int) -> None:
        await asyncio.gather(*(flood_and_vanish(port) for _ in range(4)))  # all the slots there are

    run(main(server.port))
    wait_for_no_connections(server, timeout=10)
    assert num_connections(server) == 1  # the scrape itself
    assert run(served_normally(server.port))[-1]["type"] in CLOSING_EVENTS  # nobody is locked out


def test_a_client_that_stops_reading_mid_stream_is_cut(impatient_server):
    server = impatient_server

    async def main(port: int) -> tuple[list[dict], int | None, float]:
        client = await RawClient.open(port)
        # 20 alternatives per token make every delta large; the client never takes them
        await client.send_text(json.dumps({"type": "response.create", "input": "tell me a story",
                                           "max_output_tokens": 480, "temperature": 0, "top_logprobs": 20}))
        # the client keeps its socket open: only the server can end this connection
        await asyncio.to_thread(wait_for_a_connection, server)
        held_for = await asyncio.to_thread(wait_for_no_connections, server, 10)
        events, close_code = await client.read_events(timeout=10)
        client.abort()
        return events, close_code, held_for

    events, close_code, held_for = run(main(server.port))
    assert held_for >= SEND_TIMEOUT_S  # it was given its time
    # cut with 1008 (policy violation); when the close frame sits behind unread data, the connection ends
    # without it: a reset (no code yet) or an end of stream (websockets says 1006, abnormal closure), which of
    # the two depends on timing (it failed 2 runs in 3 on an idle machine)
    assert close_code in (1008, 1006, None)
    assert not any(event["type"] in CLOSING_EVENTS for event in events)  # it never got to the end
    wait_until_idle(server.server.models.serving_now().engine)  # every block free or cached


def test_a_client_that_never_reads_anything_is_cut_by_the_keepalive(impatient_server):
    server = impatient_server

    async def main(port: int) -> int | None:
        client = await RawClient.open(port)
        await asyncio.sleep(4 * SEND_TIMEOUT_S)  # pings go unanswered: nothing here reads them
        return (await client.read_events(timeout=10))[1]

    assert run(main(server.port)) == 1008
    wait_for_no_connections(server, timeout=5)


def test_closing_the_server_with_stuck_clients_does_not_hang(tiny_chat_llm):
    async def stuck_clients(port: int) -> list[RawClient]:
        clients = [await RawClient.open(port) for _ in range(3)]
        for client in clients:
            await client.send_text(json.dumps({"type": "response.create", "input": "tell me a story",
                                               "max_output_tokens": 400, "top_logprobs": 20}))
        return clients

    loop = asyncio.new_event_loop()
    with running_server(tiny_chat_llm) as server:  # default timeouts: 30 s to send, 20 s between pings
        clients = loop.run_until_complete(stuck_clients(server.port))
        time.sleep(1)
        start = time.monotonic()
    stopped_in = time.monotonic() - start
    for client in clients:
        client.abort()
    loop.close()
    assert stopped_in < 10


# ------------------------------------------------------------------ each bound: exactly the limit, then one more
MESSAGE_BOUND = 4096  # bytes of an HTTP body or a websocket message
CONNECTION_BOUND = 3
LANE_BOUND = 2
QUEUE_BOUND = 2
LONG = {"input": "tell me a story", "max_output_tokens": 480, "temperature": 0, "localserve": {"stop": "never said"}}


@pytest.fixture(scope="module")
def bounded_server(tiny_chat_llm, impatient_server):  # after the others: one engine thread at a time
    # idle keep-alive connections hold their places for as long as a test needs them
    with running_server(tiny_chat_llm, max_message_bytes=MESSAGE_BOUND, max_connections=CONNECTION_BOUND,
                        max_lanes=LANE_BOUND, max_queued_requests=QUEUE_BOUND,
                        phase_bounds=PhaseBounds(keep_alive_s=60)) as bounded:
        yield bounded


def wait_for_connections(server, count: int, timeout: float = 10) -> None:
    """Until the server holds exactly `count` connections (a closed one is counted out a moment later)."""
    deadline = time.monotonic() + timeout
    while server.server.num_connections != count:
        assert time.monotonic() < deadline, f"{server.server.num_connections} connections, not {count}"
        time.sleep(0.02)


def padded(event: dict, size: int) -> bytes:
    """`event` as JSON of exactly `size` bytes (trailing spaces are still JSON)."""
    data = json.dumps(event).encode()
    assert len(data) <= size
    return data + b" " * (size - len(data))


BODIES = {"/v1/chat/completions": {"model": "default", "messages": [{"role": "user", "content": "hello"}],
                                   "max_tokens": 1},
          "/v1/completions": {"model": "default", "prompt": "hello", "max_tokens": 1},
          "/v1/responses": {"model": "default", "input": "hello", "max_output_tokens": 1}}


def post_raw(port: int, path: str, body: bytes, chunked: bool = False) -> RawReply:
    headers = [("Host", f"127.0.0.1:{port}"), ("Content-Type", "application/json")]
    if chunked:  # no Content-Length to refuse early: the body is counted as it arrives
        pieces = [body[start:start + 1000] for start in range(0, len(body), 1000)]
        data = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
        return exchange(port, request_bytes("POST", path, [*headers, ("Transfer-Encoding", "chunked")], data))
    return exchange(port, request_bytes("POST", path, [*headers, ("Content-Length", str(len(body)))], body))


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", BODIES)
def test_an_http_body_of_max_message_bytes_is_read_and_one_more_byte_is_a_413(bounded_server, path, chunked):
    port = bounded_server.port
    at_bound = post_raw(port, path, padded(BODIES[path], MESSAGE_BOUND), chunked)
    assert at_bound.status == 200, at_bound.body
    past = post_raw(port, path, padded(BODIES[path], MESSAGE_BOUND + 1), chunked)
    assert (past.status, past.error_code) == (413, "request_too_large"), past.body


@pytest.mark.parametrize("deflate", [False, True], ids=["plain", "deflate"])
def test_a_websocket_message_of_max_message_bytes_is_read_and_one_more_byte_closes_with_1009(bounded_server,
                                                                                             deflate):
    create = {"type": "response.create", "input": "hello", "max_output_tokens": 1}

    async def send(size: int) -> tuple[list[dict], int | None]:
        client = await RawClient.open(bounded_server.port, deflate=deflate)
        try:
            await client.send_text(padded(create, size))  # the bound is on the message as decompressed
            events = []
            while (event := await client.recv(timeout=30)) is not None:
                events.append(event)
                if event["type"] in CLOSING_EVENTS:
                    break
            return events, client.close_code
        finally:
            client.abort()

    events, close_code = run(send(MESSAGE_BOUND))
    assert close_code is None and events[-1]["type"] in CLOSING_EVENTS, events
    events, close_code = run(send(MESSAGE_BOUND + 1))
    assert close_code == 1009 and events == []
    wait_for_connections(bounded_server, 0)


def served_then_idle(port: int, request: bytes):
    """A connection that has had one answer and stays open (keep-alive): it holds a place among
    max_connections (one that has sent nothing is unfinished, and counted apart)."""
    sock = open_socket(port)
    sock.sendall(request)
    assert read_reply(sock).status == 200
    return sock


def test_max_connections_http_connections_are_served_and_one_more_is_a_429(bounded_server):
    port = bounded_server.port
    models = request_bytes("GET", "/v1/models", [("Host", f"127.0.0.1:{port}")])
    held = [served_then_idle(port, models) for _ in range(CONNECTION_BOUND - 1)]
    try:
        wait_for_connections(bounded_server, CONNECTION_BOUND - 1)
        assert exchange(port, models).status == 200  # the last connection there is room for
        with served_then_idle(port, models) as last:
            wait_for_connections(bounded_server, CONNECTION_BOUND)
            over = exchange(port, models)
            assert (over.status, over.error_code) == (429, "too_many_connections"), over.body
            assert f"limit of {CONNECTION_BOUND} connections" in over.json()["error"]["message"]  # which limit
            last.sendall(models)
            assert read_reply(last).status == 200  # those within the limit are still served
    finally:
        for sock in held:
            sock.close()
    wait_for_connections(bounded_server, 0)
    assert exchange(port, models).status == 200  # every slot came back


def test_max_connections_counts_websockets_and_http_together(bounded_server):
    port = bounded_server.port
    upgrade = request_bytes("GET", "/v1/responses", [("Host", f"127.0.0.1:{port}"), *WEBSOCKET_UPGRADE])
    models = request_bytes("GET", "/v1/models", [("Host", f"127.0.0.1:{port}")])

    async def main() -> None:
        clients = [await RawClient.open(port) for _ in range(CONNECTION_BOUND - 1)]
        for client in clients:  # a websocket holds a place once it has spoken
            await client.send_text(json.dumps({"type": "response.cancel"}))
            assert (await client.recv(timeout=30))["error"]["code"] == "response_cancel_not_active"
        try:
            await asyncio.to_thread(wait_for_connections, bounded_server, CONNECTION_BOUND - 1)
            third = await RawClient.open(port, path="/v1/monitor")  # the last slot, on the other endpoint
            await asyncio.to_thread(wait_for_connections, bounded_server, CONNECTION_BOUND)
            for entrance in (upgrade, models):
                over = await asyncio.to_thread(exchange, port, entrance)
                assert (over.status, over.error_code) == (429, "too_many_connections"), over.body
            third.abort()
            await asyncio.to_thread(wait_for_connections, bounded_server, CONNECTION_BOUND - 1)
            with await asyncio.to_thread(served_then_idle, port, models) as idle:  # an idle one takes the slot too
                await asyncio.to_thread(wait_for_connections, bounded_server, CONNECTION_BOUND)
                over = await asyncio.to_thread(exchange, port, upgrade)
                assert (over.status, over.error_code) == (429, "too_many_connections"), over.body
                idle.sendall(models)
                assert read_reply(idle).status == 200
        finally:
            for client in clients:
                client.abort()

    run(main())
    wait_for_connections(bounded_server, 0)


async def until_created(connection, stream_id: str) -> None:
    while True:
        event = json.loads(await connection.recv())
        assert event["type"] != "error", event
        if event["type"] == "response.created" and event.get("stream_id") == stream_id:
            return


async def until_closed(connection, count: int) -> list[dict]:
    """Events until `count` responses have closed or been refused."""
    events = []
    while sum(event["type"] in CLOSING_EVENTS or event["type"] == "error" for event in events) < count:
        events.append(json.loads(await connection.recv()))
    return events


def test_max_lanes_lanes_run_and_one_more_lane_is_refused(bounded_server):
    async def main(port: int) -> list[dict]:
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            for lane in range(LANE_BOUND):  # each running: the lanes are all active
                await connection.send(json.dumps({"type": "response.create", **LONG, "stream_id": f"lane-{lane}"}))
                await until_created(connection, f"lane-{lane}")
            await connection.send(json.dumps({"type": "response.create", **LONG, "stream_id": "one-more"}))
            refused = await until_closed(connection, 1)
            for lane in range(LANE_BOUND):
                await connection.send(json.dumps({"type": "response.cancel", "stream_id": f"lane-{lane}"}))
            return refused + await until_closed(connection, LANE_BOUND)

    events = run(main(bounded_server.port))
    errors = [(event["error"]["code"], event["stream_id"]) for event in events if event["type"] == "error"]
    assert errors == [("too_many_streams", "one-more")]
    closed = sorted(event["stream_id"] for event in events if event["type"] in CLOSING_EVENTS)
    assert closed == [f"lane-{lane}" for lane in range(LANE_BOUND)]
    wait_until_idle(bounded_server.server.models.serving_now().engine)


def test_max_queued_requests_wait_and_one_more_is_refused(bounded_server):
    short = {"type": "response.create", "input": "hello", "max_output_tokens": 1, "stream_id": "q"}

    async def main(port: int) -> list[dict]:
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            await connection.send(json.dumps({"type": "response.create", **LONG, "stream_id": "q"}))
            await until_created(connection, "q")  # running: it waits for nothing
            for _ in range(QUEUE_BOUND + 1):
                await connection.send(json.dumps(short))
            refused = await until_closed(connection, 1)
            await connection.send(json.dumps({"type": "response.cancel", "stream_id": "q"}))
            return refused + await until_closed(connection, 1 + QUEUE_BOUND)

    events = run(main(bounded_server.port))
    assert [event["error"]["code"] for event in events if event["type"] == "error"] == ["too_many_queued_requests"]
    finals = [event for event in events if event["type"] in CLOSING_EVENTS]
    assert len(finals) == 1 + QUEUE_BOUND  # the running one, cancelled, then every queued one
    assert [final["response"]["usage"]["output_tokens"] for final in finals[1:]] == [1] * QUEUE_BOUND
    wait_until_idle(bounded_server.server.models.serving_now().engine)


def head_of_size(port: int, path: str, size: int, upgrade: bool) -> bytes:
    """A GET whose head (request line, header lines, blank line) is exactly `size` bytes, padded in one header."""
    headers = [("Host", f"127.0.0.1:{port}"), *(WEBSOCKET_UPGRADE if upgrade else ())]
    padding = size - len(request_bytes("GET", path, [*headers, ("X-Padding", "")]))
    return request_bytes("GET", path, [*headers, ("X-Padding", "p" * padding)])


def send_head(port: int, head: bytes, trickled: bool) -> RawReply:
    with open_socket(port) as sock:
        if trickled:  # all but the last byte, then the last: the parser holds the incomplete head meanwhile
            sock.sendall(head[:-1])
            time.sleep(0.05)
            head = head[-1:]
        sock.sendall(head)
        return read_reply(sock)


@pytest.mark.parametrize("trickled", [False, True], ids=["whole", "trickled"])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/responses", "/v1/monitor"])
def test_a_request_head_of_max_head_bytes_is_read_and_one_more_byte_is_a_431(bounded_server, path, trickled):
    port, upgrade = bounded_server.port, path != "/v1/models"
    at_bound = send_head(port, head_of_size(port, path, MAX_HEAD_BYTES, upgrade), trickled)
    assert at_bound.status == (101 if upgrade else 200), at_bound.body
    past = send_head(port, head_of_size(port, path, MAX_HEAD_BYTES + 1, upgrade), trickled)
    assert (past.status, past.error_code) == (431, "request_header_too_large"), past.body
    wait_for_connections(bounded_server, 0)
