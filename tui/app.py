"""The TUI: a live view of a localserve server's KV pool, slots, trends and events.

`MonitorApp(url)` follows `/v1/monitor` at `url` in a worker and redraws on every snapshot. Without a
URL it draws only what it is handed through `show_hello` / `show_snapshot`, which is how the snapshot
tests build screens from fixed data.
"""

from __future__ import annotations

from collections import deque

from localserve.tui.block_map import BlockMap
from localserve.tui.client import (
    BadFrame,
    Connected,
    Disconnected,
    FeedItem,
    NoModelLoaded,
    SnapshotReceived,
    follow_monitor,
)
from localserve.tui.event_log import MAX_LINES, EventLog
from localserve.tui.feed import ModelSwitch, MonitorEvent, MonitorHello, MonitorSnapshot, RequestInfo
from localserve.tui.history import FeedHistory
from localserve.tui.panels import CapacityPanel, PressureBanner, StatusLine
from localserve.tui.server_log import LogBuffer, ServerLog
from localserve.tui.slots import SlotsTable
from localserve.tui.trends import Trends
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

NARROW_WIDTH = 120  # below this the capacity panel goes and the slots sit above the events

HELP_TEXT = """\
[b]localserve monitor[/b]

[b]q[/b]  quit (in [b]localserve serve[/b]: stop the server too)   [b]p[/b]  pause / resume   [b]?[/b]  this help
[b]↑ ↓[/b] move in the slots table, [b]enter[/b] highlights that request's blocks, [b]esc[/b] clears it

[b]Block map[/b]: one cell per KV block (16 tokens each), or per N blocks when the pool has more blocks
than the map has cells (its bottom border says N; a cell shows the state most of its blocks are in).
  [#585858]·[/] free   [#5f87d7]░[/] free, still holding a cached prefix (can be taken back)
  [#5faf5f]█[/] used by one sequence   [#d75fd7]▓[/] shared by several   [#d7875f]▒[/] swapped out to CPU memory
  [bold #ffff00]█ ▓[/] the selected request's own and shared blocks   [bold #00d7d7]▣[/] those holding image tokens

A red banner means the pool is full and requests are being preempted (evicted, then recomputed or
swapped back): their streams stall. Fewer slots (-np), a shorter context (-c) or a smaller KV format
(-ctk q8_0 -ctv q8_0) give each request more room.

[dim]esc, q or ? closes this help[/dim]"""


class HelpScreen(ModalScreen[None]):
    """The keys and what the colours mean."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: auto; max-width: 100%; height: auto; border: round $accent; padding: 1 2;
                          background: $surface; }
    """

    def compose(self) -> ComposeResult:
        yield Static(HELP_TEXT)


class MonitorApp(App[None]):
    """The live view of one server's monitor feed."""

    TITLE = "localserve"
    CSS = """
    #top { height: 3fr; }
    #bottom { height: 2fr; }
    #block-map, #side > *, #slots, #logs > * { border: round $primary-darken-1; border-title-color: $text; }
    #block-map { width: 1fr; height: 100%; }
    #side { width: 56; }
    #trends, #capacity { height: auto; }
    #slots { width: 3fr; height: 100%; }
    #logs { width: 2fr; height: 100%; }
    #events { height: 1fr; overflow-x: hidden; }
    #server-log { height: 1fr; }
    .-narrow #top { height: 1fr; }
    .-narrow #side { width: 32; }
    .-narrow #capacity { display: none; }
    .-narrow #bottom { layout: vertical; height: auto; }
    .-narrow #slots { width: 100%; height: 7; }
    .-narrow #logs { width: 100%; height: auto; }
    .-narrow #events, .-narrow #server-log { height: 5; }
    """
    ENABLE_COMMAND_PALETTE = False
    BINDINGS = [
        Binding("q", "quit", "quit"),
        # Ctrl-C stops a server, and the in-process TUI is one: quit rather than Textual's "press ctrl+q".
        Binding("ctrl+c", "quit", "quit", show=False, priority=True),
        Binding("p", "toggle_pause", "pause"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("escape", "clear_selection", "clear selection", show=False),
    ]

    def __init__(self, url: str | None = None, *, api_key: str | None = None, reconnect_delay_s: float = 0.5,
                 server_log: LogBuffer | None = None) -> None:
        """`url` as `client.monitor_url` returns it; None to draw only what `show_*` is handed.
        `server_log`: show these log records in a panel (a server running in this process)."""
        super().__init__()
        self.server_log = server_log
        self.feed_url = url
        self.api_key = api_key
        self.reconnect_delay_s = reconnect_delay_s
        self.history = FeedHistory()
        self.hello: MonitorHello | None = None
        self.switch: ModelSwitch | None = None  # the model on its way, as the latest frame said
        self.snapshot: MonitorSnapshot | None = None  # the one on screen
        self.connection = "connecting" if url else "no feed"
        self.paused = False
        self.num_missed_events = 0
        self.selected_label: str | None = None
        self._held: deque[MonitorEvent | int] = deque(maxlen=MAX_LINES)  # events (and missed counts) while paused
        self._latest: MonitorSnapshot | None = None

    def compose(self) -> ComposeResult:
        yield StatusLine(id="status")
        yield PressureBanner(id="pressure")
        with Horizontal(id="top"):
            yield BlockMap(id="block-map")
            with Vertical(id="side"):
                yield Trends(self.history, id="trends")
                yield CapacityPanel(id="capacity")
        with Horizontal(id="bottom"):
            yield SlotsTable(id="slots")
            with Vertical(id="logs"):
                yield EventLog(id="events")
                if self.server_log is not None:
                    yield ServerLog(id="server-log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(BlockMap).border_title = "KV blocks"
        self.query_one("#trends").border_title = f"Trends · last {self.history.window_s / 60:g} min"
        self.query_one("#capacity").border_title = "Capacity per KV format"
        self.query_one("#slots").border_title = "Slots"
        self.query_one("#events").border_title = "Events"
        if self.server_log is not None:
            self.query_one(ServerLog).border_title = "Server log"
            self.set_interval(0.2, self._show_server_log)
        self.screen.set_class(self.size.width < NARROW_WIDTH, "-narrow")
        self._show_status()
        if self.feed_url is not None:
            self.follow_feed()

    def _show_server_log(self) -> None:
        self.query_one(ServerLog).add_records(self.server_log.take())

    def on_resize(self) -> None:
        self.screen.set_class(self.size.width < NARROW_WIDTH, "-narrow")

    @work(exclusive=True, group="monitor-feed")
    async def follow_feed(self) -> None:
        """Read the feed for as long as the app runs, reconnecting when the server goes away."""
        async for item in follow_monitor(self.feed_url, api_key=self.api_key,
                                         reconnect_delay_s=self.reconnect_delay_s):
            self.handle_feed_item(item)

    def handle_feed_item(self, item: FeedItem) -> None:
        """Apply one item of the feed (see `client.follow_monitor`)."""
        if not self.is_running:  # shutting down: the worker may still hand over a frame after the widgets went
            return
        log = self.query_one(EventLog)
        match item:
            case Connected(hello):
                log.add_notice(f"connected to {self.feed_url}")
                self.show_hello(hello)
            case NoModelLoaded(no_model):
                if self.hello is not None:
                    log.add_notice(f"model {self.hello.model} unloaded")
                self.hello = None
                self.switch = no_model.switch
                self.connection = "live · no model loaded"
                self._show_status()
            case SnapshotReceived(snapshot):
                self.show_snapshot(snapshot)
            case BadFrame(error):
                log.add_notice(f"skipped a bad frame: {error}", "bold #ff5f5f")
            case Disconnected(reason, retry_in_s):
                if self.connection.startswith(("live", "connecting")):
                    log.add_notice(f"disconnected: {reason}", "#ff5f5f")
                self.connection = f"reconnecting in {retry_in_s:.1f} s ({reason})"
                self._show_status()

    def show_hello(self, hello: MonitorHello) -> None:
        """Start drawing the server (the model of the server) that sent `hello`."""
        if self.hello is not None and self.hello.model != hello.model:
            self.query_one(EventLog).add_notice(f"now showing model {hello.model}")
        self.hello = hello
        self.switch = None
        self.history.new_baseline()
        self.connection = "live"
        kv_format = hello.cache_type_k if hello.cache_type_k == hello.cache_type_v else \
            f"K {hello.cache_type_k} V {hello.cache_type_v}"
        self.query_one(BlockMap).border_title = (
            f"KV blocks · {hello.num_blocks:,}×{hello.block_size} tokens · {kv_format}")
        self.query_one(CapacityPanel).show(hello)
        self._show_status()

    def show_snapshot(self, snapshot: MonitorSnapshot) -> None:
        """Take in one snapshot: the trends always, the screen unless paused."""
        self.history.add(snapshot)
        self.switch = snapshot.switch
        self.num_missed_events += snapshot.missed_events
        self._latest = snapshot
        if self.paused:
            if snapshot.missed_events:
                self._held.append(snapshot.missed_events)
            self._held.extend(snapshot.events)
            return
        log = self.query_one(EventLog)
        if snapshot.missed_events:
            log.add_missed(snapshot.missed_events)
        log.add_events(snapshot.events)
        self._draw(snapshot)

    def _draw(self, snapshot: MonitorSnapshot) -> None:
        self.snapshot = snapshot
        self.query_one(SlotsTable).show(snapshot.requests)
        request = self._request(self.selected_label)
        self.selected_label = request.label if request else None
        self.query_one(BlockMap).show(snapshot.blocks, snapshot.cpu_blocks, self.selected_label,
                                      *self._blocks_of(request))
        self.query_one(SlotsTable).mark(self.selected_label)
        self.query_one(Trends).refresh()
        self.query_one(PressureBanner).show(self.history.pressure)
        gauges = self.snapshot.gauges
        slots = f"/{self.hello.max_num_seqs}" if self.hello else ""
        self.query_one("#slots").border_title = (
            f"Slots · {gauges.num_requests_running}{slots} running · {gauges.num_requests_waiting} waiting"
            + (f" · {gauges.num_requests_swapped} swapped" if gauges.num_requests_swapped else ""))
        if gauges.kv_groups:  # layer groups (window layers): the map holds their pools one after the other
            block_map = self.query_one(BlockMap)
            block_map.border_subtitle = " · ".join([*(group.describe() for group in gauges.kv_groups),
                                                    str(block_map.border_subtitle or "")])
        self.connection = f"live · step {snapshot.num_steps:,}"
        self._show_status()

    def _show_status(self) -> None:
        model = self.hello.model if self.hello else None
        self.query_one(StatusLine).show(self.feed_url or "fixed data", model, self.connection, self.paused,
                                        self.num_missed_events, self.switch.describe() if self.switch else None)

    def _request(self, label: str | None) -> RequestInfo | None:
        """The request `label` of the snapshot on screen, if it is there."""
        if self.snapshot is None or label is None:
            return None
        return next((request for request in self.snapshot.requests if request.label == label), None)

    def _blocks_of(self, request: RequestInfo | None) -> tuple[frozenset[int], frozenset[int]]:
        """The blocks of `request` (None: none), and those of them that hold image tokens."""
        if request is None:
            return frozenset(), frozenset()
        block_size = self.hello.block_size if self.hello else 1
        return request.block_ids, request.image_block_ids(block_size)

    def _select(self, label: str | None) -> None:
        request = self._request(label)
        self.selected_label = request.label if request else None
        self.query_one(BlockMap).select(self.selected_label, *self._blocks_of(request))
        self.query_one(SlotsTable).mark(self.selected_label)

    def on_slots_table_chosen(self, event: SlotsTable.Chosen) -> None:
        self._select(None if event.label == self.selected_label else event.label)

    def action_clear_selection(self) -> None:
        """Highlight no request's blocks."""
        self._select(None)

    def action_toggle_pause(self) -> None:
        """Freeze the screen (the feed is still read, trends still recorded) or bring it up to date."""
        self.paused = not self.paused
        if not self.paused:
            log = self.query_one(EventLog)
            for item in self._held:
                if isinstance(item, int):
                    log.add_missed(item)
                else:
                    log.add_events((item,))
            self._held.clear()
            if self._latest is not None:
                self._draw(self._latest)
        self._show_status()

    def action_help(self) -> None:
        """Show the keys and the colours."""
        self.push_screen(HelpScreen())
