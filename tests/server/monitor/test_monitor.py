"""/v1/monitor reads the engine's event log: every event exactly once and in order, however short the
request and however slow the reader; a reader that falls behind the buffer is told how many it missed."""

from __future__ import annotations

import asyncio
import json

import torch
from websockets.asyncio.client import connect

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.events import EventKind, EventLog
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from localserve.server.monitor.monitor import MonitorHub, serve_monitor
from localserve.server.wire.connection_phases import ConnectionBook
from tests.helpers.monitor_source import OneModelSource
from tests.helpers.server import CLOSING_EVENTS, SlowConnection, collect_response, running_server

NO_CONNECTIONS = ConnectionBook(max_connections=1, max_unfinished_connections=1)  # the counts of a server with none


def kinds_of(events: list[dict], label: str) -> list[str]:
    return [event["event"] for event in events if event.get("request") == label]


def test_short_request_between_two_snapshots_shows_each_event_once(tiny_chat_llm):
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/v1/monitor?interval=3") as monitor:
            hello = json.loads(await monitor.recv())
            first = json.loads(await monitor.recv())
            async with connect(f"ws://127.0.0.1:{port}/v1/responses") as client:
                await client.send(json.dumps({"type": "response.create", "input": "hello world",
                                              "max_output_tokens": 4, "temperature": 0}))
                events = await collect_response(client)
            assert events[-1]["type"] in CLOSING_EVENTS
            # Usually the request comes and goes within one interval; on a loaded machine a frame may fall
            # before its admission or in its middle. Either way its events arrive each exactly once.
            frames = [json.loads(await monitor.recv())]
            while not any(event["event"] == "finished" for event in frames[-1]["events"]) and len(frames) < 5:
                frames.append(json.loads(await monitor.recv()))
            after = json.loads(await monitor.recv())
            return hello, first, frames, after

    with running_server(tiny_chat_llm) as server:
        hello, first, frames, after = asyncio.run(asyncio.wait_for(main(server.port), 45))
    assert hello["type"] == "monitor.hello" and hello["num_blocks"] == 256 and hello["block_size"] == 16
    assert {row["format"] for row in hello["capacity"]} == {"fp16", "q4_rot"}  # q8_0 needs head_dim % 32 == 0
    fp16, q4 = hello["capacity"]  # what the same bytes of this fp32 pool would hold
    assert fp16["num_tokens"] == 2 * 256 * 16 and q4["num_tokens"] > 3 * fp16["num_tokens"]
    assert first["requests"] == [] and frames[-1]["requests"] == []
    events = [event for frame in frames for event in frame["events"]]
    labels = {event["request"] for event in events}
    assert len(labels) == 1
    label = labels.pop()
    assert not label.startswith("resp_")  # a label, not a response id another client could continue
    kinds = kinds_of(events, label)
    assert [k for k in kinds if k != "prefill_chunk"] == ["admitted", "first_token", "finished"]
    assert next(e for e in events if e["event"] == "finished")["reason"] == "length"
    seqs = [event["seq"] for event in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive: nothing skipped, nothing twice
    assert after["events"] == [] and after["missed_events"] == 0
    assert all(frame["missed_events"] == 0 for frame in frames)
    assert frames[-1]["counters"]["num_requests_finished"] - first["counters"]["num_requests_finished"] == 1


def test_preemption_shows_one_preempted_and_one_resumed_event(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model = load_model(folder, dtype=torch.float64).model
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64,
                                                 check_integrity=True))
    for start in range(4):
        engine.add_request(list(range(start + 3, start + 23)), SamplingParams(temperature=0, max_tokens=60,
                                                                             ignore_eos=True))
    engine.run_to_completion()
    assert engine.num_preemptions >= 1
    events, missed = engine.events.since(0)
    assert missed == 0
    for label in {event.request for event in events}:
        kinds = [event.kind for event in events if event.request == label
                 and event.kind in (EventKind.PREEMPTED, EventKind.RESUMED)]
        assert kinds == [EventKind.PREEMPTED, EventKind.RESUMED] * (len(kinds) // 2), (label, kinds)
    num_preempted = sum(event.kind is EventKind.PREEMPTED for event in events)
    assert num_preempted == engine.num_preemptions
    assert all(event.details["mode"] == "recompute" for event in events if event.kind is EventKind.PREEMPTED)


class FakeSnapshot:
    def to_json(self) -> dict:
        return {"requests": []}


class GatedConnection(SlowConnection):
    """A client that takes a frame only when the test opens the gate."""

    def __init__(self) -> None:
        super().__init__([], send_delay_s=0)
        self.gate = asyncio.Event()
        self.wait_closed = self.closed.wait

    async def send(self, message: str) -> None:
        await self.gate.wait()
        self.gate.clear()
        await super().send(message)


def test_slow_reader_is_told_how_many_events_it_missed():
    log = EventLog(capacity=10_000)

    async def read(after_seq: int):
        for _ in range(10):  # ten new events between any two reads
            log.append(EventKind.ADMITTED, "r1", num_prompt_tokens=1)
        return FakeSnapshot(), *log.since(after_seq)

    async def main():
        hub = MonitorHub(read, buffer_size=25)
        connection = GatedConnection()
        slow = asyncio.create_task(serve_monitor(connection, OneModelSource(hub, {"model": "fake"}),
                                                 interval_s=0.01, connection_counts=NO_CONNECTIONS.counts))
        for _ in range(3):  # hello, then two snapshot frames
            connection.gate.set()
            while connection.gate.is_set():
                await asyncio.sleep(0.001)
            for _ in range(5):  # meanwhile other monitor clients refresh the hub: 50 more events
                await hub.latest(0.0)
        connection.gate.set()
        await connection.close()
        await slow
        return connection.sent

    sent = asyncio.run(asyncio.wait_for(main(), 30))
    frames = sent[1:]
    assert sent[0]["type"] == "monitor.hello" and len(frames) >= 2
    assert frames[0]["missed_events"] == 0 and sum(frame["missed_events"] for frame in frames) > 0
    previous = None
    for frame in frames:  # each frame: consecutive events, and the gap before them is what it says it missed
        seqs = [event["seq"] for event in frame["events"]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        if previous is not None:
            assert seqs[0] - previous - 1 == frame["missed_events"]
        previous = seqs[-1]


def test_many_monitor_clients_share_one_snapshot_per_interval():
    num_reads = 0

    async def read(after_seq: int):
        nonlocal num_reads
        num_reads += 1  # each read builds a whole-pool snapshot on the engine thread
        return FakeSnapshot(), [], 0

    async def main():
        hub = MonitorHub(read)
        clients = [SlowConnection([], send_delay_s=0) for _ in range(8)]
        for client in clients:
            client.wait_closed = client.closed.wait
        tasks = [asyncio.create_task(serve_monitor(client, OneModelSource(hub, {"model": "fake"}),
                                                   interval_s=0.05, connection_counts=NO_CONNECTIONS.counts))
                 for client in clients]
        await asyncio.sleep(1.0)
        for client in clients:
            await client.close()
        await asyncio.gather(*tasks)
        return [len(client.sent) - 1 for client in clients]

    frames = asyncio.run(asyncio.wait_for(main(), 30))
    assert min(frames) >= 5  # every client got its snapshots...
    assert num_reads <= 1.0 / 0.05 + 3  # ...from one read per interval, not one per client
    assert num_reads < sum(frames) / 4
