"""Clients that never finish a request, run in a process of their own (as a hostile local process would,
so that they do not share the server's interpreter): each kind opens a connection, begins a request and
then trickles, or stays silent, until the server closes it; with `reconnect`, it opens a new one as
soon as the old one is closed, for `duration_s`.

Kinds: `headers` (a request head, one more header line every `trickle_s`), `body` (a whole head and a
body one byte every `trickle_s`), `handshake` (a websocket upgrade head without its last blank line,
one more header line every `trickle_s`), `silent_websocket` (a whole handshake, then nothing).

`python tests/helpers/flood.py CONFIG_JSON` prints `ready` once the first connection of every worker is
open, then one JSON line: for each kind, how each connection ended (`408 request_timeout`, `close 1013`,
...) and how long the server held it, the longest per ending, and every held connection's record unless
it was evicted (evictions in a reconnecting storm are too many to list).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("headers", "body", "handshake", "silent_websocket")
WEBSOCKET_HEAD = ("Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                  "Sec-WebSocket-Version: 13\r\n")
BODY_LENGTH = 2000  # promised, never sent whole (within the test server's max_message_bytes)
EVICTED_ENDINGS = ("408 too_many_unfinished_connections", "close 1013")


def opening_bytes(kind: str, port: int) -> bytes:
    host = f"Host: 127.0.0.1:{port}\r\n"
    if kind == "headers":
        return f"POST /v1/chat/completions HTTP/1.1\r\n{host}".encode()
    if kind == "body":
        return (f"POST /v1/chat/completions HTTP/1.1\r\n{host}Content-Type: application/json\r\n"
                f"Content-Length: {BODY_LENGTH}\r\n\r\n{{").encode()
    if kind == "handshake":
        return f"GET /v1/responses HTTP/1.1\r\n{host}{WEBSOCKET_HEAD}".encode()
    return f"GET /v1/responses HTTP/1.1\r\n{host}{WEBSOCKET_HEAD}\r\n".encode()


TRICKLE = {"headers": b"X-Trickle: 1\r\n", "body": b" ", "handshake": b"X-Trickle: 1\r\n", "silent_websocket": b""}


def ending_of(data: bytes) -> str | None:
    """How the server ended the connection, from what it sent: None while that is not whole yet."""
    head, separator, rest = data.partition(b"\r\n\r\n")
    if not separator:
        return None
    status = head.split(b" ", 2)[1].decode()
    if status == "101":  # a websocket: its close frame (unmasked, from the server): 0x88, length, code
        if len(rest) < 4 or rest[0] != 0x88:
            return None if len(rest) < 4 else f"frame {rest[0]:#x}"
        return f"close {int.from_bytes(rest[2:4], 'big')}"
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    if len(rest) < length:
        return None
    try:
        code = json.loads(rest[:length])["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "?"
    return f"{status} {code}"


@dataclass
class Held:
    """One connection: when it opened, how long the server held it, how it ended."""

    kind: str
    opened_at: float  # time.monotonic(), the same clock in every process of the machine
    held_s: float
    ending: str  # an HTTP status and error code, a websocket close code, `reset`, `eof`, or `open` at the end
    bytes_trickled: int  # sent after the opening bytes


async def hold(kind: str, port: int, trickle_s: float, until: float) -> Held:
    """One connection of `kind`, held until the server ends it (or `until`)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opened_at = time.monotonic()
    data, ending = bytearray(), None
    writer.write(opening_bytes(kind, port))
    num_trickled = 0
    next_trickle = opened_at + trickle_s
    try:
        while ending is None:
            now = time.monotonic()
            if now >= until:
                ending = "open"
                break
            try:
                chunk = await asyncio.wait_for(reader.read(65536), max(0.0, min(next_trickle, until) - now))
            except asyncio.TimeoutError:
                if TRICKLE[kind]:
                    try:
                        writer.write(TRICKLE[kind])
                        num_trickled += len(TRICKLE[kind])
                    except (ConnectionError, RuntimeError):
                        pass
                next_trickle += trickle_s
                continue
            except ConnectionError:
                ending = "reset"
                break
            if not chunk:
                ending = ending_of(bytes(data)) or "eof"
                break
            data += chunk
            ending = ending_of(bytes(data))
    finally:
        writer.transport.abort()  # gone at once, as a client that reconnects at once would leave
    return Held(kind, opened_at, time.monotonic() - opened_at, ending, num_trickled)


@dataclass
class KindReport:
    """What happened to every connection of one kind."""

    endings: Counter = field(default_factory=Counter)
    longest_s: dict[str, float] = field(default_factory=dict)  # by ending
    records: list[Held] = field(default_factory=list)  # all but the evicted ones when reconnecting

    def add(self, held: Held, keep_evicted: bool) -> None:
        self.endings[held.ending] += 1
        self.longest_s[held.ending] = max(self.longest_s.get(held.ending, 0.0), held.held_s)
        if keep_evicted or held.ending not in EVICTED_ENDINGS:
            self.records.append(held)


async def flood(port: int, per_kind: int, trickle_s: float, reconnect: bool, duration_s: float) -> dict[str, Any]:
    until = time.monotonic() + duration_s
    reports = {kind: KindReport() for kind in KINDS}
    first_open = asyncio.Event()
    num_started = 0

    async def worker(kind: str) -> None:
        nonlocal num_started
        while True:
            task = asyncio.ensure_future(hold(kind, port, trickle_s, until))
            await asyncio.sleep(0)  # let it connect before the next worker does (opening order = worker order)
            if not first_open.is_set():
                num_started += 1
                if num_started == per_kind * len(KINDS):
                    first_open.set()
            held = await task
            reports[kind].add(held, keep_evicted=not reconnect)
            if not reconnect or time.monotonic() >= until:
                return

    workers = []
    for index in range(per_kind * len(KINDS)):  # kinds interleaved: h, b, hs, ws, h, b, ...
        workers.append(asyncio.ensure_future(worker(KINDS[index % len(KINDS)])))
        await asyncio.sleep(0.005)  # in a known order
    await first_open.wait()
    print("ready", flush=True)
    await asyncio.gather(*workers)
    return {kind: {"endings": dict(report.endings), "longest_s": report.longest_s,
                   "records": [asdict(held) for held in report.records]} for kind, report in reports.items()}


class Flood:
    """The flood in a child process: `start()`, then `report()` once it is over."""

    def __init__(self, port: int, per_kind: int, trickle_s: float, reconnect: bool, duration_s: float) -> None:
        self.config = {"port": port, "per_kind": per_kind, "trickle_s": trickle_s, "reconnect": reconnect,
                       "duration_s": duration_s}
        self.process: subprocess.Popen | None = None

    def start(self) -> Flood:
        """Start the child; returns once every worker's first connection is open."""
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), json.dumps(self.config)],
                                        stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        assert line.strip() == "ready", f"the flood did not start: {line!r}"
        return self

    def report(self, timeout_s: float) -> dict[str, Any]:
        """Every kind's endings, longest holds and records (waits for the child to end)."""
        output, _ = self.process.communicate(timeout=timeout_s)
        assert self.process.returncode == 0, output[-2000:]
        return json.loads(output)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    print(json.dumps(asyncio.run(flood(**settings))), flush=True)
