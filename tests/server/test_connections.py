"""Clients that stop reading: a flood that is never read, a stream nobody takes, a client that vanishes.
Each is cut after a bounded buffer and time, its responses aborted, its connection slot returned; the
`num_connections` gauge comes back to zero, and closing the server never hangs."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from tests.helpers.raw_client import RawClient
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
    """The `localserve_num_connections` gauge, read from /metrics."""
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
    assert num_connections(server) == 0
    assert run(served_normally(server.port))[-1]["type"] in CLOSING_EVENTS  # nobody is locked out


def test_a_client_that_stops_reading_mid_stream_is_cut(impatient_server):
    server = impatient_server

    async def main(port: int) -> tuple[list[dict], int | None, float]:
        client = await RawClient.open(port)
        # 20 alternatives per token make every delta large; the client never takes them
        await client.send_text(json.dumps({"type": "response.create", "input": "tell me a story",
                                           "max_output_tokens": 480, "temperature": 0, "top_logprobs": 20}))
        # the client keeps its socket open: only the server can end this connection
        held_for = await asyncio.to_thread(wait_for_no_connections, server, 10)
        events, close_code = await client.read_events(timeout=10)
        client.abort()
        return events, close_code, held_for

    events, close_code, held_for = run(main(server.port))
    assert held_for >= SEND_TIMEOUT_S  # it was given its time
    # cut with 1008 (policy violation); when the close frame sits behind unread data, a reset
    assert close_code in (1008, None)
    assert not any(event["type"] in CLOSING_EVENTS for event in events)  # it never got to the end
    wait_until_idle(server.server.engine_thread)  # every block free or cached


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
