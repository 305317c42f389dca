"""The event log: the engine's events as lines, and a notice when the TUI fell behind and missed some."""

from __future__ import annotations

import time

from localserve.tui.feed import MonitorEvent
from rich.text import Text
from textual.widgets import RichLog

MAX_LINES = 1000
QUIET_EVENTS = ("prefill_chunk", "first_token")  # one per request per step: they would drown the rest
EVENT_STYLES = {"admitted": "#5faf5f", "prefix_hit": "#5f87d7", "prefill_chunk": "dim", "first_token": "dim",
                "preempted": "bold #ff5f5f", "swapped_out": "#d7875f", "swapped_in": "#d7875f",
                "resumed": "#5fafff", "copy_on_write": "#d75fd7", "finished": "dim", "failed": "bold #ff5f5f",
                "rejected": "bold #ff5f5f"}


def describe(event: MonitorEvent) -> str:
    """What happened, in words, from the event's kind and its fields."""
    details = event.details
    match event.event:
        case "admitted":
            return f"admitted, {details.get('num_prompt_tokens', '?')} prompt tokens"
        case "prefix_hit":
            return f"prefix hit, {details.get('num_cached_tokens', '?')} tokens from the cache"
        case "prefill_chunk":
            return f"prefill chunk of {details.get('num_tokens', '?')} ({details.get('num_computed_tokens', '?')} done)"
        case "first_token":
            return "first token"
        case "preempted":
            fallback = " (swap pool full)" if details.get("fallback") else ""
            return f"preempted: {details.get('mode', '?')}{fallback}"
        case "swapped_out" | "swapped_in" | "copy_on_write":
            return f"{event.event.replace('_', ' ')}, {details.get('num_blocks', '?')} blocks"
        case "resumed":
            return "resumed"
        case "finished" | "failed" | "rejected":
            return f"{event.event}: {details.get('reason', '?')}"
    return " ".join([event.event] + [f"{key}={value}" for key, value in details.items()])


def event_line(event: MonitorEvent) -> Text:
    """One log line: local time, the request's label and what happened."""
    clock = time.strftime("%H:%M:%S", time.localtime(event.time)) + f".{int(event.time * 1000) % 1000:03d}"
    return Text.assemble((clock, "dim"), " ", (f"{event.request or '-':>6}", "bold"), " ",
                         (describe(event), EVENT_STYLES.get(event.event, "")))


class EventLog(RichLog):
    """The newest `MAX_LINES` events; older ones scroll away."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, max_lines=MAX_LINES, wrap=False, auto_scroll=True)

    def add_events(self, events: tuple[MonitorEvent, ...] | list[MonitorEvent]) -> None:
        """Append these events in order, except the per-step ones (prefill chunks, first tokens)."""
        lines = [event_line(event) for event in events if event.event not in QUIET_EVENTS]
        if lines:  # one write: RichLog renders each write on its own, and a busy frame has many events
            self.write(Text("\n").join(lines))

    def add_missed(self, num_missed: int) -> None:
        """Say that `num_missed` events never reached the TUI (the engine's log dropped them first)."""
        self.write(Text(f"⚠ missed {num_missed} events (the TUI fell behind the server's log)",
                        style="bold #ffd700"))

    def add_notice(self, text: str, style: str = "dim") -> None:
        """A line that is not an engine event (connection changes, bad frames)."""
        self.write(Text(text, style=style))
