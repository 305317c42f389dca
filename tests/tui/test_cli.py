"""`localserve tui` and `localserve serve` in a terminal (a pty): the screen comes up, `q` leaves."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.server import running_server
from tests.helpers.terminal import Terminal


def tui_env(tmp_path) -> dict[str, str]:
    return dict(os.environ, TERM="xterm-256color", COLUMNS="160", LINES="48", LOCALSERVE_CACHE=str(tmp_path))


def test_tui_command_imports_no_torch():
    code = ("import sys; from localserve.cli import build_parser; args = build_parser().parse_args(['tui']); "
            "import localserve.tui; assert args.func.__name__ == 'cmd_tui'; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tui_command_shows_a_running_server_and_quits_on_q(tiny_chat_llm, tmp_path):
    with running_server(tiny_chat_llm) as server:
        terminal = Terminal([sys.executable, "-m", "localserve.cli", "tui", f"127.0.0.1:{server.port}"],
                            tui_env(tmp_path))
        try:
            terminal.read_until("KV blocks · 256×16 tokens")
            terminal.read_until("live")
            terminal.type("q")
            assert terminal.wait() == 0
        finally:
            terminal.close()


def test_serve_in_a_terminal_shows_the_tui_with_its_log_and_stops_on_q(tiny_chat_model_dir, tmp_path):
    command = [sys.executable, "-m", "localserve.cli", "serve", "-m", str(tiny_chat_model_dir), "--device", "cpu",
               "--port", "0", "--num-kv-blocks", "64"]
    terminal = Terminal(command, tui_env(tmp_path))
    try:
        terminal.read_until("KV blocks · 64×16 tokens", timeout_s=120)
        terminal.read_until("Server log")
        terminal.read_until("serving")  # the server's own log line, inside the TUI's panel
        terminal.type("q")
        assert terminal.wait(60) == 0
    finally:
        terminal.close()
