"""Snapshot tests of the main screen (pytest-textual-snapshot), built from a fixed scene.

Update them after an intended change of the screen with `pytest tests/tui/test_snapshots.py --snapshot-update`
and look at the SVGs under `__snapshots__/` before committing.
"""

from __future__ import annotations

import time

import pytest
from localserve.tui.app import MonitorApp

from tests.helpers.monitor_scenes import busy_scene, fill_app


@pytest.fixture(autouse=True)
def utc_clock(monkeypatch):
    """Event times are drawn in local time; fix the zone so the screen is the same everywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


async def _load_scene(pilot) -> None:
    fill_app(pilot.app, *busy_scene())
    await pilot.pause()
    pilot.app.query_one("#slots").focus()
    await pilot.press("down", "enter")  # select r3: its blocks in yellow


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_main_screen(snap_compare, size):
    assert snap_compare(MonitorApp(), terminal_size=size, run_before=_load_scene)
