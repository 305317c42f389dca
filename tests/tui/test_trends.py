"""The TUI's trends over minutes, the step trend's idle intervals, and the capacity table's row for the
pool's own format (issue 24: trends covered ~6.6 s, the step trend repeated the last step while idle,
and a bf16 pool's format was missing from the table)."""

from __future__ import annotations

import pytest
from localserve.tui.feed import parse_hello, parse_snapshot
from localserve.tui.history import WINDOW_S, FeedHistory
from localserve.tui.panels import capacity_rows
from localserve.tui.trends import BARS, TRENDS, trend_line

from tests.helpers.monitor_frames import hello_frame, snapshot_frame

HELLO = parse_hello(hello_frame(64))
KV_USAGE = next(spec for spec in TRENDS if spec.series == "kv_usage")
STEP = next(spec for spec in TRENDS if spec.series == "step_ms")


def snapshot(time_s: float, used: int = 0, num_steps: int = 1, last_step_s: float = 0.004):
    frame = snapshot_frame("u" * used + "." * (64 - used), time_s=time_s, num_steps=num_steps,
                           last_step_s=last_step_s)
    return parse_snapshot(frame, HELLO)


def test_the_trends_cover_minutes_not_the_last_width_samples():
    history = FeedHistory()
    interval_s = 0.2  # the TUI's own interval
    for index in range(int(WINDOW_S / interval_s)):  # five minutes: a full pool for the first minute, then empty
        time_s = index * interval_s
        history.add(snapshot(time_s, used=64 if time_s < 60 else 0, num_steps=index))
    line = trend_line(history, KV_USAGE, 30)
    assert len(line) == 30
    assert line[:5] == BARS[-1] * 5 and line[-20:] == BARS[0] * 20  # the first minute is still on screen
    assert WINDOW_S >= 300


def test_samples_older_than_the_window_go_and_gaps_stay_blank():
    history = FeedHistory()
    history.add(snapshot(0.0, used=64))
    history.add(snapshot(WINDOW_S + 100.0, used=32, num_steps=2))  # reconnected much later
    assert list(history.series["kv_usage"]) == [0.5]
    line = trend_line(history, KV_USAGE, 10)
    assert line[:9] == " " * 9 and line[9] == BARS[round(0.5 * (len(BARS) - 1))]


def test_an_idle_engine_shows_idle_steps_not_the_last_one_repeated():
    history = FeedHistory()
    history.add(snapshot(0.0, num_steps=10, last_step_s=0.020))
    history.add(snapshot(0.5, num_steps=12, last_step_s=0.010))  # two steps ran: the last took 10 ms
    assert history.latest("step_ms") == pytest.approx(10.0)
    history.add(snapshot(1.0, num_steps=12, last_step_s=0.010))  # no step since: idle
    assert history.latest("step_ms") is None and history.is_idle("step_ms")
    assert list(history.series["step_ms"]) == [pytest.approx(10.0), None]
    assert STEP.value_text(history) == "idle"
    history.add(snapshot(1.5, num_steps=13, last_step_s=0.005))
    assert STEP.value_text(history) == "5.0 ms" and not history.is_idle("step_ms")
    assert FeedHistory().is_idle("step_ms") is False and STEP.value_text(FeedHistory()) == "-"


def test_a_bin_of_idle_samples_only_is_blank_and_busy_ones_are_averaged():
    history = FeedHistory()
    steps = 0
    for index in range(30):
        busy = index < 10
        steps += busy
        history.add(snapshot(index * 10.0, num_steps=steps, last_step_s=0.008))
    line = trend_line(history, STEP, 30)  # 10 s a bin, the window (-10, 290]: sample i at 10 i s in bin i + 1
    assert line == "  " + BARS[-1] * 9 + " " * 19  # the first sample is the baseline; steps in 1-9, none after


@pytest.mark.parametrize("cache_type, expected_first", [("bf16", "bf16"), ("fp16", "fp16")])
def test_the_capacity_table_has_the_pools_own_format(cache_type, expected_first):
    hello = parse_hello(hello_frame(64, cache_type_k=cache_type, cache_type_v=cache_type))
    rows = capacity_rows(hello)
    assert rows[0][0].format == expected_first and [now for _, now in rows].count(True) == 1
    current = next(row for row, now in rows if now)
    assert current.format == cache_type and current.num_tokens == 64 * 16
    assert current.bytes_per_token == hello.kv_cache_bytes // (64 * 16)
    assert [row.format for row, _ in rows][-3:] == ["fp16", "q8_0", "q4"]  # the formats the server listed


def test_a_pool_with_k_and_v_apart_is_named_so():
    hello = parse_hello(hello_frame(64, cache_type_k="q8_0", cache_type_v="fp16"))
    rows = capacity_rows(hello)
    assert rows[0] == (rows[0][0], True) and rows[0][0].format == "K q8_0 V fp16"
