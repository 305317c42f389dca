"""Bad input on /v1/responses: each mistake gets an `error` event (type, code, message, param) or the
proper close code, the connection stays usable, other clients keep streaming, and clients that
vanish mid-stream leave every block free or cached."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosedError

from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server, wait_until_idle

MAX_MESSAGE_BYTES = 64 * 1024
GOOD = {"type": "response.create", "input": "hello world", "max_output_tokens": 3}
CREATE = '{"type": "response.create", "input": "hi", '  # the start of a create event, to add one field to


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, max_message_bytes=MAX_MESSAGE_BYTES) as server:
        yield server


def url(server) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/responses"


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


async def error_then_usable(server, frame) -> dict:
    """Send `frame`; return the error event, after checking the same connection still serves a response."""
    async with connect(url(server)) as connection:
        await connection.send(frame)
        error = json.loads(await connection.recv())
        await connection.send(json.dumps(GOOD))
        events = await collect_response(connection)
        assert events[-1]["type"] in CLOSING_EVENTS, events[-1]
        return error


LONG_PROMPT = " ".join(["hello world"] * 300)  # 600 tokens; the context is 512

BAD_INPUT = [
    ("not json", "invalid_json", None),
    ("[1, 2]", "invalid_json", None),
    ('{"input": "hi"}', "missing_required_parameter", "type"),
    ('{"type": "response.explode"}', "unknown_event_type", "type"),
    ('{"type": "response.create"}', "missing_required_parameter", "input"),
    ('{"type": "response.create", "input": 5}', "invalid_type", "input"),
    ('{"type": "response.create", "input": [{"role": "wizard", "content": "hi"}]}', "invalid_value",
     "input[0].role"),
    ('{"type": "response.create", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}',
     "invalid_type", "input[0].content[0].image_url"),
    ('{"type": "response.create", "input": [{"role": "user", "content": [{"type": "input_audio"}]}]}',
     "unsupported_value", "input[0].content[0]"),
    (CREATE + '"temperature": "hot"}', "invalid_type", "temperature"),
    (CREATE + '"max_output_tokens": 1.5}', "invalid_type", "max_output_tokens"),
    (CREATE + '"max_output_tokens": true}', "invalid_type", "max_output_tokens"),
    (CREATE + '"metadata": [1]}', "invalid_type", "metadata"),
    (CREATE + '"max_output_tokens": -5}', "integer_below_min_value",
     "max_output_tokens"),
    (CREATE + '"max_output_tokens": 1000000000}', "integer_above_max_value",
     "max_output_tokens"),
    (CREATE + '"temperature": -0.5}', "decimal_below_min_value", "temperature"),
    (CREATE + '"top_p": 0}', "invalid_value", "top_p"),
    (CREATE + '"localserve": {"top_k": 0}}', "integer_below_min_value", "localserve.top_k"),
    (CREATE + '"localserve": {"beams": 2}}', "unknown_parameter",
     "localserve.beams"),
    (CREATE + '"localserve": {"n": 1000}}', "integer_above_max_value",
     "localserve.n"),
    (json.dumps({"type": "response.create", "input": LONG_PROMPT}), "context_length_exceeded", "input"),
    ('{"type": "response.cancel"}', "response_cancel_not_active", None),
    (b'{"type": "response.create", "input": "hi"}', "unsupported_data", None),
]


@pytest.mark.parametrize("frame, code, param", BAD_INPUT, ids=[case[1] + "-" + str(i) for i, case in
                                                              enumerate(BAD_INPUT)])
def test_bad_input_gets_an_error_event_and_the_connection_stays_usable(server, frame, code, param):
    error = run(error_then_usable(server, frame))
    assert error["type"] == "error" and error["status"] == 400
    assert (error["error"]["type"], error["error"]["code"], error["error"]["param"]) == (
        "invalid_request_error", code, param)
    assert error["error"]["message"]


def test_second_create_on_the_same_lane_waits_for_the_first(server):
    async def main():
        async with connect(url(server)) as connection:
            await connection.send(json.dumps(GOOD | {"max_output_tokens": 60, "temperature": 0}))
            await connection.send(json.dumps(GOOD))
            return await collect_response(connection), await collect_response(connection)

    first, second = run(main())
    assert first[-1]["type"] in CLOSING_EVENTS and second[-1]["type"] in CLOSING_EVENTS
    assert first[0]["response"]["id"] != second[0]["response"]["id"]
    # one lane runs in order: nothing of the second response arrives before the first has closed
    assert [event["type"] for event in first].count("response.created") == 1


def test_oversized_message_closes_with_1009_while_other_clients_stream(server):
    async def main():
        async with connect(url(server)) as streaming:
            await streaming.send(json.dumps(GOOD | {"max_output_tokens": 40}))
            async with connect(url(server)) as offender:
                await offender.send(json.dumps({"type": "response.create", "input": "x" * MAX_MESSAGE_BYTES}))
                with pytest.raises(ConnectionClosedError) as closed:
                    await offender.recv()
                assert closed.value.rcvd.code == 1009
            events = await collect_response(streaming)
            assert events[-1]["type"] in CLOSING_EVENTS

    run(main())


def test_garbage_from_one_client_does_not_disturb_another(server):
    async def main():
        async def noisy():
            async with connect(url(server)) as connection:
                garbage = ["{", "[]", '{"type": 1}', b"\x00\x01", '{"type": "response.create", "input": 1}']
                for frame in garbage * 10:
                    await connection.send(frame)
                for _ in range(50):
                    assert json.loads(await connection.recv())["type"] == "error"

        async def polite():
            async with connect(url(server)) as connection:
                await connection.send(json.dumps(GOOD | {"max_output_tokens": 30}))
                return await collect_response(connection)

        _, events = await asyncio.gather(noisy(), polite())
        return events

    assert run(main())[-1]["type"] in CLOSING_EVENTS


def test_fifty_clients_vanishing_mid_stream_leave_no_block_in_use(server):
    engine_thread = server.server.models.serving_now().engine

    async def vanish(index: int) -> None:
        connection = await connect(url(server))
        await connection.send(json.dumps({"type": "response.create", "input": f"tell me a story w{index}",
                                          "max_output_tokens": 300, "temperature": 0}))
        while json.loads(await connection.recv())["type"] != "response.output_text.delta":
            pass
        connection.transport.abort()  # no closing handshake: the client is simply gone

    async def main():
        await asyncio.gather(*(vanish(i) for i in range(50)))

    generated_before = engine_thread.call(lambda engine: engine.num_generation_tokens).result()
    run(main())
    wait_until_idle(engine_thread)  # every block free or cached, books balanced
    generated = engine_thread.call(lambda engine: engine.num_generation_tokens).result() - generated_before
    assert 50 <= generated < 50 * 300 // 2  # they really were cut off mid-stream
    assert run(error_then_usable(server, "not json"))["error"]["code"] == "invalid_json"  # still serving
