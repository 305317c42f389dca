"""The HTTP clients of the load (tests/helpers/load.py): streamed `/v1/chat/completions` over keep-alive.

Each holds one TCP connection (HTTP/1.1 keep-alive) for a conversation of a few turns; a chat
completion carries the whole history (there is no `previous_response_id` on this endpoint). Half the
turns are greedy. A client that misbehaves closes its connection after the first text chunk (over HTTP,
closing is how a client cancels). Written on asyncio streams, with a minimal chunked-body reader, so
the load needs no HTTP client library and measures the server, not one.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.helpers.load import LoadConfig, LoadReport, Turn

FINISHES = {"stop": "completed", "length": "incomplete"}


class HttpConnection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads a server-sent event stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        self.reader, self.writer, self.port = reader, writer, port

    @classmethod
    async def open(cls, port: int) -> HttpConnection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        return cls(reader, writer, port)

    async def post(self, path: str, body: dict) -> tuple[int, dict[str, str]]:
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def body(self, headers: dict[str, str]):
        """The response body, piece by piece as it arrives (chunked or with a length)."""
        if headers.get("transfer-encoding") == "chunked":
            while size := int((await self.reader.readline()).strip(), 16):
                yield await self.reader.readexactly(size)
                await self.reader.readexactly(2)
            await self.reader.readexactly(2)
        else:
            yield await self.reader.readexactly(int(headers.get("content-length", "0")))

    async def events(self, headers: dict[str, str]):
        """The `data:` payloads of a server-sent event stream."""
        buffer = b""
        async for piece in self.body(headers):
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:].decode()

    def abort(self) -> None:
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def _words(rng: random.Random, low: int, high: int, words: list[str]) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))


async def run_http_client(index: int, port: int, config: LoadConfig, report: LoadReport, words: list[str]) -> None:
    """One HTTP client's conversation (see the module docstring)."""
    from tests.helpers.load import Turn

    rng = random.Random(config.seed * 1_000_003 + index)
    misbehaves = rng.random() < config.cancel_fraction + config.disconnect_fraction
    misbehave_at = rng.randint(0, config.min_turns - 1)
    instructions = "be brief" if rng.random() < 0.3 else None
    history: list[dict[str, str]] = []
    connection = await HttpConnection.open(port)
    try:
        for turn_index in range(rng.randint(config.min_turns, config.max_turns)):
            user = {"role": "user", "content": _words(rng, 3, 12, words)}
            greedy = rng.random() < config.greedy_fraction
            turn = Turn(index, "http", greedy, history + [user], instructions,
                        rng.randint(config.min_output_tokens, config.max_output_tokens))
            report.turns.append(turn)
            system = [{"role": "system", "content": instructions}] if instructions else []
            body = {"model": "default", "messages": system + history + [user], "stream": True,
                    "max_tokens": turn.max_output_tokens, "stream_options": {"include_usage": True},
                    **({"temperature": 0} if greedy else {"temperature": round(rng.uniform(0.3, 1.5), 3),
                                                          "top_k": rng.randint(1, 100)})}
            await asyncio.wait_for(_follow(connection, body, turn, misbehaves and turn_index == misbehave_at),
                                   config.event_timeout_s)
            if turn.outcome == "abandoned":
                return
            if turn.outcome.startswith("error"):
                continue
            history += [user, {"role": "assistant", "content": turn.text}]
    finally:
        if not connection.writer.transport.is_closing():
            await connection.close()


async def _follow(connection: HttpConnection, body: dict, turn: Turn, misbehave: bool) -> None:
    status, headers = await connection.post("/v1/chat/completions", body)
    if status != 200:
        payload = b"".join([piece async for piece in connection.body(headers)])
        turn.outcome = f"error:{json.loads(payload)['error']['code']}"
        return
    async for data in connection.events(headers):
        if data == "[DONE]":
            continue  # the body's end (the chunked terminator) follows: read it, the connection goes on
        chunk = json.loads(data)
        if "error" in chunk:
            turn.outcome = f"failed:{chunk['error']['message']}"
            continue
        if chunk.get("usage"):
            turn.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        for choice in chunk["choices"]:
            turn.text += choice["delta"].get("content") or ""
            if choice["delta"].get("content") and misbehave:
                connection.abort()  # gone mid-stream: the server must abort the response and free its blocks
                turn.outcome = "abandoned"
                return
            if choice["finish_reason"]:
                turn.outcome = FINISHES[choice["finish_reason"]]
