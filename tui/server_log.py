"""The server's own log inside the TUI, for `localserve serve` in a terminal.

The terminal belongs to the TUI then, so log records cannot go to stderr. `LogBuffer` is a logging
handler that any thread (the engine thread, the server's loop) may write to; the app drains it on a
timer into a `ServerLog` panel, so no thread but the app's ever touches a widget.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from rich.text import Text
from textual.widgets import RichLog

LEVEL_STYLES = {logging.DEBUG: "dim", logging.INFO: "", logging.WARNING: "#ffd700", logging.ERROR: "bold #ff5f5f",
                logging.CRITICAL: "bold #ff5f5f"}


class LogBuffer(logging.Handler):
    """Keeps the newest `capacity` records, formatted, until the TUI takes them."""

    def __init__(self, capacity: int = 1000) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        self._records: deque[tuple[int, str]] = deque(maxlen=capacity)
        self._records_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # logging's contract: a bad record must not raise into the caller
            self.handleError(record)
            return
        with self._records_lock:
            self._records.append((record.levelno, line))

    def take(self) -> list[tuple[int, str]]:
        """The records since the last call, oldest first: (level, formatted line)."""
        with self._records_lock:
            records = list(self._records)
            self._records.clear()
        return records


class ServerLog(RichLog):
    """The server's log lines, coloured by level."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, max_lines=1000, wrap=True, auto_scroll=True)

    def add_records(self, records: list[tuple[int, str]]) -> None:
        """Append (level, line) records."""
        if records:
            self.write(Text("\n").join(Text(line, style=LEVEL_STYLES.get(level, "")) for level, line in records))
