"""Connections without a model: on /v1/responses a slow client gets fewer, longer deltas (never a
growing queue) and a client that goes away aborts its request."""

from __future__ import annotations

import asyncio
import json
import threading

from localserve.engine.outputs import CompletionOutput, RequestOutput
from localserve.server.app import LocalServer
from localserve.server.config import ServerConfig
from localserve.server.openai.responses_socket import ResponsesSession
from localserve.server.registry.registry import serving_loaded
from localserve.server.wire.connection_phases import FirstEventWait
from tests.helpers.server import SlowConnection, engine_facts

NUM_TOKENS = 60


class FakeEngineThread:
    """Records submissions; the test plays the engine thread by calling the callback itself."""

    last_event_seq = 0

    def __init__(self) -> None:
        self.facts = engine_facts(max_model_len=512)
        self.submitted: list[tuple[str, object]] = []
        self.aborted: list[str] = []

    def submit(self, prompt_ids, params, on_output, request_id=None):
        self.submitted.append((request_id, on_output))
        return request_id

    def abort(self, request_id):
        self.aborted.append(request_id)


class FakeTokenizer:
    def encode_chat(self, messages, add_generation_prompt=True):
        return [5] * 10

    def decode(self, ids, skip_special_tokens=True):
        return "x"


def make_session(connection) -> tuple[ResponsesSession, FakeEngineThread]:
    engine_thread = FakeEngineThread()
    server = LocalServer(serving_loaded(engine_thread, FakeTokenizer(), "fake"), ServerConfig(send_queue_size=8))
    first_event = FirstEventWait(server.connections, server.connections.connection_opened(lambda: None))
    return ResponsesSession(server.config, server.responses, connection, first_event), engine_thread


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
