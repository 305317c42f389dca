"""Driving the monitor TUI under textual's Pilot: wait for a condition, read the event log's lines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from localserve.tui.event_log import EventLog


async def wait_until(pilot, condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Let the app run until `condition()` holds; fails the test after `timeout_s`, naming `what`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.02)


def log_text(log: EventLog) -> list[str]:
    """The event log's lines as plain text, trailing blanks stripped."""
    return [strip.text.rstrip() for strip in log.lines]
