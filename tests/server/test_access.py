"""Isolation between clients and from web pages: the Host header must name this server (DNS
rebinding), a duplicated Origin or Authorization header is a 400 (never a 500), `store: false`
responses belong to their connection, and /slots and /v1/monitor show labels, never response ids."""

from __future__ import annotations

import asyncio
import http.client
import json
import re

import pytest
from websockets.asyncio.client import connect

from tests.helpers.raw_client import HandshakeRefused, RawClient
from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server

API_KEY = "sekrit-key"


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, allowed_hosts=("llm.home.arpa",)) as server:
        yield server


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def get(port: int, path: str, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """A GET with exactly these headers (repeats allowed, no Host unless given)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
    for name, value in headers:
        connection.putheader(name, value)
    connection.endheaders()
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response.status, json.loads(body) if body.startswith((b"{", b"[")) else {}


@pytest.mark.parametrize("host, status", [
    ("127.0.0.1:{port}", 200), ("localhost:{port}", 200), ("[::1]:{port}", 200), ("LOCALHOST", 200),
    ("192.168.1.20:{port}", 200),  # an address: no rebinding page can have one as its origin's host
    ("llm.home.arpa:{port}", 200),  # --allowed-hosts
    ("evil.example:{port}", 403), ("localhost.evil.example", 403), ("127.0.0.1.nip.io:{port}", 403),
])
def test_gets_answer_only_hosts_that_name_this_server(server, host, status):
    for path in ("/slots", "/metrics", "/v1/models"):
        got, body = get(server.port, path, [("Host", host.format(port=server.port))])
        assert got == status, (path, host, body)
        if status == 403:
            assert body["error"]["code"] == "host_not_allowed"


def test_a_request_without_a_host_header_is_refused(server):
    assert get(server.port, "/slots", [])[0] == 403


def test_websocket_upgrades_check_the_host_header_too(server):
    async def status(host: str) -> int:
        try:
            client = await RawClient.open(server.port, headers={"Host": host})
        except HandshakeRefused as refused:
            return refused.status
        client.abort()
        return 101

    async def main():
        return [await status(host) for host in (f"localhost:{server.port}", "rebind.example")]

    assert run(main()) == [101, 403]


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_llm, server):  # after `server`: one engine thread at a time
    with running_server(tiny_chat_llm, api_key=API_KEY) as keyed:
        yield keyed


@pytest.mark.parametrize("name, values", [
    ("Authorization", [f"Bearer {API_KEY}", "Bearer wrong"]),
    ("Authorization", [f"Bearer {API_KEY}", f"Bearer {API_KEY}"]),
    ("Origin", ["http://127.0.0.1", "http://evil.example"]),
    ("Host", ["127.0.0.1", "evil.example"]),
])
def test_a_duplicated_auth_origin_or_host_header_is_a_400(keyed_server, name, values):
    port = keyed_server.port
    headers = [("Host", f"127.0.0.1:{port}"), ("Authorization", f"Bearer {API_KEY}")]
    headers = [(header, value) for header, value in headers if header != name] + [(name, v) for v in values]
    for path in ("/slots", "/v1/responses"):
        status, body = get(port, path, headers)
        assert status == 400, (path, status, body)
        assert body["error"]["code"] == "duplicate_header"


async def one(connection, **create) -> dict:
    await connection.send(json.dumps({"type": "response.create", "max_output_tokens": 3, **create}))
    return (await collect_response(connection))[-1]


def test_store_false_responses_belong_to_their_connection(server):
    async def main(port: int):
        url = f"ws://127.0.0.1:{port}/v1/responses"
        async with connect(url) as owner, connect(url) as other:
            private = await one(owner, input="hello world", store=False)
            stored = await one(owner, input="hello world")
            from_other = await one(other, input="and the cat", previous_response_id=private["response"]["id"])
            stored_from_other = await one(other, input="and the cat", previous_response_id=stored["response"]["id"])
            from_owner = await one(owner, input="and the cat", previous_response_id=private["response"]["id"])
            private_id = private["response"]["id"]
        async with connect(url) as later:  # the owner has gone: its store: false responses went with it
            after_owner_left = await one(later, input="x", previous_response_id=private_id)
        return private, from_other, stored_from_other, from_owner, after_owner_left

    private, from_other, stored_from_other, from_owner, after = run(main(server.port))
    assert private["type"] in CLOSING_EVENTS and private["response"]["store"] is False
    assert from_other["type"] == "error" and from_other["error"]["code"] == "previous_response_not_found"
    assert stored_from_other["type"] in CLOSING_EVENTS
    assert from_owner["type"] in CLOSING_EVENTS
    assert after["type"] == "error" and after["error"]["code"] == "previous_response_not_found"
    assert not server.server.conversations._by_owner  # nothing of a closed connection is kept


def test_slots_and_the_monitor_show_labels_never_response_ids(server):
    async def main(port: int):
        async with connect(f"ws://127.0.0.1:{port}/v1/monitor?interval=0.05") as monitor:
            await monitor.recv()
            async with connect(f"ws://127.0.0.1:{port}/v1/responses") as client:
                await client.send(json.dumps({"type": "response.create", "input": "tell me a story",
                                              "max_output_tokens": 300, "temperature": 0,
                                              "localserve": {"stop": "never said"}}))
                created = json.loads(await client.recv())
                frames = [await monitor.recv() for _ in range(3)]
                slots = await asyncio.to_thread(get, port, "/slots", [("Host", f"127.0.0.1:{port}")])
                await client.send(json.dumps({"type": "response.cancel"}))
                await collect_response(client)
        return created["response"]["id"], frames, slots

    response_id, frames, (status, slots) = run(main(server.port))
    assert status == 200 and slots["requests"]
    assert all(re.fullmatch(r"r\d+", request["label"]) for request in slots["requests"])
    for text in [*frames, json.dumps(slots)]:
        assert response_id not in text and "resp_" not in text
