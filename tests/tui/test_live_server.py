"""The TUI following a real server's /v1/monitor: the feed parses, the screen agrees with the engine."""

from __future__ import annotations

import asyncio
import json

import numpy as np
from localserve.tui.app import MonitorApp
from localserve.tui.block_map import BlockMap
from localserve.tui.client import monitor_url
from localserve.tui.event_log import EventLog
from localserve.tui.feed import BlockState
from websockets.asyncio.client import connect

from tests.helpers.server import collect_response, running_server
from tests.helpers.tui_pilot import log_text, wait_until


def test_tui_follows_a_real_server(tiny_chat_llm):
    async def main(port: int) -> None:
        app = MonitorApp(monitor_url(f"127.0.0.1:{port}", interval_s=0.05))
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_until(pilot, lambda: app.snapshot is not None, "a snapshot from the server")
            assert app.hello.num_blocks == 256 and app.hello.block_size == 16
            async with connect(f"ws://127.0.0.1:{port}/v1/responses") as client:
                for text in ("hello world", "tell me a story about the sun"):
                    await client.send(json.dumps({"type": "response.create", "input": text,
                                                  "max_output_tokens": 24, "temperature": 0}))
                    assert (await collect_response(client))[-1]["type"] == "response.incomplete"
            log = app.query_one(EventLog)
            await wait_until(pilot, lambda: sum("finished: length" in line for line in log_text(log)) == 2,
                             "both requests' finished events")
            lines = log_text(log)
            assert sum("admitted" in line for line in lines) == 2
            assert not any("bad frame" in line or "disconnected" in line for line in lines)
            await pilot.pause()
            snapshot = app.snapshot
            block_map = app.query_one(BlockMap)
            counts = np.bincount(block_map.block_states, minlength=len(BlockState))
            assert counts[BlockState.USED] + counts[BlockState.SHARED] == snapshot.gauges.num_used_blocks == 0
            assert counts[BlockState.CACHED] == snapshot.gauges.num_cached_blocks > 0  # the finished prompts
            assert snapshot.counters.num_requests_finished >= 2
            assert app.history.latest("kv_usage") == 0.0

    with running_server(tiny_chat_llm) as server:
        asyncio.run(asyncio.wait_for(main(server.port), 60))
