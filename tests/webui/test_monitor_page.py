"""The monitor in a real Chromium against a real server on the tiny chat model (steps slowed), with a
request of two samples running so the pool holds used, shared, cached and free blocks: every cell of the
canvas has the colour of its block's state in the frame the page drew (the TUI's colours), so the counts
per state equal the snapshot's; a request chosen in the slots table has its blocks drawn in yellow; the
capacity table lists the pool's own format (fp32 here, in no format list); once the engine is idle
the step trend says so."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections import Counter

import numpy as np
import pytest
from localserve.tui.block_map import COLOURS, SELECTED_COLOUR
from localserve.tui.feed import GPU_STATE_CHARS, BlockState, decode_block_states

from tests.helpers.browser import slowed
from tests.helpers.server import make_llm, running_server
from tests.helpers.webui_page import READ_CELLS, open_page

STEP_DELAY_S = 0.03
LONG_PROMPT = " ".join(["the cat and the dog tell a story about the sun"] * 6)  # 66 words: 4 full blocks


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    llm = slowed(make_llm(tiny_chat_model_dir, max_model_len=512), STEP_DELAY_S)
    with running_server(llm, monitor_interval_s=0.1) as background:
        yield background


def watched_page(page, port: int) -> list[dict]:
    """Open the page; returns the list the monitor frames it receives are appended to (decoded)."""
    frames: list[dict] = []
    page.on("websocket", lambda socket: socket.on("framereceived", lambda payload: frames.append(json.loads(payload))))
    open_page(page, port)
    page.wait_for_function("() => document.querySelector('#block-map').dataset.time !== undefined")
    return frames


class TwoSamples:
    """A streamed completion of two samples over a long prompt, running until it ends or is closed
    (the server then aborts it and frees its blocks)."""

    def __init__(self, port: int, max_tokens: int = 120) -> None:
        body = {"prompt": LONG_PROMPT, "n": 2, "max_tokens": max_tokens, "temperature": 1.0, "stream": True}
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while self.response.read(4096):
                pass
        except (OSError, ValueError, AttributeError):
            pass  # closed under the reader

    def join(self) -> None:
        """Stop it (if it still runs) and wait for the reader."""
        self.connection.close()
        self.thread.join(timeout=30)


def start_two_samples(port: int, max_tokens: int = 120) -> TwoSamples:
    return TwoSamples(port, max_tokens)


def drawn_frame(frames: list[dict], drawn_time: float) -> dict:
    return next(frame for frame in frames if frame.get("type") == "monitor.snapshot" and frame["time"] == drawn_time)


def draw_while_shared(page, port: int, attempts: int = 3) -> dict:
    """The cells and legend the page shows at a moment when a request of two samples holds its shared
    prompt blocks and a used tail each, read in one evaluation. A sample of the random model may end early (EOS), and a
    slow machine may draw its first frames late: then another request is started, up to `attempts`."""
    for _ in range(attempts):
        request = start_two_samples(port, max_tokens=400)
        try:
            deadline = time.monotonic() + 60
            while request.thread.is_alive() and time.monotonic() < deadline:
                drawn = page.evaluate(READ_CELLS)
                if drawn["legend"].get("used", 0) >= 2 and drawn["legend"].get("shared", 0) >= 4:
                    return drawn
                time.sleep(0.05)
        finally:
            request.join()
    raise AssertionError(f"no frame with shared and used blocks drawn in {attempts} requests")


def test_every_cell_shows_its_blocks_state_and_the_counts_equal_the_snapshots(page, server):
    frames = watched_page(page, server.port)
    hello = frames[0]
    drawn = draw_while_shared(page, server.port)
    frame = drawn_frame(frames, drawn["time"])
    states = decode_block_states(frame["blocks"], GPU_STATE_CHARS, hello["num_blocks"])
    assert drawn["blocksPerCell"] == 1 and len(drawn["colours"]) == hello["num_blocks"]
    colour_states = {colour: state for state, colour in COLOURS.items()}
    assert [colour_states[colour] for colour in drawn["colours"]] == list(states)  # cell by cell
    counts = Counter(colour_states[colour] for colour in drawn["colours"])
    expected = np.bincount(states, minlength=4)
    assert {state: counts[state] for state in GPU_STATE_CHARS.values()} == {
        state: int(expected[state]) for state in GPU_STATE_CHARS.values()}
    assert drawn["legend"] == {"free": expected[BlockState.EMPTY], "cached": expected[BlockState.CACHED],
                               "used": expected[BlockState.USED], "shared": expected[BlockState.SHARED]}
    assert expected[BlockState.SHARED] >= 4 and expected[BlockState.USED] >= 2  # the prompt shared, a tail each
    gauges = frame["gauges"]
    assert (gauges["num_free_blocks"], gauges["num_cached_blocks"]) == (expected[0], expected[1])


def test_a_chosen_request_has_its_blocks_drawn_yellow(page, server):
    frames = watched_page(page, server.port)
    request = start_two_samples(server.port, max_tokens=400)
    try:
        page.click("#slots tbody tr[data-label]")
        page.click("#pause")  # hold the screen: the request keeps growing meanwhile
        drawn = page.evaluate(READ_CELLS)
        label = page.get_attribute("#slots tbody tr.selected", "data-label")
        legend = page.inner_text("#map-legend")  # while paused: once the request ends, a new frame drops it
    finally:
        request.join()
    page.click("#pause")
    frame = drawn_frame(frames, drawn["time"])
    chosen = next(entry for entry in frame["requests"] if entry["label"] == label)
    own = {block for table in chosen["block_tables"] for block in table}
    states = decode_block_states(frame["blocks"], GPU_STATE_CHARS, frames[0]["num_blocks"])
    for block, colour in enumerate(drawn["colours"]):
        if block in own:
            assert colour == (SELECTED_COLOUR if states[block] == BlockState.USED else "#d7d700"), block
        else:
            assert colour == COLOURS[BlockState(states[block])], block
    assert own and legend.endswith(f"{label}'s blocks")


def test_the_capacity_table_lists_the_pools_own_format_and_idle_steps_show_as_idle(page, server):
    frames = watched_page(page, server.port)
    hello = frames[0]
    rows = page.locator("#capacity tbody tr")
    formats = [row.get_attribute("data-format") for row in rows.all()]
    assert hello["cache_type_k"] == "fp32" and "fp32" not in [entry["format"] for entry in hello["capacity"]]
    assert formats == ["fp32"] + [entry["format"] for entry in hello["capacity"]]
    now = page.locator("#capacity tbody tr.now")
    cells = now.locator("td").all_inner_texts()
    num_tokens = hello["num_blocks"] * hello["block_size"]
    assert cells[:4] == ["fp32", f"{hello['kv_cache_bytes'] // num_tokens:,}", f"{num_tokens:,}",
                         str(num_tokens // hello["max_model_len"])]
    step = "document.querySelector('.value[data-series=step_ms]').textContent"
    request = start_two_samples(server.port)
    try:
        page.wait_for_function(f"() => {step}.endsWith(' ms')")  # a step ran in the last interval
    finally:
        request.join()
    page.wait_for_function(f"() => {step} === 'idle'")  # and none since: not the last step repeated
