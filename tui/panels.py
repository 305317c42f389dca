"""The small panels: the status line, the pressure warning and the KV capacity per format."""

from __future__ import annotations

from localserve.tui.feed import FormatCapacity, MonitorHello
from localserve.tui.history import Pressure
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static


class StatusLine(Static):
    """One line: the server, its model, whether the feed is live, reconnecting or paused, and the model
    on its way when the server switches models."""

    DEFAULT_CSS = "StatusLine { height: 1; background: $panel; }"

    def show(self, url: str, model: str | None, connection: str, paused: bool, num_missed: int,
             switch: str | None = None) -> None:
        """Redraw from the current connection state (`connection` is a short phrase such as 'live';
        `switch`: what the server's model switch is doing, if one is under way)."""
        live = connection.startswith("live")
        parts: list[str | tuple[str, str]] = [("localserve", "bold"), " │ ", model or "no model yet", " │ ", url,
                                              " │ ", ("● " if live else "○ ", "#5faf5f" if live else "#ff5f5f"),
                                              connection]
        if switch:
            parts += [" │ ", (f"⇄ {switch}", "bold #ffd700")]
        if num_missed:
            parts += [" │ ", (f"missed {num_missed} events", "#ffd700")]
        if paused:
            parts += [" │ ", ("❚❚ paused (p resumes)", "bold reverse")]
        self.update(Text.assemble(*parts, overflow="ellipsis", no_wrap=True))


class PressureBanner(Static):
    """Shown only while the pool is pinned and requests are being preempted."""

    DEFAULT_CSS = """
    PressureBanner { height: 1; background: $error; color: $text; text-style: bold; padding: 0 1; display: none; }
    """

    def show(self, pressure: Pressure | None) -> None:
        """Show the warning for `pressure`, or hide it when there is none."""
        self.display = pressure is not None
        if pressure is not None:
            self.update(f"⚠ KV pool {pressure.usage:.0%} full · {pressure.num_recent_preemptions} preemptions "
                        f"in {pressure.window_s:.0f} s: requests are recomputed (? help)")


def capacity_rows(hello: MonitorHello) -> list[tuple[FormatCapacity, bool]]:
    """Each format the server lists, and whether the pool uses it; the pool's own format first when the
    list leaves it out (bf16 on a CPU, K and V in different formats), read off the pool itself."""
    current = hello.cache_type_k if hello.cache_type_k == hello.cache_type_v else \
        f"K {hello.cache_type_k} V {hello.cache_type_v}"
    rows = [(entry, entry.format == current) for entry in hello.capacity]
    if not any(now for _, now in rows):
        num_tokens = hello.num_blocks * hello.block_size
        rows.insert(0, (FormatCapacity(current, hello.kv_cache_bytes // max(1, num_tokens), num_tokens), True))
    return rows


def capacity_table(hello: MonitorHello) -> Table:
    """Tokens, and sequences at full context, that the server's KV memory holds in each format."""
    table = Table(box=None, padding=(0, 1), expand=False, show_edge=False)
    table.add_column("format")
    table.add_column("B/token", justify="right")
    table.add_column("tokens", justify="right")
    table.add_column(f"seqs@{hello.max_model_len}", justify="right")
    table.add_column("")
    for entry, current in capacity_rows(hello):
        table.add_row(entry.format, f"{entry.bytes_per_token:,}", f"{entry.num_tokens:,}",
                      str(entry.num_tokens // hello.max_model_len), "◀ now" if current else "",
                      style="bold" if current else None)
    return table


class CapacityPanel(Static):
    """How much the KV memory holds in each format, and what this server runs with."""

    def show(self, hello: MonitorHello) -> None:
        """Redraw for the server that sent `hello`."""
        num_tokens = hello.num_blocks * hello.block_size
        summary = Text(f"now: K {hello.cache_type_k}, V {hello.cache_type_v}: {hello.num_blocks:,} blocks × "
                       f"{hello.block_size} = {num_tokens:,} tokens, {hello.kv_cache_bytes / 2**20:,.0f} MiB; "
                       f"{hello.max_num_seqs} slots, {hello.max_num_batched_tokens} tokens a step", style="dim")
        self.update(Group(capacity_table(hello), summary))

