"""Connections without a model: on /v1/responses a slow client gets fewer, longer deltas (never a
growing queue) and a client that goes away aborts its request; on /v1/monitor a slow client gets
fewer snapshots, always the latest, with every event; monitor events from successive snapshots."""

from __future__ import annotations

import asyncio
import json
import threading

from localserve.monitor import MonitorEvents, serve_monitor
from localserve.outputs import CompletionOutput, RequestOutput
from localserve.responses_session import ResponsesSession
from localserve.server import LocalServer, ServerConfig

NUM_TOKENS = 60


class FakeEngine:
    max_model_len = 512


class FakeEngineThread:
    """Records submissions; the test plays the engine thread by calling the callback itself."""

    def __init__(self) -> None:
        self.engine = FakeEngine()
        self.submitted: list[tuple[str, object]] = []
        self.aborted: list[str] = []

    def submit(self, prompt_ids, params, on_output, request_id=None):
        self.submitted.append((request_id, on_output))
        return request_id

    def abort(self, request_id):
        self.aborted.append(request_id)


class FakeTokenizer:
    def encode_chat(self, messages):
        return [5] * 10

    def decode(self, ids, skip_special_tokens=True):
        return "x"


class SlowConnection:
    """Delivers the client's frames, then waits until told to close; each send takes `send_delay_s`."""

    def __init__(self, frames: list[str], send_delay_s: float) -> None:
        self.frames = frames
        self.sent: list[dict] = []
        self.send_delay_s = send_delay_s
        self.closed = asyncio.Event()

    def __aiter__(self):
        return self._frames()

    async def _frames(self):
        for frame in self.frames:
            yield frame
        await self.closed.wait()

    async def send(self, message: str) -> None:
        await asyncio.sleep(self.send_delay_s)
        self.sent.append(json.loads(message))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed.set()


def make_session(connection) -> tuple[ResponsesSession, FakeEngineThread]:
    engine_thread = FakeEngineThread()
    server = LocalServer(engine_thread, FakeTokenizer(), "fake", ServerConfig(send_queue_size=8))
    return ResponsesSession(server, connection), engine_thread


def engine_outputs(request_id: str):
    for count in range(1, NUM_TOKENS + 1):
        finished = count == NUM_TOKENS
        completion = CompletionOutput(0, "", list(range(count)), 0.0, "length" if finished else None,
                                      delta_text=f"{count},", delta_token_ids=[count])
        yield RequestOutput(request_id, [5] * 10, [completion], finished)


def test_slow_client_gets_fewer_longer_deltas_and_all_the_text():
    async def main():
        create = json.dumps({"type": "response.create", "input": "hi", "max_output_tokens": NUM_TOKENS})
        connection = SlowConnection([create], send_delay_s=0.02)
        session, engine_thread = make_session(connection)
        runner = asyncio.create_task(session.run())
        while not engine_thread.submitted:
            await asyncio.sleep(0.01)
        request_id, on_output = engine_thread.submitted[0]

        def engine():  # the engine thread: one step every millisecond, much faster than the client reads
            for output in engine_outputs(request_id):
                on_output(output)
                threading.Event().wait(0.001)

        await asyncio.to_thread(engine)
        while not connection.sent or connection.sent[-1]["type"] != "response.incomplete":
            assert session.queue.qsize() <= session.queue.maxsize
            await asyncio.sleep(0.01)
        await connection.close()
        await runner
        return connection.sent, engine_thread.aborted

    sent, aborted = asyncio.run(asyncio.wait_for(main(), 30))
    deltas = [event["delta"] for event in sent if event["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "".join(f"{count}," for count in range(1, NUM_TOKENS + 1))
    assert len(deltas) < NUM_TOKENS // 2  # coalesced while the client was busy
    assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
    assert aborted == []  # it finished; nothing to abort


def test_client_that_leaves_aborts_its_request():
    async def main():
        create = json.dumps({"type": "response.create", "input": "hi"})
        connection = SlowConnection([create], send_delay_s=0)
        session, engine_thread = make_session(connection)
        runner = asyncio.create_task(session.run())
        while not engine_thread.submitted:
            await asyncio.sleep(0.01)
        await connection.close()  # the client goes away mid-response
        await runner
        return engine_thread

    engine_thread = asyncio.run(asyncio.wait_for(main(), 30))
    assert engine_thread.aborted == [engine_thread.submitted[0][0]]


def snapshot(requests: list[dict], cow_copies: int = 0, number: int = 0) -> dict:
    return {"type": "monitor.snapshot", "number": number, "slots": {"requests": requests},
            "counters": {"cow_copies": cow_copies}}


def slot(request_id: str, state: str = "running", num_preemptions: int = 0,
         num_cached_tokens: int = 0) -> dict:
    return {"id": request_id, "state": state, "num_preemptions": num_preemptions,
            "num_cached_tokens": num_cached_tokens}


def test_monitor_events_come_from_successive_snapshots():
    events = MonitorEvents()
    assert events.diff(snapshot([slot("a", num_cached_tokens=32), slot("b", "waiting")])) == [
        {"event": "admitted", "id": "a"}, {"event": "prefix_hit", "id": "a", "num_cached_tokens": 32}]
    assert events.diff(snapshot([slot("a", "waiting", num_preemptions=1), slot("b")], cow_copies=2)) == [
        {"event": "preempted", "id": "a", "state": "waiting"}, {"event": "admitted", "id": "b"},
        {"event": "copy_on_write", "num_blocks": 2}]
    assert events.diff(snapshot([slot("a", num_preemptions=1)], cow_copies=5)) == [
        {"event": "resumed", "id": "a"}, {"event": "finished", "id": "b"},
        {"event": "copy_on_write", "num_blocks": 3}]


def test_slow_monitor_client_gets_the_latest_snapshots_and_every_event():
    async def main():
        connection = SlowConnection([], send_delay_s=0.25)
        connection.wait_closed = connection.closed.wait
        numbers = iter(range(1_000_000))

        async def read_snapshot():  # a new request admitted in every snapshot
            number = next(numbers)
            return snapshot([slot(f"r{number}")], number=number)

        monitor = asyncio.create_task(serve_monitor(connection, read_snapshot, interval_s=0.02))
        await asyncio.sleep(1.0)
        await connection.close()
        await monitor
        return connection.sent, next(numbers)

    sent, num_read = asyncio.run(asyncio.wait_for(main(), 30))
    assert 2 <= len(sent) <= 6 < num_read  # about one per send, not one per interval
    numbers = [message["number"] for message in sent]
    # each the latest when it was sent, not the next of a backlog
    assert all(later - earlier >= 5 for earlier, later in zip(numbers, numbers[1:], strict=False))
    admitted = [event["id"] for message in sent for event in message["events"]
                if event["event"] == "admitted"]
    assert admitted == [f"r{number}" for number in range(len(admitted))]  # none lost in between
