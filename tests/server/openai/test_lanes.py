"""OpenAI's WebSocket mode as its SDK uses it: `stream_id` lanes (lanes run at once, a lane runs in
order, at most 16 active), `generate: false` warm-ups whose tokens later turns find cached, `store:
false` responses only their connection can continue, and `response.cancel` on a lane. The SDK
(`client.responses.connect()`) is the reference client here."""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest
from openai.types.responses import ResponsesServerEvent
from websockets.asyncio.client import connect

from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server, wait_until_idle

SERVER_EVENT = pydantic.TypeAdapter(ResponsesServerEvent)
STORY = "hello world tell me a story about the cat and the dog in the city by the river with the moon"
NEVER = {"stop": "never said"}  # a stop string the tiny model never writes: runs to max_output_tokens


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm) as server:
        yield server


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def sdk(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


async def sdk_events(connection, lanes: set[str | None]) -> list:
    """SDK events, in arrival order, until every lane in `lanes` has closed."""
    events, open_lanes = [], set(lanes)
    while open_lanes:
        event = SERVER_EVENT.validate_json(await connection.recv_bytes())  # strict: the SDK's own types
        events.append(event)
        if event.type in CLOSING_EVENTS or event.type == "error":
            open_lanes.discard(getattr(event, "stream_id", None))
    return events


async def last_event(connection):
    return (await sdk_events(connection, {None}))[-1]


def test_sdk_runs_two_lanes_at_once_on_one_connection(server):
    async def main():
        async with sdk(server).responses.connect() as connection:
            await connection.send({"type": "response.create", "input": STORY, "max_output_tokens": 120,
                                   "temperature": 0, "stream_id": "long", "localserve": NEVER})
            await connection.response.create(input="hi", max_output_tokens=3, stream_id="short")
            return await sdk_events(connection, {"long", "short"})

    events = run(main())
    long = [event for event in events if event.stream_id == "long"]
    short = [event for event in events if event.stream_id == "short"]
    assert len(long) + len(short) == len(events)  # every event names its lane
    assert long[-1].type == "response.incomplete" and long[-1].response.usage.output_tokens == 120
    assert short[-1].type in CLOSING_EVENTS
    for lane in (long, short):  # each response numbers its own events
        assert [event.sequence_number for event in lane] == list(range(len(lane)))
    # the short lane was not queued behind the long one: it closed while the long one streamed
    assert events.index(short[-1]) < events.index(long[-1])
    assert any(event.type == "response.output_text.delta" for event in events[events.index(short[-1]):])


def test_lanes_interleave_and_one_lane_runs_in_order(server):
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            for lane, tokens in (("a", 100), ("a", 2), ("b", 2)):
                await connection.send(json.dumps({"type": "response.create", "input": STORY, "temperature": 0,
                                                  "max_output_tokens": tokens, "stream_id": lane,
                                                  "localserve": NEVER}))
            arrivals = []
            while sum(event["type"] in CLOSING_EVENTS for _, event in arrivals) < 3:
                event = json.loads(await connection.recv())
                arrivals.append((event["stream_id"], event))
            return arrivals

    arrivals = run(main(server.port))
    closings = [(lane, event["response"]["usage"]["output_tokens"]) for lane, event in arrivals
                if event["type"] in CLOSING_EVENTS]
    assert closings[0] == ("b", 2)  # lane b did not wait for lane a
    assert [c for c in closings if c[0] == "a"] == [("a", 100), ("a", 2)]  # lane a: in arrival order
    lane_a = [event["type"] for lane, event in arrivals if lane == "a"]
    first_closing = next(i for i, kind in enumerate(lane_a) if kind in CLOSING_EVENTS)
    assert "response.created" not in lane_a[1:first_closing]  # the second started after the first closed


def test_at_most_sixteen_lanes_are_active(server):
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            for lane in range(17):
                await connection.send(json.dumps({"type": "response.create", "input": STORY,
                                                  "max_output_tokens": 40, "stream_id": f"lane-{lane}",
                                                  "localserve": NEVER}))
            events = []
            while sum(e["type"] in CLOSING_EVENTS or e["type"] == "error" for e in events) < 17:
                events.append(json.loads(await connection.recv()))
            return events

    events = run(main(server.port))
    errors = [event for event in events if event["type"] == "error"]
    assert [(e["error"]["code"], e["stream_id"]) for e in errors] == [("too_many_streams", "lane-16")]
    assert sum(event["type"] in CLOSING_EVENTS for event in events) == 16
    wait_until_idle(server.server.models.serving_now().engine)


def test_cancel_names_its_lane(server):
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            for lane in ("x", "y"):
                await connection.send(json.dumps({"type": "response.create", "input": STORY, "temperature": 0,
                                                  "max_output_tokens": 200, "stream_id": lane,
                                                  "localserve": NEVER}))
            await connection.send(json.dumps({"type": "response.cancel", "stream_id": "y"}))
            await connection.send(json.dumps({"type": "response.cancel", "stream_id": "z"}))
            events = []
            while sum(e["type"] in CLOSING_EVENTS or e["type"] == "error" for e in events) < 3:
                events.append(json.loads(await connection.recv()))
            return events

    finals = {(e.get("stream_id"), e["type"]): e for e in run(main(server.port))
              if e["type"] in CLOSING_EVENTS or e["type"] == "error"}
    assert finals[("y", "response.incomplete")]["response"]["status"] == "cancelled"
    assert finals[("x", "response.incomplete")]["response"]["usage"]["output_tokens"] == 200
    assert finals[("z", "error")]["error"]["code"] == "response_cancel_not_active"


def test_sdk_warm_up_then_a_turn_that_finds_the_warmed_tokens_cached(server):
    warm_input = [{"role": "user", "content": STORY}, {"role": "assistant", "content": "the cat sat by the river"}]

    async def main():
        async with sdk(server).responses.connect() as connection:
            await connection.response.create(input=warm_input, generate=False, instructions="be brief")
            warm = await sdk_events(connection, {None})
            await connection.response.create(input="and the dog", previous_response_id=warm[-1].response.id,
                                             instructions="be brief", max_output_tokens=4, temperature=0)
            return warm, await sdk_events(connection, {None})

    warm, turn = run(main())
    assert [event.type for event in warm] == ["response.created", "response.in_progress", "response.completed"]
    warmed = warm[-1].response
    assert warmed.output == [] and warmed.usage.output_tokens == 0
    final = turn[-1].response
    assert turn[-1].type in CLOSING_EVENTS and final.previous_response_id == warmed.id
    # every full block of the warmed prompt came from the prefix cache
    assert final.usage.input_tokens_details.cached_tokens >= warmed.usage.input_tokens // 16 * 16 > 0
    assert final.usage.input_tokens > warmed.usage.input_tokens


def test_sdk_gets_previous_response_not_found_for_another_connections_store_false_response(server):
    async def main():
        client = sdk(server)
        async with client.responses.connect() as owner, client.responses.connect() as other:
            await owner.response.create(input="hello world", store=False, max_output_tokens=3)
            private = (await last_event(owner)).response
            await other.response.create(input="and the cat", previous_response_id=private.id, max_output_tokens=3)
            refused = await last_event(other)
            await owner.response.create(input="and the cat", previous_response_id=private.id, max_output_tokens=3)
            return refused, await last_event(owner)

    refused, continued = run(main())
    assert refused.type == "error"
    assert (refused.error.code, refused.error.param) == ("previous_response_not_found", "previous_response_id")
    assert continued.type in CLOSING_EVENTS


def test_a_queued_turn_may_continue_the_response_ahead_of_it(server):
    """The lane waits: a follow-up sent before its previous response ended still finds it stored."""
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as connection:
            await connection.send(json.dumps({"type": "response.create", "input": STORY, "max_output_tokens": 30,
                                              "stream_id": "chat"}))
            first_id = json.loads(await connection.recv())["response"]["id"]
            await connection.send(json.dumps({"type": "response.create", "input": "and then",
                                              "previous_response_id": first_id, "max_output_tokens": 3,
                                              "stream_id": "chat"}))
            await collect_response(connection)  # the rest of the first response
            return first_id, await collect_response(connection)

    first_id, second = run(main(server.port))
    assert second[-1]["type"] in CLOSING_EVENTS
    assert second[-1]["response"]["previous_response_id"] == first_id
