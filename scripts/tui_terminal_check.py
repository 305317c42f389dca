"""The TUI in a real terminal: tmux, a real server under load, screen updates counted from outside.

    python scripts/tui_terminal_check.py [--model PATH] [--num-kv-blocks 96] [--parallel 8] [--seconds 10]
                                         [--svg docs/tui.svg] [--svg-after 10]

Starts `localserve serve --no-tui` (the default model unless --model) with a small KV pool on a free
port, drives it with scripts/load.py, and runs `localserve tui` in a detached 160x48 tmux session.
It then reads the pane with `tmux capture-pane` every 20 ms for `--seconds` and counts how often its
text changed (screen updates per second), checks that a capture shows the block map and the slots
table, saves the last capture as text, and saves an SVG screenshot of the same screen taken by
Textual (a headless app on the same feed, under the same load). Everything it starts is stopped
before it returns; it takes about a minute plus the model's loading.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SESSION = "localserve-tui-check"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def capture() -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True,
                          check=True).stdout


def count_updates(seconds: float) -> tuple[int, str]:
    """How many times the pane's text changed in `seconds`, and its last text."""
    changes, last = 0, capture()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = capture()
        changes += now != last
        last = now
    return changes, last


async def save_svg(url: str, path: Path, seconds: float) -> None:
    from localserve.tui import MonitorApp, monitor_url

    app = MonitorApp(monitor_url(url, 0.2))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause(seconds)
        app.save_screenshot(filename=path.name, path=str(path.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model to serve (default: the default model)")
    parser.add_argument("--num-kv-blocks", type=int, default=96)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to count screen updates")
    parser.add_argument("--svg", type=Path, default=ROOT / "docs" / "tui.svg")
    parser.add_argument("--svg-after", type=float, default=10.0, help="seconds of feed before the screenshot")
    parser.add_argument("--capture", type=Path, default=ROOT / "scripts" / "out" / "tui_capture.txt")
    args = parser.parse_args()
    port = free_port()
    url = f"ws://127.0.0.1:{port}"
    localserve = [sys.executable, "-m", "localserve.cli"]
    serve = localserve + ["serve", "--no-tui", "--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks),
                          "-np", str(args.parallel), "--device", "cpu"] + (["-m", args.model] if args.model else [])
    args.capture.parent.mkdir(parents=True, exist_ok=True)
    server_log = args.capture.with_name("tui_check_server.log")
    with open(server_log, "w") as log_file:  # a file, not a pipe: a pipe nobody reads would block the server
        server = subprocess.Popen(serve, stderr=log_file, stdout=subprocess.DEVNULL)
    started = []
    try:
        deadline = time.monotonic() + 600
        while not re.search(r"serving .* on ws://", server_log.read_text()):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start listening; see {server_log}")
            time.sleep(0.5)
        print(f"server on {url}")
        load = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "load.py"), url,
                                 "--clients", str(args.parallel),
                                 "--duration", str(args.seconds + args.svg_after + 30)],
                                stdout=subprocess.PIPE, text=True)
        started.append(load)
        subprocess.run(["tmux", "new-session", "-d", "-s", SESSION, "-x", "160", "-y", "48",
                        " ".join(localserve + ["tui", url])], check=True)
        time.sleep(8)  # the TUI starts, the load builds up
        changes, last = count_updates(args.seconds)
        print(f"screen updates: {changes} in {args.seconds:g} s = {changes / args.seconds:.1f}/s")
        args.capture.write_text(last)
        shows_map = "KV blocks" in last and re.search(r"(?:[█▓░·▒] ?){20,}", last) is not None
        shows_slots = re.search(r"request\s+state\s+prompt\s+gen\s+tok/s", last) is not None
        print(f"capture ({args.capture}): block map {'shown' if shows_map else 'MISSING'}, "
              f"slots {'shown' if shows_slots else 'MISSING'}")
        asyncio.run(save_svg(url, args.svg, args.svg_after))
        print(f"screenshot: {args.svg}")
        return 0 if changes / args.seconds >= 4 and shows_map and shows_slots else 1
    finally:
        subprocess.run(["tmux", "kill-session", "-t", SESSION], capture_output=True)
        for process in started + [server]:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        if started:
            print(started[0].stdout.read())


if __name__ == "__main__":
    sys.exit(main())
