"""The server itself (server/app.py), on a played engine thread (tests/helpers/engine_access.py) and real
sockets, no model: a websocket upgrade reaches the endpoint its path names (`/v1/responses` a session,
`/v1/monitor` the monitor, its interval read from the query), every connection counted while it is open;
a handler that fails closes its connection alone with 1011; `shutdown()` stops listening before any client
hears of it, then ends each response in flight with its final event before closing (websocket 1001,
HTTP after the last event) and closes the monitors with 1001. (The handshake's refusals by path, access
and connection limit are tested in test_http.py, test_access.py and test_connections.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from localserve.server.app import LocalServer
from localserve.server.config import ServerConfig
from localserve.server.registry.registry import serving_loaded
from tests.helpers.engine_access import IDLE_STATS, CountingTokenizer, RecordedEngineThread
from tests.helpers.server import collect_response

SHUTDOWN_TIMEOUT_S = 12.0  # what shutdown() waits at most for the clients to go; these all read
CREATE = json.dumps({"type": "response.create", "input": "abc", "max_output_tokens": 50})


@asynccontextmanager
async def serving(engine: RecordedEngineThread | None = None
                  ) -> AsyncIterator[tuple[LocalServer, RecordedEngineThread]]:
    engine = engine or RecordedEngineThread()
    config = ServerConfig(port=0, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)
    server = LocalServer(serving_loaded(engine, CountingTokenizer(), "played", alias="app-test"), config)
    await server.start()
    try:
        yield server, engine
    finally:
        await server.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)


async def port_refuses(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


def connections_gauge(server: LocalServer) -> float:
    text = server.metrics.render(IDLE_STATS).decode()
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "localserve_num_connections")


async def closing(connection: ClientConnection) -> list[dict]:
    """Every frame the server sends until it closes the connection."""
    frames = []
    try:
        async for message in connection:
            frames.append(json.loads(message))
    except ConnectionClosed:
        pass
    return frames


def test_v1_responses_is_served_by_a_session_whatever_the_query():
    async def main():
        async with serving() as (server, engine):
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses?unused=1") as client:
                await client.send(CREATE)
                await until(lambda: engine.submissions)
                counted = (server.num_connections, len(server.sessions), connections_gauge(server))
                engine.answer(engine.submissions[0], ["hey"], 3, finished=True, reason="stop")
                events = await collect_response(client)
            await until(lambda: server.num_connections == 0)
            return counted, events, len(server.sessions)

    counted, events, sessions_after = run(main())
    assert counted == (1, 1, 1) and sessions_after == 0
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "hey"
    assert events[-1]["response"]["model"] == "app-test"


def test_v1_monitor_says_hello_then_sends_snapshots_at_the_interval_asked():
    async def main():
        async with serving() as (server, _):
            async with connect(f"ws://127.0.0.1:{server.port}/v1/monitor?interval=0.05") as monitor:
                hello = json.loads(await monitor.recv())
                loop = asyncio.get_running_loop()
                first = json.loads(await monitor.recv())
                started = loop.time()
                for _ in range(4):
                    json.loads(await monitor.recv())
                per_frame_s = (loop.time() - started) / 4
                counted = (server.num_connections, len(server.sessions), connections_gauge(server))
            await until(lambda: server.num_connections == 0)
            return server.models.serving_now().monitor_hello, hello, first, per_frame_s, counted

    expected_hello, hello, first, per_frame_s, counted = run(main())
    assert hello == {"type": "monitor.hello", **expected_hello} and hello["model"] == "app-test"
    assert first["type"] == "monitor.snapshot" and first["blocks"] == "." * 64 and first["events"] == []
    assert 0.03 < per_frame_s < 0.4  # the asked 0.05 s, not the default 0.5 s
    assert counted == (1, 0, 1)  # counted, and no session


def test_a_monitor_interval_that_is_no_number_closes_with_1008():
    async def main():
        async with serving() as (server, _):
            async with connect(f"ws://127.0.0.1:{server.port}/v1/monitor?interval=soon") as monitor:
                frames = await closing(monitor)
                return frames, monitor.close_code, monitor.close_reason

    assert run(main()) == ([], 1008, "interval must be a number of seconds")


class BrokenMonitorEngine(RecordedEngineThread):
    def snapshot_and_events(self, after_seq):
        raise RuntimeError("the snapshot broke")


def test_a_handler_that_fails_closes_its_connection_alone_with_1011():
    async def main():
        async with serving(BrokenMonitorEngine()) as (server, engine):
            async with connect(f"ws://127.0.0.1:{server.port}/v1/monitor") as monitor:
                frames = await closing(monitor)
                closed = (monitor.close_code, monitor.close_reason)
            await until(lambda: server.num_connections == 0)
            async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as client:  # the server goes on
                await client.send(CREATE)
                await until(lambda: engine.submissions)
            return [frame["type"] for frame in frames], closed

    assert run(main()) == (["monitor.hello"], (1011, "internal error"))


async def streaming_http_response(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A streamed POST /v1/responses whose head and first events have arrived."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = json.dumps({"input": "abc", "stream": True, "max_output_tokens": 50}).encode()
    writer.write(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    received = b""
    while b"response.in_progress" not in received:
        received += await reader.read(65536)
    assert received.startswith(b"HTTP/1.1 200")
    return reader, writer


def test_shutdown_stops_listening_then_ends_every_response_with_its_final_event_then_closes():
    async def main():
        async with serving() as (server, engine):
            url = f"ws://127.0.0.1:{server.port}"
            client = await connect(f"{url}/v1/responses")
            await client.send(CREATE)
            monitor = await connect(f"{url}/v1/monitor")
            await monitor.recv()
            reader, writer = await streaming_http_response(server.port)
            await until(lambda: len(engine.submissions) == 2)
            engine.answer(engine.submissions[0], ["so far"], 2)
            shutdown_began = asyncio.get_running_loop().time()
            shutdown = asyncio.create_task(server.shutdown())
            events, refused_when_told = [], None
            try:
                async for message in client:
                    events.append(json.loads(message))
                    if events[-1]["type"] == "response.incomplete":
                        refused_when_told = await port_refuses(server.port)
            except ConnectionClosed:
                pass
            monitor_frames = await closing(monitor)
            http_rest = await reader.read()  # up to the end of the connection
            writer.close()
            await shutdown
            shutdown_s = asyncio.get_running_loop().time() - shutdown_began
            return (server, engine, events, (client.close_code, client.close_reason), refused_when_told,
                    monitor.close_code, monitor_frames, http_rest, shutdown_s)

    (server, engine, events, client_closed, refused_when_told, monitor_code, monitor_frames, http_rest,
     shutdown_s) = run(main())
    assert shutdown_s < SHUTDOWN_TIMEOUT_S / 3  # every client was told and went: no waiting out the timeout
    assert refused_when_told is True  # the port took no new connection by the time a client heard
    final = events[-1]  # the last frame before the close
    assert final["type"] == "response.incomplete" and final["response"]["incomplete_details"] == {
        "reason": "server_shutdown"}
    assert final["response"]["output"][0]["content"][0]["text"] == "so far"
    assert client_closed == (1001, "server shutting down")
    assert monitor_code == 1001 and all(frame["type"] == "monitor.snapshot" for frame in monitor_frames)
    data_lines = [line for line in http_rest.decode().split("\n") if line.startswith("data: ")]
    last = json.loads(data_lines[-1][len("data: "):])
    assert last["type"] == "response.incomplete" and last["response"]["incomplete_details"]["reason"] == (
        "server_shutdown")
    assert http_rest.endswith(b"0\r\n\r\n")  # the chunked body ended properly before the connection closed
    assert sorted(engine.aborted) == sorted(submission.request_id for submission in engine.submissions)
    assert server.num_connections == 0 and server.responses.num_running == 0


def test_a_response_running_when_the_server_stops_ends_without_an_error_logged(tiny_chat_llm, caplog,
                                                                               monkeypatch):
    """The server's event loop closes before the engine thread stops: the outputs of a step still under
    way when it closes (a real model's step takes tens of milliseconds; here each takes 0.3 s) and the
    abort's final output are dropped, not logged as an output callback's failure (`Event loop is
    closed`)."""
    import logging
    import time

    from tests.helpers.server import running_server, wait_until_idle

    engine_step = tiny_chat_llm.engine.step

    def slow_step():
        time.sleep(0.3)
        return engine_step()

    monkeypatch.setattr(tiny_chat_llm.engine, "step", slow_step)

    async def stream_until_a_delta(port: int) -> None:
        client = await connect(f"ws://127.0.0.1:{port}/v1/responses")
        await client.send(json.dumps({"type": "response.create", "input": "tell me more",
                                      "max_output_tokens": 400, "temperature": 0}))
        event: dict = {}
        while event.get("type") != "response.output_text.delta":
            event = json.loads(await client.recv())

    caplog.set_level(logging.ERROR)
    with running_server(tiny_chat_llm) as server:
        asyncio.run(stream_until_a_delta(server.port))
        engine_thread = server.server.models.serving_now().engine
        server.stop()  # the loop closes with the response running
        wait_until_idle(engine_thread)
        time.sleep(0.5)  # the step under way, and the abort's final output, have been handed over
        assert tiny_chat_llm.engine.is_idle_and_clean()
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []
