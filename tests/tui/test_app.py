"""The TUI against a fake `/v1/monitor` server that sends fixed frames (Pilot tests, headless)."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
from localserve.tui.app import HelpScreen, MonitorApp
from localserve.tui.block_map import GLYPHS, SELECTED_COLOUR, BlockMap
from localserve.tui.client import Connected, SnapshotReceived
from localserve.tui.event_log import EventLog
from localserve.tui.feed import BlockState, parse_hello, parse_snapshot
from localserve.tui.panels import PressureBanner, StatusLine
from localserve.tui.slots import SlotsTable

from tests.helpers.fake_monitor import FakeMonitor
from tests.helpers.monitor_frames import event_entry, hello_frame, request_entry, snapshot_frame
from tests.helpers.tui_pilot import log_text, map_cells, run_with_monitor, wait_until

# 64 blocks: r1 has two sequences sharing blocks 0-3 (s) with tails 4-5 and 6-7; r2 holds 8-11; 12-17 cached.
STATES = "s" * 4 + "u" * 8 + "c" * 6 + "." * 46
REQUESTS = [request_entry("r1", "decode", [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 6, 7]], num_cached_tokens=48),
            request_entry("r2", "prefill", [[8, 9, 10, 11]], num_prompt_tokens=400, num_computed_prompt_tokens=64,
                          num_output_tokens=0, tokens_per_s=0.0),
            request_entry("r3", "preempted", [], num_preemptions=2, num_output_tokens=30)]


def test_block_map_draws_one_cell_per_block_in_its_state():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(STATES, requests=REQUESTS))
        await wait_until(pilot, lambda: app.snapshot is not None, "a snapshot")
        await pilot.pause()
        block_map = app.query_one(BlockMap)
        assert block_map.grid.blocks_per_cell == 1
        glyphs = collections.Counter(glyph for glyph, _ in map_cells(block_map))
        assert glyphs == {GLYPHS[BlockState.SHARED]: 4, GLYPHS[BlockState.USED]: 8,
                          GLYPHS[BlockState.CACHED]: 6, GLYPHS[BlockState.EMPTY]: 46}
        legend = "".join(block_map.render_line(y).text for y in range(block_map.size.height))
        assert "free 46" in legend and "cached 6" in legend and "used 8" in legend and "shared 4" in legend
        assert "free queue 52 (6 cached)" in legend
        assert "1 block/cell" in block_map.border_subtitle
    run_with_monitor(scenario)


def test_block_map_downsamples_a_large_pool_and_says_by_how_much():
    num_blocks = 8192
    states = "u" * 6000 + "c" * 1000 + "." * 1192

    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(states))
        await wait_until(pilot, lambda: app.snapshot is not None, "a snapshot")
        await pilot.pause()
        block_map = app.query_one(BlockMap)
        grid = block_map.grid
        assert grid.blocks_per_cell > 1
        assert grid.states.size * grid.blocks_per_cell >= num_blocks
        assert grid.states.size <= block_map.size.width * block_map.size.height
        assert f"{grid.blocks_per_cell} blocks/cell" in block_map.border_subtitle
        # Cells wholly inside one run show that run's state.
        used_cells = 6000 // grid.blocks_per_cell
        assert (grid.states[:used_cells] == BlockState.USED).all()
        assert (grid.states[-(1192 // grid.blocks_per_cell):] == BlockState.EMPTY).all()
        assert "used 6000" in "".join(block_map.render_line(y).text for y in range(block_map.size.height))
    run_with_monitor(scenario, hello=hello_frame(num_blocks), size=(80, 24))


def test_slots_table_rows():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(STATES, requests=REQUESTS))
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 3, "three rows")
        table = app.query_one(SlotsTable)
        assert table.rows == [("r1 ×2", "decode", "40", "12", "12.5", "0", "48"),
                              ("r2", "prefill 16% 64/400", "400", "0", "-", "0", "0"),
                              ("r3", "preempted", "40", "30", "12.5", "2", "0")]
        screen_rows = [table.render_line(y).text.split() for y in range(4)]
        assert screen_rows[0] == ["request", "state", "prompt", "gen", "tok/s", "preempt", "prefix", "hit"]
        assert screen_rows[2] == ["r2", "prefill", "16%", "64/400", "400", "0", "-", "0", "0"]
        # The next snapshot updates rows in place and drops finished requests.
        monitor.send(snapshot_frame(STATES, requests=[REQUESTS[1] | {"state": "decode", "num_output_tokens": 3}]))
        await wait_until(pilot, lambda: len(table.rows) == 1, "one row")
        assert table.rows[0][:4] == ("r2", "decode", "400", "3")
        assert table.render_line(1).text.split()[:4] == ["r2", "decode", "400", "3"]
    run_with_monitor(scenario)


def test_selecting_a_slot_highlights_exactly_its_blocks():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(STATES, requests=REQUESTS))
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 3, "three rows")
        app.query_one(SlotsTable).focus()
        await pilot.press("enter")  # the cursor starts on r1
        await pilot.pause()
        block_map = app.query_one(BlockMap)
        cells = map_cells(block_map)
        highlighted = [index for index, (_, colour) in enumerate(cells) if colour == SELECTED_COLOUR]
        assert highlighted == [0, 1, 2, 3, 4, 5, 6, 7]
        assert [cells[index][0] for index in highlighted] == ["▓"] * 4 + ["█"] * 4  # shared ones marked
        assert "r1: 8 blocks, 4 shared" in block_map.border_subtitle

        await pilot.press("down", "enter")
        await pilot.pause()
        cells = map_cells(block_map)
        assert [index for index, (_, colour) in enumerate(cells) if colour == SELECTED_COLOUR] == [8, 9, 10, 11]
        assert app.selected_label == "r2"

        await pilot.press("enter")  # selecting it again clears it
        await pilot.pause()
        assert app.selected_label is None
        assert not any(colour == SELECTED_COLOUR for _, colour in map_cells(block_map))

        await pilot.press("enter")
        monitor.send(snapshot_frame(STATES, requests=REQUESTS[:1]))  # r2 finished: nothing to highlight
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 1, "r2 gone")
        assert app.selected_label is None
        assert not np.any(block_map.grid.selected)
    run_with_monitor(scenario)


def test_pressure_warning_appears_under_pressure_and_clears_when_it_stops():
    full = "u" * 63 + "."  # 98% used

    async def scenario(pilot, app, monitor):
        banner = app.query_one(PressureBanner)

        async def send(time_s: float, states: str, num_preemptions: int) -> None:
            monitor.send(snapshot_frame(states, time_s=time_s, num_preemptions=num_preemptions))
            await wait_until(pilot, lambda: app.snapshot is not None and app.snapshot.time == 1764400000.0 + time_s,
                             f"the snapshot at {time_s}")
            await pilot.pause()

        await send(0.0, full, 0)
        assert not banner.display  # pinned, but nothing preempted yet
        await send(0.5, full, 3)
        assert banner.display and "98% full" in str(banner.render()) and "3 preemptions" in str(banner.render())
        await send(3.0, full, 5)
        assert banner.display
        await send(9.0, full, 5)  # no preemption for more than the 5-second window
        assert not banner.display
        await send(9.5, full, 6)
        assert banner.display
        await send(10.0, "u" * 32 + "." * 32, 7)  # preempting, but the pool has room again
        assert not banner.display
    run_with_monitor(scenario)


def test_event_log_and_missed_events_notice():
    events = [event_entry(1, "admitted", "r1", num_prompt_tokens=40),
              event_entry(2, "prefix_hit", "r1", num_cached_tokens=32),
              event_entry(3, "preempted", "r1", mode="swap", fallback=True),
              event_entry(4, "copy_on_write", "r2", num_blocks=1),
              event_entry(5, "finished", "r1", reason="stop")]

    async def scenario(pilot, app, monitor):
        log = app.query_one(EventLog)
        monitor.send(snapshot_frame(STATES, events=events))
        await wait_until(pilot, lambda: any("finished" in line for line in log_text(log)), "the events")
        lines = [line.split(maxsplit=1)[1] for line in log_text(log) if line[:2].isdigit()]  # without the clock
        assert lines == ["r1 admitted, 40 prompt tokens", "r1 prefix hit, 32 tokens from the cache",
                         "r1 preempted: swap (swap pool full)", "r2 copy on write, 1 blocks", "r1 finished: stop"]
        monitor.send(snapshot_frame(STATES, events=[event_entry(43, "resumed", "r1")], missed_events=37))
        await wait_until(pilot, lambda: any("resumed" in line for line in log_text(log)), "the resumed event")
        text = log_text(log)
        notice = next(index for index, line in enumerate(text) if "missed 37 events" in line)
        assert "resumed" in text[notice + 1]  # the notice comes before the events after the gap
        assert "missed 37 events" in str(app.query_one(StatusLine).render())
    run_with_monitor(scenario)


def test_reconnects_after_the_server_restarts():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(STATES, requests=REQUESTS))
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 3, "three rows")
        await monitor.stop()
        status = app.query_one(StatusLine)
        await wait_until(pilot, lambda: "reconnecting" in str(status.render()), "the reconnecting status")
        assert any("disconnected" in line for line in log_text(app.query_one(EventLog)))

        restarted = await FakeMonitor(hello_frame(128, model="Other-Model"), port=monitor.port).start()
        try:
            await wait_until(pilot, lambda: app.hello.num_blocks == 128, "the new server's hello")
            restarted.send(snapshot_frame("u" * 5 + "." * 123, requests=REQUESTS[1:2]))
            await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 1, "the new server's rows")
            assert "live" in str(status.render()) and "Other-Model" in str(status.render())
            assert collections.Counter(glyph for glyph, _ in map_cells(app.query_one(BlockMap)))["█"] == 5
            assert restarted.paths == ["/v1/monitor"]
        finally:
            await restarted.stop()
    run_with_monitor(scenario)


def test_a_bad_frame_is_reported_and_skipped():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame("x" * 64))  # not a block state
        monitor.send(snapshot_frame(STATES, requests=REQUESTS))
        await wait_until(pilot, lambda: app.snapshot is not None, "the good snapshot")
        assert any("unknown block state 'x'" in line for line in log_text(app.query_one(EventLog)))
        assert len(app.query_one(SlotsTable).rows) == 3
    run_with_monitor(scenario)


def test_pause_freezes_the_screen_and_resume_catches_up():
    async def scenario(pilot, app, monitor):
        monitor.send(snapshot_frame(STATES, requests=REQUESTS, time_s=0.0))
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 3, "three rows")
        await pilot.press("p")
        monitor.send(snapshot_frame(STATES, requests=REQUESTS[:1], time_s=0.5,
                                    events=[event_entry(9, "finished", "r2", reason="length")]))
        await wait_until(pilot, lambda: len(app.history.series["kv_usage"]) == 2, "the second snapshot")
        await pilot.pause()
        assert len(app.query_one(SlotsTable).rows) == 3  # frozen
        assert "paused" in str(app.query_one(StatusLine).render())
        assert not any("finished" in line for line in log_text(app.query_one(EventLog)))
        await pilot.press("p")
        await pilot.pause()
        assert len(app.query_one(SlotsTable).rows) == 1
        assert any("r2 finished: length" in line for line in log_text(app.query_one(EventLog)))
    run_with_monitor(scenario)


def test_help_and_quit_keys():
    async def main() -> None:
        app = MonitorApp()
        async with app.run_test() as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            footer_keys = {binding.key for binding in app.BINDINGS if binding.show}
            assert footer_keys == {"q", "p", "question_mark"}
            await pilot.press("ctrl+c")
            await pilot.pause()
        assert app.return_code == 0
    asyncio.run(main())


def test_server_log_panel_shows_records_logged_from_any_thread():
    import logging
    import threading

    from localserve.tui.server_log import LogBuffer, ServerLog

    buffer = LogBuffer()
    logger = logging.getLogger("localserve.test_tui")
    logger.addHandler(buffer)
    logger.setLevel(logging.INFO)

    async def main() -> None:
        app = MonitorApp(server_log=buffer)
        async with app.run_test(size=(160, 48)) as pilot:
            worker = threading.Thread(target=lambda: logger.warning("preempted r7 (recompute)"))
            worker.start()
            worker.join()
            logger.info("listening on ws://127.0.0.1:8080")
            panel = app.query_one(ServerLog)
            await wait_until(pilot, lambda: len(panel.lines) == 2, "two log lines")
            text = [strip.text for strip in panel.lines]
            assert "WARNING localserve.test_tui: preempted r7 (recompute)" in text[0]
            assert "listening on ws://127.0.0.1:8080" in text[1]
    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(buffer)


def test_a_frame_that_arrives_while_the_app_shuts_down_is_dropped():
    # The feed's worker can hand over a frame after the app began shutting down (its widgets already
    # pruned, the worker not yet cancelled); drawing it would raise NoMatches out of the worker.
    hello = parse_hello(hello_frame(64))
    frame = parse_snapshot(snapshot_frame(STATES, requests=REQUESTS), hello)

    async def main() -> MonitorApp:
        app = MonitorApp(None)
        async with app.run_test(size=(120, 40)):
            app.handle_feed_item(Connected(hello))
        return app

    app = asyncio.run(main())
    app.handle_feed_item(SnapshotReceived(frame))  # shut down: nothing to draw on, and nothing raised
    assert app.snapshot is None


def test_a_model_switch_shows_its_phases_then_the_new_models_pool():
    # A server of several models: its snapshots say which model is on its way, no-model frames come while
    # none is loaded, and the new model's hello starts its pool on the same connection.
    async def scenario(pilot, app, monitor):
        status = app.query_one(StatusLine)
        switch = {"model": "Other-Model", "phase": "waiting", "unloading": "SmolLM2", "elapsed_s": 0.5}
        monitor.send(snapshot_frame(STATES, requests=REQUESTS) | {"loading": switch})
        await wait_until(pilot, lambda: "⇄ Other-Model waits for SmolLM2's requests" in str(status.render()),
                         "the waiting phase")
        monitor.send({"type": "monitor.no_model", "time": 1.0,
                      "loading": switch | {"phase": "loading", "unloading": None, "elapsed_s": 2.0}})
        await wait_until(pilot, lambda: "⇄ loading Other-Model (2 s)" in str(status.render()), "the loading phase")
        assert app.hello is None and "no model loaded" in str(status.render())
        monitor.send(hello_frame(128, model="Other-Model"))
        monitor.send(snapshot_frame("u" * 5 + "." * 123, requests=REQUESTS[1:2]))
        await wait_until(pilot, lambda: len(app.query_one(SlotsTable).rows) == 1, "the new model's rows")
        assert app.hello.num_blocks == 128 and "Other-Model" in str(status.render())
        assert "⇄" not in str(status.render())
        assert any("unloaded" in line for line in log_text(app.query_one(EventLog)))
    run_with_monitor(scenario, hello_frame(64, model="SmolLM2"))
