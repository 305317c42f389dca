"""A reconnecting reader of `/v1/monitor`: an async iterator of what happened on the feed.

`follow_monitor` never ends by itself: when the connection drops or cannot be made it yields a
`Disconnected` item, waits (doubling the delay up to `max_reconnect_delay_s`, back to the first delay
after a good connection) and connects again. The TUI runs it in a Textual worker; anything else that
wants the feed (a script, a test) can iterate it the same way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit, urlunsplit

from localserve.tui.feed import (
    FeedError,
    MonitorHello,
    MonitorSnapshot,
    NoModel,
    parse_hello,
    parse_no_model,
    parse_snapshot,
)
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidHandshake, WebSocketException

MONITOR_PATH = "/v1/monitor"
DEFAULT_URL = "ws://127.0.0.1:8080"
DEFAULT_INTERVAL_S = 0.2  # five screens a second: smooth enough to watch, a frame takes far less to draw
MAX_FRAME_BYTES = 64 * 2**20  # a fragmented pool of 65,536 blocks with long block tables stays far below


def monitor_url(url: str = DEFAULT_URL, interval_s: float | None = None) -> str:
    """The websocket address of the monitor feed from what a user types.

    `127.0.0.1:8080`, `http://host:port`, `ws://host:port` and the full `ws://host:port/v1/monitor`
    all name the same feed; `https` becomes `wss`.
    """
    if "://" not in url:
        url = "ws://" + url
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"not a server address: {url!r} (expected e.g. ws://127.0.0.1:8080)")
    path = parts.path.rstrip("/")
    if not path.endswith(MONITOR_PATH):
        path += MONITOR_PATH
    query = urlencode({"interval": interval_s}) if interval_s is not None else parts.query
    return urlunsplit((scheme, parts.netloc, path, query, ""))


@dataclass(frozen=True, slots=True)
class Connected:
    """A connection is open and has sent a hello frame (again when the model it shows changes)."""

    hello: MonitorHello


@dataclass(frozen=True, slots=True)
class NoModelLoaded:
    """The server has no model loaded now (`no_model.switch`: the one on its way)."""

    no_model: NoModel


@dataclass(frozen=True, slots=True)
class SnapshotReceived:
    """A snapshot of the connection that last sent `Connected`."""

    snapshot: MonitorSnapshot


@dataclass(frozen=True, slots=True)
class BadFrame:
    """A frame that does not follow the protocol; it is skipped and the connection kept."""

    error: FeedError


@dataclass(frozen=True, slots=True)
class Disconnected:
    """No connection; the next attempt comes after `retry_in_s`."""

    reason: str
    retry_in_s: float


FeedItem = Connected | NoModelLoaded | SnapshotReceived | BadFrame | Disconnected


async def follow_monitor(url: str, *, api_key: str | None = None, reconnect_delay_s: float = 0.5,
                         max_reconnect_delay_s: float = 5.0) -> AsyncIterator[FeedItem]:
    """Yield the feed at `url` (as `monitor_url` returns it) forever, reconnecting as needed."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    delay_s = reconnect_delay_s
    while True:
        try:
            async with connect(url, additional_headers=headers, max_size=MAX_FRAME_BYTES, proxy=None,
                               open_timeout=5) as connection:
                hello = None
                first = json.loads(await connection.recv())
                if isinstance(first, dict) and first.get("type") == "monitor.no_model":
                    yield NoModelLoaded(parse_no_model(first))
                else:
                    hello = parse_hello(first)
                    yield Connected(hello)
                delay_s = reconnect_delay_s
                async for message in connection:
                    try:
                        item, hello = _parse_frame(json.loads(message), hello)
                        yield item
                    except (FeedError, json.JSONDecodeError) as error:
                        yield BadFrame(error if isinstance(error, FeedError) else FeedError(f"not JSON: {error}"))
                reason = _closed_reason(connection.close_code, connection.close_reason)
        except InvalidHandshake as error:
            reason = f"refused: {error}"
        except (OSError, asyncio.TimeoutError, WebSocketException) as error:
            reason = str(error) or type(error).__name__
        except (FeedError, json.JSONDecodeError) as error:  # the hello frame itself
            reason = f"not a localserve monitor: {error}"
        yield Disconnected(reason, delay_s)
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, max_reconnect_delay_s)


def _parse_frame(frame: object, hello: MonitorHello | None) -> tuple[FeedItem, MonitorHello | None]:
    """The item of one frame after the first, and the hello that snapshots are read against from now on."""
    kind = frame.get("type") if isinstance(frame, dict) else None
    if kind == "monitor.hello":
        hello = parse_hello(frame)
        return Connected(hello), hello
    if kind == "monitor.no_model":
        return NoModelLoaded(parse_no_model(frame)), None
    if hello is None:
        raise FeedError(f"a {kind!r} frame came before any monitor.hello")
    return SnapshotReceived(parse_snapshot(frame, hello)), hello


def _closed_reason(code: int | None, reason: str) -> str:
    text = f"server closed the connection (code {code})"
    return f"{text}: {reason}" if reason else text
