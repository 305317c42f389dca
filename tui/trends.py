"""The time series: one line per series, a label, a sparkline of its history and its value now."""

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


TRENDS = (
    TrendSpec("kv_usage", "KV usage", 1.0, lambda value: f"{value:.0%}", "#5faf5f"),
    TrendSpec("running", "running", None, lambda value: f"{value:.0f}", "#5fafff"),
    TrendSpec("waiting", "waiting", None, lambda value: f"{value:.0f}", "#d7af5f"),
    TrendSpec("preemptions_per_s", "preempt/s", None, lambda value: f"{value:.1f}", "#ff5f5f"),
    TrendSpec("prefix_hit_rate", "prefix hits", 1.0, lambda value: f"{value:.0%}", "#5f87d7"),
    TrendSpec("tokens_per_s", "tokens/s", None, lambda value: f"{value:.0f}", "#87d787"),
    TrendSpec("step_ms", "step", None, lambda value: f"{value:.1f} ms", "#afafaf"),
)


def sparkline(values: Sequence[float], width: int, full_scale: float | None) -> str:
    """The last `width` values as bars; an empty bar is the lowest, a value at full scale the highest."""
    shown = list(values)[-width:] if width > 0 else []
    top = full_scale if full_scale is not None else max(shown, default=0.0)
    if top <= 0:
        return BARS[0] * len(shown)
    return "".join(BARS[min(len(BARS) - 1, max(0, round(value / top * (len(BARS) - 1))))] for value in shown)


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
            values = self.history.series[spec.series]
            latest = self.history.latest(spec.series)
            value = spec.format_value(latest) if latest is not None else "-"
            lines.append(Text.assemble(spec.label.ljust(LABEL_WIDTH),
                                       (sparkline(values, width, spec.full_scale).ljust(width), spec.colour),
                                       " " + value.rjust(VALUE_WIDTH)))
        return Text("\n").join(lines)
