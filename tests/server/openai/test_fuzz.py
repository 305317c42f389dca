"""A hypothesis fuzzer against the live server (tiny model): random and adversarial client events.

Each case opens a connection (permessage-deflate negotiated) and sends a few actions: well-shaped
`response.create` events whose fields take wrong types and extreme values, random JSON, binary frames,
text frames that are not UTF-8, oversized frames, compressed bombs, cancels, floods it does not read
(then reads), floods it never reads (then vanishes). Meanwhile a canary connection streams greedy
requests. Invariants: no close code 1011, no `response.failed`; every request answered (an error or a
closing event) while the connection lasts; the canary's answers never fail and never change; /health
stays ok; at the end every block is free or cached.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from tests.helpers.fuzzing import responses_image_parts
from tests.helpers.json_strategies import extreme_numbers, json_values, maybe, nasty_text
from tests.helpers.raw_client import RawClient
from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server, wait_until_idle

NUM_CASES = 1000
MAX_MESSAGE_BYTES = 16 * 1024
ALLOWED_CLOSE_CODES = {None, 1000, 1002, 1007, 1008, 1009}  # never 1011 (internal error)
SENTINEL = json.dumps({"type": "fuzz.sentinel"})
CANARY = {"type": "response.create", "input": "hello world tell me a story", "temperature": 0,
          "max_output_tokens": 8, "localserve": {"stop": "never said"}}

# ---------------------------------------------------------------------------------- strategies
lane_names = st.none() | st.sampled_from(["a", "b", "lane-1", "x" * 256, "x" * 257, "", "a b", "ü", 5])
messages = st.lists(st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "assistant", "system",
                                                                          "developer", "tool"])),
                                           "content": maybe(nasty_text | st.lists(st.fixed_dictionaries(
                                               {"type": maybe(st.sampled_from(["input_text", "output_text",
                                                                               "input_image", "reasoning_text"])),
                                                "text": maybe(nasty_text)}) | responses_image_parts, max_size=3))},
                                          optional={"type": maybe(st.sampled_from(["message", "reasoning"])),
                                                    "reasoning_content": maybe(nasty_text)}), max_size=3)
extension = st.fixed_dictionaries({}, optional={
    "top_k": maybe(extreme_numbers), "min_p": maybe(extreme_numbers), "seed": maybe(extreme_numbers),
    "stop": maybe(nasty_text | st.lists(nasty_text, max_size=10)), "n": maybe(st.integers(0, 20)),
    "logprobs": maybe(extreme_numbers), "beams": json_values})
create_fields = {
    "input": maybe(nasty_text | messages), "instructions": maybe(nasty_text), "model": maybe(st.sampled_from(
        ["default", "tiny", "gpt-4o"])), "max_output_tokens": maybe(st.integers(1, 4) | extreme_numbers),
    "temperature": maybe(extreme_numbers), "top_p": maybe(extreme_numbers), "top_logprobs": maybe(
        extreme_numbers), "metadata": maybe(st.dictionaries(nasty_text, nasty_text, max_size=3)),
    "stream_id": lane_names, "store": maybe(st.booleans()), "generate": maybe(st.booleans()),
    "previous_response_id": maybe(st.sampled_from(["resp_nope", "@last"])), "localserve": maybe(extension),
    "tools": maybe(st.sampled_from([[{"type": "function", "name": "f", "parameters": {}}], [{"type": "web_search"}],
                                    [{"type": "namespace", "name": "n", "description": "N.", "tools": [
                                        {"type": "function", "name": "f"}]}]])),
    "client_metadata": maybe(st.dictionaries(nasty_text, nasty_text, max_size=3)),
    "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
    "text": maybe(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])),
    "reasoning": maybe(st.sampled_from([{"effort": "none"}, {"effort": "high"}])),
    "truncation": maybe(st.sampled_from(["auto", "disabled"])), "include": maybe(st.just(
        ["message.output_text.logprobs"])), "background": maybe(st.booleans()), "unknown_field": json_values,
}
# a conversation of tool turns as clients send it back: a call (whole, or cut short as an older answer held one),
# and its output by call id or by the function's name
tool_turns = st.builds(lambda arguments, output: [
    {"role": "user", "content": "hello"},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
    {"type": "function_call_output", "output": "done", **output}],
    st.sampled_from(["{}", '{"x": "un', "[]"]), st.sampled_from([{"call_id": "c1"}, {"name": "f"}, {"name": "g"}]))
creates = st.fixed_dictionaries({"type": st.just("response.create"), "input": st.just("hello") | tool_turns
                                 | create_fields.pop("input")}, optional=create_fields)
valid_lanes = st.none() | st.sampled_from(["a", "b", "c"])
valid_creates = st.fixed_dictionaries(
    {"type": st.just("response.create"), "input": st.sampled_from(["hello", "tell me a story", "the cat"])},
    optional={"max_output_tokens": st.integers(1, 4), "temperature": st.floats(0, 2), "stream_id": valid_lanes,
              "store": st.booleans(), "generate": st.booleans(), "previous_response_id": st.just("@last"),
              "top_p": st.floats(0.01, 1), "top_logprobs": st.integers(0, 3),
              "localserve": st.fixed_dictionaries({}, optional={"n": st.integers(1, 3), "seed": st.integers(
                  -(2 ** 63), 2 ** 63 - 1), "stop": st.text(min_size=1, max_size=3), "top_k": st.integers(1, 300),
                  "min_p": st.floats(0, 0.99)})})
actions = st.one_of(
    st.tuples(st.just("create"), creates),
    st.tuples(st.just("create"), valid_creates),
    st.tuples(st.just("cancel"), valid_lanes),
    st.tuples(st.just("json"), json_values),
    st.tuples(st.just("cancel"), lane_names),
    st.tuples(st.just("text"), st.text(max_size=40)),
    st.tuples(st.just("binary"), st.binary(max_size=40)),
    st.tuples(st.just("not_utf8"), st.sampled_from([b"\xff", b'{"type": "\xc3"}', b"\xed\xa0\x80"])),
    st.tuples(st.just("oversized"), st.integers(MAX_MESSAGE_BYTES + 1, 4 * MAX_MESSAGE_BYTES)),
    st.tuples(st.just("bomb"), st.integers(64, 1024)),  # KiB of spaces, compressed to almost nothing
    st.tuples(st.just("rsv"), st.just(b'{"type": "response.cancel"}')),
    st.tuples(st.just("flood"), st.integers(10, 300)),
    st.tuples(st.just("flood_and_vanish"), st.integers(100, 2000)),
)


# ---------------------------------------------------------------------------------- the harness
class Fuzzer:
    """Runs cases on one event loop against one server, with a canary streaming all along."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.num_cases = 0
        self.last_response_id = "resp_none"
        self.canary_texts: list[str] = []
        self.canary_failures: list[dict] = []
        self.canary_task = None

    def run(self, coroutine):
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, 120))

    async def canary(self) -> None:
        async with connect(f"ws://127.0.0.1:{self.port}/v1/responses") as connection:
            while True:
                await connection.send(json.dumps(CANARY))
                final = (await collect_response(connection))[-1]
                if final["type"] not in CLOSING_EVENTS or final["type"] == "response.failed":
                    self.canary_failures.append(final)
                else:
                    self.canary_texts.append(final["response"]["output"][0]["content"][0]["text"])

    async def case(self, steps: list[tuple]) -> None:
        self.num_cases += 1
        client = await RawClient.open(self.port, receive_buffer=1 << 16, deflate=True)
        owed = 1  # answers the server owes (an error, or a response's closing event); 1 for the sentinel
        try:
            for kind, payload in steps:
                owed += await self.act(client, kind, payload)
                if kind == "flood_and_vanish":
                    return
            await client.send_text(SENTINEL)
        except (ConnectionError, asyncio.TimeoutError):
            pass  # the server closed the connection (a bad frame): check how
        await self.check_answers(client, owed)
        client.abort()

    async def act(self, client: RawClient, kind: str, payload) -> int:
        """Send one action; returns how many answers it is owed (0 when it may close the connection)."""
        if kind == "create":
            event = {name: (self.last_response_id if value == "@last" else value) for name, value in payload.items()}
            await client.send_text(json.dumps(event))
            return 1
        if kind == "json":
            await client.send_text(json.dumps(payload))
            return 1
        if kind == "cancel":
            await client.send_text(json.dumps({"type": "response.cancel", "stream_id": payload}))
            return 0  # answered by an error, or by the cancelled response's own closing event
        if kind in ("text", "binary"):
            await (client.send_text(payload) if kind == "text" else client.send_binary(payload))
            return 1
        if kind == "not_utf8":
            await client.send_text(payload)  # the server closes with 1007
        elif kind == "oversized":
            await client.send_text(json.dumps({"type": "response.create", "input": "x" * payload}))
        elif kind == "bomb":
            await client.send_text(json.dumps({"type": "response.create", "input": " " * (payload << 10)}))
        elif kind == "rsv":
            await client.send_with_reserved_bit(payload)  # the server fails the connection: 1002
        elif kind == "flood":
            for _ in range(payload):
                client.protocol.send_text(b"{}")
            await client.flush()
            return payload
        elif kind == "flood_and_vanish":
            for _ in range(payload):
                client.protocol.send_text(b'{"type": "response.create", "input": 1}')
            await client.flush()
            client.abort()
        return 0

    async def check_answers(self, client: RawClient, owed: int) -> None:
        """Read until every answer owed has come and every response started has closed, or the server
        closed the connection (with an allowed code)."""
        answered, open_responses = 0, set()
        while answered < owed or open_responses:
            event = await client.recv(timeout=60)
            if event is None:
                assert client.close_code is not None or client.eof, f"no answer for 60 s ({answered}/{owed})"
                assert client.close_code in ALLOWED_CLOSE_CODES, client.close_code
                return
            kind = event["type"]
            assert kind != "response.failed", event
            if kind == "response.created":
                open_responses.add(event["response"]["id"])
            elif kind in CLOSING_EVENTS:
                open_responses.discard(event["response"]["id"])
                self.last_response_id = event["response"]["id"]
                answered += 1
            elif kind == "error":
                assert event["status"] in (400, 404, 429), event
                assert event["error"]["message"], event
                # a cancel is owed nothing: its error (nothing to cancel) is not the answer to a request
                answered += event["error"]["code"] != "response_cancel_not_active"


def health_ok(port: int) -> bool:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
        return json.loads(response.read()) == {"status": "ok"}


@pytest.fixture(scope="module")
def fuzzer(tiny_chat_llm):
    with running_server(tiny_chat_llm, max_message_bytes=MAX_MESSAGE_BYTES, default_max_output_tokens=4,
                        send_timeout_s=5.0) as server:
        fuzzer = Fuzzer(server.port)
        fuzzer.canary_task = fuzzer.loop.create_task(fuzzer.canary())
        yield fuzzer, server
        fuzzer.canary_task.cancel()
        fuzzer.loop.run_until_complete(asyncio.gather(fuzzer.canary_task, return_exceptions=True))
        fuzzer.loop.close()


def test_the_server_survives_random_and_adversarial_clients(fuzzer):
    fuzz, server = fuzzer

    @settings(max_examples=NUM_CASES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(steps=st.lists(actions, min_size=1, max_size=4))
    def one_case(steps):
        fuzz.run(fuzz.case(steps))
        if fuzz.num_cases % 100 == 0:
            assert health_ok(server.port)

    one_case()
    assert fuzz.num_cases >= NUM_CASES
    assert health_ok(server.port)
    assert not fuzz.canary_failures, fuzz.canary_failures[:3]
    assert len(fuzz.canary_texts) >= 10 and len(set(fuzz.canary_texts)) == 1  # greedy: the same every time
    fuzz.canary_task.cancel()
    fuzz.loop.run_until_complete(asyncio.gather(fuzz.canary_task, return_exceptions=True))
    wait_until_idle(server.server.models.serving_now().engine)
    assert server.server.models.serving_now().engine._thread.is_alive()
