"""Isolation between clients and from web pages: the Host header must name this server (DNS
rebinding), a duplicated Origin or Authorization header is a 400 (never a 500), `store: false`
responses belong to their connection, and /slots and /v1/monitor show labels, never response ids.
The Host, Origin and API key checks meet near misses (another case, a prefix, a suffix, padding, userinfo,
a second header, the key elsewhere) on HTTP and on both websocket handshakes, sent as raw bytes."""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import re

import pytest
from websockets.asyncio.client import connect

from tests.helpers.raw_client import HandshakeRefused, RawClient
from tests.helpers.raw_http import WEBSOCKET_UPGRADE, RawReply, exchange, request_bytes
from tests.helpers.server import CLOSING_EVENTS, collect_response, running_server

API_KEY = "sekrit-key"
# as a user might write them: a port, a default port spelled out, capitals
ALLOWED_ORIGINS = ("http://localhost:3000", "https://app.example:443", "http://MyApp.Example:8000")


@pytest.fixture(scope="module")
def server(tiny_chat_llm):
    with running_server(tiny_chat_llm, allowed_hosts=("llm.home.arpa",), allowed_origins=ALLOWED_ORIGINS) as server:
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
    # HTTP/1.1 requires Host (RFC 9112: a 400 from the HTTP parser); HTTP/1.0 does not: the access check
    assert get(server.port, "/slots", [])[0] == 400
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection._http_vsn_str = "HTTP/1.0"
    connection.putrequest("GET", "/slots", skip_host=True, skip_accept_encoding=True)
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 403 and json.loads(response.read())["error"]["code"] == "host_not_allowed"
    connection.close()


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


# ------------------------------------------------------------------ near-miss credentials, on every entrance
# Each case is sent as raw bytes to an HTTP endpoint and as the opening handshake of both websocket endpoints.
ENTRANCES = {"http": "/v1/models", "responses": "/v1/responses", "monitor": "/v1/monitor"}


def knock(port: int, entrance: str, headers: list[tuple[str, str | bytes]], query: str = "") -> RawReply:
    """One request with exactly `headers`, last (after the upgrade's own, for a websocket entrance)."""
    upgrade = () if entrance == "http" else WEBSOCKET_UPGRADE
    return exchange(port, request_bytes("GET", ENTRANCES[entrance] + query, [*upgrade, *headers]))


def assert_admitted(reply: RawReply, entrance: str) -> None:
    assert reply.status == (200 if entrance == "http" else 101), (reply.status, reply.body)


def assert_refused(reply: RawReply, status: int, code: str) -> None:
    assert (reply.status, reply.error_code) == (status, code), (reply.status, reply.body)


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("host, admitted", [
    ("127.0.0.1", True), ("127.0.0.1:{port}", True), ("LocalHost:{port}", True), ("[::1]:{port}", True),
    ("[::FFFF:127.0.0.1]:{port}", True),
    ("127.0.0.1:9", True),  # another port: a port forward (ssh -L) names the server by its own port
    ("llm.home.arpa", True), ("LLM.Home.ARPA:{port}", True),  # host names are case-insensitive
    # a suffix or a prefix of an allowed name is another name
    ("127.0.0.1.evil.example", False), ("evil127.0.0.1", False), ("localhost.evil.example:{port}", False),
    ("evillocalhost", False), ("llm.home.arpa.evil.example", False), ("xllm.home.arpa", False),
    ("home.arpa", False), ("localhost.", False),  # the absolute name is not on the list either
    # userinfo, a path, a query or a fragment: no Host carries them, a lenient URL parser strips them
    ("evil.example@127.0.0.1", False), ("evil.example@localhost:{port}", False), ("localhost@evil.example", False),
    ("127.0.0.1/evil.example", False), ("localhost#.evil.example", False), ("localhost?.evil.example", False),
    # a malformed port, two names, padding inside, brackets around a name
    ("localhost:http", False), ("localhost:{port}:{port}", False), ("localhost:-1", False),
    ("localhost, evil.example", False), ("localhost evil.example", False),
    ("localhost\t", True),  # whitespace around a header's value is not part of it
    (b"localhost\xa0", False), ("[localhost]", False), ("[::1", False), ("", False),
])
def test_host_near_misses(server, entrance, host, admitted):
    value = host.replace(b"{port}", str(server.port).encode()) if isinstance(host, bytes) else host.format(
        port=server.port)
    reply = knock(server.port, entrance, [("Host", value)])
    if admitted:
        assert_admitted(reply, entrance)
    else:
        assert_refused(reply, 403, "host_not_allowed")


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("origin, admitted", [
    ("http://localhost:3000", True), ("http://127.0.0.1:{port}", True), ("http://localhost:{port}", True),
    ("http://[::1]:{port}", True), ("http://localhost:3000/", True),
    ("HTTP://LOCALHOST:3000", True), ("http://myapp.example:8000", True),  # scheme and host are case-insensitive
    ("https://app.example", True), ("https://app.example:443", True),  # the default port, left out or not
    ("null", False),  # sandboxed frames and file:// pages, all alike
    ("http://localhost:3000.evil.example", False), ("http://evil.localhost:3000", False),
    ("http://localhost.evil.example:3000", False), ("http://localhost:30000", False), ("http://localhost:300", False),
    ("http://localhost", False), ("https://localhost:3000", False), ("ws://localhost:3000", False),
    ("http://app.example", False), ("https://app.example:8443", False), ("http://127.0.0.1:1", False),
    ("http://evil.example@localhost:3000", False), ("http://localhost:3000@evil.example", False),
    ("http://localhost:3000/evil", False), ("http://localhost:3000, http://evil.example", False),
    ("http://localhost:3000 http://evil.example", False), ("//localhost:3000", False), ("localhost:3000", False),
    ("", False),
])
def test_origin_near_misses(server, entrance, origin, admitted):
    headers = [("Host", f"127.0.0.1:{server.port}"), ("Origin", origin.format(port=server.port))]
    reply = knock(server.port, entrance, headers)
    if admitted:
        assert_admitted(reply, entrance)
    else:
        assert_refused(reply, 403, "origin_not_allowed")


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("name, values", [
    ("Host", ["127.0.0.1", "127.0.0.1"]), ("Host", ["evil.example", "127.0.0.1"]),
    ("Origin", ["http://localhost:3000", "http://localhost:3000"]), ("Origin", ["null", "http://localhost:3000"]),
])
def test_a_second_host_or_origin_header_is_a_400_on_every_entrance(server, entrance, name, values):
    headers = [("Host", f"127.0.0.1:{server.port}")] if name != "Host" else []
    # the second spelled in lower case: header names are case-insensitive, it is the same header
    headers += [(name, values[0]), (name.lower(), values[1])]
    assert_refused(knock(server.port, entrance, headers), 400, "duplicate_header")


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("authorization, admitted", [
    (f"Bearer {API_KEY}", True),
    (f"bearer {API_KEY}", True), (f"BEARER {API_KEY}", True),  # the scheme is case-insensitive (RFC 9110 11.1)
    (f"Bearer  {API_KEY}", True),  # 1*SP between scheme and token
    (f"Bearer {API_KEY} \t".encode(), True),  # trailing whitespace is not part of a header's value
    (f"Bearer {API_KEY}\nX-Next: 1".encode(), True),  # a bare LF ends the header line
    # the key in another case, a prefix, a suffix, with padding inside
    (f"Bearer {API_KEY.upper()}", False), (f"Bearer {API_KEY.capitalize()}", False),
    (f"Bearer {API_KEY[:-1]}", False), (f"Bearer {API_KEY[:1]}", False), (f"Bearer {API_KEY}x", False),
    (f"Bearer x{API_KEY}", False), (f"Bearer {API_KEY}{API_KEY}", False), ("Bearer sekrit key", False),
    (f"Bearer \t{API_KEY}", False), (f"Bearer\t{API_KEY}", False),
    (f"Bearer {API_KEY}\xa0".encode("latin-1"), False), (f"Bearer \xa0{API_KEY}".encode("latin-1"), False),
    (f"Bearer {API_KEY}\x85".encode("latin-1"), False),  # whitespace to Python, not to HTTP
    # no token, no scheme, another scheme, a list
    ("Bearer", False), ("Bearer ", False), ("", False), (API_KEY, False), (f"Bearer{API_KEY}", False),
    (f"Token {API_KEY}", False), ("Basic " + base64.b64encode(f":{API_KEY}".encode()).decode(), False),
    ("Basic " + base64.b64encode(f"{API_KEY}:".encode()).decode(), False),
    (f"Bearer wrong, Bearer {API_KEY}", False), (f"Bearer {API_KEY}, Bearer {API_KEY}", False),
])
def test_api_key_near_misses(keyed_server, entrance, authorization, admitted):
    port = keyed_server.port
    reply = knock(port, entrance, [("Host", f"127.0.0.1:{port}"), ("Authorization", authorization)])
    if admitted:
        assert_admitted(reply, entrance)
    else:
        assert_refused(reply, 401, "invalid_api_key")
        assert reply.header("WWW-Authenticate") == "Bearer"


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("headers, query", [
    ([("Proxy-Authorization", f"Bearer {API_KEY}")], ""), ([("Api-Key", API_KEY)], ""),
    ([("Cookie", f"api_key={API_KEY}")], ""), ([], f"?api_key={API_KEY}"), ([], f"?key={API_KEY}"),
    ([("Authorization-Bearer", API_KEY)], ""), ([], ""),
])
def test_the_key_in_another_header_or_the_query_is_no_key(keyed_server, entrance, headers, query):
    port = keyed_server.port
    assert_refused(knock(port, entrance, [("Host", f"127.0.0.1:{port}"), *headers], query), 401, "invalid_api_key")


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("values", [
    ["Bearer wrong", f"Bearer {API_KEY}"], [f"Bearer {API_KEY}", "Bearer wrong"], ["", f"Bearer {API_KEY}"],
    [f"Bearer {API_KEY}", f"Bearer {API_KEY}"],
])
def test_a_second_authorization_header_is_a_400_on_every_entrance(keyed_server, entrance, values):
    port = keyed_server.port
    headers = [("Host", f"127.0.0.1:{port}"), ("Authorization", values[0]), ("authorization", values[1])]
    assert_refused(knock(port, entrance, headers), 400, "duplicate_header")


def test_a_carriage_return_inside_the_key_is_a_malformed_request(keyed_server):
    port = keyed_server.port
    headers = [("Host", f"127.0.0.1:{port}"), ("Authorization", f"Bearer {API_KEY}\r".encode())]
    for entrance in ENTRANCES:
        assert_refused(knock(port, entrance, headers), 400, "invalid_http_request")


@pytest.mark.parametrize("entrance", ENTRANCES)
@pytest.mark.parametrize("value, admitted", [
    (API_KEY, True),  # Anthropic's clients send the key so (x-api-key: KEY), any case of the name
    (f"Bearer {API_KEY}", False), (API_KEY.upper(), False), (API_KEY[:-1], False), (f"{API_KEY}x", False),
    (f"{API_KEY}, {API_KEY}", False), ("", False), (f"{API_KEY}\xa0".encode("latin-1"), False),
])
def test_the_x_api_key_header_carries_the_key_as_bearer_does(keyed_server, entrance, value, admitted):
    port = keyed_server.port
    reply = knock(port, entrance, [("Host", f"127.0.0.1:{port}"), ("X-Api-Key", value)])
    if admitted:
        assert_admitted(reply, entrance)
    else:
        assert_refused(reply, 401, "invalid_api_key")


def test_a_second_x_api_key_header_is_a_400(keyed_server):
    port = keyed_server.port
    for entrance in ENTRANCES:
        headers = [("Host", f"127.0.0.1:{port}"), ("x-api-key", "wrong"), ("X-Api-Key", API_KEY)]
        assert_refused(knock(port, entrance, headers), 400, "duplicate_header")
