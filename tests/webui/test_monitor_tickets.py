"""The monitor's tickets (server/wire/access.py `MonitorTickets`): a browser cannot put the API key on a
websocket, so with `--api-key` it asks `POST /v1/monitor/ticket` (with the key) for a ticket and opens
`/v1/monitor?ticket=...`. A ticket is good once, for `TICKET_LIFETIME_S`; a socket with no ticket, a
used one, an expired one or a made-up one is refused (401) while a key is set; the Host and Origin
checks still apply; the key in the header still works (the TUI)."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from localserve.server.app import LocalServer
from localserve.server.config import ServerConfig
from localserve.server.registry.registry import serving_loaded
from localserve.server.wire.access import TICKET_LIFETIME_S, MonitorTickets
from tests.helpers.engine_access import CountingTokenizer, RecordedEngineThread
from tests.helpers.http_api import API_KEY, KEY, Api, response


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_is_good_once_and_only_while_it_lasts():
    clock = Clock()
    tickets = MonitorTickets(clock=clock)
    first, second, late = tickets.issue(), tickets.issue(), tickets.issue()
    assert len({first, second, late}) == 3 and len(first) >= 40
    assert tickets.redeem(first) and not tickets.redeem(first)  # single use
    clock.now += TICKET_LIFETIME_S - 0.01
    assert tickets.redeem(second)
    clock.now += 0.02
    assert not tickets.redeem(late)  # expired
    assert not tickets.redeem("made-up") and not tickets.redeem("")


def test_only_so_many_tickets_wait_the_oldest_go_first():
    tickets = MonitorTickets(clock=Clock(), max_outstanding=3)
    issued = [tickets.issue() for _ in range(5)]
    assert [tickets.redeem(ticket) for ticket in issued] == [False, False, True, True, True]


def test_the_ticket_endpoint_needs_the_key():
    api = Api(api_key=API_KEY)
    assert response(api.get("/v1/monitor/ticket", KEY))[0] == 405
    refused = api.call("POST", "/v1/monitor/ticket", body={})
    status, headers, _ = response(asyncio.run(refused))
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    status, headers, body = response(asyncio.run(api.call("POST", "/v1/monitor/ticket", body={}, headers=KEY)))
    answer = json.loads(body)
    assert status == 200 and headers["cache-control"] == "no-store"
    assert set(answer) == {"ticket", "expires_in_s"} and answer["expires_in_s"] == TICKET_LIFETIME_S


async def _status(url: str, headers: dict[str, str] | None = None) -> int | dict:
    """The handshake's refusal status, or the hello frame of an accepted monitor socket."""
    try:
        async with connect(url, additional_headers=headers or {}) as monitor:
            return json.loads(await monitor.recv())
    except InvalidStatus as refused:
        return refused.response.status_code


def test_with_a_key_the_monitor_socket_needs_a_ticket_or_the_key():
    async def main():
        server = LocalServer(serving_loaded(RecordedEngineThread(), CountingTokenizer(), "played"),
                             ServerConfig(port=0, api_key=API_KEY))
        await server.start()
        try:
            base = f"ws://127.0.0.1:{server.port}/v1/monitor"
            ticket = server.monitor_tickets.issue()
            return (await _status(base), await _status(f"{base}?ticket=forged"),
                    await _status(f"{base}?ticket={ticket}&interval=0.1"), await _status(f"{base}?ticket={ticket}"),
                    await _status(base, KEY),
                    await _status(f"{base}?ticket={server.monitor_tickets.issue()}", {"Origin": "http://evil.example"}),
                    await _status(f"ws://127.0.0.1:{server.port}/v1/responses?ticket={server.monitor_tickets.issue()}"))
        finally:
            await server.close()

    bare, forged, with_ticket, reused, with_key, foreign, other_path = asyncio.run(asyncio.wait_for(main(), 30))
    assert bare == 401 and forged == 401 and reused == 401
    assert with_ticket["type"] == "monitor.hello" and with_key["type"] == "monitor.hello"
    assert foreign == 403  # a ticket does not lift the Origin check
    assert other_path == 401  # a ticket opens the monitor, nothing else


@pytest.mark.parametrize("api_key", [None, API_KEY])
def test_tickets_are_issued_with_or_without_a_key(api_key):
    headers = KEY if api_key else {}
    status, _, body = response(asyncio.run(Api(api_key=api_key).call("POST", "/v1/monitor/ticket", body={},
                                                                     headers=headers)))
    assert status == 200 and json.loads(body)["ticket"]
