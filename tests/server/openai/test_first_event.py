"""A `/v1/responses` websocket before its first event (server/openai/responses_socket.py's first-event wait, on a played
engine thread and real sockets, no model): it is unfinished until it speaks, so it is cut at its bound
(1008), or evicted for a newer connection (1013, after the linger); its first event takes a place among
max_connections, or is refused (`too_many_connections`, then 1013). A monitor is served from its opening.
The monitor frame's `connections` shows each of these, and the TUI reads the frame."""

from __future__ import annotations

import asyncio
import json
import time

from localserve.tui.feed import parse_hello, parse_snapshot
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from localserve.server.app import LocalServer
from localserve.server.config import ServerConfig
from localserve.server.registry.registry import serving_loaded
from localserve.server.wire.connection_phases import EVICTED_REASON, CloseReason, Phase, PhaseBounds
from tests.helpers.engine_access import CountingTokenizer, RecordedEngineThread

BOUNDS = PhaseBounds(first_event_s=0.5, evicted_linger_s=0.2)
CREATE = json.dumps({"type": "response.create", "input": "abc", "max_output_tokens": 50})


async def start(**config) -> tuple[LocalServer, RecordedEngineThread]:
    engine = RecordedEngineThread()
    server = LocalServer(serving_loaded(engine, CountingTokenizer(), "played"),
                         ServerConfig(port=0, phase_bounds=BOUNDS, **config))
    await server.start()
    return server, engine


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def closed(connection) -> tuple[list[dict], int | None, str | None]:
    """The frames until the server closes, its close code and reason."""
    frames = []
    try:
        async for message in connection:
            frames.append(json.loads(message))
    except ConnectionClosed:
        pass
    return frames, connection.close_code, connection.close_reason


def test_a_websocket_that_never_speaks_is_closed_with_1008_at_its_bound():
    async def main():
        server, _ = await start()
        try:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as silent:
                opened = time.monotonic()
                await until(lambda: server.connections.counts().unfinished[Phase.FIRST_EVENT] == 1)
                frames, code, reason = await closed(silent)
                held_s = time.monotonic() - opened
            await until(lambda: server.num_connections == 0)
            return frames, code, reason, held_s, server.connections.counts()
        finally:
            await server.close()

    frames, code, reason, held_s, counts = run(main())
    assert (frames, code, reason) == ([], 1008, "no event within 0.5 s of opening")
    assert BOUNDS.first_event_s * 0.9 <= held_s < BOUNDS.first_event_s + 1
    assert counts.closed[Phase.FIRST_EVENT, CloseReason.TIMEOUT] == 1 and counts.num_served == 0


def test_a_websocket_that_speaks_in_time_is_served_and_never_cut_for_silence_later():
    async def main():
        server, engine = await start()
        try:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as client:
                await client.send(CREATE)
                await until(lambda: engine.submissions)
                served = server.connections.num_served
                await asyncio.sleep(2 * BOUNDS.first_event_s)  # silent from now on: it has spoken
                engine.answer(engine.submissions[0], ["hi"], 1, finished=True, reason="stop")
                event = json.loads(await client.recv())
            return served, event["type"], server.connections.counts()
        finally:
            await server.close()

    served, first_type, counts = run(main())
    assert served == 1 and first_type == "response.created"
    assert sum(counts.closed.values()) == 0


def test_a_silent_websocket_is_evicted_for_a_newer_connection_with_1013_after_the_linger():
    async def main():
        server, _ = await start(max_unfinished_connections=1)
        try:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as silent:
                await until(lambda: server.connections.counts().unfinished[Phase.FIRST_EVENT] == 1)
                _, newer = await asyncio.open_connection("127.0.0.1", server.port)  # sends nothing either
                evicted_at = time.monotonic()
                frames, code, reason = await closed(silent)
                lingered_s = time.monotonic() - evicted_at
                newer.close()
            return frames, code, reason, lingered_s, server.connections.counts()
        finally:
            await server.close()

    frames, code, reason, lingered_s, counts = run(main())
    assert (frames, code, reason) == ([], 1013, EVICTED_REASON)
    assert BOUNDS.evicted_linger_s * 0.9 <= lingered_s < BOUNDS.first_event_s
    assert counts.closed[Phase.FIRST_EVENT, CloseReason.EVICTED] == 1


def test_a_first_event_when_max_connections_are_served_is_refused_then_closed_with_1013():
    async def main():
        server, engine = await start(max_connections=1, max_unfinished_connections=4)
        try:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as late, \
                    connect(f"ws://127.0.0.1:{server.port}/v1/responses") as first:
                await first.send(CREATE)  # served: the one place
                await until(lambda: engine.submissions)
                await late.send(CREATE)
                frames, code, reason = await closed(late)
            return frames, code, reason, len(engine.submissions)
        finally:
            await server.close()

    frames, code, reason, num_submitted = run(main())
    (error,) = frames
    assert (error["type"], error["status"], error["error"]["code"], error["error"]["type"]) == (
        "error", 429, "too_many_connections", "rate_limit_error")
    assert "limit of 1 connections" in error["error"]["message"] and "--max-connections" in error["error"]["message"]
    assert (code, reason) == (1013, "the server holds its limit of connections")
    assert num_submitted == 1  # the refused event never reached the engine


def test_the_monitor_frame_counts_the_servers_connections_and_the_tui_reads_it():
    async def main():
        server, _ = await start()
        try:
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses"), \
                    connect(f"ws://127.0.0.1:{server.port}/v1/monitor?interval=0.05") as monitor:
                hello = json.loads(await monitor.recv())
                while True:  # until a frame shows the silent websocket (it opened first, but frames race)
                    frame = json.loads(await monitor.recv())
                    if frame["connections"]["num_unfinished"]["first_event"] == 1:
                        return hello, frame
        finally:
            await server.close()

    hello, frame = run(main())
    connections = frame["connections"]
    assert connections["num_open"] == 2 and connections["num_served"] == 1  # the monitor, served without a word
    assert connections["num_unfinished"] == {"headers": 0, "body": 0, "handshake": 0, "first_event": 1}
    assert set(connections["num_closed_unfinished"]) == {"headers", "body", "handshake", "first_event"}
    assert all(counts == {"timeout": 0, "evicted": 0} for counts in connections["num_closed_unfinished"].values())
    parse_snapshot(frame, parse_hello(hello))  # the TUI's parser takes the frame as it is


def test_the_unfinished_cap_follows_max_connections_unless_given():
    def cap(**config) -> int:
        models = serving_loaded(RecordedEngineThread(), CountingTokenizer(), "played")
        server = LocalServer(models, ServerConfig(**config))
        return server.connections.max_unfinished_connections

    assert (cap(max_connections=7), cap(max_connections=7, max_unfinished_connections=3)) == (7, 3)
