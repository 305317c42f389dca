"""The time series: one line per series, a label, a sparkline of its last minutes and its value now.

A sparkline is the history's window (tui/history.py, `WINDOW_S`) cut into as many bins as it has
characters, each the mean of its samples: blank where there is none (or only idle ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from localserve.tui.history import FeedHistory
from rich.text import Text
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"
LABEL_WIDTH = 12
VALUE_WIDTH = 8


@dataclass(frozen=True, slots=True)
class TrendSpec:
    """How one series is drawn: its label, the value that fills a bar (None: the largest seen), its format."""

    series: str
    label: str
    full_scale: float | None
    format_value: Callable[[float], str]
    colour: str
    idle_text: str = "-"  # the value shown while the newest sample is idle

    def value_text(self, history: FeedHistory) -> str:
        """The value now, as the line shows it ("-" before there is one)."""
        if history.is_idle(self.series):
            return self.idle_text
        latest = history.latest(self.series)
        return self.format_value(latest) if latest is not None else "-"


TRENDS = (
    TrendSpec("kv_usage", "KV usage", 1.0, lambda value: f"{value:.0%}", "#5faf5f"),
    TrendSpec("running", "running", None, lambda value: f"{value:.0f}", "#5fafff"),
    TrendSpec("waiting", "waiting", None, lambda value: f"{value:.0f}", "#d7af5f"),
    TrendSpec("preemptions_per_s", "preempt/s", None, lambda value: f"{value:.1f}", "#ff5f5f"),
    TrendSpec("prefix_hit_rate", "prefix hits", 1.0, lambda value: f"{value:.0%}", "#5f87d7"),
    TrendSpec("tokens_per_s", "tokens/s", None, lambda value: f"{value:.0f}", "#87d787"),
    TrendSpec("step_ms", "step", None, lambda value: f"{value:.1f} ms", "#afafaf", idle_text="idle"),
)


def sparkline(values: Sequence[float | None], full_scale: float | None) -> str:
    """One bar per value: the lowest for 0, the highest at full scale (None: the largest); None is blank."""
    top = full_scale if full_scale is not None else max((value for value in values if value is not None),
                                                        default=0.0)
    return "".join(" " if value is None else BARS[0] if top <= 0 else
                   BARS[min(len(BARS) - 1, max(0, round(value / top * (len(BARS) - 1))))] for value in values)


def trend_line(history: FeedHistory, spec: TrendSpec, width: int) -> str:
    """The sparkline of `spec`'s series over the history's window, `width` characters wide."""
    series = history.series[spec.series]
    if width <= 0:
        return ""
    if series.latest is None:
        return " " * width
    # the window ends at the newest snapshot of any series: the server's clock, not this machine's
    end_time = max(other.latest.time for other in history.series.values() if other.latest is not None)
    return sparkline(series.bins(width, end_time), spec.full_scale)


class Trends(Widget):
    """Every series of a `FeedHistory`, one line each."""

    DEFAULT_CSS = "Trends { height: auto; }"

    def __init__(self, history: FeedHistory, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.history = history

    def get_content_height(self, container, viewport, width: int) -> int:
        return len(TRENDS)

    def render(self) -> Text:
        width = max(0, self.size.width - LABEL_WIDTH - VALUE_WIDTH - 1)
        lines = []
        for spec in TRENDS:
            lines.append(Text.assemble(spec.label.ljust(LABEL_WIDTH),
                                       (trend_line(self.history, spec, width), spec.colour),
                                       " " + spec.value_text(self.history).rjust(VALUE_WIDTH)))
        return Text("\n").join(lines)
