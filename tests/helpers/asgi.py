"""The server side of one ASGI HTTP request, played by a test (no socket, no server): `receive` hands out
the client's messages, each after its delay, and then nothing ever again; `send` records what the app
sends, each taking `send_delay_s` (None: the client never takes it); `reset` and `over_limit` stand for
the connection (transport.HttpConnection).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any


def body_messages(body: bytes, num_pieces: int = 1) -> list[dict[str, Any]]:
    """`body` as ASGI http.request messages, the last with more_body False."""
    step = max(1, -(-len(body) // num_pieces))
    chunks = [body[start:start + step] for start in range(0, len(body), step)] or [b""]
    return [{"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
            for index, chunk in enumerate(chunks)]


class AsgiPeer:
    """One request's client, as the app sees it through ASGI."""

    def __init__(self, messages: Sequence[dict[str, Any]] = (), delays_s: Sequence[float] | None = None,
                 send_delay_s: float | None = 0.0, over_limit: bool = False) -> None:
        self.messages = list(messages)
        self.delays_s = list(delays_s if delays_s is not None else [0.0] * len(self.messages))
        self.send_delay_s = send_delay_s
        self.over_limit = over_limit
        self.num_received = 0
        self.sent: list[dict[str, Any]] = []
        self.resets = 0

    def scope(self, method: str = "POST", path: str = "/v1/chat/completions",
              headers: dict[str, str] | None = None) -> dict[str, Any]:
        """An http scope whose connection is this peer."""
        return {"type": "http", "method": method, "path": path, "state": {"connection": self},
                "headers": [(name.encode(), value.encode()) for name, value in (headers or {}).items()]}

    async def receive(self) -> dict[str, Any]:
        if self.num_received == len(self.messages):
            await asyncio.Event().wait()
        await asyncio.sleep(self.delays_s[self.num_received])
        self.num_received += 1
        return self.messages[self.num_received - 1]

    async def send(self, message: dict[str, Any]) -> None:
        await asyncio.sleep(self.send_delay_s if self.send_delay_s is not None else 3600)
        self.sent.append(message)

    def reset(self) -> None:
        """The connection dropped without a goodbye."""
        self.resets += 1

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.sent[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(message["body"] for message in self.sent[1:])

    def json(self) -> Any:
        return json.loads(self.body)

    def event_data(self) -> list[Any]:
        """The `data:` of each server-sent event in the body, parsed as JSON where it is JSON."""
        found = []
        for line in self.body.decode().split("\n"):
            if line.startswith("data: "):
                text = line[len("data: "):]
                found.append(text if text == "[DONE]" else json.loads(text))
        return found
