"""localserve.tui: the terminal UI that follows a server's `/v1/monitor` feed (DESIGN.md section 8)."""

from localserve.tui.app import MonitorApp
from localserve.tui.client import monitor_url
from localserve.tui.server_log import LogBuffer

__all__ = ["LogBuffer", "MonitorApp", "monitor_url"]
