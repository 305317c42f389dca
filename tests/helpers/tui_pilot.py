"""Driving the monitor TUI under textual's Pilot: an app following a fake monitor, wait for a condition, read
the event log's lines and the block map's cells."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from localserve.tui.app import MonitorApp
from localserve.tui.block_map import BlockMap
from localserve.tui.event_log import EventLog

from tests.helpers.fake_monitor import FakeMonitor
from tests.helpers.monitor_frames import hello_frame


async def wait_until(pilot, condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Let the app run until `condition()` holds; fails the test after `timeout_s`, naming `what`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.02)


def log_text(log: EventLog) -> list[str]:
    """The event log's lines as plain text, trailing blanks stripped."""
    return [strip.text.rstrip() for strip in log.lines]


def run_with_monitor(scenario, hello=None, size=(120, 40)) -> None:
    """Run `scenario(pilot, app, monitor)` with a fake monitor and an app following it."""
    async def main() -> None:
        monitor = await FakeMonitor(hello or hello_frame(64)).start()
        app = MonitorApp(monitor.url, reconnect_delay_s=0.05)
        try:
            async with app.run_test(size=size) as pilot:
                await wait_until(pilot, lambda: app.hello is not None, "the hello frame")
                await scenario(pilot, app, monitor)
        finally:
            await monitor.stop()
    asyncio.run(main())


def map_cells(block_map: BlockMap) -> list[tuple[str, str]]:
    """(glyph, colour) of every cell the map draws for the GPU pool, in block order."""
    chars = []
    columns = block_map.size.width // block_map.cell_width
    for y in range(-(-block_map.grid.states.size // columns)):
        line = []
        for segment in block_map.render_line(y):
            line += [(char, str(segment.style.color.name)) for char in segment.text]
        chars += line[:columns * block_map.cell_width:block_map.cell_width]
    return chars[:block_map.grid.states.size]
