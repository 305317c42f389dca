"""The slots table: one row per request in the engine, oldest first."""

from __future__ import annotations

from localserve.tui.feed import RequestInfo
from rich.text import Text
from textual.widgets import DataTable

COLUMNS = (("request", "request"), ("state", "state"), ("prompt", "prompt"), ("generated", "gen"),
           ("tokens_per_s", "tok/s"), ("preemptions", "preempt"), ("prefix_hit", "prefix hit"))
STATE_STYLES = {"waiting": "dim", "prefill": "#5fafff", "decode": "#5faf5f", "preempted": "bold #ff5f5f",
                "swapped": "bold #d7875f"}


def state_text(request: RequestInfo) -> Text:
    """The state as the table shows it; a prefill carries its progress."""
    label = request.state
    if request.state == "prefill" and request.num_prompt_tokens:
        percent = 100 * request.num_computed_prompt_tokens // request.num_prompt_tokens
        label = f"prefill {percent}% {request.num_computed_prompt_tokens}/{request.num_prompt_tokens}"
    return Text(label, style=STATE_STYLES[request.state])


def row_cells(request: RequestInfo) -> tuple[Text | str, ...]:
    """The table's cells for one request, in `COLUMNS` order."""
    label = request.label if request.num_seqs <= 1 else f"{request.label} ×{request.num_seqs}"
    preemptions = Text(str(request.num_preemptions), style="bold #ff5f5f" if request.num_preemptions else "dim")
    return (label, state_text(request), Text(str(request.num_prompt_tokens), justify="right"),
            Text(str(request.num_output_tokens), justify="right"),
            Text(f"{request.tokens_per_s:.1f}" if request.tokens_per_s else "-", justify="right"),
            preemptions, Text(str(request.num_cached_tokens), justify="right"))


class SlotsTable(DataTable):
    """The requests of the last snapshot; rows are keyed by label so the cursor stays on its request."""

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = True
        for key, title in COLUMNS:
            self.add_column(title, key=key)

    def show(self, requests: tuple[RequestInfo, ...]) -> None:
        """Make the rows those of `requests`, updating rows in place."""
        wanted = {request.label: request for request in requests}
        for row_key in list(self.rows):
            if row_key.value not in wanted:
                self.remove_row(row_key)
        existing = {row_key.value for row_key in self.rows}
        for label, request in wanted.items():
            cells = row_cells(request)
            if label in existing:
                for (column_key, _), cell in zip(COLUMNS, cells):
                    self.update_cell(label, column_key, cell, update_width=True)
            else:
                self.add_row(*cells, key=label)
