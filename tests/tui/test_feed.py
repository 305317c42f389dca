"""The monitor feed as typed data, the map's cells and the derived trends, without a screen."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.tui.block_map import NO_BLOCK, build_cells, cell_looks, grid_strips
from localserve.tui.client import monitor_url
from localserve.tui.feed import (
    CPU_STATE_CHARS,
    GPU_STATE_CHARS,
    BlockState,
    FeedError,
    ModelSwitch,
    NoModel,
    decode_block_states,
    parse_hello,
    parse_no_model,
    parse_snapshot,
)
from localserve.tui.history import FeedHistory
from rich.style import Style

from tests.helpers.monitor_frames import event_entry, hello_frame, request_entry, run_length_encode, snapshot_frame

block_strings = st.text(alphabet=".cus", max_size=300)


def test_protocol_example_decodes():
    states = decode_block_states("u3s2c5.1014", GPU_STATE_CHARS, 1024)
    assert states.dtype == np.uint8 and states.size == 1024
    assert list(states[:11]) == [BlockState.USED] * 3 + [BlockState.SHARED] * 2 + [BlockState.CACHED] * 5 + [0]
    assert (states[10:] == BlockState.EMPTY).all()


@given(block_strings)
def test_run_length_decoding_inverts_encoding(states):
    decoded = decode_block_states(run_length_encode(states), GPU_STATE_CHARS, len(states))
    assert "".join(".cus"[code] for code in decoded) == states


@pytest.mark.parametrize("encoded, num_blocks, message", [
    ("u3x2", 5, "unknown block state 'x'"), ("3u", 3, "starts with a run length"), ("u0.3", 3, "run of length 0"),
    ("u3", 4, "describes 3 blocks, the pool has 4"), ("w2", 2, "unknown block state 'w'"),
    ("u²", 2, "not block states"),
])
def test_bad_block_strings_name_what_is_wrong(encoded, num_blocks, message):
    with pytest.raises(FeedError, match=message):
        decode_block_states(encoded, GPU_STATE_CHARS, num_blocks)


def test_swap_pool_states():
    assert list(decode_block_states("w2.2", CPU_STATE_CHARS, 4)) == [BlockState.SWAPPED] * 2 + [BlockState.EMPTY] * 2
    with pytest.raises(FeedError, match="unknown block state 'u'"):
        decode_block_states("u4", CPU_STATE_CHARS, 4)


def test_snapshot_parses_into_typed_data():
    hello = parse_hello(hello_frame(64))
    assert hello.capacity[1].format == "q8_0" and hello.num_blocks == 64
    frame = snapshot_frame("s" * 4 + "u" * 8 + "." * 52,
                           requests=[request_entry("r1", "decode", [[0, 1, 4], [0, 1, 5]])],
                           events=[event_entry(7, "preempted", "r1", mode="recompute")], missed_events=2)
    snapshot = parse_snapshot(json.loads(json.dumps(frame)), hello)
    assert snapshot.requests[0].block_ids == {0, 1, 4, 5}
    assert snapshot.events[0].seq == 7 and snapshot.events[0].details == {"mode": "recompute"}
    assert snapshot.gauges.num_used_blocks == 12 and snapshot.missed_events == 2
    assert snapshot.counters.prefix_hit_tokens == 32


def test_layer_groups_in_the_gauges_parse_with_their_labels():
    hello = parse_hello(hello_frame(64))
    groups = [{"sliding_window": None, "num_blocks": 48, "num_used_blocks": 12, "num_cached_blocks": 0,
               "num_free_blocks": 36},
              {"sliding_window": 128, "num_blocks": 8, "num_used_blocks": 2, "num_cached_blocks": 3,
               "num_free_blocks": 3},
              {"sliding_window": "state", "num_blocks": 8, "num_used_blocks": 1, "num_cached_blocks": 2,
               "num_free_blocks": 5}]
    snapshot = parse_snapshot(snapshot_frame("u" * 14 + "c" * 3 + "." * 47, kv_groups=groups), hello)
    assert [group.describe() for group in snapshot.gauges.kv_groups] == [
        "full: 12 used, 0 cached, 36 free", "window 128: 2 used, 3 cached, 3 free", "state: 1 used, 2 cached, 5 free"]
    assert parse_snapshot(snapshot_frame("." * 64), hello).gauges.kv_groups == ()  # an older server: none


@pytest.mark.parametrize("change, message", [
    (lambda f: f.pop("gauges"), "monitor.snapshot has no 'gauges'"),
    (lambda f: f["gauges"].update(kv_groups=[{"sliding_window": 0}]), r"kv_groups\[0\].sliding_window must be"),
    (lambda f: f["gauges"].update(kv_groups=[{"sliding_window": "states"}]), r"must be null, \"state\" or an int"),
    (lambda f: f["gauges"].pop("last_step_s"), "monitor.snapshot.gauges has no 'last_step_s'"),
    (lambda f: f["counters"].update(num_preemptions=True), "counters.num_preemptions must be int, got bool"),
    (lambda f: f["requests"][0].update(state="running"), r"requests\[0\].state must be one of"),
    (lambda f: f["requests"][0].update(block_tables=[[0, 99]]), "points at block 99, outside the pool of 64"),
    (lambda f: f["requests"][0].update(block_tables=[["a"]]), r"block_tables\[0\] must be a list of block numbers"),
    (lambda f: f.update(missed_events=-1), "missed_events must be >= 0"),
    (lambda f: f.update(type="monitor.hello"), "expected a 'monitor.snapshot' frame"),
])
def test_bad_snapshots_name_the_field(change, message):
    frame = snapshot_frame("uu" + "." * 62, requests=[request_entry("r1", "decode", [[0, 1]])])
    change(frame)
    with pytest.raises(FeedError, match=message):
        parse_snapshot(frame, parse_hello(hello_frame(64)))


def _mutations(value):
    """Every (path, container) in a JSON value, for the fuzzer to pick from."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield value, key
            yield from _mutations(item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield value, index
            yield from _mutations(item)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_broken_frame_raises_feed_error_and_nothing_else(data):
    frame = snapshot_frame("ssuuuc" + "." * 58, requests=[request_entry("r1", "decode", [[0, 1, 2], [0, 1, 3]])],
                           events=[event_entry(1, "admitted", "r1", num_prompt_tokens=3)])
    frame = copy.deepcopy(frame)
    spots = list(_mutations(frame))
    container, key = data.draw(st.sampled_from(spots))
    junk = data.draw(st.one_of(st.none(), st.booleans(), st.integers(-2, 10**6), st.floats(allow_nan=True),
                               st.text(max_size=5), st.lists(st.integers(-1, 70), max_size=3),
                               st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
    if data.draw(st.booleans()) and isinstance(container, dict):
        del container[key]
    else:
        container[key] = junk
    try:
        snapshot = parse_snapshot(frame, parse_hello(hello_frame(64)))
    except FeedError:
        return
    assert snapshot.blocks.size == 64  # anything accepted still describes the whole pool
    assert all(0 <= block < 64 for request in snapshot.requests for block in request.block_ids)


@settings(max_examples=200, deadline=None)
@given(block_strings.filter(bool), st.integers(1, 400), st.data())
def test_cells_show_the_majority_state_and_every_selected_block(states, max_cells, data):
    codes = np.array([".cus".index(char) for char in states], np.uint8)
    selected = np.array(data.draw(st.lists(st.booleans(), min_size=len(states), max_size=len(states))), bool)
    grid = build_cells(codes, selected, max_cells)
    per_cell = grid.blocks_per_cell
    assert grid.states.size <= max_cells and grid.states.size * per_cell >= codes.size
    for cell in range(grid.states.size):
        blocks = codes[cell * per_cell:(cell + 1) * per_cell]
        counts = np.bincount(blocks, minlength=4)
        assert grid.states[cell] != NO_BLOCK and counts[grid.states[cell]] == counts.max()
        chosen = selected[cell * per_cell:(cell + 1) * per_cell]
        assert grid.selected[cell] == chosen.any()
        assert grid.selected_shared[cell] == (chosen & (blocks == BlockState.SHARED)).any()
    if codes.size <= max_cells:  # one cell per block: the map is the pool itself
        assert per_cell == 1 and (grid.states == codes).all() and (grid.selected == selected).all()


def _snapshot(time_s, num_preemptions, generation_tokens, query, hit, used=60):
    frame = snapshot_frame("u" * used + "." * (64 - used), time_s=time_s, num_preemptions=num_preemptions,
                           generation_tokens=generation_tokens,
                           counters={"prefix_query_tokens": query, "prefix_hit_tokens": hit})
    return parse_snapshot(frame, parse_hello(hello_frame(64)))


def test_trends_are_rates_over_the_servers_clock():
    history = FeedHistory()
    history.add(_snapshot(0.0, 0, 0, 100, 0))
    assert history.latest("tokens_per_s") is None  # no rate from a single snapshot
    history.add(_snapshot(0.5, 2, 40, 300, 50))
    assert history.latest("tokens_per_s") == pytest.approx(80.0)
    assert history.latest("preemptions_per_s") == pytest.approx(4.0)
    assert history.latest("prefix_hit_rate") == pytest.approx(0.25)
    assert history.latest("kv_usage") == pytest.approx(60 / 64)
    history.add(_snapshot(1.0, 2, 40, 300, 50))  # no prompts: no hit rate for this interval
    assert list(history.series["prefix_hit_rate"]) == [pytest.approx(0.25)]
    history.new_baseline()  # reconnected: no rate across the gap
    history.add(_snapshot(9.0, 50, 900, 1000, 900))
    assert len(history.series["tokens_per_s"]) == 2
    history.add(_snapshot(0.5, 0, 10, 0, 0))  # a restarted server's clock and counters start over
    assert len(history.series["tokens_per_s"]) == 2 and history.pressure is None


@pytest.mark.parametrize("typed, expected", [
    ("127.0.0.1:8080", "ws://127.0.0.1:8080/v1/monitor"), ("http://host:9/", "ws://host:9/v1/monitor"),
    ("https://host", "wss://host/v1/monitor"), ("ws://h:1/v1/monitor", "ws://h:1/v1/monitor"),
])
def test_monitor_url(typed, expected):
    assert monitor_url(typed) == expected
    assert monitor_url(typed, interval_s=0.25) == expected + "?interval=0.25"


def test_monitor_url_refuses_other_schemes():
    with pytest.raises(ValueError, match="not a server address"):
        monitor_url("ftp://host:21")


@settings(max_examples=200, deadline=None)
@given(block_strings.filter(bool), st.integers(1, 40), st.integers(1, 12), st.data())
def test_map_rows_draw_each_cell_with_its_glyph_and_colour(states, width, max_rows, data):
    codes = np.array([".cus".index(char) for char in states], np.uint8)
    selected = np.array(data.draw(st.lists(st.booleans(), min_size=len(states), max_size=len(states))), bool)
    grid = build_cells(codes, selected, width * max_rows)
    strips = grid_strips(grid, width, max_rows, Style())
    assert len(strips) == -(-grid.states.size // width) and all(strip.cell_length == width for strip in strips)
    drawn = [(char, segment.style.color.name if segment.style.color else None)
             for strip in strips for segment in strip for char in segment.text][:grid.states.size]
    looks = cell_looks(Style())
    expected = [(looks[key][0], looks[key][1].color.name)
                for key in (grid.states.astype(int) * 8 + grid.selected * 2 + grid.selected_shared)]
    assert drawn == expected
    tail = "".join(strip.text for strip in strips)[grid.states.size:]
    assert tail == " " * len(tail)  # the last row is padded, not drawn on


def test_a_snapshot_and_a_no_model_frame_say_which_model_is_on_its_way():
    hello = parse_hello(hello_frame(64))
    switch = {"model": "b", "phase": "unloading", "unloading": "a", "elapsed_s": 1.5}
    snapshot = parse_snapshot(snapshot_frame("." * 64) | {"loading": switch}, hello)
    assert snapshot.switch == ModelSwitch("b", "unloading", "a", 1.5)
    assert snapshot.switch.describe() == "unloading a for b"
    assert parse_snapshot(snapshot_frame("." * 64) | {"loading": None}, hello).switch is None
    assert parse_no_model({"type": "monitor.no_model", "time": 3.0, "loading": None}) == NoModel(3.0, None)
    with pytest.raises(FeedError, match="loading.phase must be one of"):
        parse_snapshot(snapshot_frame("." * 64) | {"loading": switch | {"phase": "sleeping"}}, hello)
