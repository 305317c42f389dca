"""Time series derived from successive monitor snapshots, and the pressure warning.

The server sends values now (gauges) and totals (counters); rates such as preemptions per second
come from the difference of two snapshots over the server's own clock (`snapshot.time`), so they
do not depend on when the TUI happened to read them. After a reconnection the next snapshot starts
a new baseline: no rate is ever taken across a gap or across a server restart.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from localserve.tui.feed import MonitorSnapshot

HISTORY_LENGTH = 240  # samples per series: two minutes at the default interval of 0.5 s
PINNED_USAGE = 0.95  # a pool this full has no room left for the next block of a running request
PRESSURE_WINDOW_S = 5.0  # preemptions this recent, with the pool pinned, mean the server is thrashing

SERIES = ("kv_usage", "running", "waiting", "preemptions_per_s", "prefix_hit_rate", "tokens_per_s", "step_ms")


@dataclass(frozen=True, slots=True)
class Pressure:
    """The pool is pinned and requests are being preempted."""

    usage: float
    num_recent_preemptions: int
    window_s: float


class FeedHistory:
    """The last `length` values of each series in `SERIES`, and whether the pool is under pressure."""

    def __init__(self, length: int = HISTORY_LENGTH) -> None:
        self.series: dict[str, deque[float]] = {name: deque(maxlen=length) for name in SERIES}
        self._previous: MonitorSnapshot | None = None
        self._preemption_times: deque[tuple[float, int]] = deque()  # (time, num_preemptions) in the window
        self.pressure: Pressure | None = None

    def new_baseline(self) -> None:
        """Take no difference between the next snapshot and the ones before (call after reconnecting)."""
        self._previous = None
        self._preemption_times.clear()

    def add(self, snapshot: MonitorSnapshot) -> None:
        """Append the values of `snapshot` and update the pressure warning."""
        gauges, counters = snapshot.gauges, snapshot.counters
        previous = self._previous
        if previous is not None and (snapshot.time <= previous.time
                                     or counters.num_preemptions < previous.counters.num_preemptions):
            previous = None  # the clock or the counters went back: a restarted server, no rate across it
            self._preemption_times.clear()
        self.series["kv_usage"].append(gauges.kv_cache_usage_ratio)
        self.series["running"].append(gauges.num_requests_running)
        self.series["waiting"].append(gauges.num_requests_waiting)
        self.series["step_ms"].append(gauges.last_step_s * 1000.0)
        if previous is not None:
            elapsed_s = snapshot.time - previous.time
            before = previous.counters
            self.series["preemptions_per_s"].append((counters.num_preemptions - before.num_preemptions) / elapsed_s)
            self.series["tokens_per_s"].append(
                (counters.num_generation_tokens - before.num_generation_tokens) / elapsed_s)
            num_queried = counters.prefix_query_tokens - before.prefix_query_tokens
            if num_queried > 0:  # no prompts in this interval: no hit rate to speak of
                self.series["prefix_hit_rate"].append(
                    (counters.prefix_hit_tokens - before.prefix_hit_tokens) / num_queried)
        self._previous = snapshot
        self._update_pressure(snapshot)

    def latest(self, name: str) -> float | None:
        """The newest value of a series, or None before it has one."""
        values = self.series[name]
        return values[-1] if values else None

    def _update_pressure(self, snapshot: MonitorSnapshot) -> None:
        times = self._preemption_times
        times.append((snapshot.time, snapshot.counters.num_preemptions))
        while len(times) > 1 and times[1][0] <= snapshot.time - PRESSURE_WINDOW_S:
            times.popleft()  # keep one sample at or before the window's start as its baseline
        num_recent = times[-1][1] - times[0][1]
        usage = snapshot.gauges.kv_cache_usage_ratio
        self.pressure = (Pressure(usage, num_recent, PRESSURE_WINDOW_S)
                         if usage >= PINNED_USAGE and num_recent > 0 else None)
