"""Closing a websocket within a bounded time, whoever the client is."""

from __future__ import annotations

import asyncio
from typing import Any

CLOSE_TIMEOUT_S = 2.0  # a closing handshake the client does not answer is cut after this long


async def close_within(connection: Any, code: int, reason: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Close a websocket, but never wait longer than `timeout_s`: a client that reads nothing cannot
    take the close frame (websockets' own close waits for the write buffer to drain), so it is reset."""
    try:
        await asyncio.wait_for(connection.close(code, reason), timeout_s)
    except asyncio.TimeoutError:
        connection.transport.abort()
