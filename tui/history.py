"""Time series derived from successive monitor snapshots, over minutes, and the pressure warning.

The server sends values now (gauges) and totals (counters); rates such as preemptions per second
come from the difference of two snapshots over the server's own clock (`snapshot.time`), so they
do not depend on when the TUI happened to read them. After a reconnection the next snapshot starts
a new baseline: no rate is ever taken across a gap or across a server restart.

Each series keeps the samples of the last `WINDOW_S` seconds, however often they come; the trends
draw that window cut into as many bins as they have room for (`TimeSeries.bins`), so five minutes are
on screen at any width. The step time is the last step's only when a step ran since the previous
snapshot; otherwise the sample is idle (None), never the last step repeated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from localserve.tui.feed import MonitorSnapshot

WINDOW_S = 300.0  # what the trends show: the last five minutes
MAX_SAMPLES = 6000  # per series: the window at the server's shortest interval (0.05 s)
PINNED_USAGE = 0.95  # a pool this full has no room left for the next block of a running request
PRESSURE_WINDOW_S = 5.0  # preemptions this recent, with the pool pinned, mean the server is thrashing

SERIES = ("kv_usage", "running", "waiting", "preemptions_per_s", "prefix_hit_rate", "tokens_per_s", "step_ms")


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of a series at a time of the server's clock."""

    time: float
    value: float | None  # None: nothing to measure in that interval (the step time of an idle engine)


class TimeSeries:
    """The samples of one series in the last `window_s` seconds, oldest first; iterating gives the values."""

    def __init__(self, window_s: float = WINDOW_S, max_samples: int = MAX_SAMPLES) -> None:
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=max_samples)

    def append(self, time: float, value: float | None) -> None:
        """Add a sample; those older than the window before it go."""
        self.samples.append(Sample(time, value))
        while self.samples[0].time < time - self.window_s:
            self.samples.popleft()

    def __iter__(self) -> Iterator[float | None]:
        return (sample.value for sample in self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def bins(self, count: int, end_time: float) -> list[float | None]:
        """The window ending at `end_time` cut into `count` equal bins: the mean of each bin's values,
        or None where it has none (no sample, or idle ones only)."""
        sums, numbers = [0.0] * count, [0] * count
        start = end_time - self.window_s
        for sample in self.samples:
            if sample.value is None or not start < sample.time <= end_time:
                continue
            index = min(count - 1, int((sample.time - start) / self.window_s * count))
            sums[index] += sample.value
            numbers[index] += 1
        return [total / number if number else None for total, number in zip(sums, numbers)]


@dataclass(frozen=True, slots=True)
class Pressure:
    """The pool is pinned and requests are being preempted."""

    usage: float
    num_recent_preemptions: int
    window_s: float


class FeedHistory:
    """The last `window_s` seconds of each series in `SERIES`, and whether the pool is under pressure."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.series: dict[str, TimeSeries] = {name: TimeSeries(window_s) for name in SERIES}
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
        now = snapshot.time
        self.series["kv_usage"].append(now, gauges.kv_cache_usage_ratio)
        self.series["running"].append(now, gauges.num_requests_running)
        self.series["waiting"].append(now, gauges.num_requests_waiting)
        if previous is not None:
            elapsed_s = now - previous.time
            before = previous.counters
            stepped = snapshot.num_steps > previous.num_steps  # else last_step_s is an old step's
            self.series["step_ms"].append(now, gauges.last_step_s * 1000.0 if stepped else None)
            self.series["preemptions_per_s"].append(now, (counters.num_preemptions - before.num_preemptions)
                                                    / elapsed_s)
            self.series["tokens_per_s"].append(
                now, (counters.num_generation_tokens - before.num_generation_tokens) / elapsed_s)
            num_queried = counters.prefix_query_tokens - before.prefix_query_tokens
            if num_queried > 0:  # no prompts in this interval: no hit rate to speak of
                self.series["prefix_hit_rate"].append(
                    now, (counters.prefix_hit_tokens - before.prefix_hit_tokens) / num_queried)
        self._previous = snapshot
        self._update_pressure(snapshot)

    def latest(self, name: str) -> float | None:
        """The newest value of a series, or None before it has one (or while it is idle)."""
        sample = self.series[name].latest
        return sample.value if sample is not None else None

    def is_idle(self, name: str) -> bool:
        """The newest sample of the series says there was nothing to measure (an idle engine's step)."""
        sample = self.series[name].latest
        return sample is not None and sample.value is None

    def _update_pressure(self, snapshot: MonitorSnapshot) -> None:
        times = self._preemption_times
        times.append((snapshot.time, snapshot.counters.num_preemptions))
        while len(times) > 1 and times[1][0] <= snapshot.time - PRESSURE_WINDOW_S:
            times.popleft()  # keep one sample at or before the window's start as its baseline
        num_recent = times[-1][1] - times[0][1]
        usage = snapshot.gauges.kv_cache_usage_ratio
        self.pressure = (Pressure(usage, num_recent, PRESSURE_WINDOW_S)
                         if usage >= PINNED_USAGE and num_recent > 0 else None)
