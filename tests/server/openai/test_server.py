"""Conformance: the official openai SDK (`responses.connect()`) against the real server, on a tiny
random model and on SmolLM2: every event parses into the SDK's typed events, in order and numbered;
previous_response_id continues a conversation from the prefix cache; max_output_tokens ends in
`response.incomplete`; `response.cancel` stops a response and frees its blocks."""

from __future__ import annotations

import asyncio
import json

import openai
import pydantic
import pytest
from openai.types.responses import ResponsesServerEvent

from tests.helpers.server import CLOSING_EVENTS, running_server, wait_until_idle

SERVER_EVENT = pydantic.TypeAdapter(ResponsesServerEvent)
LONG_INPUT = "hello world tell me a story about the cat and the dog in the city by the river with the moon"


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, model_alias="tiny-chat") as server:
        yield server


def sdk_client(server, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=api_key, max_retries=0)


async def one_response(connection, **create) -> list:
    """Send response.create and return its events, each validated strictly into the SDK's types."""
    await connection.response.create(**create)
    events = []
    while True:
        raw = await connection.recv_bytes()
        event = SERVER_EVENT.validate_json(raw)  # strict: a missing or mistyped field fails here
        assert type(event) is type(connection.parse_event(raw))
        events.append(event)
        if event.type in CLOSING_EVENTS or event.type == "error":
            return events


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_events_parse_into_sdk_types_in_order(server):
    async def main():
        async with sdk_client(server).responses.connect() as connection:
            return await one_response(connection, model="tiny-chat", input=LONG_INPUT, max_output_tokens=12,
                                      instructions="be helpful", temperature=0.7, metadata={"case": "order"})

    events = run(main())
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert set(types[4:-4]) <= {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = events[-4]
    assert deltas == done.text
    final = events[-1].response
    assert final.output[0].content[0].text == done.text
    assert final.metadata == {"case": "order"} and final.instructions == "be helpful"
    assert final.temperature == 0.7
    assert final.model == "tiny-chat"
    usage = final.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens <= 12
    if events[-1].type == "response.incomplete":
        assert usage.output_tokens == 12 and final.incomplete_details.reason == "max_output_tokens"
    else:
        assert events[-1].type == "response.completed" and final.status == "completed"


def test_two_turns_with_previous_response_id_reuse_the_prefix_cache(server):
    async def main():
        async with sdk_client(server).responses.connect() as connection:
            first = await one_response(connection, input=LONG_INPUT, max_output_tokens=8, temperature=0,
                                       instructions="you are a helpful assistant")
            second = await one_response(connection, input="and what about the sun", temperature=0,
                                        instructions="you are a helpful assistant", max_output_tokens=8,
                                        previous_response_id=first[-1].response.id)
            return first[-1].response, second[-1].response

    first, second = run(main())
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16  # at least turn one's first full block
    assert second.usage.input_tokens_details.cached_tokens % 16 == 0


def test_max_output_tokens_ends_incomplete(server):
    async def main():
        async with sdk_client(server).responses.connect() as connection:
            return await one_response(connection, input=LONG_INPUT, max_output_tokens=5, temperature=0)

    events = run(main())
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.usage.output_tokens == 5
    assert final.response.output[0].status == "incomplete"


def test_cancel_stops_the_response_and_frees_its_blocks(server):
    async def main():
        async with sdk_client(server).responses.connect() as connection:
            await connection.response.create(input=LONG_INPUT, max_output_tokens=400, temperature=0)
            events = []
            async for event in connection:
                events.append(event)
                if event.type == "response.output_text.delta" and len(events) == 5:
                    await connection.send_raw(json.dumps({"type": "response.cancel"}))
                if event.type in CLOSING_EVENTS:
                    break
            # the connection serves the next response as usual
            after = await one_response(connection, input="hi", max_output_tokens=3)
            return events, after

    events, after = run(main())
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "cancelled"
    assert final.usage.output_tokens < 400
    assert after[-1].type in ("response.completed", "response.incomplete")
    wait_until_idle(server.server.models.serving_now().engine)


def test_parallel_samples_and_logprobs_from_the_extension_field(server):
    async def main():
        async with sdk_client(server).responses.connect() as connection:
            await connection.send({"type": "response.create", "input": "hi", "max_output_tokens": 4,
                                   "localserve": {"n": 2, "seed": 7, "logprobs": 2, "top_k": 50}})
            events = []
            while events[-1:] == [] or events[-1].type not in CLOSING_EVENTS:
                events.append(SERVER_EVENT.validate_json(await connection.recv_bytes()))
            return events

    events = run(main())
    final = events[-1].response
    added = [event.item.id for event in events if event.type == "response.output_item.added"]
    assert [item.id for item in final.output] == added
    assert len(final.output) == 2
    for index, item in enumerate(final.output):
        deltas = [e for e in events if e.type == "response.output_text.delta" and e.output_index == index]
        assert "".join(e.delta for e in deltas) == item.content[0].text
        logprobs = [lp for e in deltas for lp in e.logprobs]
        assert len(logprobs) == len(item.content[0].logprobs) >= 1
        assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_unknown_model_and_unknown_previous_response_are_errors(server):
    async def main():
        async with sdk_client(server).responses.connect() as connection:
            wrong_model = await one_response(connection, model="gpt-4o", input="hi")
            unknown = await one_response(connection, input="hi", previous_response_id="resp_nope")
            fine = await one_response(connection, model="default", input="hi", max_output_tokens=2)
            return wrong_model[-1], unknown[-1], fine[-1]

    wrong_model, unknown, fine = run(main())
    assert wrong_model.type == "error"
    assert (wrong_model.error.code, wrong_model.error.param) == ("model_not_found", "model")
    assert wrong_model.error.type == "invalid_request_error" and "tiny-chat" in wrong_model.error.message
    assert unknown.error.code == "previous_response_not_found"
    assert unknown.error.param == "previous_response_id"
    assert fine.type in CLOSING_EVENTS


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path):
    from tests.helpers.server import make_llm

    llm = make_llm(smollm2_path, num_kv_blocks=512, max_model_len=2048)
    with running_server(llm) as server:
        yield server


def test_smollm2_two_turn_conversation(smollm2_server):
    async def main():
        async with sdk_client(smollm2_server).responses.connect() as connection:
            first = await one_response(connection, input="What is the capital of France?", temperature=0,
                                       max_output_tokens=16)
            second = await one_response(connection, input="And of Italy?", temperature=0,
                                        max_output_tokens=16, previous_response_id=first[-1].response.id)
            return first[-1].response, second[-1].response

    first, second = run(main())
    assert "Paris" in first.output[0].content[0].text
    assert "Rome" in second.output[0].content[0].text
    # the system prompt SmolLM2's template adds plus turn one's prompt come back from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    wait_until_idle(smollm2_server.server.models.serving_now().engine)
