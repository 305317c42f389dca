"""The slots table: one row per request in the engine, oldest first, with a cursor to pick one.

A line-API widget rather than Textual's DataTable: DataTable re-measures every cell of every row
when one cell changes width, which at 256 requests costs seconds a frame. Here a frame formats each
row once (column widths are a max over plain strings) and only the visible rows are drawn.
"""

from __future__ import annotations

from localserve.tui.feed import RequestInfo
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.events import Click
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

HEADERS = ("request", "state", "prompt", "gen", "tok/s", "preempt", "prefix hit")
# Shown while some request has verified a speculative draft: acceptance and tokens per verification.
SPEC_HEADER = "spec"
RIGHT_ALIGNED = (False, False, True, True, True, True, True, True)
STATE_COLOURS = {"waiting": "#808080", "prefill": "#5fafff", "decode": "#5faf5f", "preempted": "#ff5f5f",
                 "swapped": "#d7875f"}
SELECTED_COLOUR = "#ffff00"  # the same yellow as the request's blocks in the map
COLUMN_GAP = 2
CURSOR_COLOURS = {True: "#264f78", False: "#3a3a3a"}  # the cursor's row, with and without focus


def state_label(request: RequestInfo) -> str:
    """The state as the table shows it; a prefill carries its progress; a request whose sequences are
    reasoning, or that has a grammar, is marked [thinking] / [grammar], one with images [N image(s)]."""
    label = request.state
    if request.state == "prefill" and request.num_prompt_tokens:
        percent = 100 * request.num_computed_prompt_tokens // request.num_prompt_tokens
        label = f"prefill {percent}% {request.num_computed_prompt_tokens}/{request.num_prompt_tokens}"
    num_images = len(request.image_spans)
    marks = [mark for mark, shown in (("thinking", request.num_reasoning_seqs > 0), ("grammar", request.constrained),
                                      (f"{num_images} image{'s' if num_images > 1 else ''}", num_images > 0))
             if shown]
    return f"{label} [{', '.join(marks)}]" if marks else label


def spec_label(request: RequestInfo) -> str:
    """Speculative decoding's acceptance and tokens per verification (`72% ×3.1`), or `-` before any draft."""
    if not request.spec_mean_accepted_length:
        return "-"
    return f"{100 * request.spec_acceptance_rate:.0f}% ×{request.spec_mean_accepted_length:.1f}"


def row_cells(request: RequestInfo, with_spec: bool = False) -> tuple[str, ...]:
    """The table's cells for one request, in `HEADERS` order (and `SPEC_HEADER`'s last, `with_spec`)."""
    label = request.label if request.num_seqs <= 1 else f"{request.label} ×{request.num_seqs}"
    cells = (label, state_label(request), str(request.num_prompt_tokens), str(request.num_output_tokens),
             f"{request.tokens_per_s:.1f}" if request.tokens_per_s else "-", str(request.num_preemptions),
             str(request.num_cached_tokens))
    return cells + (spec_label(request),) if with_spec else cells


class SlotsTable(ScrollView, can_focus=True):
    """The requests of the last snapshot. Up/down move the cursor; enter or a click picks a request."""

    DEFAULT_CSS = "SlotsTable { height: 1fr; }"
    BINDINGS = [
        Binding("up", "move(-1)", "up", show=False), Binding("down", "move(1)", "down", show=False),
        Binding("pageup", "move(-10)", show=False), Binding("pagedown", "move(10)", show=False),
        Binding("home", "move(-1_000_000)", show=False), Binding("end", "move(1_000_000)", show=False),
        Binding("enter", "choose", "highlight blocks", show=False),
    ]

    class Chosen(Message):
        """The user picked the request `label` (enter or a click on its row)."""

        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.requests: tuple[RequestInfo, ...] = ()
        self.rows: list[tuple[str, ...]] = []  # formatted cells, one tuple per request
        self.cursor_row = 0
        self.selected_label: str | None = None  # drawn in yellow, like its blocks
        self.headers = HEADERS
        self._widths = [len(header) for header in HEADERS]
        self._base_style = Style()

    def on_mount(self) -> None:
        self._base_style = self.rich_style

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._base_style = self.rich_style

    def show(self, requests: tuple[RequestInfo, ...]) -> None:
        """Make the rows those of `requests`; the cursor stays on its request while that is there."""
        cursor_label = self.requests[self.cursor_row].label if self.cursor_row < len(self.requests) else None
        self.requests = requests
        with_spec = any(request.spec_mean_accepted_length for request in requests)
        self.headers = HEADERS + (SPEC_HEADER,) if with_spec else HEADERS
        self.rows = [row_cells(request, with_spec) for request in requests]
        self._widths = [max([len(header)] + [len(row[column]) for row in self.rows])
                        for column, header in enumerate(self.headers)]
        labels = [request.label for request in requests]
        self.cursor_row = labels.index(cursor_label) if cursor_label in labels else \
            min(self.cursor_row, max(0, len(requests) - 1))
        self.virtual_size = Size(sum(self._widths) + COLUMN_GAP * (len(self.headers) - 1) + 1, len(self.rows) + 1)
        self.refresh()

    def mark(self, label: str | None) -> None:
        """Draw request `label` as the one whose blocks the map highlights."""
        self.selected_label = label
        self.refresh()

    def action_move(self, rows: int) -> None:
        """Move the cursor by `rows`, keeping it in view."""
        if not self.rows:
            return
        self.cursor_row = max(0, min(len(self.rows) - 1, self.cursor_row + rows))
        visible_rows = max(1, self.scrollable_content_region.height - 1)  # less the header
        if self.cursor_row < self.scroll_y:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif self.cursor_row >= self.scroll_y + visible_rows:
            self.scroll_to(y=self.cursor_row - visible_rows + 1, animate=False)
        self.refresh()

    def action_choose(self) -> None:
        """Pick the request under the cursor."""
        if self.cursor_row < len(self.requests):
            self.post_message(self.Chosen(self.requests[self.cursor_row].label))

    def on_click(self, event: Click) -> None:
        row = event.y + int(self.scroll_y) - 1
        if 0 <= row < len(self.rows) and event.y >= 1:
            self.cursor_row = row
            self.action_choose()
            self.refresh()

    def _line(self, cells: tuple[str, ...], styles: list[Style]) -> list[Segment]:
        segments = []
        for column, (cell, style) in enumerate(zip(cells, styles)):
            width = self._widths[column]
            text = cell.rjust(width) if RIGHT_ALIGNED[column] else cell.ljust(width)
            gap = " " * (COLUMN_GAP if column else 1)
            segments += [Segment(gap, styles[0]), Segment(text, style)]
        return segments

    def render_line(self, y: int) -> Strip:
        base = self._base_style  # rich_style costs a style cascade per call, and this runs per line
        scroll_x, width = int(self.scroll_x), self.scrollable_content_region.width
        if y == 0:
            segments = self._line(self.headers, [base + Style(bold=True)] * len(self.headers))
        else:
            row = y - 1 + int(self.scroll_y)
            if row >= len(self.rows):
                return Strip.blank(width, base)
            request = self.requests[row]
            row_style = base
            if row == self.cursor_row:
                row_style = base + Style(bgcolor=CURSOR_COLOURS[self.has_focus])
            styles = [row_style] * len(self.headers)
            if request.label == self.selected_label:
                styles[0] = row_style + Style(color=SELECTED_COLOUR, bold=True)
            styles[1] = row_style + Style(color=STATE_COLOURS[request.state])
            if request.num_preemptions:
                styles[5] = row_style + Style(color=STATE_COLOURS["preempted"], bold=True)
            segments = self._line(self.rows[row], styles)
        strip = Strip(segments).extend_cell_length(scroll_x + width, segments[0].style if y else base)
        return strip.crop(scroll_x, scroll_x + width)
